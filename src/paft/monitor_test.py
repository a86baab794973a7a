"""Tests for paft.monitor: the step records and the edge-triggered alerts (no process group)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from paft.config import MonitorConfig
from paft.consistency import ControlVector, ControlView
from paft.divergence import DivergenceReport
from paft.monitor import Monitor
from paft.records import RunRecorder


def view(states: list[int | None], aggs: list[int] | None = None, losses: list[float] | None = None) -> ControlView:
    aggs = aggs or [7] * len(states)
    losses = losses or [2.0] * len(states)
    rows = [ControlVector(x, 1.0, 1.0, a, s, 0, 0, None).pack(0) for s, a, x in zip(states, aggs, losses)]
    return ControlView(torch.stack(rows))


def events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def test_a_state_split_is_alerted_once_with_its_distance_and_again_after_a_repair(tmp_path: Path) -> None:
    calls = []

    def divergence() -> DivergenceReport:
        calls.append(1)
        return DivergenceReport(per_rank=[0.0, 0.0, 0.5], max=0.5, finite=[True] * 3, state_per_rank=[0.0, 0.0, 0.7],
                                state_max=0.7,
                                per_tensor=[("param/w", 0.7, 2), ("param/b", 0.0, 0)])

    monitor = Monitor(MonitorConfig(), RunRecorder(tmp_path, rank=0, quiet=True), divergence)
    split = view([1, 1, 9])
    monitor.record(0, split, metric_step=True)
    monitor.record(1, split, metric_step=True)  # still split: no new alert
    assert monitor.alerts == 1 and len(calls) == 1
    monitor.replicas_agree()
    monitor.record(2, split, metric_step=True, stale_fingerprints=True)  # taken before the repair
    assert monitor.alerts == 1
    monitor.record(3, split, metric_step=True)  # split again after the repair: a new alert
    assert monitor.alerts == 2
    (first, second) = [e for e in events(tmp_path) if e["detector"] == "state_split"]
    assert (first["step"], second["step"], first["ranks"]) == (0, 3, [2])
    assert first["divergence"]["tensors"] == [["param/w", 0.7, 2]]  # unmoved tensors left out


def test_between_metric_steps_only_news_of_the_replicas_is_recorded(tmp_path: Path) -> None:
    monitor = Monitor(MonitorConfig(interval=10), RunRecorder(tmp_path, rank=0, quiet=True), None)
    assert monitor.record(1, view([None, None]), metric_step=False) == {}
    split = monitor.record(2, view([None, None], aggs=[7, 8]), metric_step=False)
    assert split["replicas/grad_distinct"] == 2 and "consistency/loss_cv" not in split
    assert monitor.record(3, view([None, None]), metric_step=False)["step"] == 3  # the split's end
    assert monitor.record(4, view([None, None]), metric_step=False) == {}
    skipped = monitor.record(5, view([None, None], aggs=[7, 8]), metric_step=True, applied=False)
    assert not any(k.startswith("replicas/grad_") for k in skipped)  # a skipped update split nothing
    lines = (tmp_path / "consistency.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [2, 3, 5]


def test_a_nan_loss_alerts_except_on_a_loss_scalers_overflow(tmp_path: Path) -> None:
    """Its NaN coefficient of variation fires the loss_cv alert; a loss scaler's overflow
    step (its non-finite values are routine) is recorded without one."""
    monitor = Monitor(MonitorConfig(alert_loss_cv=0.5), RunRecorder(tmp_path, rank=0, quiet=True), None)
    nan = view([None, None], losses=[2.0, float("nan")])
    overflow = monitor.record(0, nan, metric_step=True, alerts=False)
    assert overflow["local_grad_norms"] == [1.0, 1.0] and monitor.alerts == 0
    monitor.record(1, nan, metric_step=True)
    assert monitor.alerts == 2  # the rank by name, and the statistic it turns NaN
    assert [(e["step"], e["detector"], e["ranks"]) for e in events(tmp_path)] == [
        (1, "nonfinite_local", [1]), (1, "loss_cv", [])]


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


def test_a_split_whose_distance_the_update_rounded_away_names_no_farthest_rank(tmp_path: Path) -> None:
    said: list[str] = []
    recorder = RunRecorder(tmp_path, rank=0, quiet=True)
    recorder.say = said.append  # type: ignore[method-assign]
    monitor = Monitor(MonitorConfig(), recorder, lambda: DivergenceReport(
        per_rank=[0.0] * 3, max=0.0, finite=True, state_per_rank=[0.0] * 3, state_max=0.0, per_tensor=[]))
    monitor.record(0, view([1, 1, 9]), metric_step=True)
    assert said == ["[alert] step 0: state_split = 2 (rank(s) [2] disagree); equal in value after this step's update"]
