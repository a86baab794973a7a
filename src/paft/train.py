"""One rank's training program: DDP on gloo (CPU) or NCCL (GPU), protected by paft.

``paft train`` launches it on N local workers through torch's elastic launcher
(:mod:`paft.launch`, which also holds each worker's set-up); it also runs unchanged
under torchrun::

    torchrun --standalone --nproc-per-node 2 -m paft.train --workload resnet --steps 100
    torchrun --standalone --nproc-per-node 4 -m paft.train \\
        --inject bitflip:rate=0.05,bits=exponent,ranks=1 --protect dyn

The world size is the number of processes torchrun starts.

The loop is short on purpose; each piece is a named method of :class:`Trainer`.
"""

from __future__ import annotations

import datetime
import io
import math
import os
import pathlib
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from paft.collectives import gather_rows
from paft.config import ProtectConfig, TrainConfig
from paft.divergence import measure_divergence
from paft.dyn import DynScheduler
from paft.machine import uses_cuda
from paft.optimizers import OptimizerChain
from paft.protect import Protector, StepReport, protect
from paft.records import (
    UNTIMED_STEPS,
    RunRecorder,
    atomic_write_bytes,
    atomic_write_json,
    from_jsonable,
    max_or_nan,
    read_jsonl,
    sort_faults,
)
from paft.replicas import group_replicas
from paft.rundir import (
    checkpoint_candidates,
    load_checkpoint_file,
    stale_checkpoints,
)
from paft.state import fingerprints_over_ranks, state_fingerprint
from paft.workloads import DROPOUT_WORKLOADS, ShardedSampler, Workload, build_workload, hidden_matrices, parameter_count

__all__ = [
    "Trainer",
    "format_plan",
    "format_summary",
]


def _build_optimizer(cfg: TrainConfig, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if cfg.optimizer == "muon":
        # match_rms_adamw scales Muon's update to AdamW's size, so one --lr serves both.
        hidden = hidden_matrices(model)
        hidden_ids = {id(h) for h in hidden}
        rest = [p for p in params if id(p) not in hidden_ids]
        return OptimizerChain([
            torch.optim.Muon(hidden, lr=cfg.lr, weight_decay=cfg.weight_decay, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(rest, lr=cfg.lr, weight_decay=cfg.weight_decay),
        ])
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "momentum":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@dataclass
class _Timing:
    """The timed training steps of every leg of a run (each leg's first few are not)."""

    steps: int = 0
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    """This process's CPU time (all its threads)."""

    def add(self, seconds: float, cpu_seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds
        self.cpu_seconds += cpu_seconds


class Trainer:
    """Everything one rank needs to train, evaluate, checkpoint and summarize."""

    def __init__(self, cfg: TrainConfig, run_dir: pathlib.Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = _device(cfg)
        self.workload: Workload = build_workload(
            cfg.workload, seed=cfg.seed, model_args={**cfg.model, **self._dropout_arg(cfg)}
        )
        model = self.workload.model.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        self.model = DistributedDataParallel(model, device_ids=device_ids)
        self.optimizer = _build_optimizer(cfg, self.model.module)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(cfg))
        # The data order is --desync-shuffle's alone, so that the two perturbations of the
        # study stay apart: --desync-seed seeds only the torch RNG (dropout) per rank.
        self.sampler = ShardedSampler(
            len(self.workload.train), self.rank, self.world_size, cfg.per_rank_batch_size,
            seed=cfg.seed, desync=cfg.desync_shuffle,
        )
        # Dropout draws from this RNG; synchronized across ranks unless --desync-seed.
        torch.manual_seed(cfg.seed + 1 + (7919 * self.rank if cfg.desync_seed else 0))
        self.recorder = RunRecorder(run_dir, self.rank, tensorboard=cfg.tensorboard, quiet=cfg.quiet,
                                    append=cfg.resume)
        self.protector: Protector = protect(
            self.model, self.optimizer, monitor=cfg.monitor, protect=cfg.protect, guard=cfg.guard,
            inject=cfg.inject, seed=cfg.seed, grad_clip=cfg.grad_clip, recorder=self.recorder,
        )
        self.step = 0
        self._start_step = 0
        self.train_seconds = 0.0
        self._timed = _Timing()
        # A resume reads back the evaluations so far (non-finite values as floats again).
        self.evals: list[dict[str, Any]] = (
            [from_jsonable(e) for e in read_jsonl(run_dir / "evals.jsonl")] if cfg.resume else []
        )

    @staticmethod
    def _dropout_arg(cfg: TrainConfig) -> dict[str, Any]:
        return {"dropout": cfg.dropout} if cfg.workload in DROPOUT_WORKLOADS else {}

    # -- the loop --------------------------------------------------------------------

    def train(self) -> dict[str, Any]:
        if self.cfg.resume:
            self.load_checkpoint()
        self.prime()
        if self.step == 0:
            self.evaluate()
        finished = self.step == self.cfg.steps  # resumed at the final checkpoint: only the summary is missing
        while self.step < self.cfg.steps:
            report = self.train_step()
            if self.step == self.cfg.steps:
                self.protector.close()  # finish an in-flight sync before the final evaluation
            self.log(report)
            if self.step % self.cfg.eval_every == 0 or self.step == self.cfg.steps:
                self.evaluate()
            if self.cfg.checkpoint_every and self.step % self.cfg.checkpoint_every == 0:
                self.save_checkpoint()
        if not finished and (not self.cfg.checkpoint_every or self.cfg.steps % self.cfg.checkpoint_every):
            self.save_checkpoint()
        return self.summarize()

    def closure(self, indices: torch.Tensor) -> Callable[[], torch.Tensor]:
        """The step's closure over the training examples ``indices``: zero the gradients,
        forward, backward, return the loss (what ``Protector.step`` re-runs)."""
        inputs, targets = self.workload.train.get(indices)
        inputs, targets = inputs.to(self.device), targets.to(self.device)

        def closure() -> torch.Tensor:
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.workload.loss(self.model, inputs, targets)
            loss.backward()
            return loss

        return closure

    def _wait_for_device(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def prime(self) -> None:
        """Settle DDP's bucket layout on a batch that is not consumed (see Protector.prime)."""
        self.protector.prime(self.closure(torch.arange(self.cfg.per_rank_batch_size)))

    def train_step(self) -> StepReport:
        closure = self.closure(self.sampler.next_batch())
        lr = self.optimizer.param_groups[0]["lr"]  # what this step trains with
        # On a GPU the clock waits for the device at both ends: a step's kernels still
        # queued when it returned were paid by the next one, outside its clock.
        self._wait_for_device()
        start, cpu_start = time.perf_counter(), time.process_time()
        report = self.protector.step(closure)
        self.scheduler.step()
        self.step += 1
        self._wait_for_device()
        elapsed = time.perf_counter() - start
        self.train_seconds += elapsed
        # The first steps pay one-off costs (DDP's bucket rebuild, lazy optimizer state):
        # leave them out of the throughput so short benchmark runs compare fairly. The
        # record says which were timed: a run without its summary is timed from them.
        timed = self.step - self._start_step > UNTIMED_STEPS
        if timed:
            self._timed.add(elapsed, time.process_time() - cpu_start)
        self.recorder.metrics({
            "step": report.step, "local_loss": report.local_loss, "loss": report.loss,
            "grad_norm": report.grad_norm, "lr": lr,
            "step_time": elapsed, "timed": timed, "applied": report.applied, "attempts": report.attempts,
        })
        return report

    # -- evaluation, logging -------------------------------------------------------------

    def evaluate(self) -> dict[str, Any]:
        """Every rank's replica on the same val batches; rank 0 records all. While the
        replicas are bitwise equal (their fingerprints agree), each rank evaluates a
        share of the batches and the ranks add their per-batch sums up: the numbers each
        would have got alone, to the bit, for a world-size-th of the work."""
        equal = len(set(fingerprints_over_ranks(self.model))) == 1
        if equal:
            sums = self.workload.batch_sums(self.model, batch_size=64, max_batches=self.cfg.eval_batches,
                                            share=(self.rank, self.world_size))
            dist.all_reduce(sums)  # the host-side gloo group: a few rows
            result = self.workload.summarize(sums)
        else:
            result = self.workload.evaluate(self.model, batch_size=64, max_batches=self.cfg.eval_batches)
        keys = sorted(result)
        row = [result[k] for k in keys]
        gathered = [row] * self.world_size if equal else gather_rows(torch.tensor(row, dtype=torch.float64)).tolist()
        # Replica divergence at every evaluation: its magnitude over the run, not just at the
        # end (inf where the replicas hold NaN/Inf, bitwise equal or not: see DivergenceReport).
        record: dict[str, Any] = {"step": self.step, "replica_rel_diff": measure_divergence(self.model).max}
        for i, key in enumerate(keys):
            per_rank = [float(g[i]) for g in gathered]
            record[key] = sum(per_rank) / len(per_rank)
            record[f"{key}_per_rank"] = per_rank
        self.evals.append(record)
        self.recorder.jsonl("evals.jsonl", record)
        self.recorder.scalars(self.step, {f"eval/{k}": record[k] for k in keys})
        self.recorder.say(f"[eval] step {self.step}: " + " | ".join(f"{k} {record[k]:.4f}" for k in keys))
        return record

    def log(self, report: StepReport) -> None:
        if self.step % self.cfg.log_every and self.step != self.cfg.steps:
            return
        rate = self.step_rate()
        eta = (self.cfg.steps - self.step) / rate if rate > 0 else math.inf
        c = dict(self.protector.counters)
        if self.cfg.inject:  # each rank counts the faults it injected; the line gives the run's
            c["faults_injected"] = self._faults_over_ranks()
        extra = "".join(
            f" | {k} {c[k]}" for k in ("faults_injected", "syncs", "recomputes") if c[k]
        )
        self.recorder.say(
            f"step {self.step:>5}/{self.cfg.steps} | loss {report.loss:.4f} | "
            f"{rate:.2f} steps/s | ETA {_hms(eta)}{extra}"
        )
        self.recorder.scalars(self.step, {"train/loss": report.loss, "train/grad_norm": report.grad_norm})

    def _faults_over_ranks(self) -> int:
        """Faults injected on every rank so far (a collective: call it on every rank)."""
        total = torch.tensor([self.protector.counters["faults_injected"]], dtype=torch.int64)
        dist.all_reduce(total)
        return int(total)

    def step_rate(self) -> float:
        """Steps per second of training steps (step time only: no evaluation, no checkpoints)."""
        if self._timed.steps:
            return self._timed.steps / self._timed.seconds
        return self.step / self.train_seconds if self.train_seconds > 0 else 0.0

    # -- checkpoints -------------------------------------------------------------------

    @property
    def _ckpt_root(self) -> pathlib.Path:
        return self.run_dir / "checkpoints"

    def save_checkpoint(self) -> None:
        """Per-rank files (replicas may legitimately differ under faults), written atomically.

        An overlapped sync in flight is finished first, so the checkpoint holds no
        half-done collective; an uninterrupted run does the same at the same step,
        which keeps a resumed run on the exact same trajectory.
        """
        self.protector.close()
        folder = self._ckpt_root / f"step{self.step:07d}"
        state = {
            "step": self.step,
            "model": self.model.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "protector": self.protector.state_dict(),
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None,
            "train_seconds": self.train_seconds,
            "timed": [self._timed.steps, self._timed.seconds, self._timed.cpu_seconds],
            # What a resume must not change is checked against this, not config.json alone,
            # which a user may edit (and a resume rewrites).
            "config": self.cfg.to_dict(),
        }
        buf = io.BytesIO()
        torch.save(state, buf)
        atomic_write_bytes(folder / f"rank{self.rank}.pt", buf.getvalue())
        dist.barrier()
        if self.rank == 0:
            atomic_write_bytes(self._ckpt_root / "latest", folder.name.encode())
            for old in stale_checkpoints(list(self._ckpt_root.glob("step*")), folder.name):
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()

    def _read_checkpoint(self) -> tuple[str, dict[str, Any]]:
        """The newest checkpoint every rank can read (a collective decision): when a
        rank's file of ``latest`` is damaged, all ranks fall back to the one before."""
        names = checkpoint_candidates(self._ckpt_root)
        latest = names[0]
        for name in names:
            try:
                # To the host: load_state_dict copies into the live tensors on their
                # device, the RNG states must be CPU tensors, and a GPU run's
                # checkpoint resumes on a machine without one.
                state = load_checkpoint_file(self._ckpt_root / name / f"rank{self.rank}.pt")
            except (OSError, ValueError) as err:  # unreadable: try the older one
                state, problem = None, str(err)
            failed = torch.tensor([state is None], dtype=torch.int64)
            dist.all_reduce(failed)
            if not int(failed):
                if name != latest:
                    self.recorder.say(f"checkpoint {latest} is damaged on some rank; resuming from {name}")
                return name, state  # type: ignore[return-value]
            if state is None:
                print(f"rank {self.rank}: cannot read checkpoint {name}: {problem}", file=sys.stderr)
        raise RuntimeError(f"--resume: no checkpoint in {self._ckpt_root} is readable on every rank")

    def _apply_schedule_options(self) -> None:
        """The options this leg of the run goes on with take effect from its first step:
        the checkpoint's optimizer and scheduler carry the old ``--lr``, ``--weight-decay``
        and the learning rate the old schedule computed (a longer ``--steps`` stretches
        the cosine). Unchanged options give the very same values, bit for bit."""
        factor = _lr_lambda(self.cfg)(self.scheduler.last_epoch)
        self.scheduler.base_lrs = [self.cfg.lr] * len(self.optimizer.param_groups)
        for group in self.optimizer.param_groups:
            group.update(initial_lr=self.cfg.lr, weight_decay=self.cfg.weight_decay, lr=self.cfg.lr * factor)

    def load_checkpoint(self) -> None:
        name, state = self._read_checkpoint()
        self.model.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self._apply_schedule_options()
        self.sampler.load_state_dict(state["sampler"])
        self.protector.load_state_dict(state["protector"])
        torch.set_rng_state(state["rng_cpu"])
        if state["rng_cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng_cuda"])
        self.step = state["step"]
        self._start_step = self.step
        self.train_seconds = float(state.get("train_seconds", 0.0))  # over every leg of the run
        if "timed" in state:  # the timed steps of every leg (older checkpoints: this leg's only)
            steps, seconds, cpu = state["timed"]
            self._timed = _Timing(int(steps), float(seconds), float(cpu))
        # The interrupted run may have logged steps past its last checkpoint: the
        # protector's prime() drops them from the records (it resumed at self.step).
        self.evals = [e for e in self.evals if e["step"] <= self.step]
        self.recorder.say(f"resumed from {name} (step {self.step})")

    # -- the end -----------------------------------------------------------------------

    def summarize(self) -> dict[str, Any]:
        # Replicas compare parameters + optimizer state (BatchNorm buffers differ between
        # ranks by DDP's design); the run's own fingerprint is rank 0's whole state.
        mine = [state_fingerprint(self.model, self.optimizer, buffers=False),
                state_fingerprint(self.model, self.optimizer)]
        fps, whole = gather_rows(torch.tensor(mine, dtype=torch.int64)).T.tolist()  # one collective for both
        groups = group_replicas(fps)
        divergence = self.evals[-1]["replica_rel_diff"]
        # Faults are injected per rank and CPU time is per process; the rest is identical everywhere.
        cpu_per_step = self._timed.cpu_seconds / self._timed.steps if self._timed.steps else math.nan
        summed_over_ranks = torch.tensor([self.protector.counters["faults_injected"], cpu_per_step],
                                         dtype=torch.float64)
        dist.all_reduce(summed_over_ranks)
        first, last = self.evals[0], self.evals[-1]
        c = self.protector.counters
        summary: dict[str, Any] = {
            "workload": self.cfg.workload,
            "world_size": self.world_size,
            "steps": self.step,
            "initial_val_loss": first["val_loss"],
            "final_val_loss": last["val_loss"],
            "final_val_loss_max": max_or_nan(last["val_loss_per_rank"]),
            "steps_per_s": self.step_rate(),
            # None when no step was timed (the first few are not: see UNTIMED_STEPS).
            "cpu_ms_per_step": (None if math.isnan(summed_over_ranks[1])
                                else 1e3 * float(summed_over_ranks[1]) / self.world_size),
            "wall_s": self.train_seconds,
            "replicas_distinct": len(groups),
            "replica_groups": groups,
            # Rank 0's bits (parameters, buffers, optimizer state): equal fingerprints, equal runs.
            "state_fingerprint": f"{whole[0] & (2**64 - 1):016x}",
            "max_replica_rel_diff": divergence,
            "max_replica_rel_diff_run": max_or_nan(e["replica_rel_diff"] for e in self.evals),
            "faults_injected": int(summed_over_ranks[0]),
            "syncs": c["syncs"],
            "sync_bytes": c["sync_bytes"],
            "detections": c["detections"],
            "recomputes": c["recomputes"],
            "skipped_batches": c["skipped_batches"],
            "alerts": c["alerts"],
            "protect": self.cfg.protect.mode,
            "guard": self.cfg.guard.enabled,
        }
        if "val_acc" in last:
            summary["initial_val_acc"] = first["val_acc"]
            summary["final_val_acc"] = last["val_acc"]
        if self.rank == 0:
            sort_faults(self.run_dir)  # past the collectives above: every rank has written its last fault
            atomic_write_json(self.run_dir / "summary.json", summary)
        self.recorder.close()
        return summary


def format_plan(cfg: TrainConfig, prog: str = "paft train", schedule: dict[str, Any] | None = None) -> str:
    """What the run is about to do, printed before its workers start (they take seconds
    to come up): the run, its monitor, its defenses and faults, where it writes.
    ``schedule``: a resume's saved sync scheduler state (:func:`paft.rundir.check_run_dir`'s),
    from which PAFT-Dyn goes on with its period, not the configured first."""
    n = parameter_count(cfg.workload, cfg.model)
    size = f"{n:,}" if n < 10**6 else f"{n / 1e6:.1f} M"
    device = "cuda, nccl" if uses_cuda(cfg) else "cpu, gloo"
    m, p = cfg.monitor, cfg.protect
    if not m.enabled:
        monitor = "off (plain DDP)"
    else:
        metrics = f"metrics {_every(m.interval)} (cosine {m.cosine})" if m.interval else "no metrics"
        state = f"state fingerprint {_every(m.fingerprint_every)}" if m.fingerprint_every else "no state fingerprint"
        monitor = f"{metrics}, aggregated-gradient checksum every step, {state}"
    mode = f"broadcast from rank {p.broadcast_src}" if p.sync_mode == "broadcast" else p.sync_mode
    how = f"{mode}{', overlapped' if p.overlap else ', blocking'}"
    protection = {
        "none": "none",
        "sync": f"PAFT-Sync {_every(p.sync_period)} ({how})",
        "dyn": f"PAFT-Dyn, H {_dyn_period(p, schedule)} in [{p.h_min}, {p.h_max}] ({how})",
        "averager": f"PeriodicModelAverager {_every(p.sync_period)}",
    }[p.mode]
    guard = "off" if not cfg.guard.enabled else "on" + (
        ", stops on a persistent fault" if cfg.guard.on_persistent == "stop" else "")
    optimizer = "muon + adamw" if cfg.optimizer == "muon" else cfg.optimizer
    return "\n".join([
        f"{prog}: {cfg.workload} ({size} parameters), {_many(cfg.world_size, 'worker')} ({device}), "
        f"{_many(cfg.steps, 'step')} of global batch {cfg.batch_size}, {optimizer} lr {cfg.lr:g}, seed {cfg.seed}",
        f"  monitor: {monitor}",
        f"  protect: {protection}; guard: {guard}; inject: {' '.join(cfg.inject) if cfg.inject else 'none'}",
        f"  run dir: {cfg.run_dir}{' (resumed)' if cfg.resume else ''}",
    ])


def _dyn_period(p: ProtectConfig, schedule: dict[str, Any] | None) -> str:
    """PAFT-Dyn's period as the run takes it: the configured first, or the one a resume
    goes on with (the saved period clamped into the bounds, as the protector loads it)."""
    if schedule is None:
        return str(p.first_h)
    resumed = DynScheduler(p.dyn_config())
    try:
        resumed.load_state_dict(schedule)
    except (ValueError, KeyError, TypeError):  # not PAFT-Dyn's: the workers refuse it, and say why
        return str(p.first_h)
    return f"{resumed.period} (from the checkpoint)"


def _every(n: int) -> str:
    return "every step" if n == 1 else f"every {n} steps"


def _many(n: int, thing: str) -> str:
    return f"{n} {thing}{'' if n == 1 else 's'}"


def format_summary(summary: dict[str, Any], run_dir: str) -> str:
    """The final table printed on the console."""
    rows: list[tuple[str, str]] = []
    for key in (
        "workload", "world_size", "steps", "initial_val_loss", "final_val_loss", "initial_val_acc",
        "final_val_acc", "steps_per_s", "wall_s", "replicas_distinct", "max_replica_rel_diff",
        "faults_injected", "syncs", "detections", "recomputes", "skipped_batches",
    ):
        if key in summary:
            value = summary[key]
            rows.append((key, f"{value:.4g}" if isinstance(value, float) else str(value)))
    width = max(len(k) for k, _ in rows)
    lines = [f"summary ({run_dir}/summary.json)", "-" * (width + 14)]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    return "\n".join(lines)


def _device(cfg: TrainConfig) -> torch.device:
    if uses_cuda(cfg):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def _hms(seconds: float) -> str:
    if not 0 <= seconds < 1e9:  # NaN, inf, or beyond timedelta's range (and any use)
        return "?"
    return str(datetime.timedelta(seconds=int(seconds)))


if __name__ == "__main__":  # the torchrun form: the program lives beside paft train's launcher
    from paft.launch import torchrun_main

    code = torchrun_main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit as a multiprocessing child does (paft train's workers), without the
    # interpreter's finalization: there, a torch.distributed background thread still
    # joinable at C++ static destruction aborted the process now and then ("terminate
    # called without an active exception", 3 of 16 torchrun runs on 2 loaded cores).
    os._exit(code)
