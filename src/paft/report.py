"""Plots and a text summary of one run directory (``paft report``); the summary's
words are :mod:`paft.report_text`'s, the reading of the records both share
:mod:`paft.run_reading`'s.

Reads the run directory through :func:`paft.rundata.load_run`. A missing file means
nothing to show for that layer: a fault-free, unprotected run still gets its loss, dispersion and cosine plots;
a run that is still going or crashed (no ``summary.json``) is reported from the jsonl
files, with a note saying so; a library run's folder (``paft.protect`` with a
``RunRecorder``: no ``config.json``) from its ``consistency.jsonl``. Usage::

    paft report runs/<dir>

writes ``runs/<dir>/report/{loss,dispersion,cosine,divergence,guard}.png`` (those the run has
records for) and ``report.md`` and prints the text summary. From Python: ``build_report("runs/<dir>")``.

The plots use matplotlib's Agg canvas directly (no pyplot, no global backend switch),
so reports can be built on headless machines and inside other programs.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import same_color
from matplotlib.figure import Figure
from matplotlib.text import Text
from matplotlib.ticker import MaxNLocator

from paft.records import folders_to_make, is_file, output_dir_problem, remove_made, write_together
from paft.report_text import ranks_phrase, run_settings, summary_text
from paft.run_reading import guard_incidents, replica_splits, seen_from, series, split_syncs, sync_events
from paft.rundata import ReportError, RunData, load_run, mean_local_loss, number

__all__ = ["Report", "build_report"]

_PLOTS = ("loss.png", "dispersion.png", "cosine.png", "divergence.png", "guard.png")  # every plot _plots may write
REPORT_MARKER = ".paft-report"  # marks a folder paft report wrote, which it may write into again
_TITLE = "# paft report: "
# The tab10 colours (C0-C9) are the ranks'; what is not a rank is drawn in others. Each
# guard action has its own height, so a step's recompute and its later skip both show.
_GUARD_MARKERS = {"recompute": ("X", "magenta", 0.95), "skip": ("s", "darkgoldenrod", 0.91),
                  "stop": ("*", "black", 0.99)}
_SYNC_COLOR = "teal"
_STATE_SPLIT_COLOR = "goldenrod"  # a state-split alert's, and its measurement's on the divergence panel
# How far up a panel (a fraction of it) the non-finite marks' first row is; each series
# with such marks has its own row below it, where _mark_alerts rings them.
_NONFINITE_ROW = 0.88
# A monitor alert: a ring around the value it judged, on the panel of its metric.
_ALERT_STYLE: dict[str, Any] = {"ls": "", "marker": "o", "ms": 12, "mfc": "none", "mew": 1.5, "zorder": 3}
_SPLIT_LABELS = 6  # the most splits the replica panel labels; more are counted in one note
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
        height = max(_NONFINITE_ROW - 0.04 * row, 0.5)
        _edge_marks(ax, bad, height, kw.get("color", "black"), "_nolegend_", gid="nonfinite")
        if _NONFINITE_LABEL not in ax.get_legend_handles_labels()[1]:
            _edge_marks(ax, [], _NONFINITE_ROW, "0.3", _NONFINITE_LABEL)


def _edge_marks(ax: Axes, steps: Sequence[int], height: float, color: Any, label: str, gid: str | None = None) -> None:
    """A "!" at each of ``steps``, ``height`` up the panel (a fraction of it): a value
    that is not a finite number has no place on the value axis."""
    ax.plot(steps, [height] * len(steps), ls="", marker="$!$", ms=10, color=color,
            transform=ax.get_xaxis_transform(), gid=gid, label=label)


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


def _figure(rows: int, cols: int, title: str, run: RunData | None = None) -> tuple[Figure, list[Axes]]:
    """A figure of ``rows`` x ``cols`` panels; with ``run``, titled with the run's name
    and settings, so that a plot shown on its own says what it is of."""
    fig = Figure(figsize=(6.5 * cols + 3.0, 1.0 + 3.0 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    grid = fig.subplots(rows, cols, sharex=True, squeeze=False)
    fig.suptitle(title if run is None else f"{title}: {run.name}\n{_settings_title(run)}")
    return fig, [ax for row in grid for ax in row]


def _settings_title(run: RunData) -> str:
    ranks = f"{run.world_size} rank{'' if run.world_size == 1 else 's'}"
    if run.library:
        return f"library run, {ranks}"
    said = run_settings(run)
    injected = said["injected"] if len(said["injected"]) <= 60 else said["injected"][:57] + "..."
    return (f"{said['workload']}, {ranks}, protection {said['protection']}, "
            f"guard {said['guard']}, injected {injected}")


def _legend_once() -> Callable[[str], str]:
    """A labeller that gives each legend entry once (matplotlib leaves "_nolegend_" out)."""
    labelled: set[str] = set()

    def label(text: str) -> str:
        if text in labelled:
            return "_nolegend_"
        labelled.add(text)
        return text

    return label


def _mark_events(ax: Axes, run: RunData) -> None:
    """Faults as vertical lines colored by rank; syncs (bottom) and guard actions (top) as markers."""
    label = _legend_once()

    faults = [(int(f["rank"]), int(f["step"]), str(f.get("site", "?")))
              for f in run.faults if "step" in f and "rank" in f]
    sites = {rank: ", ".join(sorted({site for r, _, site in faults if r == rank})) for rank, _, _ in faults}
    # By rank, so that the legend lists the ranks in order; behind the data, which a fault
    # line in its rank's color hid where it crossed that rank's line.
    for rank, step in sorted({(rank, step) for rank, step, _ in faults}):
        ax.axvline(step, color=_rank_color(rank), ls="--", lw=1.0, alpha=0.6, zorder=0.5,
                   label=label(f"fault on rank {rank} ({sites[rank]})"))
    for sync in sync_events(run):
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


def _mark_alerts(ax: Axes, run: RunData, *detectors: str) -> None:
    """The monitor's alerts of ``detectors`` (the panel's metrics) at their steps: a ring
    around the value each judged, on the top edge where that is no finite number (a NaN,
    the ranks a ``nonfinite_local`` alert names). One artist and one legend entry per
    kind, however many alerts."""
    for detector in detectors:
        alerts = [a for a in run.events_of("alert") if a.get("detector") == detector]
        if not alerts:
            continue
        color = _STATE_SPLIT_COLOR if detector == "state_split" else "crimson"
        ranks = sorted({int(r) for a in alerts for r in a.get("ranks") or []})
        who = f", {ranks_phrase(ranks)}" if detector == "nonfinite_local" and ranks else ""
        label = f"alert: {detector}{who} ({len(alerts)})"
        at = [(int(a["step"]), number(a.get("value"))) for a in alerts]
        finite = [(s, v) for s, v in at if math.isfinite(v)]
        if finite:
            ax.plot([s for s, _ in finite], [v for _, v in finite], color=color, label=label, **_ALERT_STYLE)
        ringed = [(s, height) for a in alerts if not math.isfinite(number(a.get("value")))
                  for s in [int(a["step"])] for height in _nonfinite_heights(ax, s, a.get("ranks") or [])]
        if ringed:
            ax.plot([s for s, _ in ringed], [h for _, h in ringed], color=color, transform=ax.get_xaxis_transform(),
                    clip_on=False, label="_nolegend_" if finite else label, **_ALERT_STYLE)


def _nonfinite_heights(ax: Axes, step: int, ranks: Sequence[int]) -> list[float]:
    """Where on the top edge an alert of ``step`` that judged no finite value is ringed:
    on the row of each rank it names (each series' non-finite marks have their own row,
    in the rank's color), also where that rank's value is finite at the step (a
    non-finite gradient beside a finite loss); else on the first row with a mark at the
    step (a panel of one series), else the first row. A ring on the first row alone
    circled another rank's mark, or none, where the rank it named was drawn lower."""
    rows = [(np.asarray(line.get_xdata()).tolist(), float(np.asarray(line.get_ydata())[0]), line.get_color())
            for line in ax.get_lines() if line.get_gid() == "nonfinite"]
    # A rank's first row is its local loss's (its validation loss, in its color too, comes after).
    of_ranks = [next((h for _, h, color in rows if same_color(color, _rank_color(int(r)))), None) for r in ranks]
    if any(h is not None for h in of_ranks):
        return sorted({h for h in of_ranks if h is not None}, reverse=True)
    at_step = [h for steps, h, _ in rows if step in steps]
    return [at_step[0] if at_step else _NONFINITE_ROW]


def _finish(ax: Axes, run: RunData, title: str, ylabel: str) -> None:
    _mark_events(ax, run)
    if any(g.get("action") != "proceed" for g in run.events_of("guard")):  # as _mark_events draws them
        _below_the_guard_marks(ax)
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


def _below_the_guard_marks(ax: Axes) -> None:
    """Raise the panel's top, so that its data end below the guard's marks (from 0.91 of
    the panel up): the value at a step the guard acted on is often the panel's highest
    (a repair's divergence, a detection's judged value), which its marks hid."""
    lo, hi = ax.get_ylim()
    scale = ax.yaxis.get_transform()  # the panel's scale (linear, log, symlog), as a plot's height is
    bottom, top = scale.transform([lo, hi])
    ax.set_ylim(lo, float(scale.inverted().transform([bottom + (top - bottom) / 0.9])[0]))


def _png(fig: Figure) -> bytes:
    data = io.BytesIO()
    fig.savefig(data, format="png", dpi=110)
    return data.getvalue()


# -- the four plots ----------------------------------------------------------------------


def _visible_spread(values: list[float]) -> bool:
    """Whether the ranks' values differ by more than a plot can hide (1e-3 relative;
    replicas apart by rounding, 1e-7, drew four markers inside the mean's)."""
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < len(values):
        return 0 < len(finite) or len({str(v) for v in values}) > 1
    return bool(finite) and max(finite) - min(finite) > 1e-3 * max(abs(v) for v in finite)


def _plot_loss(run: RunData) -> bytes:
    fig, (ax,) = _figure(1, 1, "Loss", run)
    everything: list[float] = []
    for rank, records in run.metrics.items():
        steps, values = series(records, "local_loss")
        _plot(ax, steps, values, color=_rank_color(rank), lw=0.7, alpha=0.7, label=f"rank {rank} local loss")
        everything += values
    steps, values = mean_local_loss(run.metrics)  # every step, where consistency.jsonl may skip some
    _plot(ax, steps, values, color="black", lw=1.8, label="global loss (mean of ranks)")
    everything += values
    steps, values = series(run.evals, "val_loss")
    if steps:
        _plot(ax, steps, values, color="black", ls="", marker="o", ms=7, mfc="white", label="validation loss (mean)")
        everything += values
        per_rank = [r["val_loss_per_rank"] for r in run.evals if isinstance(r.get("val_loss_per_rank"), list)]
        if any(_visible_spread([number(v) for v in row]) for row in per_rank):
            ranks = max(len(row) for row in per_rank)
            for rank in range(ranks):
                rows = [(r["step"], number(r["val_loss_per_rank"][rank])) for r in run.evals
                        if len(r.get("val_loss_per_rank", [])) > rank]
                # Largest first, each rank's smaller on top: ranks at one value (replicas in
                # agreement) show as nested markers, where one hid the others.
                _plot(ax, [s for s, _ in rows], [v for _, v in rows], color=_rank_color(rank), ls="",
                      marker="D", ms=3 + 2 * (min(ranks, 6) - 1 - min(rank, 5)),
                      label=f"rank {rank} validation loss")
                everything += [v for _, v in rows]
    _scale(ax, everything)
    _mark_alerts(ax, run, "nonfinite_local")
    _finish(ax, run, "global and per-rank local loss" + (" (monitored steps only)" if run.library else ""), "loss")
    return _png(fig)


def _plot_dispersion(run: RunData) -> bytes:
    fig, axes = _figure(2, 2, "Worker dispersion", run)
    for ax, (key, title, ylabel) in zip(axes, _DISPERSION):
        steps, values = series(run.consistency, key)
        _plot(ax, steps, values, color="black", lw=1.2, label=key)
        _scale(ax, values)
        _mark_alerts(ax, run, key.rpartition("/")[2])  # a threshold's alert is named as its metric (loss_cv)
        _finish(ax, run, f"{title}\n({key})", ylabel)
    # The four panels mark the same events (and a panel its alerts): one legend for the
    # figure, where four took a third of its width.
    marks: dict[str, Any] = {}
    for ax, (key, *_) in zip(axes, _DISPERSION):
        legend = ax.get_legend()
        if legend is not None:
            legend.remove()
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label != key:
                marks.setdefault(label, handle)
    if marks:
        fig.legend(list(marks.values()), list(marks), loc="outside right upper", fontsize="small")
    return _png(fig)


def _plot_cosine(run: RunData) -> bytes:
    fig, (pairs, to_mean) = _figure(2, 1, "Gradient cosine similarity between workers", run)
    # Drawn wide then thin: with two ranks there is one pair, and min == mean.
    for key, color, width in (("consistency/grad_cos_mean", "0.6", 3.0), ("consistency/grad_cos_min", "black", 1.2)):
        steps, values = series(run.consistency, key)
        _plot(pairs, steps, values, color=color, lw=width, label=key.split("/")[1])
    _mark_alerts(pairs, run, "grad_cos_min")
    _finish(pairs, run, "pairwise cosine of local gradients", "cosine")
    rows = [(r["step"], r["consistency/cos_to_mean"]) for r in run.consistency
            if isinstance(r.get("consistency/cos_to_mean"), list)]
    for rank in range(max((len(v) for _, v in rows), default=0)):
        kept = [(s, number(v[rank])) for s, v in rows if len(v) > rank]
        _plot(to_mean, [s for s, _ in kept], [v for _, v in kept], color=_rank_color(rank), lw=0.9,
              label=f"rank {rank}")
    _finish(to_mean, run, "cosine of each rank's local gradient to the mean gradient", "cosine")
    return _png(fig)


# Where a guard event keeps the value its detector judged, and that detector's limit.
_GUARD_VALUES = (("value", "limit"), ("ratio", "limit"), ("grad_norm_value", "grad_norm_limit"),
                 ("loss_value", "loss_limit"))


def _plot_guard(run: RunData) -> bytes:
    """What the guard caught: each incident's judged value against its detector's limit,
    colored by the rank it flagged (the rejected attempt is in no other record: the
    step's records are the accepted one's)."""
    fig, (ax,) = _figure(1, 1, "Guard detections", run)
    label = _legend_once()
    for g in guard_incidents(run):
        found = g.get("values") or {}
        pair = next(((number(found[v]), number(found[lim])) for v, lim in _GUARD_VALUES
                     if v in found and lim in found), None)
        ranks = g.get("ranks") or []
        what = f"{g.get('detector', '?')} on {ranks_phrase(ranks)}" if ranks else str(g.get("detector", "?"))
        color = _rank_color(int(ranks[0])) if ranks else "black"
        if pair is None or not math.isfinite(pair[0]):  # NaN/Inf, or a value not recorded: on the top edge
            _edge_marks(ax, [g["step"]], 0.97, color, label(what))
        else:
            ax.plot([g["step"]], [pair[0]], ls="", marker="o", ms=7, color=color, label=label(what))
            if math.isfinite(pair[1]):
                ax.plot([g["step"]], [pair[1]], ls="", marker="_", ms=14, mew=2, color="0.4",
                        label=label("the detector's limit"))
    ax.set_yscale("log")
    _finish(ax, run, "the value each detection judged (rejected attempt) against its limit",
            "loss, gradient norm or update ratio")
    return _png(fig)


def _state_distinct(run: RunData) -> tuple[list[int], list[float]]:
    """The distinct training states: each fingerprint's count, and 1 from the first step
    whose fingerprints see a sync or repair (it leaves the replicas identical: the
    event's ``seen_from``; a sync recorded without it ran after its step's fingerprints)
    until the next fingerprint says otherwise. Without the syncs the line held a
    repaired split until the next check."""
    steps, values = series(run.consistency, "replicas/state_distinct")
    # An applied update from split aggregated gradients splits the state from the next step
    # on (a skipped one has no grad record); a sync or repair after it joins it again.
    split = [(s + 1, v) for s, v in zip(*series(run.consistency, "replicas/grad_distinct")) if v > 1]
    found = [_found_split(e) for e in split_syncs(run)]
    # Every sync's end, also without a state fingerprint (--fingerprint-every 0): the
    # split it found is drawn, and so must be the end it put to it. An overlapped sync
    # that landed within a step (seen_from two steps after its own) came before that
    # step's update, whose split gradients split the state again: the split has the last word.
    synced = [(seen_from(e), 1.0, int(e["step"])) for e in sync_events(run)]
    landed_before = [(f, v) for f, v, step in synced if f >= step + 2]
    landed_after = [(f, v) for f, v, step in synced if f < step + 2]
    end = [(run.last_step + 1, float(run.summary["replicas_distinct"]))] if run.summary and isinstance(
        run.summary.get("replicas_distinct"), int) else []
    # At one step the later kind has the last word.
    last = dict([*landed_before, *split, *((s, v) for s, v, after in found if not after), *landed_after,
                 *zip(steps, values), *((s, v) for s, v, after in found if after), *end])
    return sorted(last), [last[s] for s in sorted(last)]


def _found_split(sync: dict[str, Any]) -> tuple[int, float, bool]:
    """(step to draw it at, distinct replicas, whether after that step's fingerprints) of
    the split a sync or repair found. A sync after its step's update saw that update's
    state, which no earlier sync's end or the step's fingerprints (taken before it) undo.
    A repair before its step's rerun (seen_from: that step) saw the state the step began
    from, which the step before's update (or a fault at rest) left: it is drawn there, as
    a split after that update, since at its own step the rerun's fingerprints of one
    replica have the last word (a split the guard repaired at a fingerprint step never
    showed). A repair at step 0 has no step before it: under its end, at its own."""
    step, distinct = int(sync["step"]), float(len(sync["groups"]))
    if seen_from(sync) > step:
        return step, distinct, True
    return (step - 1, distinct, True) if step > 0 else (step, distinct, False)


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
        steps, values = _state_distinct(run) if key == "replicas/state_distinct" else series(run.consistency, key)
        if steps:
            ax.step(steps, values, where="post", **_lone(values, style), label=f"distinct {label}")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, max(2, run.world_size) + 0.5)
    _mark_alerts(ax, run, "replicas_split", "state_split")
    _finish(ax, run, "distinct replicas (fingerprint groups)", "replicas")
    _label_splits(ax, run)


# Where a later split's label may go, in points from the split's step on the line of one
# replica: below it (where only the sync markers are) at three depths, then above it.
_LATER_LABEL_HEIGHTS = (-14, -28, -42, 20, 34)


def _label_splits(ax: Axes, run: RunData) -> None:
    """Each split, with the ranks outside the majority: the first above the line of one
    replica, the later ones smaller, where their text overlaps no other label's (a few
    splits steps apart were written over each other); a later one that finds no such
    place, or past the first few, is counted in one note. Placed in the figure's final
    layout: the panel must be the figure's last drawn, and the labels take no part in
    the layout, which would move them."""
    splits = replica_splits(run)
    if not splits:
        return
    note = ax.text(0.99, 0.1, f"{len(splits) - 1} later splits not labelled", transform=ax.transAxes,
                   ha="right", color="0.4", fontsize="small")  # its widest text, so that no label takes its place
    fig = ax.figure
    assert isinstance(fig, Figure)  # _figure's, never a subfigure
    fig.draw_without_rendering()  # the layout, in which the labels' extents are measured
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    panel = ax.get_window_extent(renderer)
    taken = [note.get_window_extent(renderer)]
    left_out = 0
    for i, (step, ranks, _, by) in enumerate(splits):
        if i >= _SPLIT_LABELS:
            left_out += 1
            continue
        who = ranks_phrase(ranks) if ranks else "no majority"  # not "rank ?"
        caught = {"guard": " (caught by the guard)", "sync": " (found by a sync)"}.get(by, "")
        late = step > 0.6 * max(run.last_step, 1)  # written leftwards, clear of the legend
        sides = (-8, 8) if late else (8, -8)
        places = [(sides[0], 20)] if i == 0 else [(dx, dy) for dy in _LATER_LABEL_HEIGHTS for dx in sides]
        for dx, dy in places:
            label = ax.annotate(f"{'first split' if i == 0 else 'split'}: step {step}, {who}{caught}", xy=(step, 1),
                                xytext=(dx, dy), ha="left" if dx > 0 else "right",
                                va="bottom" if dy > 0 else "top", textcoords="offset points",
                                arrowprops={"arrowstyle": "->"}, fontsize=None if i == 0 else "small")
            label.set_in_layout(False)
            label.update_positions(renderer)  # where its offset puts the text in this layout
            box = Text.get_window_extent(label, renderer).padded(2)  # the text's, without its arrow
            # The first is written wherever it falls: every split after it is measured against it.
            if i == 0 or (panel.contains(box.x0, box.y0) and panel.contains(box.x1, box.y1)
                          and not any(box.overlaps(other) for other in taken)):
                taken.append(box)
                break
            label.remove()
        else:
            left_out += 1
    if left_out:
        note.set_text(f"{left_out} later split{'s' if left_out > 1 else ''} not labelled")
    else:
        note.remove()


def _eval_divergence(run: RunData) -> tuple[list[int], list[float]]:
    """Measured at every evaluation (max over ranks); empty when it never left 0."""
    steps, values = series(run.evals, "replica_rel_diff")
    return (steps, values) if any(v != 0 for v in values) else ([], [])


def _alert_divergence(run: RunData) -> list[tuple[int, float]]:
    """(step, largest relative distance of a rank's parameters to the mean) measured at
    each state-split alert: before the first evaluation or sync, often the only
    measurement of a split's size."""
    found = []
    for a in run.events_of("alert"):
        per_rank = (a.get("divergence") or {}).get("params_per_rank") if a.get("detector") == "state_split" else None
        finite = [number(v) for v in per_rank or [] if math.isfinite(number(v))]
        if finite:
            found.append((int(a["step"]), max(finite)))
    return found


def _divergence_panel(ax: Axes, run: RunData) -> None:
    # Both kinds are measurements at single steps, drawn as points: a line between two of
    # them would claim values for the steps between (it rose before the fault, and ran
    # across the syncs that found identical replicas).
    steps, values = _eval_divergence(run)
    if steps:
        # Hollow and larger: a sync's point at an evaluation's step shows inside it.
        _plot(ax, steps, values, color="black", ls="", marker="o", ms=8, mfc="none", label="at evaluations")
    # Syncs that found identical replicas (divergence 0) show only as the hollow triangles.
    syncs = [(int(e["step"]), number(e.get("divergence"))) for e in sync_events(run)]
    pos = [(s, v) for s, v in syncs if math.isfinite(v) and v > 0]
    if pos:
        ax.plot([s for s, _ in pos], [v for _, v in pos], ls="", marker="o", ms=5, color=_SYNC_COLOR,
                label="before a sync that found replicas apart")
    alerts = _alert_divergence(run)
    if alerts:
        ax.plot([s for s, _ in alerts], [v for _, v in alerts], ls="", marker="D", ms=5, color=_STATE_SPLIT_COLOR,
                label="at a state-split alert")
    bad = [s for s, v in syncs if not math.isfinite(v)]
    if bad:
        _edge_marks(ax, bad, _NONFINITE_ROW, "red", "non-finite replica at a sync")
    _scale(ax, [*values, *(v for _, v in pos), *(v for _, v in alerts)])
    if ax.get_yscale() != "log":  # a distance: nothing below 0 (an all-zero panel showed -0.05, symlog -1e-2)
        ax.set_ylim(bottom=0)
    if not steps and not pos and not alerts and not bad:
        ax.text(0.5, 0.5, "every sync found identical replicas", transform=ax.transAxes, ha="center", color="0.4")
    # A sync measures against the replica it takes (about 1.5x the distance to the mean on 3 ranks).
    _finish(ax, run, "relative L2 distance of the replicas (max over ranks)\n"
            "to their mean; at a sync, to the replica the sync takes", "divergence")


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
    return sorted(((int(e["step"]), number(e["period"])) for e in run.events
                   if e.get("event") in ("sync", "repair", "dyn_trigger") and "period" in e),
                  key=lambda p: p[0])


def _plot_divergence(run: RunData) -> bytes | None:
    periods = _periods(run)
    panels = [name for name, on in (("replicas", any("replicas/grad_distinct" in r for r in run.consistency)),
                                    ("divergence", bool(sync_events(run) or _eval_divergence(run)[0]
                                                        or _alert_divergence(run))),
                                    ("period", bool(periods))) if on]
    if not panels:
        return None
    fig, axes = _figure(len(panels), 1, "Replica divergence", run)
    # The replica panel last: it labels its splits in the figure's final layout.
    for ax, name in sorted(zip(axes, panels), key=lambda panel: panel[1] == "replicas"):
        if name == "replicas":
            _replica_panel(ax, run)
        elif name == "divergence":
            _divergence_panel(ax, run)
        else:
            _period_panel(ax, run, periods)
    return _png(fig)


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
    if guard_incidents(run):
        plots["guard.png"] = _plot_guard(run)
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
    except (TypeError, AttributeError, KeyError, IndexError, ValueError, ArithmeticError) as err:
        raise ReportError(f"{run.path}: a record holds a value of an unexpected kind "
                          f"({type(err).__name__}: {err}); nothing was written") from None
    made = folders_to_make(out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ReportError(f"{label}: cannot create {out}: {err.strerror or err}") from None
    files = [out / name for name in plots]
    images = "\n".join(f"![{f.stem}]({f.name})" for f in files)
    md = out / "report.md"
    # The plots before report.md, so that every plot the report.md on disk links to exists at every moment.
    contents = {**dict(zip(files, plots.values())),
                md: f"{_TITLE}{run.name}\n\n```text\n{text}```\n\n{images}\n".encode()}
    _write_all(out, contents, made, label)
    # Last: a plot this run no longer has must not survive from an earlier report.
    for name in set(_PLOTS) - {f.name for f in files}:
        (out / name).unlink(missing_ok=True)
    return Report(files=[*files, md], text=text)


def _write_all(out: Path, contents: dict[Path, bytes], made: list[Path], label: str) -> None:
    """Write ``contents`` (path -> bytes, in that order) into ``out``, the marker first,
    whole or not at all (:func:`paft.records.write_together`): a full disk (or an
    interrupt) while writing leaves an earlier report as it was, and removes the folders
    ``made`` for this one."""
    try:
        (out / REPORT_MARKER).write_text("paft report\n")  # an interrupted report's folder is still known as ours
        write_together(contents)
    except BaseException as err:
        remove_made(made)
        if isinstance(err, OSError):  # a full disk, a quota: not paft's to show a traceback for
            # A write_text that fails as it flushes names no file: the marker's.
            raise ReportError(f"{label}: cannot write {err.filename or out / REPORT_MARKER}: {err.strerror or err}; "
                              "nothing was written") from None
        raise


def _titled_report(path: Path) -> bool:
    """Whether ``path`` is a ``report.md`` that ``paft report`` wrote (by its first line)."""
    try:
        with path.open(encoding="utf-8") as f:
            return f.readline().startswith(_TITLE)
    except (OSError, UnicodeDecodeError):
        return False
