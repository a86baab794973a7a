"""`paft train`, `paft report` and `paft train --resume` where their options meet.

Real runs through :func:`paft.cli.main` (2 gloo workers on tiny models, a few steps):

- every workload under every ``--protect`` mode, with and without ``--guard``, with one
  injected fault: ``summary.json`` agrees with the console's summary, with
  ``faults.jsonl`` and ``events.jsonl`` (syncs, their bytes, the guard's counts,
  alerts), and ``paft report`` says the same;
- ``--monitor-interval 5`` with each ``--cosine`` and ``--fingerprint-every``, and
  ``--no-monitor`` with PAFT-Sync: the report draws and says what was recorded, and
  says what was not (README, the ``paft report`` paragraph);
- ``--desync-seed`` / ``--desync-shuffle`` with dropout: each changes what README says
  it changes, and nothing else;
- a run stopped by its ``--steps`` and resumed to more steps under PAFT-Dyn and the
  guard, faults after the resume point: the same run as an uninterrupted one (gpt, and
  resnet's BatchNorm buffers);
- ``--tensorboard`` across a failed leg and its resume: every scalar once, the
  uninterrupted run's values;
- a real SIGTERM, then Ctrl-C to a resume of the run: each recorded and noted;
- PAFT-Dyn on 3 ranks: exact for a fault its checks see before a forward pass, not for
  a parameter corrupted at rest, which the guard makes exact;
- ``--on-persistent stop`` on 3 ranks: a reduction that fails again after a state repair
  came between stops the run (exit 3), naming the rank.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

import paft
from paft.cli import main
from paft.records import read_jsonl
from paft.report_text import summary_text
from paft.resync import averages_at
from paft.rundata import load_run

TINY = {
    "gpt": ["--model", "n_layer=1", "--model", "n_embd=16", "--model", "n_head=2", "--model", "block_size=16"],
    "llama": ["--model", "n_layer=1", "--model", "n_embd=16", "--model", "n_head=2", "--model", "block_size=16"],
    "resnet": ["--model", "depth=8", "--model", "width=4"],
}


def _run(workload: str, *argv: str) -> list[str]:
    return ["train", "--workload", workload, *TINY[workload], "--world-size", "2", "--batch-size", "4",
            "--eval-batches", "1", "--quiet", *argv]


def _train(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[dict[str, Any], str]:
    """Run ``paft train``; its summary.json and console output."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 0, err
    run_dir = pathlib.Path(argv[argv.index("--run-dir") + 1])
    return json.loads((run_dir / "summary.json").read_text()), out


def _jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    return read_jsonl(path) if path.exists() else []


def _check_records(run_dir: pathlib.Path, summary: dict[str, Any], console: str) -> str:
    """Assert that the console table, faults.jsonl, events.jsonl and the report's text say
    what summary.json says; the report's text."""
    table = dict(line.split() for line in console.splitlines()[2:] if len(line.split()) == 2)
    assert table, console
    for key, shown in table.items():
        value = summary[key]
        assert shown == (f"{value:.4g}" if isinstance(value, float) else str(value)), key
    faults = _jsonl(run_dir / "faults.jsonl")
    events = _jsonl(run_dir / "events.jsonl")
    assert len(faults) == summary["faults_injected"]
    syncs = [e for e in events if e["event"] in ("sync", "repair")]
    averaged = 0
    if summary["protect"] == "averager":  # PyTorch's averager records no event
        period = json.loads((run_dir / "config.json").read_text())["protect"]["sync_period"]
        averaged = sum(averages_at(step, period) for step in range(summary["steps"]))
    assert len(syncs) + averaged == summary["syncs"]
    if summary["protect"] != "averager":
        assert sum(e["bytes_sent"] for e in syncs) == summary["sync_bytes"]
    guard = [e for e in events if e["event"] == "guard"]
    totals = guard[-1]["totals"] if guard else {}
    for key in ("detections", "recomputes", "skipped_batches"):
        assert totals.get(key, 0) == summary[key], key
    assert sum(e["event"] == "alert" for e in events) == summary["alerts"]
    text = summary_text(load_run(run_dir))
    assert f"faults injected: {summary['faults_injected']}\n" in text
    assert (f"syncs: {summary['syncs']}   detections: {summary['detections']}   recomputes: "
            f"{summary['recomputes']}   skipped batches: {summary['skipped_batches']}\n") in text
    assert f"replicas distinct at the end: {summary['replicas_distinct']} " in text
    assert f"\nalerts: {summary['alerts']}" in text
    return text


def _plots(run_dir: pathlib.Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "report").glob("*.png"))


# Each workload meets every --protect mode, and --guard on and off; across the workloads
# every (mode, guard) pair runs. One fault each, at a step where the run's defense sees it.
_FAULTS = {
    "aggregation": "bitflip:steps=3,bits=30,ranks=1",
    "params": "bitflip:site=params,steps=4,bits=30,ranks=1",
    "optimizer-state": "bitflip:site=optimizer-state,steps=4,bits=30,ranks=0",
    "local-grad": "bitflip:site=local-grad,steps=3,bits=30,ranks=0",
}
_SWEEP = [
    ("gpt", "none", True, "params"), ("gpt", "sync", False, "aggregation"),
    ("gpt", "dyn", True, "optimizer-state"), ("gpt", "averager", False, "local-grad"),
    ("llama", "none", False, "aggregation"), ("llama", "sync", True, "optimizer-state"),
    ("llama", "dyn", False, "aggregation"), ("llama", "averager", True, "params"),
    ("resnet", "none", True, "optimizer-state"), ("resnet", "sync", False, "params"),
    ("resnet", "dyn", True, "aggregation"), ("resnet", "averager", False, "local-grad"),
]


@pytest.mark.parametrize("workload,protect,guard,site", _SWEEP)
def test_each_workload_under_each_defense_records_what_its_summary_says(
    workload: str, protect: str, guard: bool, site: str, tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    spec = _FAULTS[site]
    argv = _run(workload, "--steps", "8", "--eval-every", "4", "--fingerprint-every", "2", "--protect", protect,
                "--sync-period", "3", "--inject", spec, "--run-dir", "r", *(["--guard"] if guard else []))
    summary, console = _train(argv, capsys)
    assert (summary["workload"], summary["protect"], summary["guard"]) == (workload, protect, guard)
    text = _check_records(pathlib.Path("r"), summary, console)
    # The fault is recorded where its spec put it.
    [fault] = read_jsonl(tmp_path / "r" / "faults.jsonl")
    step = int(spec.split("steps=")[1].split(",")[0])
    rank = int(spec.split("ranks=")[1])
    recorded = (fault["step"], fault["rank"], fault["site"], fault["kind"], fault["bit"])
    assert recorded == (step, rank, site, "bitflip", 30)
    assert f"first: step {step}, rank {rank}, {site}/bitflip" in text
    if guard:  # a flip to ~1e36 is caught before its update and recomputed (a state split repaired first)
        assert summary["detections"] == 1 and summary["recomputes"] >= 1
    if guard or protect == "dyn" or site == "local-grad":  # a local-gradient fault reaches every rank alike
        assert summary["replicas_distinct"] == 1
    if not guard and protect == "none" and site == "aggregation":  # README: the silent split
        assert summary["replicas_distinct"] == 2 and summary["alerts"] >= 1
    if protect == "dyn":  # `paft report` itself (its plots take a second), once per workload
        assert main(["report", "r"]) == 0
        assert capsys.readouterr().out.startswith(text)
        assert text in (tmp_path / "r" / "report" / "report.md").read_text()
        guarded = ["guard.png"] if guard else []  # what the guard caught
        assert _plots(tmp_path / "r") == ["cosine.png", "dispersion.png", "divergence.png", *guarded, "loss.png"]


def test_the_report_says_what_the_monitor_recorded_and_what_it_did_not(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    fault = ["--inject", "bitflip:site=params,steps=4,bits=30,ranks=1", "--protect", "sync", "--sync-period", "6"]
    common = ["--steps", "12", "--eval-every", "6", *fault]
    # Metrics every 5 steps with exact cosines; no state fingerprint while training.
    summary, _ = _train(_run("gpt", *common, "--monitor-interval", "5", "--cosine", "exact",
                             "--fingerprint-every", "0", "--run-dir", "exact"), capsys)
    records = read_jsonl(tmp_path / "exact" / "consistency.jsonl")
    assert [r["step"] for r in records if "consistency/loss_cv" in r] == [0, 5, 10]
    assert all("replicas/state_distinct" not in r for r in records)
    assert main(["report", "exact"]) == 0
    out = capsys.readouterr().out
    assert _plots(tmp_path / "exact") == ["cosine.png", "dispersion.png", "divergence.png", "loss.png"]
    assert ("training state: not fingerprinted while training (--fingerprint-every 0); the syncs found it apart "
            "at step 6 (groups [[0], [1]])\n") in out
    assert "found and repaired by the sync at this step, no fingerprint saw it before" in out
    assert summary["syncs"] == 1 and summary["replicas_distinct"] == 1
    # Sketch cosines, the state fingerprinted every 3 steps: the split is seen and alerted.
    summary, _ = _train(_run("gpt", *common, "--monitor-interval", "5", "--cosine", "sketch",
                             "--fingerprint-every", "3", "--run-dir", "sketch"), capsys)
    records = read_jsonl(tmp_path / "sketch" / "consistency.jsonl")
    assert [r["step"] for r in records if "replicas/state_distinct" in r] == [0, 3, 6, 9]
    assert [r["replicas/state_distinct"] for r in records if r["step"] == 6] == [2]
    assert main(["report", "sketch"]) == 0
    out = capsys.readouterr().out
    assert _plots(tmp_path / "sketch") == ["cosine.png", "dispersion.png", "divergence.png", "loss.png"]
    assert "first replica split: step 6 (training-state fingerprints differ; no strict majority)\n" in out
    assert "alerts: 2 (loss_cv (1), state_split (1))" in out and summary["alerts"] == 2
    # No cosine: no cosine plot, and the text says why.
    _train(_run("gpt", *common, "--monitor-interval", "5", "--cosine", "off", "--fingerprint-every", "3",
                "--run-dir", "off"), capsys)
    assert all(not k.startswith("consistency/grad_cos") for r in read_jsonl(tmp_path / "off" / "consistency.jsonl")
               for k in r)
    assert main(["report", "off"]) == 0
    assert "min grad_cos_min: not recorded (cosine monitoring off)\n" in capsys.readouterr().out
    assert _plots(tmp_path / "off") == ["dispersion.png", "divergence.png", "loss.png"]
    # No monitor: no consistency.jsonl, no dispersion or cosine plot; a sync ran, so the
    # divergence plot is drawn from it.
    summary, _ = _train(_run("gpt", *common, "--no-monitor", "--run-dir", "plain"), capsys)
    assert not (tmp_path / "plain" / "consistency.jsonl").exists() and summary["syncs"] == 1
    assert main(["report", "plain"]) == 0
    out = capsys.readouterr().out
    assert _plots(tmp_path / "plain") == ["divergence.png", "loss.png"]
    assert "max loss_cv: not recorded (no consistency.jsonl: monitoring off)\n" in out
    assert "first replica split: step 6 (training-state fingerprints differ; no strict majority; found and " \
           "repaired by the sync at this step" in out


def test_desync_options_change_what_they_say_and_nothing_else(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    first: dict[str, list[float]] = {}
    fingerprints: dict[str, str] = {}
    for name, extra in [("base", []), ("seed", ["--desync-seed"]), ("shuffle", ["--desync-shuffle"]),
                        ("base0", ["--dropout", "0"]), ("seed0", ["--dropout", "0", "--desync-seed"])]:
        dropout = [] if "--dropout" in extra else ["--dropout", "0.1"]
        summary, _ = _train(_run("gpt", "--steps", "3", *dropout, *extra, "--run-dir", name), capsys)
        assert summary["replicas_distinct"] == 1  # DDP averages whatever each rank computed
        first[name] = read_jsonl(tmp_path / name / "consistency.jsonl")[0]["local_losses"]
        fingerprints[name] = summary["state_fingerprint"]
    # Rank 0 keeps the shared seed and the shared order: its first loss is the same in all.
    assert first["base"][0] == first["seed"][0] == first["shuffle"][0]
    # Rank 1 draws other dropout masks, or other batches.
    assert first["seed"][1] != first["base"][1] and first["shuffle"][1] != first["base"][1]
    assert len(set(fingerprints.values()) - {fingerprints["base0"]}) == 3
    # --desync-seed seeds the torch RNG only: without dropout the run is the synchronized one.
    assert fingerprints["seed0"] == fingerprints["base0"]
    assert main(["report", "shuffle"]) == 0 and (tmp_path / "shuffle" / "report" / "loss.png").is_file()


# Records that differ between legs by design: timings, which steps a leg times (its first
# 3 are not), and seen_from: an overlapped sync in flight at the end of the first leg lands
# at its close(), before the next step's fingerprints, where the uninterrupted run lands it
# during that step.
_LEG_KEYS = {"seconds", "wall_seconds", "step_time", "timed", "seen_from"}


def _records(run_dir: pathlib.Path, name: str) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k not in _LEG_KEYS} for r in _jsonl(run_dir / name)]


def _key(record: dict[str, Any]) -> tuple[int, str]:
    return record["step"], json.dumps(record, sort_keys=True)


@pytest.mark.parametrize("workload", ["gpt", "resnet"])
def test_a_resumed_run_is_the_uninterrupted_run(
    workload: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """5 steps, then --resume --steps 10, under PAFT-Dyn and the guard with faults on both
    sides of the resume; the default 20-step learning-rate warm-up covers both lengths, so
    the schedules match (a longer --steps stretches only the cosine after it)."""
    monkeypatch.chdir(tmp_path)
    argv = _run(workload, "--protect", "dyn", "--guard", "--sync-period", "3", "--h-min", "2",
                "--fingerprint-every", "1", "--eval-every", "5",
                "--inject", "bitflip:site=optimizer-state,steps=2,bits=30,ranks=1",
                "--inject", "bitflip:steps=5,bits=30,ranks=1",  # the first resumed step
                "--inject", "bitflip:site=params,steps=8,bits=30,ranks=0")
    whole, _ = _train([*argv, "--steps", "10", "--run-dir", "whole"], capsys)
    _train([*argv, "--steps", "5", "--run-dir", "legs"], capsys)
    resumed, console = _train([*argv, "--steps", "10", "--run-dir", "legs", "--resume"], capsys)
    timing = {"steps_per_s", "wall_s", "cpu_ms_per_step"}
    assert {k: v for k, v in resumed.items() if k not in timing} == {k: v for k, v in whole.items() if k not in timing}
    assert (whole["faults_injected"], whole["detections"], whole["replicas_distinct"]) == (3, 3, 1)
    for name in ("faults.jsonl", "consistency.jsonl", "metrics/rank0.jsonl", "metrics/rank1.jsonl"):
        assert _records(tmp_path / "legs", name) == _records(tmp_path / "whole", name), name
    # The same events; the sync in flight at step 5 is recorded before that step's guard
    # events where the first leg's close() landed it, after them where step 5 did.
    assert sorted(map(_key, _records(tmp_path / "legs", "events.jsonl"))) == sorted(
        map(_key, _records(tmp_path / "whole", "events.jsonl")))
    # The resumed run's evaluations: the first leg's last one (step 5) stays.
    assert [e["step"] for e in read_jsonl(tmp_path / "legs" / "evals.jsonl")] == [0, 5, 10]
    _check_records(tmp_path / "legs", resumed, console)


def test_tensorboard_across_a_failed_leg_and_its_resume(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """README: the scalars of 0-based step t at t + 1; a resumed run hides the interrupted
    leg's scalars for the steps it re-does. Every replica turning NaN at step 5 stops the
    first leg (a mean sync has nothing finite to average) after its checkpoint at step 3."""
    pytest.importorskip("tensorboard")
    # tensorboard ships no type hints.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # type: ignore[import-untyped]

    monkeypatch.chdir(tmp_path)
    argv = _run("gpt", "--steps", "8", "--tensorboard", "--protect", "dyn", "--sync-mode", "mean", "--no-overlap",
                "--fingerprint-every", "1", "--eval-every", "2", "--log-every", "1")
    _train([*argv, "--run-dir", "whole"], capsys)
    assert main([*argv, "--run-dir", "legs", "--checkpoint-every", "3",
                 "--inject", "nan:site=params,steps=5,ranks=0+1"]) == 1
    assert "legs keeps its checkpoints (--resume continues from the last)" in capsys.readouterr().err
    _train([*argv, "--run-dir", "legs", "--resume", "--inject", "bitflip:steps=100"], capsys)

    def scalars(run_dir: str) -> dict[str, list[tuple[int, float]]]:
        acc = EventAccumulator(str(tmp_path / run_dir / "tb"))
        acc.Reload()
        return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}

    whole, legs = scalars("whole"), scalars("legs")
    assert len(list((tmp_path / "legs" / "tb").iterdir())) == 2  # one event file per leg
    assert whole["train/loss"][0][0] == 1 and [s for s, _ in whole["eval/val_loss"]] == [0, 2, 4, 6, 8]
    assert legs == whole


def _steps_recorded(run_dir: pathlib.Path) -> list[int]:
    return [r["step"] for r in _jsonl(run_dir / "metrics" / "rank0.jsonl")]


def _train_until_signalled(run_dir: pathlib.Path, argv: list[str], past: int, sig: signal.Signals,
                           group: bool) -> tuple[int, str]:
    """Start ``paft train`` (a process of its own), send it ``sig`` once rank 0 has
    recorded a step past ``past`` (to its whole process group, as a terminal's Ctrl-C,
    with ``group``); its exit code and stderr."""
    env = {**os.environ, "PYTHONPATH": str(pathlib.Path(paft.__file__).parents[1]), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, "-m", "paft", *argv, "--run-dir", str(run_dir)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while max(_steps_recorded(run_dir), default=-1) <= past:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate(timeout=60)[1][-2000:]
            time.sleep(0.1)
        os.killpg(proc.pid, sig) if group else proc.send_signal(sig)
        return proc.wait(timeout=120), proc.communicate()[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_run_a_signal_stopped_says_so_and_a_resume_keeps_it(tmp_path: pathlib.Path) -> None:
    """Ctrl-C (130) and SIGTERM (143) left no record: the run directory of an interrupted
    run did not say why it ended early. Each leg's signal is an "interrupted" event at the
    step it stopped, which a resume keeps and paft report notes."""
    run = tmp_path / "r"
    argv = _run("gpt", "--steps", "100000", "--checkpoint-every", "2", "--eval-every", "100000")
    code, err = _train_until_signalled(run, argv, 2, signal.SIGTERM, group=False)  # a scheduler's
    assert code == 143 and "paft train: interrupted (SIGTERM)" in err, err[-2000:]
    first = max(_steps_recorded(run)) + 1
    # Resumed, then Ctrl-C in its terminal (the whole group) once it trained past the first stop.
    code, err = _train_until_signalled(run, [*argv, "--resume"], first, signal.SIGINT, group=True)
    assert code == 130 and "paft train: interrupted (Ctrl-C)" in err, err[-2000:]
    second = max(_steps_recorded(run)) + 1
    ends = [(e["step"], e["signal"]) for e in read_jsonl(run / "events.jsonl") if e["event"] == "interrupted"]
    assert ends == [(first, "SIGTERM"), (second, "SIGINT")]
    notes = [line for line in summary_text(load_run(run)).splitlines() if line.startswith("note: ")]
    assert notes[:2] == [f"note: the run was interrupted at step {first} (SIGTERM); resumed, the run went on to step "
                         f"{second - 1}", f"note: the run was interrupted at step {second} (Ctrl-C)"]


def test_paft_dyn_is_exact_for_faults_it_sees_before_a_forward_pass_and_the_guard_for_the_rest(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:
    """README, PAFT-Dyn: with a strict majority (3 ranks) a repair puts the run back on the
    fault-free trajectory where the split shows before the faulty values reach a forward
    pass. A parameter corrupted at rest has already fed its step's all-reduce: the
    replicas end identical but off that trajectory, unless the guard, which recomputes
    after its repair, caught it (a flip to ~1e36, without the guard, leaves every replica
    NaN alike)."""
    monkeypatch.chdir(tmp_path)
    runs = {
        "clean": [],
        "optimizer-state": ["--inject", "bitflip:site=optimizer-state,steps=3,bits=30,ranks=0"],
        "params": ["--inject", "bitflip:site=params,steps=3,bits=10,ranks=2"],
        # The default --fingerprint-every 10: the detection's recompute fingerprints the state.
        "guard": ["--guard", "--fingerprint-every", "10", "--inject", "bitflip:site=params,steps=3,bits=30,ranks=2"],
    }
    s = {}
    for name, extra in runs.items():
        argv = ["train", "--workload", "gpt", *TINY["gpt"], "--world-size", "3", "--batch-size", "12",
                "--eval-batches", "1", "--quiet", "--steps", "6", "--protect", "dyn", "--fingerprint-every", "1",
                *extra, "--run-dir", name]
        s[name], _ = _train(argv, capsys)
        assert s[name]["replicas_distinct"] == 1
    fault_free = s["clean"]["state_fingerprint"]
    assert s["optimizer-state"]["state_fingerprint"] == fault_free and s["optimizer-state"]["syncs"] == 1
    assert s["params"]["state_fingerprint"] != fault_free and s["params"]["syncs"] == 1
    assert s["guard"]["state_fingerprint"] == fault_free and s["guard"]["detections"] == 1


@pytest.mark.parametrize("policy", ["stop", "repair"])
def test_a_persistent_reduction_fault_seen_by_a_state_repair_is_named(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], policy: str,
) -> None:
    """docs/GUARD.md, state: the recompute of a mismatch on rank 2 finds rank 1's
    optimizer state corrupted at rest (no fingerprint was due at the first attempt), and
    rank 2's reduction failing again in the same view. With --max-reruns 1 the repair
    spent the only rerun: the batch was skipped with cause "state", rank 2 unnamed, and a
    run asked to stop went on (exit 0). Now the run stops naming rank 2 (exit 3), or,
    under --on-persistent repair, the split is repaired all the same and the batch
    skipped at the cap, rank 2 named."""
    monkeypatch.chdir(tmp_path)
    argv = ["train", "--workload", "gpt", *TINY["gpt"], "--world-size", "3", "--batch-size", "12",
            "--eval-batches", "1", "--quiet", "--steps", "4", "--guard", "--on-persistent", policy, "--max-reruns", "1",
            "--inject", "scale:site=optimizer-state,steps=2,ranks=1,factor=1e-12,fraction=1.0",
            "--inject", "bitflip:site=aggregation,steps=2,ranks=2,bits=30,persistent=true", "--run-dir", "r"]
    assert main(argv) == (3 if policy == "stop" else 0), capsys.readouterr().err
    records = _jsonl(tmp_path / "r" / "events.jsonl")
    events = [(e["event"], e.get("attempt"), e.get("detector"), e["ranks"], e.get("action"), e.get("cause"))
              for e in records if e["event"] in ("guard", "stop")]
    assert events[0] == ("guard", 0, "grad_mismatch", [2], "recompute", None)
    if policy == "stop":
        assert events[1:] == [("guard", 1, "grad_mismatch", [2], "stop", "persistent"),
                              ("stop", None, None, [2], None, None)]
        return
    assert events[1:] == [("guard", 1, "rerun_cap", [2], "skip", "persistent")]
    (repair,) = [e for e in records if e["event"] == "repair"]  # rank 1's optimizer state, at the cap too
    assert (repair["step"], repair["groups"]) == (2, [[0, 2], [1]])
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["replicas_distinct"] == 1
