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

Variants run in rotating rounds inside one worker group; every run's steps/s is
divided by the mean of the ``plain`` runs of its round. The table gives the median
ratio and the range over rounds.
"""

from __future__ import annotations

import pathlib
import statistics
from typing import Any

from paft.bench.runner import Run, make_config, markdown_table, rotations, run_all, write_outputs
from paft.config import TrainConfig

__all__ = ["VARIANTS", "plan", "run"]

VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {"monitor": {"enabled": False}},
    "monitor": {},
    "monitor-fp1": {"monitor": {"fingerprint_every": 1}},
    "guard": {"guard": {"enabled": True}},
    "dyn": {"protect": {"mode": "dyn"}},
    "sync": {"monitor": {"enabled": False}, "protect": {"mode": "sync", "overlap": False}},
    "averager": {"monitor": {"enabled": False}, "protect": {"mode": "averager"}},
}


def plan(out: pathlib.Path, base: dict[str, Any], rounds: int, variants: list[str]) -> list[Run]:
    runs = []
    for i, variant in enumerate(rotations(variants, rounds)):
        rnd = i // len(variants)
        runs.append(Run(
            name=f"r{rnd}-{variant}",
            config=make_config(base, out / "runs" / f"r{rnd}-{variant}", **VARIANTS[variant]),
            labels={"variant": variant, "round": rnd},
        ))
    return runs


def run(out: pathlib.Path, *, rounds: int = 3, steps: int = 40, period: int = 20, workload: str = "gpt",
        world_size: int = 4, variants: list[str] | None = None) -> dict[str, Any]:
    variants = variants or list(VARIANTS)
    if "plain" not in variants:
        variants = ["plain", *variants]
    base = TrainConfig(
        workload=workload, world_size=world_size, steps=steps, eval_every=steps, eval_batches=1,
        checkpoint_every=0, warmup_steps=min(20, steps // 2),
    ).to_dict()
    base["protect"]["sync_period"] = period
    runs = plan(out, base, rounds, variants)
    run_all(runs, world_size)
    ratios: dict[str, list[float]] = {v: [] for v in variants if v != "plain"}
    for rnd in range(rounds):
        in_round = [r for r in runs if r.labels["round"] == rnd]
        ref = statistics.fmean(r.summary["steps_per_s"] for r in in_round if r.labels["variant"] == "plain")
        for r in in_round:
            if r.labels["variant"] != "plain":
                ratios[r.labels["variant"]].append(r.summary["steps_per_s"] / ref)
    rows = []
    for variant, values in ratios.items():
        rows.append([variant, statistics.median(values), min(values), max(values),
                     (1 - statistics.median(values)) * 100])
    table = markdown_table(["variant", "throughput / plain DDP (median)", "min", "max", "overhead %"], rows)
    plain_rates = [r.summary["steps_per_s"] for r in runs if r.labels["variant"] == "plain"]
    note = (f"{workload}, {world_size} ranks, {steps} steps per run, {rounds} rotating rounds, sync period {period}; "
            f"plain DDP: {statistics.median(plain_rates):.3f} steps/s (median).")
    results = {"ratios": ratios, "note": note, "runs": [{"name": r.name, **r.labels, **r.summary} for r in runs]}
    write_outputs(out, "Overhead without faults (ratio to plain DDP)", results, f"{note}\n\n{table}")
    print(f"\n{note}\n{table}")
    return results
