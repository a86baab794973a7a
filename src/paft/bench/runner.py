"""The machinery of ``paft bench``: run many configs in one worker group, alternate, compare.

All runs of a benchmark share ONE set of worker processes (one elastic launch):
each run is a full :class:`~paft.train.Trainer` with its own run directory, built
from the same seed and data order, so runs differ only in what the benchmark
varies. Sharing the processes removes the start-up cost per run and, with the
alternating schedules below, most of this noisy machine's drift from the
throughput ratios.

Example::

    base, out = TrainConfig(steps=50).to_dict(), pathlib.Path("bench/demo")  # 4 workers
    runs = [Run("ref", make_config(base, out / "ref")),
            Run("dyn", make_config(base, out / "dyn", protect={"mode": "dyn"}))]
    run_all(runs, world_size=4)
    ratios = throughput_ratios([r.name for r in runs], [r.summary["steps_per_s"] for r in runs], "ref")
"""

from __future__ import annotations

import contextlib
import json
import math
import pathlib
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from paft.config import TrainConfig
from paft.records import console, json_bytes, write_together

if TYPE_CHECKING:
    from paft.train import Trainer

__all__ = [
    "Run",
    "alternate",
    "throughput_ratios",
    "trailing_mean",
    "run_all",
    "run_on_workers",
    "worker_group",
    "new_trainer",
    "make_config",
    "write_outputs",
    "markdown_table",
]


@dataclass
class Run:
    """One training run of a benchmark: a name, the config, and what it measured."""

    name: str
    config: dict[str, Any]
    group: str = ""
    """Runs of one group are compared with each other (e.g. one workload)."""
    labels: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)


# -- schedules for throughput ratios ----------------------------------------------------


def alternate(reference: str, names: Sequence[str], every: int = 2) -> list[str]:
    """``[ref, a, b, ref, c, d, ref, ...]``: the reference again after every ``every`` runs
    and at the end, so each run has a reference measured next to it."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    schedule = [reference]
    for i, name in enumerate(names):
        schedule.append(name)
        if (i + 1) % every == 0 or i == len(names) - 1:
            schedule.append(reference)
    return schedule


def throughput_ratios(schedule: Sequence[str], rates: Sequence[float], reference: str) -> dict[str, list[float]]:
    """Per name, each run's rate divided by the reference runs nearest to it in ``schedule``.

    For every run that is not the reference, the reference rates of the closest
    reference runs before and after it (one of them at the edges) are averaged.
    """
    if len(schedule) != len(rates):
        raise ValueError("schedule and rates differ in length")
    ref_at = [i for i, n in enumerate(schedule) if n == reference]
    if not ref_at:
        raise ValueError(f"the schedule never runs the reference {reference!r}")
    out: dict[str, list[float]] = {}
    for i, name in enumerate(schedule):
        if name == reference:
            continue
        before = [j for j in ref_at if j < i]
        after = [j for j in ref_at if j > i]
        near = ([before[-1]] if before else []) + ([after[0]] if after else [])
        ref_rate = statistics.fmean(rates[j] for j in near)
        out.setdefault(name, []).append(rates[i] / ref_rate)
    return out


# -- running many configs in one set of workers ------------------------------------------


@contextlib.contextmanager
def worker_group(cfg_dict: dict[str, Any]) -> Iterator[None]:
    """Inside a launched worker: threads and the process group for ``cfg_dict``'s device,
    torn down on exit, even after an error. The trainers inside must be gone by then
    (:func:`paft.launch.take_group_down`)."""
    from paft.launch import start_launched_worker, take_group_down

    start_launched_worker(TrainConfig.from_dict(cfg_dict))
    done = False
    try:
        yield
        done = True
    finally:
        take_group_down(every_rank_done=done)


def new_trainer(cfg_dict: dict[str, Any]) -> Trainer:
    """A fresh :class:`~paft.train.Trainer` for ``cfg_dict`` in its own run directory
    (rank 0 creates it, every rank waits for that)."""
    from paft.rundir import prepare_run_dir
    from paft.train import Trainer

    cfg = TrainConfig.from_dict(cfg_dict)
    if dist.get_rank() == 0:
        prepare_run_dir(cfg)
    dist.barrier()
    return Trainer(cfg, pathlib.Path(cfg.run_dir))


def _bench_worker(configs: list[dict[str, Any]], names: list[str]) -> list[dict[str, Any]]:
    """Runs every config in turn inside this worker group (rank 0 prints progress)."""
    summaries = []
    start = time.perf_counter()
    with worker_group(configs[0]):
        rank = dist.get_rank()
        for i, (cfg_dict, name) in enumerate(zip(configs, names)):
            summary = new_trainer(cfg_dict).train()
            summaries.append(summary)
            if rank == 0:
                elapsed = time.perf_counter() - start
                eta = elapsed / (i + 1) * (len(configs) - i - 1)
                console(
                    f"[{i + 1:>3}/{len(configs)}] {name:<40} val_loss {summary['final_val_loss']:.4f} "
                    f"| {summary['steps_per_s']:.2f} steps/s | replicas {summary['replicas_distinct']} "
                    f"| elapsed {elapsed:.0f}s, ETA {eta:.0f}s"
                )
    return summaries


def run_on_workers(entry: Callable[..., Any], world_size: int, *args: Any) -> dict[int, Any]:
    """``entry(*args)`` in one elastic launch of ``world_size`` local workers; rank -> return value.

    ``entry`` must be a module-level function (the workers are forked from a server, or
    spawned: see :func:`paft.workers.local_workers`); it sets up and
    tears down its process group itself (see :func:`_bench_worker`).
    """
    from paft.workers import local_workers

    return local_workers(entry, world_size, "paft-bench")(*args)


def run_all(runs: Sequence[Run], world_size: int) -> None:
    """Run ``runs`` in order in one elastic launch of ``world_size`` workers; fills summaries."""
    results = run_on_workers(_bench_worker, world_size, [r.config for r in runs], [r.name for r in runs])
    for run, summary in zip(runs, results[0]):
        run.summary = summary


def make_config(base: dict[str, Any], run_dir: pathlib.Path, **overrides: Any) -> dict[str, Any]:
    """A validated config dict: ``base`` + ``overrides`` (sections as nested dicts)."""
    data = json.loads(json.dumps(base))
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict) and key != "model":
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    data["run_dir"] = str(run_dir)
    data["quiet"] = True
    return TrainConfig.from_dict(data).to_dict()


def write_outputs(out: pathlib.Path, title: str, results: dict[str, Any], markdown: str) -> None:
    """``results.json`` and ``results.md``, both or neither (a full disk leaves no JSON
    without its table)."""
    write_together({out / "results.json": json_bytes(results),
                    out / "results.md": f"# {title}\n\n{markdown}\n".encode()})


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return "n/a" if math.isnan(v) else f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def trailing_mean(values: list[float], k: int) -> list[float]:
    """Per point, the mean of the finite values among it and the ``k - 1`` before it
    (NaN where there are none): the smoothed curves of the benchmarks' plots."""
    out = []
    for i in range(len(values)):
        window = [x for x in values[max(0, i - k + 1) : i + 1] if math.isfinite(x)]
        out.append(statistics.fmean(window) if window else math.nan)
    return out
