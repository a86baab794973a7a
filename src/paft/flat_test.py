"""Tests for paft.flat: the layout of a sync's flat buffers, and its small helpers.
Pure logic, one process (sync_test.py carries layouts through real collectives)."""

from __future__ import annotations

import pytest
import torch

from paft.flat import (
    build_layout,
    consecutive_runs,
    copy_all_,
    pack,
    ranges_in,
    storage_of,
    structure_key,
    transport_view,
)


def test_layout_groups_by_dtype_cuts_byte_buckets_and_joins_adjacent_parameters() -> None:
    entries = [
        ("param/a", torch.zeros(3)),
        ("param/b", torch.zeros(2, 2)),
        ("optim/0/step", torch.zeros((), dtype=torch.int64)),
        ("buffer/m", torch.zeros(2)),
        ("param/empty", torch.zeros(0)),
        ("param/c", torch.zeros(1)),
    ]
    layout = build_layout(structure_key(entries), entries, bucket_bytes=16)
    floats, ints = layout.groups
    assert (floats.dtype, floats.floating, ints.dtype, ints.floating) == (torch.float32, True, torch.int64, False)
    assert [(s.name, s.offset, s.numel, s.shape) for s in floats.slots] == [
        ("param/a", 0, 3, (3,)), ("param/b", 3, 4, (2, 2)), ("buffer/m", 7, 2, (2,)),
        ("param/empty", 9, 0, (0,)), ("param/c", 9, 1, (1,)),
    ]
    assert (floats.members, ints.members) == ([0, 1, 3, 4, 5], [2])
    assert floats.param_ranges == [(0, 7), (9, 10)]  # the buffer between them splits the range
    assert (floats.numel, floats.buckets) == (10, [(0, 4), (4, 8), (8, 10)])  # 16 bytes: 4 float32
    assert (ints.numel, ints.buckets, ints.param_ranges) == (1, [(0, 1)], [])
    assert build_layout(layout.key, entries, bucket_bytes=1).groups[0].buckets[:2] == [(0, 1), (1, 2)]
    assert layout.digest != 0
    assert layout.digest == build_layout(structure_key(entries), entries, 16).digest
    reshaped = [(n, t.reshape(-1)) if n == "param/b" else (n, t) for n, t in entries]
    assert build_layout(structure_key(reshaped), reshaped, 16).digest != layout.digest


def test_buckets_count_the_dtypes_own_bytes_and_empty_parameters_have_no_range() -> None:
    """Each dtype's buckets hold bucket_bytes of its own elements (8 per 64 bytes of
    float64, 32 of float16); an empty parameter adds no (zero-length) parameter range,
    which would make a group without parameters look like one that has some."""
    entries = [
        ("param/w", torch.zeros(20, dtype=torch.float64)),
        ("param/h", torch.zeros(40, dtype=torch.float16)),
        ("buffer/mask", torch.zeros(3, dtype=torch.uint8)),  # a bool buffer's transport view
        ("param/empty", torch.zeros(0, dtype=torch.uint8)),
    ]
    wide, half, small = build_layout(structure_key(entries), entries, bucket_bytes=64).groups
    assert (wide.dtype, wide.floating, wide.buckets) == (torch.float64, True, [(0, 8), (8, 16), (16, 20)])
    assert (half.dtype, half.floating, half.buckets) == (torch.float16, True, [(0, 32), (32, 40)])
    assert (small.dtype, small.floating, small.buckets, small.param_ranges) == (torch.uint8, False, [(0, 3)], [])
    only_empty = [("param/empty", torch.zeros(0))]
    assert build_layout(structure_key(only_empty), only_empty, 64).groups[0].param_ranges == []


def test_structure_key_names_dtypes_and_shapes() -> None:
    a = [("param/w", torch.zeros(2, 3))]
    assert structure_key(a) == (("param/w", torch.float32, (2, 3)),)
    for other in ([("param/v", torch.zeros(2, 3))], [("param/w", torch.zeros(3, 2))],
                  [("param/w", torch.zeros(2, 3, dtype=torch.float64))]):
        assert structure_key(other) != structure_key(a)


def test_ranges_in_clips_and_rebases() -> None:
    ranges = [(0, 3), (5, 9), (12, 14)]
    assert ranges_in(ranges, 2, 13) == [(0, 1), (3, 7), (10, 11)]
    assert ranges_in(ranges, 3, 5) == []  # touching ends are empty, not zero-length ranges
    assert ranges_in(ranges, 0, 20) == ranges


def test_transport_views_carry_complex_and_bool() -> None:
    z = torch.tensor([1 + 2j, 3 - 4j])
    view = transport_view(z)
    assert view.dtype == torch.float32 and torch.equal(view, torch.tensor([[1.0, 2.0], [3.0, -4.0]]))
    view[0, 1] = 5.0
    assert torch.equal(z, torch.tensor([1 + 5j, 3 - 4j]))
    lazy = z.conj()  # its memory is z's: the view carries that memory, and writes land in it
    view = transport_view(lazy)
    assert torch.equal(view, torch.tensor([[1.0, 5.0], [3.0, -4.0]]))
    view[1, 0] = 7.0
    assert torch.equal(lazy, torch.tensor([1 - 5j, 7 + 4j]))
    mask = torch.tensor([True, False])
    view = transport_view(mask)
    assert view.dtype == torch.uint8
    view[1] = 1  # what a received copy writes lands in the mask itself
    assert torch.equal(mask, torch.tensor([True, True]))
    w = torch.zeros(2, requires_grad=True)
    assert not transport_view(w).requires_grad


def test_copy_all_copies_each_pair_into_its_destination() -> None:
    dst, src = [torch.zeros(2), torch.zeros((), dtype=torch.int64)], [torch.tensor([1.0, 2.0]), torch.tensor(7)]
    copy_all_(dst, src)
    assert all(torch.equal(d, s) for d, s in zip(dst, src))
    assert torch.equal(src[0], torch.tensor([1.0, 2.0]))


def test_pack_and_storage_of() -> None:
    flat = torch.empty(5)
    assert torch.equal(pack(flat, [torch.tensor([1.0, 2.0]), torch.tensor([[3.0], [4.0], [5.0]])]),
                       torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert pack(flat, []) is flat
    base = torch.zeros(4)
    assert storage_of(base[2:]) == storage_of(base) == (base.device, base.untyped_storage().data_ptr())
    assert storage_of(torch.zeros(0)) is None
    assert storage_of(torch.zeros(2, 2).to_sparse()) is None


def test_copy_all_batches_per_device_and_dtypes(monkeypatch: pytest.MonkeyPatch) -> None:
    # CUDA's batched copy takes one device and one dtype per list: a list mixing them
    # (an int64 buffer among float32 tensors) went down a copy per tensor. A source's
    # dtype counts too: a float64 source into a float32 destination is a batch of its own.
    dst = [torch.zeros(3), torch.zeros(2, dtype=torch.int64), torch.zeros(4), torch.zeros(1, dtype=torch.float64),
           torch.zeros(2)]
    src = [torch.ones(3), torch.full((2,), 7), torch.full((4,), 2.0), torch.full((1,), 0.5, dtype=torch.float64),
           torch.full((2,), 0.25, dtype=torch.float64)]
    batches: list[int] = []
    real = torch._foreach_copy_

    def counted(ds: list[torch.Tensor], ss: list[torch.Tensor]) -> None:
        assert len({(d.device, d.dtype) for d in ds}) == len({s.dtype for s in ss}) == 1
        batches.append(len(ds))
        real(ds, ss)

    monkeypatch.setattr(torch, "_foreach_copy_", counted)
    copy_all_(dst, src)
    assert sorted(batches) == [1, 1, 1, 2]
    assert all(torch.equal(d, s.to(d.dtype)) for d, s in zip(dst, src))


def test_tensors_off_the_flats_device_are_copied_in_their_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """Adam's CPU step counters beside CUDA state: ``pack`` joins each run of tensors on
    the flat's device with one ``cat`` into its own slice, and copies a tensor from
    another device straight into its place; ``copy_all_`` copies a pair across devices
    by itself. No GPU here: the meta device is the flat's, the CPU the other."""
    cats: list[tuple[int, int]] = []
    crossed: list[tuple[str, str]] = []
    real_cat, real_copy = torch.cat, torch.Tensor.copy_

    def cat(tensors: list[torch.Tensor], *, out: torch.Tensor) -> torch.Tensor:
        cats.append((out.storage_offset(), out.numel()))
        return out if out.is_meta else real_cat(tensors, out=out)  # meta's cat costs seconds to load

    def copy(self: torch.Tensor, src: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
        if self.device != src.device:
            crossed.append((self.device.type, src.device.type))
        return real_copy(self, src, non_blocking)

    monkeypatch.setattr(torch, "cat", cat)
    monkeypatch.setattr(torch.Tensor, "copy_", copy)
    pack(torch.empty(3), [torch.ones(1), torch.ones(2)])
    assert cats == [(0, 3)]  # one device: one cat, no copy per tensor
    cats.clear()
    meta = torch.device("meta")
    pack(torch.empty(6, device=meta), [torch.ones(2, device=meta), torch.ones(1), torch.ones(3, device=meta)])
    assert (cats, crossed) == ([(0, 2), (3, 3)], [("meta", "cpu")])
    crossed.clear()
    dst = [torch.zeros(2, device=meta), torch.zeros(1)]
    copy_all_(dst, [torch.ones(2), torch.ones(1)])
    assert crossed == [("meta", "cpu")] and dst[1].item() == 1.0


def test_consecutive_runs_close_before_the_cap_and_a_larger_size_goes_alone() -> None:
    """The bound on the copies held at a time (a divergence's float64 buckets, the update
    ratio's differences): an empty size joins the run before it."""
    assert consecutive_runs([3, 3, 1, 10, 2, 0], 6) == [(0, 2), (2, 3), (3, 4), (4, 6)]
    assert consecutive_runs([0], 1) == [(0, 1)] and consecutive_runs([], 6) == []
