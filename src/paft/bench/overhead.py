"""Overhead without faults: each defense's cost per step as a ratio to plain DDP.

Variants, on the default workload (gpt, 4 ranks), all without faults:

- ``plain``: plain DDP (no hook, no control collective) — the reference;
- ``monitor``: the per-step monitor with its defaults (sketch cosine at interval 1,
  aggregated-gradient checksum every step, state fingerprint every 10 steps);
- ``monitor-fp1``: the same with the state fingerprint every step;
- ``monitor-nocos``: the monitor with ``--cosine off`` (no gradient sketch; the
  guard and PAFT-Dyn's trigger do not need it);
- ``monitor-i10``: the worker metrics every 10 steps (``--monitor-interval 10``); the
  aggregated-gradient checksum, which sees replicas split, still every step;
- ``monitor-floor``: the comm hook, the aggregated-gradient checksum and the step's
  control collective, nothing else (metrics every 10000 steps, no state
  fingerprint): the monitor's fixed cost, below which no setting goes;
- ``guard``: monitor + guard;
- ``dyn``: monitor + PAFT-Dyn with overlapped sync;
- ``guard-nocos`` / ``dyn-nocos``: the same with ``--cosine off``, i.e. with only what
  the defense itself reads (neither uses the gradient cosine): its own cost, apart
  from the diagnostics';
- ``dyn-i10`` / ``guard-i10``: PAFT-Dyn / the guard with the worker metrics every 10
  steps: what the defense reads (the checksums; for the guard also the local losses
  and gradient norms) still every step;
- ``dyn-i0`` / ``guard-i0``: the same with no worker metrics at all
  (``--monitor-interval 0``): the defense alone, what it costs apart from the diagnostics;
- ``sync``: PAFT-Sync, blocking, at period H (no per-step monitor);
- ``averager``: PyTorch's PeriodicModelAverager at the same period H.

**Paired steps.** Every variant is a full :class:`~paft.train.Trainer` (its own
model, optimizer, data order and run directory), and all of them live in the SAME
worker processes: step ``i`` of every variant runs back to back, in an order rotated
by one each step, each after a barrier. A variant's cost is the sum of its step
times over the plain trainer's, so anything that drifts slower than a step (other
jobs on a shared machine, thermal state) hits both sides of the ratio equally.
On this shared 2-core machine, whole runs alternated one after another gave
ratios that scattered by ±12% around their median; with paired steps a variant's
five blocks of one measurement spread over 1-2 points (6.5 in one busy run), and
the sum over all steps is steadier still.

Two clocks: the wall time of a step (the slowest rank: the step ends when it does)
and its CPU time (all threads of a worker, mean over ranks). The first ``warmup``
steps are not timed: DDP's bucket rebuild, the optimizer's lazy state and the guard's
warm-up (20 accepted steps during which it snapshots the state before every update)
are one-off costs. Caveats: the variants share the machine's caches (each step starts
on another model's data, as in a run that is one of several jobs), and an overlapped
PAFT-Dyn sync still in flight at the end of its step runs on under the next variant's
step; fault-free, a Dyn sync is a fingerprint exchange plus, every few periods, a
divergence measurement, so this moves little.

Example::

    paft bench overhead --steps 200 --variants plain,monitor,dyn,guard
"""

from __future__ import annotations

import pathlib
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from paft.bench.runner import make_config, markdown_table, new_trainer, run_on_workers, worker_group, write_outputs
from paft.config import TrainConfig
from paft.machine import uses_cuda
from paft.records import console

__all__ = ["VARIANTS", "BLOCKS", "WARMUP", "measure", "block_range", "run"]

VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {"monitor": {"enabled": False}},
    "monitor": {},
    "monitor-fp1": {"monitor": {"fingerprint_every": 1}},
    "monitor-nocos": {"monitor": {"cosine": "off"}},
    "monitor-i10": {"monitor": {"interval": 10}},
    "monitor-floor": {"monitor": {"cosine": "off", "interval": 10_000, "fingerprint_every": 0}},
    "guard": {"guard": {"enabled": True}},
    "dyn": {"protect": {"mode": "dyn"}},
    "guard-nocos": {"guard": {"enabled": True}, "monitor": {"cosine": "off"}},
    "dyn-nocos": {"protect": {"mode": "dyn"}, "monitor": {"cosine": "off"}},
    "dyn-i10": {"protect": {"mode": "dyn"}, "monitor": {"interval": 10}},
    "guard-i10": {"guard": {"enabled": True}, "monitor": {"interval": 10}},
    "dyn-i0": {"protect": {"mode": "dyn"}, "monitor": {"interval": 0}},
    "guard-i0": {"guard": {"enabled": True}, "monitor": {"interval": 0}},
    "sync": {"monitor": {"enabled": False}, "protect": {"mode": "sync", "overlap": False}},
    "averager": {"monitor": {"enabled": False}, "protect": {"mode": "averager"}},
}

BLOCKS = 5
"""The timed steps are cut into this many consecutive blocks; the spread of the
per-block ratios is the measurement's own noise."""

WARMUP = 30
"""Untimed steps before the timed ones: DDP's bucket rebuild, the optimizer's lazy
state and the guard's 20-step warm-up fall inside."""


def _round_order(names: Sequence[str], round_index: int) -> list[str]:
    """The order the variants step in at round ``round_index``: ``names`` rotated left by
    ``round_index``, so over ``len(names)`` consecutive rounds each variant runs once in
    each position: none always runs first in a round, nor always last."""
    k = round_index % len(names)
    return [*names[k:], *names[:k]]


def _paired_worker(configs: dict[str, dict[str, Any]], steps: int, warmup: int) -> dict[str, Any]:
    """One worker: a trainer per variant, stepped in rotating order; per-step wall and CPU
    seconds per variant, and the model's parameter count."""
    with worker_group(next(iter(configs.values()))):
        # The trainers go with _paired_steps' frame: before the group (take_group_down).
        return _paired_steps(configs, steps, warmup)


def _paired_steps(configs: dict[str, dict[str, Any]], steps: int, warmup: int) -> dict[str, Any]:
    import torch.distributed as dist

    trainers = {name: new_trainer(cfg_dict) for name, cfg_dict in configs.items()}
    for trainer in trainers.values():
        trainer.prime()
    names = list(trainers)
    times: dict[str, dict[str, list[float]]] = {n: {"wall": [], "cpu": []} for n in names}
    for i in range(warmup + steps):
        for name in _round_order(names, i):
            dist.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
            trainers[name].train_step()
            if trainers[name].device.type == "cuda":
                torch.cuda.synchronize()  # a step ends when its kernels do
            if i >= warmup:
                times[name]["wall"].append(time.perf_counter() - wall)
                times[name]["cpu"].append(time.process_time() - cpu)
        if dist.get_rank() == 0 and (i + 1) % 50 == 0:
            console(f"  step {i + 1}/{warmup + steps}")
    for trainer in trainers.values():
        trainer.protector.close()
    params = sum(p.numel() for p in trainers["plain"].model.parameters())
    return {"times": times, "parameters": params}


def _ratio(part: Sequence[float], reference: Sequence[float]) -> float:
    return sum(part) / sum(reference)


def measure(runs_dir: pathlib.Path, base: dict[str, Any], variants: Sequence[str], *, steps: int,
            world_size: int, warmup: int = WARMUP) -> dict[str, Any]:
    """Paired-step costs of ``variants`` (``plain`` is added) on the config ``base``.

    Returns, per variant: ``wall`` and ``cpu``, each the ratio of summed step times to
    plain DDP's, with ``wall_blocks`` / ``cpu_blocks`` (the same ratio per block of
    consecutive steps), and ``wall_median_extra_ms``, the median over steps of the
    variant's wall time minus plain DDP's in the same round: a typical step's cost,
    which a few stalled steps (a worker descheduled on an oversubscribed machine) do
    not move, where they do move the sums; for ``plain``, the median step in ms and
    the model's parameter count. Run directories (metrics, events) go under ``runs_dir/<variant>``.
    """
    if steps < BLOCKS:
        raise ValueError(f"steps: must be >= {BLOCKS} (one per block), got {steps}")
    names = ["plain", *[v for v in variants if v != "plain"]]
    configs = {n: make_config(base, runs_dir / n, **VARIANTS[n]) for n in names}
    per_rank = run_on_workers(_paired_worker, world_size, configs, steps, warmup)
    ranks = [per_rank[r]["times"] for r in sorted(per_rank)]
    # Per step: wall = the slowest rank, CPU = the mean over ranks.
    wall = {n: [max(x) for x in zip(*(r[n]["wall"] for r in ranks))] for n in names}
    cpu = {n: [statistics.fmean(x) for x in zip(*(r[n]["cpu"] for r in ranks))] for n in names}
    cuts = [steps * b // BLOCKS for b in range(BLOCKS + 1)]

    def blocks(series: dict[str, list[float]], n: str) -> list[float]:
        return [_ratio(series[n][a:b], series["plain"][a:b]) for a, b in zip(cuts, cuts[1:])]

    out: dict[str, Any] = {"plain": {"wall_ms": 1e3 * statistics.median(wall["plain"]),
                                     "cpu_ms": 1e3 * statistics.median(cpu["plain"]),
                                     "parameters": per_rank[0]["parameters"]}}
    for n in names[1:]:
        out[n] = {"wall": _ratio(wall[n], wall["plain"]), "wall_blocks": blocks(wall, n),
                  "wall_median_extra_ms": 1e3 * statistics.median(a - b for a, b in zip(wall[n], wall["plain"])),
                  "cpu": _ratio(cpu[n], cpu["plain"]), "cpu_blocks": blocks(cpu, n)}
    return out


def block_range(ratios: Sequence[float]) -> str:
    """The per-block ratios to plain DDP as an overhead range, ``+1.3 to +2.7`` (%)."""
    return f"{(min(ratios) - 1) * 100:+.1f} to {(max(ratios) - 1) * 100:+.1f}"


def run(out: pathlib.Path, *, steps: int = 200, period: int = 20, workload: str = "gpt", world_size: int = 4,
        batch_size: int = 64, variants: list[str] | None = None, warmup: int = WARMUP,
        device: str = "auto", model: dict[str, Any] | None = None) -> dict[str, Any]:
    variants = [v for v in (variants or list(VARIANTS)) if v != "plain"]
    total = warmup + steps
    base = TrainConfig(
        workload=workload, world_size=world_size, batch_size=batch_size, steps=total, eval_every=total,
        eval_batches=1, checkpoint_every=0, warmup_steps=min(20, total // 2), device=device,
        model=model or {},
    ).to_dict()
    base["protect"]["sync_period"] = period
    protect = TrainConfig.from_dict(base).protect
    period_said = f"sync period {period}"
    if any(VARIANTS[v].get("protect", {}).get("mode") == "dyn" for v in variants):
        # PAFT-Dyn runs at --period only where its bounds let it, and only at first.
        period_said += (f" (PAFT-Dyn starts at H {protect.first_h}, within [{protect.h_min}, {protect.h_max}], "
                        "and adapts it)")
    console(f"paft bench overhead: {len(variants) + 1} trainers x {total} paired steps ({workload}, {world_size} "
            f"ranks, device {device})")
    costs = measure(out / "runs", base, variants, steps=steps, world_size=world_size, warmup=warmup)
    plain = costs["plain"]
    rows = []
    for v in variants:
        c = costs[v]
        rows.append([v, (c["wall"] - 1) * 100, block_range(c["wall_blocks"]),
                     100 * c["wall_median_extra_ms"] / plain["wall_ms"], 1 / c["wall"],
                     (c["cpu"] - 1) * 100, block_range(c["cpu_blocks"])])
    table = markdown_table(["variant", "overhead %", f"range over {BLOCKS} blocks (%)", "median step overhead %",
                            "throughput / plain DDP", "CPU overhead %", f"range over {BLOCKS} blocks (%)"], rows)
    where = "CUDA" if uses_cuda(TrainConfig.from_dict(base)) else "CPU"
    size = "".join(f", {k}={v}" for k, v in (model or {}).items())
    params = plain["parameters"]
    note = (f"{workload}{size} ({params / 1e6:.2f} M parameters), {world_size} ranks on {where}, global batch "
            f"{batch_size}, {steps} paired steps per variant after {warmup} untimed, {period_said}; "
            f"plain DDP: {plain['wall_ms']:.1f} ms per step (wall, slowest rank), {plain['cpu_ms']:.1f} ms CPU "
            f"per step and rank (medians). Overhead % is the extra time per step: (variant time / plain time "
            f"- 1) x 100. Median step overhead % is the median over steps of (variant step - plain step in "
            f"the same round), over plain's median step: a typical step's cost, unmoved by a few stalled steps.")
    results = {"costs": costs, "note": note, "steps": steps, "warmup": warmup, "batch_size": batch_size,
               "world_size": world_size, "workload": workload, "period": period, "device": where.lower(),
               "model": model or {}, "parameters": params}
    write_outputs(out, "Overhead without faults (ratio to plain DDP)", results, f"{note}\n\n{table}")
    console(f"\n{note}\n\n{table}")
    return results
