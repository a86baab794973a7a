"""The reading of a run's records that the plots (:mod:`paft.report`) and the text summary
(:mod:`paft.report_text`) share: where the replicas split, each time, with the ranks
outside the majority and who found it (:func:`replica_splits`, the first
:func:`first_split`), the syncs and repairs and the ones that found the replicas split,
the guard's incidents, a record's values as a series."""

from __future__ import annotations

import math
from typing import Any, TypeGuard

from paft.replicas import outside_majority
from paft.rundata import RunData, number

__all__ = [
    "Split",
    "first_period",
    "first_split",
    "guard_incidents",
    "is_steps",
    "replica_splits",
    "seen_from",
    "series",
    "split_syncs",
    "sync_events",
]


def series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that hold ``key``; a value that is no number is NaN
    (a gap in a plot)."""
    rows = [(int(r["step"]), number(r[key])) for r in records if key in r]
    return [s for s, _ in rows], [v for _, v in rows]


def sync_events(run: RunData) -> list[dict[str, Any]]:
    """PAFT-Sync's syncs and the guard's repairs (a robust sync of its own), in file order."""
    return [e for e in run.events if e.get("event") in ("sync", "repair")]


def seen_from(sync: dict[str, Any]) -> int:
    """The first step whose state fingerprints see a sync's result; a sync recorded
    without it ran after its step's fingerprints."""
    return int(sync.get("seen_from", int(sync["step"]) + 1))


# What differed, as the split line names it: the per-step checksum of the aggregated
# gradient, or the fingerprint of the parameters, buffers and optimizer state.
_MISMATCH = {"grad_mismatch": "aggregated-gradient checksums", "state_mismatch": "training-state fingerprints"}


def _split_in(rec: dict[str, Any]) -> tuple[list[int], list[str]] | None:
    """(ranks outside the largest group, what differed) if the record shows a split."""
    ranks: set[int] = set()
    what: list[str] = []
    for kind, name in (("grad", _MISMATCH["grad_mismatch"]), ("state", _MISMATCH["state_mismatch"])):
        if number(rec.get(f"replicas/{kind}_distinct", 1)) > 1:
            what.append(name)
            ranks.update(int(r) for r in rec.get(f"replicas/{kind}_minority_ranks", []))
    return (sorted(ranks), what) if what else None


Split = tuple[int, list[int], list[str], str]
"""(step, ranks outside the largest group, what differed, who found it: ``""`` the step's
own checks, ``"guard"``, ``"sync"``)."""


def first_period(run: RunData) -> int | None:
    """The sync period the run began with: what a resume that changed the schedule
    recorded (``config.json`` is the last leg's), else the configured one (PAFT-Dyn's
    clamped into [h_min, h_max], as the protector starts it); None where neither says."""
    recorded = next((e["first_period"] for e in run.events_of("period") if "first_period" in e), None)
    if is_steps(recorded):
        return recorded
    protect = run.config.get("protect") or {}
    start = protect.get("sync_period")
    if not is_steps(start):
        return None
    lo, hi = protect.get("h_min"), protect.get("h_max")
    if protect.get("mode") == "dyn" and is_steps(lo) and is_steps(hi):
        return min(max(start, lo), hi)
    return start


def is_steps(value: Any, least: int = 1) -> TypeGuard[int]:
    """Whether a recorded value is a whole number of steps, at least ``least``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def replica_splits(run: RunData) -> list[Split]:
    """Every split of the replicas, at the first step of each stretch they stayed apart:
    a split record (found ``""``: by the step's own checks), a mismatch the guard undid
    (by a recompute or a repair) before the step's record (``"guard"``), or a split a sync
    found before any fingerprint saw it (``"sync"``); at one step in that order. A
    stretch ends where a sync, a repair or the guard left the replicas one, or where a
    state fingerprint found them one: a split after it is another."""
    # (step, order at the step, the split it shows, whether it is a state fingerprint of
    # one replica, from which steps on it left the replicas one: (gradients, state)).
    found: list[tuple[int, int, Split | None, bool, tuple[int, int] | None]] = []
    for r in run.consistency:
        seen = _split_in(r)
        found.append((int(r["step"]), 0, (int(r["step"]), *seen, "") if seen else None,
                      r.get("replicas/state_distinct") == 1, None))
    caught = [g for g in run.events_of("guard") if g.get("detector") in _MISMATCH]
    for step in sorted({int(g["step"]) for g in caught}):
        same_step = [g for g in caught if int(g["step"]) == step]
        what = sorted({_MISMATCH[g["detector"]] for g in same_step})
        ranks = sorted({int(r) for g in same_step for r in g.get("ranks") or []})
        # Undone: the step's update is from an attempt the guard accepted.
        found.append((step, 1, (step, ranks, what, "guard"), False, (step + 1, step + 1)))
    apart = split_syncs(run)
    for e in sync_events(run):
        step = int(e["step"])
        split: Split | None = (step, outside_majority(e["groups"], run.world_size),
                               [_MISMATCH["state_mismatch"]], "sync") if e in apart else None
        # The first update from one replica (an overlapped sync lands within the step after
        # its own), and the first fingerprints that see it (seen_from).
        found.append((step, 2, split, False, (min(seen_from(e), step + 1), seen_from(e))))
    splits: list[Split] = []
    new_from: tuple[float, float] = (0, 0)  # the first step whose split is a new one: by gradients, by state alone
    for step, _, split, whole, ends in sorted(found, key=lambda f: f[:2]):
        if whole:
            new_from = (min(new_from[0], step), min(new_from[1], step))
        # A split in the state alone, seen by fingerprints taken before an overlapped sync
        # landed, is the one the sync ended.
        by_state = split is not None and split[3] != "sync" and _MISMATCH["grad_mismatch"] not in split[2]
        if split is not None and step >= (new_from[1] if by_state else new_from[0]):
            splits.append(split)
            new_from = (math.inf, math.inf)  # apart until something ends it
        if ends is not None and math.isinf(new_from[0]):  # a sync that found one replica ended nothing
            new_from = ends
    return splits


def first_split(run: RunData) -> Split | None:
    """The first of :func:`replica_splits`."""
    splits = replica_splits(run)
    return splits[0] if splits else None


def split_syncs(run: RunData) -> list[dict[str, Any]]:
    """The syncs and repairs whose fingerprints found the parameters or optimizer state
    split (not only the buffers, which differ under DDP's BatchNorm as a rule)."""
    return [e for e in sync_events(run) if len(e.get("groups") or []) > 1
            and not str(e.get("note", "")).startswith("buffers only")]


def guard_incidents(run: RunData) -> list[dict[str, Any]]:
    """The guard events that opened an incident: a first attempt the guard acted on."""
    return [g for g in run.events_of("guard") if g.get("action") != "proceed" and not g.get("attempt")]
