"""The PAFT evaluation matrix: defenses side by side under injected faults.

Per workload (gpt, llama, resnet; bench-sized models so the full matrix of 180 runs
fits in about 20 minutes on 2 cores), at 4 ranks, same seed and data order everywhere:

1. ``fault-free``: plain DDP without faults (the reference, re-run between cells; no
   comm hook, no control collective);
2. ``unprotected``: faults, plain DDP (no control collective; paft's comm hook only
   to inject the faults);
3. ``averager``: faults + ``torch.distributed.algorithms.model_averaging``'s
   PeriodicModelAverager at period H (the in-tree anchor);
4. ``paft-sync``: faults + PAFT-Sync at H;
5. ``paft-dyn``: faults + PAFT-Dyn;
6. ``guard``: faults + guard;
7. ``dyn+guard``: faults + PAFT-Dyn + guard.

(torchft's LocalSGD is not among them: it needs torchft's lighthouse service and, like
the averager, syncs parameters only.)

Fault settings: aggregation bit flips on rank 1, exponent and mantissa classes, at
rates 1e-3, 1e-2, 1e-1 per step; plus an exponent flip in the local gradient
(compute SDC) at 2e-2 for the guard scenarios. ``--quick``: exponent at 1e-1 only, the
local-gradient flips at 1e-1 too, fewer steps, sync period 10.

Per cell: final validation loss (and accuracy) and its gap to the fault-free run,
max replica divergence over the run (sampled at evaluations) and at the end,
replicas distinct at the end, syncs and bytes synchronized, detections and
recomputes, and throughput as a ratio to the fault-free runs scheduled next to it.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any

from paft.bench.runner import (
    Run,
    alternate,
    make_config,
    markdown_table,
    run_all,
    throughput_ratios,
    trailing_mean,
    write_outputs,
)
from paft.config import TrainConfig
from paft.records import console
from paft.rundata import mean_local_loss, number, read_metrics, read_records

__all__ = ["SCENARIOS", "fault_settings", "plan", "run", "summarize", "BENCH_MODELS"]

REFERENCE = "fault-free"

# The reference and the unprotected runs are plain DDP: no control collective (the
# monitor is on by default in a TrainConfig); the unprotected runs' faults still need
# paft's comm hook to inject them.
PLAIN_DDP: dict[str, Any] = {"monitor": {"enabled": False}}

SCENARIOS: dict[str, dict[str, Any]] = {
    "unprotected": PLAIN_DDP,
    "averager": {**PLAIN_DDP, "protect": {"mode": "averager"}},
    "paft-sync": {**PLAIN_DDP, "protect": {"mode": "sync"}},
    "paft-dyn": {"protect": {"mode": "dyn"}},
    "guard": {"guard": {"enabled": True}},
    "dyn+guard": {"protect": {"mode": "dyn"}, "guard": {"enabled": True}},
}
GUARD_SCENARIOS = ("unprotected", "guard", "dyn+guard")

BENCH_MODELS: dict[str, dict[str, Any]] = {
    "gpt": {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64},
    "llama": {"n_layer": 2, "n_head": 4, "n_embd": 64, "block_size": 64},
    "resnet": {"depth": 8, "width": 8},
}


def fault_settings(quick: bool) -> dict[str, tuple[str, tuple[str, ...]]]:
    """name -> (fault spec, scenarios that run under it)."""
    all_scenarios = tuple(SCENARIOS)
    rates = (1e-1,) if quick else (1e-3, 1e-2, 1e-1)
    classes = ("exponent",) if quick else ("exponent", "mantissa")
    out = {
        f"agg-{bits}-{rate:g}": (f"bitflip:site=aggregation,rate={rate:g},bits={bits},ranks=1", all_scenarios)
        for bits in classes for rate in rates
    }
    local = 0.1 if quick else 0.02
    out[f"local-exponent-{local:g}"] = (f"bitflip:site=local-grad,rate={local:g},bits=exponent,ranks=1",
                                        GUARD_SCENARIOS)
    return out


def plan(out: pathlib.Path, workloads: list[str], quick: bool, steps: int, world_size: int,
         device: str = "auto") -> list[Run]:
    period = 10 if quick else 20
    runs: list[Run] = []
    for workload in workloads:
        base = TrainConfig(
            workload=workload, world_size=world_size, steps=steps, batch_size=8 * world_size,
            eval_every=max(1, steps // 5), eval_batches=4, checkpoint_every=0, warmup_steps=min(20, steps // 5),
            model=dict(BENCH_MODELS[workload]), device=device,
        ).to_dict()
        base["protect"]["sync_period"] = period
        cells = [(setting, spec, scenario) for setting, (spec, scenarios) in fault_settings(quick).items()
                 for scenario in scenarios]
        names = [f"{workload}/{setting}/{scenario}" for setting, _, scenario in cells]
        by_name = dict(zip(names, cells))
        ref_count = 0
        for name in alternate(REFERENCE, names, every=3 if quick else 2):
            if name == REFERENCE:
                run_dir = out / "runs" / workload / f"{REFERENCE}-{ref_count}"
                runs.append(Run(f"{workload}/{REFERENCE}-{ref_count}", make_config(base, run_dir, **PLAIN_DDP),
                                group=workload, labels={"scenario": REFERENCE, "setting": "none"}))
                ref_count += 1
                continue
            setting, spec, scenario = by_name[name]
            run_dir = out / "runs" / workload / setting / scenario
            runs.append(Run(name, make_config(base, run_dir, inject=[spec], **SCENARIOS[scenario]), group=workload,
                            labels={"scenario": scenario, "setting": setting, "spec": spec}))
    return runs


def _row(run: Run, ref: dict[str, Any], ratio: float, ratio_unprotected: float | None) -> dict[str, Any]:
    s = run.summary
    gap = (s["final_val_loss"] - ref["final_val_loss"]) / ref["final_val_loss"] * 100
    row = {
        "workload": run.group, "setting": run.labels["setting"], "scenario": run.labels["scenario"],
        "final_val_loss": s["final_val_loss"], "gap_pct": gap,
        # The worst replica against the reference's worst: a split replica's loss is
        # diluted in the mean, and BatchNorm statistics differ per rank even fault-free.
        "gap_worst_pct": (s["final_val_loss_max"] - ref["final_val_loss_max"]) / ref["final_val_loss_max"] * 100,
        "max_divergence": s["max_replica_rel_diff_run"], "end_divergence": s["max_replica_rel_diff"],
        "replicas_distinct": s["replicas_distinct"], "faults": s["faults_injected"], "syncs": s["syncs"],
        "sync_mb": s["sync_bytes"] / 2**20, "detections": s["detections"], "recomputes": s["recomputes"],
        "skipped": s["skipped_batches"], "throughput_ratio": ratio, "throughput_vs_unprotected": ratio_unprotected,
    }
    if "final_val_acc" in s:
        row["final_val_acc"] = s["final_val_acc"]
    return row


def run(out: pathlib.Path, *, quick: bool, workloads: list[str], steps: int | None = None,
        world_size: int = 4, device: str = "auto") -> dict[str, Any]:
    steps = steps or (40 if quick else 150)
    runs = plan(out, workloads, quick, steps, world_size, device)
    console(f"paft bench matrix: {len(runs)} runs ({', '.join(workloads)}; {steps} steps each, {world_size} ranks)")
    run_all(runs, world_size)
    return summarize(out, runs, workloads, steps, world_size)


def summarize(out: pathlib.Path, runs: list[Run], workloads: list[str], steps: int, world_size: int) -> dict[str, Any]:
    """Rows, tables and plots from finished runs."""
    rows: list[dict[str, Any]] = []
    for workload in workloads:
        group = [r for r in runs if r.group == workload]
        schedule = [r.labels["scenario"] if r.labels["scenario"] == REFERENCE else r.name for r in group]
        ratios = throughput_ratios(schedule, [r.summary["steps_per_s"] for r in group], REFERENCE)
        ref_runs = [r for r in group if r.labels["scenario"] == REFERENCE]
        ref = dict(ref_runs[0].summary)
        rows.append(_row(ref_runs[0], ref, 1.0, None))
        unprotected = {r.labels["setting"]: r.summary["steps_per_s"] for r in group
                       if r.labels["scenario"] == "unprotected"}
        for r in group:
            if r.labels["scenario"] != REFERENCE:
                base = unprotected.get(r.labels["setting"])
                rows.append(_row(r, ref, ratios[r.name][0], r.summary["steps_per_s"] / base if base else None))
    header = ["workload", "setting", "scenario", "val loss", "gap %", "worst gap %", "max div", "end div", "replicas",
              "faults", "syncs", "sync MiB", "detect", "recomp", "thru / ref", "thru / unprot"]
    table = markdown_table(header, [
        [r["workload"], r["setting"], r["scenario"], r["final_val_loss"], r["gap_pct"], r["gap_worst_pct"],
         r["max_divergence"], r["end_divergence"], r["replicas_distinct"], r["faults"], r["syncs"], r["sync_mb"],
         r["detections"], r["recomputes"], r["throughput_ratio"],
         math.nan if r["throughput_vs_unprotected"] is None else r["throughput_vs_unprotected"]] for r in rows])
    acc_rows = [[r["setting"], r["scenario"], r["final_val_acc"]] for r in rows if "final_val_acc" in r]
    md = (f"{len(runs)} runs, {steps} steps each, {world_size} ranks, same seed and data order. gap % = final "
          "validation loss (mean over replicas) vs the fault-free run; worst gap % = the worst replica's vs the "
          "fault-free run's worst; div = max over ranks of ||w_r - mean w|| / ||mean w|| (max over the run's "
          "evaluations, and at the end); sync MiB = bytes the syncs moved / 2^20; thru / ref = steps/s over "
          "the fault-free runs scheduled next to it "
          "(plain DDP, built-in reducer); thru / unprot = steps/s over the unprotected run of the same fault "
          f"setting (the same comm-hook path, no defense).\n\n{table}\n")
    # A short run may draw no fault from a setting's rate: its rows then compare fault-free runs.
    idle = sorted({(r["workload"], r["setting"]) for r in rows if r["scenario"] != REFERENCE}
                  - {(r["workload"], r["setting"]) for r in rows if r["scenario"] != REFERENCE and r["faults"]})
    if idle:
        said = ", ".join(f"{setting} ({workload})" for workload, setting in idle)
        md += (f"\n**No fault fired** in {said}: {steps} steps drew none, so those rows compare fault-free runs; "
               "run more --steps.\n")
    if acc_rows:
        md += "\nresnet validation accuracy:\n\n" + markdown_table(["setting", "scenario", "val acc"], acc_rows) + "\n"
    results = {"steps": steps, "world_size": world_size, "workloads": workloads, "rows": rows,
               "runs": [{"name": r.name, "group": r.group, "config": r.config, "labels": r.labels,
                         "summary": r.summary} for r in runs]}
    plots = _plots(out, runs, workloads)
    md += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots) + "\n"
    write_outputs(out, "paft bench matrix", results, md)
    console("\n" + table)
    return results


def _plots(out: pathlib.Path, runs: list[Run], workloads: list[str]) -> list[pathlib.Path]:
    """Loss curves per scenario, divergence over time with syncs, and the Dyn period H."""
    from matplotlib.figure import Figure

    files = []
    for workload in workloads:
        group = [r for r in runs if r.group == workload]
        settings = sorted({r.labels["setting"] for r in group if r.labels["setting"] != "none"})
        fig = Figure(figsize=(6 * len(settings), 10), layout="constrained")
        axes = fig.subplots(3, len(settings), squeeze=False)
        ref = next(r for r in group if r.labels["scenario"] == REFERENCE)
        for col, setting in enumerate(settings):
            loss_ax, div_ax, h_ax = axes[0][col], axes[1][col], axes[2][col]
            for r in [ref] + [r for r in group if r.labels["setting"] == setting]:
                name = r.labels["scenario"]
                steps, loss = mean_local_loss(read_metrics(r.config["run_dir"]))
                loss_ax.plot(steps, trailing_mean(loss, 5), label=name, lw=1)
                evals = read_records(pathlib.Path(r.config["run_dir"]) / "evals.jsonl")
                div_ax.plot([e["step"] for e in evals], [_finite_or_nan(e["replica_rel_diff"]) for e in evals],
                            marker="o", ms=3, label=name)
                events = read_records(pathlib.Path(r.config["run_dir"]) / "events.jsonl")
                syncs = [e for e in events if e.get("event") in ("sync", "repair") and "period" in e]
                if syncs and name in ("paft-dyn", "dyn+guard", "paft-sync"):
                    # Marked: a run's only sync is a step line of one point, which draws nothing.
                    h_ax.step([e["step"] for e in syncs], [e["period"] for e in syncs], where="post", label=name,
                              marker="o", ms=3)
            loss_ax.set(title=f"{workload}: {setting}", xlabel="step", ylabel="train loss, mean over ranks (smoothed)")
            loss_ax.set_yscale("log")
            div_ax.set(xlabel="step", ylabel="replica divergence")
            div_ax.set_yscale("symlog", linthresh=1e-8)
            h_ax.set(xlabel="step", ylabel="sync period H")
            for ax in (loss_ax, div_ax, h_ax):
                ax.grid(alpha=0.3)
                if ax.get_legend_handles_labels()[0]:
                    ax.legend(fontsize=7)
        path = out / f"{workload}.png"
        fig.savefig(path, dpi=90)
        files.append(path)
    return files


def _finite_or_nan(x: Any) -> float:
    x = number(x)
    return x if math.isfinite(x) else math.nan
