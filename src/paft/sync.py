"""PAFT-Sync: re-synchronize parameters, buffers and optimizer state across replicas.

When the gradient all-reduce is silently corrupted on some rank, that rank applies a
different update and the replicas drift apart; nothing in DDP ever brings them back.
:class:`ReplicaSync` brings every replica back to one bitwise identical state --
parameters, buffers (BatchNorm running stats, integer counters) AND optimizer state
(momentum, ``exp_avg``, ``exp_avg_sq``, Adam's ``step``) -- with flat, bucketed
collectives, blocking (:meth:`ReplicaSync.sync`) or overlapped with the next step's
forward/backward (:meth:`ReplicaSync.start` / :meth:`ReplicaSync.finish`).

Every sync begins with ONE small control collective: each rank contributes two state
fingerprints (:func:`paft.fingerprint.fingerprint`), one of its parameters and optimizer
state and one of its buffers, a hash of its state's structure (names, dtypes, shapes)
and, where a reference is kept, the reference's tag (24 or 32 bytes). Ranks whose
structures differ cannot be merged value by value: every rank raises
``RuntimeError`` (instead of launching collectives of mismatched sizes). If all
fingerprints agree the sync is a no-op in every mode -- the replicas already are
what a sync produces (a mean of identical values could even change their last
bit) -- and the cheap common case moves no data.

The two parts are then synchronized apart, each by its own fingerprints: the
buffers, which legitimately differ under DDP with BatchNorm (each rank updates its
running statistics from its own batch), and the parameters with the optimizer
state. So buffers apart never hide a majority of the rest: one rank's flipped weight
is a majority copy, not a median of everything, and the buffers take their own
median. When only the buffers differ (every fault-free sync of a BatchNorm model)
only they move (the report's note says ``buffers only``). Under DDP with
``broadcast_buffers`` (pass the DDP model), robust mode gives buffers without a
majority those of DDP's source rank, as DDP's next forward would, not their median
(see :func:`paft.sync_plan.as_ddp_would`). For each part whose
replicas differ one more exchange carries, per tensor, how many NaN/Inf entries the
rank holds and where (16 bytes per tensor). "Finite" below means: no NaN/Inf in
the parameters and optimizer state, and in the buffers none beyond what the
replicas share (a strict majority's pattern, see
:func:`~paft.divergence.sound_replicas`), so a ``-inf`` every replica holds alike
(an attention-mask buffer) is state, not corruption. Then, per mode (the choice
itself is :func:`paft.sync_plan.plan_sync`, pure logic that every rank runs alike):

* ``robust`` (default):

  - a strict majority of bitwise identical, finite replicas (``"majority-copy"``):
    copy from the lowest majority rank -- point-to-point when a single rank is off
    (the common case: the other majority ranks move nothing), else a broadcast.
    Exact repair; majority ranks keep their bits;
  - exactly one finite replica (``"finite-copy"``): copy it, in the same way;
  - no (finite) majority, world size >= 3 (``"median"``): all-gather and take, per
    coordinate, the median of the replicas' values (:func:`~paft.robust.replica_median`).
    It is always one replica's value (never an average, so a flipped exponent cannot
    leak into it) and any minority of outliers on either side loses; where the
    replicas split evenly (2 against 2), the middle value of smaller magnitude wins.
    NaN counts as +inf per coordinate, so a replica holding NaN/Inf somewhere still
    votes everywhere else; where too many values of a coordinate are non-finite for
    its median to be finite, the median of the finite replicas is taken, or, when
    every replica holds NaN/Inf somewhere, the median of that coordinate's finite
    values (the report's note says so);
  - world size 2 (``"median-with-reference"``): two replicas never form a majority,
    and a plain mean would spread a flipped exponent (1e30 / 2) to both. A third
    opinion breaks the tie: the REFERENCE, the state at the last completed sync
    (identical on both ranks; or at the last state check the guard passed, see
    :meth:`ReplicaSync.set_reference`). Per coordinate the result is the median of the
    three values, i.e. ``clamp(ref, min(a, b), max(a, b))``: if both replicas moved
    the same way since the last sync it is the one that moved less (the huge
    corrupted value is dropped), if they moved in opposite ways it is the agreed
    value itself. The result always lies between the two replicas. What the
    reference costs, what stands in for state it has not seen, and when the ranks'
    references disagree: :mod:`paft.sync_reference`.

* ``mean``: average over the FINITE replicas only. A non-finite replica contributes
  zeros to the sum-all-reduce and the sum is divided by the number of finite
  replicas, so NaN/Inf never contaminate the others. Where the sum of finite
  replicas overflows (two float16 values near 40000), the coordinate takes a second
  sum instead, of each share scaled by ``1 / count`` first, so finite replicas stay
  finite. With a power-of-two count of finite replicas (2, 4, 8) sum-then-divide keeps
  the values they agree on exact; with 3 an agreed ``x`` becomes ``fl(fl(3x) / 3)``,
  which moves about one float32 value in five by one ulp (identically on every
  rank: replicas still end bitwise equal). float16 and bfloat16 are summed and
  divided in float32 and rounded once, so their agreed values stay exact (and the
  measured divergence has no floor of one 16-bit ulp). ``robust`` never
  touches agreed values. No finite replica at all raises :class:`RuntimeError` (on
  every rank).
* ``broadcast``: copy rank ``src`` exactly. If ``src`` holds NaN/Inf, the lowest
  finite rank is copied instead (the report's note says so); none finite raises
  :class:`RuntimeError`, as in ``mean``.

Integer tensors (``num_batches_tracked``, integer steps) are never averaged: they are
copied from the chosen source (``mean``: the lowest finite rank) or, in the median
modes, take the coordinate-wise median, which is again one replica's value.

Wire format: tensors are grouped by dtype (complex as real pairs, bool as uint8) into
one flat buffer per dtype, cut into buckets of at most ``bucket_mb``; ONE collective
per bucket, never one per tensor. ``bytes_sent`` counts the logical payload this rank
hands to the collectives it launched (all-reduce: the buffer; all-gather: its own
contribution; broadcast / send: the buffer on the source, 0 on receivers), not the
algorithm-dependent wire traffic. Every sync that moves parameters or optimizer
state ends with one 8-byte all-reduce (max) of their divergence, so all ranks report
the same number (the buffers are not measured: a replica whose buffers hold NaN/Inf
of its own makes the divergence ``inf``, else they add nothing).

After any completed blocking sync every rank holds bitwise identical parameters,
buffers and optimizer state. The overlapped form syncs the buffers at
:meth:`~ReplicaSync.start`, blocking: they are small, and the next forward updates
them by running averages, which no additive correction can carry over (it put a
replica's deviation back with the opposite sign: a negative running variance).
Parameters and optimizer state are snapshotted and their collectives overlap the
next forward/backward (under DDP only where the replicas agree: see
:meth:`~ReplicaSync.start`'s ``repair_now``); they end bitwise identical when nothing changed
them before :meth:`~ReplicaSync.finish`, as in the per-step protocol, where finish
comes before the next ``optimizer.step()``. If something did (an optimizer step),
finish applies ``w <- synced + (w - snapshot)`` per coordinate: additive progress is
kept, so for plain SGD without weight decay the replicas are equal up to the rounding
of that addition; where the update reads the state (momentum, Adam's moments, weight
decay) they stay apart by its non-additive part. Boolean tensors take the live value
where it changed and the synced one elsewhere (a sum of booleans is not a boolean).
"""

from __future__ import annotations

import math
import time
import weakref
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from paft.collectives import collective_device, gather_rows, max_over_ranks
from paft.config import SYNC_MODES
from paft.divergence import all_finite, nonfinite_patterns, rel_distance, sound_replicas
from paft.fingerprint import fingerprint, group_replicas, state_tensors
from paft.flat import (
    Group,
    Layout,
    build_layout,
    copy_all_,
    pack,
    ranges_in,
    storage_of,
    structure_key,
    transport_view,
)
from paft.norms import sq_norm, wide_dtype
from paft.records import jsonable
from paft.robust import finite_where_outvoted_, median_of_three, replica_median, sound_where_it_can_tell_
from paft.sync_plan import COPY_MODES, SyncPlan, as_ddp_would, plan_sync
from paft.sync_reference import SyncReference

__all__ = [
    "ReplicaSync",
    "SyncReport",
]

# ----------------------------------------------------------------------------
# Reports
# ----------------------------------------------------------------------------


@dataclass
class SyncReport:
    """What one sync did, on this rank (identical on every rank except ``bytes_sent``,
    ``collectives``, ``seconds``, ``wall_seconds`` and ``delta_tensors``)."""

    mode: str
    """The mode actually used: ``noop``, ``majority-copy``, ``finite-copy``,
    ``median``, ``median-with-reference``, ``mean`` or ``broadcast``."""
    groups: list[list[int]]
    """Ranks grouped by equal state fingerprint, largest group first."""
    source_ranks: list[int]
    """Ranks whose values make up the result: the copied rank, the finite ranks
    (``mean``, ``median``), both (``median-with-reference``), all (``noop``)."""
    bytes_sent: int
    """Logical payload this rank handed to the collectives it launched."""
    seconds: float
    """Time on the caller's critical path (for an overlapped sync: start + finish)."""
    divergence: float
    """Max over ranks of ``||w_r - c|| / ||c||`` over the parameters, before the sync
    (optimizer state and buffers are synchronized, not measured).
    ``c`` is the mean replica (``median``, ``median-with-reference``: mean of the
    finite replicas; ``mean``: the finite mean), or the source replica for
    ``majority-copy`` / ``finite-copy`` / ``broadcast`` -- the mean would need another O(parameters)
    collective there; :func:`~paft.divergence.measure_divergence` gives it on demand. ``inf`` when a
    replica is non-finite; 0.0 for ``noop``, identical replicas, even all non-finite
    (nothing to repair from)."""
    collectives: int = 0
    """Collectives (and point-to-point sends/receives) this rank launched, the control
    exchange included."""
    wall_seconds: float = 0.0
    """From the start of the sync to the end of its application."""
    overlapped: bool = False
    """A transfer of parameters or optimizer state ran behind the caller's next step
    (an overlapped sync whose replicas agreed moved nothing: False)."""
    delta_tensors: int = 0
    """Tensors to which the correction ``synced + (w - snapshot)`` was applied because
    they changed during an overlapped sync (0: plain copies)."""
    note: str = ""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (non-finite floats as strings), e.g. for ``events.jsonl``."""
        return jsonable(asdict(self))


# ----------------------------------------------------------------------------
# ReplicaSync
# ----------------------------------------------------------------------------


@dataclass
class _InFlight:
    """One part of a sync (the parameters and optimizer state, or the buffers) in flight."""

    decision: SyncPlan
    layout: Layout
    originals: list[Tensor]  # the live objects, for identity / version checks
    versions: list[int]
    opt_steps: int
    overlapped: bool
    snaps: list[Tensor | None]  # per dtype group: this rank's packed state
    bufs: list[Tensor | None]  # per dtype group: reduced / broadcast buffer
    gathered: list[list[Tensor]]  # per dtype group, per bucket: [ws, len]
    works: list[Any]
    reference: list[Tensor | None] | None  # no-op, world size 2: the agreed state at start
    bytes_sent: int
    collectives: int


@dataclass
class _Done:
    """A completed part: what the report says of it."""

    decision: SyncPlan
    divergence: float
    bytes_sent: int
    collectives: int
    delta_tensors: int


@dataclass
class _Sync:
    """A sync between start and finish: its control exchange, the buffers' part
    (completed at start) and the parameters' and optimizer state's part in flight."""

    ctrl: list[list[int]]  # every rank's fingerprints: the next reference's tag
    control_bytes: int  # the control and finite-flag exchanges
    control_collectives: int
    buffers: _Done
    state: _InFlight
    t0: float
    critical: float


class ReplicaSync:
    """Synchronize a data-parallel model's parameters, buffers and optimizer state.

    ``model`` may be DDP-wrapped (its ``.module`` state is used). ``mode``: ``robust``
    (default), ``mean`` or ``broadcast`` (see the module docstring). ``src``: the rank
    (within ``group``) that ``broadcast`` copies. ``bucket_mb``: the largest message of
    one collective. ``group``: the process group (default: the world). Every call is a
    collective: all ranks of the group make the same calls in the same order.

    For an overlapped sync, call :meth:`start` right after ``optimizer.step()`` of step
    ``t`` and :meth:`finish` right before ``optimizer.step()`` of step ``t + 1``; the
    communication then hides behind the forward/backward of step ``t + 1``. Using a
    separate ``group`` keeps it from queueing in front of DDP's own all-reduces.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        mode: str = "robust",
        src: int = 0,
        bucket_mb: float = 25.0,
        group: Any = None,
    ) -> None:
        if mode not in SYNC_MODES:
            raise ValueError(f"mode must be one of {SYNC_MODES}, got {mode!r}")
        if not (isinstance(bucket_mb, (int, float)) and math.isfinite(bucket_mb) and bucket_mb > 0):
            raise ValueError(f"bucket_mb must be a positive number, got {bucket_mb!r}")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ReplicaSync needs an initialized torch.distributed process group")
        self.model = model
        self.optimizer = optimizer
        self.mode = mode
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.world_size:
            raise ValueError(f"src must be a rank in [0, {self.world_size}), got {src!r}")
        self.src = src
        self.bucket_bytes = max(1, int(bucket_mb * 2**20))
        self.syncs = 0
        self._layouts: dict[tuple[Any, ...], Layout] = {}  # all tensors, buffers only, all but buffers
        self._pending: _Sync | None = None
        self._device = collective_device(group, next(iter(model.parameters()), None))
        self._buffer_src = self._agreed_buffer_source(model)
        # Fused optimizers update parameters and state without bumping the tensors'
        # version counters; a step hook tells finish() that a step happened anyway.
        self._opt_steps = 0
        if optimizer is not None:
            ref = weakref.ref(self)

            def _count_step(*_: Any) -> None:
                me = ref()
                if me is not None:
                    me._opt_steps += 1

            # Removed with this object, so a discarded ReplicaSync leaves nothing behind.
            weakref.finalize(self, optimizer.register_step_post_hook(_count_step).remove)
        # Two replicas never form a majority: robust mode breaks their ties with the
        # state they last agreed on (see paft.sync_reference).
        self._reference: SyncReference | None = None
        if mode == "robust" and self.world_size == 2:
            entries = self._entries()
            layout = self._layout_for(entries)
            self._reference = SyncReference(layout, [self._pack_group(g, entries) for g in layout.groups],
                                            self._device)

    # -- public API -----------------------------------------------------------------

    @property
    def in_flight(self) -> bool:
        """True between :meth:`start` and :meth:`finish`."""
        return self._pending is not None

    def sync(self) -> SyncReport:
        """Blocking sync; on return every rank holds bitwise identical state."""
        if self._pending is not None:
            raise RuntimeError("ReplicaSync.sync(): an overlapped sync is in flight; call finish() first")
        self._pending = self._launch(overlapped=False)
        return self._complete(state_changed=False)

    def start(self, *, repair_now: bool = False) -> SyncReport | None:
        """Sync the buffers (blocking: they are small, and the next forward updates
        them), then snapshot the parameters and optimizer state into flat buffers and
        launch their collectives asynchronously; ``None``: in flight until
        :meth:`finish`. What blocks besides the buffers is the 24-32-byte control
        exchange, the two fingerprint passes over the state and, where the replicas
        differ, the NaN/Inf exchange with its pass over the state.

        ``repair_now``: where the parameters or optimizer state differ between
        replicas, sync them blocking and return the report, as :meth:`sync` does. Pass
        it under DDP: the next forward/backward on a faulty replica would all-reduce its
        gradient (a NaN, a huge value) into every rank, and the repaired replicas would
        apply it. (Where replicas differ by design, as in local SGD, overlapping the
        repair is the point.)"""
        if self._pending is not None:
            raise RuntimeError("ReplicaSync.start(): a sync is already in flight; call finish() first")
        self._pending = self._launch(overlapped=True, repair_now=repair_now)
        return None if self._pending.state.overlapped else self._complete(state_changed=False)

    def finish(self, state_changed: bool | None = None) -> SyncReport:
        """Wait for the collectives of :meth:`start` and apply the result.

        Only parameters and optimizer state are in flight: :meth:`start` synced the
        buffers already. ``state_changed``: ``False`` promises that nothing touched
        them since :meth:`start` (pure copy: bitwise identical replicas); ``True``
        applies the correction ``synced + (w - snapshot)`` to every tensor; ``None``
        (default) decides per tensor: one that was replaced, whose version counter
        moved, or any when the optimizer stepped since start, gets the correction.
        The correction yields the synced bits wherever a coordinate did not change, and
        keeps additive progress (an SGD step) exactly; a running average's is not
        additive (Adam's moments), so call finish() before the next optimizer step, as
        :class:`paft.protect.Protector` does. Changes made through ``.data`` or other
        kernels that bypass version counters must be declared with ``True``.
        """
        if self._pending is None:
            raise RuntimeError("ReplicaSync.finish(): no sync in flight; call start() first")
        return self._complete(state_changed)

    def set_reference(self, agreed: int) -> None:
        """Keep the current parameters and optimizer state as the world-size-2 reference.

        Call it on every rank right after checking that the replicas agree -- their
        :func:`~paft.fingerprint.state_fingerprint` (``buffers=False``) values are all
        ``agreed`` -- and before anything changes the state; the guard does so at each
        state check it passes, so that a later repair takes the median with the last
        agreed state, not with the state at the last sync. Buffers keep their reference
        (under DDP they differ between ranks between syncs). A no-op unless a
        reference is kept (robust mode, world size 2).
        """
        if self._pending is not None:
            raise RuntimeError("ReplicaSync.set_reference(): a sync is in flight; call finish() first")
        if self._reference is None:
            return
        entries = [e for e in self._entries() if not e[0].startswith("buffer/")]
        named = [(n, t) for n, t, _ in entries]
        if self._reference.holds_all(named):  # the usual case: the same tensors as last time, copied in place
            self._reference.copy_in(named)
        else:  # state the reference has not seen yet (optimizer state created since)
            layout = self._layout_for(entries)
            self._reference.keep(layout, [self._pack_group(g, entries) for g in layout.groups])
        self._reference.agreed_on(agreed)

    def state_dict(self) -> dict[str, Any]:
        """What must survive a checkpoint: the world-size-2 reference (else None)."""
        if self._pending is not None:
            raise RuntimeError("ReplicaSync.state_dict(): a sync is in flight; call finish() first")
        ref = None if self._reference is None else self._reference.state_dict()
        return {"mode": self.mode, "world_size": self.world_size, "syncs": self.syncs, "reference": ref}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`. A reference saved by a run of another world
        size or mode (an elastic restart) is ignored: the one captured at
        construction stays."""
        ref = state.get("reference")
        if ref is not None and not (isinstance(ref, dict) and all(
                isinstance(k, str) and isinstance(v, Tensor) for k, v in ref.items())):
            raise ValueError("ReplicaSync.load_state_dict(): reference must map tensor names to tensors "
                             f"(a ReplicaSync.state_dict()), got {type(ref).__name__}")
        self.syncs = int(state.get("syncs", 0))
        same_run = state.get("world_size") == self.world_size and state.get("mode") == self.mode
        if self._reference is not None and ref is not None and same_run:
            self._reference.load_state_dict(ref)

    def _agreed_buffer_source(self, model: nn.Module) -> int | None:
        """The rank (in ``group``) whose buffers DDP broadcasts at every forward, when
        ``model`` is DDP with ``broadcast_buffers`` and every rank of this group names
        the same one (DDP over a sub-group of it, each rank its own: None); a
        collective."""
        source = -1
        if isinstance(model, nn.parallel.DistributedDataParallel) and model.broadcast_buffers:
            try:
                source = dist.get_group_rank(self.group or dist.group.WORLD,
                                             dist.get_global_rank(model.process_group, 0))
            except (ValueError, RuntimeError):  # DDP's source is outside this group
                source = -1
        named = set(gather_rows(torch.tensor([source], dtype=torch.int64, device=self._device), self.group)
                    .reshape(-1).tolist())
        return source if len(named) == 1 and source >= 0 else None

    # -- internals: state and layout ---------------------------------------------------

    def _entries(self) -> list[tuple[str, Tensor, Tensor]]:
        """(name, transport view, live object) for every state tensor, each memory once:
        a tensor that is another's exact alias (two Parameter objects over one storage,
        optimizer state that *is* its parameter) is left out. The overlapped correction
        ``synced + (w - snapshot)`` written through both would add the progress twice
        (partial overlaps, which cannot be left out, are corrected apart: see _apply)."""
        seen: set[tuple[Any, ...]] = set()
        entries = []
        for n, t in state_tensors(self.model, self.optimizer):
            storage = storage_of(t)
            if storage is not None:
                where = (*storage, t.storage_offset(), t.dtype, tuple(t.shape), t.stride())
                if where in seen:
                    continue
                seen.add(where)
            entries.append((n, transport_view(t), t))
        return entries

    def _layout_for(self, entries: list[tuple[str, Tensor, Tensor]]) -> Layout:
        key = structure_key((n, t) for n, t, _ in entries)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= 6:  # the state's shape changed (optimizer state created)
                self._layouts.clear()
            layout = self._layouts[key] = build_layout(key, [(n, t) for n, t, _ in entries], self.bucket_bytes)
        return layout

    def _pack_group(self, g: Group, entries: list[tuple[str, Tensor, Tensor]]) -> Tensor:
        flat = torch.empty(g.numel, dtype=g.dtype, device=self._device)
        return pack(flat, [entries[i][1] for i in g.members])

    # -- internals: one sync ----------------------------------------------------------

    def _check_structure(self, digests: list[int]) -> None:
        """Raise on every rank if the ranks' states differ in structure: their flat
        buffers would not line up, and no mode can merge them value by value."""
        if len(set(digests)) > 1:
            groups = group_replicas(digests)
            raise RuntimeError(
                f"ReplicaSync: the ranks' states differ in structure (tensor names, dtypes or shapes; "
                f"ranks grouped by structure: {groups}), e.g. optimizer state created on some ranks only "
                "or a history whose length depends on the values; a sync cannot merge them -- "
                "restore a checkpoint"
            )

    def _gather_ints(self, row: list[int]) -> list[list[int]]:
        """Blocking gather of a few int64 per rank."""
        return gather_rows(torch.tensor(row, dtype=torch.int64, device=self._device), self.group).tolist()

    def _launch(self, overlapped: bool, repair_now: bool = False) -> _Sync:
        t0 = time.perf_counter()
        entries = self._entries()
        is_buffer = [n.startswith("buffer/") for n, _, _ in entries]
        state = [e for e, b in zip(entries, is_buffer) if not b]
        buffers = [e for e, b in zip(entries, is_buffer) if b]
        # The control exchange: two fingerprints, the state's structure (+ the
        # reference tag), 24-32 bytes.
        row = [fingerprint(t for _, t, _ in state), fingerprint(t for _, t, _ in buffers),
               self._layout_for(entries).digest]
        row += [self._reference.tag] if self._reference is not None else []
        ctrl = self._gather_ints(row)
        bytes_sent, collectives = len(row) * 8, 1
        self._check_structure([r[2] for r in ctrl])
        tags = [r[-1] for r in ctrl]
        parts = [(state, [r[0] for r in ctrl]), (buffers, [r[1] for r in ctrl])]
        # Finite flags cost a pass over a part: only where its replicas differ (one more
        # exchange, 16 bytes per tensor of such a part), or for mean mode's check of
        # identical parameters and optimizer state. In the buffers "finite" is relative
        # (see sound_replicas): NaN/Inf the replicas share is state.
        differ = [len(set(fps)) > 1 for _, fps in parts]
        mine = [x for (part, _), d in zip(parts, differ) if d for x in nonfinite_patterns([t for _, t, _ in part])]
        rows = self._gather_ints(mine) if mine else []
        bytes_sent, collectives = bytes_sent + 8 * len(mine), collectives + bool(mine)
        decisions, at = [], 0
        for (part, fps), d in zip(parts, differ):
            if d:
                lenient = [part is buffers] * len(part)
                finite = [all(ok) for ok in sound_replicas([r[at : at + 2 * len(part)] for r in rows], lenient)]
                at += 2 * len(part)
            else:  # identical: mean mode still refuses parameters or optimizer state gone
                # non-finite on every rank alike (nothing to average from), never buffers
                strict = self.mode == "mean" and part is state
                finite = [not strict or all_finite([t for _, t, _ in part])] * self.world_size
            decisions.append(plan_sync(self.mode, fps, finite, src=self.src, with_reference=self._reference is not None,
                                       reference_ok=self._reference is not None and len(set(tags)) == 1,
                                       per_coordinate=part is buffers))
        state_d, buffers_d = decisions
        if self._buffer_src is not None:
            buffers_d = as_ddp_would(buffers_d, state_d, self._buffer_src)
        # The buffers first, now and blocking, before the next forward updates them:
        # their updates (BatchNorm's running averages) are not additive, so the overlapped
        # correction synced + (w - snapshot) would put a replica's deviation back with the
        # opposite sign (a negative running variance). They are small.
        buffers_done = self._finish_transfer(self._transfer(buffers_d, buffers, overlapped=False), False)
        pending = self._transfer(state_d, state, overlapped and not (repair_now and differ[0]))
        return _Sync(ctrl, bytes_sent, collectives, buffers_done, pending, t0, critical=time.perf_counter() - t0)

    def _transfer(self, d: SyncPlan, entries: list[tuple[str, Tensor, Tensor]], overlapped: bool) -> _InFlight:
        """Launch the collectives of one part (the parameters and optimizer state, or the
        buffers) as decided by ``d``."""
        ws, rank, group = self.world_size, self.rank, self.group
        layout = self._layout_for(entries)
        bytes_sent = collectives = 0
        snaps: list[Tensor | None] = []
        bufs: list[Tensor | None] = []
        gathered: list[list[Tensor]] = []
        works: list[Any] = []
        src_global = dist.get_global_rank(group, d.src) if group is not None and d.src >= 0 else d.src
        for g in layout.groups:
            snap: Tensor | None = None
            buf: Tensor | None = None
            outs: list[Tensor] = []
            copy_mode = d.mode in COPY_MODES or (d.mode == "mean" and not g.floating)
            if d.mode == "noop" or g.numel == 0:
                pass
            elif d.mode in COPY_MODES and len(d.minority) == 1:
                # One rank to repair (the common case): send it the source's state
                # point-to-point; the other majority members move nothing at all.
                (bad,) = d.minority
                if rank == d.src:
                    buf = snap = self._pack_group(g, entries)
                    dst = dist.get_global_rank(group, bad) if group is not None else bad
                    for k, (a, b) in enumerate(g.buckets):
                        works.append(dist.isend(buf[a:b], dst, group=group, tag=k))
                    bytes_sent += buf.numel() * buf.element_size()
                    collectives += len(g.buckets)
                elif rank == bad:
                    snap = self._pack_group(g, entries)
                    buf = torch.empty(g.numel, dtype=g.dtype, device=self._device)
                    for k, (a, b) in enumerate(g.buckets):
                        works.append(dist.irecv(buf[a:b], src_global, group=group, tag=k))
                    collectives += len(g.buckets)
            elif copy_mode:
                if rank == d.src:
                    # The source's buffer is never overwritten: it is its own snapshot.
                    buf = snap = self._pack_group(g, entries)
                    bytes_sent += buf.numel() * buf.element_size()
                else:
                    # Majority members hold the result already and only receive; the
                    # others keep a snapshot for divergence and the overlapped delta.
                    if not d.holds_result(rank):
                        snap = self._pack_group(g, entries)
                    buf = torch.empty(g.numel, dtype=g.dtype, device=self._device)
                for a, b in g.buckets:
                    works.append(dist.broadcast(buf[a:b], src_global, group=group, async_op=True))
                collectives += len(g.buckets)
            elif d.mode == "mean":
                snap = self._pack_group(g, entries)
                # Sum, then divide (in _finish_transfer): exact where the replicas agree for a
                # power-of-two count (n * x / n is x) and for the smallest subnormals
                # (halving first would round them to 0). A non-finite replica contributes
                # zeros (NaN * 0 would still be NaN). Integer tensors are copied, never
                # averaged (copy_mode above).
                wide = wide_dtype(g.dtype)
                buf = snap.to(wide, copy=True) if d.finite[rank] else torch.zeros_like(snap, dtype=wide)
                for a, b in g.buckets:
                    works.append(dist.all_reduce(buf[a:b], group=group, async_op=True))
                bytes_sent += buf.numel() * buf.element_size()
                collectives += len(g.buckets)
            else:  # median, median-with-reference
                snap = self._pack_group(g, entries)
                for a, b in g.buckets:
                    out = torch.empty(ws, b - a, dtype=g.dtype, device=self._device)
                    works.append(dist.all_gather(list(out.unbind(0)), snap[a:b], group=group, async_op=True))
                    outs.append(out)
                bytes_sent += snap.numel() * snap.element_size()
                collectives += len(g.buckets)
            snaps.append(snap)
            bufs.append(buf)
            gathered.append(outs)
        originals = [o for _, _, o in entries]
        # The next world-size-2 reference after a no-op is the state agreed NOW: by
        # finish() an overlapped step may have moved the two replicas apart.
        reference = None
        if d.mode == "noop" and self._reference is not None:
            reference = [self._pack_group(g, entries) for g in layout.groups]
        return _InFlight(
            decision=d,
            layout=layout,
            originals=originals,
            versions=[o._version for o in originals],
            opt_steps=self._opt_steps,
            overlapped=overlapped,
            snaps=snaps,
            bufs=bufs,
            gathered=gathered,
            works=works,
            reference=reference,
            bytes_sent=bytes_sent,
            collectives=collectives,
        )

    def _complete(self, state_changed: bool | None) -> SyncReport:
        p = self._pending
        assert p is not None
        self._pending = None
        t1 = time.perf_counter()
        done, buffers = self._finish_transfer(p.state, state_changed), p.buffers
        self.syncs += 1
        if self._reference is not None:
            self._reference.after_sync(self.syncs, p.ctrl)
        d, note = done.decision, done.decision.note
        if buffers.decision.mode != "noop":
            if d.mode == "noop":  # parameters and optimizer state agree: only the buffers moved
                d, note = buffers.decision, "; ".join(filter(None, ["buffers only", buffers.decision.note]))
            else:
                extra = f" ({buffers.decision.note})" if buffers.decision.note else ""
                note = "; ".join(filter(None, [note, f"buffers: {buffers.decision.mode}{extra}"]))
        t2 = time.perf_counter()
        return SyncReport(
            mode=d.mode,
            groups=d.groups,
            source_ranks=d.sources,
            bytes_sent=p.control_bytes + done.bytes_sent + buffers.bytes_sent,
            seconds=p.critical + (t2 - t1),
            divergence=max(done.divergence, buffers.divergence),
            collectives=p.control_collectives + done.collectives + buffers.collectives,
            wall_seconds=t2 - p.t0,
            overlapped=p.state.overlapped and p.state.decision.mode != "noop",  # a transfer was in flight
            delta_tensors=done.delta_tensors,
            note=note,
        )

    def _finish_transfer(self, p: _InFlight, state_changed: bool | None) -> _Done:
        """Wait for one part's collectives, merge, measure and apply them."""
        d, layout = p.decision, p.layout
        for w in p.works:
            w.wait()
        bytes_sent, collectives = p.bytes_sent, p.collectives

        # 1. The synced flats (identical on every rank) and this rank's distance to
        # the centre: the mean of the finite replicas (median modes: from the gather;
        # mean: the result), or the copied source (copy modes).
        synced: list[Tensor | None] = []
        local_sq = ref_sq = 0.0
        me = self.rank
        measure = d.mode != "noop" and not d.holds_result(me) and d.finite[me]
        good = [r for r in range(self.world_size) if d.finite[r]]
        for gi, g in enumerate(layout.groups):
            snap, buf = p.snaps[gi], p.bufs[gi]
            if d.mode == "noop" or g.numel == 0 or (buf is None and d.holds_result(me)):
                synced.append(None)  # nothing moved, or a majority member left out of the copy
                continue
            if d.mode in ("median", "median-with-reference"):
                out_flat = torch.empty(g.numel, dtype=g.dtype, device=self._device)
                ref = self._reference.flat(g, d.reference_ok) if d.mode == "median-with-reference" else None
                nan_free = all(d.finite)  # then the NaN pass of the medians is skipped
                for (a, b), rows in zip(g.buckets, p.gathered[gi]):
                    if ref is not None:
                        median_of_three(rows[0], rows[1], ref[a:b], out=out_flat[a:b], nan_free=nan_free)
                        if len(good) == 1 and g.floating:
                            sound_where_it_can_tell_(out_flat[a:b], rows[good[0]], rows[1 - good[0]])
                    else:
                        merged = replica_median(rows, out=out_flat[a:b], nan_free=nan_free)
                        if not nan_free:
                            finite_where_outvoted_(merged, rows, good)
                    if not (measure and g.floating):
                        continue
                    for lo, hi in ranges_in(g.param_ranges, a, b):
                        part = rows[:, lo:hi].to(wide_dtype(g.dtype))
                        c = (part if len(good) == self.world_size else part[good]).mean(0)
                        ref_sq += sq_norm(c)
                        local_sq += sq_norm(part[me] - c)
                synced.append(out_flat)
                continue
            assert buf is not None
            if d.mode == "mean" and g.floating:
                buf.div_(d.count)
                overflowed = ~torch.isfinite(buf)
                if bool(overflowed.any()):
                    # Finite replicas whose sum overflowed (40000 + 40992 in float16): sum
                    # again with each share scaled first, and take that where the plain
                    # sum overflowed. The all-reduce left the same result on every rank,
                    # so every rank takes this branch alike.
                    assert snap is not None
                    scaled = snap.to(buf.dtype) * (1.0 / d.count) if d.finite[me] else torch.zeros_like(buf)
                    for a, b in g.buckets:
                        dist.all_reduce(scaled[a:b], group=self.group)
                    buf = torch.where(overflowed, scaled, buf)
                    bytes_sent += scaled.numel() * scaled.element_size()
                    collectives += len(g.buckets)
            if measure and g.floating and snap is not None:
                for lo, hi in g.param_ranges:
                    local_sq += sq_norm(snap[lo:hi] - buf[lo:hi])
                    ref_sq += sq_norm(buf[lo:hi])
            synced.append(buf.to(g.dtype))  # a float32 mean of 16-bit state, rounded once

        # The max over ranks: one 8-byte all-reduce, so that every rank reports the
        # very same number (PAFT-Dyn takes its decisions from it on every rank). A part
        # without parameters (the buffers) is not measured: its finite flags, which every
        # rank holds, say all there is.
        if d.mode == "noop":
            divergence = 0.0
        elif not any(g.param_ranges for g in layout.groups):
            divergence = 0.0 if all(d.finite) else math.inf
        else:
            mine = rel_distance(local_sq, ref_sq) if measure else 0.0
            divergence = max_over_ranks(mine if d.finite[me] else math.inf, self.group)
            bytes_sent, collectives = bytes_sent + 8, collectives + 1

        # 2. Apply: copy where the tensor is untouched since the snapshot, else the
        # correction synced + (w - snapshot).
        delta_tensors = 0
        if d.mode != "noop" and not d.holds_result(self.rank):
            delta_tensors = self._apply(p, synced, state_changed)

        # 3. The reference for the next world-size-2 median: the state just agreed
        # (merged by name: each part replaces its own tensors' reference).
        if self._reference is not None:
            agreed = p.reference if p.reference is not None else synced
            self._reference.keep(layout, agreed)
        return _Done(d, divergence, bytes_sent, collectives, delta_tensors)

    def _apply(self, p: _InFlight, synced: list[Tensor | None], state_changed: bool | None) -> int:
        d, layout = p.decision, p.layout
        if p.overlapped:
            # Re-resolve by name: the optimizer may have replaced a state tensor.
            now = {n: (t, o) for n, t, o in self._entries()}
        # A non-finite replica's own progress is garbage: it just takes the result.
        garbage = not d.finite[self.rank]
        stepped = self._opt_steps != p.opt_steps
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
                    delta_tensors += 1
                    old = snap[s.offset : s.offset + s.numel].view(s.shape)
                    if live.dtype == torch.bool:  # flags: the live value where it changed
                        value = torch.where(target != old.to(target.device), target, new.to(target.device))
                    else:
                        progress = target - old.to(target.device)
                        res = new.to(target.device) + progress
                        # Untouched coordinates (progress 0) get the synced bits exactly;
                        # a non-finite result (a NaN replica's progress) falls back to them.
                        keep = progress == 0
                        if res.is_floating_point():
                            keep |= ~torch.isfinite(res)
                        value = torch.where(keep, new.to(target.device), res)
                    if shared and storage_of(target) in shared:
                        later.append((target, value))
                    else:
                        target.copy_(value)
            copy_all_(copy_dst, copy_src)
            for a, b in later:  # after the copies: a correction wins over a plain copy
                a.copy_(b)
        return delta_tensors
