"""Plots and a text summary of one run directory (``paft report``).

Reads the run directory through :func:`paft.rundata.load_run`. A missing file means
nothing to show for that layer: a fault-free, unprotected run still gets its loss, dispersion and cosine plots;
a run that is still going or crashed (no ``summary.json``) is reported from the jsonl
files, with a note saying so. Usage::

    paft report runs/<dir>

writes ``runs/<dir>/report/{loss,dispersion,cosine,divergence}.png`` and ``report.md``
and prints the text summary. From Python: ``build_report("runs/<dir>")``.

The plots use matplotlib's Agg canvas directly (no pyplot, no global backend switch),
so reports can be built on headless machines and inside other programs.
"""

from __future__ import annotations

import io
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from paft.records import UNTIMED_STEPS, atomic_write_bytes, is_file, max_or_nan, output_dir_problem
from paft.replicas import outside_majority
from paft.resync import averages_at
from paft.rundata import ReportError, RunData, load_run

__all__ = ["Report", "build_report", "summary_text"]

_PLOTS = ("loss.png", "dispersion.png", "cosine.png", "divergence.png")
REPORT_MARKER = ".paft-report"  # marks a folder paft report wrote, which it may write into again
_TITLE = "# paft report: "
# The tab10 colours (C0-C9) are the ranks'; what is not a rank is drawn in others. Each
# guard action has its own height, so a step's recompute and its later skip both show.
_GUARD_MARKERS = {"recompute": ("X", "magenta", 0.95), "skip": ("s", "darkgoldenrod", 0.91),
                  "stop": ("*", "black", 0.99)}
_SYNC_COLOR = "teal"
_NONFINITE_LABEL = "non-finite value (color: series)"
_DISPERSION = [
    ("consistency/loss_std", "local-loss std over ranks", "std"),
    ("consistency/loss_cv", "local-loss coefficient of variation", "std / |mean|"),
    ("consistency/gnorm_std", "local grad-norm std over ranks", "std"),
    ("consistency/gnorm_cv", "local grad-norm coefficient of variation", "std / mean"),
]


@dataclass
class Report:
    """What :func:`build_report` wrote (PNGs, then ``report.md``) and the text summary."""

    files: list[Path]
    text: str


# -- plotting helpers -------------------------------------------------------------------


def _rank_color(rank: int) -> str:
    return f"C{rank % 10}"


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    rows = [(int(r["step"]), _num(r[key])) for r in records if key in r]
    return [s for s, _ in rows], [v for _, v in rows]


def _lone(values: Sequence[float], kw: dict[str, Any]) -> dict[str, Any]:
    """``kw`` with a marker on each lone point: a finite value with no finite neighbour,
    which no line reaches (a one-step run; a measurement between unmeasured steps, or
    beside a non-finite one). Else such a value is in the legend and nowhere else."""
    lone = [i for i, v in enumerate(values) if math.isfinite(v)
            and not any(0 <= j < len(values) and math.isfinite(values[j]) for j in (i - 1, i + 1))]
    if lone and "marker" not in kw:
        return {**kw, "marker": "o", "ms": 4, "markevery": lone}
    return kw


def _gapped(steps: Sequence[int], values: Sequence[float]) -> tuple[list[int], list[float]]:
    """The series with NaN for its non-finite values and at the first step of each gap
    between two measurements: matplotlib breaks a line at a NaN, so no line claims a
    value for steps where nothing was measured (``--monitor-interval``, the records
    between metric steps, a sparse record)."""
    xs: list[int] = []
    ys: list[float] = []
    for step, value in zip(steps, values):
        if xs and step > xs[-1] + 1:
            xs.append(xs[-1] + 1)
            ys.append(math.nan)
        xs.append(step)
        ys.append(value if math.isfinite(value) else math.nan)
    return xs, ys


def _plot(ax: Axes, steps: Sequence[int], values: Sequence[float], **kw: Any) -> None:
    """A line of the finite values, broken where a step was not measured, a marker on a
    lone point; non-finite values as markers on the top edge."""
    xs, ys = _gapped(steps, values)
    ax.plot(xs, ys, **_lone(ys, kw))
    bad = [s for s, v in zip(steps, values) if not math.isfinite(v)]
    if bad:
        # Each series its own row, so that which rank went non-finite first shows.
        row = sum(1 for line in ax.get_lines() if line.get_gid() == "nonfinite")
        ax.plot(bad, [max(0.88 - 0.04 * row, 0.5)] * len(bad), ls="", marker="$!$", ms=10,
                color=kw.get("color", "black"), transform=ax.get_xaxis_transform(), gid="nonfinite",
                label="_nolegend_")
        if _NONFINITE_LABEL not in ax.get_legend_handles_labels()[1]:
            ax.plot([], [], ls="", marker="$!$", ms=10, color="0.3", label=_NONFINITE_LABEL)


def _scale(ax: Axes, values: Sequence[float]) -> None:
    """Log scale when the positive values span two decades or more (symlog if zeros too)."""
    finite = [v for v in values if math.isfinite(v)]
    positive = [v for v in finite if v > 0]
    if len(positive) < 2 or max(positive) / min(positive) < 100:
        return
    if len(positive) == len(finite):
        ax.set_yscale("log")
    else:
        ax.set_yscale("symlog", linthresh=min(positive))


def _figure(rows: int, cols: int, title: str) -> tuple[Figure, list[Axes]]:
    fig = Figure(figsize=(6.5 * cols + 3.0, 1.0 + 3.0 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.subplots(rows, cols, sharex=True, squeeze=False)
    fig.suptitle(title)
    return fig, [ax for row in grid for ax in row]


def _mark_events(ax: Axes, run: RunData) -> None:
    """Faults as vertical lines colored by rank; syncs (bottom) and guard actions (top) as markers."""
    labelled: set[str] = set()

    def label(text: str) -> str:
        if text in labelled:
            return "_nolegend_"
        labelled.add(text)
        return text

    for step, rank in sorted({(int(f["step"]), int(f["rank"])) for f in run.faults if "step" in f and "rank" in f}):
        ax.axvline(step, color=_rank_color(rank), ls="--", lw=1.0, alpha=0.8, label=label(f"fault on rank {rank}"))
    for sync in _syncs(run):
        noop = sync.get("mode") == "noop"
        ax.plot([sync["step"]], [0.03], ls="", marker="^", ms=7, color=_SYNC_COLOR,
                mfc="none" if noop else _SYNC_COLOR, transform=ax.get_xaxis_transform(), clip_on=False,
                label=label("sync (no-op)" if noop else "sync (repair)"))
    for guard in run.events_of("guard"):
        action = str(guard.get("action", "?"))
        if action == "proceed":
            continue  # the verdict after a successful recompute: nothing was done
        marker, color, height = _GUARD_MARKERS.get(action, ("P", "dimgray", 0.93))
        ax.plot([guard["step"]], [height], ls="", marker=marker, ms=8, color=color,
                transform=ax.get_xaxis_transform(), clip_on=False, label=label(f"guard: {action}"))


def _syncs(run: RunData) -> list[dict[str, Any]]:
    """PAFT-Sync's syncs and the guard's repairs (a robust sync of its own), in file order."""
    return [e for e in run.events if e.get("event") in ("sync", "repair")]


def _finish(ax: Axes, run: RunData, title: str, ylabel: str) -> None:
    _mark_events(ax, run)
    ax.set_title(title)
    spec = ax.get_subplotspec()
    if spec is None or spec.is_last_row():  # shared x axis: label it once, at the bottom
        ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    lo, hi = ax.get_xlim()  # the whole run, also where a panel's record is sparse (one point: ±0.04)
    ax.set_xlim(min(lo, 0), max(hi, run.last_step + 1))
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")


def _png(fig: Figure) -> bytes:
    data = io.BytesIO()
    fig.savefig(data, format="png", dpi=110)
    return data.getvalue()


def _save(data: bytes, path: Path) -> Path:
    """Write ``data`` to ``path`` whole or not at all (an interrupted report leaves the
    earlier one's plot, never half a PNG)."""
    atomic_write_bytes(path, data)
    return path


# -- the four plots ----------------------------------------------------------------------


def _global_loss(run: RunData) -> tuple[list[int], list[float]]:
    """Per step, the mean of the ranks' local losses, from every rank's metrics: they
    have every step, where consistency.jsonl may have only every --monitor-interval-th
    (and has nothing without the monitor)."""
    by_step: dict[int, list[float]] = defaultdict(list)
    for records in run.metrics.values():
        for r in records:
            if "local_loss" in r:
                by_step[int(r["step"])].append(_num(r["local_loss"]))
    steps = [s for s in sorted(by_step) if len(by_step[s]) == len(run.metrics)]
    return steps, [math.fsum(by_step[s]) / len(run.metrics) for s in steps]


def _visible_spread(values: list[float]) -> bool:
    """Whether the ranks' values differ by more than a plot can hide (1e-3 relative;
    replicas apart by rounding, 1e-7, drew four markers inside the mean's)."""
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < len(values):
        return 0 < len(finite) or len({str(v) for v in values}) > 1
    return bool(finite) and max(finite) - min(finite) > 1e-3 * max(abs(v) for v in finite)


def _plot_loss(run: RunData) -> bytes:
    fig, (ax,) = _figure(1, 1, f"Loss: {run.name}")
    everything: list[float] = []
    for rank, records in run.metrics.items():
        steps, values = _series(records, "local_loss")
        _plot(ax, steps, values, color=_rank_color(rank), lw=0.7, alpha=0.7, label=f"rank {rank} local loss")
        everything += values
    steps, values = _global_loss(run)
    _plot(ax, steps, values, color="black", lw=1.8, label="global loss (mean of ranks)")
    everything += values
    steps, values = _series(run.evals, "val_loss")
    if steps:
        _plot(ax, steps, values, color="black", ls="", marker="o", ms=7, mfc="white", label="validation loss (mean)")
        everything += values
        per_rank = [r["val_loss_per_rank"] for r in run.evals if isinstance(r.get("val_loss_per_rank"), list)]
        if any(_visible_spread([_num(v) for v in row]) for row in per_rank):
            for rank in range(max(len(row) for row in per_rank)):
                rows = [(r["step"], _num(r["val_loss_per_rank"][rank])) for r in run.evals
                        if len(r.get("val_loss_per_rank", [])) > rank]
                _plot(ax, [s for s, _ in rows], [v for _, v in rows], color=_rank_color(rank), ls="",
                      marker="D", ms=4, label=f"rank {rank} validation loss")
                everything += [v for _, v in rows]
    _scale(ax, everything)
    _finish(ax, run, "global and per-rank local loss", "loss")
    return _png(fig)


def _plot_dispersion(run: RunData) -> bytes:
    fig, axes = _figure(2, 2, f"Worker dispersion: {run.name}")
    for ax, (key, title, ylabel) in zip(axes, _DISPERSION):
        steps, values = _series(run.consistency, key)
        _plot(ax, steps, values, color="black", lw=1.2, label=key)
        _scale(ax, values)
        _finish(ax, run, title, ylabel)
    return _png(fig)


def _plot_cosine(run: RunData) -> bytes:
    fig, (pairs, to_mean) = _figure(2, 1, f"Gradient cosine similarity between workers: {run.name}")
    # Drawn wide then thin: with two ranks there is one pair, and min == mean.
    for key, color, width in (("consistency/grad_cos_mean", "0.6", 3.0), ("consistency/grad_cos_min", "black", 1.2)):
        steps, values = _series(run.consistency, key)
        _plot(pairs, steps, values, color=color, lw=width, label=key.split("/")[1])
    _finish(pairs, run, "pairwise cosine of local gradients", "cosine")
    rows = [(r["step"], r["consistency/cos_to_mean"]) for r in run.consistency
            if isinstance(r.get("consistency/cos_to_mean"), list)]
    for rank in range(max((len(v) for _, v in rows), default=0)):
        kept = [(s, _num(v[rank])) for s, v in rows if len(v) > rank]
        _plot(to_mean, [s for s, _ in kept], [v for _, v in kept], color=_rank_color(rank), lw=0.9,
              label=f"rank {rank}")
    _finish(to_mean, run, "cosine of each rank's local gradient to the mean gradient", "cosine")
    return _png(fig)


def _state_distinct(run: RunData) -> tuple[list[int], list[float]]:
    """The distinct training states: each fingerprint's count, and 1 from the first step
    whose fingerprints see a sync or repair (it leaves the replicas identical: the
    event's ``seen_from``; a sync recorded without it ran after its step's fingerprints)
    until the next fingerprint says otherwise. Without the syncs the line held a
    repaired split until the next check."""
    steps, values = _series(run.consistency, "replicas/state_distinct")
    # An applied update from split aggregated gradients splits the state from the next step
    # on (a skipped one has no grad record); a sync or repair after it joins it again.
    split = [(s + 1, v) for s, v in zip(*_series(run.consistency, "replicas/grad_distinct")) if v > 1]
    found = [(int(e["step"]), float(len(e["groups"]))) for e in _split_syncs(run)]  # the split a sync saw
    # Every sync's end, also without a state fingerprint (--fingerprint-every 0): the
    # split it found is drawn, and so must be the end it put to it. An overlapped sync
    # that landed within a step (seen_from two steps after its own) came before that
    # step's update, whose split gradients split the state again: the split has the last word.
    synced = [(int(e.get("seen_from", int(e["step"]) + 1)), 1.0, int(e["step"])) for e in _syncs(run)]
    landed_before = [(f, v) for f, v, step in synced if f >= step + 2]
    landed_after = [(f, v) for f, v, step in synced if f < step + 2]
    end = [(run.last_step + 1, float(run.summary["replicas_distinct"]))] if run.summary and isinstance(
        run.summary.get("replicas_distinct"), int) else []
    # At one step the later kind has the last word (a fingerprint the last).
    last = dict([*landed_before, *split, *found, *landed_after, *zip(steps, values), *end])
    return sorted(last), [last[s] for s in sorted(last)]


def _fingerprinted(run: RunData) -> bool:
    """Whether the run fingerprinted the training state (not with --fingerprint-every 0,
    but for the guard's own checks)."""
    return any("replicas/state_distinct" in r for r in run.consistency)


def _replica_panel(ax: Axes, run: RunData) -> None:
    # Drawn wide then thin and dashed: where both are 1 neither hides the other.
    # Without fingerprints the state's line is what the syncs and the aggregated
    # gradients' checksums say of it, and its label says so.
    state = "training state" if _fingerprinted(run) else "training state (not fingerprinted: syncs, checksums)"
    for key, style, label in (("replicas/state_distinct", {"color": "0.55", "lw": 3.0}, state),
                              ("replicas/grad_distinct", {"color": "black", "lw": 1.2, "ls": "--"},
                               "aggregated gradients")):
        steps, values = _state_distinct(run) if key == "replicas/state_distinct" else _series(run.consistency, key)
        if steps:
            ax.step(steps, values, where="post", **_lone(values, style), label=f"distinct {label}")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, max(2, run.world_size) + 0.5)
    split = _first_split(run)
    if split is not None:
        who = _ranks(split[1]) if split[1] else "no majority"  # not "rank ?"
        caught = {"guard": " (caught by the guard)", "sync": " (found by a sync)"}.get(split[3], "")
        late = split[0] > 0.6 * max(run.last_step, 1)  # written leftwards, clear of the legend
        ax.annotate(f"first split: step {split[0]}, {who}{caught}", xy=(split[0], 1),
                    xytext=(-8 if late else 8, 20), ha="right" if late else "left", textcoords="offset points",
                    arrowprops={"arrowstyle": "->"})
    _finish(ax, run, "distinct replicas (fingerprint groups)", "replicas")


def _eval_divergence(run: RunData) -> tuple[list[int], list[float]]:
    """Measured at every evaluation (max over ranks); empty when it never left 0."""
    steps, values = _series(run.evals, "replica_rel_diff")
    return (steps, values) if any(v != 0 for v in values) else ([], [])


def _divergence_panel(ax: Axes, run: RunData) -> None:
    # Both kinds are measurements at single steps, drawn as points: a line between two of
    # them would claim values for the steps between (it rose before the fault, and ran
    # across the syncs that found identical replicas).
    steps, values = _eval_divergence(run)
    if steps:
        # Hollow and larger: a sync's point at an evaluation's step shows inside it.
        _plot(ax, steps, values, color="black", ls="", marker="o", ms=8, mfc="none", label="at evaluations")
    # Syncs that found identical replicas (divergence 0) show only as the hollow triangles.
    syncs = [(int(e["step"]), _num(e.get("divergence"))) for e in _syncs(run)]
    pos = [(s, v) for s, v in syncs if math.isfinite(v) and v > 0]
    if pos:
        ax.plot([s for s, _ in pos], [v for _, v in pos], ls="", marker="o", ms=5, color=_SYNC_COLOR,
                label="before a sync that found replicas apart")
    bad = [s for s, v in syncs if not math.isfinite(v)]
    if bad:
        ax.plot(bad, [0.88] * len(bad), ls="", marker="$!$", ms=10, color="red",
                transform=ax.get_xaxis_transform(), label="non-finite replica at a sync")
    _scale(ax, [*values, *(v for _, v in pos)])
    if ax.get_yscale() == "linear":  # a distance: nothing below 0 (an all-zero panel showed -0.05)
        ax.set_ylim(bottom=0)
    if not steps and not pos and not bad:
        ax.text(0.5, 0.5, "every sync found identical replicas", transform=ax.transAxes, ha="center", color="0.4")
    _finish(ax, run, "relative L2 distance of the replicas to their mean (max over ranks)", "divergence")


def _period_panel(ax: Axes, run: RunData, periods: list[tuple[int, float]]) -> None:
    protect = run.config.get("protect") or {}
    start = protect.get("sync_period")
    if isinstance(start, int) and not isinstance(start, bool) and periods[0][0] > 0:  # the period it began with
        if protect.get("mode") == "dyn":  # clamped into [h_min, h_max], as the protector starts it
            lo, hi = protect.get("h_min"), protect.get("h_max")
            start = min(max(start, lo), hi) if isinstance(lo, int) and isinstance(hi, int) else start
        periods = [(0, float(start)), *periods]
    if periods[-1][0] < run.last_step:  # hold the last period to the end of the run
        periods = [*periods, (run.last_step, periods[-1][1])]
    ax.step([s for s, _ in periods], [p for _, p in periods], where="post", color="black", lw=1.5,
            label="sync period H")
    _scale(ax, [p for _, p in periods])
    if ax.get_yscale() == "linear":
        ax.set_ylim(bottom=0, top=1.15 * max(p for _, p in periods))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    adapts = " (PAFT-Dyn adapts it)" if protect.get("mode") == "dyn" else ""
    _finish(ax, run, f"PAFT sync period H{adapts}", "period (steps)")


def _periods(run: RunData) -> list[tuple[int, float]]:
    """(step, sync period) of every event that set one (a guard's repair under PAFT-Dyn
    does). Sorted by step only: within a
    step the file's order holds (a trigger's period, then the sync's answer to it,
    which is the period in force from that step on)."""
    return sorted(((int(e["step"]), _num(e["period"])) for e in run.events
                   if e.get("event") in ("sync", "repair", "dyn_trigger") and "period" in e),
                  key=lambda p: p[0])


def _plot_divergence(run: RunData) -> bytes | None:
    periods = _periods(run)
    panels = [name for name, on in (("replicas", any("replicas/grad_distinct" in r for r in run.consistency)),
                                    ("divergence", bool(_syncs(run) or _eval_divergence(run)[0])),
                                    ("period", bool(periods))) if on]
    if not panels:
        return None
    fig, axes = _figure(len(panels), 1, f"Replica divergence: {run.name}")
    for ax, name in zip(axes, panels):
        if name == "replicas":
            _replica_panel(ax, run)
        elif name == "divergence":
            _divergence_panel(ax, run)
        else:
            _period_panel(ax, run, periods)
    return _png(fig)


# -- the text summary --------------------------------------------------------------------


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 1`` / ``ranks 1, 3``."""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(str(r) for r in ranks) if ranks else '?'}"


# What differed, as the split line names it: the per-step checksum of the aggregated
# gradient, or the fingerprint of the parameters, buffers and optimizer state.
_MISMATCH = {"grad_mismatch": "aggregated-gradient checksums", "state_mismatch": "training-state fingerprints"}


def _split_in(rec: dict[str, Any]) -> tuple[list[int], list[str]] | None:
    """(ranks outside the largest group, what differed) if the record shows a split."""
    ranks: set[int] = set()
    what: list[str] = []
    for kind, name in (("grad", _MISMATCH["grad_mismatch"]), ("state", _MISMATCH["state_mismatch"])):
        if _num(rec.get(f"replicas/{kind}_distinct", 1)) > 1:
            what.append(name)
            ranks.update(int(r) for r in rec.get(f"replicas/{kind}_minority_ranks", []))
    return (sorted(ranks), what) if what else None


def _first_split(run: RunData) -> tuple[int, list[int], list[str], str] | None:
    """(step, ranks outside the largest group, what differed, who found it) of the first
    split: a split record (found ``""``: by the step's own checks), a mismatch the guard
    undid (by a recompute or a repair) before the step's record (``"guard"``), or a
    split a sync found and ended before any fingerprint saw it (``"sync"``)."""
    found = [(int(r["step"]), *split, "") for r in run.consistency if (split := _split_in(r))][:1]
    caught = [g for g in run.events_of("guard") if g.get("detector") in _MISMATCH]
    if caught:
        step = int(caught[0]["step"])
        same_step = [g for g in caught if int(g["step"]) == step]
        what = sorted({_MISMATCH[g["detector"]] for g in same_step})
        found.append((step, sorted({int(r) for g in same_step for r in g.get("ranks") or []}), what, "guard"))
    found += [(int(e["step"]), outside_majority(e["groups"], run.world_size), [_MISMATCH["state_mismatch"]], "sync")
              for e in _split_syncs(run)[:1]]
    return min(found, key=lambda f: f[0]) if found else None  # at one step the first kind listed


def _split_syncs(run: RunData) -> list[dict[str, Any]]:
    """The syncs and repairs whose fingerprints found the parameters or optimizer state
    split (not only the buffers, which differ under DDP's BatchNorm as a rule)."""
    return [e for e in _syncs(run) if len(e.get("groups") or []) > 1
            and not str(e.get("note", "")).startswith("buffers only")]


def _last_state_check(run: RunData) -> str:
    """What the last record with state fingerprints says (else the last gradient check):
    the state's split shows only at a fingerprint step, and outlives the steps between."""
    checked = [r for r in run.consistency if "replicas/state_distinct" in r]
    if checked:
        rec = checked[-1]
        ranks = rec.get("replicas/state_minority_ranks") or []
        differ = f"; minority: {_ranks(ranks)}" if ranks else ""
        n = rec["replicas/state_distinct"]
        # An aggregated gradient that differed after the check split the replicas since:
        # the check's own step's too, whose update follows the fingerprints of the state
        # it starts from.
        later = [r["step"] for r in run.consistency
                 if r["step"] >= rec["step"] and _num(r.get("replicas/grad_distinct", 1)) > 1]
        since = f"; aggregated gradients differed after it, first at step {later[0]}" if later else ""
        return f"replicas distinct at the last state check (step {rec['step']}): {n}{differ}{since}"
    rec = run.consistency[-1]
    return (f"distinct aggregated gradients at the last recorded step ({rec['step']}): "
            f"{rec.get('replicas/grad_distinct', '?')} (no state fingerprint recorded)")


def _extreme(run: RunData, key: str, pick_max: bool) -> str:
    steps, values = _series(run.consistency, key)
    if not steps:
        return "not recorded"
    bad = [(s, v) for s, v in zip(steps, values) if not math.isfinite(v)]
    if bad:
        return f"{bad[0][1]} at step {bad[0][0]} (non-finite at {len(bad)} step{'s' if len(bad) > 1 else ''})"
    # The first step holding the extreme, for a max as for a min.
    value, step = max(zip(values, steps), key=lambda p: (p[0], -p[1])) if pick_max else min(zip(values, steps))
    return f"{value:.4g} at step {step}"


def _counts(records: list[dict[str, Any]], key: str, prefix: str = "") -> str:
    counts = Counter(r.get(key, "?") for r in records)
    # Ranks in their order (rank 2 before rank 10), other values by their text.
    order = sorted(counts, key=lambda k: (not isinstance(k, int), k if isinstance(k, int) else 0, str(k)))
    return ", ".join(f"{prefix}{k} ({counts[k]})" for k in order)


def summary_text(run: RunData, files: Sequence[Path] = ()) -> str:
    """The plain-text summary of a run (what ``paft report`` prints); ``files``: what the
    report writes, listed on its last line."""
    lines = [f"paft report: {run.path}", *_notes(run), *_header(run), *_losses(run), _speed(run),
             *_replicas(run), *_unfingerprinted(run), *_faults(run), _first_split_line(run),
             *_differing_tensors(run), _counters(run),
             *_metric_extremes(run),
             _alerts(run)]
    if files:
        folder = Path(files[0]).parent
        lines.append(f"report in {folder}: {', '.join(Path(f).name for f in files)}")
    return "\n".join(lines) + "\n"


def _notes(run: RunData) -> list[str]:
    """Why the run ended early, or why its summary is missing or behind its records."""
    cfg, last = run.config, run.last_step + 1
    lines = []
    # paft train records a guard stop twice: the guard's verdict, and the trainer's "stop"
    # event with its reason; a library user's run has the verdict only. One note either way.
    stops = run.events_of("stop") or [g for g in run.events_of("guard") if g.get("action") == "stop"]
    for stop in stops:
        reason = stop.get("reason") or f"a persistent fault on {_ranks(stop.get('ranks') or [])}"
        reason = reason.removeprefix(f"step {stop.get('step')}: ")  # said once, before it
        lines.append(f"note: the guard stopped the run at step {stop.get('step')} (--on-persistent stop): {reason}")
    if run.stale_summary is not None:
        went = "go on to" if last > run.stale_summary else "stop at"  # stop: resumed from an earlier checkpoint
        lines.append(f"note: summary.json ends at step {run.stale_summary} but the records {went} step "
                     f"{last} (a resume still running or interrupted): reported from the jsonl files "
                     f"({last} of {cfg.get('steps', '?')} steps recorded)")
    elif not stops and run.summary is None:
        lines.append(f"note: no summary.json: the run is still running, crashed or was interrupted; reported "
                     f"from the jsonl files ({last} of {cfg.get('steps', '?')} steps recorded)")
    missing = [r for r in range(run.world_size) if r not in run.metrics]
    if missing:
        files = ", ".join(f"metrics/rank{r}.jsonl" for r in missing)
        lines.append(f"note: no complete record in {files} (missing or empty): the loss plot lacks "
                     f"{_ranks(missing)}, and its global loss is the mean over the ranks recorded")
    return lines


def _header(run: RunData) -> list[str]:
    s, cfg = run.summary or {}, run.config
    protect = s.get("protect", (cfg.get("protect") or {}).get("mode", "none"))
    guard = s.get("guard", (cfg.get("guard") or {}).get("enabled", False))
    return [
        f"workload: {s.get('workload', cfg.get('workload', '?'))}   world size: {run.world_size}   "
        f"steps: {s.get('steps', run.last_step + 1)} of {cfg.get('steps', '?')}",
        f"protection: {protect}   guard: {'on' if guard else 'off'}   "
        f"injected: {'; '.join(cfg.get('inject') or []) or 'none'}",
    ]


def _losses(run: RunData) -> list[str]:
    """First and last evaluation (the worst rank's loss where it differs visibly)."""
    s = run.summary or {}
    first, final = (run.evals[0], run.evals[-1]) if run.evals else ({}, {})
    lines = []
    for key, name in (("val_loss", "val loss"), ("val_acc", "val acc")):
        a, b = s.get(f"initial_{key}", first.get(key)), s.get(f"final_{key}", final.get(key))
        if a is not None and b is not None:
            per_rank = [_num(v) for v in final.get(f"{key}_per_rank", [])]
            worst = max_or_nan(per_rank) if per_rank else _num(b)
            shown = f"{worst:.4f}" != f"{_num(b):.4f}"  # a difference the line can show
            spread = f", worst rank {worst:.4f}" if key == "val_loss" and shown else ""
            lines.append(f"{name}: {_num(a):.4f} (step {first.get('step', 0)}) -> {_num(b):.4f} "
                         f"(step {final.get('step', run.last_step + 1)}{spread})")
    return lines


def _speed(run: RunData) -> str:
    s = run.summary or {}
    if "steps_per_s" in s:
        return f"speed: {s['steps_per_s']:.2f} steps/s ({_num(s.get('wall_s')):.2f} s in training steps)"
    # As the trainer times it (Trainer.step_rate): over the timed steps, which leave out
    # the first few of every leg (much slower), else over every step; the records say
    # which (those written before they did: the first leg's rule).
    rank, records = next(iter(run.metrics.items()))
    times = [(_num(r.get("step_time")), r.get("timed", r["step"] >= UNTIMED_STEPS)) for r in records]
    wall = sum(t for t, _ in times if math.isfinite(t))
    timed = [t for t, on in times if on is True and math.isfinite(t)]
    steps, seconds = (len(timed), sum(timed)) if timed else (len(times), wall)
    return (f"speed: {steps / seconds:.2f} steps/s ({wall:.2f} s in training steps; rank {rank}'s step times)"
            if seconds > 0 else "speed: ?")


def _replicas(run: RunData) -> list[str]:
    """How many distinct replicas the run ended with, and whether they are finite: the
    divergence measured at an evaluation is inf exactly when a replica's parameters hold
    NaN/Inf (see DivergenceReport), which bitwise identical replicas can share."""
    s = run.summary or {}
    if "replicas_distinct" in s:
        diff = _num(s.get("max_replica_rel_diff"))
        # One group, yet infinitely apart: every replica holds the same NaN/Inf.
        bad = ": identical but non-finite, every replica holds NaN/Inf in its parameters" if (
            s["replicas_distinct"] == 1 and math.isinf(diff)) else ""
        return [f"replicas distinct at the end: {s['replicas_distinct']} (groups {s.get('replica_groups', '?')}, "
                f"max relative difference {diff:.3g}){bad}"]
    last = run.evals[-1] if run.evals else {}
    bad = (f"; the last evaluation (step {last['step']}) found NaN/Inf in a replica's parameters"
           if math.isinf(_num(last.get("replica_rel_diff"))) else "")
    return [_last_state_check(run) + bad] if run.consistency else []


def _unfingerprinted(run: RunData, shown: int = 5) -> list[str]:
    """With --fingerprint-every 0 no state fingerprint says whether the replicas' state
    split: what the syncs and repairs found of it (they compare it whole), where any ran."""
    if (run.config.get("monitor") or {}).get("fingerprint_every") != 0 or not run.consistency:
        return []
    checked = [r["step"] for r in run.consistency if "replicas/state_distinct" in r]
    only = f", but at the guard's state checks (step{_plural(checked)} {_listed(checked, shown)})" if checked else ""
    apart = _split_syncs(run)
    same = [int(e["step"]) for e in _syncs(run) if e not in apart]
    found = []
    if same:
        found.append(f"identical at step{_plural(same)} {_listed(same, shown)}")
    if apart:
        found.append("apart at " + _listed([f"step {e['step']} (groups {e['groups']})" for e in apart], shown))
    said = (f"the syncs found it {' and '.join(found)}" if found else
            "no sync compared it: a split shows only through the aggregated-gradient checksums")
    return [f"training state: not fingerprinted while training (--fingerprint-every 0){only}; {said}"]


def _plural(items: Sequence[Any]) -> str:
    return "s" if len(items) > 1 else ""


def _listed(items: Sequence[Any], shown: int, total: int | None = None) -> str:
    """``4, 8, 12`` / ``4, 8 and 3 more``: the first ``shown`` of ``items``, and how many
    of ``total`` (default: all of ``items``) they leave out."""
    listed = items[:shown]
    more = (len(items) if total is None else total) - len(listed)
    return ", ".join(str(s) for s in listed) + (f" and {more} more" if more > 0 else "")


def _faults(run: RunData) -> list[str]:
    lines = [f"faults injected: {int((run.summary or {}).get('faults_injected', len(run.faults)))}"]
    if run.faults:
        lines.append(f"  by site: {_counts(run.faults, 'site')}")
        lines.append(f"  by kind: {_counts(run.faults, 'kind')}")
        lines.append(f"  by rank: {_counts(run.faults, 'rank', 'rank ')}")
        f0 = min(run.faults, key=lambda f: f.get("step", 0))
        lines.append(f"  first: step {f0.get('step')}, rank {f0.get('rank')}, {f0.get('site')}/{f0.get('kind')}")
    return lines


def _first_split_line(run: RunData) -> str:
    split = _first_split(run)
    if split is not None:
        step, ranks, what, by = split
        # No ranks named: the guard found no strict majority to tell the odd ones out.
        tie = "; no strict majority" if not ranks or 2 * len(ranks) >= run.world_size else ""
        undone = {"guard": "; the guard caught it before the update",
                  "sync": "; found and repaired by the sync at this step, no fingerprint saw it before"}.get(by, "")
        where = f" on {_ranks(ranks)}" if ranks else ""
        return f"first replica split: step {step}{where} ({' and '.join(what)} differ{tie}{undone})"
    if any("replicas/grad_distinct" in r for r in run.consistency):
        return "first replica split: none (replicas identical at every recorded step)"
    return "first replica split: not recorded (no fingerprints in consistency.jsonl)"


def _differing_tensors(run: RunData, shown: int = 4) -> list[str]:
    """The tensors the replicas first differed in, where a record names them: the first
    sync or repair that found the parameters or optimizer state split (the syncs
    exchange per-tensor digests), or, earlier, the monitor's first state-split alert
    (the tensors farthest apart, measured after that step's update)."""
    found: list[tuple[int, int, str]] = []  # (step, the sync's exact names first, the line)
    for e in _split_syncs(run):
        named: dict[str, list[list[int]]] = e.get("differing") or {}
        if not named:
            continue
        parts = []
        for name, groups in list(named.items())[:shown]:
            odd = outside_majority(groups, run.world_size)
            parts.append(f"{name} on {_ranks(odd)}" if odd else f"{name} (no strict majority: {groups})")
        listed = _listed(parts, shown, total=int(e.get("differing_tensors", len(named))))
        found.append((int(e["step"]), 0, f"as the {e['event']} at step {e['step']} found them: {listed}"))
        break
    for a in run.events_of("alert"):
        moved = (a.get("divergence") or {}).get("tensors") if a.get("detector") == "state_split" else None
        if moved:
            parts = [f"{name} on {_ranks([int(rank)])} (relative distance {_num(rel):.3g} to the mean)"
                     for name, rel, rank in moved[:shown]]
            found.append((int(a["step"]), 1, f"farthest apart at the state-split alert of step {a['step']}: "
                                             f"{', '.join(parts)}"))
            break
    return [f"  tensors that differed, {min(found)[2]}"] if found else []


def _counters(run: RunData) -> str:
    """Syncs and the guard's counts: the summary's, else the guard's own counts, which
    each of its events carries; a run recorded before they did is counted from the
    events (an incident's first attempt that made the guard act is one detection; a
    repair is followed by a recompute)."""
    s = run.summary or {}
    guards = run.events_of("guard")
    totals = next((g["totals"] for g in reversed(guards) if isinstance(g.get("totals"), dict)), None) or {
        "detections": len({g.get("step") for g in guards if g.get("action") != "proceed" and not g.get("attempt")}),
        "recomputes": sum(1 for g in guards if g.get("action") in ("recompute", "repair")),
        "skipped_batches": sum(1 for g in guards if g.get("action") == "skip"),
    }
    counts = {
        "syncs": s.get("syncs", _recorded_syncs(run)),
        "detections": s.get("detections", totals.get("detections", 0)),
        "recomputes": s.get("recomputes", totals.get("recomputes", 0)),
        "skipped batches": s.get("skipped_batches", totals.get("skipped_batches", 0)),
    }
    return "   ".join(f"{k}: {v}" for k, v in counts.items())


def _recorded_syncs(run: RunData) -> int:
    """The syncs and repairs of a run without a summary. events.jsonl holds each of
    PAFT-Sync's and the guard's, but none of PyTorch's averager: its averages are
    counted from the recorded steps (a step one rank recorded had its averaging
    all-reduce done), at the steps :func:`paft.resync.averages_at` says it averages."""
    protect = run.config.get("protect") or {}
    period = protect.get("sync_period")
    averaged = 0
    if protect.get("mode") == "averager" and isinstance(period, int) and not isinstance(period, bool) and period > 0:
        averaged = sum(1 for step in range(run.last_step + 1) if averages_at(step, period))
    return len(_syncs(run)) + averaged


def _metric_extremes(run: RunData) -> list[str]:
    """The largest loss CV and smallest cosine, or why they are missing (one reason for both)."""
    if (run.config.get("monitor") or {}).get("interval") == 0:
        why = "worker metrics off: --monitor-interval 0"
    elif run.consistency:
        why = "a cosine needs 2 ranks" if run.world_size < 2 else "cosine monitoring off"
    elif (run.path / "consistency.jsonl").is_file():
        why = "consistency.jsonl holds no complete record"
    else:
        why = "no consistency.jsonl: monitoring off"
    loss_cv = _extreme(run, "consistency/loss_cv", True)
    cos_min = _extreme(run, "consistency/grad_cos_min", False)
    return [f"max loss_cv: {loss_cv}{f' ({why})' if loss_cv == 'not recorded' else ''}",
            f"min grad_cos_min: {cos_min}{f' ({why})' if cos_min == 'not recorded' else ''}"]


def _alerts(run: RunData) -> str:
    alerts = run.events_of("alert")
    detail = f" ({_counts(alerts, 'detector')})" if alerts else ""
    return f"alerts: {(run.summary or {}).get('alerts', len(alerts))}{detail}"


def _plots(run: RunData) -> dict[str, bytes]:
    """The report's PNG files by name, in the report's order."""
    plots = {"loss.png": _plot_loss(run)}
    # Only what was recorded: --monitor-interval 0 leaves the replica records alone.
    if any(key in r for r in run.consistency for key, *_ in _DISPERSION):
        plots["dispersion.png"] = _plot_dispersion(run)
        if any("consistency/grad_cos_mean" in r for r in run.consistency):
            plots["cosine.png"] = _plot_cosine(run)
    divergence = _plot_divergence(run)
    if divergence is not None:
        plots["divergence.png"] = divergence
    return plots


def build_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Report:
    """Plot a run directory and summarize it; files go to ``out_dir`` (default ``<run_dir>/report``)."""
    if not str(run_dir).strip():  # as --out-dir: "" is no name for the working directory
        raise ReportError("RUN_DIR: must not be empty (a run directory, e.g. runs/<dir>; . for this one)")
    run = load_run(run_dir)
    if out_dir is not None and not str(out_dir).strip():
        raise ReportError("--out-dir: must not be empty (leave it out for RUN_DIR/report)")
    out = Path(out_dir).expanduser() if out_dir is not None else run.path / "report"
    # The option when one was given; else the default folder, which a user may have filled.
    label = "--out-dir" if out_dir is not None else "the report folder"
    # Writes only into a new folder or an earlier report's: never among a user's files.
    try:
        # A link to a folder writes there; a dangling one is said so by output_dir_problem.
        target = out.resolve() if out.is_symlink() and out.exists() else out
    except OSError as err:  # e.g. a name too long for the file system
        raise ReportError(f"{label}: cannot use {out}: {err.strerror or err}") from None
    # A user's folder that happens to hold a report.md or a loss.png is not ours; a report
    # written before the marker existed is recognised by its title line.
    problem = output_dir_problem(target, label, {REPORT_MARKER: is_file, "report.md": _titled_report},
                                 overwrite=True)
    if problem:
        raise ReportError(problem.replace("--overwrite: ", f"{label}: ").replace("delete it", "write into it"))
    # Everything is drawn and said before the first byte is written: a record the checks
    # of load_run let through and the drawing cannot take leaves no half report.
    try:
        plots = _plots(run)
        text = summary_text(run, [out / "report.md", *(out / name for name in plots)])
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as err:
        raise ReportError(f"{run.path}: a record holds a value of an unexpected kind "
                          f"({type(err).__name__}: {err}); nothing was written") from None
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ReportError(f"{label}: cannot create {out}: {err.strerror or err}") from None
    (out / REPORT_MARKER).write_text("paft report\n")
    files = [_save(data, out / name) for name, data in plots.items()]
    images = "\n".join(f"![{f.stem}]({f.name})" for f in files)
    md = out / "report.md"
    atomic_write_bytes(md, f"{_TITLE}{run.name}\n\n```text\n{text}```\n\n{images}\n".encode())
    # Last, so that every plot the report.md on disk links to exists at every moment:
    # a plot this run no longer has must not survive from an earlier report.
    for name in set(_PLOTS) - {f.name for f in files}:
        (out / name).unlink(missing_ok=True)
    return Report(files=[*files, md], text=text)


def _titled_report(path: Path) -> bool:
    """Whether ``path`` is a ``report.md`` that ``paft report`` wrote (by its first line)."""
    try:
        with path.open(encoding="utf-8") as f:
            return f.readline().startswith(_TITLE)
    except (OSError, UnicodeDecodeError):
        return False
