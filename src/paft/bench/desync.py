"""The silent-inconsistency study at CPU scale: do desynchronized ranks show in the monitor?

Three settings of the bench-sized gpt (dropout 0.1, so per-rank seeds matter), no
faults, the per-step monitor on (sketch cosine), everything else equal (same seed,
weights, schedule and global batch), run in ONE worker group:

- ``S1`` synchronized: one shared permutation, rank ``r`` takes its strided shard
  (disjoint batches), same dropout seed on every rank (the default);
- ``S2`` ``desync_shuffle``: each rank shuffles with its own seed, so ranks' batches
  may overlap and are no longer coordinated;
- ``S3`` ``desync_shuffle`` + ``desync_seed``: also different dropout masks per rank;
- ``S1r``: S1 again with the next seed, a null control: its difference to S1 is what
  chance alone produces, so a "difference" of S2 or S3 no larger than S1r's is none.

Per setting, from ``consistency.jsonl``: mean and max over steps of the local-loss
coefficient of variation and std and of the local grad-norm CV, the mean pairwise
gradient cosine (mean over steps) and its minimum, the final validation loss, and
the roughness of the averaged (global) loss curve: std of its step-to-step
differences after the learning-rate warm-up. The claim under test is that the
averaged loss looks alike while worker-level dispersion differs; S2, S3 and S1r are
compared with S1 step by step (paired differences, z = mean / standard error of
10-step block means (shorter blocks in series of under 50 finite values, a short run's or
one with non-finite values left out: 5 blocks at least; the note names the sizes), since
consecutive steps share a trajectory), and the table says
"no difference beyond noise" when |z| < 3, whatever we hoped to see (a difference the
same in every block has z = +-inf; one with fewer than two blocks, too few steps, none).

Note: in S1 ranks already see different data every step, so the per-step dispersion
of S2 comes from the same kind of sampling noise; only overlap and the uncoordinated
epoch coverage differ. Expect small effects at this scale.
"""

from __future__ import annotations

import math
import pathlib
import statistics
from typing import Any

from paft.bench.matrix import BENCH_MODELS
from paft.bench.runner import Run, make_config, markdown_table, run_all, trailing_mean, write_outputs
from paft.config import TrainConfig
from paft.records import console
from paft.rundata import number, read_records

__all__ = ["SETTINGS", "METRICS", "Z_NOISE", "plan", "analyze", "run"]

SETTINGS: dict[str, tuple[str, dict[str, Any]]] = {
    "S1": ("synchronized", {}),
    "S2": ("desync shuffle", {"desync_shuffle": True}),
    "S3": ("desync shuffle + seed", {"desync_shuffle": True, "desync_seed": True}),
    "S1r": ("synchronized, seed + 1 (null control)", {}),
}
"""``S1r`` repeats S1 with the next seed (other weights, data order and masks): its
difference to S1 is what chance alone produces, the yardstick for S2 and S3."""
METRICS = ("loss_cv", "loss_std", "gnorm_cv", "grad_cos_mean", "grad_cos_min")
"""Per-step monitor metrics read from ``consistency.jsonl`` (``consistency/<name>``)."""
Z_NOISE = 3.0
"""|paired mean difference| / standard error below this: no difference beyond noise."""
NULL_FACTOR = 2.0
"""A difference no larger than this many times the null control's (S1r vs S1) is noise."""
BLOCK = 10
"""Steps per block for standard errors: consecutive steps share a trajectory, so the
error is taken over block means (batch means), not over single steps."""
DROPOUT = 0.1
PER_RANK_BATCH = 16


def plan(out: pathlib.Path, steps: int, world_size: int, seed: int = 0, device: str = "auto") -> list[Run]:
    base = TrainConfig(
        workload="gpt", world_size=world_size, steps=steps, batch_size=PER_RANK_BATCH * world_size,
        eval_every=max(1, steps // 5), eval_batches=4, checkpoint_every=0, warmup_steps=min(20, steps // 5),
        dropout=DROPOUT, seed=seed, model=dict(BENCH_MODELS["gpt"]), device=device,
    ).to_dict()
    runs = []
    for key, (desc, overrides) in SETTINGS.items():
        extra = {"seed": seed + 1} if key == "S1r" else {}
        runs.append(Run(f"{key} {desc}", make_config(base, out / "runs" / key, **overrides, **extra),
                        labels={"setting": key}))
    return runs


def _series(run_dir: str) -> dict[str, list[float]]:
    records = read_records(pathlib.Path(run_dir) / "consistency.jsonl")
    out: dict[str, list[float]] = {"step": [float(r["step"]) for r in records],
                                   "loss": [number(r["loss"]) for r in records]}
    for name in METRICS:
        out[name] = [number(r.get(f"consistency/{name}", math.nan)) for r in records]
    return out


def _finite(xs: list[float]) -> list[float]:
    return [x for x in xs if math.isfinite(x)]


def _block(n: int) -> int:
    """Steps per block for ``n`` values: BLOCK, fewer in short runs so that there are at
    least 5 blocks."""
    return max(1, min(BLOCK, n // 5))


def _mean_se(xs: list[float]) -> tuple[float, float, int]:
    """Mean and its standard error from the means of consecutive blocks of the finite
    values, and the block size (:func:`_block` of their count; 0 without any)."""
    xs = _finite(xs)
    if not xs:
        return math.nan, math.nan, 0
    block = _block(len(xs))
    means = [statistics.fmean(xs[i:i + block]) for i in range(0, len(xs) - block + 1, block)]
    if len(means) < 2:
        return statistics.fmean(xs), math.nan, block
    return statistics.fmean(xs), statistics.stdev(means) / math.sqrt(len(means)), block


def _paired(a: list[float], b: list[float]) -> dict[str, float]:
    """Mean of b - a, entry by entry (the two runs' series of the same steps: every
    setting records every step), over the pairs both finite; its standard error, z and
    the block size the error took."""
    diffs = [y - x for x, y in zip(a, b) if math.isfinite(x) and math.isfinite(y)]
    mean, se, block = _mean_se(diffs)
    if se == 0:  # the same difference in every block: beyond any noise unless it is none
        z = 0.0 if mean == 0 else math.copysign(math.inf, mean)
    else:
        z = mean / se  # NaN without a standard error (too few steps) or without a finite pair
    return {"diff": mean, "se": se, "z": z, "block": block}


def analyze(runs: list[Run], warmup: int) -> dict[str, Any]:
    """Per-setting statistics and the paired comparisons with S1, and the block sizes
    their standard errors took (``blocks``, largest first)."""
    stats: dict[str, dict[str, Any]] = {}
    series: dict[str, dict[str, list[float]]] = {}
    blocks: set[int] = set()
    for r in runs:
        key = r.labels["setting"]
        s = series[key] = _series(r.config["run_dir"])
        steps, loss = s["step"], s["loss"]
        row: dict[str, Any] = {"setting": key, "description": SETTINGS[key][0]}
        for name in METRICS:
            xs = _finite(s[name])
            mean, se, block = _mean_se(xs)
            row[f"{name}_mean"], row[f"{name}_se"] = mean, se
            blocks.add(block)
            row[f"{name}_max"] = max(xs) if xs else math.nan
            row[f"{name}_min"] = min(xs) if xs else math.nan
        after = [x for t, x in zip(steps, loss) if t >= warmup and math.isfinite(x)]
        diffs = [b - a for a, b in zip(after, after[1:])]
        row["loss_diff_std"] = statistics.pstdev(diffs) if len(diffs) > 1 else math.nan
        row["final_val_loss"] = r.summary["final_val_loss"]
        row["steps_per_s"] = r.summary["steps_per_s"]
        stats[key] = row
    comparisons: dict[str, dict[str, Any]] = {}
    ref = series.get("S1")
    for key, s in series.items():
        if key == "S1" or ref is None:
            continue
        comp = {name: _paired(ref[name], s[name]) for name in (*METRICS, "loss")}
        comparisons[key] = comp
        blocks.update(int(c["block"]) for c in comp.values())
    return {"stats": stats, "comparisons": comparisons, "series": series,
            "blocks": sorted(blocks - {0}, reverse=True)}


def _blocks_text(blocks: list[int]) -> str:
    """The note's words for the block sizes :func:`analyze` found: one as a number of
    steps; several where a series with non-finite values left out took smaller blocks."""
    if not blocks:
        return "block means"
    if len(blocks) == 1:
        return f"{blocks[0]}-step block means"
    return (f"means of blocks of {', '.join(map(str, blocks[:-1]))} or {blocks[-1]} values (the smaller in a "
            f"series with non-finite values left out)")


def _verdict(name: str, comp: dict[str, float], ref_mean: float, null: dict[str, float] | None = None) -> str:
    """One metric's reading: beyond noise only if |z| >= Z_NOISE and, when the null control
    is there, the difference is more than NULL_FACTOR times the null control's."""
    z = comp["z"]
    rel = comp["diff"] / abs(ref_mean) * 100 if ref_mean else math.nan
    if math.isnan(comp["diff"]):
        return f"{name}: no step where both runs have a finite value, nothing to compare"
    if math.isnan(z) and comp["diff"] != 0:
        # No standard error (a run of one step): a difference that cannot be weighed is not "none".
        return f"{name}: {rel:+.1f}% vs S1, too few steps to tell it from noise (z undefined)"
    if math.isnan(z) or abs(z) < Z_NOISE:
        return f"{name}: no difference beyond noise ({rel:+.1f}% vs S1, z = {z:+.1f})"
    word = "higher" if comp["diff"] > 0 else "lower"
    if null is not None and math.isfinite(null["diff"]) and abs(comp["diff"]) <= NULL_FACTOR * abs(null["diff"]):
        null_rel = null["diff"] / abs(ref_mean) * 100 if ref_mean else math.nan
        return (f"{name}: {word} than S1 by {rel:+.1f}% (z = {z:+.1f}), but the null control differs by "
                f"{null_rel:+.1f}%: not beyond run-to-run noise")
    return f"{name}: {word} than S1 by {rel:+.1f}% (z = {z:+.1f})"


def _null_note(comps: dict[str, dict[str, Any]]) -> str:
    """What the null control says about the z test's calibration."""
    null = comps.get("S1r")
    if null is None:
        return ""
    names = ("loss_cv", "gnorm_cv", "grad_cos_mean", "loss")
    fired = [name for name in names if abs(null[name]["z"]) >= Z_NOISE]  # NaN compares False
    untested = [name for name in names if math.isnan(null[name]["z"]) and null[name]["diff"] != 0
                and not math.isnan(null[name]["diff"])]
    if untested and not fired:
        return (f"- The null control S1r (synchronized, only the seed differs) cannot be tested against "
                f"|z| = {Z_NOISE:g} in {', '.join(untested)}: too few steps for a standard error; run more --steps.")
    if fired:
        return (f"- The null control S1r (synchronized, only the seed differs) also differs from S1 beyond "
                f"|z| = {Z_NOISE:g} in {', '.join(fired)}: the z test is too eager there; read S2 and S3 "
                f"against S1r's differences, not against the threshold.")
    return (f"- The null control S1r (synchronized, only the seed differs) stays within |z| < {Z_NOISE:g} on "
            f"loss_cv, gnorm_cv, grad_cos_mean and the global loss.")


def run(out: pathlib.Path, *, steps: int = 150, world_size: int = 4, seed: int = 0,
        device: str = "auto") -> dict[str, Any]:
    runs = plan(out, steps, world_size, seed, device)
    warmup = TrainConfig.from_dict(runs[0].config).warmup_steps
    console(f"paft bench desync: {len(runs)} runs (gpt {BENCH_MODELS['gpt']}, dropout {DROPOUT}; {steps} steps, "
            f"{world_size} ranks)")
    run_all(runs, world_size)
    result = analyze(runs, warmup)
    stats, comps = result["stats"], result["comparisons"]
    header = ["setting", "loss_cv mean ± se", "loss_cv max", "loss_std mean", "loss_std max", "gnorm_cv mean ± se",
              "gnorm_cv max", "grad_cos_mean mean ± se", "grad_cos_min min", "final val loss",
              "global loss Δ std"]
    rows = []
    for key, s in stats.items():
        rows.append([
            f"{key} {s['description']}", f"{s['loss_cv_mean']:.4g} ± {s['loss_cv_se']:.2g}", s["loss_cv_max"],
            s["loss_std_mean"], s["loss_std_max"], f"{s['gnorm_cv_mean']:.4g} ± {s['gnorm_cv_se']:.2g}",
            s["gnorm_cv_max"], f"{s['grad_cos_mean_mean']:.4g} ± {s['grad_cos_mean_se']:.2g}",
            s["grad_cos_min_min"], s["final_val_loss"], s["loss_diff_std"],
        ])
    table = markdown_table(header, rows)
    reading = []
    for key, comp in comps.items():
        null = comps.get("S1r") if key != "S1r" else None
        parts = [_verdict(name, comp[name], stats["S1"][f"{name}_mean"], null[name] if null else None)
                 for name in ("loss_cv", "gnorm_cv", "grad_cos_mean")]
        loss = comp["loss"]
        val = stats[key]["final_val_loss"] - stats["S1"]["final_val_loss"]
        part = f"global loss: {loss['diff']:+.4f} per step vs S1 on average (z = {loss['z']:+.1f})"
        if null:
            part += f", null control {null['loss']['diff']:+.4f}"
        part += f"; final val loss {val:+.4f}"
        if null and "S1r" in stats:
            part += f" (null control {stats['S1r']['final_val_loss'] - stats['S1']['final_val_loss']:+.4f})"
        parts.append(part)
        reading.append(f"- {key} ({SETTINGS[key][0]}) vs S1: " + "; ".join(parts) + ".")
    null_note = _null_note(comps)
    if null_note:
        reading.append(null_note)
    note = (
        f"gpt {BENCH_MODELS['gpt']}, dropout {DROPOUT}, {world_size} ranks x {PER_RANK_BATCH} sequences, "
        f"{steps} steps, seed {seed}, no faults, monitor on (sketch cosine, every step); one run per setting, "
        f"same weights and schedule; S1r repeats S1 with seed {seed + 1} (a null control: what chance alone "
        f"gives). Statistics over the steps of each run (± standard error from "
        f"{_blocks_text(result['blocks'])}). "
        f"Global loss Δ std: std of step-to-step differences of the mean-of-ranks loss after the "
        f"{warmup}-step warm-up (roughness of the curve a DDP user sees). Paired comparisons: per-step "
        f"difference to S1, z = mean / block standard error; |z| < {Z_NOISE:g} is read as no difference beyond "
        f"noise."
    )
    md = f"{note}\n\n{table}\n\nReading (computed, not edited):\n\n" + "\n".join(reading) + "\n"
    plots = _plots(out, result["series"])
    md += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots) + "\n"
    results = {
        "steps": steps, "world_size": world_size, "seed": seed, "model": BENCH_MODELS["gpt"], "dropout": DROPOUT,
        "z_noise": Z_NOISE, "warmup": warmup, "note": note, "reading": reading,
        "settings": {k: {"description": d, "overrides": o} for k, (d, o) in SETTINGS.items()},
        "rows": list(stats.values()), "comparisons": comps, "series": result["series"],
        "runs": [{"name": r.name, **r.labels, **r.summary} for r in runs],
    }
    write_outputs(out, "Silent inconsistency: synchronized vs desynchronized ranks", results, md)
    console("\n" + table + "\n\n" + "\n".join(reading))
    return results


def _plots(out: pathlib.Path, series: dict[str, dict[str, list[float]]]) -> list[pathlib.Path]:
    """Global loss overlaid; loss / grad-norm CV; gradient cosine; one PNG each."""
    from matplotlib.figure import Figure

    colors = {"S1": "tab:blue", "S2": "tab:orange", "S3": "tab:green", "S1r": "tab:gray"}
    files = []

    def lines(ax: Any, key: str, steps: list[float], values: list[float], suffix: str = "") -> None:
        """Per step (thin) and its 9-step mean (thick; the null control dashed)."""
        ax.plot(steps, values, color=colors.get(key), lw=0.6, alpha=0.35)
        ax.plot(steps, trailing_mean(values, 9), color=colors.get(key), ls="--" if key == "S1r" else "-", lw=1.5,
                label=f"{key} {SETTINGS[key][0]}{suffix}")

    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    for key, s in series.items():
        lines(ax, key, s["step"], s["loss"], " (9-step mean)")
    ax.set(title="global (mean-of-ranks) training loss", xlabel="step", ylabel="loss")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    files.append(out / "loss.png")
    fig.savefig(files[-1], dpi=90)

    fig = Figure(figsize=(12, 4.5), layout="constrained")
    axes = fig.subplots(1, 2)
    fig.suptitle("dispersion over ranks (thin: per step, thick: 9-step mean)")
    for ax, name, title in ((axes[0], "loss_cv", "local-loss CV"),
                            (axes[1], "gnorm_cv", "local grad-norm CV")):
        for key, s in series.items():
            lines(ax, key, s["step"], s[name])
        ax.set(title=title, xlabel="step", ylabel="std / |mean|")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    files.append(out / "dispersion.png")
    fig.savefig(files[-1], dpi=90)

    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    for key, s in series.items():
        lines(ax, key, s["step"], s["grad_cos_mean"])
    ax.set(title="mean pairwise cosine of local gradients (sketch)", xlabel="step", ylabel="cosine")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    files.append(out / "cosine.png")
    fig.savefig(files[-1], dpi=90)
    return files
