"""The guard's detection table: per float32 bit and fault site, how often a flip harms and is caught.

For each site (``aggregation``: the all-reduced gradient one rank receives;
``local-grad``: one rank's gradient before the all-reduce) and each bit target (the
32 bits of float32, then the classes ``sign``, ``exponent``, ``mantissa``, from which
each fault draws one bit), two runs inject ``bitflip:site=SITE,rate=RATE,bits=B,
ranks=1,count=1`` (one element of rank 1's gradient): one with ``--guard``, one with
the monitor only (no guard) to measure the harm. All runs share the seed, weights,
data order and fault schedule, so every bit target is flipped at the same steps and
in the same gradient element (a controlled sweep; only the bit differs); a
fault-free run is the reference. Small model (gpt, 1 layer, width 32, 2 ranks) so
the ~140 runs fit in about ten minutes on 2 cores; evaluation (one fixed validation
batch) and replica divergence after every step.

Definitions (a fault is one injected flip at step ``t``; ``v(s)`` is the worst
replica's validation loss after ``s`` updates, ``div(s)`` the replicas' relative
L2 divergence, ``gap(s) = (v_unguarded(s) - v_fault_free(s)) / v_fault_free(s)``):

- **harmful** (from the unguarded run): the update of step ``t`` made the model
  non-finite (``v`` or ``div`` non-finite at ``t+1 .. t+K``), or raised the loss:
  ``max gap(s) - gap(t) > LOSS_HARM`` over ``s = t+1 .. t+K``, or split the replicas:
  ``div(t+1) - div(t) - drift > DIV_HARM`` (PAFT-Dyn's default divergence target;
  ``drift = max(0, div(t) - div(t-1))``: replicas split by an earlier fault keep
  drifting apart, which is not this fault's doing). The window
  stops before the next fault's update. Faults on an already non-finite model are
  not assessed, nor is a fault right after one that split the replicas whose split
  the drift decides (it fires without the drift subtracted, not with it): there
  ``div(t) - div(t-1)`` is that fault's jump, not a drift, and a split keeps
  drifting at about its jump's size for a few steps, so this fault's own split cannot
  be told from it (measured, float32 bit 26 at steps 4 and 5: step 5's flip alone
  split the replicas by 1.6e-4, above DIV_HARM, and after step 4's added 0.04e-4
  beyond its drift). The same test applied at every fault-free step gives the
  *background* rate: how often the test fires without a fresh fault (its noise).
- **detected** (from the guarded run): the guard logged a detection (any detector)
  at a fault step; a detection within LATE_WINDOW steps after a fault step is
  *late*; any other detection is a *false positive*, counted in the faulty runs
  and in fault-free guarded runs.
- **recomputes**, and the final validation-loss gap of the guarded (and unguarded)
  run to the fault-free run, in percent.

The guard's overhead without faults is measured on the same model with
:func:`paft.bench.overhead.measure` (paired steps of plain DDP, monitor and guard
trainers in one worker group); the fault-free guarded trainer of that measurement
also counts false positives.
"""

from __future__ import annotations

import math
import pathlib
from collections.abc import Sequence
from typing import Any

import torch

from paft.bench import overhead
from paft.bench.runner import Run, make_config, markdown_table, run_all, write_outputs
from paft.config import TrainConfig
from paft.faultspec import BIT_CLASSES, BUCKET_SITES, bit_range
from paft.records import console
from paft.rundata import read_records

__all__ = [
    "bit_label",
    "SITES",
    "BIT_TARGETS",
    "MODEL",
    "LOSS_HARM",
    "DIV_HARM",
    "HARM_WINDOW",
    "LATE_WINDOW",
    "OVERHEAD_VARIANTS",
    "parse_bits",
    "fault_spec",
    "plan",
    "assess_harm",
    "assess_detection",
    "harmful_missed",
    "run",
]

SITES: tuple[str, ...] = BUCKET_SITES
BIT_TARGETS: tuple[int | str, ...] = (*range(32), "sign", "exponent", "mantissa")
MODEL: dict[str, Any] = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32}
PER_RANK_BATCH = 8
LOSS_HARM = 0.02
"""A rise of the worst replica's validation loss, relative to the fault-free run, above this is harm."""
DIV_HARM = 1e-4
"""A rise of the replicas' relative divergence above this is harm (PAFT-Dyn's default target)."""
HARM_WINDOW = 3
"""Steps after the faulty update in which the harm must show (K)."""
LATE_WINDOW = 2
"""A detection this many steps after a fault step is late, not a false positive."""
OVERHEAD_VARIANTS: tuple[str, ...] = ("plain", "monitor", "guard")
"""Variants of :data:`paft.bench.overhead.VARIANTS` measured for the guard's overhead."""
REFERENCE = "fault-free"
NOT_ASSESSED = ("collapsed", "after_split")
""":func:`assess_harm`'s verdicts on faults it cannot judge (see the module docstring)."""


def parse_bits(bits: Sequence[str | int] | None) -> list[int | str]:
    """Bit targets as ints 0..31 or class names; ``None``: all of :data:`BIT_TARGETS`."""
    if bits is None:
        return list(BIT_TARGETS)
    out: list[int | str] = []
    for b in bits:
        value: int | str = int(b) if isinstance(b, int) or str(b).strip().isdigit() else str(b).strip()
        if isinstance(value, int) and not 0 <= value <= 31:
            raise ValueError(f"bits: a float32 bit index must be in 0..31, got {value}")
        if isinstance(value, str) and value not in BIT_CLASSES:
            raise ValueError(f"bits: must be 0..31 or one of {BIT_CLASSES}, got {value!r}")
        if value not in out:
            out.append(value)
    if not out:
        raise ValueError("bits: needs at least one bit target")
    return out


def fault_spec(site: str, bits: int | str, rate: float) -> str:
    return f"bitflip:site={site},rate={rate:g},bits={bits},ranks=1,count=1"


def _float32_field(bit: int) -> str:
    """The float32 field (``sign``, ``exponent``, ``mantissa``) that holds ``bit``."""
    for field in ("sign", "exponent", "mantissa"):
        lo, hi = bit_range(torch.float32, field)
        if lo <= bit <= hi:
            return field
    raise ValueError(f"bit {bit} is not a float32 bit")


def bit_label(bits: int | str) -> str:
    if isinstance(bits, str):
        return f"{bits} (random bit)" if bits != "sign" else "sign (class)"
    return f"{bits} ({_float32_field(bits)})"


def _base(steps: int, world_size: int, seed: int, eval_every: int, device: str = "auto") -> dict[str, Any]:
    return TrainConfig(
        workload="gpt", world_size=world_size, steps=steps, batch_size=PER_RANK_BATCH * world_size,
        eval_every=eval_every, eval_batches=1, checkpoint_every=0, warmup_steps=max(1, steps // 8), seed=seed,
        model=dict(MODEL), device=device,
    ).to_dict()


def plan(out: pathlib.Path, *, steps: int, rate: float, world_size: int, bits: list[int | str],
         sites: Sequence[str], seed: int = 0, device: str = "auto") -> list[Run]:
    """The reference, then the (site, bits) cells guarded and unguarded."""
    # Evaluate after every step: per-step validation loss and replica divergence for the harm test.
    base = _base(steps, world_size, seed, eval_every=1, device=device)
    runs = [Run(REFERENCE, make_config(base, out / "runs" / REFERENCE), labels={"kind": "reference"})]
    for site in sites:
        for b in bits:
            spec = fault_spec(site, b, rate)
            for guarded in (True, False):
                arm = "guard" if guarded else "unguarded"
                overrides: dict[str, Any] = {"guard": {"enabled": True}} if guarded else {}
                runs.append(Run(
                    f"{site}/bits={b}/{arm}", make_config(base, out / "runs" / site / f"bits-{b}" / arm,
                                                          inject=[spec], **overrides),
                    group=site, labels={"kind": "cell", "site": site, "bits": b, "guard": guarded, "spec": spec},
                ))
    return runs


# -- reading a run directory ------------------------------------------------------------


def _fault_steps(run_dir: pathlib.Path) -> list[int]:
    """Steps where a fault was injected on the first attempt (transient faults never re-fire)."""
    return sorted({int(r["step"]) for r in read_records(run_dir / "faults.jsonl") if int(r.get("attempt", 0)) == 0})


def _guard_events(run_dir: pathlib.Path) -> list[dict[str, Any]]:
    return [e for e in read_records(run_dir / "events.jsonl") if e.get("event") == "guard" and e.get("detector")]


def _evals(run_dir: pathlib.Path) -> tuple[dict[int, float], dict[int, float]]:
    """step -> worst replica's validation loss, step -> relative replica divergence."""
    worst, div = {}, {}
    for e in read_records(run_dir / "evals.jsonl"):
        per_rank = e.get("val_loss_per_rank", [e["val_loss"]])
        worst[int(e["step"])] = math.inf if not all(math.isfinite(v) for v in per_rank) else max(per_rank)
        div[int(e["step"])] = e["replica_rel_diff"]
    return worst, div


# -- the two measurements ----------------------------------------------------------------


def assess_harm(run_dir: pathlib.Path, ref_dir: pathlib.Path, steps: int) -> dict[str, Any]:
    """Harm of every fault of an unguarded run (see the module docstring), and the background rate."""
    faults = _fault_steps(run_dir)
    worst, div = _evals(run_dir)
    ref_worst, _ = _evals(ref_dir)

    def gap(s: int) -> float:
        return (worst[s] - ref_worst[s]) / ref_worst[s]

    fault_set = set(faults)

    def test(t: int, stop: int) -> tuple[str | None, dict[str, float]]:
        """Why the update of step t was harmful (None: it was not), or why it is not
        assessed: 'collapsed' before it, 'after_split' (see the module docstring)."""
        if not (math.isfinite(worst.get(t, math.nan)) and math.isfinite(div.get(t, math.nan))):
            return "collapsed", {}
        window = [s for s in range(t + 1, min(t + HARM_WINDOW, stop) + 1) if s in worst]
        if not window:
            return None, {}
        if any(not (math.isfinite(worst[s]) and math.isfinite(div[s])) for s in window):
            return "nonfinite", {}
        rise = max(gap(s) for s in window) - gap(t)
        # A split replica keeps drifting apart for many steps (its optimizer state
        # differs): count only the divergence added beyond the previous step's drift.
        drift = max(0.0, div[t] - div[t - 1]) if t - 1 in div and math.isfinite(div[t - 1]) else 0.0
        split = div[window[0]] - div[t] - drift
        values = {"loss_rise": rise, "div_rise": split}
        if rise > LOSS_HARM:
            return "loss", values
        if split > DIV_HARM:
            return "split", values
        if t - 1 in fault_set and drift > 0 and split + drift > DIV_HARM:
            return "after_split", values  # the "drift" is the previous fault's jump
        return None, values

    per_fault = []
    for i, t in enumerate(faults):
        stop = min(faults[i + 1] if i + 1 < len(faults) else steps, steps)
        why, values = test(t, stop)
        per_fault.append({"step": t, "harm": why, **values})
    background = {"assessed": 0, "fired": 0}
    for t in range(steps):
        if t in fault_set:
            continue
        nxt = min([f for f in faults if f > t] + [steps])
        why, _ = test(t, nxt)
        if why in NOT_ASSESSED:
            continue
        background["assessed"] += 1
        background["fired"] += why is not None
    assessed = [p for p in per_fault if p["harm"] not in NOT_ASSESSED]
    return {
        "faults": len(faults),
        "assessed": len(assessed),
        "collapsed": sum(p["harm"] == "collapsed" for p in per_fault),
        "after_split": sum(p["harm"] == "after_split" for p in per_fault),
        "harmful": sum(p["harm"] is not None for p in assessed),
        "by_reason": {r: sum(p["harm"] == r for p in assessed) for r in ("nonfinite", "loss", "split")},
        "per_fault": per_fault,
        "background": background,
    }


def assess_detection(run_dir: pathlib.Path) -> dict[str, Any]:
    """Detections of a guarded run at fault steps, late after them, and elsewhere (false positives)."""
    faults = _fault_steps(run_dir)
    events = _guard_events(run_dir)
    detected_steps = sorted({int(e["step"]) for e in events})
    fault_set = set(faults)
    late = [s for s in detected_steps if s not in fault_set
            and any(0 < s - f <= LATE_WINDOW for f in faults)]
    false_pos = [s for s in detected_steps if s not in fault_set and s not in late]
    detectors: dict[str, int] = {}
    for e in events:
        if int(e["step"]) in fault_set and int(e.get("attempt", 0)) == 0:
            detectors[e["detector"]] = detectors.get(e["detector"], 0) + 1
    return {
        "faults": len(faults),
        "detected": len(fault_set & set(detected_steps)),
        "detected_fault_steps": sorted(fault_set & set(detected_steps)),
        "late": len(late),
        "false_positives": len(false_pos),
        "false_positive_steps": false_pos,
        "detectors": detectors,
    }


def harmful_missed(per_fault: list[dict[str, Any]], detected_fault_steps: Sequence[int]) -> int:
    """Faults harmful in the unguarded run (:func:`assess_harm`'s ``per_fault``) whose
    step the guarded run did not detect: both runs share the fault schedule, keyed by
    rank and step, so a fault is matched by its step."""
    caught = set(detected_fault_steps)
    return sum(p["harm"] not in (None, *NOT_ASSESSED) and p["step"] not in caught for p in per_fault)


# -- the benchmark -----------------------------------------------------------------------


def _share(k: int, n: int) -> float:
    return k / n if n else math.nan


def run(out: pathlib.Path, *, steps: int = 40, rate: float = 0.1, world_size: int = 2,
        bits: Sequence[str | int] | None = None, sites: Sequence[str] = SITES, overhead_steps: int = 200,
        seed: int = 0, device: str = "auto") -> dict[str, Any]:
    targets = parse_bits(bits)
    unknown = [s for s in sites if s not in SITES]
    if unknown:
        raise ValueError(f"sites: must be among {SITES}, got {unknown}")
    if overhead_steps < overhead.BLOCKS:
        raise ValueError(f"overhead_steps: must be >= {overhead.BLOCKS}, got {overhead_steps}")
    runs = plan(out, steps=steps, rate=rate, world_size=world_size, bits=targets, sites=sites, seed=seed,
                device=device)
    console(f"paft bench detection: {len(runs)} runs (gpt {MODEL}; {steps} steps, rate {rate:g}, {world_size} "
            f"ranks; {len(sites)} sites x {len(targets)} bit targets x guard/no guard, + overhead)")
    run_all(runs, world_size)

    ref = runs[0]
    ref_dir = pathlib.Path(ref.config["run_dir"])
    ref_loss = ref.summary["final_val_loss"]
    cells: dict[tuple[str, int | str], dict[str, Any]] = {}
    for r in runs:
        if r.labels.get("kind") != "cell":
            continue
        key = (r.labels["site"], r.labels["bits"])
        cell = cells.setdefault(key, {"site": key[0], "bits": key[1], "spec": r.labels["spec"]})
        s = r.summary
        run_dir = pathlib.Path(r.config["run_dir"])
        gap = (s["final_val_loss"] - ref_loss) / ref_loss * 100 if math.isfinite(s["final_val_loss"]) else math.inf
        if r.labels["guard"]:
            det = assess_detection(run_dir)
            cell.update({
                "faults_guarded": s["faults_injected"], "detected": det["detected"],
                "detected_fault_steps": det["detected_fault_steps"], "late": det["late"],
                "false_positives": det["false_positives"], "false_positive_steps": det["false_positive_steps"],
                "detectors": det["detectors"], "recomputes": s["recomputes"], "skipped": s["skipped_batches"],
                "gap_guard_pct": gap, "replicas_guard": s["replicas_distinct"],
                "detected_share": _share(det["detected"], det["faults"]),
            })
        else:
            harm = assess_harm(run_dir, ref_dir, steps)
            cell.update({
                "faults": s["faults_injected"], "harm_assessed": harm["assessed"], "harmful": harm["harmful"],
                "collapsed": harm["collapsed"], "after_split": harm["after_split"], "harm_by_reason": harm["by_reason"],
                "per_fault": harm["per_fault"],
                "background": harm["background"], "gap_unguarded_pct": gap,
                "replicas_unguarded": s["replicas_distinct"], "end_divergence_unguarded": s["max_replica_rel_diff"],
                "harmful_share": _share(harm["harmful"], harm["assessed"]),
            })
    rows = list(cells.values())
    for c in rows:
        c["harmful_missed"] = harmful_missed(c["per_fault"], c["detected_fault_steps"])

    # Guard overhead without faults (paired steps); its guarded trainer also counts false positives.
    clean_steps = overhead.WARMUP + overhead_steps
    obase = _base(clean_steps, world_size, seed, eval_every=clean_steps, device=device)
    costs = overhead.measure(out / "runs" / "overhead", obase, OVERHEAD_VARIANTS, steps=overhead_steps,
                             world_size=world_size)
    clean_fp = assess_detection(out / "runs" / "overhead" / "guard")["false_positives"]

    md = _markdown(rows, sites, targets, steps=steps, rate=rate, world_size=world_size, ref_loss=ref_loss,
                   costs=costs, overhead_steps=overhead_steps, clean_fp=clean_fp, clean_steps=clean_steps)
    plot = _plot(out, rows, sites, targets)
    results = {
        "steps": steps, "rate": rate, "world_size": world_size, "seed": seed, "model": MODEL,
        "thresholds": {"loss_harm": LOSS_HARM, "div_harm": DIV_HARM, "harm_window": HARM_WINDOW,
                       "late_window": LATE_WINDOW},
        "reference": {"final_val_loss": ref_loss, "steps_per_s": ref.summary["steps_per_s"]},
        "rows": rows,
        "overhead": {"costs": costs, "steps": overhead_steps, "false_positives_fault_free": clean_fp,
                     "fault_free_guarded_steps": clean_steps},
        "runs": [{"name": r.name, **r.labels, **r.summary} for r in runs],
    }
    write_outputs(out, "Guard detection per float32 bit", results, md + f"\n![{plot.stem}]({plot.name})\n")
    console("\n" + md)  # the plot's markdown link is for results.md only
    return results


def _markdown(rows: list[dict[str, Any]], sites: Sequence[str], targets: list[int | str], *, steps: int,
              rate: float, world_size: int, ref_loss: float, costs: dict[str, dict[str, Any]],
              overhead_steps: int, clean_fp: int, clean_steps: int) -> str:
    by_key = {(r["site"], r["bits"]): r for r in rows}
    short = {"aggregation": "agg", "local-grad": "local"}
    header = ["bits"]
    for site in sites:
        p = short.get(site, site)
        header += [f"{p} faults", f"{p} harmful", f"{p} detected", f"{p} FP", f"{p} recomp",
                   f"{p} gap % guard", f"{p} gap % no guard"]
    body = []
    for b in targets:
        line: list[Any] = [bit_label(b)]
        for site in sites:
            c = by_key[(site, b)]
            harmful = f"{c['harmful']}/{c['harm_assessed']}"
            if c["collapsed"]:
                harmful += f" (+{c['collapsed']} after NaN)"
            if c["after_split"]:
                harmful += f" (+{c['after_split']} after a split)"
            fp = str(c["false_positives"]) + (f" (+{c['late']} late)" if c["late"] else "")
            line += [c["faults"], harmful, f"{c['detected']}/{c['faults_guarded']}", fp, c["recomputes"],
                     c["gap_guard_pct"], c["gap_unguarded_pct"]]
        body.append(line)
    table = markdown_table(header, body)

    totals = []
    for site in sites:
        cs = [c for c in rows if c["site"] == site]
        ints = [c for c in cs if isinstance(c["bits"], int)]
        bg = [c["background"] for c in cs]
        fired, assessed = sum(x["fired"] for x in bg), sum(x["assessed"] for x in bg)
        totals.append(
            f"- {site}: over the single-bit rows, {sum(c['harmful'] for c in ints)}/"
            f"{sum(c['harm_assessed'] for c in ints)} faults harmful, {sum(c['detected'] for c in ints)}/"
            f"{sum(c['faults_guarded'] for c in ints)} detected; harmful but missed: "
            f"{_missed(ints)}; false positives in these runs: {sum(c['false_positives'] for c in cs)} "
            f"(+{sum(c['late'] for c in cs)} late); harm test background (fired at fault-free steps of the "
            f"unguarded runs): {fired}/{assessed}."
        )
    orows = [[v, (o["wall"] - 1) * 100, overhead.block_range(o["wall_blocks"]), (o["cpu"] - 1) * 100,
              overhead.block_range(o["cpu_blocks"])] for v, o in costs.items() if v != "plain"]
    otable = markdown_table(["variant", "overhead %", "range over blocks (%)", "CPU overhead %",
                             "range over blocks (%)"], orows)
    note = (
        f"gpt {MODEL}, {world_size} ranks x {PER_RANK_BATCH} sequences, {steps} steps per run, fault rate "
        f"{rate:g} per step on rank 1, one element per fault (`bitflip:site=SITE,rate={rate:g},bits=B,ranks=1,"
        f"count=1`), guard defaults (warm-up 20 accepted steps). Same seed everywhere: every bit target is "
        f"flipped at the same steps and element, so each cell has only the few faults listed. Fault-free "
        f"final val loss {ref_loss:.4f}.\n\n"
        f"- harmful (unguarded run): the faulty update made the model non-finite, or raised the worst "
        f"replica's validation loss (one fixed batch, evaluated after every step) by more than "
        f"{LOSS_HARM * 100:g}% of the fault-free run's within {HARM_WINDOW} steps, or raised the replicas' "
        f"relative divergence by more than {DIV_HARM:g} beyond the previous step's drift; k/n over the faults "
        f"assessed (not assessed: a fault after the model went non-finite, and one right after a fault that "
        f"split the replicas whose own split the drift decides, as that \"drift\" is the other fault's jump).\n"
        f"- detected (guarded run): a guard detection at the fault step; FP: detections at other steps "
        f"(late: within {LATE_WINDOW} steps after a fault); recomp: recomputations; gap %: final val loss vs "
        f"fault-free.\n"
    )
    if not any(c["faults"] for c in rows):
        note += (f"\n**No fault fired**: at rate {rate:g} per step, {steps} steps drew none. The table below "
                 f"holds only zeros; run more --steps or a higher --rate.\n")
    md = (f"{note}\n{table}\n\nTotals:\n\n" + "\n".join(totals) + "\n\n"
          f"Guard overhead without faults (same model; plain DDP, monitor and guard trainers in one worker "
          f"group, {overhead_steps} paired steps each after {overhead.WARMUP} untimed; plain DDP "
          f"{costs['plain']['wall_ms']:.1f} ms per step). The monitor and the guard add a "
          f"fixed cost per step (one control collective, gradient sketch and checksums; the guard also waits for "
          f"the control collective before each update), so on this tiny model the ratio is a worst case; "
          f"`paft bench overhead` measures it on the default workload. False positives in {clean_steps} "
          f"fault-free guarded steps: {clean_fp}.\n\n{otable}\n")
    return md


def _missed(cells: list[dict[str, Any]]) -> str:
    """Bit targets with a fault that was harmful in the unguarded run and missed by the guard."""
    out = [str(c["bits"]) for c in cells if c["harmful_missed"]]
    return ", ".join(out) if out else "none"


_FIELD_COLORS = {"sign": "tab:purple", "exponent": "tab:orange", "mantissa": "tab:gray"}


def _plot(out: pathlib.Path, rows: list[dict[str, Any]], sites: Sequence[str],
          targets: list[int | str]) -> pathlib.Path:
    from matplotlib.figure import Figure

    by_key = {(r["site"], r["bits"]): r for r in rows}
    fig = Figure(figsize=(max(8.0, 0.38 * len(targets) + 2), 3.6 * len(sites)), layout="constrained")
    axes = fig.subplots(len(sites), 1, squeeze=False)
    xs = list(range(len(targets)))
    for ax, site in zip(axes[:, 0], sites):
        cs = [by_key[(site, b)] for b in targets]
        ax.bar([x - 0.2 for x in xs], [c["harmful_share"] for c in cs], width=0.4, color="tab:red",
               label="harmful share (unguarded)")
        ax.bar([x + 0.2 for x in xs], [c["detected_share"] for c in cs], width=0.4, color="tab:blue",
               label="detected share (guard)")
        # Shade the float32 fields behind the single-bit targets.
        for x, b in zip(xs, targets):
            if isinstance(b, int):
                ax.axvspan(x - 0.5, x + 0.5, color=_FIELD_COLORS[_float32_field(b)], alpha=0.08, lw=0)
        ax.set_xticks(xs, [str(b) for b in targets], rotation=90, fontsize=8)
        ax.set(title=f"site {site}, per bit target: harmful share of the assessed faults, detected share of "
                     f"the injected ones "
                     f"(shaded: mantissa grey, exponent orange, sign purple)",
               ylabel="share", ylim=(0, 1.25))
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8, loc="upper right", ncol=2)
    path = out / "detection.png"
    fig.savefig(path, dpi=90)
    return path
