"""Tests for paft.guard: detectors, the recompute / attribution state machine, caps, state.

Pure: ControlView matrices are built directly with ControlVector.pack, no process
group. The whole file runs in about a second.
"""

from __future__ import annotations

import doctest
import json
import math
import random
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

import paft.guard
from paft.config import GuardConfig
from paft.consistency import (
    FLAG_AGG_NONFINITE,
    FLAG_LOCAL_NONFINITE,
    FLAG_LOSS_NONFINITE,
    ControlVector,
    ControlView,
)
from paft.guard import Guard, GuardVerdict

NAN = math.nan
FP = 0x1234_5678_9ABC_DEF  # an aggregated-gradient fingerprint all healthy ranks share


def make_view(
    losses: Sequence[float],
    local: Sequence[float],
    agg: Sequence[float] | float,
    fps: Sequence[int] | None = None,
    flags: Sequence[int] | None = None,
    faults: Sequence[int] | None = None,
    states: Sequence[int | None] | None = None,
) -> ControlView:
    ws = len(losses)
    agg = [float(agg)] * ws if isinstance(agg, (int, float)) else list(agg)
    rows = [
        ControlVector(
            loss=float(losses[r]),
            local_sq=float(local[r]) ** 2,
            agg_norm=agg[r],
            agg_checksum=(fps or [FP] * ws)[r],
            state_fingerprint=(states or [None] * ws)[r],
            flags=(flags or [0] * ws)[r],
            faults=(faults or [0] * ws)[r],
            sketch=None,
        ).pack(0)
        for r in range(ws)
    ]
    return ControlView(torch.stack(rows))


def steady(ws: int, loss: float = 2.0, local: float = 1.5, agg: float = 1.0) -> ControlView:
    return make_view([loss] * ws, [local] * ws, agg)


def guard(ws: int = 4, **kw: object) -> Guard:
    kw.setdefault("enabled", True)
    return Guard(GuardConfig(**kw), ws)  # type: ignore[arg-type]


def warm(g: Guard, steps: int = 30, seed: int = 0) -> int:
    """Accept ``steps`` clean, mildly noisy steps; return the next step index."""
    rng = random.Random(seed)
    ws = g.world_size
    for t in range(steps):
        view = make_view([2.0 * math.exp(rng.gauss(0, 0.1)) for _ in range(ws)],
                         [1.5 * math.exp(rng.gauss(0, 0.2)) for _ in range(ws)],
                         math.exp(rng.gauss(0, 0.1)))
        assert g.check(t, 0, view).action == "proceed"
        g.wants_snapshot(t, view)
        ratio = 1e-3 * math.exp(rng.gauss(0, 0.1))
        assert g.check_update(t, ratio).action == "proceed"
        g.accept(t, view, ratio)
    return steps


# --------------------------------------------------------------------------- clean runs


def clean_run(ws: int, seed: int, steps: int) -> Iterator[tuple[ControlView, float]]:
    """A realistic fault-free run: decreasing loss, ranks' local losses tens of percent
    apart, a grad-norm bump during LR warm-up and a later one, occasional benign
    1.8x grad-norm blips, update ratio following the LR schedule."""
    rng = random.Random(seed * 1000 + ws)
    for t in range(steps):
        base = 1.5 + 3.0 * math.exp(-t / 80)
        losses = [base * math.exp(rng.gauss(0, 0.15)) for _ in range(ws)]
        g = 0.8 + 2.5 * math.exp(-(((t - 25) / 12) ** 2)) + 1.2 * math.exp(-(((t - 300) / 20) ** 2))
        g *= math.exp(rng.gauss(0, 0.12)) * (1.8 if rng.random() < 0.02 else 1.0)
        local = [g * 0.8 * math.sqrt(ws) * math.exp(rng.gauss(0, 0.25)) for _ in range(ws)]
        lr = min(1.0, (t + 1) / 20) * (0.55 + 0.45 * math.cos(math.pi * t / steps))
        fp = rng.getrandbits(62)
        yield make_view(losses, local, g, fps=[fp] * ws), 2e-3 * lr * math.exp(rng.gauss(0, 0.1))


def bimodal_run(ws: int, seed: int, steps: int) -> Iterator[tuple[ControlView, float]]:
    """Late training on an easy task: near-zero per-rank losses, and now and then a
    rank whose batch holds a misclassified example (loss and grad norm ~100x)."""
    rng = random.Random(seed)
    for _ in range(steps):
        hard = [rng.random() < 0.1 for _ in range(ws)]
        losses = [rng.uniform(0.05, 0.25) if h else 1e-3 * math.exp(rng.gauss(0, 0.5)) for h in hard]
        local = [rng.uniform(0.5, 2.0) if h else 0.01 * math.exp(rng.gauss(0, 0.5)) for h in hard]
        agg = math.sqrt(sum(x * x for x in local)) / ws
        yield make_view(losses, local, agg), 1e-4 * math.exp(rng.gauss(0, 0.3))


def drive_clean(g: Guard, run: Iterator[tuple[ControlView, float]]) -> int:
    """Run a clean sequence, asserting no detector fires; return the snapshots asked for after warm-up."""
    armed = 0
    for t, (view, ratio) in enumerate(run):
        v = g.check(t, 0, view)
        assert (v.action, v.detector) == ("proceed", None), (t, v)
        snap = g.wants_snapshot(t, view)
        armed += snap and t >= g.config.warmup
        u = g.check_update(t, ratio)
        assert (u.action, u.detector) == ("proceed", None), (t, u)
        g.accept(t, view, ratio)
    assert all(n == 0 for n in g.counters.values()), g.counters
    return armed


@pytest.mark.parametrize("ws", [2, 4, 8])
@pytest.mark.parametrize("seed", range(3))
def test_clean_runs_never_fire(ws: int, seed: int) -> None:
    armed = drive_clean(guard(ws), clean_run(ws, seed, 400))
    assert armed <= 8  # snapshots after warm-up: rare near misses (< 2% of steps)


@pytest.mark.parametrize("ws", [2, 4])
@pytest.mark.parametrize("seed", range(3))
def test_clean_heavy_tailed_near_zero_losses_never_fire(ws: int, seed: int) -> None:
    drive_clean(guard(ws), bimodal_run(ws, seed, 600))


def floor_run(ws: int, steps: int) -> Iterator[tuple[ControlView, float]]:
    """A hinge loss at its floor: every loss, norm and update exactly 0, and every 20th
    step one rank's batch holds a small-margin example (loss 0.075)."""
    for t in range(steps):
        hard = t % 20 == 10
        losses = [0.075 if hard and r == t % ws else 0.0 for r in range(ws)]
        local = [0.1 if x else 0.0 for x in losses]
        yield make_view(losses, local, max(local) / ws), 1e-4 if hard else 0.0


@pytest.mark.parametrize("ws", [2, 3])
def test_a_loss_at_its_floor_of_exact_zeros_never_fires(ws: int) -> None:
    # Against a history of exact zeros every positive value was a spike (a limit of
    # 1e-11), reproduced on the rerun and skipped as bad data, every time.
    g = guard(ws)
    drive_clean(g, floor_run(ws, 200))
    # a flipped exponent still fires after such a history
    zeros = [0.0] * ws
    assert g.check(200, 0, make_view([1e38, *zeros[1:]], zeros, 0.0)).detector in ("rank_outlier", "loss_spike")
    assert guard(ws).check(0, 0, make_view(zeros, zeros, 1e38)).detector is None  # no history: nothing to judge by
    g = guard(ws)
    drive_clean(g, floor_run(ws, 5))
    assert g.check(5, 0, make_view(zeros, zeros, 1e38)).detector == "grad_spike"


def test_clean_run_with_short_warmup_and_lower_thresholds() -> None:
    drive_clean(guard(4, warmup=5, spike_threshold=6.0, outlier_threshold=12.0), clean_run(4, 7, 400))


def test_world_size_one() -> None:
    g = guard(1)
    t = warm(g)
    assert g.check(t, 0, make_view([2.0], [1e36], 1e36)).detector == "grad_spike"
    assert g.check(t, 1, make_view([2.0], [1.0], 1.0)).cause == "transient"


# --------------------------------------------------------------------------- detectors


def test_nonfinite_loss_by_flag_and_by_value() -> None:
    g = guard(4)
    v = g.check(0, 0, make_view([2.0, 3.0, 2.0, 2.0], [1.0] * 4, 1.0, flags=[0, FLAG_LOSS_NONFINITE, 0, 0]))
    assert (v.action, v.detector, v.ranks, v.cause) == ("recompute", "nonfinite_loss", [1], None)
    v = guard(4).check(0, 0, make_view([2.0, 2.0, NAN, 2.0], [1.0] * 4, 1.0))
    assert (v.detector, v.ranks) == ("nonfinite_loss", [2])
    assert json.dumps(v.to_json(), allow_nan=False)  # NaN became a string
    assert v.to_json()["values"]["value"] == "nan"
    # Every rank's loss: every rank (only the aggregate's suspects come from the local values).
    v = guard(4).check(0, 0, make_view([NAN] * 4, [1.0] * 4, 1.0))
    assert (v.detector, v.ranks) == ("nonfinite_loss", [0, 1, 2, 3])


def test_nonfinite_local_and_aggregated_gradients() -> None:
    v = guard(4).check(0, 0, make_view([2.0] * 4, [1.0, 1.0, 1.0, math.inf], 1.0))
    assert (v.detector, v.ranks) == ("nonfinite_local_grad", [3])
    v = guard(4).check(0, 0, make_view([2.0] * 4, [1.0] * 4, 1.0, flags=[0, 0, FLAG_LOCAL_NONFINITE, 0]))
    assert (v.detector, v.ranks) == ("nonfinite_local_grad", [2])
    # NaN received by one rank only (aggregation SDC): that rank.
    v = guard(4).check(0, 0, make_view([2.0] * 4, [1.0] * 4, [1.0, NAN, 1.0, 1.0], fps=[FP, 5, FP, FP]))
    assert (v.detector, v.ranks) == ("nonfinite_agg_grad", [1])
    v = guard(4).check(0, 0, make_view([2.0] * 4, [1.0] * 4, [1.0, NAN, NAN, 1.0], fps=[FP, 5, 5, FP]))
    assert (v.detector, v.ranks) == ("nonfinite_agg_grad", [1, 2])
    # Every rank's aggregate overflowed from finite inputs: blame the huge local gradient.
    g = guard(4)
    t = warm(g)
    v = g.check(t, 0, make_view([2.0] * 4, [1.5, 1.5, 1e30, 1.5], math.inf, flags=[FLAG_AGG_NONFINITE] * 4))
    assert (v.detector, v.ranks) == ("nonfinite_agg_grad", [2])


def test_bit30_flip_in_aggregate_is_a_grad_spike() -> None:
    g = guard(4)
    t = warm(g)
    v = g.check(t, 0, make_view([2.0] * 4, [1.5] * 4, 3.4e36))  # same bytes everywhere: no mismatch
    assert (v.action, v.detector, v.ranks) == ("recompute", "grad_spike", [])
    assert v.values["value"] == pytest.approx(3.4e36) and v.values["limit"] < 10


def test_bit30_flip_in_local_gradient_names_the_rank() -> None:
    g = guard(4)
    t = warm(g)
    v = g.check(t, 0, make_view([2.0] * 4, [1.5, 1.5, 1.5, 4e36], 1e36))
    assert (v.detector, v.ranks) == ("rank_outlier", [3])


def test_the_aggregated_norm_is_judged_by_its_largest_rank() -> None:
    # The checksums agree, one rank's norm does not (a fault in that norm's own reduction).
    g = guard(4)
    t = warm(g)
    v = g.check(t, 0, make_view([2.0] * 4, [1.5] * 4, [1.0, 1.0, 1e36, 1.0]))
    assert (v.detector, v.values["value"]) == ("grad_spike", 1e36)
    uneven = make_view([2.0] * 4, [1.5] * 4, [1.0, 1.2, 1.0, 1.0])
    assert g.check(t, 0, uneven).values["grad_norm"] == 1.2
    g.accept(t, uneven)
    assert g.state_dict()["windows"]["grad"][-1] == 1.2  # the history holds the same largest norm


@pytest.mark.parametrize("ws,local,suspects", [(4, [1.5, 1.5, 1.5, 7.0], [3]), (2, [7.0, 7.0], [])])
def test_a_spike_names_the_ranks_whose_own_values_spike_and_none_where_all_do(
        ws: int, local: list[float], suspects: list[int]) -> None:
    # 7.0 is above a local norm's limit at spike_threshold (about 5.5), not at outlier_threshold (about 9).
    g = guard(ws)
    t = warm(g)
    v = g.check(t, 0, make_view([2.0] * ws, local, 1e4))
    assert (v.detector, v.ranks) == ("grad_spike", suspects)


@pytest.mark.parametrize("above", [False, True])
def test_a_value_at_its_limit_is_no_detection(above: bool) -> None:
    # A flat history makes the limits exact: the loss 2 + 10 * 5% * 2, the aggregated
    # norm 1 + 10 * 50% * 1, a local norm 1.5 + 20 * 25% * 1.5 by its history and its peers.
    g = guard(4)
    for s in range(25):
        assert g.check(s, 0, steady(4)).action == "proceed"
        g.accept(s, steady(4))

    def at(x: float) -> float:
        return math.nextafter(x, math.inf) if above else x

    cases = ((steady(4, agg=at(6.0)), "grad_spike"), (make_view([at(3.0)] * 4, [1.5] * 4, 1.0), "loss_spike"),
             (make_view([2.0] * 4, [1.5, 1.5, 1.5, at(9.0)], 1.0), "rank_outlier"))
    assert [g.check(25, 0, view).detector for view, _ in cases] == [d if above else None for _, d in cases]


def test_rank_outlier_reports_the_worst_rank() -> None:
    g = guard(5)
    t = warm(g)
    v = g.check(t, 0, make_view([2.0, 2.0, 90.0, 2.0, 60.0], [1.5] * 5, 1.0))
    assert (v.detector, v.ranks, v.values["loss_value"]) == ("rank_outlier", [2, 4], 90.0)


def test_grad_mismatch_names_the_minority() -> None:
    v = guard(4).check(0, 0, make_view([2.0] * 4, [1.0] * 4, [1.0, 1.0, 1e36, 1.0], fps=[FP, FP, 99, FP]))
    assert (v.action, v.detector, v.ranks) == ("recompute", "grad_mismatch", [2])
    # A flip too small to see in the norm still splits the fingerprints.
    v = guard(4).check(0, 0, make_view([2.0] * 4, [1.0] * 4, 1.0, fps=[FP, 7, FP, FP]))
    assert (v.detector, v.ranks) == ("grad_mismatch", [1])


def test_grad_mismatch_two_ranks_tie_broken_by_history() -> None:
    g = guard(2)
    t = warm(g)
    v = g.check(t, 0, make_view([2.0] * 2, [1.5] * 2, [2e36, 1.0], fps=[3, FP]))
    assert (v.detector, v.ranks) == ("grad_mismatch", [0])
    # Both norms plausible: which rank is wrong is unknown.
    v = g.check(t + 1, 0, make_view([2.0] * 2, [1.5] * 2, [1.0, 1.0], fps=[3, FP]))
    assert (v.detector, v.ranks) == ("grad_mismatch", [])
    # Without history, no guess either.
    v = guard(2).check(0, 0, make_view([2.0] * 2, [1.5] * 2, [2e36, 1.0], fps=[3, FP]))
    assert (v.detector, v.ranks) == ("grad_mismatch", [])


@pytest.mark.parametrize("agg,threshold,suspects", [
    ([1.0, 1.1], 10.0, []),  # both plausible: 10% is within the 50% floor of the median
    ([1e36, 2e36], 10.0, []),  # both far off: which one is wrong is unknown
    ([1.0, 1e-3], 1.5, [1]),  # a flip can shrink a value too
])
def test_grad_mismatch_two_ranks_against_a_flat_history(agg: list[float], threshold: float,
                                                        suspects: list[int]) -> None:
    g = guard(2, spike_threshold=threshold)
    for s in range(5):
        assert g.check(s, 0, steady(2)).action == "proceed"
        g.accept(s, steady(2))
    v = g.check(5, 0, make_view([2.0] * 2, [1.5] * 2, agg, fps=[3, FP]))
    assert (v.detector, v.ranks) == ("grad_mismatch", suspects)


def test_loss_spike() -> None:
    g = guard(4)
    t = warm(g)
    v = g.check(t, 0, make_view([9.0] * 4, [1.5] * 4, 1.0))
    assert (v.detector, v.ranks) == ("loss_spike", [])
    # A 30% rise is noise-sized for the default threshold; downward never counts.
    assert g.check(t, 0, make_view([2.6] * 4, [1.5] * 4, 1.0)).action == "proceed"
    assert g.check(t, 0, make_view([0.01] * 4, [1.5] * 4, 0.01)).action == "proceed"


def test_rank_outlier_needs_both_peers_and_history() -> None:
    g = guard(4)
    t = warm(g)
    v = g.check(t, 0, make_view([2.0, 2.0, 2.0, 60.0], [1.5] * 4, 1.0))
    assert (v.detector, v.ranks) == ("rank_outlier", [3])
    assert v.values["loss_value"] == 60.0
    # Tens of percent apart is ordinary data parallelism.
    assert g.check(t, 0, make_view([1.5, 2.0, 2.6, 3.2], [0.9, 1.5, 2.4, 3.0], 1.0)).action == "proceed"
    # Far from the peers but within what local values have looked like: not an outlier.
    g2 = guard(4)
    for s in range(30):
        view = make_view([1e-3, 1e-3, 0.2 if s % 3 else 1e-3, 1e-3], [0.01] * 4, 0.01)
        assert g2.check(s, 0, view).action == "proceed"
        g2.accept(s, view)
    assert g2.check(30, 0, make_view([1e-3, 1e-3, 1e-3, 0.2], [0.01] * 4, 0.01)).action == "proceed"


def test_rank_outlier_two_ranks_against_history() -> None:
    g = guard(2)
    t = warm(g)
    v = g.check(t, 0, make_view([2.0, 2.0], [1.5, 300.0], 1.0))
    assert (v.detector, v.ranks) == ("rank_outlier", [1])
    assert g.check(t, 0, make_view([2.0, 2.0], [1.5, 4.0], 1.0)).action == "proceed"


def test_warmup_arms_spikes_gross_jumps_fire_earlier() -> None:
    g = guard(4, warmup=20)
    for t in range(19):
        view = steady(4)
        assert g.check(t, 0, view).action == "proceed"
        g.accept(t, view)
    # 50x is a spike only once armed ...
    assert g.check(19, 0, steady(4, agg=50.0)).action == "proceed"
    g.accept(19, steady(4))
    assert g.check(20, 0, steady(4, agg=50.0)).detector == "grad_spike"
    # ... while a bit-30 magnitude fires from the first accepted step on.
    g2 = guard(2, warmup=20)
    assert g2.check(0, 0, steady(2, agg=1e36)).action == "proceed"  # nothing to compare with yet
    g2.accept(0, steady(2))
    assert g2.check(1, 0, steady(2, agg=1e36)).detector == "grad_spike"


@pytest.mark.parametrize("ws", [3, 4])
def test_peers_catch_a_gross_local_value_at_the_first_step(ws: int) -> None:
    g = guard(ws)
    local = [1.0] * ws
    local[1] = 1e36
    bad = make_view([2.0] * ws, local, 1e35)
    v = g.check(0, 0, bad)
    assert (v.action, v.detector, v.ranks) == ("recompute", "rank_outlier", [1])
    v = g.check(0, 1, bad)  # reproduced before any step was accepted: bad data all the same
    assert (v.action, v.detector, v.ranks, v.cause) == ("skip", "rank_outlier", [1], "data")


# --------------------------------------------------------------------------- state machine


def test_transient_recompute_then_proceed() -> None:
    g = guard(4)
    t = warm(g)
    v0 = g.check(t, 0, make_view([2.0] * 4, [1.5, 1.5, 4e36, 1.5], 1e36, faults=[0, 0, 1, 0]))
    assert (v0.action, v0.cause, v0.ranks) == ("recompute", None, [2])
    v1 = g.check(t, 1, steady(4))
    assert (v1.action, v1.detector, v1.ranks, v1.cause) == ("proceed", "rank_outlier", [2], "transient")
    assert g.counters == {"detections": 1, "recomputes": 1, "skipped_batches": 0, "transient": 1,
                          "persistent": 0, "data": 0, "state": 0, "rollbacks": 0}


def nan_data_view(ws: int, rank: int, states: list[int | None] | None = None) -> ControlView:
    """NaN in rank ``rank``'s input: NaN loss there, NaN everywhere after the all-reduce."""
    losses = [2.0] * ws
    losses[rank] = NAN
    local = [1.5] * ws
    local[rank] = NAN
    flags = [FLAG_AGG_NONFINITE] * ws
    flags[rank] |= FLAG_LOSS_NONFINITE | FLAG_LOCAL_NONFINITE
    return make_view(losses, local, NAN, fps=[-77] * ws, flags=flags, states=states)


def test_state_mismatch_past_the_rerun_cap_is_repaired_and_skipped() -> None:
    g = guard(3, max_reruns_per_run=1)
    t = warm(g)
    split = make_view([2.0] * 3, [1.5] * 3, 1.0, states=[5, 9, 5])
    assert g.check(t, 0, split).action == "repair"  # spends the run's one rerun
    v = g.check(t + 1, 0, split)
    assert (v.action, v.detector, v.ranks, v.cause) == ("skip", "state_mismatch", [1], "state")


def test_data_is_still_data_when_only_the_rerun_fingerprints_the_state() -> None:
    g = guard(3)
    t = warm(g)
    assert g.check(t, 0, nan_data_view(3, 1)).action == "recompute"
    v1 = g.check(t, 1, nan_data_view(3, 1, states=[5, 5, 5]))  # replicas agree: the data
    assert (v1.action, v1.cause) == ("skip", "data")


@pytest.mark.parametrize("ws,states,minority", [(3, [5, 9, 5], [1]), (2, [5, 9], [])])
def test_state_mismatch_repairs_then_recomputes(ws: int, states: list[int], minority: list[int]) -> None:
    # A corrupted replica reproduces its bad step on every rerun: re-synchronize first.
    g = guard(ws)
    t = warm(g)
    v0 = g.check(t, 0, nan_data_view(ws, 1, states=states))
    assert (v0.action, v0.detector, v0.ranks, v0.cause) == ("repair", "state_mismatch", minority, "state")
    v1 = g.check(t, 1, make_view([2.0] * ws, [1.5] * ws, 1.0, states=[5] * ws))
    assert (v1.action, v1.detector, v1.cause) == ("proceed", "state_mismatch", "state")
    assert (g.counters["detections"], g.counters["recomputes"], g.counters["state"], g.counters["data"]) == (1, 1, 1, 0)


@pytest.mark.parametrize("policy,action", [("stop", "stop"), ("repair", "repair")])
def test_a_replica_corrupted_again_after_its_repair_is_persistent(policy: str, action: str) -> None:
    # Stuck memory: the repaired rank's state differs again on the rerun.
    g = guard(3, on_persistent=policy)
    t = warm(g)
    split = make_view([2.0] * 3, [1.5] * 3, 1.0, states=[5, 9, 5])
    assert g.check(t, 0, split).action == "repair"
    v1 = g.check(t, 1, make_view([2.0] * 3, [1.5] * 3, 1.0, states=[6, 8, 6]))
    assert (v1.action, v1.detector, v1.ranks, v1.cause) == (action, "state_mismatch", [1], "persistent")
    assert (g.counters["persistent"], g.counters["state"], g.counters["detections"]) == (1, 0, 1)
    other = guard(3, on_persistent=policy)  # another rank corrupted on the rerun: not persistent
    t = warm(other)
    other.check(t, 0, split)
    assert other.check(t, 1, make_view([2.0] * 3, [1.5] * 3, 1.0, states=[6, 6, 8])).cause == "state"
    assert other.counters["detections"] == 1  # what a step's recompute finds is the same incident
    spread = guard(3, on_persistent=policy)  # no majority on the rerun: no rank named twice
    t = warm(spread)
    spread.check(t, 0, split)
    assert spread.check(t, 1, make_view([2.0] * 3, [1.5] * 3, 1.0, states=[6, 7, 8])).cause == "state"


@pytest.mark.parametrize("between", ["rollback", "detection"])
def test_a_replica_corrupted_again_after_a_rollback_or_another_detection_is_persistent(between: str) -> None:
    # Only the split right before was compared: with a rolled-back update or another
    # fault's recompute between the repair and the split again, the stuck replica was
    # "state" again, repaired until the cap, and a run asked to stop on a persistent fault went on.
    g = guard(3, on_persistent="stop", max_reruns_per_step=3)
    t = warm(g)
    assert g.check(t, 0, make_view([2.0] * 3, [1.5] * 3, 1.0, states=[5, 9, 5])).action == "repair"
    if between == "rollback":
        clean = make_view([2.8] * 3, [1.5] * 3, 1.0, states=[5, 5, 5])
        assert g.check(t, 1, clean).action == "proceed" and g.wants_snapshot(t, clean)
        assert g.check_update(t, math.inf).action == "recompute"
    else:
        assert g.check(t, 1, make_view([2.0] * 3, [1.5] * 3, 1.0, fps=[FP, FP, 3], states=[5, 5, 5])).ranks == [2]
    restored = guard(3, on_persistent="stop", max_reruns_per_step=3)  # the step in flight, saved and loaded
    restored.load_state_dict(json.loads(json.dumps(g.state_dict())))
    for h in (g, restored):
        v = h.check(t, 2, make_view([2.0] * 3, [1.5] * 3, 1.0, states=[6, 8, 6]))  # rank 1 split again
        assert (v.action, v.detector, v.ranks, v.cause) == ("stop", "state_mismatch", [1], "persistent")
        assert (h.counters["persistent"], h.counters["state"]) == (1, 0)


@pytest.mark.parametrize("policy,action", [("stop", "stop"), ("repair", "repair")])
def test_two_replicas_split_again_after_their_repair_is_persistent(policy: str, action: str) -> None:
    # No majority names the stuck replica, either time: persistent all the same, as a
    # grad_mismatch that comes back, with the rank left unnamed.
    g = guard(2, on_persistent=policy)
    t = warm(g)
    assert g.check(t, 0, make_view([2.0] * 2, [1.5] * 2, 1.0, states=[1, 2])).action == "repair"
    v1 = g.check(t, 1, make_view([2.0] * 2, [1.5] * 2, 1.0, states=[1, 3]))
    assert (v1.action, v1.detector, v1.ranks, v1.cause) == (action, "state_mismatch", [], "persistent")
    assert (g.counters["detections"], g.counters["persistent"], g.counters["state"]) == (1, 1, 0)


def test_a_state_mismatch_found_by_the_recompute_is_the_same_incident() -> None:
    # A parameter corrupted at rest on a step without fingerprints: first seen as a rank
    # outlier, then, on the recompute (which fingerprints the state), as a split.
    g = guard(3)
    t = warm(g)
    assert g.check(t, 0, make_view([2.0, 400.0, 2.0], [1.5, 60.0, 1.5], 20.0)).action == "recompute"
    assert g.check(t, 1, make_view([2.0, 400.0, 2.0], [1.5, 60.0, 1.5], 20.0, states=[1, 2, 1])).action == "repair"
    assert g.check(t, 2, steady(3)).cause == "state"
    assert (g.counters["detections"], g.counters["recomputes"]) == (1, 2)


@pytest.mark.parametrize("ws", [2, 4])
def test_data_nan_is_skipped(ws: int) -> None:
    g = guard(ws, shift_after=1)  # NaN batches never count towards a level shift
    t = warm(g)
    for step in (t, t + 1):
        v0 = g.check(step, 0, nan_data_view(ws, 1))
        assert (v0.action, v0.detector, v0.ranks) == ("recompute", "nonfinite_loss", [1])
        v1 = g.check(step, 1, nan_data_view(ws, 1))
        assert (v1.action, v1.detector, v1.ranks, v1.cause) == ("skip", "nonfinite_loss", [1], "data")
    assert (g.counters["data"], g.counters["skipped_batches"], g.counters["persistent"]) == (2, 2, 0)
    # The next step starts afresh.
    assert g.check(t + 2, 0, steady(ws)).action == "proceed"


def test_a_lasting_rise_is_taken_as_the_new_level_after_shift_after_skips() -> None:
    # A learning-rate restart lifts the loss for good: every batch is a spike that
    # reproduces, and skipping each as data would stall the run for ever.
    g = guard(4, shift_after=3)
    t = warm(g)
    high = make_view([9.0] * 4, [1.5] * 4, 1.0)
    for step in range(t, t + 3):
        assert g.check(step, 0, high).action == "recompute"
        assert (g.check(step, 1, high).action, g.counters["skipped_batches"]) == ("skip", step - t + 1)
    g.check(t + 3, 0, high)
    v = g.check(t + 3, 1, high)
    assert (v.action, v.detector, v.cause) == ("proceed", "level_shift", "data")
    g.wants_snapshot(t + 3, high)
    g.accept(t + 3, high, 0.01)
    assert g.check(t + 4, 0, high).action == "proceed"  # the statistics start over, at the new level
    assert g.check(t + 4, 0, make_view([30.0] * 4, [1.5] * 4, 1.0)).action == "proceed"  # warming up: gross jumps only
    assert g.state_dict()["data_skips"] == 0
    # A batch applied between two skips starts the count again.
    g = guard(4, shift_after=2)
    t = warm(g)
    actions = []
    for step, view in enumerate((high, steady(4), high, high), start=t):
        v = g.check(step, 0, view)
        if v.action == "recompute":
            v = g.check(step, 1, view)
        if v.action == "proceed":
            g.wants_snapshot(step, view)
            g.accept(step, view, 1e-3)
        actions.append(v.action)
    assert actions == ["skip", "proceed", "skip", "skip"]
    never = guard(4, shift_after=0)  # skip for ever, as asked
    t = warm(never)
    for step in range(t, t + 8):
        never.check(step, 0, high)
        assert never.check(step, 1, high).action == "skip"


def test_a_batch_applied_with_an_unrolled_back_update_anomaly_restarts_the_count_of_skips() -> None:
    # docs/GUARD.md: a level shift needs --shift-after skips "with none applied between
    # them". A batch applied whose update fired where no snapshot was taken kept the
    # count going (only its values stay out of the history), and the next spike was applied.
    g = guard(4, shift_after=1)
    t = warm(g)
    high = make_view([9.0] * 4, [1.5] * 4, 1.0)
    assert g.check(t, 0, high).action == "recompute" and g.check(t, 1, high).action == "skip"
    assert g.check(t + 1, 0, steady(4)).action == "proceed" and not g.wants_snapshot(t + 1, steady(4))
    assert g.check_update(t + 1, 5.0).detector == "update_ratio"  # not armed: a record, the update kept
    g.accept(t + 1, steady(4), 5.0)
    assert g.check(t + 2, 0, high).action == "recompute"
    v = g.check(t + 2, 1, high)
    assert (v.action, v.detector, v.cause) == ("skip", "loss_spike", "data")


def test_spikes_skipped_at_the_rerun_cap_count_towards_a_level_shift_only_when_every_rank_rose() -> None:
    # Once the run's rerun budget is spent every detection skips its batch unrecomputed.
    # Counted as data, five such skips made a stuck rank's 1000-fold gradient norms a
    # "level_shift" that was applied, and the restarted statistics let the next ones by.
    spent = guard(4, shift_after=3, max_reruns_per_run=1)
    t = warm(spent)
    high = make_view([9.0] * 4, [1.5] * 4, 1.0)
    spent.check(t, 0, high)  # the budget's one rerun: a spike that reproduces, skipped as data
    assert (spent.check(t, 1, high).cause, spent.state_dict()["data_skips"]) == ("data", 1)
    for k, step in enumerate(range(t + 1, t + 10)):
        faulty = make_view([2.0, 60.0 + 2 * k, 2.0, 2.0], [1.5, 1.5e3 * (1 + k), 1.5, 1.5], 1.0)
        v = spent.check(step, 0, faulty)
        assert (v.action, v.detector) == ("skip", "rerun_cap"), (step, v)
    assert spent.state_dict()["data_skips"] == 1
    # Two stuck ranks of four: the ranks' median moves with them, the spike names no
    # rank, yet only two ranks rose. Not a new level either.
    for k, step in enumerate(range(t + 10, t + 16)):
        pair = make_view([2.0] * 4, [1.5, 40.0 + k, 50.0 + 2 * k, 1.5], 1e4 * (1 + k))
        v = spent.check(step, 0, pair)
        assert (v.action, v.detector, v.ranks) == ("skip", "rerun_cap", []), (step, v)
    assert spent.state_dict()["data_skips"] == 1
    # A rise of every rank alike names no rank: skipped at the cap, it still counts, or
    # a real new level would stall the run for good once the budget is spent.
    shift = guard(4, shift_after=3, max_reruns_per_run=2)
    t = warm(shift)
    verdicts = []
    for step in range(t, t + 8):
        v = shift.check(step, 0, high)
        if v.action == "recompute":
            v = shift.check(step, 1, high)
        verdicts.append((v.action, v.detector))
        if v.action == "proceed":
            shift.wants_snapshot(step, high)
            shift.accept(step, high, 0.01)
    assert verdicts[:3] == [("skip", "loss_spike")] * 2 + [("skip", "rerun_cap")]
    assert verdicts[3] == ("proceed", "level_shift") and verdicts[4:] == [("proceed", None)] * 4


@pytest.mark.parametrize("view,shifts", [
    (make_view([2.0] * 4, [1.5] * 4, 50.0), True),  # the aggregate alone: no rank's own values rose
    (make_view([9.0, 9.0, 9.0, 400.0], [1.5] * 4, 1.0), False),  # every rank rose, one far more: maybe its fault
])
def test_at_the_rerun_cap_a_spike_counts_towards_a_level_shift_only_where_no_rank_stands_out(
        view: ControlView, shifts: bool) -> None:
    g = guard(4, shift_after=1, max_reruns_per_run=1)
    t = warm(g)
    assert g.check(t, 0, steady(4, agg=1e36)).action == "recompute"  # the budget's one rerun
    assert g.check(t, 1, steady(4)).action == "proceed"
    g.accept(t, steady(4))
    verdicts = [(v.action, v.detector) for v in (g.check(s, 0, view) for s in (t + 1, t + 2))]
    assert verdicts == [("skip", "rerun_cap"), ("proceed", "level_shift") if shifts else ("skip", "rerun_cap")]


@pytest.mark.parametrize("before", ["rollback", "repair"])
def test_a_spike_skipped_at_the_steps_cap_never_counts_towards_a_level_shift(before: str) -> None:
    # With --max-reruns 1 a rolled-back update or a state repair spends the step's one
    # rerun; a spike on that recompute was skipped at the cap and counted towards a level
    # shift, as if the run's budget were spent: after a lasting rise, a 1e36 aggregated
    # gradient, never recomputed, was applied as the new level (98 of 100 reruns left).
    g = guard(4, max_reruns_per_step=1, shift_after=1)
    t = warm(g)
    high = make_view([9.0] * 4, [1.5] * 4, 1.0)
    assert g.check(t, 0, high).action == "recompute"
    assert g.check(t, 1, high).cause == "data"  # a lasting rise: one skip towards a level shift
    t += 1
    if before == "rollback":
        odd = make_view([2.8] * 4, [1.5] * 4, 1.0)  # a near miss: armed
        assert g.check(t, 0, odd).action == "proceed" and g.wants_snapshot(t, odd)
        assert g.check_update(t, math.inf).action == "recompute"
    else:
        assert g.check(t, 0, make_view([2.0] * 4, [1.5] * 4, 1.0, states=[1, 2, 1, 1])).action == "repair"
    v = g.check(t, 1, steady(4, agg=1e36))  # a fault in everyone's aggregate alike: no rank's own values rose
    assert (v.action, v.detector) == ("skip", "rerun_cap")
    assert g.state_dict()["data_skips"] == 1


@pytest.mark.parametrize("policy,action", [("stop", "stop"), ("repair", "recompute")])
def test_unnamed_recurring_anomaly_is_pinned_on_the_ranks_whose_values_moved(policy: str, action: str) -> None:
    # Two of four ranks persistently faulty: the ranks' median moves with them and
    # names nobody, but healthy ranks recompute their own values bit for bit.
    g = guard(4, on_persistent=policy)
    t = warm(g)
    v0 = g.check(t, 0, make_view([2.0] * 4, [1.5, 40.0, 50.0, 1.5], 1e4))
    assert (v0.action, v0.detector, v0.ranks) == ("recompute", "grad_spike", [])
    v1 = g.check(t, 1, make_view([2.0] * 4, [1.5, 60.0, 30.0, 1.5], 2e4))
    assert (v1.action, v1.detector, v1.ranks, v1.cause) == (action, "grad_spike", [1, 2], "persistent")
    # Unnamed both times, but by another detector: a new detection, not this one again.
    g = guard(4, on_persistent="stop")
    t = warm(g)
    assert g.check(t, 0, make_view([2.0, 50.0, 60.0, 2.0], [1.5] * 4, 1.0)).detector == "loss_spike"
    v1 = g.check(t, 1, make_view([2.0, 50.0, 60.0, 2.0], [1.5, 60.0, 30.0, 1.5], 2e4))
    assert (v1.action, v1.detector, v1.ranks, v1.cause) == ("recompute", "grad_spike", [], None)
    # A rank that moved only because a one-off fault hit its first attempt is not blamed:
    # on the rerun it sits among the others, and the all-rank spike reproduces (data).
    g = guard(4, on_persistent="stop")
    t = warm(g)
    assert g.check(t, 0, make_view([9.0, 9.5, 9.0, 9.0], [1.5] * 4, 1.0)).ranks == []
    v1 = g.check(t, 1, make_view([9.0] * 4, [1.5] * 4, 1.0))
    assert (v1.action, v1.ranks) == ("recompute", [])
    assert g.check(t, 2, make_view([9.0] * 4, [1.5] * 4, 1.0)).cause == "data"


def test_bad_data_on_one_rank_is_data_despite_another_ranks_transient_fault() -> None:
    # Rank 3's aggregate was hit on the first attempt only; rank 1's NaN batch reproduces.
    g = guard(4, on_persistent="stop")
    t = warm(g)
    first = nan_data_view(4, 1).matrix.copy()
    first[3, 2] = 5e30  # rank 3's aggregated norm, corrupted on attempt 0
    assert g.check(t, 0, ControlView(first)).ranks == [1]
    v1 = g.check(t, 1, nan_data_view(4, 1))
    assert (v1.action, v1.ranks, v1.cause) == ("skip", [1], "data")


@pytest.mark.parametrize("faulty_attempt", [0, 1])
def test_bad_data_on_one_rank_is_data_despite_another_ranks_local_fault(faulty_attempt: int) -> None:
    # Rank 1's batch is bad on both attempts; rank 2's local gradient was hit on one of
    # them, which moves every rank's aggregated norm: rank 1's own values still reproduce.
    g = guard(3, on_persistent="stop")
    t = warm(g)
    bad = make_view([2.0, 400.0, 2.0], [1.5, 60.0, 1.5], 20.0)
    hit = make_view([2.0, 400.0, 2.0], [1.5, 60.0, 4e36], 1.3e36)
    first = g.check(t, 0, hit if faulty_attempt == 0 else bad)
    assert (first.action, first.detector) == ("recompute", "rank_outlier")
    v1 = g.check(t, 1, bad if faulty_attempt == 0 else hit)
    assert (v1.action, v1.ranks, v1.cause) == ("skip", [1], "data")
    assert (g.counters["data"], g.counters["persistent"]) == (1, 0)


@pytest.mark.parametrize("hit", [False, True])
def test_no_level_shift_applies_an_attempt_where_another_rank_was_hit(hit: bool) -> None:
    g = guard(3, shift_after=1)
    t = warm(g)
    bad = make_view([2.0, 400.0, 2.0], [1.5, 60.0, 1.5], 20.0)
    g.check(t, 0, bad)
    assert g.check(t, 1, bad).action == "skip"  # the first skip of a lasting rise
    g.check(t + 1, 0, bad)
    rerun = make_view([2.0, 400.0, 2.0], [1.5, 60.0, 4e36], 1.3e36) if hit else bad
    v = g.check(t + 1, 1, rerun)
    expected = ("skip", "rank_outlier", [1]) if hit else ("proceed", "level_shift", [1])
    assert (v.action, v.detector, v.ranks) == expected


@pytest.mark.parametrize("nan_first", [True, False])
def test_bad_data_on_one_rank_is_data_despite_a_one_off_fault_in_everyones_aggregate(nan_first: bool) -> None:
    # A fault in the reduction itself reaches every rank alike (no mismatch): the
    # aggregate is NaN on one attempt only; rank 1's own finite values reproduce.
    g = guard(3, on_persistent="stop")
    t = warm(g)
    bad = make_view([2.0, 400.0, 2.0], [1.5, 60.0, 1.5], 20.0)
    nan = make_view([2.0, 400.0, 2.0], [1.5, 60.0, 1.5], math.nan, flags=[FLAG_AGG_NONFINITE] * 3)
    first = g.check(t, 0, nan if nan_first else bad)
    assert (first.action, first.ranks) == ("recompute", [1])
    v1 = g.check(t, 1, bad if nan_first else nan)
    assert (v1.action, v1.ranks, v1.cause) == ("skip", [1], "data")


def test_a_gross_local_value_at_the_first_step_of_two_ranks_is_an_outlier() -> None:
    # No history yet and no median of peers: a 1e4x gap between the two ranks fires.
    v = guard(2).check(0, 0, make_view([2.0, 2.0], [1.0, 1e36], 1e35))
    assert (v.action, v.detector, v.ranks) == ("recompute", "rank_outlier", [1])
    assert guard(2).check(0, 0, make_view([2.0, 2.5], [1.0, 900.0], 400.0)).action == "proceed"
    assert guard(1).check(0, 0, make_view([2.0], [1e36], 1e36)).action == "proceed"  # one rank: nothing to compare


def test_reproduced_spike_within_tolerance_is_data() -> None:
    """GPU kernels with atomics do not reproduce low bits; a bad batch still reproduces."""
    g = guard(4)
    t = warm(g)
    assert g.check(t, 0, make_view([2.0, 2.0, 2.0, 90.0], [1.5] * 4, 1.0, fps=[5] * 4)).action == "recompute"
    v = g.check(t, 1, make_view([2.0, 2.0, 2.0, 90.0 * (1 + 1e-6)], [1.5] * 4, 1.0, fps=[6] * 4))
    assert (v.action, v.cause, v.ranks) == ("skip", "data", [3])


def test_nonfinite_must_reproduce_bitwise() -> None:
    """A faulty unit producing NaN at another element changes the fingerprint: not data."""
    g = guard(4)
    t = warm(g)
    bad = dict(flags=[FLAG_AGG_NONFINITE, FLAG_AGG_NONFINITE, FLAG_AGG_NONFINITE | FLAG_LOCAL_NONFINITE,
                      FLAG_AGG_NONFINITE], faults=[0, 0, 1, 0])
    g.check(t, 0, make_view([2.0] * 4, [1.5, 1.5, NAN, 1.5], NAN, fps=[11] * 4, **bad))
    v = g.check(t, 1, make_view([2.0] * 4, [1.5, 1.5, NAN, 1.5], NAN, fps=[12] * 4, **bad))
    assert (v.cause, v.ranks) == ("persistent", [2])


def test_nonfinite_data_under_nondeterministic_kernels_is_still_data() -> None:
    """Where the other ranks' own values move on the rerun (GPU atomics), the NaN rank's
    aggregated checksum, a sum over all ranks, moves too: its own NaN coming back is
    data, not a persistent fault (which stopped a run with --on-persistent stop)."""
    g = guard(4)
    t = warm(g)
    flags = [FLAG_AGG_NONFINITE] * 4
    flags[1] |= FLAG_LOSS_NONFINITE | FLAG_LOCAL_NONFINITE
    first = make_view([2.0, NAN, 2.0, 2.0], [1.5, NAN, 1.5, 1.5], NAN, fps=[-77] * 4, flags=flags)
    assert g.check(t, 0, first).action == "recompute"
    rerun = make_view([2.0, NAN, 2.0, 2.0], [1.5000001, NAN, 1.5, 1.4999999], NAN, fps=[-78] * 4, flags=flags)
    v = g.check(t, 1, rerun)
    assert (v.action, v.cause, v.ranks) == ("skip", "data", [1])
    # deterministic kernels (the others recompute bit for bit): the checksum must match
    g = guard(4)
    assert g.check(t, 0, first).action == "recompute"
    steady_others = make_view([2.0, NAN, 2.0, 2.0], [1.5, NAN, 1.5, 1.5], NAN, fps=[-78] * 4, flags=flags)
    assert g.check(t, 1, steady_others).cause == "persistent"


def persistent_views(ws: int, rank: int) -> list[ControlView]:
    local = [[1.5] * ws for _ in range(3)]
    for i, mag in enumerate((4e36, 3e30, 7e33)):
        local[i][rank] = mag
    return [make_view([2.0] * ws, local[i], local[i][rank] / ws, faults=[int(r == rank) for r in range(ws)])
            for i in range(3)]


def test_persistent_stop_policy_names_the_rank() -> None:
    g = guard(4, on_persistent="stop")
    t = warm(g)
    views = persistent_views(4, 1)
    assert g.check(t, 0, views[0]).action == "recompute"
    v = g.check(t, 1, views[1])
    assert (v.action, v.cause, v.ranks, v.detector) == ("stop", "persistent", [1], "rank_outlier")
    assert g.counters["persistent"] == 1


def test_persistent_repair_policy_recomputes_then_skips() -> None:
    g = guard(4, on_persistent="repair", max_reruns_per_step=2)
    t = warm(g)
    views = persistent_views(4, 1)
    assert g.check(t, 0, views[0]).action == "recompute"
    v1 = g.check(t, 1, views[1])
    assert (v1.action, v1.cause, v1.ranks) == ("recompute", "persistent", [1])
    v2 = g.check(t, 2, views[2])
    assert (v2.action, v2.detector, v2.cause, v2.ranks) == ("skip", "rerun_cap", "persistent", [1])
    assert g.counters["persistent"] == 1 and g.counters["recomputes"] == 2
    # An intermittent rank that comes out clean on the second recompute: still persistent.
    g = guard(4, on_persistent="repair")
    t = warm(g)
    g.check(t, 0, views[0])
    g.check(t, 1, views[1])
    v = g.check(t, 2, steady(4))
    assert (v.action, v.cause, v.ranks) == ("proceed", "persistent", [1])
    assert (g.counters["persistent"], g.counters["transient"]) == (1, 0)


def test_a_state_split_after_a_persistent_fault_keeps_the_step_persistent() -> None:
    # Rank 1 misbehaved again with other values (persistent, recomputed under the repair
    # policy), then rank 2's replica was found split at rest: the step became "state", and
    # the run's counts lost the persistent fault its records had named.
    g = guard(4, on_persistent="repair", max_reruns_per_step=3)
    t = warm(g)
    views = persistent_views(4, 1)
    assert g.check(t, 0, views[0]).action == "recompute"
    assert g.check(t, 1, views[1]).cause == "persistent"
    v = g.check(t, 2, make_view([2.0] * 4, [1.5] * 4, 1.0, states=[1, 1, 2, 1]))
    assert (v.action, v.detector, v.ranks, v.cause) == ("repair", "state_mismatch", [2], "persistent")
    assert g.check(t, 3, make_view([2.0] * 4, [1.5] * 4, 1.0, states=[1] * 4)).cause == "persistent"
    assert (g.counters["persistent"], g.counters["state"]) == (1, 0)


def test_persistent_grad_mismatch_same_minority() -> None:
    g = guard(4, on_persistent="stop")
    g.check(0, 0, make_view([2.0] * 4, [1.5] * 4, [1.0, 1.0, 1.0, 2.0], fps=[FP, FP, FP, 1]))
    v = g.check(0, 1, make_view([2.0] * 4, [1.5] * 4, [1.0, 1.0, 1.0, 0.5], fps=[FP, FP, FP, 2]))
    assert (v.action, v.detector, v.ranks, v.cause) == ("stop", "grad_mismatch", [3], "persistent")


def test_grad_mismatch_that_comes_back_is_never_data() -> None:
    """Data cannot make ranks receive different aggregated gradients. A mismatch whose
    norms agree within the rerun tolerance (a mantissa flip at another element) used to
    read as reproduced, and the guard skipped the batch as bad data."""
    g = guard(4, on_persistent="stop")
    g.check(0, 0, make_view([2.0] * 4, [1.5] * 4, 1.0, fps=[FP, 5, FP, FP]))
    v = g.check(0, 1, make_view([2.0] * 4, [1.5] * 4, 1.0, fps=[FP, 6, FP, FP]))
    assert (v.action, v.detector, v.ranks, v.cause) == ("stop", "grad_mismatch", [1], "persistent")
    # Bitwise the same split again: still the reduction, not the data.
    g = guard(4)
    view = make_view([2.0] * 4, [1.5] * 4, 1.0, fps=[FP, 5, FP, FP])
    g.check(0, 0, view)
    v = g.check(0, 1, view)
    assert (v.action, v.ranks, v.cause) == ("recompute", [1], "persistent")
    assert (g.counters["data"], g.counters["skipped_batches"]) == (0, 0)
    # Another rank's mismatch on the rerun is a new fault, not this one again.
    g = guard(4, on_persistent="stop")
    g.check(0, 0, make_view([2.0] * 4, [1.5] * 4, 1.0, fps=[FP, 5, FP, FP]))
    v = g.check(0, 1, make_view([2.0] * 4, [1.5] * 4, 1.0, fps=[FP, FP, 6, FP]))
    assert (v.action, v.ranks, v.cause) == ("recompute", [2], None)
    # Two ranks: which one is faulty is unknown, that one is, is not.
    g = guard(2, on_persistent="stop")
    g.check(0, 0, make_view([2.0] * 2, [1.5] * 2, 1.0, fps=[FP, 5]))
    v = g.check(0, 1, make_view([2.0] * 2, [1.5] * 2, 1.0, fps=[FP, 6]))
    assert (v.action, v.ranks, v.cause) == ("stop", [], "persistent")
    # ... also where the history named one of them the first time only.
    g = guard(2, on_persistent="stop")
    t = warm(g)
    assert g.check(t, 0, make_view([2.0] * 2, [1.5] * 2, [2e36, 1.0], fps=[3, FP])).ranks == [0]
    v = g.check(t, 1, make_view([2.0] * 2, [1.5] * 2, 1.0, fps=[3, FP]))
    assert (v.action, v.ranks, v.cause) == ("stop", [], "persistent")
    # A mismatch on the recompute of another detection is a new fault, not the reduction failing again.
    g = guard(4, on_persistent="stop")
    t = warm(g)
    assert g.check(t, 0, steady(4, agg=1e36)).detector == "grad_spike"
    v = g.check(t, 1, make_view([2.0] * 4, [1.5] * 4, 1.0, fps=[FP, 5, FP, FP]))
    assert (v.action, v.detector, v.ranks, v.cause) == ("recompute", "grad_mismatch", [1], None)


@pytest.mark.parametrize("policy,action", [("stop", "stop"), ("repair", "recompute")])
def test_a_grad_mismatch_that_comes_back_after_a_state_repair_is_persistent(policy: str, action: str) -> None:
    """The state check comes first: a recompute that found a replica corrupted at rest
    repaired it and hid that the reduction failed again. The mismatch after the repair
    was compared with the state split, not the mismatch before it, and the step ended
    at rerun_cap with cause "state" (a run asked to stop on a persistent fault went on)."""
    g = guard(3, on_persistent=policy, max_reruns_per_step=3)
    t = warm(g)
    assert g.check(t, 0, make_view([2.0] * 3, [1.5] * 3, 1.0, fps=[FP, FP, 5])).ranks == [2]
    # (The reduction came out clean on the repair's own view: see the next test for one that did not.)
    assert g.check(t, 1, make_view([2.0] * 3, [1.5] * 3, 1.0, states=[1, 2, 1])).action == "repair"
    restored = guard(3, on_persistent=policy, max_reruns_per_step=3)  # the step in flight, saved and loaded
    restored.load_state_dict(json.loads(json.dumps(g.state_dict())))
    for h in (g, restored):
        v = h.check(t, 2, make_view([2.0] * 3, [1.5] * 3, 1.0, fps=[FP, FP, 7], states=[1, 1, 1]))
        assert (v.action, v.detector, v.ranks, v.cause) == (action, "grad_mismatch", [2], "persistent")
        assert (h.counters["persistent"], h.counters["state"], h.counters["detections"]) == (1, 0, 1)
    # Another rank's mismatch after the repair is a new fault: the step stays "state".
    g = guard(3, on_persistent=policy, max_reruns_per_step=3)
    t = warm(g)
    g.check(t, 0, make_view([2.0] * 3, [1.5] * 3, 1.0, fps=[FP, FP, 5]))
    g.check(t, 1, make_view([2.0] * 3, [1.5] * 3, 1.0, states=[1, 2, 1]))
    v = g.check(t, 2, make_view([2.0] * 3, [1.5] * 3, 1.0, fps=[6, FP, FP], states=[1, 1, 1]))
    assert (v.action, v.ranks, v.cause) == ("recompute", [0], "state")


@pytest.mark.parametrize("policy,action,detector", [("stop", "stop", "grad_mismatch"), ("repair", "skip", "rerun_cap")])
@pytest.mark.parametrize("mismatch_first", [True, False])
@pytest.mark.parametrize("split_loss", [2.0, math.nan])
def test_a_state_repairs_own_view_of_a_reduction_failing_again_names_it(
        policy: str, action: str, detector: str, mismatch_first: bool, split_loss: float) -> None:
    """With one rerun per step (--max-reruns 1) the repair spends it: the batch was
    skipped before rank 2's reduction was seen again, although the repair's own view
    showed its checksum split, and the step ended unnamed with cause "state" (a run
    asked to stop on a persistent fault went on). That view's mismatch is compared with
    the step's last one, and remembered for the attempt after the repair; also where
    the corrupted replica's loss is NaN (``split_loss``), which a detector before the
    checksums' would report instead."""
    g = guard(3, on_persistent=policy, max_reruns_per_step=1)
    t = warm(g)
    views = [make_view([2.0] * 3, [1.5] * 3, 1.0, fps=[FP, FP, 5]),  # rank 2's reduction fails
             make_view([2.0, split_loss, 2.0], [1.5] * 3, 1.0, fps=[FP, FP, 6],
                       states=[1, 2, 1])]  # ... and rank 1's state split
    if not mismatch_first:  # the split seen first: repaired, then the reduction fails again
        views = [views[1], make_view([2.0] * 3, [1.5] * 3, 1.0, fps=[FP, FP, 7], states=[1, 1, 1])]
    assert g.check(t, 0, views[0]).action == ("recompute" if mismatch_first else "repair")
    v = g.check(t, 1, views[1])
    assert (v.action, v.detector, v.ranks, v.cause) == (action, detector, [2], "persistent")
    assert (g.counters["persistent"], g.counters["state"], g.counters["detections"]) == (1, 0, 1)
    # With a rerun left, the split is repaired and recomputed, the fault already named.
    g = guard(3, on_persistent="repair", max_reruns_per_step=2)
    t = warm(g)
    g.check(t, 0, make_view([2.0] * 3, [1.5] * 3, 1.0, fps=[FP, FP, 5]))
    v = g.check(t, 1, make_view([2.0] * 3, [1.5] * 3, 1.0, fps=[FP, FP, 6], states=[1, 2, 1]))
    assert (v.action, v.detector, v.ranks, v.cause) == ("repair", "grad_mismatch", [2], "persistent")
    # Another rank's reduction on the repair's view is a new fault: the step stays "state".
    g = guard(3, on_persistent=policy, max_reruns_per_step=1)
    t = warm(g)
    g.check(t, 0, make_view([2.0] * 3, [1.5] * 3, 1.0, fps=[FP, FP, 5]))
    v = g.check(t, 1, make_view([2.0] * 3, [1.5] * 3, 1.0, fps=[6, FP, FP], states=[1, 2, 1]))
    assert (v.action, v.detector, v.ranks, v.cause) == ("skip", "state_mismatch", [1], "state")


@pytest.mark.parametrize("policy,action", [("stop", "stop"), ("repair", "skip")])
@pytest.mark.parametrize("nan_first", [False, True])
def test_a_reduction_failing_again_beside_a_non_finite_loss_is_persistent(
        policy: str, action: str, nan_first: bool) -> None:
    """A non-finite loss fires before the checksums are compared: rank 0's NaN loss hid
    that rank 1's reduction failed again (or, seen first, was not remembered), and the
    step ended unnamed at the rerun cap, or "transient" on a clean recompute."""
    g = guard(4, on_persistent=policy, max_reruns_per_step=1)
    t = warm(g)
    mismatch = make_view([2.0] * 4, [1.5] * 4, 1.0, fps=[FP, 5, FP, FP])
    beside_nan = make_view([NAN, 2.0, 2.0, 2.0], [1.5] * 4, 1.0, fps=[FP, 6, FP, FP],
                           flags=[FLAG_LOSS_NONFINITE, 0, 0, 0])
    views = [beside_nan, mismatch] if nan_first else [mismatch, beside_nan]
    assert g.check(t, 0, views[0]).action == "recompute"
    v = g.check(t, 1, views[1])
    verdict = (action, "grad_mismatch" if policy == "stop" else "rerun_cap", [1], "persistent")
    assert (v.action, v.detector, v.ranks, v.cause) == verdict
    assert (g.counters["persistent"], g.counters["detections"]) == (1, 1)
    # A mismatch beside it on another rank is a new fault: the NaN is what the verdict names.
    g = guard(4, on_persistent=policy, max_reruns_per_step=2)
    t = warm(g)
    g.check(t, 0, mismatch)
    v = g.check(t, 1, make_view([NAN, 2.0, 2.0, 2.0], [1.5] * 4, 1.0, fps=[FP, FP, 6, FP]))
    assert (v.action, v.detector, v.ranks, v.cause) == ("recompute", "nonfinite_loss", [0], None)


@pytest.mark.parametrize("policy", ["stop", "repair"])
def test_a_detection_right_after_a_state_repair_is_compared_with_nothing(policy: str) -> None:
    """The repaired state moves the ranks' values: bad data on the repaired rank comes
    back with other values, or even the same. It was compared with the state split (its
    suspects overlapped, its state column moved) and called persistent: a run asked to
    stop on a persistent fault stopped on a bad batch."""
    g = guard(3, on_persistent=policy, max_reruns_per_step=3)
    t = warm(g)
    def outlier(states: list[int | None]) -> ControlView:  # bad data on rank 1
        return make_view([2.0, 400.0, 2.0], [1.5, 60.0, 1.5], 20.0, states=states)

    assert g.check(t, 0, outlier([None] * 3)).action == "recompute"
    assert g.check(t, 1, outlier([1, 2, 1])).action == "repair"
    v = g.check(t, 2, outlier([1, 1, 1]))  # every recompute fingerprints the state
    assert (v.action, v.detector, v.ranks, v.cause) == ("recompute", "rank_outlier", [1], "state")
    v = g.check(t, 3, outlier([1, 1, 1]))  # reproduced on a recompute from the same state: the data
    assert (v.action, v.detector, v.cause) == ("skip", "rank_outlier", "data")
    assert g.counters["persistent"] == 0


def test_a_grad_mismatch_that_comes_back_after_a_rolled_back_update_is_persistent() -> None:
    # Clean on its recompute, the step's update was rolled back; the recompute of the
    # update found the same rank's reduction failing again.
    g = guard(4, on_persistent="stop", max_reruns_per_step=3)
    t = warm(g)
    assert g.check(t, 0, make_view([2.0] * 4, [1.5] * 4, 1.0, fps=[FP, 5, FP, FP])).action == "recompute"
    assert g.check(t, 1, steady(4)).cause == "transient" and g.wants_snapshot(t, steady(4))
    assert g.check_update(t, math.inf).action == "recompute"
    v = g.check(t, 2, make_view([2.0] * 4, [1.5] * 4, 1.0, fps=[FP, 6, FP, FP]))
    assert (v.action, v.detector, v.ranks, v.cause) == ("stop", "grad_mismatch", [1], "persistent")
    assert (g.counters["persistent"], g.counters["transient"]) == (1, 0)


def test_different_rank_on_rerun_is_a_new_fault() -> None:
    g = guard(4)
    t = warm(g)
    g.check(t, 0, make_view([2.0] * 4, [4e36, 1.5, 1.5, 1.5], 1e36))
    v = g.check(t, 1, make_view([2.0] * 4, [1.5, 1.5, 3e30, 1.5], 7e29))
    assert (v.action, v.ranks, v.cause) == ("recompute", [2], None)
    assert g.check(t, 2, steady(4)).cause == "transient"


def test_rerun_cap_per_step() -> None:
    g = guard(4, max_reruns_per_step=2)
    t = warm(g)
    verdicts = [g.check(t, a, steady(4, agg=mag)) for a, mag in enumerate((1e36, 2e30, 5e33))]
    assert [v.action for v in verdicts] == ["recompute", "recompute", "skip"]
    assert (verdicts[2].detector, verdicts[2].cause) == ("rerun_cap", None)
    assert verdicts[2].values["reruns_step"] == 2
    assert g.counters["detections"] == 1 and g.counters["skipped_batches"] == 1


def test_rerun_cap_per_run() -> None:
    g = guard(4, max_reruns_per_run=3)
    t = warm(g)
    actions = []
    for s in range(t, t + 5):
        actions.append(g.check(s, 0, steady(4, agg=1e36)).action)
        if actions[-1] == "recompute":
            assert g.check(s, 1, steady(4)).action == "proceed"
            g.accept(s, steady(4))
    assert actions == ["recompute"] * 3 + ["skip"] * 2
    assert g.counters["recomputes"] == 3 and g.counters["skipped_batches"] == 2


# --------------------------------------------------------------------------- post-step


def test_update_ratio_rolls_back_when_armed() -> None:
    g = guard(4, update_ratio=1.0)
    t = warm(g)
    g.check(t, 0, steady(4))
    g.wants_snapshot(t, steady(4))  # warm-up is over and nothing is odd: not armed ...
    v = g.check_update(t, 5.0)
    assert (v.action, v.detector, v.cause) == ("proceed", "update_ratio", None)  # ... so only a record
    g.accept(t, steady(4), 5.0)
    assert g.state_dict()["windows"]["ratio"][-1] != 5.0  # kept out of the history
    # Armed (here: a near miss in the loss): recompute, then the clean rerun attributes it.
    t += 1
    odd = make_view([2.8] * 4, [1.5] * 4, 1.0)
    assert g.check(t, 0, odd).detector is None
    assert g.wants_snapshot(t, odd)
    v = g.check_update(t, math.inf)
    assert (v.action, v.detector) == ("recompute", "update_ratio")
    assert g.check(t, 1, odd).action == "proceed"
    assert g.wants_snapshot(t, odd)
    v = g.check_update(t, 1e-3)
    assert (v.action, v.detector, v.cause) == ("proceed", "update_ratio", "transient")
    assert g.counters["rollbacks"] == 1 and g.counters["detections"] == 2


def test_update_ratio_spike_reproduced_is_data() -> None:
    g = guard(2)
    t = warm(g)
    view = make_view([2.8, 2.8], [1.5, 1.5], 1.0)
    assert g.check(t, 0, view).detector is None
    assert g.wants_snapshot(t, view)
    assert g.check_update(t, 0.2).action == "recompute"  # 200x the usual 1e-3, below the cap of 1.0
    g.check(t, 1, view)
    g.wants_snapshot(t, view)
    v = g.check_update(t, 0.2)
    assert (v.action, v.cause) == ("skip", "data")
    assert g.counters["rollbacks"] == 2


def test_an_update_ratio_that_comes_back_after_another_detection_is_still_data() -> None:
    """A rollback's recompute hit by a fault, then a clean attempt whose update fires
    again, as before: every attempt updates from the same state, so the ratio reproduced
    (the batch's data). It was compared with nothing, the recompute's detection having
    replaced it, and the step ended at rerun_cap labelled "transient" (the fault's cause)."""
    g = guard(4)
    t = warm(g)
    view = make_view([2.8] * 4, [1.5] * 4, 1.0)  # a near miss: armed
    assert g.check(t, 0, view).action == "proceed" and g.wants_snapshot(t, view)
    assert g.check_update(t, 0.2).action == "recompute"
    assert g.check(t, 1, make_view([2.8] * 4, [1.5] * 4, 1.0, fps=[FP, 5, FP, FP])).action == "recompute"
    assert g.check(t, 2, view).cause == "transient" and g.wants_snapshot(t, view)
    v = g.check_update(t, 0.2)
    assert (v.action, v.detector, v.cause) == ("skip", "update_ratio", "data")
    assert (g.counters["data"], g.counters["transient"], g.counters["rollbacks"]) == (1, 0, 2)
    # Not across a repair: the update then starts from another state.
    g = guard(4, max_reruns_per_step=3)
    t = warm(g)
    assert g.check(t, 0, view).action == "proceed" and g.wants_snapshot(t, view)
    assert g.check_update(t, 0.2).action == "recompute"
    assert g.check(t, 1, make_view([2.8] * 4, [1.5] * 4, 1.0, states=[1, 2, 1, 1])).action == "repair"
    clean = make_view([2.8] * 4, [1.5] * 4, 1.0, states=[1] * 4)
    assert g.check(t, 2, clean).cause == "state" and g.wants_snapshot(t, clean)
    v = g.check_update(t, 0.2)
    assert (v.action, v.detector, v.cause) == ("recompute", "update_ratio", "state")


@pytest.mark.parametrize("first,again", [(math.inf, 0.2), (0.2, math.inf)])
def test_an_update_ratio_infinite_on_one_attempt_only_is_not_reproduced(first: float, again: float) -> None:
    # An infinity lies within any relative tolerance of every value: a finite spike on
    # the rerun of an infinite update read as reproduced, and the batch was skipped as data.
    g = guard(2)
    t = warm(g)
    view = make_view([2.8, 2.8], [1.5, 1.5], 1.0)  # a near miss: armed
    for attempt, ratio in enumerate((first, again)):
        assert g.check(t, attempt, view).action == "proceed" and g.wants_snapshot(t, view)
        v = g.check_update(t, ratio)
        assert (v.action, v.cause) == ("recompute", None), attempt
    assert g.counters["data"] == 0


@pytest.mark.parametrize(("probe", "action"), [(55, "proceed"), (56, "recompute")])
def test_a_spike_accepted_in_the_warm_up_widens_the_limit_for_the_windows_length(probe: int, action: str) -> None:
    # docs/GUARD.md, the 3x term's price: "a 400-fold gradient norm at step 5 lets a
    # 200-fold one through until step 55 (checked with the defaults: caught again from step 56)".
    g = guard(4)  # the defaults: --guard-window 50, --guard-warmup 20, --spike-threshold 10
    rng = random.Random(0)
    for t in range(probe):
        view = make_view([2.0 * math.exp(rng.gauss(0, 0.1)) for _ in range(4)],
                         [1.5 * math.exp(rng.gauss(0, 0.2)) for _ in range(4)],
                         (400.0 if t == 5 else 1.0) * math.exp(rng.gauss(0, 0.1)))
        assert g.check(t, 0, view).action == "proceed", t  # step 5 too: below the warm-up's 1e4x
        g.wants_snapshot(t, view)
        ratio = 1e-3 * math.exp(rng.gauss(0, 0.1))
        assert g.check_update(t, ratio).action == "proceed"
        g.accept(t, view, ratio)
    v = g.check(probe, 0, make_view([2.0] * 4, [1.5] * 4, 200.0))
    assert (v.action, v.detector) == (action, "grad_spike" if action == "recompute" else None)


@pytest.mark.parametrize(("cap", "gap", "ratio", "action"), [
    (1.0, 200, 5.0, "recompute"),  # no recent ratio: the cap alone judges
    (math.inf, 200, 5.0, "proceed"),  # --update-ratio inf: no cap
    (math.inf, 0, 0.05, "recompute"),  # ... and the spike rule stays: 50x the warm-up's ratios
])
def test_update_ratio_inf_lifts_the_cap_and_keeps_the_spike_rule(cap: float, gap: int, ratio: float,
                                                                 action: str) -> None:
    g = guard(2, update_ratio=cap)
    t = warm(g) + gap
    view = make_view([2.8, 2.8], [1.5, 1.5], 1.0)  # a near miss: armed
    assert g.check(t, 0, view).detector is None and g.wants_snapshot(t, view)
    assert g.check_update(t, ratio).action == action


def test_update_ratio_is_judged_against_recent_ratios_only() -> None:
    # Ratios are measured on armed steps only: after the warm-up, rarely. A window of
    # the first steps' ratios (tiny, under a learning-rate warm-up) called a clean
    # recompute's update 200 steps later a spike, rolled it back and skipped the batch
    # as data. Older than --guard-window steps, a ratio no longer judges: only the cap.
    def judged(gap: int) -> str:
        g = guard(2, update_ratio=1.0)
        t = warm(g) + gap
        view = make_view([2.8, 2.8], [1.5, 1.5], 1.0)  # a near miss: armed
        assert g.check(t, 0, view).detector is None and g.wants_snapshot(t, view)
        return g.check_update(t, 0.05).action  # 50x the warm-up's 1e-3, below the cap

    assert judged(0) == "recompute"
    assert judged(49) == "recompute"  # the last warm-up ratio, of step 29, is 50 steps old: still judged
    assert judged(50) == "proceed"
    short = guard(2, window=10)  # a full window: each ratio's step beside it
    warm(short)
    assert (short.state_dict()["ratio_steps"], len(short.state_dict()["windows"]["ratio"])) == (list(range(20, 30)), 10)
    assert judged(200) == "proceed"
    g = guard(2, update_ratio=1.0)
    t = warm(g) + 200
    view = make_view([2.8, 2.8], [1.5, 1.5], 1.0)
    g.check(t, 0, view)
    g.wants_snapshot(t, view)
    assert g.check_update(t, 5.0).action == "recompute"  # the cap still holds
    restored = guard(2, update_ratio=1.0)
    restored.load_state_dict(g.state_dict())
    assert restored.state_dict() == g.state_dict()


def test_a_step_and_its_recomputes_count_one_detection() -> None:
    g = guard(2)
    t = warm(g)
    split = make_view([2.0, 2.0], [1.5, 1.5], 1.0, fps=[FP, FP + 1])
    assert g.check(t, 0, split).action == "recompute"
    clean = make_view([2.8, 2.8], [1.5, 1.5], 1.0)
    assert g.check(t, 1, clean).action == "proceed" and g.wants_snapshot(t, clean)
    assert g.check_update(t, 0.2).action == "recompute"  # the recompute's update spikes: the same incident
    assert g.counters["detections"] == 1 and g.counters["recomputes"] == 2
    # The other way round: a rolled-back update, then the recompute finds the state split.
    g = guard(3)
    t = warm(g)
    clean = make_view([2.8] * 3, [1.5] * 3, 1.0)
    assert g.check(t, 0, clean).action == "proceed" and g.wants_snapshot(t, clean)
    assert g.check_update(t, float("nan")).action == "recompute"
    assert g.check(t, 1, make_view([2.8] * 3, [1.5] * 3, 1.0, states=[5, 9, 5])).action == "repair"
    assert g.counters["detections"] == 1 and g.counters["recomputes"] == 2


def test_update_ratio_from_a_zero_learning_rate_or_a_small_init_is_no_detection() -> None:
    # A warm-up from lr 0 makes step 0's ratio 0, and a small initialisation makes the
    # first ratios exceed the cap of 1.0. Kept in the history, the 0 made every later
    # update a gross jump; capped from the start, every update of a std-1e-3 model
    # was rolled back, reproduced and skipped as data.
    g = guard(2, update_ratio=1.0, warmup=3)
    for t, ratio in enumerate([0.0, 10.0, 4.0, 2.0]):
        assert g.check(t, 0, steady(2)).action == "proceed"
        assert g.wants_snapshot(t, steady(2))  # the ratios' warm-up: 3 positive ones
        assert g.check_update(t, ratio).action == "proceed", t
        g.accept(t, steady(2), ratio)
    assert g.counters["detections"] == 0 and not g.wants_snapshot(4, steady(2))
    # Warm, the cap holds, and a reproduced ratio over it is a spike like a loss spike:
    # skipped as data, then applied once --shift-after such skips came in a row.
    near_miss = make_view([2.8, 2.8], [1.5, 1.5], 1.0)
    actions = []
    for t in range(4, 4 + g.config.shift_after + 1):
        for attempt in (0, 1):
            assert g.check(t, attempt, near_miss).action == "proceed"
            assert g.wants_snapshot(t, near_miss)
            actions.append(g.check_update(t, 1.5))
        if actions[-1].action == "proceed":
            g.accept(t, near_miss, 1.5)
    assert [v.action for v in actions] == ["recompute", "skip"] * g.config.shift_after + ["recompute", "proceed"]
    assert actions[-1].detector == "level_shift"
    assert g.counters["skipped_batches"] == g.config.shift_after
    assert g.counters["rollbacks"] == 2 * g.config.shift_after + 1  # the level shift keeps its update


def test_a_reproduced_non_finite_update_is_always_skipped() -> None:
    # Adam's eps=0 on a feature that is always 0: the update is 0/0 = NaN every time.
    # The level shift applies reproduced spikes after --shift-after skips; never NaN.
    fresh = guard(2)  # also before any ratio: no spike limit yet, no cap in the warm-up
    assert fresh.check(0, 0, steady(2)).action == "proceed" and fresh.wants_snapshot(0, steady(2))
    assert fresh.check_update(0, math.inf).action == "recompute"
    g = guard(2, shift_after=2)
    t = warm(g)
    near_miss = make_view([2.8, 2.8], [1.5, 1.5], 1.0)  # arms the snapshot
    for s in range(t, t + 4):
        for attempt, expect in ((0, "recompute"), (1, "skip")):
            assert g.check(s, attempt, near_miss).action == "proceed"
            assert g.wants_snapshot(s, near_miss)
            assert g.check_update(s, math.inf).action == expect, (s, attempt)
    assert g.counters["skipped_batches"] == 4


def test_rollback_recompute_numbered_from_zero_keeps_the_step_state() -> None:
    """A protector that restarts its attempt counter after a rollback still gets attribution and caps."""
    g = guard(4, max_reruns_per_step=2)
    t = warm(g, 5)  # still in warm-up: every update is snapshotted
    for ratio, expect in ((50.0, "recompute"), (70.0, "recompute"), (90.0, "skip")):
        assert g.check(t, 0, steady(4)).action == "proceed"
        assert g.wants_snapshot(t, steady(4))
        assert g.check_update(t, ratio).action == expect
    assert g.counters["recomputes"] == 2 and g.counters["rollbacks"] == 3


def test_a_step_left_mid_rollback_does_not_leak_into_the_next() -> None:
    # A loss-scale overflow on the recompute of a rolled-back update ends the step with
    # no further call: the next step has a rerun budget of its own.
    g = guard(4, max_reruns_per_step=1)
    t = warm(g)
    odd = make_view([2.8] * 4, [1.5] * 4, 1.0)
    assert g.check(t, 0, odd).action == "proceed" and g.wants_snapshot(t, odd)
    assert g.check_update(t, math.inf).action == "recompute"
    v = g.check(t + 1, 0, steady(4, agg=1e36))
    assert (v.action, v.detector) == ("recompute", "grad_spike")


def test_an_update_anomaly_resolved_after_a_repair_keeps_the_steps_cause() -> None:
    g = guard(3)
    t = warm(g)
    assert g.check(t, 0, make_view([2.0] * 3, [1.5] * 3, 1.0, states=[5, 9, 5])).action == "repair"
    clean = make_view([2.0] * 3, [1.5] * 3, 1.0, states=[5, 5, 5])
    assert g.check(t, 1, clean).cause == "state" and g.wants_snapshot(t, clean)
    assert g.check_update(t, 0.2).action == "recompute"
    assert g.check(t, 2, clean).action == "proceed" and g.wants_snapshot(t, clean)
    v = g.check_update(t, 1e-3)
    assert (v.action, v.detector, v.cause) == ("proceed", "update_ratio", "state")
    assert (g.counters["state"], g.counters["transient"]) == (1, 0)


@pytest.mark.parametrize("ratio,action", [(0.5, "proceed"), (math.nextafter(0.5, 1.0), "recompute")])
def test_the_update_ratio_cap_is_inclusive(ratio: float, action: str) -> None:
    g = guard(2, update_ratio=0.5, warmup=3)
    for t in range(3):
        assert g.check(t, 0, steady(2)).action == "proceed" and g.wants_snapshot(t, steady(2))
        assert g.check_update(t, 0.5).action == "proceed"
        g.accept(t, steady(2), 0.5)
    near_miss = make_view([2.8, 2.8], [1.5, 1.5], 1.0)
    assert g.check(3, 0, near_miss).action == "proceed" and g.wants_snapshot(3, near_miss)
    assert g.check_update(3, ratio).action == action


def test_update_ratio_disabled() -> None:
    g = guard(2, update_ratio=0.0)
    assert not g.wants_snapshot(0, steady(2))
    v = g.check_update(0, math.nan)
    assert (v.action, v.detector, g.counters["detections"]) == ("proceed", None, 0)


def test_wants_snapshot() -> None:
    g = guard(4, warmup=20)
    assert g.wants_snapshot(0, steady(4))  # update-ratio warm-up
    t = warm(g, 20)
    assert not g.wants_snapshot(t, steady(4))
    assert g.wants_snapshot(t, make_view([2.8] * 4, [1.5] * 4, 1.0))  # loss near miss ...
    assert g.check(t, 0, make_view([2.8] * 4, [1.5] * 4, 1.0)).detector is None  # ... not a detection
    assert g.wants_snapshot(t, steady(4, agg=4.0))  # grad-norm near miss
    assert not g.wants_snapshot(t, steady(4, agg=2.0))  # within the norm's floor of 50% of its median
    assert g.check(t, 0, steady(4, agg=4.0)).detector is None
    assert not g.wants_snapshot(t, make_view([2.0] * 4, [1.5] * 4, 1.0, states=[1, 1, 1, 1]))
    # A state split is never applied as it stands: it is repaired first, and its recompute armed.
    assert g.check(t, 0, make_view([2.0] * 4, [1.5] * 4, 1.0, states=[1, 1, 2, 1])).action == "repair"
    assert g.wants_snapshot(t, make_view([2.0] * 4, [1.5] * 4, 1.0, states=[1, 1, 1, 1]))
    g.check(t, 0, steady(4, agg=1e36))
    g.check(t, 1, steady(4))
    assert g.wants_snapshot(t, steady(4))  # the step already needed a recompute


# --------------------------------------------------------------------------- state


def scripted(g: Guard, start: int, n: int, seed: int) -> list[dict[str, object]]:
    """A run with faults mixed in; every verdict as JSON."""
    rng = random.Random(seed)
    out: list[dict[str, object]] = []
    for t in range(start, start + n):
        clean = make_view([2.0 * math.exp(rng.gauss(0, 0.1)) for _ in range(4)],
                          [1.5 * math.exp(rng.gauss(0, 0.2)) for _ in range(4)], math.exp(rng.gauss(0, 0.1)))
        views = [clean]
        if t % 7 == 3:
            views = [steady(4, agg=1e36), clean]
        elif t % 11 == 5:
            views = [nan_data_view(4, 2)] * 2
        for a, view in enumerate(views):
            v = g.check(t, a, view)
            out.append(v.to_json())
            if v.action != "recompute":
                break
        if v.action != "proceed":
            continue
        out.append({"snapshot": g.wants_snapshot(t, view)})
        ratio = 1e-3 * math.exp(rng.gauss(0, 0.1)) * (1e4 if t % 13 == 8 else 1)
        u = g.check_update(t, ratio)
        out.append(u.to_json())
        if u.action == "proceed":
            g.accept(t, view, ratio)
    return out


def test_state_dict_round_trip_continues_identically() -> None:
    a = guard(4, warmup=10, window=20)
    scripted(a, 0, 40, seed=1)
    state = json.loads(json.dumps(a.state_dict(), allow_nan=False))
    b = guard(4, warmup=10, window=20)
    b.load_state_dict(state)
    assert b.state_dict() == a.state_dict()
    assert scripted(a, 40, 60, seed=2) == scripted(b, 40, 60, seed=2)
    assert a.state_dict() == b.state_dict()
    assert a.counters["detections"] > 10 and a.counters["data"] > 0 and a.counters["transient"] > 0


@pytest.mark.parametrize("window", [10, 50, 80])
def test_a_resumed_guard_keeps_its_history_in_its_own_window(window: int) -> None:
    # docs/LIBRARY.md: a resumed run may change --guard-window. A shorter one kept the
    # newest values of every window but emptied the update ratios' (their steps, saved
    # beside them, no longer matched in number: read as a torn checkpoint), so a ratio
    # spike passed on the --update-ratio cap alone.
    saved = guard(4, window=50)
    t = warm(saved)
    state = json.loads(json.dumps(saved.state_dict()))
    resumed = guard(4, window=window)
    resumed.load_state_dict(state)
    got = resumed.state_dict()
    for name, values in state["windows"].items():  # the newest, as many as the new window holds
        size = window * (4 if name.startswith("rank_") else 1)
        assert got["windows"][name] == values[-size:], name
    assert got["ratio_steps"] == state["ratio_steps"][-window:]
    view = make_view([2.8] * 4, [1.5] * 4, 1.0)  # a near miss: armed
    for g in (saved, resumed):
        assert g.check(t, 0, view).detector is None and g.wants_snapshot(t, view)
        assert g.check_update(t, 0.05).action == "recompute"  # 50x the warm-up's ratios, below the cap


def test_state_dict_mid_step() -> None:
    a = guard(4)
    t = warm(a)
    odd = make_view([2.8] * 4, [1.5] * 4, 1.0)
    assert a.check(t, 0, odd).action == "proceed" and a.wants_snapshot(t, odd)
    assert a.check_update(t, 1e-3).action == "proceed"
    a.accept(t, odd, 1e-3)
    assert (a.state_dict()["step"], a.state_dict()["armed_step"]) == (None, None)  # nothing in flight
    t += 1
    a.check(t, 0, steady(4, agg=1e36))
    b = guard(4)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    for g in (a, b):
        v = g.check(t, 1, steady(4, agg=1e36))  # reproduced bitwise
        assert (v.action, v.cause) == ("skip", "data")
    assert a.state_dict() == b.state_dict()
    # An update anomaly that could not be rolled back keeps its step out of the history
    # across a restore too; the count of skips towards a level shift is restored.
    t += 1
    for g in (a, b):
        assert g.check(t, 0, steady(4)).action == "proceed" and not g.wants_snapshot(t, steady(4))
        assert g.check_update(t, 5.0).detector == "update_ratio"
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert b.state_dict() == a.state_dict() and a.state_dict()["data_skips"] == 1
    for g in (a, b):
        g.accept(t, steady(4), 5.0)
    assert a.state_dict() == b.state_dict()
    # A state with nothing in flight ends the step in flight.
    c = guard(4)
    c.check(0, 0, steady(4))
    c.load_state_dict(a.state_dict())
    assert c.state_dict() == a.state_dict()
    # Ratios whose steps do not match them (a torn checkpoint): the ratio history starts afresh.
    state = a.state_dict()
    state["ratio_steps"] = state["ratio_steps"][1:]
    c.load_state_dict(state)
    assert (c.state_dict()["windows"]["ratio"], c.state_dict()["ratio_steps"]) == ([], [])
    with pytest.raises(ValueError, match="version"):
        b.load_state_dict({"version": 99})


def test_view_of_wrong_world_size_is_rejected() -> None:
    with pytest.raises(ValueError, match="ranks"):
        guard(4).check(0, 0, steady(2))


@pytest.mark.parametrize("make", [
    lambda: GuardVerdict("go"),
    lambda: GuardVerdict("skip", "grad_spikes"),
    lambda: GuardVerdict("skip", cause="bad_luck"),
    lambda: guard(0),
])
def test_a_misspelt_verdict_or_an_empty_world_is_rejected(make: Callable[[], object]) -> None:
    with pytest.raises(ValueError):
        make()


def test_verdict_json() -> None:
    v = GuardVerdict("skip", "grad_spike", [1], "data", {"a": math.inf, "b": -math.inf, "c": 1.5})
    assert v.to_json() == {"action": "skip", "detector": "grad_spike", "ranks": [1], "cause": "data",
                           "values": {"a": "inf", "b": "-inf", "c": 1.5}}


def test_module_docstring_example() -> None:
    result = doctest.testmod(paft.guard, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0
