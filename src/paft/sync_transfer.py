"""PAFT-Sync's transfer: one part of the state carried through flat, bucketed collectives.

A sync moves its two parts apart, the parameters with the optimizer state and the
buffers (see :mod:`paft.sync`), each as its :class:`~paft.sync_plan.SyncPlan` says.
:meth:`Transfer.launch` packs this rank's part and launches its collectives;
:meth:`Transfer.finish` waits for them, merges what they brought, measures how far
apart the replicas were and applies the result to the live tensors. A blocking
median's all-gathers run in :meth:`~Transfer.finish` instead, a bucket ahead of the
merge: every replica's whole state at once was world-size times the state.

Wire format: tensors are grouped by dtype (complex as real pairs, bool as uint8) into
one flat buffer per dtype, cut into buckets of at most ``bucket_mb``; ONE collective
per bucket, never one per tensor (:mod:`paft.flat`). ``bytes_sent`` counts the logical
payload this rank hands to the collectives it launched (all-reduce: the buffer;
all-gather: its own contribution; broadcast / send: the buffer on the source, 0 on
receivers), not the algorithm-dependent wire traffic. Per mode:

* ``majority-copy`` and ``finite-copy``: point-to-point from the copied rank when a
  single rank is to be repaired (the common case: the other majority ranks move
  nothing), else a broadcast, as ``broadcast`` always is;
* ``median`` and ``median-with-reference``: an all-gather of every rank's flat,
  merged per coordinate by :mod:`paft.robust` (with the reference's flat, at world
  size 2);
* ``mean``: a sum-all-reduce, to which a non-finite replica contributes -0.0 (which
  changes no bits of a sum), then a division by the number of finite replicas. Where
  the sum of finite replicas overflows (two float16 values near 40000), the coordinate
  takes a second sum instead, of each share scaled by ``1 / count`` first, so finite
  replicas stay finite. With a power-of-two count of finite replicas (2, 4, 8)
  sum-then-divide keeps the values they agree on exact; with 3 an agreed ``x`` becomes
  ``fl(fl(3x) / 3)``, which moves about one float32 value in five by one ulp
  (identically on every rank: replicas still end bitwise equal). float16 and bfloat16
  are summed and divided in float32 and rounded once, so their agreed values stay
  exact (and the measured divergence has no floor of one 16-bit ulp).

Every sync that moves parameters or optimizer state ends with one 8-byte all-reduce
(max) of their divergence, so all ranks report the same number (the buffers are not
measured: a replica whose buffers hold NaN/Inf of its own makes the divergence
``inf``, else they add nothing).

A rank whose state is not the result already copies the synced values into its live
tensors, or, where they changed since the launch (an overlapped sync), applies
``w <- synced + (w - snapshot)`` per coordinate (see
:meth:`paft.sync.ReplicaSync.finish`). Boolean tensors take the live value where it
changed and the synced one elsewhere (a sum of booleans is not a boolean); optimizer
state that holds no negative value (a second moment) takes the synced value where the
correction would make it negative.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from paft.collectives import max_over_ranks, start_gather_into
from paft.divergence import rel_distance
from paft.flat import Group, Layout, copy_all_, pack, ranges_in, storage_of, transport_view
from paft.norms import squared_norm_as_float, wide_dtype
from paft.robust import finite_where_outvoted_, median_of_three, replica_median, sound_where_it_can_tell_
from paft.sync_plan import COPY_MODES, SyncPlan
from paft.sync_reference import SyncReference

__all__ = [
    "Entry",
    "PartDone",
    "PartInFlight",
    "Transfer",
    "keep_as_reference",
    "pack_group",
]

Entry = tuple[str, Tensor, Tensor]
"""One state tensor: its name, its transport view (:func:`paft.flat.transport_view`)
and the live object."""


def pack_group(g: Group, entries: list[Entry], device: torch.device) -> Tensor:
    """``g``'s members of ``entries`` packed into a new flat on ``device``."""
    flat = torch.empty(g.numel, dtype=g.dtype, device=device)
    return pack(flat, [entries[i][1] for i in g.members])


def keep_as_reference(reference: SyncReference, layout: Layout, entries: list[Entry], device: torch.device) -> None:
    """Take ``entries`` as they are now as their reference: copied into the reference's
    own tensors where it holds them all (the usual case: a fresh copy of the state at
    every sync in agreement cost an allocation and its page faults), else packed anew
    (state it has not seen yet: optimizer state created since)."""
    named = [(n, t) for n, t, _ in entries]
    if reference.holds_all(named):
        reference.copy_in(named)
    else:
        reference.keep(layout, [pack_group(g, entries, device) for g in layout.groups])


@dataclass
class PartInFlight:
    """One part of a sync (the parameters and optimizer state, or the buffers) in flight."""

    plan: SyncPlan
    layout: Layout
    originals: list[Tensor]  # the live objects, for identity / version checks
    versions: list[int]
    opt_steps: int
    overlapped: bool
    snaps: list[Tensor | None]  # per dtype group: this rank's packed state
    bufs: list[Tensor | None]  # per dtype group: reduced / broadcast buffer
    gathered: list[list[Tensor] | None]  # per dtype group, per bucket: [ws, len]; None: gathered in finish
    works: list[Any]
    bytes_sent: int
    collectives: int


@dataclass
class PartDone:
    """A completed part: what the report says of it."""

    plan: SyncPlan
    divergence: float
    bytes_sent: int
    collectives: int
    delta_tensors: int


@dataclass
class _Distance:
    """The divergence's two sums over the parameters' ranges, in the order they are
    measured: this rank's squared distance to the centre and the centre's squared norm."""

    local_sq: float = 0.0
    ref_sq: float = 0.0

    def add(self, mine: Tensor, centre: Tensor) -> None:
        self.ref_sq += squared_norm_as_float(centre)
        self.local_sq += squared_norm_as_float(mine - centre)

    def relative(self) -> float:
        return rel_distance(self.local_sq, self.ref_sq)


def _non_negative(*tensors: Tensor) -> Tensor:
    """Whether every value of ``tensors`` is >= 0 (none NaN), as a 0-dim bool tensor
    on the first one's device (no host read on the critical path of a GPU's finish):
    state that holds no negative value anywhere, as a second moment never does. Judged
    by the values, so any optimizer state that holds none is kept from turning negative."""
    ok = torch.ones((), dtype=torch.bool, device=tensors[0].device)
    for t in tensors:
        ok &= (t >= 0).all().to(ok.device)
    return ok


def _divergence_from_flags(plan: SyncPlan, layout: Layout) -> float | None:
    """The divergence where the plan alone tells it, else None (it must be measured and
    exchanged). A no-op moves nothing; a non-finite replica, or a part without
    parameters (the buffers), needs no exchange: the finite flags, which every rank
    holds, say all there is."""
    if plan.mode == "noop":
        return 0.0
    if not all(plan.finite):
        return math.inf
    if not any(g.param_ranges for g in layout.groups):
        return 0.0
    return None


@dataclass(frozen=True)
class Transfer:
    """Launches and finishes the collectives of a sync's parts over ``group`` (this
    ``rank`` of ``world_size``), with flat buffers on ``device``."""

    group: dist.ProcessGroup | None
    rank: int
    world_size: int
    device: torch.device

    def launch(
        self,
        plan: SyncPlan,
        layout: Layout,
        entries: list[Entry],
        *,
        overlapped: bool,
        opt_steps: int,
        reference: SyncReference | None,
    ) -> PartInFlight:
        """Launch the collectives of one part (the parameters and optimizer state, or the
        buffers) as ``plan`` says. ``layout``: the entries' layout; ``overlapped``: the
        caller's next step may change the state before :meth:`finish`; ``opt_steps``:
        the optimizer steps so far; ``reference``: where one is kept, a no-op keeps the
        state agreed now for it."""
        rank, group = self.rank, self.group
        bytes_sent = collectives = 0
        snaps: list[Tensor | None] = []
        bufs: list[Tensor | None] = []
        gathered: list[list[Tensor] | None] = []
        works: list[Any] = []
        src_global = dist.get_global_rank(group, plan.src) if group is not None and plan.src >= 0 else plan.src
        for g in layout.groups:
            snap: Tensor | None = None
            buf: Tensor | None = None
            outs: list[Tensor] | None = []
            copy_mode = plan.mode in COPY_MODES or (plan.mode == "mean" and not g.floating)
            if plan.mode == "noop" or g.numel == 0:
                pass
            elif plan.mode in COPY_MODES and len(plan.minority) == 1:
                # One rank to repair (the common case): send it the source's state
                # point-to-point; the other majority members move nothing at all.
                (bad,) = plan.minority
                if rank == plan.src:
                    buf = snap = pack_group(g, entries, self.device)
                    dst = dist.get_global_rank(group, bad) if group is not None else bad
                    for k, (a, b) in enumerate(g.buckets):
                        works.append(dist.isend(buf[a:b], dst, group=group, tag=k))
                    bytes_sent += buf.numel() * buf.element_size()
                    collectives += len(g.buckets)
                elif rank == bad:
                    snap = pack_group(g, entries, self.device)
                    buf = torch.empty(g.numel, dtype=g.dtype, device=self.device)
                    for k, (a, b) in enumerate(g.buckets):
                        works.append(dist.irecv(buf[a:b], src_global, group=group, tag=k))
                    collectives += len(g.buckets)
            elif copy_mode:
                if rank == plan.src:
                    # The source's buffer is never overwritten: it is its own snapshot.
                    buf = snap = pack_group(g, entries, self.device)
                    bytes_sent += buf.numel() * buf.element_size()
                else:
                    # Majority members hold the result already and only receive; the
                    # others keep a snapshot for divergence and the overlapped delta.
                    if not plan.holds_result(rank):
                        snap = pack_group(g, entries, self.device)
                    buf = torch.empty(g.numel, dtype=g.dtype, device=self.device)
                for a, b in g.buckets:
                    works.append(dist.broadcast(buf[a:b], src_global, group=group, async_op=True))
                collectives += len(g.buckets)
            elif plan.mode == "mean":
                snap = pack_group(g, entries, self.device)
                # Sum, then divide (in finish): exact where the replicas agree for a
                # power-of-two count (n * x / n is x) and for the smallest subnormals
                # (halving first would round them to 0). A non-finite replica contributes
                # -0.0 (NaN * 0 would still be NaN), the one value whose sum with any x is x
                # bit for bit: a +0.0 turned the -0.0 the finite replicas held into +0.0.
                # Integer tensors are copied, never averaged (copy_mode above).
                wide = wide_dtype(g.dtype)
                buf = snap.to(wide, copy=True) if plan.finite[rank] else torch.full_like(snap, -0.0, dtype=wide)
                for a, b in g.buckets:
                    works.append(dist.all_reduce(buf[a:b], group=group, async_op=True))
                bytes_sent += buf.numel() * buf.element_size()
                collectives += len(g.buckets)
            else:  # median, median-with-reference
                snap = pack_group(g, entries, self.device)
                # Every replica's state at once is world-size times the state: only an
                # overlapped part gathers it all behind the next step; a blocking one
                # gathers in finish(), a bucket ahead of the merge.
                outs = [self._gather(snap, a, b, works) for a, b in g.buckets] if overlapped else None
                bytes_sent += snap.numel() * snap.element_size()
                collectives += len(g.buckets)
            snaps.append(snap)
            bufs.append(buf)
            gathered.append(outs)
        originals = [o for _, _, o in entries]
        # The next world-size-2 reference after a no-op is the state agreed NOW: by
        # finish() an overlapped step may have moved the two replicas apart.
        if plan.mode == "noop" and reference is not None:
            keep_as_reference(reference, layout, entries, self.device)
        return PartInFlight(
            plan=plan,
            layout=layout,
            originals=originals,
            versions=[o._version for o in originals],
            opt_steps=opt_steps,
            overlapped=overlapped,
            snaps=snaps,
            bufs=bufs,
            gathered=gathered,
            works=works,
            bytes_sent=bytes_sent,
            collectives=collectives,
        )

    def _gather(self, snap: Tensor, a: int, b: int, works: list[Any]) -> Tensor:
        """Every rank's ``snap[a:b]`` as the rows of a ``[world_size, b - a]`` tensor,
        once the all-gather appended to ``works`` completes."""
        out = torch.empty(self.world_size, b - a, dtype=snap.dtype, device=snap.device)
        works.append(start_gather_into(out, snap[a:b], self.group))
        return out

    def _rows(self, p: PartInFlight, gi: int) -> Iterator[Tensor]:
        """Group ``gi``'s gathered rows, bucket by bucket: those launched with the part,
        else gathered now, the next bucket in flight while the caller merges this one
        (world size times two buckets held, not world size times the state)."""
        ready = p.gathered[gi]
        if ready is not None:
            yield from ready
            return
        snap, buckets = p.snaps[gi], p.layout.groups[gi].buckets
        assert snap is not None
        works: list[Any] = []
        ahead = self._gather(snap, *buckets[0], works)
        for k in range(len(buckets)):
            rows, work = ahead, works[k]
            if k + 1 < len(buckets):
                ahead = self._gather(snap, *buckets[k + 1], works)
            work.wait()
            yield rows

    def finish(
        self,
        p: PartInFlight,
        state_changed: bool | None,
        *,
        live_entries: Callable[[], list[Entry]],
        opt_steps: int,
        reference: SyncReference | None,
    ) -> PartDone:
        """Wait for one part's collectives, merge, measure and apply them.

        ``state_changed``: as :meth:`paft.sync.ReplicaSync.finish` takes it;
        ``live_entries``: the state's entries as they are now (an overlapped part
        re-resolves its tensors by name); ``opt_steps``: the optimizer steps so far;
        ``reference``: where one is kept, the median's third opinion, and then replaced
        by the state just agreed."""
        plan, layout = p.plan, p.layout
        for w in p.works:
            w.wait()
        bytes_sent, collectives = p.bytes_sent, p.collectives

        # 1. The synced flats (identical on every rank) and this rank's distance to
        # the centre: the mean of the finite replicas (median modes: from the gather;
        # mean: the result), or the copied source (copy modes).
        synced: list[Tensor | None] = []
        distance = _Distance()
        me = self.rank
        # A replica holding NaN/Inf is infinitely far from the others, which every rank
        # knows from the plan: only a sync of finite replicas measures the distance.
        measure = plan.mode != "noop" and not plan.holds_result(me) and all(plan.finite)
        for gi, g in enumerate(layout.groups):
            snap, buf = p.snaps[gi], p.bufs[gi]
            if plan.mode == "noop" or g.numel == 0 or (buf is None and plan.holds_result(me)):
                synced.append(None)  # nothing moved, or a majority member left out of the copy
                continue
            if plan.mode in ("median", "median-with-reference"):
                synced.append(self._merge_median(p, gi, reference, distance if measure and g.floating else None))
                continue
            assert buf is not None
            if plan.mode == "mean" and g.floating:
                buf, summed_again = self._mean_from_sum(plan, g, snap, buf)
                if summed_again:
                    bytes_sent += buf.numel() * buf.element_size()
                    collectives += len(g.buckets)
            if measure and g.floating and snap is not None:
                for lo, hi in g.param_ranges:
                    distance.add(snap[lo:hi], buf[lo:hi])
            synced.append(buf.to(g.dtype))  # a float32 mean of 16-bit state, rounded once

        divergence = _divergence_from_flags(plan, layout)
        if divergence is None:
            # The max over ranks: one 8-byte all-reduce, so that every rank reports the
            # very same number (PAFT-Dyn takes its decisions from it on every rank).
            divergence = max_over_ranks(distance.relative() if measure else 0.0, self.group)
            bytes_sent, collectives = bytes_sent + 8, collectives + 1

        # 2. Apply: copy where the tensor is untouched since the snapshot, else the
        # correction synced + (w - snapshot).
        delta_tensors = 0
        if plan.mode != "noop" and not plan.holds_result(self.rank):
            delta_tensors = self._apply(p, synced, state_changed, live_entries, opt_steps)

        # 3. The reference for the next world-size-2 median: the state just agreed
        # (merged by name: each part replaces its own tensors' reference; a no-op's was
        # taken at launch).
        if reference is not None and plan.mode != "noop":
            reference.keep(layout, synced)
        return PartDone(plan, divergence, bytes_sent, collectives, delta_tensors)

    def _merge_median(
        self, p: PartInFlight, gi: int, reference: SyncReference | None, distance: _Distance | None
    ) -> Tensor:
        """Group ``gi``'s per-coordinate median of the gathered replicas (and, in
        ``median-with-reference``, the reference), bucket by bucket; where ``distance``
        is given, this rank's distance to the replicas' mean is added to it."""
        plan, g, me = p.plan, p.layout.groups[gi], self.rank
        good = [r for r in range(self.world_size) if plan.finite[r]]
        out_flat = torch.empty(g.numel, dtype=g.dtype, device=self.device)
        ref = None
        if plan.mode == "median-with-reference":
            assert reference is not None  # planned only where a reference is kept
            ref = reference.flat(g, plan.reference_ok)
        nan_free = all(plan.finite)  # then the NaN pass of the medians is skipped
        for (a, b), rows in zip(g.buckets, self._rows(p, gi)):
            if ref is not None:
                median_of_three(rows[0], rows[1], ref[a:b], out=out_flat[a:b], nan_free=nan_free)
                if len(good) == 1 and g.floating:
                    sound_where_it_can_tell_(out_flat[a:b], rows[good[0]], rows[1 - good[0]])
            else:
                merged = replica_median(rows, out=out_flat[a:b], nan_free=nan_free)
                if not nan_free:
                    finite_where_outvoted_(merged, rows, good)
            if distance is None:
                continue
            for lo, hi in ranges_in(g.param_ranges, a, b):
                rows_in_range = rows[:, lo:hi].to(wide_dtype(g.dtype))
                distance.add(rows_in_range[me], rows_in_range.mean(0))
        return out_flat

    def _mean_from_sum(self, plan: SyncPlan, g: Group, snap: Tensor | None, buf: Tensor) -> tuple[Tensor, bool]:
        """The finite replicas' mean from ``buf``, their sum (divided in place), and
        whether the overflowed coordinates took a second sum-all-reduce."""
        buf.div_(plan.count)
        overflowed = ~torch.isfinite(buf)
        if not bool(overflowed.any()):
            return buf, False
        # Finite replicas whose sum overflowed (40000 + 40992 in float16): sum again
        # with each share scaled first, and take that where the plain sum overflowed.
        # The all-reduce left the same result on every rank, so every rank takes this
        # branch alike.
        assert snap is not None
        scaled = snap.to(buf.dtype) * (1.0 / plan.count) if plan.finite[self.rank] else torch.zeros_like(buf)
        for a, b in g.buckets:
            dist.all_reduce(scaled[a:b], group=self.group)
        return torch.where(overflowed, scaled, buf), True

    def _apply(
        self,
        p: PartInFlight,
        synced: list[Tensor | None],
        state_changed: bool | None,
        live_entries: Callable[[], list[Entry]],
        opt_steps: int,
    ) -> int:
        """Write ``synced`` into the live state; how many tensors took the correction."""
        plan, layout = p.plan, p.layout
        if p.overlapped:
            # Re-resolve by name: the optimizer may have replaced a state tensor.
            now = {n: (t, o) for n, t, o in live_entries()}
        # A non-finite replica's own progress is garbage: it just takes the result.
        garbage = not plan.finite[self.rank]
        stepped = opt_steps != p.opt_steps
        delta_tensors = 0
        copy_dst: list[Tensor] = []
        copy_src: list[Tensor] = []
        # Tensors over one memory, partly overlapping (a Parameter over a view of another):
        # each correction reads the progress through its own view, so all are computed
        # before any is written; the overlap's synced values agree, so either write is right.
        storages = Counter(storage_of(o) for o in p.originals)
        shared = {k for k, n in storages.items() if k is not None and n > 1}
        later: list[tuple[Tensor, Tensor]] = []
        with torch.no_grad():
            for gi, g in enumerate(layout.groups):
                flat, snap = synced[gi], p.snaps[gi]
                if flat is None:
                    continue
                for s, i in zip(g.slots, g.members):
                    orig = p.originals[i]
                    if p.overlapped:
                        cur = now.get(s.name)
                        if cur is None or cur[0].dtype != g.dtype or tuple(cur[0].shape) != s.shape:
                            continue  # gone or reshaped meanwhile: nothing sensible to write
                        target, live = cur
                    else:
                        target, live = transport_view(orig), orig
                    new = flat[s.offset : s.offset + s.numel].view(s.shape)
                    if garbage or snap is None or not p.overlapped:
                        changed = False
                    elif state_changed is not None:
                        changed = state_changed
                    else:
                        changed = live is not orig or live._version != p.versions[i] or stepped
                    if not changed:
                        copy_dst.append(target)
                        copy_src.append(new)
                        continue
                    assert snap is not None  # changed is False without a snapshot (above)
                    delta_tensors += 1
                    old = snap[s.offset : s.offset + s.numel].view(s.shape)
                    if live.dtype == torch.bool:  # flags: the live value where it changed
                        value = torch.where(target != old.to(target.device), target, new.to(target.device))
                    else:
                        old = old.to(target.device)
                        res = new.to(target.device) + (target - old)
                        # Untouched coordinates (a mask's -inf too) get the synced bits
                        # exactly. A result the sum alone made non-finite (an overflow)
                        # falls back to them; one whose live value went NaN/Inf in the
                        # window stays so, as on the ranks that hold the result and apply
                        # nothing: where it went so on every rank (DDP's shared gradient),
                        # every rank ends alike.
                        keep = target == old
                        if res.is_floating_point():
                            keep |= ~torch.isfinite(res) & torch.isfinite(target)
                            if s.name.startswith("optim/"):
                                # A second moment (Adam's exp_avg_sq, Adagrad's sum) decays
                                # in proportion to itself: a replica that held a huge value
                                # took a step down that, added to a small synced value, made
                                # it negative, and the next step's square root NaN. Where the
                                # sum alone turns it negative, the synced value stands.
                                keep |= (res < 0) & _non_negative(new, old, target).to(res.device)
                        value = torch.where(keep, new.to(target.device), res)
                    if shared and storage_of(target) in shared:
                        later.append((target, value))
                    else:
                        target.copy_(value)
            copy_all_(copy_dst, copy_src)
            for a, b in later:  # after the copies: a correction wins over a plain copy
                a.copy_(b)
        return delta_tensors
