"""PAFT-Sync's plan: whose values make up the synchronized state.

A sync starts with one small control exchange (see :mod:`paft.sync`): every rank
learns every replica's state fingerprint and whether that replica is finite. From
those alone :func:`plan_sync` decides what the sync does, so every rank computes the
very same :class:`SyncPlan` without another collective, and the rules are tested here
in microseconds (``sync_plan_test.py``), apart from the transfers that carry a plan
out. The rules, in order:

0. ``mean`` with no finite replica: ``RuntimeError``, even where the replicas agree
   (nothing to average from);
1. one fingerprint on every rank: ``noop`` (a mean of identical values could even
   change their last bit);
2. ``broadcast``: copy ``src``; if it is non-finite, the lowest finite rank (none
   finite: ``RuntimeError``, nothing to copy from);
3. ``mean``: average the finite replicas only;
4. ``robust``:

   - a strict majority of identical replicas that is finite: ``majority-copy`` from
     its lowest rank (exact repair of the minority);
   - else exactly one finite replica: ``finite-copy`` of it;
   - else, where a reference is kept (world size 2, see :mod:`paft.sync_reference`):
     ``median-with-reference``, the per-coordinate median of both replicas and the
     last agreed state (a zero state when the ranks' references disagree);
   - else ``median``: the per-coordinate median of all replicas, in which a
     replica holding NaN/Inf still votes where it is finite.

:func:`as_ddp_would` adjusts robust mode's
plan for buffers under DDP, which broadcasts one rank's buffers at every forward.

Example::

    >>> plan = plan_sync("robust", [7, 7, 9, 7], [True] * 4)
    >>> plan.mode, plan.src, plan.minority
    ('majority-copy', 0, [2])
    >>> plan.holds_result(1), plan.holds_result(2)
    (True, False)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from paft.config import SYNC_MODES
from paft.replicas import group_replicas, majority

__all__ = [
    "COPY_MODES",
    "SyncPlan",
    "as_ddp_would",
    "plan_sync",
]

COPY_MODES = ("majority-copy", "finite-copy", "broadcast")
"""Plans whose result is one rank's state, copied bit for bit."""


@dataclass(frozen=True)
class SyncPlan:
    """What a sync does: identical on every rank that planned from the same exchange."""

    mode: str
    """``noop``, ``majority-copy``, ``finite-copy``, ``broadcast``, ``mean``,
    ``median`` or ``median-with-reference``."""
    groups: list[list[int]]
    """Ranks grouped by equal fingerprint, largest group first."""
    sources: list[int]
    """Ranks whose values make up the result."""
    finite: list[bool]
    """Per rank: its replica is finite."""
    src: int = -1
    """The rank copied (copy modes), or the lowest finite rank (``mean``: integer
    tensors are copied from it, never averaged); -1 otherwise."""
    count: int = 0
    """``mean``: how many finite replicas are averaged."""
    minority: list[int] = field(default_factory=list)
    """``majority-copy`` and ``finite-copy``: the ranks to repair (when it is one
    rank, the copy goes point to point; ``broadcast`` always broadcasts)."""
    reference_ok: bool = True
    """``median-with-reference``: the ranks' references agree (else a zero
    reference is used)."""
    note: str = ""
    """Why the plan departs from the mode's plain rule, for the sync's report."""

    def holds_result(self, rank: int) -> bool:
        """Whether the plan leaves ``rank``'s state as it is because it already is the
        result: every rank of a no-op, the copied rank, a majority-copy's majority.
        (Not a check of the bits: under ``broadcast`` a rank equal to ``src`` still
        receives.)"""
        if self.mode == "noop":
            return True
        if self.mode == "majority-copy":
            return rank not in self.minority
        return self.mode in COPY_MODES and rank == self.src


def plan_sync(
    mode: str,
    fingerprints: Sequence[int],
    finite: Sequence[bool],
    *,
    src: int = 0,
    with_reference: bool = False,
    reference_ok: bool = True,
    per_coordinate: bool = False,
) -> SyncPlan:
    """Decide one sync from every rank's fingerprint and finite flag (index = rank).

    ``mode``: ``robust``, ``mean`` or ``broadcast``. ``src``: the rank ``broadcast``
    copies. ``with_reference``: a world-size-2 reference is kept (robust mode, two
    ranks), so that a split is resolved by ``median-with-reference``;
    ``reference_ok``: the two ranks' references agree. ``per_coordinate`` (the
    buffers): with an agreed reference, a split in which one replica holds NaN/Inf the
    other does not is a ``median-with-reference``, not a copy: two ranks cannot tell a
    buffer that gained a NaN from a mask that lost a ``-inf``. The sync then takes the
    sound replica's values except where the other holds an infinity the sound one
    lacks, where the median with the last agreed buffers decides
    (:func:`paft.robust.sound_where_it_can_tell_`).
    """
    if mode not in SYNC_MODES:
        raise ValueError(f"mode must be one of {SYNC_MODES}, got {mode!r}")
    ws = len(fingerprints)
    if ws == 0 or len(finite) != ws:
        raise ValueError(f"need one fingerprint and one finite flag per rank, got {ws} and {len(finite)}")
    if not 0 <= src < ws:
        raise ValueError(f"src must be a rank in [0, {ws}), got {src!r}")
    fps, finite = list(fingerprints), [bool(f) for f in finite]
    groups = group_replicas(fps)
    everyone = list(range(ws))
    good = [r for r in everyone if finite[r]]
    bad = [r for r in everyone if not finite[r]]
    # mean refuses identical replicas too when none is finite (ReplicaSync checks
    # identical parameters and optimizer state in mean mode): nothing to average from.
    if not good and mode == "mean":
        raise _nothing_to_take(mode, ws, "average")
    if len(groups) == 1:
        return SyncPlan("noop", groups, everyone, finite)
    if not good and mode == "broadcast":
        raise _nothing_to_take(mode, ws, "copy")
    if mode == "broadcast":
        copied = src if finite[src] else good[0]
        note = f"source rank {src} is non-finite; copied rank {copied}" if copied != src else ""
        return SyncPlan("broadcast", groups, [copied], finite, src=copied, note=note)
    if mode == "mean":
        note = f"non-finite ranks {bad} excluded" if bad else ""
        return SyncPlan("mean", groups, good, finite, src=good[0], count=len(good), note=note)
    maj = majority(fps)
    if maj is not None and finite[maj[0]]:
        return SyncPlan("majority-copy", groups, [maj[0]], finite, src=maj[0],
                        minority=[r for r in everyone if r not in maj])
    note = "majority is non-finite; " if maj is not None else ""
    if len(good) == 1 and not (with_reference and reference_ok and per_coordinate):  # copy the one sound replica
        return SyncPlan("finite-copy", groups, good, finite, src=good[0], minority=bad,
                        note=f"{note}non-finite ranks {bad} excluded")
    if good and bad:  # one sound rank only with a reference, for the buffers (per_coordinate)
        note += f"non-finite ranks {bad} outvoted where non-finite; "
    elif not good:
        note += "every rank holds NaN/Inf; "
    if with_reference:
        if not reference_ok:
            note += "references disagree; used a zero reference"
        return SyncPlan("median-with-reference", groups, everyone, finite,
                        reference_ok=reference_ok, note=note.rstrip("; "))
    if not good:
        note += "where the median is non-finite, the finite values' median"
    return SyncPlan("median", groups, everyone, finite, note=note.rstrip("; "))


def _nothing_to_take(mode: str, ws: int, what: str) -> RuntimeError:
    return RuntimeError(
        f"ReplicaSync(mode={mode!r}): no replica is finite (NaN/Inf on all {ws} ranks); "
        f"nothing to {what} from -- restore a checkpoint"
    )


def as_ddp_would(buffers: SyncPlan, state: SyncPlan, source: int) -> SyncPlan:
    """Robust mode's plan for the buffers, under DDP with ``broadcast_buffers``.

    Buffers without a majority are the normal case under DDP with BatchNorm: each rank
    updates its running statistics from its own batch. A median of them would leave
    the fault-free trajectory; copying those of DDP's buffer ``source`` rank does not,
    since DDP's next forward broadcasts them anyway. Not where that rank's buffers
    hold NaN/Inf of their own, or its parameters and optimizer state are in the
    minority that ``state`` repairs: then ``buffers`` stands.
    """
    if buffers.mode not in ("median", "median-with-reference"):
        return buffers
    if not buffers.finite[source] or source in state.minority:
        return buffers
    return replace(buffers, mode="broadcast", sources=[source], src=source, reference_ok=True,
                   note=f"DDP's buffer source, rank {source}")
