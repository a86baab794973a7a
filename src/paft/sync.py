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
rank holds and where, and the tensor's digest, from which the fingerprint was built
(24 bytes per tensor): the report names the tensors that differed. "Finite" below
means: no NaN/Inf in the parameters and optimizer state, and in the buffers none
beyond what the replicas share (a strict majority's pattern, see
:func:`~paft.divergence.sound_replicas`), so a ``-inf`` every replica holds alike
(an attention-mask buffer) is state, not corruption. Then, per mode (the choice
itself is :func:`paft.sync_plan.plan_sync`, pure logic that every rank runs alike):

* ``robust`` (default):

  - a strict majority of bitwise identical, finite replicas (``"majority-copy"``):
    copy from the lowest majority rank. Exact repair; majority ranks keep their bits;
  - exactly one finite replica (``"finite-copy"``): copy it, in the same way;
  - no (finite) majority, world size >= 3 (``"median"``): all-gather and take, per
    coordinate, the median of the replicas' values (:func:`~paft.robust.replica_median`).
    It is always one replica's value (never an average, so a flipped exponent cannot
    leak into it) and any minority of outliers on either side loses; where the
    replicas split evenly (2 against 2), the middle value of smaller magnitude wins.
    NaN counts as +inf per coordinate, so a replica holding NaN/Inf somewhere still
    votes everywhere else (a median that comes out of NaN is NaN, never +inf); where
    too many values of a coordinate are non-finite for its median to be finite, the
    median of the finite replicas is taken, or, when every replica holds NaN/Inf
    somewhere, the median of that coordinate's finite values
    (:func:`~paft.robust.finite_where_outvoted_`; the report's note says so);
  - world size 2 (``"median-with-reference"``): two replicas never form a majority,
    and a plain mean would spread a flipped exponent (1e30 / 2) to both. A third
    opinion breaks the tie: the REFERENCE, the state at the last completed sync
    (identical on both ranks; or at the last state check the guard passed, see
    :meth:`ReplicaSync.set_reference`). Per coordinate the result is the median of the
    three values, i.e. ``clamp(ref, min(a, b), max(a, b))``: if both replicas moved
    the same way since the last sync it is the one that moved less (the huge
    corrupted value is dropped), if they moved in opposite ways it is the agreed
    value itself. The result always lies between the two replicas (where both hold
    NaN, it is NaN, as they hold it: NaN counts as +inf, as above). What the
    reference costs, what stands in for state it has not seen, and when the ranks'
    references disagree: :mod:`paft.sync_reference`.

* ``mean``: average over the FINITE replicas only, so NaN/Inf never contaminate the
  others (how the sum is taken, and which agreed values it keeps exact:
  :mod:`paft.sync_transfer`). ``robust`` never touches agreed values. No finite
  replica at all raises :class:`RuntimeError` (on every rank).
* ``broadcast``: copy rank ``src`` exactly. If ``src`` holds NaN/Inf, the lowest
  finite rank is copied instead (the report's note says so); none finite raises
  :class:`RuntimeError`, as in ``mean``.

Integer tensors (``num_batches_tracked``, integer steps) are never averaged: they are
copied from the chosen source (``mean``: the lowest finite rank) or, in the median
modes, take the coordinate-wise median, which is again one replica's value.

The transfers themselves (one collective per bucket of a flat buffer per dtype,
point-to-point where a single rank is repaired, what ``bytes_sent`` counts, the one
8-byte exchange of the divergence) are :mod:`paft.sync_transfer`'s.

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
decay) they stay apart by its non-additive part. Optimizer state that holds no negative
value (a second moment: Adam's ``exp_avg_sq``, Adagrad's ``sum``) never turns negative
through the correction: where it would, the synced value stands (a replica whose second
moment had been corrupted huge took a step down that made it negative, and its next
step NaN).
"""

from __future__ import annotations

import math
import time
import weakref
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from paft.collectives import collective_device, gather_rows
from paft.config import SYNC_MODES
from paft.divergence import all_finite, nonfinite_patterns, sound_replicas
from paft.fingerprint import fingerprint_and_digests
from paft.flat import Layout, build_layout, storage_of, structure_key, transport_view
from paft.records import jsonable
from paft.replicas import group_replicas
from paft.state import state_tensors
from paft.sync_plan import SyncPlan, as_ddp_would, plan_sync
from paft.sync_reference import SyncReference
from paft.sync_transfer import Entry, PartDone, PartInFlight, Transfer, keep_as_reference, pack_group

__all__ = [
    "ReplicaSync",
    "SyncReport",
]

_LISTED = 16  # differing tensors a report names (a drifted state differs in every one)

_Part = tuple[list[Entry], list[int], list[int]]
"""One part of the state: its entries, every rank's fingerprint of it and this rank's
digests of its tensors."""

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
    """Ranks grouped by equal fingerprint of parameters + optimizer state, largest group
    first; where only the buffers differed (``note`` begins ``buffers only``), by the
    buffers' fingerprint, as ``mode`` and ``source_ranks`` are the buffers' then."""
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
    differing_tensors: int = 0
    """How many tensors' bits differed between the replicas before the sync (0 when
    they agreed)."""
    differing: dict[str, list[list[int]]] = field(default_factory=dict)
    """The first :data:`_LISTED` of them by name (``param/...``, ``optim/<index>/<key>``, then
    ``buffer/...``; see :func:`paft.state.state_tensors`), each with the ranks grouped
    by its bits, largest group first: where a fault at rest struck, or which moment
    a faulty update wrote."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (non-finite floats as strings), e.g. for ``events.jsonl``."""
        return jsonable(asdict(self))


# ----------------------------------------------------------------------------
# ReplicaSync
# ----------------------------------------------------------------------------


@dataclass
class _Sync:
    """A sync between start and finish: its control exchange, the buffers' part
    (completed at start) and the parameters' and optimizer state's part in flight."""

    ctrl: list[list[int]]  # every rank's fingerprints: the next reference's tag
    control_bytes: int  # the control and finite-flag exchanges
    control_collectives: int
    buffers: PartDone
    state: PartInFlight
    differing: list[tuple[str, list[list[int]]]]  # tensors whose bits differ, ranks grouped by them
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
        group: dist.ProcessGroup | None = None,
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
        self._transfer = Transfer(group, self.rank, self.world_size, self._device)
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
            self._reference = SyncReference(layout, [pack_group(g, entries, self._device) for g in layout.groups],
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
        :class:`paft.protect.Protector` does. A coordinate that went NaN/Inf since
        :meth:`start` stays so on the ranks where it did, as on those that hold the
        result and apply nothing: on every rank under DDP, whose all-reduced gradient
        puts it into every replica; where ranks step apart (local SGD), the replicas then
        differ there until the next sync. One the sum alone overflows, or turns
        negative in optimizer state that holds no negative value (a second moment),
        takes the synced value. Changes made through ``.data`` or other
        kernels that bypass version counters must be declared with ``True``.
        """
        if self._pending is None:
            raise RuntimeError("ReplicaSync.finish(): no sync in flight; call start() first")
        return self._complete(state_changed)

    def set_reference(self, agreed: int) -> None:
        """Keep the current parameters and optimizer state as the world-size-2 reference.

        Call it on every rank right after checking that the replicas agree -- their
        :func:`~paft.state.state_fingerprint` (``buffers=False``) values are all
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
        keep_as_reference(self._reference, self._layout_for(entries), entries, self._device)
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
                source = dist.get_global_rank(model.process_group, 0)
                if self.group is not None:  # else the world's: its rank is the global one
                    source = dist.get_group_rank(self.group, source)
            except (ValueError, RuntimeError):  # DDP's source is outside this group
                source = -1
        named = set(gather_rows(torch.tensor([source], dtype=torch.int64, device=self._device), self.group)
                    .reshape(-1).tolist())
        return source if len(named) == 1 and source >= 0 else None

    # -- internals: state and layout ---------------------------------------------------

    def _entries(self) -> list[Entry]:
        """(name, transport view, live object) for every state tensor, each memory once:
        a tensor that is another's exact alias (two Parameter objects over one storage,
        optimizer state that *is* its parameter) is left out. The overlapped correction
        ``synced + (w - snapshot)`` written through both would add the progress twice
        (partial overlaps, which cannot be left out, are corrected apart: see paft.sync_transfer)."""
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

    def _layout_for(self, entries: list[Entry]) -> Layout:
        key = structure_key((n, t) for n, t, _ in entries)
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= 6:  # the state's shape changed (optimizer state created)
                self._layouts.clear()
            layout = self._layouts[key] = build_layout(key, [(n, t) for n, t, _ in entries], self.bucket_bytes)
        return layout

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

    @staticmethod
    def _patterns_and_digests_row(parts: list[_Part], differ: list[bool]) -> list[int]:
        """This rank's row of the exchange after the control one: for each part whose
        replicas differ, per tensor its NaN/Inf count and pattern (two ints,
        :func:`~paft.divergence.nonfinite_patterns`), then per tensor its digest.
        :meth:`_plan_parts` reads every rank's row back in this layout."""
        return [x for (part, _, digests), differs in zip(parts, differ) if differs
                for x in nonfinite_patterns([t for _, t, _ in part]) + digests]

    def _plan_parts(self, parts: list[_Part], differ: list[bool], rows: list[list[int]],
                    reference_ok: bool) -> tuple[list[SyncPlan], list[tuple[str, list[list[int]]]]]:
        """Each part's plan (``parts``: the parameters' and optimizer state's, then the
        buffers') and the tensors whose bits differ, each with the ranks grouped by
        them, from every rank's :meth:`_patterns_and_digests_row` in ``rows``."""
        plans, differing, at = [], [], 0
        for i, ((part, fps, _), differs) in enumerate(zip(parts, differ)):
            is_buffers = i == 1
            if differs:
                n = len(part)
                lenient = [is_buffers] * n
                finite = [all(ok) for ok in sound_replicas([r[at : at + 2 * n] for r in rows], lenient)]
                for (name, _, _), *digests in zip(part, *(r[at + 2 * n : at + 3 * n] for r in rows)):
                    if len(set(digests)) > 1:
                        differing.append((name, group_replicas(digests)))
                at += 3 * n
            else:  # identical: mean mode still refuses parameters or optimizer state gone
                # non-finite on every rank alike (nothing to average from), never buffers
                strict = self.mode == "mean" and not is_buffers
                finite = [not strict or all_finite([t for _, t, _ in part])] * self.world_size
            plans.append(plan_sync(self.mode, fps, finite, src=self.src, with_reference=self._reference is not None,
                                   reference_ok=reference_ok, per_coordinate=is_buffers))
        return plans, differing

    def _launch(self, overlapped: bool, repair_now: bool = False) -> _Sync:
        t0 = time.perf_counter()
        entries = self._entries()
        is_buffer = [n.startswith("buffer/") for n, _, _ in entries]
        state = [e for e, b in zip(entries, is_buffer) if not b]
        buffers = [e for e, b in zip(entries, is_buffer) if b]
        # The control exchange: two fingerprints, the state's structure (+ the
        # reference tag), 24-32 bytes.
        (state_fp, state_digests), (buffers_fp, buffer_digests) = (
            fingerprint_and_digests(t for _, t, _ in part) for part in (state, buffers))
        row = [state_fp, buffers_fp, self._layout_for(entries).digest]
        row += [self._reference.tag] if self._reference is not None else []
        ctrl = self._gather_ints(row)
        bytes_sent, collectives = len(row) * 8, 1
        self._check_structure([r[2] for r in ctrl])
        tags = [r[-1] for r in ctrl]
        parts = [(state, [r[0] for r in ctrl], state_digests), (buffers, [r[1] for r in ctrl], buffer_digests)]
        # Finite flags cost a pass over a part: only where its replicas differ (one more
        # exchange, 24 bytes per tensor of such a part, with the tensor's digest, which
        # the fingerprint was built from: which tensors differ is free to tell), or for
        # mean mode's check of identical parameters and optimizer state. In the buffers
        # "finite" is relative (see sound_replicas): NaN/Inf the replicas share is state.
        differ = [len(set(fps)) > 1 for _, fps, _ in parts]
        mine = self._patterns_and_digests_row(parts, differ)
        rows = self._gather_ints(mine) if mine else []
        bytes_sent, collectives = bytes_sent + 8 * len(mine), collectives + bool(mine)
        reference_ok = self._reference is not None and len(set(tags)) == 1
        plans, differing = self._plan_parts(parts, differ, rows, reference_ok)
        state_plan, buffers_plan = plans
        if self._buffer_src is not None:
            buffers_plan = as_ddp_would(buffers_plan, state_plan, self._buffer_src)
        # The buffers first, now and blocking, before the next forward updates them:
        # their updates (BatchNorm's running averages) are not additive, so the overlapped
        # correction synced + (w - snapshot) would put a replica's deviation back with the
        # opposite sign (a negative running variance). They are small.
        buffers_done = self._finish_part(self._launch_part(buffers_plan, buffers, overlapped=False), False)
        pending = self._launch_part(state_plan, state, overlapped and not (repair_now and differ[0]))
        return _Sync(ctrl, bytes_sent, collectives, buffers_done, pending, differing, t0,
                     critical=time.perf_counter() - t0)

    def _launch_part(self, plan: SyncPlan, entries: list[Entry], overlapped: bool) -> PartInFlight:
        return self._transfer.launch(plan, self._layout_for(entries), entries, overlapped=overlapped,
                                     opt_steps=self._opt_steps, reference=self._reference)

    def _finish_part(self, p: PartInFlight, state_changed: bool | None) -> PartDone:
        return self._transfer.finish(p, state_changed, live_entries=self._entries, opt_steps=self._opt_steps,
                                     reference=self._reference)

    def _complete(self, state_changed: bool | None) -> SyncReport:
        p = self._pending
        assert p is not None
        self._pending = None
        t1 = time.perf_counter()
        done, buffers = self._finish_part(p.state, state_changed), p.buffers
        self.syncs += 1
        if self._reference is not None:
            self._reference.after_sync(self.syncs, p.ctrl)
        plan, note = done.plan, done.plan.note
        if buffers.plan.mode != "noop":
            if plan.mode == "noop":  # parameters and optimizer state agree: only the buffers moved
                plan, note = buffers.plan, "; ".join(filter(None, ["buffers only", buffers.plan.note]))
            else:
                extra = f" ({buffers.plan.note})" if buffers.plan.note else ""
                note = "; ".join(filter(None, [note, f"buffers: {buffers.plan.mode}{extra}"]))
        t2 = time.perf_counter()
        return SyncReport(
            mode=plan.mode,
            groups=plan.groups,
            source_ranks=plan.sources,
            bytes_sent=p.control_bytes + done.bytes_sent + buffers.bytes_sent,
            seconds=p.critical + (t2 - t1),
            divergence=max(done.divergence, buffers.divergence),
            collectives=p.control_collectives + done.collectives + buffers.collectives,
            wall_seconds=t2 - p.t0,
            overlapped=p.state.overlapped and p.state.plan.mode != "noop",  # a transfer was in flight
            delta_tensors=done.delta_tensors,
            note=note,
            differing_tensors=len(p.differing),
            differing=dict(p.differing[:_LISTED]),
        )
