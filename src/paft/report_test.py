"""Tests of ``paft report`` on real run directories (two tiny 2-rank gloo runs, ~10 s each,
and a library run's folder: a one-rank ``paft.protect`` loop in this process).

Variants the training stack does not produce cheaply (a crashed run, cosine off,
guard and sync events, non-finite values) are derived from a real run's files.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
from typing import Any

import matplotlib.text
import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import paft.records as records
import paft.report as report_module
import paft.report_divergence as report_divergence
import paft.report_draw as report_draw
import paft.report_text as report_text
from paft.config import MonitorConfig, ProtectConfig, TrainConfig
from paft.protect import PersistentFaultError, protect
from paft.records import RunRecorder, read_jsonl, record_files, truncate_jsonl
from paft.report import build_report
from paft.report_divergence import (
    _alert_divergence,
    _eval_divergence,
    _period_panel,
    _periods,
    _replica_panel,
    _state_distinct,
)
from paft.report_draw import figure, plot
from paft.report_text import summary_text
from paft.run_reading import first_split, replica_splits, series
from paft.rundata import ReportError, RunData, load_run, mean_local_loss
from paft.rundir import prepare_run_dir
from paft.testing import one_rank_group, run_workers
from paft.train import Trainer

TINY_LM = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32}
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PLOTS = ["loss.png", "dispersion.png", "cosine.png", "divergence.png"]


def train(rank: int, world_size: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    cfg = TrainConfig.from_dict(cfg_dict)
    return Trainer(cfg, pathlib.Path(cfg.run_dir)).train()


def make_run(run_dir: pathlib.Path, inject: list[str], **options: Any) -> pathlib.Path:
    cfg = TrainConfig(
        workload="gpt", world_size=2, steps=12, batch_size=8, eval_every=6, eval_batches=2, log_every=100,
        checkpoint_every=0, run_dir=str(run_dir), model=dict(TINY_LM), inject=inject, **options,
    )
    prepare_run_dir(cfg)
    run_workers(train, cfg.world_size, cfg.to_dict())
    return run_dir


@pytest.fixture(scope="module")
def fault_run(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_run(tmp_path_factory.mktemp("report") / "fault", ["bitflip:steps=5,bits=exponent,ranks=1"])


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_run(tmp_path_factory.mktemp("report") / "clean", [])


@pytest.fixture(scope="module")
def library_run(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A library user's folder: 6 steps of ``paft.protect`` with a ``RunRecorder``, worker
    metrics every 2nd step, PAFT-Sync every 2nd, a fault at step 2."""
    run_dir = tmp_path_factory.mktemp("report") / "library"
    torch.manual_seed(0)
    with one_rank_group():
        _train_library_run(run_dir)
    return run_dir


def _train_library_run(run_dir: pathlib.Path) -> None:
    """The library run of :func:`library_run`, in a frame of its own: its DDP model goes
    with the frame, before the group."""
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    protector = protect(ddp, optimizer, monitor=MonitorConfig(interval=2),
                        protect=ProtectConfig(mode="sync", sync_period=2), inject=["scale:steps=2,factor=3"],
                        recorder=RunRecorder(run_dir, 0, quiet=True))
    for step in range(6):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))

        def closure(x: torch.Tensor = x) -> torch.Tensor:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True))
            loss.backward()
            return loss

        protector.step(closure)
    protector.close()


def copy_run(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("checkpoints", "report"))
    return dst


def rewrite_jsonl(path: pathlib.Path, edit: Any) -> None:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    path.write_text("".join(json.dumps(edit(r)) + "\n" for r in records))


def assert_pngs(files: list[pathlib.Path], names: list[str]) -> None:
    pngs = [f for f in files if f.suffix == ".png"]
    assert [f.name for f in pngs] == names
    for f in pngs:
        data = f.read_bytes()
        assert data[:8] == PNG_MAGIC, f  # what each plot draws: the tests that capture its figure


def test_fault_run_report(fault_run: pathlib.Path) -> None:
    report = build_report(fault_run)
    out = fault_run / "report"
    assert_pngs(report.files, PLOTS)
    assert all(f.parent == out for f in report.files)
    assert report.files[-1] == out / "report.md"
    assert report.text in (out / "report.md").read_text()
    text = report.text
    # Two ranks that disagree: no majority, so no rank is named (faults.jsonl names the one hit).
    assert "first replica split: step 5 (aggregated-gradient checksums differ; no strict majority)" in text
    assert "faults injected: 1\n" in text
    assert "by site: aggregation (1)" in text and "by kind: bitflip (1)" in text and "by rank: rank 1 (1)" in text
    assert "replicas distinct at the end: 2" in text
    assert "workload: gpt   world size: 2   steps: 12 of 12   optimizer: adamw" in text
    assert "protection: none   guard: off   injected: bitflip:steps=5,bits=exponent,ranks=1\n" in text
    assert "syncs: 0   detections: 0   recomputes: 0   skipped batches: 0" in text
    assert "val loss: " in text and "max loss_cv: " in text
    summary = json.loads((fault_run / "summary.json").read_text())  # the trainer's timing, not the records'
    assert f"speed: {summary['steps_per_s']:.2f} steps/s ({summary['wall_s']:.2f} s in training steps)\n" in text
    alerts = json.loads((fault_run / "summary.json").read_text())["alerts"]
    assert "min grad_cos_min: " in text and f"alerts: {alerts} (replicas_split (1)" in text
    assert "note:" not in text  # finished run: summary.json was read


def test_clean_run_report_to_other_dir(clean_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    report = build_report(clean_run, tmp_path / "out")
    # No faults, no protection: the divergence plot still shows the (flat) replica count.
    assert_pngs(report.files, PLOTS)
    assert all(f.parent == tmp_path / "out" for f in report.files)
    assert not (clean_run / "report").exists()
    assert "faults injected: 0" in report.text
    assert "first replica split: none" in report.text
    assert "replicas distinct at the end: 1" in report.text


def test_a_library_runs_folder_is_reported_from_its_consistency_records(library_run: pathlib.Path,
                                                                        tmp_path: pathlib.Path) -> None:
    assert not (library_run / "config.json").exists() and not (library_run / "metrics").exists()
    report = build_report(library_run, tmp_path / "out")
    assert_pngs(report.files, ["loss.png", "dispersion.png", "divergence.png"])  # one rank: no cosine
    text = report.text
    assert ("library run (paft.protect's RunRecorder, no config.json): drawn from consistency.jsonl, the loss at "
            "monitored steps only; the run's settings are not recorded\n"
            "world size: 1   monitored steps: 3, the last at step 4\n") in text
    # No step times, no summary: nothing said of them is a guess, and no run is "interrupted".
    assert "speed: not recorded (a library run's records hold no step times)\n" in text and "note:" not in text
    assert "faults injected: 1\n" in text and "by site: aggregation (1)" in text
    assert "syncs: 2   detections: 0" in text
    assert "protection:" not in text and "val loss" not in text


def test_a_library_runs_losses_are_its_consistency_records(library_run: pathlib.Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    records = read_jsonl(library_run / "consistency.jsonl")
    run = load_run(library_run)
    assert run.library and run.config == {} and run.summary is None and run.world_size == 1
    assert [(r["step"], r["local_loss"], r["loss"]) for r in run.metrics[0]] == [
        (c["step"], c["local_losses"][0], c["loss"]) for c in records]
    figures: list[Any] = []
    monkeypatch.setattr(report_module, "png", lambda fig: figures.append(fig) or b"")
    report_module._plot_loss(run)
    (ax,) = figures[0].axes
    assert ax.get_title() == "global and per-rank local loss (monitored steps only)"
    assert figures[0].get_suptitle() == f"Loss: {library_run.name}\nlibrary run, 1 rank"  # not "1 ranks"
    lines = {line.get_label(): line for line in ax.get_lines()}
    drawn = [(x, y) for x, y in zip(*lines["rank 0 local loss"].get_data()) if math.isfinite(y)]
    assert drawn == [(c["step"], c["local_losses"][0]) for c in records]
    # A guard stop is named by the setting a library user gave, not by paft train's option
    # (at step 5, after the last record: the step a stop ends has none).
    run.events.append({"step": 5, "event": "guard", "action": "stop", "ranks": [0]})
    assert ("note: the guard stopped the run at step 5 (on_persistent='stop'): a persistent fault on rank 0\n"
            in summary_text(run))


def test_a_run_resumed_without_the_monitor_says_its_records_are_an_earlier_legs(
        clean_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # config.json is the last leg's: --resume --no-monitor kept the plots and extremes of
    # the first leg's records with no word that the later steps were not monitored.
    run = copy_run(clean_run, tmp_path / "resumed")
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "monitor": {**config["monitor"], "enabled": False}}))
    end = max(r["step"] for r in read_jsonl(run / "consistency.jsonl"))
    note = (f"note: monitoring is off (--no-monitor, as the last leg ran); consistency.jsonl holds an earlier "
            f"leg's records, up to step {end}\n")
    assert note in summary_text(load_run(run))
    assert "note: monitoring is off" not in summary_text(load_run(clean_run))


def test_crashed_run_without_cosine(fault_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    run = copy_run(fault_run, tmp_path / "crashed")
    (run / "summary.json").unlink()
    rewrite_jsonl(run / "consistency.jsonl",
                  lambda r: {k: v for k, v in r.items() if "cos" not in k})
    with open(run / "metrics" / "rank0.jsonl", "a") as f:
        f.write('{"step": 12, "local_lo')  # the process died mid-line
    report = build_report(run)
    assert_pngs(report.files, ["loss.png", "dispersion.png", "divergence.png"])
    # A Ctrl-C before the end writes none either: the note does not say "crashed" alone.
    assert "note: no summary.json: the run is still running, crashed or was interrupted" in report.text
    assert "first replica split: step 5 (aggregated-gradient checksums" in report.text
    # The state split shows at the fingerprint step (10), not in the records after it.
    assert "replicas distinct at the last state check (step 10): 2\n" in report.text  # two ranks: no minority
    rewrite_jsonl(run / "consistency.jsonl", lambda r: {**r, "replicas/state_distinct": 1,
                                                        "replicas/state_minority_ranks": []}
                  if "replicas/state_distinct" in r else {**r, "replicas/grad_distinct": 2} if r["step"] == 11 else r)
    assert ("replicas distinct at the last state check (step 10): 1; aggregated gradients differed after it, "
            "first at step 11\n") in build_report(run).text
    # A check fingerprints the state its step starts from: that step's own update, from
    # split gradients, came after it (a real run with --fingerprint-every 5 and the fault
    # at step 5, interrupted, read "(step 5): 1" and nothing more).
    rewrite_jsonl(run / "consistency.jsonl", lambda r: {**r, "replicas/grad_distinct": 2} if r["step"] == 10 else r)
    assert ("replicas distinct at the last state check (step 10): 1; aggregated gradients differed after it, "
            "first at step 10\n") in summary_text(load_run(run))
    assert "faults injected: 1\n" in report.text
    assert "not recorded (cosine monitoring off)" in report.text
    alerts = sum(1 for line in (run / "events.jsonl").read_text().splitlines() if '"alert"' in line)
    assert alerts > 0 and f"alerts: {alerts} (" in report.text
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "world_size": 1}))  # one rank: no pair to compare
    assert "min grad_cos_min: not recorded (a cosine needs 2 ranks)" in build_report(run).text


@pytest.mark.parametrize("trainer_event", [True, False], ids=["paft-train", "library"])
def test_guard_stopped_run_gets_one_note(fault_run: pathlib.Path, tmp_path: pathlib.Path,
                                         trainer_event: bool) -> None:
    run = copy_run(fault_run, tmp_path / "stopped")
    (run / "summary.json").unlink()  # a stopped run writes none
    for path in record_files(run):  # nor any record of the step it stopped in, or after
        truncate_jsonl(path, 5)
    events = [{"step": 5, "event": "guard", "attempt": 1, "action": "stop", "detector": "grad_mismatch",
               "cause": "persistent", "ranks": [1], "values": {}}]
    if trainer_event:
        events.append({"step": 5, "event": "stop", "ranks": [1], "reason": "step 5: rank(s) [1] reproduce it"})
    with open(run / "events.jsonl", "a") as f:
        f.writelines(json.dumps(e) + "\n" for e in events)
    text = build_report(run).text
    assert text.count("note: the guard stopped the run at step 5 (--on-persistent stop): ") == 1
    assert ("stop): rank(s) [1] reproduce it" in text) == trainer_event  # the step said once
    assert "no summary.json" not in text
    # A resume of a finished 4-step run, stopped: its old summary is set aside, and said so.
    summary = json.loads((fault_run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "steps": 4}))
    text = summary_text(load_run(run))
    assert "note: the guard stopped the run at step 5" in text
    assert "note: summary.json ends at step 4 but the records go on to step 5" in text
    # The trainer's own reason names the policy: said once.
    kept = [line for line in (run / "events.jsonl").read_text().splitlines() if '"stop"' not in line]
    stop = {"step": 5, "event": "stop", "ranks": [1], "reason": str(PersistentFaultError(5, [1]))}
    (run / "events.jsonl").write_text("\n".join([*kept, json.dumps(stop)]) + "\n")
    assert summary_text(load_run(run)).count("(--on-persistent stop)") == 1


def test_each_legs_end_is_one_note_in_the_order_the_legs_ended(fault_run: pathlib.Path,
                                                                tmp_path: pathlib.Path) -> None:
    """A resume keeps why the leg it continues ended. One that the guard stopped again at
    the same step left two identical notes; a stop the run had gone on past hid the
    missing summary of a later leg that said nothing of its end (killed); and a leg a
    signal ended said nothing at all."""
    run = copy_run(fault_run, tmp_path / "legs")
    (run / "summary.json").unlink()
    for path in record_files(run):  # the last leg stopped in step 5
        truncate_jsonl(path, 5)
    reason = str(PersistentFaultError(5, [1]))
    legs = [{"step": 3, "event": "interrupted", "signal": "SIGTERM"},  # resumed from step 2: SIGTERM at 3
            *[{"step": 5, "event": "stop", "ranks": [1], "reason": reason}] * 2]  # resumed from 4: stopped at 5 again
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in legs))
    notes = [line for line in summary_text(load_run(run)).splitlines() if line.startswith("note: ")]
    assert notes == ["note: the run was interrupted at step 3 (SIGTERM); resumed, the run went on to step 4",
                     f"note: the guard stopped the run at step 5: {reason.removeprefix('step 5: ')}; a resume "
                     "stopped there again"]
    # Resumed past the stops, with --on-persistent repair, and killed outright: nothing
    # says why this leg ended, and the summary is missing; then one stopped by Ctrl-C.
    # Step 5 recorded is the run gone on past the stop in it.
    shutil.copytree(fault_run / "metrics", run / "metrics", dirs_exist_ok=True)
    for rank_file in (run / "metrics").iterdir():
        truncate_jsonl(rank_file, 6)
    notes = [line for line in summary_text(load_run(run)).splitlines() if line.startswith("note: ")]
    assert notes[1].endswith("; a resume stopped there again; the run went on after it, to step 5")
    shutil.copytree(fault_run / "metrics", run / "metrics", dirs_exist_ok=True)
    notes = [line for line in summary_text(load_run(run)).splitlines() if line.startswith("note: ")]
    assert notes[1].endswith("; a resume stopped there again; the run went on after it, to step 11")
    assert notes[2].startswith("note: no summary.json: the run is still running, crashed or was interrupted")
    with open(run / "events.jsonl", "a") as f:
        f.write(json.dumps({"step": 12, "event": "interrupted", "signal": "SIGINT"}) + "\n")
    notes = [line for line in summary_text(load_run(run)).splitlines() if line.startswith("note: ")]
    assert notes[2] == "note: the run was interrupted at step 12 (Ctrl-C)"


def test_an_interrupted_resume_past_config_steps_and_a_lone_evaluation(
        fault_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """An interrupted resume with more --steps leaves config.json as its last checkpoint's
    (fewer steps): "steps: 12 of 8" was read; and one evaluation is not a change from
    itself ("4.2178 (step 0) -> 4.2178 (step 0)")."""
    run = copy_run(fault_run, tmp_path / "resumed")
    (run / "summary.json").unlink()
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "steps": 8}))
    (run / "evals.jsonl").write_text((run / "evals.jsonl").read_text().splitlines()[0] + "\n")
    text = summary_text(load_run(run))
    assert "steps: 12   optimizer" in text and "(12 steps recorded)" in text and " of 8" not in text
    first = json.loads((run / "evals.jsonl").read_text())
    assert f"val loss: {first['val_loss']:.4f} (step 0, the only evaluation)\n" in text
    (run / "config.json").write_text(json.dumps({**config, "steps": 12}))
    assert "steps: 12 of 12   optimizer" in summary_text(load_run(run))


def test_monitoring_off(clean_run: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = copy_run(clean_run, tmp_path / "unmonitored")
    build_report(run)  # an earlier report's plots must not survive the next one
    (run / "consistency.jsonl").unlink()
    cfg = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**cfg, "monitor": {**cfg["monitor"], "enabled": False}}))
    report = build_report(run)
    assert_pngs(report.files, ["loss.png"])
    assert sorted(p.name for p in (run / "report").iterdir()) == [".paft-report", "loss.png", "report.md"]
    assert report.text.splitlines()[-1] == f"report in {run / 'report'}: report.md, loss.png"
    assert "first replica split: not recorded" in report.text
    assert "max loss_cv: not recorded (no consistency.jsonl: monitoring off)" in report.text
    # Given as "." from inside the run directory: still named.
    monkeypatch.chdir(run)
    assert build_report(".").files[-1].read_text().startswith("# paft report: unmonitored\n")


def test_events_and_non_finite_values(fault_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    run = copy_run(fault_run, tmp_path / "events")
    (run / "summary.json").unlink()
    (run / "faults.jsonl").unlink()  # a second fault, written by rank 0 at step 8
    with open(run / "faults.jsonl", "w") as f:  # a run still going: in the order the ranks appended them
        for rank, step in ((0, 8), (1, 5)):
            f.write(json.dumps({"step": step, "rank": rank, "site": "local-grad", "kind": "nan"}) + "\n")
    with open(run / "events.jsonl", "a") as f:
        for event in (
            {"step": 8, "event": "guard", "attempt": 0, "action": "recompute", "detector": "nonfinite",
             "cause": "transient", "ranks": [0], "values": {"loss": "nan"}},
            {"step": 8, "event": "guard", "attempt": 1, "action": "proceed", "detector": "", "cause": "",
             "ranks": [], "values": {}},
            {"step": 6, "event": "sync", "period": 4, "divergence": 2.5e-7, "mode": "median"},
            {"step": 9, "event": "sync", "period": 8, "divergence": "inf", "mode": "median"},
            {"step": 10, "event": "sync", "period": 8, "divergence": 0.0, "mode": "noop"},
        ):
            f.write(json.dumps(event) + "\n")
    rewrite_jsonl(run / "metrics" / "rank0.jsonl",
                  lambda r: {**r, "local_loss": "inf"} if r["step"] == 8 else r)
    rewrite_jsonl(run / "consistency.jsonl",
                  lambda r: {**r, "consistency/loss_cv": "nan", "loss": "inf"} if r["step"] == 8
                  else {**r, "consistency/loss_cv": "inf"} if r["step"] == 10 else r)
    data = load_run(run)
    assert data.metrics[0][8]["local_loss"] == float("inf")
    _, (ax,) = figure(1, 1, "events")
    report_draw._mark_events(ax, data)
    labels = ax.get_legend_handles_labels()[1]  # a recompute's "proceed" verdict did nothing: no marker
    assert "guard: recompute" in labels and not any("proceed" in label for label in labels)
    assert {"fault on rank 0 (local-grad)", "fault on rank 1 (local-grad)", "sync (repair)",
            "sync (no-op)"} <= set(labels)
    faults = {line.get_label(): list(line.get_xdata()) for line in ax.get_lines()
              if line.get_label().startswith("fault on")}
    assert faults == {"fault on rank 0 (local-grad)": [8, 8], "fault on rank 1 (local-grad)": [5, 5]}
    # A plot shown on its own says what run it is of.
    fig, _ = figure(1, 1, "Loss", data)
    assert fig.get_suptitle() == ("Loss: events\ngpt, 2 ranks, protection none, guard off, injected "
                                  "bitflip:steps=5,bits=exponent,ranks=1")
    syncs = [(list(line.get_xdata()), line.get_mfc()) for line in ax.get_lines() if line.get_marker() == "^"]
    assert [x for x, _ in syncs] == [[6], [9], [10]] and syncs[2][1] == "none" != syncs[0][1]  # no-op: hollow
    report = build_report(run)
    assert_pngs(report.files, [*PLOTS, "guard.png"])  # the guard recomputed step 8
    text = report.text
    assert "syncs: 3   detections: 1   recomputes: 1   skipped batches: 0" in text
    assert "by rank: rank 0 (1), rank 1 (1)" in text
    assert data.faults[0]["kind"] == "nan"  # a fault kind, not a float NaN (each of which was counted apart)
    assert "by kind: nan (2)" in text
    assert "  first: step 5, rank 1, local-grad/nan\n" in text  # the earliest, not the first line
    assert "max loss_cv: nan at step 8 (non-finite at 2 steps)\n" in text  # the first of them


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # matplotlib's log axis at 1e308
def test_finite_losses_whose_sum_passes_float64_are_averaged(fault_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # float64 losses of 1e308 on both ranks (an exponent flip): fsum of them raised
    # OverflowError, and paft report ended in a traceback.
    run = copy_run(fault_run, tmp_path / "huge")
    for rank in (0, 1):
        rewrite_jsonl(run / "metrics" / f"rank{rank}.jsonl",
                      lambda r: {**r, "local_loss": 1e308} if r["step"] == 8 else r)
    steps, losses = mean_local_loss(load_run(run).metrics)
    assert losses[steps.index(8)] == 1e308
    assert_pngs(build_report(run).files, PLOTS)


def test_a_sync_ends_a_state_split_and_evaluations_show_the_divergence(
        fault_run: pathlib.Path, clean_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    run_dir = copy_run(fault_run, tmp_path / "synced")
    # A state fingerprint every 5 steps found a split at step 5, which a sync at step 5
    # repaired: the training-state line is 2 at step 5 only, not until the next check.
    states = {0: 1, 5: 2, 10: 1}
    rewrite_jsonl(run_dir / "consistency.jsonl", lambda r: {
        **{k: v for k, v in r.items() if k != "replicas/state_distinct"},
        **({"replicas/state_distinct": states[r["step"]]} if r["step"] in states else {})})
    sync = {"step": 5, "event": "sync", "period": 5, "divergence": 1e-3, "mode": "majority-copy"}
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps(sync) + "\n")
    run = load_run(run_dir)
    steps, values = _state_distinct(run)
    # The run ends split (summary.json: 2 replicas): the line says so at its end, past step 11.
    assert list(zip(steps, values)) == [(0, 1), (5, 2), (6, 1), (10, 1), (12, 2)]
    # An overlapped sync started after step 5 lands during step 6, after its fingerprint;
    # step 5's split aggregated gradients split the state from step 6 on until then.
    rewrite_jsonl(run_dir / "events.jsonl", lambda e: {**e, "overlapped": True, "seen_from": 7} if e == sync else e)
    steps, values = _state_distinct(load_run(run_dir))
    assert list(zip(steps, values)) == [(0, 1), (5, 2), (6, 2), (7, 1), (10, 1), (12, 2)]
    # The divergence measured at every evaluation: the split at step 5 shows at 6 and 12.
    steps, values = _eval_divergence(run)
    assert steps == [0, 6, 12] and values[0] == 0 and min(values[1:]) > 0
    assert _eval_divergence(load_run(clean_run)) == ([], [])  # never left 0: no panel for it
    report = build_report(run_dir)
    assert_pngs(report.files, PLOTS)


def test_a_non_finite_replica_at_a_sync_is_no_identical_replicas(fault_run: pathlib.Path,
                                                                  tmp_path: pathlib.Path) -> None:
    """The divergence panel marked a repair's NaN replica and said, beside the marker,
    "every sync found identical replicas"."""
    import matplotlib.pyplot as plt

    run_dir = copy_run(fault_run, tmp_path / "nan-at-sync")
    rewrite_jsonl(run_dir / "evals.jsonl", lambda r: {**r, "replica_rel_diff": 0.0})
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(json.dumps({"step": 9, "event": "sync", "period": 8, "divergence": "inf", "mode": "finite-copy"})
                + "\n")
    fig, ax = plt.subplots()
    run = load_run(run_dir)
    report_divergence._divergence_panel(ax, run, _eval_divergence(run), _alert_divergence(run))
    said = [t.get_text() for t in ax.texts]
    plt.close(fig)
    assert "every sync found identical replicas" not in said
    assert "non-finite replica at a sync" in [line.get_label() for line in ax.get_lines()]


def test_a_nan_replica_is_the_worst_in_the_text(fault_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    run_dir = copy_run(fault_run, tmp_path / "nan-replica")
    (run_dir / "summary.json").unlink()
    rewrite_jsonl(run_dir / "evals.jsonl", lambda r: {**r, "val_loss": "nan", "val_loss_per_rank": [3.9, "nan"]}
                  if r["step"] == 12 else r)
    text = build_report(run_dir).text
    assert "-> nan (step 12)" in text and "worst rank 3.9" not in text


def test_not_a_run_directory(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ReportError, match="RUN_DIR: must not be empty"):
        build_report("")
    with pytest.raises(ReportError, match=re.escape(f"{tmp_path / 'missing'}: does not exist")):
        build_report(tmp_path / "missing")
    refused = ("not a paft run directory (no config.json, and no consistency.jsonl record with local_losses): "
               "expected a paft train run directory, or the folder of a library run's RunRecorder with the monitor on")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ReportError, match=re.escape(f"plain: {refused}")):
        build_report(tmp_path / "plain")
    # A RunRecorder's folder before a monitored step, or with the monitor off.
    (tmp_path / "plain" / "metrics").mkdir()
    (tmp_path / "plain" / "events.jsonl").write_text('{"step": 0, "event": "sync"}\n')
    with pytest.raises(ReportError, match=re.escape(f"plain: {refused}")):
        build_report(tmp_path / "plain")
    started = tmp_path / "started"
    (started / "metrics").mkdir(parents=True)
    (started / "config.json").write_text("{}")  # another program's
    with pytest.raises(ReportError, match=re.escape("started: not a paft run directory (its config.json is not")):
        build_report(started)
    (started / "config.json").write_text(json.dumps(TrainConfig().to_dict()))
    with pytest.raises(ReportError, match="started: no per-step metrics"):
        build_report(started)
    assert issubclass(ReportError, ValueError)
    assert not (tmp_path / "plain" / "report").exists()


@pytest.mark.parametrize("name,data,needle", [
    ("consistency.jsonl", b"null\n", "consistency.jsonl: line 1 is not a JSON object (got NoneType)"),
    ("summary.json", b"[]", "summary.json must hold a JSON object, got list"),
    ("summary.json", b'{"steps": "x"}', "summary.json: steps must be a number, got 'x'"),
    ("config.json", b"\xff\xfe{}", "config.json is not UTF-8 text"),
    ("config.json", b'{"protect": "x"}', "config.json: protect must be an object, got 'x'"),
    ("config.json", b'{"steps": true}', "config.json: steps must be an integer, got True"),  # JSON's true is no count
    ("summary.json", b'{"steps": 12, "final_val_loss": "x"}', "summary.json: final_val_loss must be a number, got 'x'"),
    ("metrics/rank0.jsonl", b'{"step": NaN}\n{"step": 1}\n', "rank0.jsonl: record 1: step must be an integer >= 0"),
    ("events.jsonl", b'{"event": "sync"}\n{"step": 1}\n', "events.jsonl: record 1: step must be an integer >= 0"),
    ("faults.jsonl", b'{"step": 2, "rank": "x"}\n{"step": 1}\n', "faults.jsonl: record 1: rank must be an integer"),
    # Fields of the wrong kind crashed the report halfway (plots written, report.md not).
    ("config.json", b'{"inject": [3]}', "config.json: inject must be a list of fault specs (strings), got [3]"),
    ("events.jsonl", b'{"step": 2, "event": "stop", "reason": 5}\n',
     "events.jsonl: record 1: reason must be a string, got 5"),
    ("events.jsonl", b'{"step": 2, "event": "guard", "action": "stop", "ranks": 5}\n',
     "events.jsonl: record 1: ranks must be a list of ranks, got 5"),
    ("consistency.jsonl", b'{"step": 3, "replicas/grad_distinct": 2, "replicas/grad_minority_ranks": 5}\n',
     "consistency.jsonl: record 1: replicas/grad_minority_ranks must be a list of ranks, got 5"),
    ("consistency.jsonl", b'{"step": 3, "consistency/nonfinite_ranks": [-1]}\n',
     "consistency.jsonl: record 1: consistency/nonfinite_ranks must be a list of ranks, got [-1]"),
    ("evals.jsonl", b'{"step": 4, "val_loss": 1.0, "val_loss_per_rank": 5}\n',
     "evals.jsonl: record 1: val_loss_per_rank must be a list, got 5"),
    # These were "a record holds a value of an unexpected kind", naming no file.
    ("faults.jsonl", b'{"step": 5, "rank": 1, "before": 5, "after": [1.0]}\n',
     "faults.jsonl: record 1: before must be a list, got 5"),
    ("events.jsonl", b'{"step": 5, "event": "sync", "groups": [[0], 1]}\n',
     "events.jsonl: record 1: groups must be a list of lists of ranks, got [[0], 1]"),
])
def test_damaged_files_are_named_not_taken_for_missing(fault_run: pathlib.Path, tmp_path: pathlib.Path,
                                                       name: str, data: bytes, needle: str) -> None:
    run = copy_run(fault_run, tmp_path / "damaged")
    (run / name).write_bytes(data)
    with pytest.raises(ReportError, match=re.escape(needle)):
        build_report(run)
    assert not (run / "report").exists()


def test_a_record_the_checks_let_through_leaves_no_half_report(fault_run: pathlib.Path, tmp_path: pathlib.Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a record holds, the report is drawn whole before a file is written."""
    run = copy_run(fault_run, tmp_path / "odd")
    build_report(run)
    def files() -> dict[str, tuple[bytes, int]]:  # a rewrite replaces the file: a new inode
        return {p.name: (p.read_bytes(), p.stat().st_ino) for p in (run / "report").iterdir()}

    before = files()

    def choke(run: Any, files: Any) -> str:
        raise TypeError("'int' object is not iterable")

    monkeypatch.setattr(report_module, "summary_text", choke)  # the last thing drawn
    with pytest.raises(ReportError, match=re.escape("a record holds a value of an unexpected kind (TypeError: "
                                                    "'int' object is not iterable); nothing was written")):
        build_report(run)
    assert files() == before
    with pytest.raises(ReportError, match="nothing was written"):  # not even a new folder
        build_report(run, tmp_path / "fresh" / "out")
    assert not (tmp_path / "fresh").exists()


def test_a_consistency_file_without_a_complete_record_is_not_monitoring_off(
        fault_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    run = copy_run(fault_run, tmp_path / "cut")
    (run / "consistency.jsonl").write_bytes(b'{"step": 0, "consis')  # cut inside its first record
    assert "not recorded (consistency.jsonl holds no complete record)" in build_report(run).text


def test_out_dir_is_never_among_other_files(clean_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    # A user's own report.md and loss.png (generic names) do not make a folder paft's.
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / "report.md").write_text("my notes")
    (tmp_path / "proj" / "loss.png").write_bytes(b"my plot")
    (tmp_path / "afile").write_text("")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    for out, needle in [(tmp_path / "mine", "--out-dir: " + str(tmp_path / "mine") + " holds no .paft-report"),
                        (tmp_path / "dangling", "is a symbolic link to nothing"),  # was: "File exists"
                        (tmp_path / "proj", "--out-dir: " + str(tmp_path / "proj") + " holds no .paft-report"),
                        (tmp_path / "afile", "exists and is not a directory"),
                        (tmp_path / "afile" / "sub", "is not a directory")]:
        with pytest.raises(ReportError, match=re.escape(needle)):
            build_report(clean_run, out)
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]
    assert (tmp_path / "proj" / "report.md").read_text() == "my notes"
    assert (tmp_path / "proj" / "loss.png").read_bytes() == b"my plot"
    run = copy_run(clean_run, tmp_path / "filled")
    (run / "report").write_text("a user's file")  # the default folder's name taken: no --out-dir to blame
    needle = f"the report folder: {run / 'report'} exists and is not a directory"
    with pytest.raises(ReportError, match=re.escape(needle)):
        build_report(run)
    again = build_report(clean_run, tmp_path / "out")  # a report folder is replaced by the next report
    (tmp_path / "out" / "report.md").write_text("stale")
    (tmp_path / "out" / "cosine.png").write_bytes(b"stale")
    assert build_report(clean_run, tmp_path / "out").files == again.files
    assert (tmp_path / "out" / "report.md").read_text().startswith("# paft report: ")
    assert (tmp_path / "out" / "cosine.png").read_bytes() != b"stale"
    (tmp_path / "out" / ".paft-report").unlink()  # a report written before the marker: known by its title
    assert build_report(clean_run, tmp_path / "out").files == again.files


def test_an_interrupted_report_leaves_the_earlier_one_whole(clean_run: pathlib.Path, tmp_path: pathlib.Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    # The earlier report's plots were deleted up front: a Ctrl-C after the first plot
    # left a report.md linking to three missing files.
    out = tmp_path / "out"
    first = build_report(clean_run, out)
    before = {f.name: f.read_bytes() for f in first.files}
    real_stage = records.stage_bytes

    def interrupted_after_loss(path: pathlib.Path, data: bytes) -> pathlib.Path:
        if path.name != "loss.png":
            raise KeyboardInterrupt
        return real_stage(path, data)

    monkeypatch.setattr(records, "stage_bytes", interrupted_after_loss)
    with pytest.raises(KeyboardInterrupt):
        build_report(clean_run, out)
    linked = re.findall(r"\]\(([^)]+)\)", (out / "report.md").read_text())
    assert len(linked) == len(first.files) - 1 and all((out / name).is_file() for name in linked)
    assert (out / "report.md").read_bytes() == before["report.md"]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".") and p.name != ".paft-report"]
    monkeypatch.undo()
    assert {f.name: f.read_bytes() for f in build_report(clean_run, out).files}.keys() == before.keys()


def test_a_report_the_disk_cannot_hold_is_refused_and_leaves_the_earlier_one_untouched(
        clean_run: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A full disk raised OSError's traceback (exit 1) after the first plots had replaced
    # the earlier report's: a report.md beside plots of another report.
    out = tmp_path / "out"
    build_report(clean_run, out)
    before = {p.name: (p.read_bytes(), p.stat().st_ino) for p in out.iterdir()}
    real_fsync = os.fsync
    calls = []

    def full_at_the_second_file(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_at_the_second_file)
    with pytest.raises(ReportError, match=re.escape(f"cannot write {out / 'dispersion.png'}: No space left on "
                                                    "device; nothing was written")):
        build_report(clean_run, out)
    assert {p.name: (p.read_bytes(), p.stat().st_ino) for p in out.iterdir()} == before
    calls.clear()
    with pytest.raises(ReportError, match="No space left on device; nothing was written"):
        build_report(clean_run, tmp_path / "fresh" / "out")
    assert not (tmp_path / "fresh").exists()


def test_the_global_loss_line_has_every_step_when_consistency_is_sparse(fault_run: pathlib.Path,
                                                                        tmp_path: pathlib.Path) -> None:
    run_dir = copy_run(fault_run, tmp_path / "sparse")
    path = run_dir / "consistency.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r) + "\n" for r in records if r["step"] % 5 == 0))  # --monitor-interval 5
    steps, values = mean_local_loss(load_run(run_dir).metrics)
    assert steps == [r["step"] for r in records] == list(range(12))
    assert values == pytest.approx([r["loss"] for r in records], rel=1e-12)
    # A rank that stopped recording a step early (killed): no mean of the others' alone.
    path = run_dir / "metrics" / "rank1.jsonl"
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:-1]))
    steps, values = mean_local_loss(load_run(run_dir).metrics)
    assert steps == list(range(11)) and values == pytest.approx([r["loss"] for r in records[:11]], rel=1e-12)


def test_per_rank_validation_losses_are_drawn_when_they_differ_visibly() -> None:
    visible = report_module._visible_spread
    assert visible([3.9, 3.95]) and not visible([3.9, 3.9 + 1e-7])  # 1e-3 relative: apart by more than rounding
    assert visible([3.9, 3.91]) and not visible([3.9, 3.903])  # either side of the 1e-3
    assert visible([3.9, math.nan]) and not visible([math.nan, math.nan])  # a NaN beside a number shows


def test_loss_plot_draws_every_ranks_local_loss_and_their_mean(fault_run: pathlib.Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    figures: list[Any] = []
    monkeypatch.setattr(report_module, "png", lambda fig: figures.append(fig) or b"")
    run = load_run(fault_run)
    report_module._plot_loss(run)
    lines = {line.get_label(): line for line in figures[0].axes[0].get_lines()}
    local = {rank: [r["local_loss"] for r in run.metrics[rank]] for rank in (0, 1)}
    for rank in (0, 1):
        line = lines[f"rank {rank} local loss"]
        assert list(line.get_xdata()) == list(range(12)) and list(line.get_ydata()) == local[rank]
    mean = lines["global loss (mean of ranks)"]
    assert list(mean.get_xdata()) == list(range(12))
    assert list(mean.get_ydata()) == [(a + b) / 2 for a, b in zip(local[0], local[1])]
    val = lines["validation loss (mean)"]
    drawn = [(x, y) for x, y in zip(val.get_xdata(), val.get_ydata()) if math.isfinite(y)]
    assert drawn == [(r["step"], r["val_loss"]) for r in run.evals]


def test_ranks_at_one_validation_loss_stay_visible(fault_run: pathlib.Path, tmp_path: pathlib.Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Per-rank validation markers of one size: where ranks agreed (replicas identical),
    the last rank's hid the others' (a report review)."""
    run_dir = copy_run(fault_run, tmp_path / "r")
    rewrite_jsonl(run_dir / "evals.jsonl", lambda r: {**r, "val_loss_per_rank": [4.0, 4.0 + r["step"] / 10]})
    figures: list[Any] = []
    monkeypatch.setattr(report_module, "png", lambda fig: figures.append(fig) or b"")
    report_module._plot_loss(load_run(run_dir))
    lines = {line.get_label(): line for line in figures[0].axes[0].get_lines()}
    sizes = [lines[f"rank {rank} validation loss"].get_markersize() for rank in (0, 1)]
    assert sizes[0] > sizes[1]  # drawn in rank order, so each later rank's sits inside


def test_no_line_bridges_a_step_that_was_not_measured(fault_run: pathlib.Path, tmp_path: pathlib.Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Worker metrics at some steps only (--monitor-interval; between its steps the
    records hold the replica checks alone): a line from step 2 to step 5 drew values
    for steps 3 and 4, where nothing was measured."""
    run_dir = copy_run(fault_run, tmp_path / "gaps")
    measured = {0, 1, 2, 5, 9, 10, 11}
    metric = re.compile(r"consistency/|local_grad_norms$")
    rewrite_jsonl(run_dir / "consistency.jsonl",
                  lambda r: r if r["step"] in measured else {k: v for k, v in r.items() if not metric.match(k)})
    figures: list[Any] = []
    monkeypatch.setattr(report_module, "png", lambda fig: figures.append(fig) or b"")
    run = load_run(run_dir)
    report_module._plot_dispersion(run)
    report_module._plot_cosine(run)
    series = [line for fig in figures for ax in fig.axes for line in ax.get_lines()
              if line.get_label().startswith(("consistency/", "grad_cos_", "rank "))]
    assert len(series) == 4 + 2 + 2  # the dispersion panels, pairwise cosine, each rank's cosine to the mean
    for line in series:
        xs, ys = list(line.get_xdata()), list(line.get_ydata())
        assert [x for x, y in zip(xs, ys) if math.isfinite(y)] == sorted(measured), line.get_label()
        # Every segment joins two neighbouring steps; the point at step 5 stands alone, as a marker.
        joined = [(a, b) for a, b, ya, yb in zip(xs, xs[1:], ys, ys[1:]) if math.isfinite(ya) and math.isfinite(yb)]
        assert joined == [(0, 1), (1, 2), (9, 10), (10, 11)], line.get_label()
        assert line.get_marker() == "o" and [xs[i] for i in line.get_markevery()] == [5], line.get_label()
    # Measured at every step: one unbroken line, no marker.
    _, (ax,) = figure(1, 1, "every step")
    plot(ax, [0, 1, 2], [1.0, 2.0, 3.0])
    assert list(ax.get_lines()[0].get_xdata()) == [0, 1, 2] and ax.get_lines()[0].get_marker() == "None"


def test_a_line_breaks_at_each_unmeasured_step_and_marks_what_it_cannot_draw() -> None:
    # A bool is no number: a gap, as any other non-number in a record.
    steps, values = series([{"step": 0, "v": 1.0}, {"step": 1, "v": True}, {"step": 2},
                                            {"step": 3, "v": 2}], "v")
    assert steps == [0, 1, 3] and values[0] == 1.0 and math.isnan(values[1]) and values[2] == 2.0
    _, (ax,) = figure(1, 1, "lines")
    plot(ax, [0, 1, 3, 4], [1.0, 2.0, 3.0, 4.0])  # step 2 alone missing: no line across it either
    xs, ys = list(ax.get_lines()[0].get_xdata()), list(ax.get_lines()[0].get_ydata())
    assert xs == [0, 1, 2, 3, 4] and math.isnan(ys[2]) and ys[:2] + ys[3:] == [1.0, 2.0, 3.0, 4.0]
    # Two series gone non-finite: each its own row of markers (which went first shows), one legend entry.
    plot(ax, [0, 1], [math.inf, 1.0], color="C0")
    plot(ax, [0, 1], [1.0, math.nan], color="C1")
    rows = [(line.get_color(), line.get_ydata()[0]) for line in ax.get_lines() if line.get_gid() == "nonfinite"]
    assert rows == [("C0", 0.88), ("C1", pytest.approx(0.84))]
    assert ax.get_legend_handles_labels()[1].count("non-finite value (color: series)") == 1
    assert len({report_draw.rank_color(rank) for rank in range(10)}) == 10  # tab10: one colour per rank


@pytest.mark.parametrize("values,scale", [
    ([1.0, 50.0], "linear"), ([1.0, 100.0], "log"), ([0.0, 1.0, 100.0], "symlog"), ([-1.0, 1.0, 100.0], "symlog"),
    ([math.nan, 1.0, 100.0], "log"),  # the non-finite values are no part of the span
])
def test_a_panel_is_logarithmic_once_its_positive_values_span_two_decades(values: list[float], scale: str) -> None:
    _, (ax,) = figure(1, 1, "scale")
    report_draw.scale(ax, values)
    assert ax.get_yscale() == scale


def test_a_run_without_worker_metrics_is_reported(fault_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # --monitor-interval 0: only the replica checks' records (the split, its end, the
    # state fingerprints), no dispersion or cosine. The report says why they are missing.
    run = copy_run(fault_run, tmp_path / "no-metrics")
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "monitor": {**config["monitor"], "interval": 0}}))
    metric = re.compile(r"consistency/|local_grad_norms$")
    rewrite_jsonl(run / "consistency.jsonl", lambda r: {k: v for k, v in r.items() if not metric.match(k)})
    report = build_report(run)
    assert_pngs(report.files, ["loss.png", "divergence.png"])  # no empty dispersion plot
    assert "max loss_cv: not recorded (worker metrics off: --monitor-interval 0)" in report.text
    assert "min grad_cos_min: not recorded (worker metrics off: --monitor-interval 0)" in report.text
    assert "first replica split: step 5 (aggregated-gradient checksums" in report.text
    (run / "config.json").write_text(json.dumps({**config, "monitor": "on"}))
    with pytest.raises(ReportError, match="monitor must be an object"):
        build_report(run)


def test_a_lone_point_is_drawn_over_the_whole_run(fault_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # A series with one point has no line to draw: without a marker it was in the legend
    # only, on an x axis of ±0.04 around the point (a 1-step run; --monitor-interval 0).
    run_dir = copy_run(fault_run, tmp_path / "lone")
    path = run_dir / "consistency.jsonl"
    path.write_text(path.read_text().splitlines()[0] + "\n")  # step 0's record only
    run = load_run(run_dir)
    _, (ax, other) = figure(1, 2, "lone")
    _replica_panel(ax, run)
    lone = [line for line in ax.get_lines() if line.get_label() == "distinct aggregated gradients"]
    assert lone[0].get_marker() == "o"
    lo, hi = ax.get_xlim()
    assert lo <= 0 and hi >= run.last_step + 1  # the whole run (and the end state, past its last step)
    plot(other, [0, 1], [1.0, 2.0])  # a line: no marker added
    plot(other, [0, 1], [1.0, math.nan])
    assert [line.get_marker() for line in other.get_lines()[:2]] == ["None", "o"]
    _, (alone,) = figure(1, 1, "one point")  # x not shared with a panel that spans the run
    plot(alone, [0], [1.0])
    report_draw.finish(alone, run, "one point", "value")  # to the end state, after the last step's update
    assert alone.get_xlim()[1] == run.last_step + 1


def test_a_summary_the_records_went_past_is_set_aside(fault_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # A resume of a finished run rewrites summary.json only when it ends: interrupted
    # before, the old summary (8 steps here) must not speak for the records (12).
    run = copy_run(fault_run, tmp_path / "resumed")
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "steps": 8, "final_val_loss": 99.0}))
    text = build_report(run).text
    assert "note: summary.json ends at step 8 but the records go on to step 12" in text
    assert "steps: 12 of 12" in text and "99.0" not in text
    final = json.loads((run / "evals.jsonl").read_text().splitlines()[-1])
    assert f"-> {final['val_loss']:.4f} (step 12" in text
    # A resume from an earlier checkpoint (the newest one damaged) cut the records back
    # below the old summary's 12 steps: the old summary had spoken for them.
    (run / "summary.json").write_text(json.dumps({**summary, "steps": 20, "final_val_loss": 99.0}))
    text = build_report(run).text
    assert "note: summary.json ends at step 20 but the records stop at step 12" in text
    assert "steps: 12 of 12" in text and "99.0" not in text


def test_a_split_a_sync_ended_before_any_fingerprint_is_reported(clean_run: pathlib.Path,
                                                                  tmp_path: pathlib.Path) -> None:
    """A scheduled sync repaired a split no fingerprint had seen yet: the report said
    "first replica split: none" and drew one replica throughout."""
    run = copy_run(clean_run, tmp_path / "synced")
    with open(run / "events.jsonl", "a") as f:
        for event in (  # a BatchNorm model's fault-free sync: only the buffers differ, no split
            {"step": 2, "event": "sync", "period": 5, "divergence": 0.01, "mode": "median", "groups": [[0], [1]],
             "note": "buffers only"},
            {"step": 5, "event": "sync", "period": 5, "divergence": 0.2, "mode": "median-with-reference",
             "groups": [[0], [1]], "note": ""},
        ):
            f.write(json.dumps(event) + "\n")
    text = build_report(run).text
    assert ("first replica split: step 5 (training-state fingerprints differ; no strict majority; "
            "found and repaired by the sync at this step") in text
    steps, values = _state_distinct(load_run(run))
    assert dict(zip(steps, values))[5] == 2 and dict(zip(steps, values))[6] == 1
    assert dict(zip(steps, values)).get(2, 1) == 1


def test_the_first_split_is_the_earliest_whoever_found_it(fault_run: pathlib.Path, clean_run: pathlib.Path,
                                                         tmp_path: pathlib.Path) -> None:
    early, late = copy_run(fault_run, tmp_path / "early"), copy_run(clean_run, tmp_path / "late")
    with open(early / "events.jsonl", "a") as f:  # later splits, found by the guard and a sync
        for event in ({"step": 8, "event": "guard", "attempt": 0, "action": "recompute", "detector": "state_mismatch",
                       "cause": "state", "ranks": [1], "values": {}},
                      {"step": 9, "event": "sync", "period": 5, "divergence": 0.2, "mode": "median",
                       "groups": [[0], [1]], "note": ""}):
            f.write(json.dumps(event) + "\n")
    assert "first replica split: step 5 (aggregated-gradient checksums differ" in summary_text(load_run(early))
    # Found by the guard before the records' split at step 5: the guard's step (a mutant
    # that took the records' split whenever there was one survived).
    guarded = copy_run(fault_run, tmp_path / "guarded")
    with open(guarded / "events.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, "event": "guard", "attempt": 0, "action": "recompute",
                            "detector": "grad_mismatch", "cause": "transient", "ranks": [1], "values": {}}) + "\n")
    assert ("first replica split: step 2 on rank 1 (aggregated-gradient checksums differ; no strict majority; "
            "the guard caught it before the update)") in summary_text(load_run(guarded))
    with open(late / "events.jsonl", "a") as f:
        f.write(json.dumps({"step": 10, "event": "sync", "period": 5, "divergence": 0.2, "mode": "median",
                            "groups": [[0], [1]], "note": ""}) + "\n")
    # Beside the split, written leftwards when it is late in the run (clear of the legend).
    for run_dir, step, side in ((early, 5, "left"), (late, 10, "right")):
        _, (ax,) = figure(1, 1, "split")
        _replica_panel(ax, load_run(run_dir))
        note = ax.texts[0]  # early's sync at step 9 found a later split, after the guard undid the first
        assert note.get_text().startswith(f"first split: step {step}, ") and note.get_horizontalalignment() == side


def test_the_training_state_line_takes_a_repair_at_its_own_step(clean_run: pathlib.Path,
                                                                tmp_path: pathlib.Path) -> None:
    """The guard's repair before a step's rerun (seen_from: that step) found the replicas
    split and left them one: one replica from that step on, not two until the next
    fingerprint; two after the step before's update, where the state it found came from.
    At a fingerprint step (a fault at rest at step 5 that the guard's state check caught at
    step 10, as a real run recorded it) the rerun's fingerprints of one replica hid the
    split: the line never left 1. A repair at step 0 has no step before it."""
    run = copy_run(clean_run, tmp_path / "repaired")
    with open(run / "events.jsonl", "a") as f:
        for step in (3, 10):  # clean_run fingerprints the state at steps 0 and 10
            f.write(json.dumps({"step": step, "event": "repair", "mode": "median-with-reference", "divergence": 0.5,
                                "groups": [[0], [1]], "note": "", "seen_from": step}) + "\n")
    steps, values = _state_distinct(load_run(run))
    assert list(zip(steps, values)) == [(0, 1), (2, 2), (3, 1), (9, 2), (10, 1), (12, 1)]
    at_start = load_run(run)
    at_start.events = [{**at_start.events[-1], "step": 0, "seen_from": 0}]
    assert list(zip(*_state_distinct(at_start))) == [(0, 1), (10, 1), (12, 1)]


def test_the_training_state_line_draws_every_split_a_sync_found_after_its_update(
        clean_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """PAFT-Dyn repairs a split at the step of its fault, after the update: the line drew it
    there, but not where the step before had its own repair (that repair's end, seen from
    this step, had the last word) nor at a step with a state fingerprint (taken before the
    update). A real 3-rank Dyn run drew 13 of its 15 repaired splits and left out the one
    of step 100, the largest."""
    run = copy_run(clean_run, tmp_path / "repaired-twice")
    with open(run / "events.jsonl", "a") as f:
        for step in (3, 4, 10):  # clean_run fingerprints the state at steps 0 and 10: one replica
            f.write(json.dumps({"step": step, "event": "sync", "mode": "majority-copy", "divergence": 0.1,
                                "groups": [[0], [1]], "note": "", "seen_from": step + 1}) + "\n")
    steps, values = _state_distinct(load_run(run))
    assert list(zip(steps, values)) == [(0, 1), (3, 2), (4, 2), (5, 1), (10, 2), (11, 1), (12, 1)]


def test_the_divergence_a_guard_repair_found_shows_below_its_marks_and_no_distance_below_zero(
        clean_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """A guard's repair of a replica hit at rest (divergence 5.6e35 in a real run) is the
    panel's highest value, at the step of the guard's marks on the top edge, which hid it;
    the symlog axis that the evaluations' zeros call for went below 0 (-1e-2)."""
    run = copy_run(clean_run, tmp_path / "guard-repair")
    with open(run / "events.jsonl", "a") as f:
        for event in ({"step": 3, "event": "guard", "attempt": 0, "action": "repair", "detector": "state_mismatch",
                       "cause": "state", "ranks": [1], "values": {}},
                      {"step": 3, "event": "repair", "mode": "median-with-reference", "divergence": 5.6e35,
                       "groups": [[0], [1]], "note": "", "seen_from": 3}):
            f.write(json.dumps(event) + "\n")
    rewrite_jsonl(run / "evals.jsonl", lambda r: {**r, "replica_rel_diff": 1e-4 if r["step"] == 6 else 0.0})
    _, (ax,) = figure(1, 1, "divergence")
    loaded = load_run(run)
    report_divergence._divergence_panel(ax, loaded, _eval_divergence(loaded), _alert_divergence(loaded))
    assert ax.get_yscale() == "symlog" and ax.get_ylim()[0] == 0
    height = ax.transAxes.inverted().transform(ax.transData.transform((3, 5.6e35)))[1]
    assert height < 0.88  # the guard's marks are drawn from 0.91 of the panel up


def test_a_sync_before_the_first_state_fingerprint_ends_its_split(clean_run: pathlib.Path,
                                                                   tmp_path: pathlib.Path) -> None:
    """--fingerprint-every 0: the state is fingerprinted only after the guard's state
    mismatch (step 8 here). A sync at step 5 found the replicas split and left them one;
    the line drew the split and dropped its end, two replicas from step 5 to 8."""
    run = copy_run(clean_run, tmp_path / "late-fingerprint")
    rewrite_jsonl(run / "consistency.jsonl", lambda r: {
        **{k: v for k, v in r.items() if not k.startswith("replicas/state_")},
        **({"replicas/state_distinct": 1, "replicas/state_minority_ranks": []} if r["step"] == 8 else {})})
    with open(run / "events.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "event": "sync", "period": 5, "divergence": 0.2, "mode": "median",
                            "groups": [[0], [1]], "note": ""}) + "\n")
    steps, values = _state_distinct(load_run(run))
    assert list(zip(steps, values)) == [(5, 2), (6, 1), (8, 1), (12, 1)]


def test_a_run_without_state_fingerprints_says_what_its_syncs_found(tmp_path: pathlib.Path) -> None:
    """--fingerprint-every 0: no fingerprint of the training state, and the report drew
    no state line and said nothing of it. The syncs compare the state whole, and an
    update from split aggregated gradients splits it: here the fault at step 5 splits
    the gradients, the overlapped sync of step 4 (found identical) landed in step 5
    before that update, and the sync of step 8 found the split and ended it."""
    run_dir = make_run(tmp_path / "fp0", ["bitflip:steps=5,bits=exponent,ranks=1"],
                       monitor=MonitorConfig(fingerprint_every=0), protect=ProtectConfig(mode="sync", sync_period=4))
    run = load_run(run_dir)
    assert not any("replicas/state_distinct" in r for r in run.consistency)
    assert [(e["step"], e["seen_from"]) for e in run.events_of("sync")] == [(4, 6), (8, 9)]
    steps, values = _state_distinct(run)
    assert list(zip(steps, values)) == [(6, 2), (8, 2), (9, 1), (12, 1)]
    _, (ax,) = figure(1, 1, "fp0")
    _replica_panel(ax, run)
    assert "distinct training state (not fingerprinted: syncs, checksums)" in ax.get_legend_handles_labels()[1]
    assert ("\ntraining state: not fingerprinted while training (--fingerprint-every 0); the syncs found it "
            "identical at step 4 and apart at step 8 (groups [[0], [1]])\n") in summary_text(run)
    # A blocking sync after step 5's update (seen from 6) found the split and ended it:
    # it came after that update, and has the last word over its split gradients.
    blocking = copy_run(run_dir, tmp_path / "blocking")
    (blocking / "summary.json").unlink()
    sync = {**run.events_of("sync")[1], "step": 5, "seen_from": 6, "overlapped": False}
    (blocking / "events.jsonl").write_text(json.dumps(sync) + "\n")
    assert _state_distinct(load_run(blocking)) == ([5, 6], [2.0, 1.0])
    # Without the syncs (and the summary's end state) only the gradients' split is known.
    copy = copy_run(run_dir, tmp_path / "no-syncs")
    (copy / "summary.json").unlink()
    rewrite_jsonl(copy / "events.jsonl", lambda r: {**r, "event": "was-sync"} if r["event"] == "sync" else r)
    assert _state_distinct(load_run(copy)) == ([6], [2.0])
    assert ("\ntraining state: not fingerprinted while training (--fingerprint-every 0); no sync compared it: a "
            "split shows only through the aggregated-gradient checksums\n") in summary_text(load_run(copy))
    # The guard fingerprints the state after its state mismatch, --fingerprint-every 0 or not.
    rewrite_jsonl(copy / "consistency.jsonl", lambda r: {**r, **({"replicas/state_distinct": 1} if r["step"] in (
        9, 10) else {})})
    assert ("\ntraining state: not fingerprinted while training (--fingerprint-every 0), but at the guard's state "
            "checks (steps 9, 10); no sync compared it") in summary_text(load_run(copy))
    _, (ax,) = figure(1, 1, "fp0 with the guard's checks")
    _replica_panel(ax, load_run(copy))
    assert "distinct training state" in ax.get_legend_handles_labels()[1]
    # --no-monitor records no checksums either: nothing to say of the state.
    (copy / "consistency.jsonl").unlink()
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "monitor": {**cfg["monitor"], "enabled": False}}))
    assert "training state:" not in summary_text(load_run(copy))


def test_a_monitored_run_with_no_record_in_consistency_jsonl_had_no_split_to_record(
        clean_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """--monitor-interval 0 --fingerprint-every 0 records a step only where the aggregated
    gradients split: a run with none has no consistency.jsonl. Its report said the split
    was "not recorded" and nothing of the unfingerprinted state."""
    run = copy_run(clean_run, tmp_path / "quiet")
    (run / "consistency.jsonl").unlink()
    cfg = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps(
        {**cfg, "monitor": {**cfg["monitor"], "interval": 0, "fingerprint_every": 0}}))
    (run / "faults.jsonl").write_text(json.dumps({"step": 4, "rank": 1, "site": "params", "kind": "bitflip"}) + "\n")
    lost = copy_run(clean_run, tmp_path / "lost")  # a monitor recording every step: the records are lost
    (lost / "consistency.jsonl").unlink()
    assert "\nfirst replica split: not recorded" in summary_text(load_run(lost))
    (lost / "consistency.jsonl").write_text(json.dumps({"step": 0}) + "\n")  # an update the scaler skipped
    assert "\nfirst replica split: none seen" in summary_text(load_run(lost))
    text = summary_text(load_run(run))
    assert ("\ntraining state: not fingerprinted while training (--fingerprint-every 0); no sync compared it: a "
            "split shows only through the aggregated-gradient checksums\n") in text
    # Replicas one at the end: a split of the state alone may still have come and gone.
    assert ("\nfirst replica split: none seen (aggregated gradients identical at every recorded step; the training "
            "state fingerprinted only at the end, one replica there, 1 fault injected before)\n") in text
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "replicas_distinct": 2, "replica_groups": [[0], [1]]}))
    assert ("\nfirst replica split: after the last state check (never): the end of the run found 2 distinct "
            "replicas\n") in summary_text(load_run(run))


def test_a_run_without_its_summary_reports_the_summarys_speed(fault_run: pathlib.Path,
                                                               tmp_path: pathlib.Path) -> None:
    """summary.json's steps_per_s leaves out the first steps of every leg (DDP set-up,
    lazy optimizer state: much slower); a run without the summary (crashed, killed)
    averaged every recorded step time, and said another speed for the same steps."""
    line = next(x for x in summary_text(load_run(fault_run)).splitlines() if x.startswith("speed: "))
    run = copy_run(fault_run, tmp_path / "killed")
    (run / "summary.json").unlink()
    assert f"\n{line.removesuffix(')')}; rank 0's step times)\n" in summary_text(load_run(run))
    # Records written before they said which steps were timed: the first leg's rule.
    for rank in (0, 1):
        rewrite_jsonl(run / "metrics" / f"rank{rank}.jsonl", lambda r: {k: v for k, v in r.items() if k != "timed"})
    assert f"\n{line.removesuffix(')')}; rank 0's step times)\n" in summary_text(load_run(run))


def test_the_summary_says_what_the_faults_made_of_the_values_they_hit(
        clean_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # A run whose five exponent flips the guard let pass (#6's command, seed 0): the
    # summary shows they left small values, where a harmful flip leaves inf or 1e+38.
    run = copy_run(clean_run, tmp_path / "faults")

    def flip(step: int, bits: list[int], before: list[Any], after: list[Any]) -> dict[str, Any]:
        return {"step": step, "rank": 1, "site": "local-grad", "kind": "bitflip", "bits": bits,
                "before": before, "after": after}

    faults = [flip(1, [27], [7.0e-05], [1.1e-09]), flip(4, [30, 26], [-0.002, 0.5], ["-inf", -3.0]),
              flip(6, [30], ["nan"], ["nan"]), flip(9, [26], [0.0002], [0.05])]
    # Out of step order, as a crashed run leaves them (the ranks' lines are sorted at the end).
    (run / "faults.jsonl").write_text("".join(json.dumps(f) + "\n" for f in faults[2:] + faults[:2]))
    text = summary_text(load_run(run))
    assert "  by bit: 26 (2), 27 (1), 30 (2)\n" in text
    assert "  first: step 1, rank 1, local-grad/bitflip\n" in text
    # A NaN that stayed NaN was not made by the fault; the largest is by magnitude.
    assert ("  values hit: 5 recorded, 1 made NaN/Inf; largest finite value after: -3 (was 0.5; step 4, rank 1)\n"
            in text)
    # A record lists the first elements it hit only (count= or fraction=): the counts say of how many.
    many = {**flip(5, [24, 30, 28], [0.1, 0.2, 0.3], [0.4, 0.5, 0.6]), "num_elements": 1000}
    (run / "faults.jsonl").write_text(json.dumps(many) + "\n" + json.dumps({**faults[0], "num_elements": 1}) + "\n")
    assert "  by bit (the 4 elements recorded of 1001 hit): 24 (1), 27 (1), 28 (1), 30 (1)\n" in (
        summary_text(load_run(run)))
    (run / "faults.jsonl").write_text(json.dumps({"step": 2, "rank": 0, "site": "params", "kind": "zero"}) + "\n")
    text = summary_text(load_run(run))  # a record without values or bits: no such lines
    assert "by bit" not in text and "values hit" not in text
    # Values that are not numbers (a damaged or hand-edited record) are left out, not a crash.
    (run / "faults.jsonl").write_text(json.dumps(flip(3, [30], [None, "x", 1.0], [2.0, 3.0, 4.0])) + "\n")
    assert "  values hit: 1 recorded, 0 made NaN/Inf; largest finite value after: 4 (was 1; step 3, rank 1)\n" in (
        summary_text(load_run(run)))


def test_an_interrupted_run_is_summed_up_from_its_records(clean_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    run = copy_run(clean_run, tmp_path / "interrupted")
    (run / "summary.json").unlink()
    for rank in (0, 1):
        rewrite_jsonl(run / "metrics" / f"rank{rank}.jsonl", lambda r: {**r, "step_time": 0.25})
    rewrite_jsonl(run / "consistency.jsonl",
                  lambda r: {**r, "consistency/loss_cv": 0.5 if r["step"] in (3, 7) else 0.1,
                             "consistency/grad_cos_min": 0.2 if r["step"] in (4, 8) else 0.9})
    # The ranks' accuracies differ: the worst rank is said for the loss only (the largest accuracy is the best).
    rewrite_jsonl(run / "evals.jsonl", lambda r: {**r, "val_acc": 0.6, "val_acc_per_rank": [0.5, 0.7]})
    (run / "faults.jsonl").write_text("".join(json.dumps({"step": 2, "rank": rank, "site": "params", "kind": "zero"})
                                              + "\n" for rank in (10, 2)))
    with open(run / "events.jsonl", "a") as f:  # the rerun of a detection names the rank the first could not
        for attempt, detector, ranks in ((0, "grad_mismatch", []), (1, "state_mismatch", [1])):
            f.write(json.dumps({"step": 3, "event": "guard", "attempt": attempt, "action": "repair",
                                "detector": detector, "cause": "state", "ranks": ranks, "values": {}}) + "\n")
    text = summary_text(load_run(run))
    assert "speed: 4.00 steps/s (3.00 s in training steps; rank 0's step times)\n" in text
    assert "max loss_cv: 0.5 at step 3\n" in text  # the first step holding it
    assert "min grad_cos_min: 0.2 at step 4\n" in text
    assert "val acc: 0.6000 (step 0) -> 0.6000 (step 12)\n" in text
    assert "by rank: rank 2 (1), rank 10 (1)\n" in text
    assert ("first replica split: step 3 on rank 1 (aggregated-gradient checksums and training-state fingerprints "
            "differ; no strict majority; the guard caught it before the update)\n") in text
    for rank in (0, 1):  # a library user's metrics, without step times: no speed to say (not a division by 0)
        rewrite_jsonl(run / "metrics" / f"rank{rank}.jsonl", lambda r: {k: v for k, v in r.items() if k != "step_time"})
    assert "\nspeed: ?\n" in summary_text(load_run(run))


def test_the_tensors_that_differed_come_from_the_first_record_that_names_them(clean_run: pathlib.Path,
                                                                             tmp_path: pathlib.Path) -> None:
    # A monitor-only run names them in its state-split alert (the tensors farthest apart);
    # a sync or repair by their digests, which wins at the same step (exact, before the update).
    run = copy_run(clean_run, tmp_path / "named")
    # Each tensor's farthest ranks (a record before the ties were kept names one rank: an int).
    alert = {"step": 6, "event": "alert", "detector": "state_split", "value": 2, "ranks": [1],
             "divergence": {"tensors": [["param/wte.weight", 2.0, [1]], ["optim/0/exp_avg", 0.5, 1]]}}
    events = (run / "events.jsonl").read_text() if (run / "events.jsonl").exists() else ""
    (run / "events.jsonl").write_text(events + json.dumps(alert) + "\n")

    def line() -> str:
        return next(x for x in summary_text(load_run(run)).splitlines() if x.startswith("  tensors that differed"))

    assert line() == ("  tensors that differed, farthest apart at the state-split alert of step 6: param/wte.weight "
                      "on rank 1 (relative distance 2 to the mean), optim/0/exp_avg on rank 1 (relative distance "
                      "0.5 to the mean)")
    # An alert records up to 5 tensors and how many moved; the report shows 4 and says
    # how many it left out (an older record without the count: of the 5).
    alert["divergence"]["tensors"] = [[f"param/h.{i}.weight", 1.0, [1]] for i in range(5)]
    (run / "events.jsonl").write_text(events + json.dumps(alert) + "\n")
    assert line().endswith("param/h.3.weight on rank 1 (relative distance 1 to the mean) and 1 more")
    alert["divergence"]["moved_tensors"] = 12
    events += json.dumps(alert) + "\n"
    (run / "events.jsonl").write_text(events)
    assert line().endswith("param/h.3.weight on rank 1 (relative distance 1 to the mean) and 8 more")
    for step, kept in ((6, "as the repair at step 6"), (8, "farthest apart at the state-split alert of step 6")):
        repair = {"step": step, "event": "repair", "mode": "median-with-reference", "groups": [[0], [1]],
                  "differing_tensors": 1, "differing": {"param/wte.weight": [[0], [1]]}}
        (run / "events.jsonl").write_text(events + json.dumps(repair) + "\n")
        assert line().startswith(f"  tensors that differed, {kept}")


def test_a_split_the_guard_undid_is_reported(clean_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    run = copy_run(clean_run, tmp_path / "guarded")
    (run / "summary.json").unlink()
    with open(run / "events.jsonl", "a") as f:
        for event in (
            # Two ranks: no strict majority, so the guard names no rank.
            {"step": 3, "event": "guard", "attempt": 0, "action": "repair", "detector": "state_mismatch",
             "cause": "state", "ranks": [], "values": {}},
            {"step": 3, "event": "repair", "mode": "median-with-reference", "divergence": 0.5, "groups": [[0], [1]],
             "differing_tensors": 6, "differing": {"param/wte.weight": [[0], [1]], **{
                 f"optim/{i}/exp_avg": [[0], [1]] for i in range(5)}}},
            {"step": 7, "event": "dyn_trigger", "period": 25},
            {"step": 7, "event": "sync", "period": 5, "divergence": 0.1, "mode": "median"},
        ):
            f.write(json.dumps(event) + "\n")
    text = build_report(run).text
    assert ("first replica split: step 3 (training-state fingerprints differ; no strict majority; "
            "the guard caught it before the update)") in text
    # The repair's per-tensor names, the first four of the six.
    split = "(no strict majority: [[0], [1]])"
    assert (f"\n  tensors that differed, as the repair at step 3 found them: param/wte.weight {split}, "
            f"optim/0/exp_avg {split}, optim/1/exp_avg {split}, optim/2/exp_avg {split} and 2 more\n") in text
    assert "syncs: 2   detections: 1   recomputes: 1" in text  # the guard's repair is a sync, and reruns
    assert _periods(load_run(run)) == [(7, 25.0), (7, 5.0)]  # the sync's period is the one in force
    # One incident whose recompute trips another detector is one detection (a run
    # recorded before the events carried the guard's own counts)...
    with open(run / "events.jsonl", "a") as f:
        for attempt, detector in ((0, "grad_mismatch"), (1, "rank_outlier")):
            f.write(json.dumps({"step": 9, "event": "guard", "attempt": attempt, "action": "recompute",
                                "detector": detector, "cause": None, "ranks": [1], "values": {}}) + "\n")
    assert "detections: 2   recomputes: 3   skipped batches: 0" in build_report(run).text
    # ... and the guard's own counts, when its events carry them, are the ones reported.
    with open(run / "events.jsonl", "a") as f:
        f.write(json.dumps({"step": 9, "event": "guard", "attempt": 2, "action": "proceed", "detector": "rank_outlier",
                            "cause": "transient", "ranks": [1], "values": {},
                            "totals": {"detections": 7, "recomputes": 8, "skipped_batches": 1}}) + "\n")
    assert "detections: 7   recomputes: 8   skipped batches: 1" in build_report(run).text
    with open(run / "events.jsonl", "a") as f:  # each event carries the counts so far: the last one's are the run's
        f.write(json.dumps({"step": 10, "event": "guard", "attempt": 0, "action": "skip", "detector": "nonfinite",
                            "cause": "persistent", "ranks": [0], "values": {},
                            "totals": {"detections": 8, "recomputes": 8, "skipped_batches": 2}}) + "\n")
    assert "detections: 8   recomputes: 8   skipped batches: 2" in build_report(run).text
    # A stop a resume went on past is kept (why that leg ended), but its counts held the
    # steps the resume re-did: not the run's.
    with open(run / "events.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "event": "guard", "attempt": 1, "action": "stop", "detector": "grad_mismatch",
                            "cause": "persistent", "ranks": [1], "values": {},
                            "totals": {"detections": 99, "recomputes": 99, "skipped_batches": 9}}) + "\n")
    assert "detections: 8   recomputes: 8   skipped batches: 2" in build_report(run).text


def test_a_sync_after_the_last_state_check_is_what_holds_now(fault_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """Without a summary (a stopped run, a library run) the last check's split was the
    last word, though a sync after it had synchronized the replicas (as the plot drew)."""
    run = copy_run(fault_run, tmp_path / "synced")
    (run / "summary.json").unlink()
    # Split aggregated gradients at steps 10 and 11; the state check of step 10 found 2.
    rewrite_jsonl(run / "consistency.jsonl", lambda r: {**r, "replicas/grad_distinct": 2} if r["step"] >= 10 else r)
    sync = {"event": "sync", "period": 5, "divergence": 0.1, "mode": "mean", "groups": [[0], [1]]}
    events = (run / "events.jsonl").read_text()
    # A blocking sync after step 10's update: step 11's split gradients split them again.
    (run / "events.jsonl").write_text(events + json.dumps({**sync, "step": 10, "seen_from": 11}) + "\n")
    assert ("replicas distinct at the last state check (step 10): 2; synchronized since, by the sync at step 10; "
            "aggregated gradients differed after it, first at step 11\n") in summary_text(load_run(run))
    # An overlapped sync started after step 9 that landed in step 10, before its update.
    (run / "events.jsonl").write_text(events + json.dumps({**sync, "step": 9, "seen_from": 11}) + "\n")
    assert ("replicas distinct at the last state check (step 10): 2; synchronized since, by the sync at step 9; "
            "aggregated gradients differed after it, first at step 10\n") in summary_text(load_run(run))
    # One the check already saw says nothing.
    (run / "events.jsonl").write_text(events + json.dumps({**sync, "step": 4, "seen_from": 5}) + "\n")
    assert "replicas distinct at the last state check (step 10): 2; aggregated gradients differed after it, " \
           "first at step 10\n" in summary_text(load_run(run))


def test_a_three_rank_split_names_its_minority(clean_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """With a strict majority the odd rank is named: in the first split, at the last state
    check, and beside each differing tensor of the first sync that named them."""
    run_dir = copy_run(clean_run, tmp_path / "three")
    (run_dir / "summary.json").unlink()
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**config, "world_size": 3}))
    shutil.copy(run_dir / "metrics" / "rank1.jsonl", run_dir / "metrics" / "rank2.jsonl")
    # The state fingerprint of step 10 finds rank 2 apart; the gradients agreed throughout.
    rewrite_jsonl(run_dir / "consistency.jsonl", lambda r: {
        **r, "replicas/state_distinct": 2, "replicas/state_minority_ranks": [2]} if r["step"] == 10 else r)
    run = load_run(run_dir)
    text = summary_text(run)
    assert "first replica split: step 10 on rank 2 (training-state fingerprints differ)\n" in text
    assert "replicas distinct at the last state check (step 10): 2; minority: rank 2\n" in text
    # The syncs that found it: the first names no tensor (the split was in none it lists),
    # the second lists two of the 40 that differed.
    sync = {"event": "sync", "period": 4, "divergence": 0.3, "mode": "majority-copy", "groups": [[0, 1], [2]]}
    run.events = [{**sync, "step": 4, "differing_tensors": 0, "differing": {}},
                  {**sync, "step": 8, "differing_tensors": 40,
                   "differing": {"param/wte.weight": [[0, 1], [2]], "optim/0/exp_avg": [[0], [1], [2]]}}]
    assert report_text._differing_tensors(run, first_split(run)) == [
        "  tensors that differed, as the sync at step 8 found them: param/wte.weight on rank 2, "
        "optim/0/exp_avg (no strict majority: [[0], [1], [2]]) and 38 more"]
    run.events[1]["differing_tensors"] = 2  # every one listed: no "and 0 more"
    assert report_text._differing_tensors(run, first_split(run))[0].endswith(
        "(no strict majority: [[0], [1], [2]])")


def test_a_closed_console_ends_the_report_quietly(fault_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    # `paft report RUN | head`: the reader is gone before the summary is printed.
    paft = pathlib.Path(sys.executable).with_name("paft")
    read, write = os.pipe()
    os.close(read)
    with os.fdopen(write, "wb") as closed:
        proc = subprocess.run([str(paft), "report", str(fault_run), "--out-dir", str(tmp_path / "out")],
                              stdout=closed, stderr=subprocess.PIPE, text=True, timeout=120)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert (tmp_path / "out" / "report.md").is_file()


def test_the_period_panel_starts_from_the_period_the_run_began_with(fault_run: pathlib.Path,
                                                                    tmp_path: pathlib.Path) -> None:
    """PAFT-Dyn starts at the configured period clamped into [h_min, h_max] (60 here, not 50)."""
    run_dir = copy_run(fault_run, tmp_path / "dyn")
    config = json.loads((run_dir / "config.json").read_text())
    config["protect"].update(mode="dyn", sync_period=50, h_min=60, h_max=400)
    (run_dir / "config.json").write_text(json.dumps(config))
    run = load_run(run_dir)
    _, (ax,) = figure(1, 1, "dyn")
    _period_panel(ax, run, [(4, 30.0)])
    line = ax.get_lines()[0]
    assert list(line.get_xdata())[:2] == [0, 4] and list(line.get_ydata())[:2] == [60.0, 30.0]
    assert (line.get_xdata()[-1], line.get_ydata()[-1]) == (run.last_step, 30.0)  # held to the end of the run
    _, (ax,) = figure(1, 1, "dyn from step 0")  # a period set at step 0 is the first: none before it
    _period_panel(ax, run, [(0, 30.0), (4, 20.0)])
    assert list(ax.get_lines()[0].get_xdata())[:2] == [0, 4] and list(ax.get_lines()[0].get_ydata())[:2] == [30, 20]


def test_the_period_panel_draws_the_periods_of_a_resume_that_changed_them(fault_run: pathlib.Path,
                                                                          tmp_path: pathlib.Path) -> None:
    """A resume at step 6 with --h-max 20 clamped the saved H 60: the panel began at the
    new bounds' 20 (config.json is the resumed run's; the run began with 50) and held 60
    until the next sync, as if the clamp had not happened."""
    run_dir = copy_run(fault_run, tmp_path / "resumed")
    config = json.loads((run_dir / "config.json").read_text())
    config["protect"].update(mode="dyn", sync_period=50, h_min=5, h_max=20)
    (run_dir / "config.json").write_text(json.dumps(config))
    with open(run_dir / "events.jsonl", "a") as f:
        for event in ({"step": 3, "event": "sync", "period": 60, "divergence": 0.0, "mode": "noop"},
                      {"step": 6, "event": "period", "period": 20, "first_period": 50}):
            f.write(json.dumps(event) + "\n")
    run = load_run(run_dir)
    _, (ax,) = figure(1, 1, "resumed")
    _period_panel(ax, run, _periods(run))
    line = ax.get_lines()[0]
    assert list(zip(line.get_xdata(), line.get_ydata())) == [(0, 50), (3, 60), (6, 20), (run.last_step, 20)]


def test_divergences_are_points_not_lines_across_the_steps_between(fault_run: pathlib.Path,
                                                                     tmp_path: pathlib.Path) -> None:
    """A line through the sparse evaluations rose before the fault (step 5: 0 at the
    evaluation of step 0, > 0 at step 6's), and one through the syncs that found replicas
    apart ran across a no-op sync between them."""
    run_dir = copy_run(fault_run, tmp_path / "points")
    with open(run_dir / "events.jsonl", "a") as f:
        for step, divergence, mode in ((3, 0.2, "median"), (6, 0.0, "noop"), (9, 0.4, "median")):
            f.write(json.dumps({"step": step, "event": "sync", "period": 3, "divergence": divergence,
                                "mode": mode}) + "\n")
        # A state-split alert's measurement, often the first of a split's size, was not drawn.
        f.write(json.dumps({"step": 4, "event": "alert", "detector": "state_split",
                            "divergence": {"params_per_rank": [1e-5, 3e-5]}}) + "\n")
    run = load_run(run_dir)
    _, (ax,) = figure(1, 1, "points")
    report_divergence._divergence_panel(ax, run, _eval_divergence(run), _alert_divergence(run))
    lines = {line.get_label(): line for line in ax.get_lines()}
    evals, syncs = lines["at evaluations"], lines["before a sync that found replicas apart"]
    measured = [(x, y) for x, y in zip(evals.get_xdata(), evals.get_ydata()) if math.isfinite(y)]
    assert [x for x, _ in measured] == [0, 6, 12] and measured[0][1] == 0 < min(y for _, y in measured[1:])
    assert list(zip(syncs.get_xdata(), syncs.get_ydata())) == [(3, 0.2), (9, 0.4)]
    assert (4, 3e-5) in zip(lines["at a state-split alert"].get_xdata(), lines["at a state-split alert"].get_ydata())
    # The fault lines go behind the data (in its rank's color, one hid that rank's line).
    faults = [line for line in ax.get_lines() if line.get_label().startswith("fault on rank")]
    assert faults and all(line.get_zorder() < evals.get_zorder() for line in faults)
    # Nothing joins two measurements: every line of several points is markers only, or
    # a vertical event line (one step).
    for line in ax.get_lines():
        if len(set(line.get_xdata())) > 1:
            assert line.get_linestyle() == "None" and line.get_marker() != "None", line.get_label()


def test_an_averager_run_without_a_summary_counts_its_syncs(clean_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """PyTorch's averager records no event of its own: an interrupted run read "syncs: 0"."""
    run = copy_run(clean_run, tmp_path / "averager")
    (run / "summary.json").unlink()  # interrupted (Ctrl-C) before the end
    config = json.loads((run / "config.json").read_text())
    config["protect"].update(mode="averager", sync_period=5)
    (run / "config.json").write_text(json.dumps(config))
    # Steps 0-11 recorded: averaged at steps 0, 5 and 10 (paft.resync.averages_at, as Resync counts).
    assert "syncs: 3   detections: 0" in build_report(run).text
    with open(run / "events.jsonl", "a") as f:  # the guard's repair is a sync too
        f.write(json.dumps({"step": 7, "event": "repair", "mode": "median-with-reference", "divergence": 0.5}) + "\n")
    assert "syncs: 4   detections: 0" in build_report(run).text
    for rank in (0, 1):  # interrupted during step 11: steps 0-10 recorded, the last of them an average
        path = run / "metrics" / f"rank{rank}.jsonl"
        path.write_text("".join(path.read_text().splitlines(keepends=True)[:-1]))
    assert "syncs: 4   detections: 0" in build_report(run).text


def test_an_averager_run_resumed_with_another_period_counts_each_legs_averages(
        clean_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """config.json holds the last leg's --sync-period: the averages before a resume that
    changed it were counted at the new period."""
    run = copy_run(clean_run, tmp_path / "averager")
    (run / "summary.json").unlink()
    config = json.loads((run / "config.json").read_text())
    config["protect"].update(mode="averager", sync_period=5)
    (run / "config.json").write_text(json.dumps(config))
    with open(run / "events.jsonl", "a") as f:  # begun at period 2, resumed at step 6 with 5
        f.write(json.dumps({"step": 6, "event": "period", "period": 5, "first_period": 2}) + "\n")
    # Steps 0-11 recorded: averaged at steps 0, 2 and 4, then at 10.
    assert "syncs: 4   detections: 0" in build_report(run).text


@pytest.mark.parametrize(("empty", "rank"), [(False, 1), (True, 0)], ids=["missing", "empty"])
def test_a_rank_without_metrics_is_named(fault_run: pathlib.Path, tmp_path: pathlib.Path, empty: bool,
                                         rank: int) -> None:
    run = copy_run(fault_run, tmp_path / "one-rank-missing")
    (run / "metrics" / f"rank{rank}.jsonl").unlink()
    if empty:
        (run / "metrics" / f"rank{rank}.jsonl").write_text('{"step": 0, "local_lo')  # killed mid-line
    text = build_report(run).text
    assert (f"note: no complete record in metrics/rank{rank}.jsonl (missing or empty): the loss plot lacks "
            f"rank {rank}, and its global loss is the mean over the ranks recorded\n") in text
    assert "world size: 2" in text
    assert "note:" not in build_report(fault_run, tmp_path / "whole").text


def test_identical_non_finite_replicas_are_not_a_healthy_end(clean_run: pathlib.Path, fault_run: pathlib.Path,
                                                              tmp_path: pathlib.Path) -> None:
    """A NaN in one rank's local gradient reaches every replica through the all-reduce:
    one fingerprint group, every replica NaN alike, which the report read as 1 replica."""
    run = copy_run(clean_run, tmp_path / "all-nan")
    summary = json.loads((run / "summary.json").read_text())
    # What such a run writes (nan:site=local-grad,steps=5,ranks=0, seen in a real run).
    summary.update(replicas_distinct=1, replica_groups=[[0, 1]], max_replica_rel_diff="inf", final_val_loss="nan")
    (run / "summary.json").write_text(json.dumps(summary))
    rewrite_jsonl(run / "evals.jsonl", lambda r: {**r, "replica_rel_diff": "inf"} if r["step"] > 0 else r)
    assert ("replicas distinct at the end: 1 (groups [[0, 1]], largest relative L2 distance to their mean inf): "
            "identical but non-finite, every replica holds NaN/Inf in its parameters\n") in build_report(run).text
    (run / "summary.json").unlink()  # interrupted: the last evaluation says it
    assert "; the last evaluation (step 12) found NaN/Inf in a replica's parameters\n" in build_report(run).text
    # Apart, a NaN replica is one of two groups: not "identical".
    split = copy_run(fault_run, tmp_path / "one-nan")
    summary = json.loads((split / "summary.json").read_text())
    (split / "summary.json").write_text(json.dumps({**summary, "max_replica_rel_diff": "inf"}))
    text = build_report(split).text
    assert "replicas distinct at the end: 2 (" in text and "non-finite, every replica" not in text
    assert "non-finite, every replica" not in build_report(clean_run, tmp_path / "clean").text


def test_a_failed_run_says_where_and_why_it_failed(fault_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    run = copy_run(fault_run, tmp_path / "failed")
    (run / "summary.json").unlink()  # a failed run writes none
    with open(run / "events.jsonl", "a") as f:  # as paft train's launcher records a rank killed outright
        f.write(json.dumps({"step": 13, "event": "failed", "rank": 1, "cause": "was killed by SIGKILL",
                            "traceback": None}) + "\n")
    text = summary_text(load_run(run))
    assert text.count("note: the run failed") == 1
    assert "note: the run failed at step 13: rank 1 was killed by SIGKILL\n" in text  # it left no traceback
    # The failure says why there is no summary.json: not a second, vaguer note.
    assert "note: no summary.json" not in text
    # A rank that raised: its traceback is recorded, and the note says where.
    with open(run / "events.jsonl", "a") as f:
        f.write(json.dumps({"step": 13, "event": "failed", "rank": 0, "cause": "failed: ValueError: x",
                            "traceback": "Traceback (most recent call last):\nValueError: x\n"}) + "\n")
    assert ("note: the run failed at step 13: rank 0 failed: ValueError: x (its traceback is in events.jsonl)\n"
            in summary_text(load_run(run)))
    # A resume keeps the line of the leg it continues, and the records go on past it.
    with open(run / "events.jsonl", "a") as f:
        f.write(json.dumps({"step": 6, "event": "failed", "rank": 1, "cause": "was killed by SIGKILL",
                            "traceback": None}) + "\n")
    assert ("note: the run failed at step 6: rank 1 was killed by SIGKILL; resumed, the run went on to step 11\n"
            in summary_text(load_run(run)))


def test_the_first_split_line_says_how_far_the_state_checks_reach(clean_run: pathlib.Path,
                                                                  tmp_path: pathlib.Path) -> None:
    """"none (replicas identical at every recorded step)" was said of a run whose state was
    last fingerprinted steps before its end, with a fault at rest since (a library run, a
    run stopped before its summary): nothing had checked the replicas after it."""
    run = copy_run(clean_run, tmp_path / "r")
    line = "first replica split: none (replicas identical at every recorded step)"
    assert line in build_report(run).text  # the summary's check at the end
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").unlink()
    checked = [r["step"] for r in read_jsonl(run / "consistency.jsonl") if "replicas/state_distinct" in r]
    assert checked[-1] < load_run(run).last_step
    (run / "faults.jsonl").write_text(json.dumps({"step": checked[-1] + 1, "rank": 1, "site": "params",
                                                  "kind": "noise"}) + "\n")
    assert ("first replica split: none seen (aggregated gradients identical at every recorded step; the training "
            f"state fingerprinted last at step {checked[-1]}, 1 fault injected after it)") in build_report(run).text
    (run / "summary.json").write_text(json.dumps({**summary, "replicas_distinct": 2}))
    assert (f"first replica split: after the last state check (last at step {checked[-1]}): the end of the run "
            "found 2 distinct replicas") in build_report(run).text


def test_a_guard_stop_the_loop_went_on_after_is_told_so(library_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """A library user may catch the guard's stop and train on: the note said only that
    the guard stopped the run, above later steps' records."""
    run = copy_run(library_run, tmp_path / "r")
    with open(run / "events.jsonl", "a") as f:
        f.write(json.dumps({"step": 2, "event": "guard", "attempt": 2, "action": "stop", "ranks": [0]}) + "\n")
    assert ("note: the guard stopped the run at step 2 (on_persistent='stop'): a persistent fault on rank 0; "
            f"the run went on after it, to step {load_run(run).last_step}\n") in build_report(run).text


def test_tensors_a_later_sync_found_are_not_tied_to_a_split_the_guard_undid(clean_run: pathlib.Path,
                                                                              tmp_path: pathlib.Path) -> None:
    """The guard recomputed step 3 (the state stayed whole); the sync at step 7 found
    another incident's tensors, listed as the first split's, BatchNorm buffers first."""
    run = copy_run(clean_run, tmp_path / "r")
    (run / "summary.json").unlink()
    split = [[0], [1]]
    with open(run / "events.jsonl", "a") as f:
        for event in (
            {"step": 3, "event": "guard", "attempt": 0, "action": "recompute", "detector": "grad_mismatch",
             "ranks": [], "values": {}},
            {"step": 7, "event": "sync", "mode": "median", "groups": split, "differing_tensors": 2,
             "differing": {"buffer/1.running_mean": split, "param/wte.weight": split}},
        ):
            f.write(json.dumps(event) + "\n")
    text = build_report(run).text
    assert "first replica split: step 3 (aggregated-gradient checksums differ" in text
    said = "(no strict majority: [[0], [1]])"
    assert (f"\n  tensors that differed (a later split: the guard undid the first), as the sync at step 7 found "
            f"them: param/wte.weight {said}, buffer/1.running_mean {said}\n") in text


def test_the_summary_says_what_the_syncs_repaired_and_what_the_guard_caught(clean_run: pathlib.Path,
                                                                             tmp_path: pathlib.Path) -> None:
    """Only counts were printed ("syncs: 10   detections: 5"): which syncs found the
    replicas apart, and the guard's detectors, flagged ranks and causes, took reading
    events.jsonl (a user trial)."""
    run = copy_run(clean_run, tmp_path / "r")
    assert "syncs that found" not in build_report(run).text and "guard detections" not in build_report(run).text
    totals = {"transient": 0, "persistent": 0, "data": 0, "state": 0, "detections": 1}
    with open(run / "events.jsonl", "a") as f:
        for event in (
            {"step": 3, "event": "sync", "mode": "median", "groups": [[0], [1]], "divergence": 0.5},
            {"step": 4, "event": "guard", "attempt": 0, "action": "recompute", "detector": "rank_outlier",
             "ranks": [1], "totals": totals},
            {"step": 4, "event": "guard", "attempt": 1, "action": "proceed", "detector": "rank_outlier",
             "ranks": [1], "cause": "transient", "totals": {**totals, "transient": 1}},
            {"step": 6, "event": "sync", "mode": "noop", "groups": [[0, 1]], "divergence": 0.0},
            {"step": 7, "event": "repair", "mode": "mean", "groups": [[0], [1]], "divergence": "inf"},
        ):
            f.write(json.dumps(event) + "\n")
    text = build_report(run).text
    assert ("\n  syncs that found the replicas apart: 2 (steps 3, 7), merged by mean (1), median (1); largest "
            "divergence 0.5 (step 3)\n") in text
    assert "\n  guard detections: rank_outlier (1); flagged rank 1 (1); causes: transient (1)\n" in text


def test_the_guard_plot_shows_each_caught_value_against_its_limit(clean_run: pathlib.Path, tmp_path: pathlib.Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The attempts the guard rejected are in no other record (a step's records are the
    accepted attempt's): the plots showed a caught fault as a marker alone (a user trial)."""
    run = copy_run(clean_run, tmp_path / "r")
    assert "guard.png" not in [f.name for f in build_report(run).files]
    with open(run / "events.jsonl", "a") as f:
        for event in (
            {"step": 3, "event": "guard", "attempt": 0, "action": "recompute", "detector": "rank_outlier",
             "ranks": [1], "values": {"grad_norm_value": 1e30, "grad_norm_limit": 5.0}},
            {"step": 3, "event": "guard", "attempt": 1, "action": "proceed", "detector": "rank_outlier",
             "ranks": [1], "values": {"grad_norm": 1.0}},
            {"step": 7, "event": "guard", "attempt": 0, "action": "recompute", "detector": "nonfinite",
             "ranks": [0], "values": {"loss": "nan"}},
        ):
            f.write(json.dumps(event) + "\n")
    assert "guard.png" in [f.name for f in build_report(run).files]
    figures: list[Any] = []
    monkeypatch.setattr(report_module, "png", lambda fig: figures.append(fig) or b"")
    report_module._plot_guard(load_run(run))
    (ax,) = figures[0].axes
    points = {line.get_label(): list(zip(line.get_xdata(), line.get_ydata())) for line in ax.get_lines()}
    assert points["rank_outlier on rank 1"] == [(3, 1e30)] and points["the detector's limit"] == [(3, 5.0)]
    assert [x for x, _ in points["nonfinite on rank 0"]] == [7]  # NaN: on the top edge
    assert ax.get_yscale() == "log"
    rewrite_jsonl(run / "events.jsonl", lambda e: {**e, "event": "note"} if e["event"] == "guard" else e)
    build_report(run)  # a guard plot must not survive a report of a run without detections
    assert not (run / "report" / "guard.png").exists()


def test_the_dispersion_panels_share_one_legend(fault_run: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The four panels mark the same events: four legends took a third of the figure's width."""
    figures: list[Any] = []
    monkeypatch.setattr(report_module, "png", lambda fig: figures.append(fig) or b"")
    report_module._plot_dispersion(load_run(fault_run))
    (fig,) = figures
    assert [ax.get_legend() for ax in fig.axes] == [None] * 4
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["fault on rank 1 (aggregation)"]
    assert fig.axes[0].get_title() == "local-loss std over ranks\n(consistency/loss_std)"


def test_each_alert_is_marked_on_the_panel_of_its_metric(fault_run: pathlib.Path, tmp_path: pathlib.Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The monitor's alerts were in events.jsonl and the text's count only: a reader of the
    plots saw a loss CV rise past its threshold with no word that it had been alerted. The
    fault run's own alerts are a replicas_split at step 5 and a state_split after it."""
    run_dir = copy_run(fault_run, tmp_path / "alerts")
    with open(run_dir / "events.jsonl", "a") as f:
        for step, detector, value in ((3, "loss_cv", 0.7), (7, "loss_cv", "nan"), (8, "loss_cv", 0.9),
                                      (4, "grad_cos_min", -0.9), (6, "nonfinite_local", [1]),
                                      (9, "nonfinite_local", [0, 1])):
            ranks = value if isinstance(value, list) else []
            f.write(json.dumps({"step": step, "event": "alert", "detector": detector, "value": value,
                                "ranks": ranks}) + "\n")
    run = load_run(run_dir)
    split_alerts = {a["detector"]: a for a in run.events_of("alert") if a["detector"].endswith("split")}
    assert set(split_alerts) == {"replicas_split", "state_split"}
    figures: list[Any] = []
    for module in (report_module, report_divergence):  # the divergence figure is drawn in its own module
        monkeypatch.setattr(module, "png", lambda fig: figures.append(fig) or b"")
    report_module._plots(run)
    loss, dispersion, cosine, divergence = (fig.axes for fig in figures)

    def rings(ax: Any) -> dict[str, list[tuple[float, float]]]:
        """Each alert artist's label and points (one artist per kind, more for a kind with
        values on the top edge, which are unlabelled)."""
        found: dict[str, list[tuple[float, float]]] = {}
        for line in ax.get_lines():
            if line.get_marker() == "o" and line.get_markerfacecolor() == "none" and line.get_markersize() == 12:
                found.setdefault(line.get_label(), []).extend(zip(line.get_xdata(), line.get_ydata()))
        return found

    # The loss CV's panel, not the other three: the finite values where they were judged,
    # the NaN on the top edge; one legend entry, in the figure's one legend.
    assert [rings(ax) for ax in dispersion] == [
        {}, {"alert: loss_cv (3)": [(3, 0.7), (8, 0.9)], "_nolegend_": [(7, 0.88)]}, {}, {}]
    assert "alert: loss_cv (3)" in [t.get_text() for t in figures[1].legends[0].get_texts()]
    assert rings(cosine[0]) == {"alert: grad_cos_min (1)": [(4, -0.9)]} and rings(cosine[1]) == {}
    # A non-finite rank's alert names the ranks: on the top edge of the loss plot.
    assert rings(loss[0]) == {"alert: nonfinite_local, ranks 0, 1 (2)": [(6, 0.88), (9, 0.88)]}
    # The splits on the replica panel, at the count of distinct replicas each judged.
    replicas = divergence[0]
    assert rings(replicas) == {f"alert: {d} (1)": [(a["step"], a["value"])] for d, a in split_alerts.items()}
    assert {"alert: replicas_split (1)", "alert: state_split (1)"} <= {
        t.get_text() for t in replicas.get_legend().get_texts()}
    assert all(rings(ax) == {} for ax in divergence[1:])  # the state split's measurement is drawn there already


def test_each_later_split_is_labelled_with_its_minority(clean_run: pathlib.Path, tmp_path: pathlib.Path) -> None:
    """The divergence plot labelled the first split only: after a sync or the guard had
    made the replicas one, a split again showed as a rise of the line with no word of
    the ranks apart. Three ranks, so that each split has a minority to name."""
    run_dir = copy_run(clean_run, tmp_path / "splits")
    (run_dir / "summary.json").unlink()
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**config, "world_size": 3}))
    shutil.copy(run_dir / "metrics" / "rank1.jsonl", run_dir / "metrics" / "rank2.jsonl")
    splits = {2: {"replicas/state_distinct": 2, "replicas/state_minority_ranks": [2]},
              3: {"replicas/state_distinct": 2, "replicas/state_minority_ranks": [2]},  # the same split
              6: {"replicas/grad_distinct": 2, "replicas/grad_minority_ranks": [1]}}
    rewrite_jsonl(run_dir / "consistency.jsonl", lambda r: {**r, **splits.get(r["step"], {})})
    sync = {"event": "sync", "period": 4, "divergence": 0.3, "mode": "majority-copy"}
    with open(run_dir / "events.jsonl", "a") as f:
        for event in ({**sync, "step": 3, "groups": [[0, 1], [2]]},  # ends the first split
                      {**sync, "step": 7, "groups": [[0, 2], [1]]},  # ends the second
                      {"step": 10, "event": "guard", "attempt": 0, "action": "recompute",
                       "detector": "grad_mismatch", "ranks": [0], "values": {}},  # caught and undone
                      {**sync, "step": 11, "groups": [[0, 1], [2]]}):  # a split no fingerprint saw
            f.write(json.dumps(event) + "\n")
    run = load_run(run_dir)
    _, (ax,) = figure(1, 1, "splits")
    _replica_panel(ax, run)
    assert [(t.get_text(), t.xy[0]) for t in ax.texts] == [
        ("first split: step 2, rank 2", 2), ("split: step 6, rank 1", 6),
        ("split: step 10, rank 0 (caught by the guard)", 10), ("split: step 11, rank 2 (found by a sync)", 11)]
    assert "first replica split: step 2 on rank 2 (training-state fingerprints differ)\n" in summary_text(run)
    # Many splits: the first few labelled, the rest counted, not written over each other.
    run.events += [{**sync, "step": step, "groups": [[0, 1], [2]]} for step in range(12, 20)]
    _, (ax,) = figure(1, 1, "many")
    _replica_panel(ax, run)
    labels = [t.get_text() for t in ax.texts]
    assert len(labels) == report_divergence._SPLIT_LABELS + 1 and "6 later splits not labelled" in labels


def test_what_ends_a_split_and_what_does_not(clean_run: pathlib.Path) -> None:
    """A split ends where a state fingerprint finds one replica again, and where a sync
    that found the replicas apart made them one: an overlapped sync lands within the
    step after its own (seen_from two steps on), whose state fingerprints, taken before
    it landed, still show the split it ended, while that step's split aggregated
    gradients are a new split. A sync that found one replica ended nothing, and hides
    no split that a fingerprint found before it landed."""
    run = load_run(clean_run)
    run.consistency = [{"step": 2, "replicas/state_distinct": 2}, {"step": 4, "replicas/state_distinct": 1},
                       {"step": 6, "replicas/grad_distinct": 2}]
    assert [s[0] for s in replica_splits(run)] == [2, 6]
    run.consistency = [{"step": 4, "replicas/state_distinct": 2}, {"step": 5, "replicas/state_distinct": 2}]
    run.events = [{"step": 4, "event": "sync", "mode": "median", "groups": [[0], [1]], "seen_from": 6}]
    assert [s[0] for s in replica_splits(run)] == [4]
    run.consistency[1]["replicas/grad_distinct"] = 2
    assert [s[0] for s in replica_splits(run)] == [4, 5]
    run.consistency = [{"step": 5, "replicas/state_distinct": 2}]
    run.events = [{"step": 4, "event": "sync", "mode": "noop", "groups": [[0, 1]], "seen_from": 6}]
    assert [s[0] for s in replica_splits(run)] == [5]


def hand_made_run(path: pathlib.Path, losses: dict[int, list[float]], consistency: list[dict[str, Any]],
                  events: list[dict[str, Any]]) -> RunData:
    """A run's records without a run: each rank's local loss by step, as load_run reads them."""
    metrics = {rank: [{"step": step, "local_loss": loss} for step, loss in enumerate(values)]
               for rank, values in losses.items()}
    return RunData(path=path, config={"world_size": len(losses), "workload": "gpt"}, summary=None, metrics=metrics,
                   consistency=consistency, evals=[], events=events, faults=[])


def test_a_nonfinite_alert_rings_the_marks_of_the_ranks_it_names(tmp_path: pathlib.Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN gradient on rank 1 at step 6 made every replica NaN (a real run's alerts): rank
    1's alert at step 6, its loss still finite, and both ranks' at step 7 were ringed on the
    first row of marks, rank 0's: the first circled nothing in rank 1's row, the second
    not rank 1's mark."""
    nan = math.nan
    run = hand_made_run(tmp_path, {0: [4.1] * 7 + [nan] * 3, 1: [4.2] * 7 + [nan] * 3}, [], [
        {"step": 6, "event": "alert", "detector": "nonfinite_local", "ranks": [1], "value": [1]},
        {"step": 7, "event": "alert", "detector": "nonfinite_local", "ranks": [0, 1], "value": [0, 1]}])
    figures: list[Any] = []
    monkeypatch.setattr(report_module, "png", lambda fig: figures.append(fig) or b"")
    report_module._plot_loss(run)
    lines = figures[0].axes[0].get_lines()
    marks = {line.get_color(): float(line.get_ydata()[0]) for line in lines if line.get_gid() == "nonfinite"}
    assert marks == {"C0": 0.88, "C1": 0.84, "black": pytest.approx(0.80)}  # rank 0, rank 1, their mean
    rings = [list(zip(line.get_xdata(), line.get_ydata())) for line in lines if line.get_markersize() == 12]
    assert rings == [[(6, 0.84), (7, 0.88), (7, 0.84)]]


def test_split_labels_close_together_stay_readable(tmp_path: pathlib.Path) -> None:
    """Six splits the guard caught within nine steps (a Dyn run with aggregation faults at
    a high rate): their labels, at three depths in turn, were written over each other. Each
    label now takes a place no other's text holds, and those that find none are counted."""
    steps = 15
    consistency = [{"step": s, "replicas/grad_distinct": 1, "replicas/grad_minority_ranks": []} for s in range(steps)]
    caught = (3, 4, 5, 7, 8, 11)
    run = hand_made_run(tmp_path, {rank: [4.0] * steps for rank in range(3)}, consistency, [
        {"step": s, "event": "guard", "attempt": 0, "action": "recompute", "detector": "grad_mismatch",
         "ranks": [s % 3], "values": {}} for s in caught])
    fig, (ax,) = figure(1, 1, "close splits", run)
    _replica_panel(ax, run)
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    labels = [t for t in ax.texts if t.get_text().startswith(("first split", "split"))]
    boxes = [matplotlib.text.Text.get_window_extent(t, renderer) for t in labels]
    assert not [(a.get_text(), b.get_text()) for i, (a, box) in enumerate(zip(labels, boxes))
                for b, other in zip(labels[i + 1:], boxes[i + 1:]) if box.overlaps(other)]
    labelled = [int(t.get_text().split("step ")[1].split(",")[0]) for t in labels]
    assert labelled[0] == caught[0] and len(labelled) >= 3  # the first always, and some beside it
    note = [t.get_text() for t in ax.texts if t not in labels]
    left_out = len(caught) - len(labelled)
    assert note == ([f"{left_out} later split{'s' if left_out > 1 else ''} not labelled"] if left_out else [])
