"""Tests for paft.monitor: the step records and the edge-triggered alerts (no process group)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from paft.config import MonitorConfig
from paft.consistency import ControlVector, ControlView
from paft.divergence import DivergenceReport
from paft.monitor import Monitor
from paft.records import RunRecorder


def view(states: list[int | None], aggs: list[int] | None = None, losses: list[float] | None = None,
         faults: list[int] | None = None) -> ControlView:
    aggs = aggs or [7] * len(states)
    losses = losses or [2.0] * len(states)
    faults = faults or [0] * len(states)
    rows = [ControlVector(x, 1.0, 1.0, a, s, 0, f, None).pack(0) for s, a, x, f in zip(states, aggs, losses, faults)]
    return ControlView(torch.stack(rows))


def sketched(sketches: list[list[float]], sq: list[float] | None = None) -> ControlView:
    """Two-element gradient sketches (and squared local norms) per rank."""
    sq = sq or [1.0] * len(sketches)
    return ControlView(torch.stack([ControlVector(2.0, q, 1.0, 7, None, 0, 0, torch.tensor(v)).pack(2)
                                    for v, q in zip(sketches, sq)]))


def events(run_dir: Path) -> list[dict]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_state_split_is_alerted_once_with_its_distance_and_again_after_a_repair(tmp_path: Path) -> None:
    calls = []

    moved = [(f"param/w{i}", 0.7 - 0.1 * i, [2]) for i in range(7)]

    def divergence() -> DivergenceReport:
        calls.append(1)
        return DivergenceReport(per_rank=[0.0, 0.0, 0.5], max=0.5, finite=[True] * 3, state_per_rank=[0.0, 0.0, 0.7],
                                state_max=0.7, per_tensor=[*moved[:2], ("param/b", 0.0, [0, 1, 2]), *moved[2:]])

    monitor = Monitor(MonitorConfig(), RunRecorder(tmp_path, rank=0, quiet=True), divergence)
    split = view([1, 1, 9])
    monitor.record(0, split, metric_step=True)
    monitor.record(1, split, metric_step=True)  # still split: no new alert
    assert monitor.alerts == 1 and len(calls) == 1
    monitor.replicas_agree()
    # Fingerprints taken before the repair: no state alert, but the gradients' split is one
    # (and measures no divergence: that collective is for state splits).
    monitor.record(2, view([1, 1, 9], aggs=[7, 7, 8]), metric_step=True, stale_fingerprints=True)
    assert [e["detector"] for e in events(tmp_path)] == ["state_split", "replicas_split"] and len(calls) == 1
    monitor.record(3, split, metric_step=True)  # split again after the repair: a new alert
    assert monitor.alerts == 3
    (first, second) = [e for e in events(tmp_path) if e["detector"] == "state_split"]
    assert (first["step"], second["step"], first["ranks"]) == (0, 3, [2])
    # Unmoved tensors left out, the farthest apart first, the five that moved most (README).
    assert first["divergence"] == {"params_per_rank": [0.0, 0.0, 0.5], "state_per_rank": [0.0, 0.0, 0.7],
                                   "tensors": [list(t) for t in moved[:5]], "moved_tensors": len(moved)}


def test_a_gradient_split_right_after_a_repair_is_alerted_again(tmp_path: Path) -> None:
    """An aggregation fault at step 4 that PAFT-Dyn repairs in its step, and another on
    the same rank at step 5: the same groups, but a new split (README: a split a sync or
    repair ended that comes back is alerted again). It went unalerted."""
    monitor = Monitor(MonitorConfig(), RunRecorder(tmp_path, rank=0, quiet=True), None)
    split = view([None] * 3, aggs=[7, 8, 7])
    monitor.record(4, split, metric_step=True)
    monitor.replicas_agree()
    monitor.record(5, split, metric_step=True)
    monitor.record(6, split, metric_step=True)  # not repaired: the same split lasts
    assert [(e["step"], e["detector"], e["ranks"]) for e in events(tmp_path)] == [
        (4, "replicas_split", [1]), (5, "replicas_split", [1])]


def test_between_metric_steps_only_news_of_the_replicas_is_recorded(tmp_path: Path) -> None:
    monitor = Monitor(MonitorConfig(interval=10), RunRecorder(tmp_path, rank=0, quiet=True), None)
    assert monitor.record(1, view([None, None]), metric_step=False) == {}
    split = monitor.record(2, view([None, None], aggs=[7, 8], losses=[1.0, 3.0], faults=[0, 1]), metric_step=False)
    assert split["replicas/grad_distinct"] == 2 and "consistency/loss_cv" not in split
    # What every step carries; the local gradient norms come with the worker metrics only.
    assert (split["loss"], split["local_losses"], split["faults"]) == (2.0, [1.0, 3.0], [0, 1])
    assert "local_grad_norms" not in split
    assert monitor.record(3, view([None, None]), metric_step=False)["step"] == 3  # the split's end
    assert monitor.record(4, view([None, None]), metric_step=False) == {}
    skipped = monitor.record(5, view([3, 3], aggs=[7, 8]), metric_step=True, applied=False, guarded=True)
    assert not any(k.startswith("replicas/grad_") for k in skipped)  # a skipped update split nothing
    assert skipped["replicas/state_distinct"] == 1  # ...but its fingerprints are kept
    # A fingerprint is news, agreeing or not; a state split lasts until the replicas agree.
    assert monitor.record(6, view([3, 3]), metric_step=False)["replicas/state_distinct"] == 1
    assert monitor.alerts == 1  # the split at step 2 only
    assert monitor.record(7, view([3, 4]), metric_step=False)["replicas/state_distinct"] == 2
    assert monitor.record(8, view([None, None]), metric_step=False)["step"] == 8
    monitor.replicas_agree()
    assert monitor.record(9, view([None, None]), metric_step=False) == {}
    assert [e["detector"] for e in events(tmp_path)] == ["replicas_split", "state_split"]
    lines = (tmp_path / "consistency.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [2, 3, 5, 6, 7, 8]


def test_a_gradient_split_a_loss_scaler_skipped_without_the_guard_is_alerted(tmp_path: Path) -> None:
    # The ranks skip a step where rank 1's aggregated gradient is non-finite (the loss
    # scaler's agreed skip). The record leaves the split out (nothing split the replicas),
    # but where no guard's event names it, the alert must: it was recorded nowhere at all.
    monitor = Monitor(MonitorConfig(interval=10), RunRecorder(tmp_path, rank=0, quiet=True), None)
    hit = view([None] * 3, aggs=[7, 8, 7])
    assert monitor.record(1, hit, metric_step=False, applied=False, guarded=True) == {}  # the guard's events say it
    assert monitor.record(2, view([None] * 3), metric_step=False) == {}
    skipped = monitor.record(3, hit, metric_step=False, applied=False)
    assert skipped["step"] == 3 and not any(k.startswith("replicas/grad_") for k in skipped)
    assert monitor.record(4, view([None] * 3), metric_step=False)["replicas/grad_distinct"] == 1  # its end
    assert [(e["step"], e["detector"], e["ranks"]) for e in events(tmp_path)] == [(3, "replicas_split", [1])]


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_loss_is_alerted_by_name_alone_except_on_a_loss_scalers_overflow(
        tmp_path: Path, bad: float) -> None:
    """The NaN coefficient of variation it makes measured nothing: no loss_cv alert
    besides the rank's. A loss scaler's overflow step (its non-finite values are
    routine) is recorded without one."""
    monitor = Monitor(MonitorConfig(alert_loss_cv=0.5), RunRecorder(tmp_path, rank=0, quiet=True), None)
    nan = view([None, None], losses=[2.0, bad])
    overflow = monitor.record(0, nan, metric_step=True, alerts=False)
    assert overflow["local_grad_norms"] == [1.0, 1.0] and monitor.alerts == 0
    assert math.isnan(monitor.record(1, nan, metric_step=True)["consistency/loss_cv"])
    assert [(e["step"], e["detector"], e["ranks"]) for e in events(tmp_path)] == [(1, "nonfinite_local", [1])]
    assert monitor.alerts == 1


def test_a_threshold_left_unmeasured_by_a_non_finite_rank_keeps_its_state(tmp_path: Path) -> None:
    monitor = Monitor(MonitorConfig(alert_loss_cv=0.5), RunRecorder(tmp_path, rank=0, quiet=True), None)
    far, nan, near = [1.0, 9.0], [1.0, float("nan")], [2.0, 2.0]
    # Apart, unmeasured, apart: one incident. Together, unmeasured, apart: a new one.
    for step, losses in enumerate([far, nan, far, near, nan, far]):
        monitor.record(step, view([None, None], losses=losses), metric_step=True)
    assert [(e["step"], e["detector"]) for e in events(tmp_path)] == [
        (0, "loss_cv"), (1, "nonfinite_local"), (4, "nonfinite_local"), (5, "loss_cv")]


def test_a_rank_with_a_non_finite_gradient_is_alerted_by_name_while_the_cosines_stay_finite(tmp_path: Path) -> None:
    # Three ranks: the cosine statistics leave the NaN rank out and stay finite.
    monitor = Monitor(MonitorConfig(), RunRecorder(tmp_path, rank=0, quiet=True), None)
    rows = [ControlVector(2.0, sq, 1.0, 7, None, 0, 0, torch.tensor([1.0, 0.1 * r, 0.5]) * sq).pack(3)
            for r, sq in enumerate([1.0, float("nan"), 1.0])]
    m = monitor.record(0, ControlView(torch.stack(rows)), metric_step=True)
    assert m["consistency/nonfinite_ranks"] == [1] and m["consistency/grad_cos_min"] > 0.9
    monitor.record(1, ControlView(torch.stack(rows)), metric_step=True)  # still on: not again
    assert [(e["step"], e["detector"], e["ranks"]) for e in events(tmp_path)] == [(0, "nonfinite_local", [1])]
    # Another rank gone non-finite while it lasts is named (it was not); one recovering is not news.
    for step, bad in ((2, [1, 2]), (3, [2]), (4, [1, 2])):
        rows = [ControlVector(2.0, float("nan") if r in bad else 1.0, 1.0, 7, None, 0, 0,
                              torch.tensor([1.0, 0.1 * r, 0.5])).pack(3) for r in range(3)]
        monitor.record(step, ControlView(torch.stack(rows)), metric_step=True)
    assert [(e["step"], e["ranks"]) for e in events(tmp_path) if e["detector"] == "nonfinite_local"] == [
        (0, [1]), (2, [1, 2]), (4, [1, 2])]
    monitor.alerting["nonfinite_local"] = True  # as a checkpoint of an older version saved it
    monitor.record(5, ControlView(torch.stack(rows)), metric_step=True)  # no TypeError; named as new
    assert events(tmp_path)[-1]["step"] == 5


def test_a_split_that_regroups_is_alerted_again(tmp_path: Path) -> None:
    monitor = Monitor(MonitorConfig(), RunRecorder(tmp_path, rank=0, quiet=True), None)
    monitor.record(0, view([None] * 4, aggs=[7, 7, 8, 7]), metric_step=True)  # rank 2 hit
    monitor.record(1, view([None] * 4, aggs=[7, 7, 8, 7]), metric_step=True)  # the same split: no news
    monitor.record(2, view([None] * 4, aggs=[9, 7, 7, 7]), metric_step=True)  # rank 0 hit while it lasts
    assert [(e["step"], e["ranks"]) for e in events(tmp_path) if e["detector"] == "replicas_split"] == [
        (0, [2]), (2, [0])]
    monitor.alerting["replicas_split"] = True  # as a checkpoint of an older version saved it: no groups
    monitor.record(3, view([None] * 4, aggs=[9, 7, 7, 7]), metric_step=True)  # which regrouping is unknown
    assert monitor.alerts == 2


def test_an_alert_still_active_after_a_resume_is_not_new(tmp_path: Path) -> None:
    split = view([None] * 4, aggs=[7, 7, 8, 7])  # rank 2 hit
    saved = Monitor(MonitorConfig(), RunRecorder(tmp_path / "a", rank=0, quiet=True), None)
    saved.record(0, split, metric_step=True)
    resumed = Monitor(MonitorConfig(), RunRecorder(tmp_path / "b", rank=0, quiet=True), None)
    resumed.load_state_dict(saved.state_dict())
    resumed.record(1, split, metric_step=True)
    assert resumed.alerts == 1 and events(tmp_path / "b") == []
    # An older checkpoint's: no alert state, or a split saved as True (which groups is unknown).
    resumed.load_state_dict({"counters": {}})
    assert (resumed.alerts, resumed.alerting) == (0, {})
    resumed.load_state_dict({"counters": {"alerts": 1}, "alerting": {"replicas_split": True}})
    resumed.record(2, split, metric_step=True)
    assert resumed.alerts == 1


def _report(per_tensor: list | None, state: list[float]) -> Callable[[], DivergenceReport]:
    return lambda: DivergenceReport(per_rank=[0.0, 0.9, 0.5], max=0.9, finite=[True] * 3, state_per_rank=state,
                                    state_max=max(state), per_tensor=per_tensor)


def _structure_differs() -> DivergenceReport:
    raise RuntimeError("tensor shapes differ")


@pytest.mark.parametrize("divergence, words, record", [
    (None, "", None),
    # The distance the update rounded away: no farthest rank.
    (_report([], [0.0] * 3), "; equal in value after this step's update", []),
    # The farthest over the whole state (not the parameters alone), and the tensor that moved most.
    (_report([("param/w", 0.7, [2])], [0.0, 0.0, 0.7]),
     "; farthest from the mean: rank(s) [2], 0.7, most in param/w (0.7)", [["param/w", 0.7, [2]]]),
    (_report(None, [0.0, 0.0, 0.7]), "; farthest from the mean: rank(s) [2], 0.7", []),
    # Distances equal but for their last bit (two replicas are equally far from their mean,
    # computed 0.09805806756909202 and 0.098058067569092 at two ranks): both are named.
    (_report(None, [0.0, 0.7, math.nextafter(0.7, 0.0)]), "; farthest from the mean: rank(s) [1, 2], 0.7", []),
    (_structure_differs, "; the states differ in structure", None),
], ids=["no divergence", "rounded away", "one tensor", "no per-tensor", "tied", "structure"])
def test_a_state_splits_line_says_how_far_apart_the_replicas_are(
        tmp_path: Path, divergence: Callable[[], DivergenceReport] | None, words: str, record: list | None) -> None:
    said: list[str] = []
    recorder = RunRecorder(tmp_path, rank=0, quiet=True)
    recorder.say = said.append  # type: ignore[method-assign]
    monitor = Monitor(MonitorConfig(), recorder, divergence)
    monitor.record(0, view([1, 1, 9]), metric_step=True)
    assert said == [f"[alert] step 0: state_split = 2 (rank(s) [2] disagree){words}"]
    (event,) = events(tmp_path)
    if divergence is None:
        assert "divergence" not in event
    elif record is None:
        assert event["divergence"] == {"error": "tensor shapes differ"}
    else:
        assert event["divergence"]["tensors"] == record


@pytest.mark.parametrize("config, rows, alerted", [
    # At the threshold is not past it: a CV of exactly 0.5, a cosine of exactly 0.
    (MonitorConfig(alert_loss_cv=0.5), view([None, None], losses=[1.0, 3.0]), []),
    (MonitorConfig(alert_cos_min=0.0), sketched([[1.0, 0.0], [0.0, 1.0]]), []),
    (MonitorConfig(alert_cos_min=0.0), sketched([[1.0, 0.0], [-1.0, 0.1]]), ["grad_cos_min"]),
    # Two ranks, one non-finite: no pair of finite gradients is left, and the rank alone is named.
    (MonitorConfig(), sketched([[1.0, 0.0], [float("nan"), 0.0]], sq=[1.0, float("nan")]), ["nonfinite_local"]),
    (MonitorConfig(), sketched([[1.0, 0.0], [float("inf"), 0.0]], sq=[1.0, float("inf")]), ["nonfinite_local"]),
    # A NaN that no non-finite rank explains fires: finite losses whose sum overflows,
    # a sketch gone non-finite from a finite gradient (and quietly: no numpy warning).
    pytest.param(MonitorConfig(), view([None, None], losses=[1e308, 1e308]), ["loss_cv"],
                 marks=pytest.mark.filterwarnings("error::RuntimeWarning")),
    (MonitorConfig(), sketched([[1.0, 0.0], [float("nan"), 0.0]]), ["grad_cos_min"]),
], ids=["cv at threshold", "cos at threshold", "cos below", "nan rank", "inf rank", "nan cv", "nan cos"])
def test_a_value_at_a_threshold_is_not_past_it_and_nan_is(
        tmp_path: Path, config: MonitorConfig, rows: ControlView, alerted: list[str]) -> None:
    monitor = Monitor(config, RunRecorder(tmp_path, rank=0, quiet=True), None)
    monitor.record(0, rows, metric_step=True)
    assert [e["detector"] for e in events(tmp_path)] == alerted and monitor.alerts == len(alerted)


@pytest.mark.parametrize("config, rows, line", [
    # Rounded to 4 digits these read "1" and "0.5": on the threshold's safe side, or on it.
    (MonitorConfig(alert_cos_min=0.99999),
     sketched([[1.0, 0.0], [math.cos(math.acos(0.99996)), math.sin(math.acos(0.99996))]]), "grad_cos_min = 0.99996"),
    (MonitorConfig(alert_loss_cv=0.5), view([None, None], losses=[1.0, 3.0002]), "loss_cv = 0.50002"),
    (MonitorConfig(alert_loss_cv=0.5), view([None, None], losses=[1.0, 5.0]), "loss_cv = 0.6667"),
], ids=["cos near 1", "cv near its threshold", "cv far past"])
def test_an_alerts_line_shows_its_value_past_the_threshold(
        tmp_path: Path, config: MonitorConfig, rows: ControlView, line: str) -> None:
    said: list[str] = []
    recorder = RunRecorder(tmp_path, rank=0, quiet=True)
    recorder.say = said.append  # type: ignore[method-assign]
    Monitor(config, recorder, None).record(0, rows, metric_step=True)
    assert said == [f"[alert] step 0: {line}"]


def test_exact_gradients_given_replace_the_sketches_in_the_cosines(tmp_path: Path) -> None:
    monitor = Monitor(MonitorConfig(), RunRecorder(tmp_path, rank=0, quiet=True), None)
    orthogonal = sketched([[1.0, 0.0], [0.0, 1.0]])
    assert monitor.record(0, orthogonal, metric_step=True)["consistency/grad_cos_min"] == 0.0
    parallel = torch.tensor([[1.0, 0.0, 0.0], [2.0, 0.0, 0.0]])
    assert monitor.record(1, orthogonal, metric_step=True, grads=parallel)["consistency/grad_cos_min"] == 1.0
