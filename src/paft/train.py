"""One rank's training program: DDP on gloo (CPU) or NCCL (GPU), protected by paft.

``paft train`` launches this on N local workers through torch's elastic launcher;
it also runs unchanged under torchrun::

    torchrun --standalone --nproc-per-node 2 -m paft.train --workload resnet --steps 100
    torchrun --standalone --nproc-per-node 4 -m paft.train \\
        --inject bitflip:rate=0.05,bits=exponent,ranks=1 --protect dyn

The world size is the number of processes torchrun starts.

The loop is short on purpose; each piece is a named method of :class:`Trainer`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import io
import json
import math
import os
import pathlib
import re
import shutil
import signal
import sys
import time
import zipfile
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from paft.config import TrainConfig
from paft.consistency import gather_rows
from paft.fingerprint import group_replicas, state_fingerprint
from paft.protect import PersistentFaultError, Protector, protect
from paft.records import (
    RunRecorder,
    atomic_write_bytes,
    atomic_write_json,
    is_file,
    output_dir_problem,
    path_name_problem,
    read_jsonl,
    read_utf8,
    truncate_jsonl,
)
from paft.sync import measure_divergence
from paft.workloads import ShardedSampler, Workload, build_workload, model_config, parameter_count

__all__ = [
    "Trainer",
    "run_worker",
    "main",
    "prepare_run_dir",
    "write_config",
    "check_run_dir",
    "resolve_run_dir",
    "has_checkpoint",
    "stale_checkpoints",
    "format_summary",
    "RunDirError",
    "DeviceError",
    "check_devices",
    "uses_cuda",
    "EXIT_PERSISTENT_FAULT",
]

EXIT_PERSISTENT_FAULT = 3
BYTES_PER_PARAMETER = 20
"""fp32 weights, gradients, DDP buckets and two optimizer moments (the memory check)."""
_KEEP_CHECKPOINTS = 2
_UNTIMED_STEPS = 3


class RunDirError(ValueError):
    """The run directory cannot be used as asked (exists, or nothing to resume)."""


class DeviceError(ValueError):
    """The devices asked for are not there (no GPU, or fewer GPUs than workers)."""


def default_run_dir(workload: str) -> str:
    return os.path.join("runs", f"{workload}-{datetime.datetime.now():%Y%m%d-%H%M%S}")


# What a resumed run cannot change: its state would not load, or it would be another run.
_FIXED_ON_RESUME = (
    ("workload", "--workload"), ("model", "--model"), ("world_size", "--world-size"),
    ("batch_size", "--batch-size"), ("optimizer", "--optimizer"), ("seed", "--seed"),
    ("protect.mode", "--protect"), ("protect.sync_mode", "--sync-mode"), ("guard.enabled", "--guard"),
)


def resolve_run_dir(run_dir: str) -> str:
    """``run_dir`` as the kernel walks it, where the text says otherwise: a path with
    ".." is resolved (symbolic links, then "..") up front, so the checks, the folders a
    run creates and their clean-up all mean the folder its files land in
    ("missing/../a" is ``a`` and creates no ``missing/``; "link/../r" is beside the
    link's target, not beside the link)."""
    return os.path.realpath(run_dir) if ".." in pathlib.PurePath(run_dir).parts else run_dir


def check_run_dir(cfg: TrainConfig) -> None:
    """Refuse a run directory that would be overwritten, cannot be created, or cannot be
    resumed as asked. Writes nothing."""
    path = pathlib.Path(cfg.run_dir)
    problem = path_name_problem(path, "--run-dir")
    if problem:
        raise RunDirError(problem)
    try:
        _check_run_dir(cfg, path)
    except OSError as err:  # e.g. a name too long for the file system
        raise RunDirError(f"--run-dir: cannot use {path}: {err.strerror or err}") from None


def _check_run_dir(cfg: TrainConfig, path: pathlib.Path) -> None:
    if cfg.resume:
        _check_resume(cfg, path)
        return
    if path.is_dir() and not path.is_symlink() and any(path.iterdir()) and not cfg.overwrite:
        if _is_run_config(path / "config.json") and not (path / "checkpoints" / "latest").is_file():
            raise RunDirError(f"--run-dir: {path} holds a run that stopped before its first checkpoint; "
                              "pass --overwrite to start it again")
        raise RunDirError(
            f"--run-dir: {path} already exists; pass --resume to continue it or --overwrite to replace it"
        )
    problem = output_dir_problem(path, "--run-dir", {"config.json": _is_run_config}, cfg.overwrite)
    if problem:
        raise RunDirError(problem)


# Keys every paft run's config.json has had: a user's own config.json is not a run's.
_RUN_CONFIG_KEYS = frozenset({"workload", "world_size", "steps", "seed", "inject", "monitor", "protect", "guard"})


def _is_run_config(path: pathlib.Path) -> bool:
    """Whether ``path`` is a ``config.json`` that ``paft train`` wrote (what marks a run
    directory that ``--overwrite`` may replace)."""
    try:
        data = json.loads(read_utf8(path))
    except (OSError, ValueError):  # missing, unreadable, not UTF-8, not JSON
        return False
    return isinstance(data, dict) and _RUN_CONFIG_KEYS <= data.keys()


def stale_checkpoints(folders: list[pathlib.Path], latest: str) -> list[pathlib.Path]:
    """The checkpoint folders to delete once ``latest`` is written: all but the newest
    ``_KEEP_CHECKPOINTS`` up to it, and every one past it. Those are from a timeline a
    resume fell back from (``latest`` was damaged): kept, a damaged newer folder would
    outlive the good ones, each new checkpoint deleting the one before."""
    # Zero-padded step numbers: names sort as the steps do.
    upto = sorted(f for f in folders if f.name <= latest)
    return upto[:-_KEEP_CHECKPOINTS] + sorted(f for f in folders if f.name > latest)


def has_checkpoint(run_dir: pathlib.Path) -> bool:
    """Whether ``run_dir`` holds a checkpoint to resume (``checkpoints/latest``); False
    where the file system cannot look (:func:`check_run_dir` names such errors)."""
    return is_file(run_dir / "checkpoints" / "latest")


def _check_resume(cfg: TrainConfig, path: pathlib.Path) -> None:
    if not has_checkpoint(path):
        raise RunDirError(f"--resume: no checkpoint to resume in {path} (checkpoints/latest is missing)")
    try:
        saved = TrainConfig.from_dict(json.loads((path / "config.json").read_text(encoding="utf-8"))).to_dict()
    except (OSError, ValueError, TypeError, AttributeError) as err:
        raise RunDirError(f"--resume: cannot read {path / 'config.json'}: {err}") from None
    asked = cfg.to_dict()
    # Compare what takes effect: model fields at their defaults, no sync mode without a sync.
    for d in (saved, asked):
        d["model"] = dataclasses.asdict(model_config(d["workload"], d["model"]))
        if d["protect"]["mode"] not in ("sync", "dyn"):
            d["protect"]["sync_mode"] = None
    for key, flag in _FIXED_ON_RESUME:
        was, now = saved, asked
        for part in key.split("."):
            was, now = was[part], now[part]
        if was != now:
            if isinstance(was, dict):  # name only the fields that differ
                keys = sorted(k for k in was.keys() | now.keys() if was.get(k) != now.get(k))
                was, now = ({k: d.get(k) for k in keys} for d in (was, now))
            raise RunDirError(f"--resume: cannot change {flag} ({was!r} in {path}, {now!r} asked); start a new run")
    # The logs the resume reads back and cuts at the checkpoint's step.
    logs = [path / n for n in ("consistency.jsonl", "events.jsonl", "evals.jsonl", "faults.jsonl")]
    for log in [*logs, *sorted((path / "metrics").glob("rank*.jsonl"))]:
        try:
            read_jsonl(log)
        except ValueError as err:
            raise RunDirError(f"--resume: {err}") from None
    # The workers fall back from a damaged latest checkpoint to older ones; check here,
    # before config.json is rewritten, that one of them has every rank's file intact.
    root = path / "checkpoints"
    names = checkpoint_candidates(root)
    damaged: dict[str, list[int]] = {}
    for name in names:  # newest first, as the workers try them
        damaged[name] = [r for r in range(cfg.world_size) if not _intact(root / name / f"rank{r}.pt")]
        if not damaged[name]:
            break
    else:
        raise RunDirError(f"--resume: no checkpoint in {root} has an intact file for every rank "
                          f"({names[0]}: rank(s) {damaged[names[0]]} missing or damaged)")
    done = int(name.removeprefix("step"))
    # A run stopped after its final checkpoint but before summary.json only lacks the
    # summary: resuming it at the same --steps writes it (Trainer.train trains nothing).
    if done > cfg.steps or (done == cfg.steps and _summary_steps(path) == done):
        raise RunDirError(
            f"--resume: {path} has trained {done} steps already (--steps {cfg.steps}); "
            f"pass --steps above {done} to train on"
        )


def _summary_steps(path: pathlib.Path) -> int | None:
    """The steps ``summary.json`` in run directory ``path`` reports; None where it is
    missing or unreadable (an interrupted end: the resume rewrites it)."""
    try:
        steps = json.loads((path / "summary.json").read_text(encoding="utf-8"))["steps"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return steps if isinstance(steps, int) else None


_CHECKPOINT_NAME = re.compile(r"step\d+")


def checkpoint_candidates(root: pathlib.Path) -> list[str]:
    """Checkpoint folders in the order a resume tries them: the one ``latest`` names,
    then the older ones, newest first."""
    try:
        latest = (root / "latest").read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise RunDirError(f"--resume: cannot read {root / 'latest'}: {err}") from None
    if not _CHECKPOINT_NAME.fullmatch(latest):
        raise RunDirError(f"--resume: {root / 'latest'} names {latest[:40]!r}, not a checkpoint folder (stepNNNNNNN)")
    older = (p.name for p in root.glob("step*") if _CHECKPOINT_NAME.fullmatch(p.name) and p.name < latest)
    return [latest, *sorted(older, reverse=True)]


_CHECKPOINT_KEYS = frozenset({"step", "model", "optimizer", "scheduler", "sampler", "protector", "rng_cpu"})


def load_checkpoint_file(path: pathlib.Path, mmap: bool = False) -> dict[str, Any]:
    """One rank's checkpoint; ``ValueError`` if it is not a paft checkpoint (truncated,
    another zip, another torch file) or any byte differs from the CRC-32 torch.save
    wrote beside it (torch.load does not check them: damage inside a tensor loaded as
    wrong values). With ``mmap`` the tensors are not loaded, only read once for the
    check."""
    if not zipfile.is_zipfile(path):  # torch.save's format ends in a zip directory
        raise ValueError(f"{path} is not a torch checkpoint (truncated or overwritten)")
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, EOFError) as err:
        raise ValueError(f"{path}: {err}") from None
    if bad is not None:
        raise ValueError(f"{path} is damaged ({bad} does not match its CRC-32)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
    except Exception as err:  # noqa: BLE001 - whatever torch.load finds wrong
        raise ValueError(f"{path}: {type(err).__name__}: {err}") from None
    if not isinstance(state, dict) or not _CHECKPOINT_KEYS <= state.keys():
        raise ValueError(f"{path} is a torch file but not a paft checkpoint")
    return state


def _intact(path: pathlib.Path) -> bool:
    """A checkpoint file the workers will load (see :func:`load_checkpoint_file`),
    checked without loading its tensors."""
    try:
        load_checkpoint_file(path, mmap=True)
    except (OSError, ValueError):
        return False
    return True


def prepare_run_dir(cfg: TrainConfig) -> pathlib.Path:
    """Create (or, with --overwrite, replace) the run directory and write ``config.json``:
    for benchmarks and tests, which own their folders. ``paft train`` and its torchrun
    form claim the directory under a lock instead (:func:`paft.launch.claim_run_dir`)."""
    path = pathlib.Path(cfg.run_dir)
    try:
        if cfg.overwrite and path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"--run-dir: cannot write {path}: {err.strerror or err}") from None
    write_config(cfg)
    return path


def write_config(cfg: TrainConfig) -> None:
    """Write ``config.json`` into the existing run directory; on --resume, the options
    the run continues under."""
    try:
        atomic_write_json(pathlib.Path(cfg.run_dir) / "config.json", cfg.to_dict())
    except OSError as err:
        raise RunDirError(f"--run-dir: cannot write {cfg.run_dir}: {err.strerror or err}") from None


def _build_optimizer(cfg: TrainConfig, params: Any) -> torch.optim.Optimizer:
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "momentum":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _lr_lambda(cfg: TrainConfig):  # noqa: ANN202 - a LambdaLR factor function
    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        span = max(1, cfg.steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class Trainer:
    """Everything one rank needs to train, evaluate, checkpoint and summarize."""

    def __init__(self, cfg: TrainConfig, run_dir: pathlib.Path) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.device = _device(cfg)
        torch.manual_seed(cfg.seed)
        self.workload: Workload = build_workload(
            cfg.workload, seed=cfg.seed, model_args={**cfg.model, **self._dropout_arg(cfg)}
        )
        model = self.workload.model.to(self.device)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        self.model = DistributedDataParallel(model, device_ids=device_ids)
        self.optimizer = _build_optimizer(cfg, self.model.parameters())
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, _lr_lambda(cfg))
        # The data order is --desync-shuffle's alone, so that the two perturbations of the
        # study stay apart: --desync-seed seeds only the torch RNG (dropout) per rank.
        self.sampler = ShardedSampler(
            len(self.workload.train), self.rank, self.world_size, cfg.per_rank_batch_size,
            seed=cfg.seed, desync=cfg.desync_shuffle,
        )
        # Dropout draws from this RNG; synchronized across ranks unless --desync-seed.
        torch.manual_seed(cfg.seed + 1 + (7919 * self.rank if cfg.desync_seed else 0))
        self.recorder = RunRecorder(run_dir, self.rank, tensorboard=cfg.tensorboard, quiet=cfg.quiet)
        self.protector: Protector = protect(
            self.model, self.optimizer, monitor=cfg.monitor, protect=cfg.protect, guard=cfg.guard,
            inject=cfg.inject, seed=cfg.seed, grad_clip=cfg.grad_clip, recorder=self.recorder,
        )
        self.step = 0
        self._start_step = 0
        self.train_seconds = 0.0
        self._timed = [0, 0.0, 0.0]  # (steps, seconds, CPU seconds) after the first steps of each leg
        self.evals: list[dict[str, Any]] = read_jsonl(run_dir / "evals.jsonl") if cfg.resume else []

    @staticmethod
    def _dropout_arg(cfg: TrainConfig) -> dict[str, Any]:
        return {"dropout": cfg.dropout} if cfg.workload in ("gpt", "llama") and cfg.dropout else {}

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

    def prime(self) -> None:
        """Settle DDP's bucket layout on a batch that is not consumed (see Protector.prime)."""
        inputs, targets = self.workload.train.get(torch.arange(self.cfg.per_rank_batch_size))
        inputs, targets = inputs.to(self.device), targets.to(self.device)

        def closure() -> torch.Tensor:
            loss = self.workload.loss(self.model, inputs, targets)
            loss.backward()
            return loss

        self.protector.prime(closure)

    def train_step(self) -> Any:
        inputs, targets = self.workload.train.get(self.sampler.next_batch())
        inputs, targets = inputs.to(self.device), targets.to(self.device)

        def closure() -> torch.Tensor:
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.workload.loss(self.model, inputs, targets)
            loss.backward()
            return loss

        lr = self.scheduler.get_last_lr()[0]  # what this step trains with
        start, cpu_start = time.perf_counter(), time.process_time()
        report = self.protector.step(closure)
        self.scheduler.step()
        self.step += 1
        elapsed = time.perf_counter() - start
        self.train_seconds += elapsed
        # The first steps pay one-off costs (DDP's bucket rebuild, lazy optimizer state):
        # leave them out of the throughput so short benchmark runs compare fairly.
        if self.step - self._start_step > _UNTIMED_STEPS:
            self._timed[0] += 1
            self._timed[1] += elapsed
            self._timed[2] += time.process_time() - cpu_start
        self.recorder.metrics({
            "step": report.step, "local_loss": report.local_loss, "loss": report.loss,
            "grad_norm": report.grad_norm, "lr": lr,
            "step_time": elapsed, "applied": report.applied, "attempts": report.attempts,
        })
        return report

    # -- evaluation, logging -------------------------------------------------------------

    def evaluate(self) -> dict[str, Any]:
        """Every rank evaluates its own replica on the same batches; rank 0 records all."""
        result = self.workload.evaluate(self.model, batch_size=64, max_batches=self.cfg.eval_batches)
        keys = sorted(result)
        gathered = gather_rows(torch.tensor([result[k] for k in keys], dtype=torch.float64)).cpu()
        # Replica divergence at every evaluation: its magnitude over the run, not just at the end.
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

    def log(self, report: Any) -> None:
        if self.step % self.cfg.log_every and self.step != self.cfg.steps:
            return
        rate = self.step_rate()
        eta = (self.cfg.steps - self.step) / rate if rate > 0 else math.inf
        c = self.protector.counters
        extra = "".join(
            f" | {k} {c[k]}" for k in ("faults_injected", "syncs", "recomputes") if c[k]
        )
        self.recorder.say(
            f"step {self.step:>5}/{self.cfg.steps} | loss {report.loss:.4f} | "
            f"{rate:.2f} steps/s | ETA {_hms(eta)}{extra}"
        )
        self.recorder.scalars(self.step, {"train/loss": report.loss, "train/grad_norm": report.grad_norm})

    def step_rate(self) -> float:
        """Steps per second of training steps (step time only: no evaluation, no checkpoints)."""
        if self._timed[0]:
            return self._timed[0] / self._timed[1]
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
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "train_seconds": self.train_seconds,
            "timed": list(self._timed),
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
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

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
            self._timed = [int(steps), float(seconds), float(cpu)]
        # The interrupted run may have logged steps past its last checkpoint: drop them.
        truncate_jsonl(self.run_dir / "metrics" / f"rank{self.rank}.jsonl", self.step)
        if self.rank == 0:
            for log in ("consistency.jsonl", "events.jsonl", "evals.jsonl", "faults.jsonl"):
                truncate_jsonl(self.run_dir / log, self.step + (log == "evals.jsonl"))
        self.evals = [e for e in self.evals if e["step"] <= self.step]
        dist.barrier()
        self.recorder.say(f"resumed from {name} (step {self.step})")

    # -- the end -----------------------------------------------------------------------

    def summarize(self) -> dict[str, Any]:
        # Replicas compare parameters + optimizer state (BatchNorm buffers differ between
        # ranks by DDP's design); the run's own fingerprint is rank 0's whole state.
        fp = torch.tensor([state_fingerprint(self.model, self.optimizer, buffers=False),
                           state_fingerprint(self.model, self.optimizer)], dtype=torch.int64)
        fps, whole = gather_rows(fp).T.tolist()
        groups = group_replicas(fps)
        divergence = self.evals[-1]["replica_rel_diff"]
        # Faults are injected per rank and CPU time is per process; the rest is identical everywhere.
        cpu_per_step = self._timed[2] / self._timed[0] if self._timed[0] else math.nan
        counters = torch.tensor([self.protector.counters["faults_injected"], cpu_per_step], dtype=torch.float64)
        dist.all_reduce(counters)
        first, last = self.evals[0], self.evals[-1]
        c = self.protector.counters
        summary: dict[str, Any] = {
            "workload": self.cfg.workload,
            "world_size": self.world_size,
            "steps": self.step,
            "initial_val_loss": first["val_loss"],
            "final_val_loss": last["val_loss"],
            "final_val_loss_max": max(last["val_loss_per_rank"]),
            "steps_per_s": self.step_rate(),
            # None when no step was timed (the first few are not: see _UNTIMED_STEPS).
            "cpu_ms_per_step": None if math.isnan(counters[1]) else 1e3 * float(counters[1]) / self.world_size,
            "wall_s": self.train_seconds,
            "replicas_distinct": len(groups),
            "replica_groups": groups,
            # Rank 0's bits (parameters, buffers, optimizer state): equal fingerprints, equal runs.
            "state_fingerprint": f"{whole[0] & (2**64 - 1):016x}",
            "max_replica_rel_diff": divergence,
            "max_replica_rel_diff_run": max(e["replica_rel_diff"] for e in self.evals),
            "faults_injected": int(counters[0]),
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
            atomic_write_json(self.run_dir / "summary.json", summary)
        self.recorder.close()
        return summary


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


def uses_cuda(cfg: TrainConfig) -> bool:
    """Whether ``cfg`` trains on GPUs (``--device cuda``, or ``auto`` with CUDA present)."""
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def check_devices(cfg: TrainConfig) -> None:
    """Refuse a device set-up that would fail inside the workers. Writes nothing.

    NCCL runs one rank per GPU: two ranks on one device are refused by NCCL itself
    ("duplicate GPU"), so the check is made here, before any worker starts.
    """
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise DeviceError("--device cuda: no CUDA device is visible; use --device cpu")
    count = torch.cuda.device_count()
    if uses_cuda(cfg) and cfg.world_size > count:
        raise DeviceError(
            f"--world-size {cfg.world_size}: NCCL needs one GPU per worker and {count} "
            f"{'is' if count == 1 else 'are'} visible; use --world-size {count} or --device cpu (gloo)"
        )
    # Weights, gradients, DDP's buckets and two optimizer moments: 20 bytes per fp32
    # parameter per worker, before activations. Only sizes far beyond the machine are
    # refused here; the rest is the allocator's to judge.
    need = BYTES_PER_PARAMETER * parameter_count(cfg.workload, cfg.model)
    if uses_cuda(cfg):
        have, where = torch.cuda.get_device_properties(0).total_memory, "each GPU has"
    else:
        need *= cfg.world_size
        have, where = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this machine has"
    if need > have:
        raise DeviceError(
            f"--model: the {cfg.workload} model would need about {need / 2**30:,.0f} GiB for weights, gradients "
            f"and optimizer state ({BYTES_PER_PARAMETER} bytes per parameter per worker) and {where} "
            f"{have / 2**30:,.0f} GiB; make it smaller"
        )


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


def _init_process_group(cfg: TrainConfig) -> None:
    if dist.is_initialized():
        return
    # On GPUs, NCCL moves CUDA tensors (gradients, syncs, the control vector) and gloo
    # the trainer's few host-side values (evaluation losses, summary counters).
    dist.init_process_group("cpu:gloo,cuda:nccl" if uses_cuda(cfg) else "gloo")


def _set_threads() -> None:
    # N workers share the machine's cores: one BLAS pool each, sized to its share.
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))


def run_worker(cfg_dict: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """Entry point of one worker launched by ``paft train`` (elastic launcher, env:// rendezvous)."""
    cfg = TrainConfig.from_dict(cfg_dict)
    _set_threads()
    _init_process_group(cfg)
    try:
        trainer = Trainer(cfg, pathlib.Path(run_dir))
        try:
            return {"status": "ok", "summary": trainer.train()}
        except PersistentFaultError as err:
            if dist.get_rank() == 0:
                trainer.recorder.event({"step": err.step, "event": "stop", "ranks": err.ranks, "reason": str(err)})
            trainer.recorder.close()
            return {"status": "persistent_fault", "ranks": err.ranks, "step": err.step, "message": str(err)}
    finally:
        dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m paft.train`` under torchrun: every rank parses the same options.

    The world size is torchrun's (``WORLD_SIZE``) unless ``--world-size`` or a config
    file sets it; a value that differs from the processes torchrun started is refused
    (exit 2), since the per-rank batch and the fault ranks are derived from it."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from paft.launch import interrupted, on_sigterm
    from paft.options import parse_train_config

    prog = "python -m paft.train"
    launched = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    # Every rank parses and refuses alike: the first to exit makes torchrun stop the
    # others, maybe before rank 0 has written a word.
    cfg = parse_train_config(argv, prog=prog, launched=launched)
    try:
        check_devices(cfg)
    except DeviceError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    # torchrun stops the ranks with SIGTERM (when one fails, or when it is stopped): unwind,
    # so that rank 0's claim cleans up as paft train's launcher does.
    signal.signal(signal.SIGTERM, on_sigterm)
    _set_threads()
    _init_process_group(cfg)
    rank0 = dist.get_rank() == 0
    try:
        return _main(cfg, prog, rank0)
    except (KeyboardInterrupt, SignalException) as err:
        return interrupted(err, prog=prog, say=rank0)


def _main(cfg: TrainConfig, prog: str, rank0: bool) -> int:
    """:func:`main` once the process group is up."""
    from paft.launch import claim_run_dir  # launch imports this module
    # One run-dir name for all ranks, and the same checks everywhere, so all ranks agree.
    name = [resolve_run_dir(cfg.run_dir or default_run_dir(cfg.workload))]
    dist.broadcast_object_list(name, src=0)
    cfg.run_dir = name[0]
    with contextlib.ExitStack() as claim:
        # Rank 0 claims the directory as paft train does (the lock, --overwrite's set-aside,
        # the clean-up of a run that stopped before its first checkpoint); every rank
        # learns whether it could.
        error, outcome = [""], {"code": 0}
        if rank0:
            try:
                check_run_dir(cfg)
                outcome = claim.enter_context(claim_run_dir(cfg, prog))
            except RunDirError as err:
                error = [str(err)]
        dist.broadcast_object_list(error, src=0)
        if error[0]:
            if rank0:
                print(f"{prog}: error: {error[0]}", file=sys.stderr)
            dist.destroy_process_group()
            return 2
        result = run_worker(cfg.to_dict(), cfg.run_dir)
        code = EXIT_PERSISTENT_FAULT if result["status"] == "persistent_fault" else 0
        outcome["code"] = code
    if code == EXIT_PERSISTENT_FAULT:
        if rank0:
            print(f"{prog}: {result['message']}", file=sys.stderr, flush=True)
        return code
    if not cfg.quiet and rank0:
        print(format_summary(result["summary"], cfg.run_dir))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit as a multiprocessing child does (paft train's workers), without the
    # interpreter's finalization: there, a torch.distributed background thread still
    # joinable at C++ static destruction aborted the process now and then ("terminate
    # called without an active exception", 3 of 16 torchrun runs on 2 loaded cores).
    os._exit(code)
