"""The wire format of a sync: named state tensors laid out in flat, bucketed buffers.

Tensors are grouped by dtype (complex as real pairs, bool as uint8: what collectives
carry), one flat buffer per dtype, cut into buckets of at most a given number of
bytes, so a sync launches ONE collective per bucket, never one per tensor. A
:class:`Layout` says where each named tensor lives; it depends only on the names,
dtypes and shapes, so ranks with the same state structure build the same one, and its
digest tells them whether they do.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from paft.fingerprint import repr_digest

__all__ = [
    "Slot",
    "Group",
    "Layout",
    "build_layout",
    "consecutive_runs",
    "copy_all_",
    "pack",
    "ranges_in",
    "storage_of",
    "structure_key",
    "transport_view",
]


def transport_view(t: Tensor) -> Tensor:
    """A view of ``t`` (same storage) in a dtype collectives can carry."""
    t = t.detach()
    if t.is_complex():
        # A lazy conjugate (is_conj) stores conj(values): carry that memory, read alike on
        # every rank, so that a write still lands in t (resolve_conj would copy).
        return torch.view_as_real(t.conj() if t.is_conj() else t)
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    return t


@dataclass
class Slot:
    """Where one named tensor lives in its dtype group's flat: ``numel`` elements from
    ``offset``, viewed back as ``shape``."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]


@dataclass
class Group:
    """The tensors of one dtype, back to back in one flat of ``numel`` elements."""

    dtype: torch.dtype
    floating: bool
    numel: int = 0
    slots: list[Slot] = field(default_factory=list)
    members: list[int] = field(default_factory=list)  # entry index of each slot
    buckets: list[tuple[int, int]] = field(default_factory=list)
    """``[start, end)`` element ranges of the flat, one collective each."""
    param_ranges: list[tuple[int, int]] = field(default_factory=list)
    """``[start, end)`` element ranges the parameters (``param/``) fill, adjacent ones
    joined: what a sync measures the parameters' divergence over."""


@dataclass
class Layout:
    """Where each named tensor of a state lives: one :class:`Group` per dtype."""

    key: tuple[Any, ...]
    groups: list[Group]
    digest: int = 0
    """A hash of ``key`` (names, dtypes, shapes) that is equal on two ranks exactly
    when their states have the same structure (up to 64-bit collisions)."""


def structure_key(entries: Iterable[tuple[str, Tensor]]) -> tuple[Any, ...]:
    """What two ranks' states must share to line up value by value: every tensor's
    name, dtype and shape, in order (a :class:`Layout`'s key)."""
    return tuple((n, t.dtype, tuple(t.shape)) for n, t in entries)


def build_layout(key: tuple[Any, ...], entries: list[tuple[str, Tensor]], bucket_bytes: int) -> Layout:
    """The layout of ``entries`` (whose :func:`structure_key` is ``key``): a group per
    dtype in order of first appearance, cut into buckets of at most ``bucket_bytes``."""
    by_dtype: dict[torch.dtype, Group] = {}
    for i, (name, t) in enumerate(entries):
        g = by_dtype.get(t.dtype)
        if g is None:
            g = by_dtype[t.dtype] = Group(t.dtype, t.is_floating_point())
        slot = Slot(name, g.numel, t.numel(), tuple(t.shape))
        g.slots.append(slot)
        g.members.append(i)
        if name.startswith("param/") and t.numel():
            if g.param_ranges and g.param_ranges[-1][1] == slot.offset:
                g.param_ranges[-1] = (g.param_ranges[-1][0], slot.offset + slot.numel)
            else:
                g.param_ranges.append((slot.offset, slot.offset + slot.numel))
        g.numel += slot.numel
    for g in by_dtype.values():
        cap = max(1, bucket_bytes // torch.empty((), dtype=g.dtype).element_size())
        g.buckets = [(a, min(a + cap, g.numel)) for a in range(0, g.numel, cap)]
    return Layout(key, list(by_dtype.values()), repr_digest(key))


def pack(flat: Tensor, tensors: list[Tensor]) -> Tensor:
    """Copy ``tensors`` back to back into ``flat``: one ``cat`` per run of tensors on
    ``flat``'s device, and a copy straight into its place for each tensor on another
    (Adam's CPU step counters beside CUDA state; every tensor of a CUDA model synced
    through gloo's CPU buffers), so nothing is copied twice."""
    o = start = 0
    run: list[Tensor] = []
    for t in tensors:
        n = t.numel()
        if t.device == flat.device:
            run.append(t.reshape(-1))
        else:
            if run:
                torch.cat(run, out=flat[start:o])
                run = []
            flat[o : o + n].copy_(t.reshape(-1))
            start = o + n
        o += n
    if run:
        torch.cat(run, out=flat[start:o])
    return flat


def copy_all_(dst: list[Tensor], src: list[Tensor]) -> None:
    """``d.copy_(s)`` for each pair: one batched ``_foreach_copy_`` per device and dtypes
    (CUDA's batched kernel takes a list on one device in one dtype; one pair off it sent
    the whole list down a copy each), a copy each for the pairs across devices (Adam's
    step counters on the CPU beside CUDA parameters)."""
    batches: dict[tuple[torch.device, torch.dtype, torch.dtype], tuple[list[Tensor], list[Tensor]]] = {}
    for d, s in zip(dst, src):
        if d.device == s.device:
            ds, ss = batches.setdefault((d.device, d.dtype, s.dtype), ([], []))
            ds.append(d)
            ss.append(s)
        else:
            d.copy_(s)
    for ds, ss in batches.values():
        torch._foreach_copy_(ds, ss)


def ranges_in(ranges: list[tuple[int, int]], a: int, b: int) -> list[tuple[int, int]]:
    """The parts of ``ranges`` inside ``[a, b)``, relative to ``a``."""
    out = []
    for p0, p1 in ranges:
        lo, hi = max(a, p0), min(b, p1)
        if lo < hi:
            out.append((lo - a, hi - a))
    return out


def consecutive_runs(sizes: Sequence[int], cap: int) -> list[tuple[int, int]]:
    """The indices of ``sizes`` cut into consecutive runs ``[i, j)`` of at most ``cap`` in
    all: a run closes before it would pass the cap, a size above the cap makes a run of
    its own, a zero joins the run before it. What bounds the copies a loop over the runs
    holds at a time."""
    runs: list[tuple[int, int]] = []
    start = total = 0
    for k, n in enumerate(sizes):
        if k > start and total + n > cap:
            runs.append((start, k))
            start, total = k, 0
        total += n
    if start < len(sizes):
        runs.append((start, len(sizes)))
    return runs


def storage_of(t: Tensor) -> tuple[torch.device, int] | None:
    """Which memory ``t`` lives in (None for tensors without one: empty, sparse)."""
    if t.layout != torch.strided or not t.numel():
        return None
    return t.device, t.untyped_storage().data_ptr()
