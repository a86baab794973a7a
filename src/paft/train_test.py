"""Multi-process tests of one rank's training program (gloo, CPU)."""

from __future__ import annotations

import json
import math
import pathlib
import shutil
from typing import Any

import pytest
import torch

from paft.config import GuardConfig, MonitorConfig, ProtectConfig, TrainConfig
from paft.dyn import DynConfig, DynScheduler
from paft.launch import run_worker
from paft.records import from_jsonable, read_jsonl
from paft.report_text import summary_text
from paft.rundata import load_run
from paft.rundir import RunDirError, check_run_dir, prepare_run_dir, stale_checkpoints
from paft.testing import run_workers
from paft.train import Trainer, _lr_lambda, format_plan
from paft.workloads import build_workload, parameter_count

TINY_LM = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32}


def tiny_config(run_dir: pathlib.Path, **overrides: Any) -> TrainConfig:
    base: dict[str, Any] = dict(
        workload="gpt", world_size=2, steps=12, batch_size=16, eval_every=6, eval_batches=2,
        log_every=100, checkpoint_every=6, run_dir=str(run_dir), model=dict(TINY_LM),
    )
    base.update(overrides)
    return TrainConfig(**base)


def train_and_return_state(rank: int, world_size: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    cfg = TrainConfig.from_dict(cfg_dict)
    trainer = Trainer(cfg, pathlib.Path(cfg.run_dir))
    summary = trainer.train()
    return {
        "summary": summary,
        "params": [p.detach().clone() for p in trainer.model.module.parameters()],
        "protector": {k: v for k, v in trainer.protector.state_dict().items() if k != "sync"},
    }


def run(cfg: TrainConfig) -> list[dict[str, Any]]:
    if not cfg.resume:
        prepare_run_dir(cfg)
    return run_workers(train_and_return_state, cfg.world_size, cfg.to_dict())


def test_fault_free_ddp_keeps_replicas_bitwise_identical(tmp_path: pathlib.Path) -> None:
    out = run(tiny_config(tmp_path / "run", world_size=3, batch_size=12, optimizer="adam"))
    for other in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out[0]["params"], other["params"]))
    assert out[0]["summary"]["replicas_distinct"] == 1
    assert out[0]["summary"]["max_replica_rel_diff"] == 0.0
    files = {p.name for p in (tmp_path / "run").iterdir()}
    assert {"config.json", "summary.json", "metrics", "checkpoints", "consistency.jsonl"} <= files
    metrics = read_jsonl(tmp_path / "run" / "metrics" / "rank1.jsonl")
    assert [m["step"] for m in metrics] == list(range(12))
    assert {"step", "local_loss", "loss", "grad_norm", "lr", "step_time", "applied", "attempts"} <= set(metrics[0])
    assert all(m["applied"] is True and m["attempts"] == 1 for m in metrics)
    # Equal replicas split the evaluation (2 batches over 3 ranks: rank 2 evaluates none)
    # and each rank records what it would have got alone, to the bit.
    wl = build_workload("gpt", seed=0, model_args=dict(TINY_LM))
    with torch.no_grad():
        for mine, trained in zip(wl.model.parameters(), out[0]["params"]):
            mine.copy_(trained)
    last = read_jsonl(tmp_path / "run" / "evals.jsonl")[-1]
    alone = wl.evaluate(wl.model, batch_size=64, max_batches=2)["val_loss"]
    assert (last["step"], last["val_loss_per_rank"], last["replica_rel_diff"]) == (12, [alone] * 3, 0.0)


def test_summary_timings_leave_out_the_first_steps_of_every_leg(tmp_path: pathlib.Path) -> None:
    # README (run directory): steps_per_s and cpu_ms_per_step over the timed steps of
    # every leg, the first 3 of each leg untimed; with none timed, cpu_ms_per_step is null
    # and steps_per_s is over every step; wall_s over every leg. A leg of 3 steps times
    # none; resumed to 7, the second leg times only its 4th step (0-based step 6).
    def times() -> list[float]:
        return [m["step_time"] for m in read_jsonl(tmp_path / "r" / "metrics" / "rank0.jsonl")]

    short = run(tiny_config(tmp_path / "r", steps=3, eval_every=3, checkpoint_every=3))[0]["summary"]
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["cpu_ms_per_step"] is None
    assert short["wall_s"] == pytest.approx(sum(times()), rel=1e-12)
    assert short["steps_per_s"] == pytest.approx(3 / short["wall_s"], rel=1e-12)
    assert speed_without_summary(tmp_path / "r") == speed_line(short)
    # As if the first leg had gone on past its checkpoint and been killed after another
    # evaluation: the resume drops that one, and keeps the checkpoint step's own (marked
    # here the run's largest divergence; mutants that kept every evaluation read back,
    # or dropped the checkpoint step's, survived).
    evals = read_jsonl(tmp_path / "r" / "evals.jsonl")
    evals[1]["replica_rel_diff"] = 0.5
    evals.append({**evals[1], "step": 5, "replica_rel_diff": 1.0})
    (tmp_path / "r" / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in evals))
    longer = run(tiny_config(tmp_path / "r", steps=7, eval_every=3, checkpoint_every=3, resume=True))[0]["summary"]
    assert [e["step"] for e in read_jsonl(tmp_path / "r" / "evals.jsonl")] == [0, 3, 6, 7]
    assert longer["max_replica_rel_diff_run"] == 0.5 and longer["initial_val_loss"] == evals[0]["val_loss"]
    assert len(times()) == 7 and longer["wall_s"] == pytest.approx(sum(times()), rel=1e-12)
    assert longer["steps_per_s"] == pytest.approx(1 / times()[6], rel=1e-12)
    assert longer["cpu_ms_per_step"] > 0
    # The records say which steps were timed, so that a run whose summary is missing (a
    # crash) is reported at the summary's speed: here the resumed leg's 4th step alone.
    assert [m["timed"] for m in read_jsonl(tmp_path / "r" / "metrics" / "rank0.jsonl")] == [False] * 6 + [True]
    assert speed_without_summary(tmp_path / "r") == speed_line(longer)


def speed_line(summary: dict[str, Any]) -> str:
    """What ``paft report`` says from the records, with the speed ``summary`` holds."""
    return (f"speed: {summary['steps_per_s']:.2f} steps/s ({summary['wall_s']:.2f} s in training steps; "
            "rank 0's step times)")


def speed_without_summary(run_dir: pathlib.Path) -> str:
    """The speed line of ``paft report`` on a copy of ``run_dir`` without its summary.json."""
    copy = run_dir.with_name(run_dir.name + "-killed")
    shutil.rmtree(copy, ignore_errors=True)  # the copy of an earlier leg
    shutil.copytree(run_dir, copy, ignore=shutil.ignore_patterns("checkpoints"))
    (copy / "summary.json").unlink()
    return next(x for x in summary_text(load_run(copy)).splitlines() if x.startswith("speed: "))


def test_an_averager_run_records_no_event_counts_its_bytes_and_logs_tensorboard_at_steps_done(
        tmp_path: pathlib.Path) -> None:
    # README: the averager writes no events.jsonl; summary.json's sync_bytes is the
    # protector's count (here the parameters' bytes at each averaging: steps 0, 5, 10);
    # --tensorboard puts the record of 0-based step t at t + 1, training and evaluation
    # scalars alike (evaluations and training logs every 5 steps done, and at the end);
    # the last two checkpoints are kept.
    cfg = tiny_config(tmp_path / "r", steps=12, eval_every=5, log_every=5, checkpoint_every=4, tensorboard=True,
                      protect=ProtectConfig(mode="averager", sync_period=5))
    out = run(cfg)
    run_dir = tmp_path / "r"
    assert not (run_dir / "events.jsonl").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    param_bytes = sum(p.numel() * p.element_size()
                      for p in build_workload("gpt", seed=0, model_args=dict(TINY_LM)).model.parameters())
    assert summary["syncs"] == 3 and summary["sync_bytes"] == 3 * param_bytes
    assert all(o["protector"]["counters"]["sync_bytes"] == summary["sync_bytes"] for o in out)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    tb = {key: [(e.step, e.value) for e in acc.Scalars(key)] for key in acc.Tags()["scalars"]}
    evals = read_jsonl(run_dir / "evals.jsonl")
    losses = [m["loss"] for m in read_jsonl(run_dir / "metrics" / "rank0.jsonl")]
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731  (TensorBoard stores float32)
    assert tb["eval/val_loss"] == [(e["step"], f32(e["val_loss"])) for e in evals]
    assert [s for s, _ in tb["eval/val_loss"]] == [0, 5, 10, 12]
    assert tb["train/loss"] == [(t + 1, f32(losses[t])) for t in (4, 9, 11)]
    consistency = read_jsonl(run_dir / "consistency.jsonl")
    assert tb["consistency/loss_mean"] == [(r["step"] + 1, f32(r["consistency/loss_mean"])) for r in consistency]
    assert [r["step"] for r in consistency] == list(range(12))
    ckpts = run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step0000008", "step0000012"]
    assert (ckpts / "latest").read_text() == "step0000012"


RESUME_CASES = {
    "plain": {"optimizer": "momentum", "lr": 0.05},
    # faults + PAFT-Dyn + guard: the scheduler, sync reference and guard history resume too
    "dyn-guard-faults": {
        "optimizer": "adamw", "world_size": 3, "batch_size": 12,
        "inject": ["bitflip:rate=0.3,bits=exponent,ranks=1", "bitflip:site=local-grad,steps=8,bits=30,ranks=2"],
        "protect": ProtectConfig(mode="dyn", sync_period=4, h_min=2),
        "guard": GuardConfig(enabled=True, warmup=2),
    },
    # two ranks, guard only: a sign flip at rest on the first resumed step is repaired
    # to the median with the state of the last passing check (step 4), which only the
    # checkpoint holds (built afresh, the guard's repairer would start from step 0)
    "guard-two-ranks": {
        "optimizer": "adamw", "monitor": MonitorConfig(fingerprint_every=2),
        "guard": GuardConfig(enabled=True, warmup=2), "inject": ["bitflip:site=params,steps=6,bits=sign,ranks=1"],
    },
    # Muon and AdamW chained: both optimizers' state goes into the checkpoint and comes
    # back, and PAFT-Dyn repairs both
    "muon-dyn-faults": {
        "optimizer": "muon", "protect": ProtectConfig(mode="dyn", sync_period=4, h_min=2),
        "inject": ["scale:rate=0.3,fraction=1,factor=1.5,ranks=1"],
    },
    # PAFT-Sync overlapped, a sync in flight at the step-6 checkpoint: it lands first,
    # in both runs, so the checkpoint holds no half-done collective
    "sync-in-flight": {"protect": ProtectConfig(mode="sync", sync_period=5)},
    # stale faults due on the first resumed step: they replay the step before's values,
    # which only the checkpoint holds (rank 1's optimizer state from step 4 to 8, rank 0's
    # aggregated gradient at step 6 alone)
    "stale-faults": {
        "optimizer": "adamw",
        "inject": ["stale:site=optimizer-state,steps=4,burst=5,ranks=1", "stale:site=aggregation,steps=6,ranks=0"],
    },
    # a model of two gradient buckets (1.6 MB; DDP's first bucket holds 1 MB): every
    # event hits the same one bucket in both runs, also on the first resumed step
    "two-buckets": {
        "steps": 8, "checkpoint_every": 4, "eval_every": 4,
        "model": {**TINY_LM, "n_layer": 2, "n_embd": 128, "n_head": 4},
        "inject": ["scale:rate=0.7,factor=3,ranks=1", "scale:site=local-grad,rate=0.7,factor=3,ranks=0"],
    },
}


@pytest.mark.parametrize("case", sorted(RESUME_CASES))
def test_resume_continues_the_exact_trajectory(tmp_path: pathlib.Path, case: str) -> None:
    opts = RESUME_CASES[case]
    straight = run(tiny_config(tmp_path / "a", **opts))
    # Interrupt a second run at its step-6 checkpoint, then resume it.
    run(tiny_config(tmp_path / "b", **opts))
    ckpts = tmp_path / "b" / "checkpoints"
    half = opts.get("steps", 12) // 2
    (ckpts / "latest").write_text(f"step{half:07d}")
    resumed = run(tiny_config(tmp_path / "b", resume=True, **opts))
    for a, b in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
        # Scheduler, counters and guard decisions resume exactly. The guard's running
        # statistics hold gradient norms from BLAS reductions on the autograd thread,
        # whose last bits may vary with the thread count a loaded machine grants.
        pa, pb = dict(a["protector"]), dict(b["protector"])
        ga, gb = pa.pop("guard"), pb.pop("guard")
        ra, rb = pa.pop("repairer"), pb.pop("repairer")
        # The values a stale fault would replay at the next step, where a stale spec can hit the rank.
        ka, kb = pa.pop("stale_values", []), pb.pop("stale_values", [])
        assert pa == pb
        assert bool(ka) == (case == "stale-faults") and len(ka) == len(kb)
        for x, y in zip(ka, kb):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) if k == "value" else x[k] == y[k] for k in x)
        assert (ra is None) == (rb is None) == (case != "guard-two-ranks")
        if ra is not None:
            refs = ra.pop("reference"), rb.pop("reference")
            assert ra == rb and refs[0].keys() == refs[1].keys()
            assert all(torch.equal(refs[0][k], refs[1][k]) for k in refs[0])
        if ga is not None:
            wa, wb = ga.pop("windows"), gb.pop("windows")
            assert ga == gb
            for key in wa:
                assert wa[key] == pytest.approx(wb[key], rel=1e-6, abs=0), key
    losses = lambda d: [m["loss"] for m in read_jsonl(tmp_path / d / "metrics" / "rank0.jsonl")]  # noqa: E731
    assert losses("a") == losses("b") and len(losses("b")) == opts.get("steps", 12)
    assert straight[0]["summary"]["final_val_loss"] == resumed[0]["summary"]["final_val_loss"]
    # summary.json's worst replica and largest divergence are the evaluations' (the faulty
    # cases' replicas differ: mutants that took the mean loss, or the last divergence, survived).
    evals = [from_jsonable(e) for e in read_jsonl(tmp_path / "b" / "evals.jsonl")]
    assert resumed[0]["summary"]["final_val_loss_max"] == max(evals[-1]["val_loss_per_rank"])
    assert resumed[0]["summary"]["max_replica_rel_diff_run"] == max(e["replica_rel_diff"] for e in evals)
    # sync_bytes: what the recorded syncs and repairs sent, over both legs of the resumed run.
    sent = sum(e.get("bytes_sent", 0) for e in read_jsonl(tmp_path / "b" / "events.jsonl")) if (
        tmp_path / "b" / "events.jsonl").exists() else 0
    assert resumed[0]["summary"]["sync_bytes"] == straight[0]["summary"]["sync_bytes"] == sent
    synced = ("dyn-guard-faults", "guard-two-ranks", "muon-dyn-faults", "sync-in-flight")
    assert (sent > 0) == (case in synced)
    def faults(run: str) -> list[dict[str, Any]]:
        return read_jsonl(tmp_path / run / "faults.jsonl") if opts.get("inject") else []

    # The same lines in the same order (every rank appends its own; sorted at the end).
    assert faults("a") == faults("b") and bool(faults("a")) == bool(opts.get("inject"))  # they fired
    if opts.get("inject"):
        assert (tmp_path / "a" / "faults.jsonl").read_bytes() == (tmp_path / "b" / "faults.jsonl").read_bytes()
    # The run's other records too, step for step (a sync's timings aside; floats to 1e-6:
    # local gradient norms may differ in their last bits, as above).
    def records(run: str, name: str) -> list[dict[str, Any]]:
        return [{k: v for k, v in r.items() if k not in ("seconds", "wall_seconds")}
                for r in read_jsonl(tmp_path / run / name)]

    for name in ("consistency.jsonl", "evals.jsonl", "events.jsonl"):
        assert _close(records("b", name), records("a", name)), name
    if case == "two-buckets":
        assert {f["target"] for f in faults("a")} == {0, 1}
    if case == "stale-faults":  # both fire at step 6, the resumed run's first
        assert sorted((f["step"], f["site"]) for f in faults("a")) == sorted(
            [(step, "optimizer-state") for step in range(4, 9)] + [(6, "aggregation")])


def launched_worker(rank: int, world_size: int, cfg_dict: dict[str, Any]) -> dict[str, Any]:
    """One worker as ``paft train`` runs it (a guard's stop is a result, not an error)."""
    return run_worker(cfg_dict, cfg_dict["run_dir"])


# Faults on every rank at every step: harmless ones (the lowest mantissa bit of a local
# gradient), and for the guard's stop a persistent one on rank 2.
FAULT_RUNS = {
    "end": {"inject": ["bitflip:site=local-grad,steps=0-3,bits=0,ranks=0+1+2", "bitflip:site=params,steps=1+2,bits=0"]},
    "guard-stop": {"inject": ["bitflip:site=local-grad,steps=0-5,bits=0,ranks=0+1+2",
                              "bitflip:steps=5,ranks=2,bits=30,count=4,persistent=true"],
                   "guard": GuardConfig(enabled=True, warmup=3, on_persistent="stop")},
}


@pytest.mark.parametrize("case", sorted(FAULT_RUNS))
def test_identical_runs_write_identical_faults_jsonl(tmp_path: pathlib.Path, case: str) -> None:
    # Every rank appends the faults it injects: two identical runs interleaved the
    # ranks' lines differently, until rank 0 put them in order at the end (or the stop).
    cfgs = [tiny_config(tmp_path / name, world_size=3, batch_size=12, steps=8, **FAULT_RUNS[case]) for name in "ab"]
    for cfg in cfgs:
        prepare_run_dir(cfg)
        status = run_workers(launched_worker, 3, cfg.to_dict())[0]["status"]
        # Under heavy load a rank's first update once came out apart from its peers' (with
        # 2 threads per rank: docs/ARCHITECTURE.md, "Determinism"): the record names what
        # differed, if anything like it recurs.
        events = pathlib.Path(cfg.run_dir, "events.jsonl")
        assert status == ("persistent_fault" if case == "guard-stop" else "ok"), (
            events.read_text() if events.exists() else "no events.jsonl")
    data = (tmp_path / "a" / "faults.jsonl").read_bytes()
    assert data == (tmp_path / "b" / "faults.jsonl").read_bytes()
    if case == "guard-stop":  # paft train records the stop, with its reason (what paft report notes)
        stops = [e for e in read_jsonl(tmp_path / "a" / "events.jsonl") if e["event"] == "stop"]
        assert [(e["step"], e["ranks"]) for e in stops] == [(5, [2])]
        assert stops[0]["reason"].startswith("step 5: rank(s) [2] reproduced a harmful update on recomputation")
    faults = read_jsonl(tmp_path / "a" / "faults.jsonl")
    keys = [(f["step"], f["attempt"], f["rank"]) for f in faults]
    assert keys == sorted(keys) and {(s, r) for s, _, r in keys} >= {(s, r) for s in range(4) for r in range(3)}


def train_and_return_console(rank: int, world_size: int, cfg_dict: dict[str, Any]) -> list[str]:
    cfg = TrainConfig.from_dict(cfg_dict)
    trainer = Trainer(cfg, pathlib.Path(cfg.run_dir))
    lines: list[str] = []
    trainer.recorder.say = lines.append  # type: ignore[method-assign]
    trainer.train()
    return lines


def test_the_progress_line_counts_the_faults_of_every_rank(tmp_path: pathlib.Path) -> None:
    # Faults on rank 1 alone: the line (rank 0's) said rank 0's own count, 0 or 1 of the
    # summary's 5, so a run that had injected faults looked as if it had not.
    cfg = tiny_config(tmp_path / "r", steps=8, log_every=4, inject=["bitflip:steps=1-5,ranks=1,bits=0"])
    prepare_run_dir(cfg)
    progress = [line for line in run_workers(train_and_return_console, 2, cfg.to_dict())[0]
                if line.startswith("step ")]
    assert [line.split(" | ")[-1] for line in progress] == ["faults_injected 3", "faults_injected 5"]
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["faults_injected"] == 5


def _close(a: Any, b: Any) -> bool:
    """``a == b``, floats (nested in lists and dicts too) within 1e-6 relative."""
    if isinstance(a, float) and isinstance(b, float):
        return a == pytest.approx(b, rel=1e-6, abs=0, nan_ok=True)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return bool(a == b)


def test_resume_takes_the_new_learning_rate_weight_decay_and_length(tmp_path: pathlib.Path) -> None:
    # Given again with --resume, --lr, --weight-decay and --steps take effect from the
    # first resumed step (the checkpoint's optimizer and scheduler held the old ones,
    # while config.json said the new); metrics record the rate each step trained with.
    first = tiny_config(tmp_path / "r", steps=12, warmup_steps=4, lr=3e-3, optimizer="adamw")
    run(first)
    (tmp_path / "r" / "checkpoints" / "latest").write_text("step0000006")
    again = tiny_config(tmp_path / "r", steps=20, warmup_steps=4, lr=1e-2, weight_decay=0.5, optimizer="adamw",
                        resume=True)
    run(again)
    lrs = [m["lr"] for m in read_jsonl(tmp_path / "r" / "metrics" / "rank0.jsonl")]
    old, new = _lr_lambda(first), _lr_lambda(again)
    assert lrs == pytest.approx([3e-3 * old(s) for s in range(6)] + [1e-2 * new(s) for s in range(6, 20)], rel=1e-12)
    assert lrs[0] == 3e-3 / 4  # step 0 trains with the first warm-up rate
    state = torch.load(tmp_path / "r" / "checkpoints" / "step0000020" / "rank1.pt", weights_only=False)
    assert [(g["weight_decay"], g["initial_lr"]) for g in state["optimizer"]["param_groups"]] == [(0.5, 1e-2)]


def test_resume_falls_back_to_the_older_checkpoint_when_the_newest_is_damaged(tmp_path: pathlib.Path) -> None:
    opts = RESUME_CASES["plain"]
    straight = run(tiny_config(tmp_path / "a", **opts))
    run(tiny_config(tmp_path / "b", **opts))
    damaged = tmp_path / "b" / "checkpoints" / "step0000012" / "rank1.pt"
    damaged.write_bytes(damaged.read_bytes()[:100])  # a write cut short, on one rank only
    resumed = run(tiny_config(tmp_path / "b", resume=True, **opts))  # from step 6, on every rank
    for a, b in zip(straight, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert [m["step"] for m in read_jsonl(tmp_path / "b" / "metrics" / "rank0.jsonl")] == list(range(12))


def test_checkpoints_past_the_latest_are_pruned() -> None:
    # A resume fell back from a damaged step 250 to step 200 and checkpoints every 20:
    # at step 240 the damaged folder goes, and 220 and 240 stay (step 250 was kept,
    # newest by name, and each new checkpoint deleted the good one before it).
    folders = [pathlib.Path("ckpt", f"step{s:07d}") for s in (200, 220, 240, 250)]
    assert [f.name for f in stale_checkpoints(folders, "step0000240")] == ["step0000200", "step0000250"]
    assert [f.name for f in stale_checkpoints(folders[:2], "step0000220")] == []
    # Past step 9999999 the names grow an eighth digit: by name, step10000000 sorted before
    # step9999990, and the first checkpoint there deleted the good ones before it.
    folders = [pathlib.Path("ckpt", f"step{s:07d}") for s in (9_999_980, 9_999_990, 10_000_000)]
    assert [f.name for f in stale_checkpoints(folders, "step10000000")] == ["step9999980"]


def test_a_resume_tries_checkpoints_newest_first_by_step(tmp_path: pathlib.Path) -> None:
    from paft.rundir import checkpoint_candidates

    for s in (9_999_980, 9_999_990, 10_000_000):
        (tmp_path / f"step{s:07d}").mkdir()
    (tmp_path / "latest").write_text("step10000000")
    assert checkpoint_candidates(tmp_path) == ["step10000000", "step9999990", "step9999980"]


def test_resume_of_a_run_stopped_before_its_summary_writes_only_the_summary(tmp_path: pathlib.Path) -> None:
    # Stopped between the final checkpoint and summary.json: a resume at the same
    # --steps trains nothing, keeps the checkpoint, and writes the summary the run
    # would have written (it used to ask for more --steps, so the run never ended).
    opts = {**RESUME_CASES["plain"], "checkpoint_every": 5}  # the final checkpoint is the one after the loop
    straight = run(tiny_config(tmp_path / "r", **opts))[0]["summary"]
    with pytest.raises(RunDirError, match="has trained 12 steps already"):
        check_run_dir(tiny_config(tmp_path / "r", resume=True, **opts))
    (tmp_path / "r" / "summary.json").unlink()
    final = tmp_path / "r" / "checkpoints" / "step0000012" / "rank0.pt"
    saved = final.stat().st_mtime_ns, final.read_bytes()
    resume = tiny_config(tmp_path / "r", resume=True, **opts)
    check_run_dir(resume)  # what paft train checks first
    finished = run(resume)[0]["summary"]
    assert finished == straight  # the timings too: the checkpoint holds them
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["state_fingerprint"] == straight[
        "state_fingerprint"]
    assert (final.stat().st_mtime_ns, final.read_bytes()) == saved
    assert [m["step"] for m in read_jsonl(tmp_path / "r" / "metrics" / "rank0.jsonl")] == list(range(12))


def test_non_finite_evaluations_count_and_survive_a_resume(tmp_path: pathlib.Path) -> None:
    # A NaN in rank 1's aggregated gradient at step 5: its replica alone evaluates to NaN
    # at step 6; the next all-reduce has carried the NaN into every replica by step 12.
    opts: dict[str, Any] = dict(world_size=3, batch_size=12, inject=["nan:site=aggregation,steps=5,ranks=1"])
    first = run(tiny_config(tmp_path / "r", **opts))[0]["summary"]
    evals = {e["step"]: from_jsonable(e) for e in read_jsonl(tmp_path / "r" / "evals.jsonl")}
    assert [math.isnan(v) for v in evals[6]["val_loss_per_rank"]] == [False, True, False]
    assert math.isnan(evals[6]["val_loss"])  # the mean over the replicas, the NaN one too
    assert evals[6]["replica_rel_diff"] == math.inf
    # Bitwise equal replicas, all NaN (the evaluation split among them): still non-finite.
    assert evals[12]["replica_rel_diff"] == math.inf and all(map(math.isnan, evals[12]["val_loss_per_rank"]))
    # The NaN replica is the worst one (max() skipped a NaN that did not come first).
    assert math.isnan(first["final_val_loss_max"]) and first["max_replica_rel_diff_run"] == math.inf
    # At the end too (not the first evaluation's 0.0); the one fault is rank 1's, summed over ranks.
    assert first["max_replica_rel_diff"] == math.inf and first["faults_injected"] == 1
    # A resume reads the evaluations back ("nan" and "inf" in evals.jsonl) and finishes.
    resumed = run(tiny_config(tmp_path / "r", steps=18, resume=True, **opts))[0]["summary"]
    assert resumed["steps"] == 18 and math.isnan(resumed["final_val_loss_max"])
    assert resumed["max_replica_rel_diff_run"] == math.inf


@pytest.mark.parametrize(
    "workload,overrides",
    [
        ("llama", {"model": dict(TINY_LM), "lr": 1e-2}),
        ("resnet", {"model": {"depth": 8, "width": 8}, "lr": 1e-2}),
    ],
)
def test_workload_trains(tmp_path: pathlib.Path, workload: str, overrides: dict[str, Any]) -> None:
    cfg = tiny_config(tmp_path / "run", workload=workload, steps=30, eval_every=30, checkpoint_every=0, warmup_steps=2,
                      batch_size=32, **overrides)
    summary = run(cfg)[0]["summary"]
    assert summary["final_val_loss"] < summary["initial_val_loss"] * 0.9
    # --checkpoint-every 0: a checkpoint at the end only
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text() == "step0000030"
    if workload == "resnet":
        assert summary["final_val_acc"] > summary["initial_val_acc"]


@pytest.mark.parametrize("workload", ["gpt", "llama", "resnet"])
def test_guard_has_no_false_positives_on_clean_runs(tmp_path: pathlib.Path, workload: str) -> None:
    model = {"depth": 8, "width": 8} if workload == "resnet" else dict(TINY_LM)
    cfg = tiny_config(tmp_path / "run", workload=workload, steps=300, eval_every=300, checkpoint_every=0,
                      model=model, guard=GuardConfig(enabled=True))
    summary = run(cfg)[0]["summary"]
    assert summary["detections"] == 0 and summary["recomputes"] == 0 and summary["skipped_batches"] == 0
    assert summary["final_val_loss"] < summary["initial_val_loss"]


def test_a_checkpoint_damaged_inside_a_tensor_is_refused_by_every_reader(tmp_path: pathlib.Path) -> None:
    """torch.load does not check the CRC-32s it writes: a flipped byte inside a tensor
    loaded as wrong values, in the workers, after the pre-check had passed."""
    from paft.rundir import _CHECKPOINT_KEYS, _intact, load_checkpoint_file

    path = tmp_path / "rank0.pt"
    weights = torch.arange(100_000, dtype=torch.float32)
    torch.save({**dict.fromkeys(_CHECKPOINT_KEYS), "model": {"w": weights}}, path)
    assert _intact(path) is not None and torch.equal(load_checkpoint_file(path)["model"]["w"], weights)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40  # inside the tensor's bytes: the zip stays valid
    path.write_bytes(bytes(data))
    assert _intact(path) is None
    with pytest.raises(ValueError, match="does not match its CRC-32"):
        load_checkpoint_file(path)
    with pytest.raises(ValueError, match=r"rank1\.pt is missing"):  # not "truncated": it is not there
        load_checkpoint_file(tmp_path / "rank1.pt")


@pytest.mark.parametrize(("period", "first"), [(1, 5), (50, 50), (1000, 400)])
def test_the_plan_gives_paft_dyns_first_period_as_the_run_takes_it(period: int, first: int) -> None:
    # --sync-period is PAFT-Dyn's first H held to [--h-min, --h-max]: the plan said
    # "H 1 in [5, 400]" for a run whose first period was 5.
    cfg = TrainConfig(world_size=1, protect=ProtectConfig(mode="dyn", sync_period=period, h_min=5, h_max=400))
    assert f"  protect: PAFT-Dyn, H {first} in [5, 400] (robust, overlapped); " in format_plan(cfg)


def test_a_resumed_plan_gives_the_period_paft_dyn_goes_on_with() -> None:
    # A resume said "H 50 in [5, 400]", the configured first H, of a run going on with the
    # checkpoint's 12 (or its 600 clamped into a new --h-max).
    cfg = TrainConfig(world_size=1, run_dir="r", resume=True, protect=ProtectConfig(mode="dyn", sync_period=50))
    saved = DynScheduler(DynConfig(h_init=12)).state_dict()
    assert "  protect: PAFT-Dyn, H 12 (from the checkpoint) in [5, 400] (robust" in format_plan(cfg, schedule=saved)
    long = DynScheduler(DynConfig(h_init=600, h_max=1000)).state_dict()
    assert "PAFT-Dyn, H 400 (from the checkpoint) in [5, 400]" in format_plan(cfg, schedule=long)
    assert "PAFT-Dyn, H 50 in [5, 400]" in format_plan(cfg)  # a fresh run's


def test_the_plan_says_each_mode_as_configured() -> None:
    one = TrainConfig(world_size=1, steps=1, batch_size=1, lr=1e-4, seed=7, run_dir="r", resume=True,
                      monitor=MonitorConfig(enabled=False), protect=ProtectConfig(mode="averager", sync_period=1))
    assert format_plan(one, "python -m paft.train").splitlines() == [
        "python -m paft.train: gpt (809,856 parameters), 1 worker (cpu, gloo), 1 step of global batch 1, adamw lr "
        "0.0001, seed 7",
        "  monitor: off (plain DDP)",
        "  protect: PeriodicModelAverager every step; guard: off; inject: none",
        "  run dir: r (resumed)"]
    big = TrainConfig(workload="llama", model={"n_embd": 256}, device="cpu", monitor=MonitorConfig(interval=2,
                      cosine="exact", fingerprint_every=0), protect=ProtectConfig(mode="sync", sync_period=7,
                      sync_mode="mean", overlap=False), guard=GuardConfig(enabled=True),
                      inject=["nan:steps=3", "zero:steps=5"])
    n = parameter_count("llama", {"n_embd": 256})
    assert n >= 10**6
    assert format_plan(big).splitlines()[:3] == [
        f"paft train: llama ({n / 1e6:.1f} M parameters), 4 workers (cpu, gloo), 200 steps of global batch 64, "
        "adamw lr 0.003, seed 0",
        "  monitor: metrics every 2 steps (cosine exact), aggregated-gradient checksum every step, "
        "no state fingerprint",
        "  protect: PAFT-Sync every 7 steps (mean, blocking); guard: on; inject: nan:steps=3 zero:steps=5"]
    assert "  protect: none; " in format_plan(TrainConfig())
    # A broadcast copies one rank's replica: the plan names which (it said "broadcast" alone).
    copied = TrainConfig(protect=ProtectConfig(mode="dyn", sync_mode="broadcast", broadcast_src=3))
    assert "  protect: PAFT-Dyn, H 50 in [5, 400] (broadcast from rank 3, overlapped); " in format_plan(copied)


def train_at_a_set_rate_and_return_console(rank: int, world_size: int, cfg_dict: dict[str, Any]) -> list[str]:
    """The console lines of ``train_and_return_console``, at 1 step in 1000 s (the ETA)."""
    cfg = TrainConfig.from_dict(cfg_dict)
    trainer = Trainer(cfg, pathlib.Path(cfg.run_dir))
    lines: list[str] = []
    trainer.recorder.say = lines.append  # type: ignore[method-assign]
    trainer.step_rate = lambda: 1e-3  # type: ignore[method-assign]
    trainer.train()
    return lines


def test_the_progress_line_says_the_global_loss_the_time_left_and_the_last_sync(tmp_path: pathlib.Path) -> None:
    # README (progress line): the loss averaged over the ranks (not rank 0's own), the
    # steps left at the current rate, and the counters as the summary has them: the sync
    # due at the last step lands before its line (it was counted only after it).
    cfg = tiny_config(tmp_path / "r", steps=5, log_every=4, protect=ProtectConfig(mode="sync", sync_period=2))
    prepare_run_dir(cfg)
    progress = [line for line in run_workers(train_at_a_set_rate_and_return_console, 2, cfg.to_dict())[0]
                if line.startswith("step ")]
    metrics = read_jsonl(tmp_path / "r" / "metrics" / "rank0.jsonl")
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    assert summary["syncs"] == 2
    assert progress == [
        f"step     4/5 | loss {metrics[3]['loss']:.4f} | 0.00 steps/s | ETA 0:16:40 | syncs 1",
        f"step     5/5 | loss {metrics[4]['loss']:.4f} | 0.00 steps/s | ETA 0:00:00 | syncs 2",
    ]
    assert [f"{m['loss']:.4f}" for m in metrics] != [f"{m['local_loss']:.4f}" for m in metrics]


def test_the_summary_takes_the_mean_loss_the_largest_divergence_and_the_guards_counts(tmp_path: pathlib.Path) -> None:
    # README (summary.json): final_val_loss is the mean over the replicas; a split left
    # by a fault on rank 1's update (no defense) keeps them apart to the end.
    split = run(tiny_config(tmp_path / "split", steps=4, eval_every=2, checkpoint_every=0,
                            inject=["scale:site=params,steps=1,fraction=1,factor=1.5,ranks=1"]))[0]["summary"]
    last = read_jsonl(tmp_path / "split" / "evals.jsonl")[-1]
    assert len(set(last["val_loss_per_rank"])) == 2 and split["replicas_distinct"] == 2
    assert split["final_val_loss"] == sum(last["val_loss_per_rank"]) / 2
    # The same split, repaired by the sync at step 3: max_replica_rel_diff_run is the
    # largest divergence of the run (step 2's), not the last (0); then a persistent fault
    # the guard recomputes twice and skips: one detection, two recomputes, one batch skipped.
    opts: dict[str, Any] = dict(
        world_size=3, batch_size=12, steps=6, eval_every=2, checkpoint_every=0,
        protect=ProtectConfig(mode="sync", sync_period=3), guard=GuardConfig(enabled=True, warmup=3),
        inject=["scale:site=params,steps=1,fraction=1,factor=1.5,ranks=1",
                "bitflip:steps=5,ranks=2,bits=30,count=4,persistent=true"])
    out = run(tiny_config(tmp_path / "guard", **opts))
    summary = out[0]["summary"]
    evals = read_jsonl(tmp_path / "guard" / "evals.jsonl")
    assert [e["replica_rel_diff"] > 0 for e in evals] == [False, True, False, False]
    assert summary["max_replica_rel_diff_run"] == evals[1]["replica_rel_diff"]
    assert (summary["detections"], summary["recomputes"], summary["skipped_batches"]) == (1, 2, 1)
