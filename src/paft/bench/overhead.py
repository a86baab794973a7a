"""Overhead without faults: each defense's throughput as a ratio to plain DDP.

Variants, on the default workload (gpt, 4 ranks), all without faults:

- ``plain``: plain DDP (no hook, no control collective) — the reference;
- ``monitor``: the per-step monitor with its defaults (sketch cosine at interval 1,
  aggregated-gradient fingerprint every step, state fingerprint every 10 steps);
- ``monitor-fp1``: the same with the state fingerprint every step;
- ``guard``: monitor + guard;
- ``dyn``: monitor + PAFT-Dyn with overlapped sync;
- ``sync``: PAFT-Sync, blocking, at period H (no per-step monitor);
- ``averager``: PyTorch's PeriodicModelAverager at the same period H.

Variants run in rotating rounds inside one worker group, and every variant run sits
between two ``plain`` runs (``plain, a, plain, b, plain, ...``): its steps/s is divided
by the mean of those two neighbours, so slow drifts of a shared machine cancel. The
table gives the median ratio and the range over rounds, and the same for the CPU time
per step (``cpu_ms_per_step``, all threads of a worker, mean over ranks): on a machine
that other jobs share, the CPU cost of a defense is steadier than its wall time.
"""

from __future__ import annotations

import pathlib
import statistics
from typing import Any

from paft.bench.runner import (
    Run,
    alternate,
    make_config,
    markdown_table,
    rotations,
    run_all,
    throughput_ratios,
    write_outputs,
)
from paft.config import TrainConfig

__all__ = ["VARIANTS", "plan", "ratios_of", "run"]

VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {"monitor": {"enabled": False}},
    "monitor": {},
    "monitor-fp1": {"monitor": {"fingerprint_every": 1}},
    "guard": {"guard": {"enabled": True}},
    "dyn": {"protect": {"mode": "dyn"}},
    "sync": {"monitor": {"enabled": False}, "protect": {"mode": "sync", "overlap": False}},
    "averager": {"monitor": {"enabled": False}, "protect": {"mode": "averager"}},
}


def plan(runs_dir: pathlib.Path, base: dict[str, Any], rounds: int, variants: list[str], *,
         group: str = "", prefix: str = "") -> list[Run]:
    """``rounds`` rotations of the non-plain variants, a plain DDP run before and after each.

    Run directories go under ``runs_dir``; ``group`` and ``prefix`` (of the run names)
    let another benchmark (``detection``) append these runs to its own plan.
    """
    others = [v for v in variants if v != "plain"]
    schedule = alternate("plain", rotations(others, rounds), every=1)
    runs = []
    for i, variant in enumerate(schedule):
        # Variant j of the rotations sits at 2j + 1, the plain run after it at 2j + 2.
        rnd = max(0, i - 1) // 2 // len(others) if others else 0
        name = f"{i:03d}-{variant}"
        runs.append(Run(
            name=prefix + name,
            config=make_config(base, runs_dir / name, **VARIANTS[variant]),
            group=group,
            labels={"kind": "overhead", "variant": variant, "round": rnd},
        ))
    return runs


def ratios_of(runs: list[Run], key: str = "steps_per_s") -> dict[str, list[float]]:
    """Each non-plain run's ``key`` over the mean of the plain runs next to it, per variant."""
    over = [r for r in runs if r.labels.get("kind") == "overhead"]
    return throughput_ratios([r.labels["variant"] for r in over], [r.summary[key] for r in over], "plain")


def run(out: pathlib.Path, *, rounds: int = 3, steps: int = 40, period: int = 20, workload: str = "gpt",
        world_size: int = 4, batch_size: int = 64, variants: list[str] | None = None) -> dict[str, Any]:
    variants = variants or list(VARIANTS)
    if "plain" not in variants:
        variants = ["plain", *variants]
    base = TrainConfig(
        workload=workload, world_size=world_size, batch_size=batch_size, steps=steps, eval_every=steps, eval_batches=1,
        checkpoint_every=0, warmup_steps=min(20, steps // 2),
    ).to_dict()
    base["protect"]["sync_period"] = period
    runs = plan(out / "runs", base, rounds, variants)
    run_all(runs, world_size)
    measured, cpu_measured = ratios_of(runs), ratios_of(runs, "cpu_ms_per_step")
    ratios = {v: measured.get(v, []) for v in variants if v != "plain"}
    cpu = {v: cpu_measured.get(v, []) for v in ratios}
    rows = []
    for variant, values in ratios.items():
        tput, cost = statistics.median(values), statistics.median(cpu[variant])
        rows.append([variant, tput, f"{min(values):.3f}-{max(values):.3f}", (1 - tput) * 100,
                     cost, f"{min(cpu[variant]):.3f}-{max(cpu[variant]):.3f}", (cost - 1) * 100])
    table = markdown_table(["variant", "throughput / plain DDP (median)", "range", "overhead %",
                            "CPU per step / plain DDP (median)", "range", "CPU overhead %"], rows)
    plain = [r.summary for r in runs if r.labels["variant"] == "plain"]
    note = (f"{workload}, {world_size} ranks, global batch {batch_size}, {steps} steps per run, {rounds} rotating rounds, each run between "
            f"two plain DDP runs, sync period {period}; plain DDP: "
            f"{statistics.median(s['steps_per_s'] for s in plain):.3f} steps/s, "
            f"{statistics.median(s['cpu_ms_per_step'] for s in plain):.1f} ms CPU per step and rank (medians).")
    results = {"ratios": ratios, "cpu_ratios": cpu, "note": note,
               "runs": [{"name": r.name, **r.labels, **r.summary} for r in runs]}
    write_outputs(out, "Overhead without faults (ratio to plain DDP)", results, f"{note}\n\n{table}")
    print(f"\n{note}\n{table}")
    return results
