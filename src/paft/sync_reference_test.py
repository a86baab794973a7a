"""Tests for paft.sync_reference: the world-size-2 reference kept, merged, packed and
checkpointed in one process (sync_test.py runs it end to end on real ranks)."""

from __future__ import annotations

import torch
from torch import Tensor

from paft.flat import Layout, build_layout, structure_key, transport_view
from paft.sync_reference import SyncReference
from paft.sync_transfer import Entry, keep_as_reference, pack_group

CPU = torch.device("cpu")


def _entries(named: dict[str, Tensor]) -> list[Entry]:
    return [(n, transport_view(t), t) for n, t in named.items()]


def _layout(named: dict[str, Tensor]) -> Layout:
    pairs = list(named.items())
    return build_layout(structure_key(pairs), pairs, 1 << 20)


def _reference(named: dict[str, Tensor]) -> SyncReference:
    layout, entries = _layout(named), _entries(named)
    return SyncReference(layout, [pack_group(g, entries, CPU) for g in layout.groups], CPU)


def _keep(ref: SyncReference, named: dict[str, Tensor]) -> None:
    keep_as_reference(ref, _layout(named), _entries(named), CPU)


def _flat(ref: SyncReference, named: dict[str, Tensor]) -> list[Tensor]:
    return [ref.flat(g, True) for g in _layout(named).groups]


def test_a_part_kept_replaces_only_its_own_tensors_reference() -> None:
    ref = _reference({"param/w": torch.tensor([1.0, 2.0]), "buffer/b": torch.tensor([3.0])})
    _keep(ref, {"param/w": torch.tensor([5.0, 6.0]), "opt/m": torch.tensor([7.0])})  # no buffers here
    assert {n: t.tolist() for n, t in ref.tensors.items()} == {
        "param/w": [5.0, 6.0], "buffer/b": [3.0], "opt/m": [7.0]}


def test_held_tensors_are_copied_in_place_and_state_seen_first_is_packed_anew() -> None:
    ref = _reference({"param/w": torch.tensor([1.0, 2.0])})
    where = ref.tensors["param/w"].data_ptr()
    _keep(ref, {"param/w": torch.tensor([3.0, 4.0])})
    assert ref.tensors["param/w"].tolist() == [3.0, 4.0] and ref.tensors["param/w"].data_ptr() == where
    # Optimizer state created since, beside a tensor already held: not all held, so packed anew.
    _keep(ref, {"param/w": torch.tensor([5.0, 6.0]), "opt/m": torch.tensor([7.0])})
    assert {n: t.tolist() for n, t in ref.tensors.items()} == {"param/w": [5.0, 6.0], "opt/m": [7.0]}


def test_a_model_cast_alike_on_both_ranks_keeps_its_new_dtype_as_reference() -> None:
    ref = _reference({"param/w": torch.tensor([1.0, 2.0])})
    cast = {"param/w": torch.tensor([3.0, 4.0], dtype=torch.float64)}
    # Before it is kept, the float32 reference is no reference for float64 state: zeros.
    assert [f.tolist() for f in _flat(ref, cast)] == [[0.0, 0.0]]
    _keep(ref, cast)  # not copied into the float32 tensor (then packed as zeros): kept anew
    assert ref.tensors["param/w"].dtype == torch.float64
    assert [(f.dtype, f.tolist()) for f in _flat(ref, cast)] == [(torch.float64, [3.0, 4.0])]


def test_the_flat_holds_zeros_where_the_shape_differs_or_the_tags_disagree() -> None:
    ref = _reference({"param/w": torch.arange(6.0).reshape(2, 3), "param/v": torch.tensor([1.0])})
    same = {"param/w": torch.zeros(2, 3), "param/v": torch.zeros(1)}
    assert [f.tolist() for f in _flat(ref, same)] == [[0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 1.0]]
    # The same numel in another shape is another tensor: no reference for it.
    transposed = {"param/w": torch.zeros(3, 2), "param/v": torch.zeros(1)}
    assert [f.tolist() for f in _flat(ref, transposed)] == [[0.0] * 6 + [1.0]]
    assert [ref.flat(g, False).tolist() for g in _layout(same).groups] == [[0.0] * 7]  # tags disagree
    # A weight resized alike on both ranks (a vocabulary grown): kept anew, not copied into.
    _keep(ref, {"param/w": torch.ones(4), "param/v": torch.tensor([2.0])})
    assert ref.tensors["param/w"].tolist() == [1.0] * 4 and ref.tensors["param/v"].tolist() == [2.0]


def test_a_checkpoint_is_a_copy_and_a_loaded_reference_is_tagged_by_its_bytes() -> None:
    ref = _reference({"param/w": torch.tensor([1.0, 2.0])})
    saved = ref.state_dict()
    _keep(ref, {"param/w": torch.tensor([3.0, 4.0])})  # copied in place: the checkpoint must not move
    assert saved["param/w"].tolist() == [1.0, 2.0]
    a, b = _reference({"param/w": torch.zeros(2)}), _reference({"param/w": torch.zeros(2)})
    a.load_state_dict(saved)
    b.load_state_dict({"param/w": torch.tensor([1.0, 2.5])})  # another checkpoint: another tag
    assert a.tag != b.tag and a.tag == _reference({"param/w": torch.tensor([1.0, 2.0])}).tag
    b.load_state_dict(saved)
    assert a.tag == b.tag and b.tensors["param/w"].tolist() == [1.0, 2.0]


def test_the_agreed_tag_depends_on_the_tag_before() -> None:
    # References that disagreed before an agreement still disagree after it: the new tag
    # must mix the old one, not only the agreed state's fingerprint.
    a, b = _reference({"param/w": torch.tensor([1.0])}), _reference({"param/w": torch.tensor([2.0])})
    a.agreed_on(7)
    b.agreed_on(7)
    assert a.tag != b.tag
