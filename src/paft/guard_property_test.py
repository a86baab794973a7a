"""Property tests for paft.guard: random sequences of attempts, driven as
:class:`~paft.guarded_update.GuardedUpdate` drives them, against the decision table of
the module docstring and docs/GUARD.md.

Each step's attempts are drawn from clean views and faults (non-finite loss or local
gradient on some ranks, a non-finite aggregate everywhere, a gradient mismatch on a set
of ranks, a state split, spikes, the previous attempt again bit for bit) and update
ratios. Every verdict is checked against what the docs promise of it, the counters
against the verdicts, the rerun caps, and a guard restored from ``state_dict`` mid-step
against the original. Derandomized: the same examples on every run, in about 2 s.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paft.config import GuardConfig
from paft.consistency import FLAG_AGG_NONFINITE, ControlView
from paft.guard import CAUSES, Guard, GuardVerdict
from paft.guard_test import FP, NAN, make_view
from paft.replicas import group_replicas, outside_majority

KINDS = ("clean", "clean", "clean", "nan_loss", "nan_local", "nan_agg", "mismatch", "split", "split_mismatch",
         "agg_spike", "loss_spike", "outlier", "again")
RATIOS = (1e-3, 1e-3, 1e-3, 0.3, 5.0, math.inf)
_SPIKES = ("loss_spike", "grad_spike", "rank_outlier", "update_ratio")


def attempt_view(ws: int, step: int, kind: str, ranks: list[int], salt: int, fingerprint: bool) -> ControlView:
    """One attempt of ``step``: its batch's clean values (the same on every attempt), with ``kind`` on ``ranks``."""
    rng = random.Random(step)
    losses = [2.0 * math.exp(rng.gauss(0, 0.1)) for _ in range(ws)]
    local = [1.5 * math.exp(rng.gauss(0, 0.2)) for _ in range(ws)]
    agg = [math.exp(rng.gauss(0, 0.1))] * ws
    fps, flags = [FP] * ws, [0] * ws
    states: list[int | None] | None = [1] * ws if fingerprint or kind.startswith("split") else None
    for r in ranks:
        if kind == "nan_loss":
            losses[r] = NAN
        elif kind == "nan_local":
            local[r] = NAN
        elif kind in ("mismatch", "split_mismatch"):
            fps[r], agg[r] = 1000 + salt, agg[r] * (2 + salt)
        elif kind == "outlier":
            local[r] = 1e6 * (1 + salt)
        if kind.startswith("split") and states is not None:
            states[r] = 50 + salt
    if kind == "nan_agg":
        agg, fps, flags = [NAN] * ws, [-77 - salt] * ws, [FLAG_AGG_NONFINITE] * ws
    elif kind == "agg_spike":
        agg = [1e30 * (1 + salt)] * ws
    elif kind == "loss_spike":
        losses = [9 * x for x in losses]
    return make_view(losses, local, agg, fps=fps, flags=flags, states=states)


def minority(keys: list[int] | None, ws: int) -> list[int] | None:
    """The ranks outside the strict majority of a split (``[]`` without one); None: no split."""
    groups = group_replicas(keys) if keys is not None else []
    return outside_majority(groups, ws) if len(groups) > 1 else None


def restored(g: Guard) -> Guard:
    """A guard loaded from ``g``'s JSON state."""
    h = Guard(g.config, g.world_size)
    h.load_state_dict(json.loads(json.dumps(g.state_dict(), allow_nan=False)))
    assert h.state_dict() == g.state_dict()
    return h


@dataclass
class Ledger:
    """What the verdicts so far say, to check the guard's counters and each next verdict by."""

    g: Guard
    recomputes: int = 0
    skips: int = 0
    rollbacks: int = 0
    detected: set[int] = field(default_factory=set)
    causes: dict[int, str] = field(default_factory=dict)  # by step: its last cause
    # this step's
    reruns: int = 0
    last: tuple[bool, GuardVerdict] | None = None  # (from check_update, verdict)
    split: list[int] | None = None  # the minority of its last state split
    mismatch: list[int] | None = None  # the minority of its last gradient mismatch

    def begin(self) -> None:
        self.reruns, self.last, self.split, self.mismatch = 0, None, None, None

    def check(self, step: int, kind: str, view: ControlView, prev_view: ControlView | None, v: GuardVerdict) -> None:
        """A pre-step verdict against the decision table's rows."""
        ws = self.g.world_size
        split = minority(view.state_fingerprints(), ws)
        mismatch = minority(view.agg_checksum_keys(), ws)
        after = self.last[1] if self.last is not None and not self.last[0] else None  # the check it answers
        if split is not None:  # tried first
            assert v.action in ("repair", "skip", "stop"), v
            if self.split is not None and (set(self.split) & set(split) or not (self.split or split)):
                assert v.cause == "persistent", (self.split, v)  # the repaired replica split again: stuck memory
            self.split = split
        if mismatch:  # a reduction failing again on the same ranks (a strict majority names them)
            if self.mismatch and set(self.mismatch) & set(mismatch):
                assert v.cause == "persistent", (self.mismatch, v)
            self.mismatch = mismatch
        if kind == "clean" and split is None and after is not None and after.action in ("recompute", "repair"):
            # The detection it answers, and the step's cause so far.
            assert (v.action, v.cause) == ("proceed", self.causes.get(step, "transient")), (after, v)
            assert v.detector == (after.detector if after.action == "recompute" else "state_mismatch"), (after, v)
        if (after is not None and after.action == "recompute" and split is None and mismatch is None
                and prev_view is not None and view.header_bits() == prev_view.header_bits()):
            assert v.cause == "data", (after, v)  # reproduced bit for bit
        self.verdict(step, v, post=False)

    def verdict(self, step: int, v: GuardVerdict, post: bool) -> None:
        """Any verdict: its ranks, action and cause, the caps, and the counters so far."""
        cfg = self.g.config
        assert v.ranks == sorted(set(v.ranks)) and all(0 <= r < self.g.world_size for r in v.ranks), v
        if v.action == "stop":
            assert v.cause == "persistent" and cfg.on_persistent == "stop" and not post, v
        if v.action == "repair":
            assert v.detector in ("state_mismatch", "grad_mismatch"), v
        if v.cause == "data":
            assert v.action == "skip" or v.detector == "level_shift", v
        if v.detector == "level_shift":  # after a spike's recompute reproduced it, or with the run's reruns spent
            spent = self.g.counters["recomputes"] >= cfg.max_reruns_per_run
            last = self.last
            assert spent or last is not None and last[0] == post and last[1].action == "recompute" and (
                last[1].detector in _SPIKES), (last, v)
        self.last = (post, v)
        if v.action in ("recompute", "repair"):
            self.recomputes += 1
            self.reruns += 1
            assert self.reruns <= cfg.max_reruns_per_step and self.recomputes <= cfg.max_reruns_per_run, v
        self.skips += v.action == "skip"
        self.rollbacks += post and v.action in ("recompute", "skip")
        if v.detector is not None or v.action != "proceed":
            self.detected.add(step)
        if v.cause is not None:
            self.causes[step] = v.cause
        expected = {"recomputes": self.recomputes, "skipped_batches": self.skips, "rollbacks": self.rollbacks,
                    "detections": len(self.detected),
                    **{c: sum(x == c for x in self.causes.values()) for c in CAUSES}}
        assert self.g.counters == expected, (self.g.counters, expected, v)


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), ws=st.sampled_from([1, 2, 3, 4]), policy=st.sampled_from(["stop", "repair"]),
       per_step=st.integers(1, 3), per_run=st.integers(1, 6), shift_after=st.integers(0, 2))
def test_random_attempts_follow_the_decision_table(data: st.DataObject, ws: int, policy: str, per_step: int,
                                                   per_run: int, shift_after: int) -> None:
    g = Guard(GuardConfig(enabled=True, warmup=2, window=5, on_persistent=policy, max_reruns_per_step=per_step,
                          max_reruns_per_run=per_run, shift_after=shift_after), ws)
    ledger = Ledger(g)
    for t in range(10):
        ledger.begin()
        attempt, prev_view = 0, None
        while True:
            kind = data.draw(st.sampled_from(KINDS)) if t >= 3 else "clean"
            if kind == "again" and prev_view is not None:
                view = prev_view
            elif kind == "again":
                kind = "clean"
                view = attempt_view(ws, t, kind, [], 0, fingerprint=data.draw(st.booleans()))
            else:
                ranks = sorted(data.draw(st.sets(st.integers(0, ws - 1), min_size=1)))
                view = attempt_view(ws, t, kind, ranks, data.draw(st.integers(0, 2)),
                                    fingerprint=attempt > 0 or data.draw(st.booleans()))  # every recompute does
            other = restored(g) if data.draw(st.booleans()) else None
            v = g.check(t, attempt, view)
            if other is not None:  # restored mid-step: the same verdict, the same state after it
                assert other.check(t, attempt, view).to_json() == v.to_json()
                assert other.state_dict() == g.state_dict()
            ledger.check(t, kind, view, prev_view, v)
            prev_view = view
            attempt += 1
            if v.action in ("recompute", "repair"):
                continue
            if v.action != "proceed":
                break
            g.wants_snapshot(t, view)
            ratio = data.draw(st.sampled_from(RATIOS))
            other = restored(g) if data.draw(st.booleans()) else None
            u = g.check_update(t, ratio)
            if other is not None:
                assert other.check_update(t, ratio).to_json() == u.to_json()
                assert other.state_dict() == g.state_dict()
            ledger.verdict(t, u, post=True)
            if u.action == "proceed":
                g.accept(t, view, ratio)
            if u.action != "recompute":
                break
