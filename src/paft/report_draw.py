"""The drawing primitives of ``paft report``'s plots (:mod:`paft.report`) and of its
replica-divergence figure (:mod:`paft.report_divergence`): a figure titled with the run,
a series drawn as lines with its non-finite values on the top edge, the run's faults,
syncs, guard actions and monitor alerts marked on a panel, the panel finished, the
figure rendered to PNG bytes (matplotlib's Agg canvas, no pyplot).
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import same_color
from matplotlib.figure import Figure

from paft.report_text import ranks_phrase, run_settings
from paft.run_reading import sync_events
from paft.rundata import RunData, number

__all__ = ["NONFINITE_ROW", "STATE_SPLIT_COLOR", "SYNC_COLOR", "edge_marks", "figure", "finish", "legend_once",
           "lone", "mark_alerts", "plot", "png", "rank_color", "scale"]

# The tab10 colours (C0-C9) are the ranks'; what is not a rank is drawn in others. Each
# guard action has its own height, so a step's recompute and its later skip both show.
_GUARD_MARKERS = {"recompute": ("X", "magenta", 0.95), "skip": ("s", "darkgoldenrod", 0.91),
                  "stop": ("*", "black", 0.99)}
SYNC_COLOR = "teal"
STATE_SPLIT_COLOR = "goldenrod"  # a state-split alert's, and its measurement's on the divergence panel
# How far up a panel (a fraction of it) the non-finite marks' first row is; each series
# with such marks has its own row below it, where mark_alerts rings them.
NONFINITE_ROW = 0.88
# A monitor alert: a ring around the value it judged, on the panel of its metric.
_ALERT_STYLE: dict[str, Any] = {"ls": "", "marker": "o", "ms": 12, "mfc": "none", "mew": 1.5, "zorder": 3}
_NONFINITE_LABEL = "non-finite value (color: series)"


def rank_color(rank: int) -> str:
    return f"C{rank % 10}"


def lone(values: Sequence[float], kw: dict[str, Any]) -> dict[str, Any]:
    """``kw`` with a marker on each lone point: a finite value with no finite neighbour,
    which no line reaches (a one-step run; a measurement between unmeasured steps, or
    beside a non-finite one). Else such a value is in the legend and nowhere else."""
    points = [i for i, v in enumerate(values) if math.isfinite(v)
              and not any(0 <= j < len(values) and math.isfinite(values[j]) for j in (i - 1, i + 1))]
    if points and "marker" not in kw:
        return {**kw, "marker": "o", "ms": 4, "markevery": points}
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


def plot(ax: Axes, steps: Sequence[int], values: Sequence[float], **kw: Any) -> None:
    """A line of the finite values, broken where a step was not measured, a marker on a
    lone point; non-finite values as markers on the top edge."""
    xs, ys = _gapped(steps, values)
    ax.plot(xs, ys, **lone(ys, kw))
    bad = [s for s, v in zip(steps, values) if not math.isfinite(v)]
    if bad:
        # Each series its own row, so that which rank went non-finite first shows.
        row = sum(1 for line in ax.get_lines() if line.get_gid() == "nonfinite")
        height = max(NONFINITE_ROW - 0.04 * row, 0.5)
        edge_marks(ax, bad, height, kw.get("color", "black"), "_nolegend_", gid="nonfinite")
        if _NONFINITE_LABEL not in ax.get_legend_handles_labels()[1]:
            edge_marks(ax, [], NONFINITE_ROW, "0.3", _NONFINITE_LABEL)


def edge_marks(ax: Axes, steps: Sequence[int], height: float, color: Any, label: str, gid: str | None = None) -> None:
    """A "!" at each of ``steps``, ``height`` up the panel (a fraction of it): a value
    that is not a finite number has no place on the value axis."""
    ax.plot(steps, [height] * len(steps), ls="", marker="$!$", ms=10, color=color,
            transform=ax.get_xaxis_transform(), gid=gid, label=label)


def scale(ax: Axes, values: Sequence[float]) -> None:
    """Log scale when the positive values span two decades or more (symlog if zeros too)."""
    finite = [v for v in values if math.isfinite(v)]
    positive = [v for v in finite if v > 0]
    if len(positive) < 2 or max(positive) / min(positive) < 100:
        return
    if len(positive) == len(finite):
        ax.set_yscale("log")
    else:
        ax.set_yscale("symlog", linthresh=min(positive))


def figure(rows: int, cols: int, title: str, run: RunData | None = None) -> tuple[Figure, list[Axes]]:
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


def legend_once() -> Callable[[str], str]:
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
    label = legend_once()

    faults = [(int(f["rank"]), int(f["step"]), str(f.get("site", "?")))
              for f in run.faults if "step" in f and "rank" in f]
    sites = {rank: ", ".join(sorted({site for r, _, site in faults if r == rank})) for rank, _, _ in faults}
    # By rank, so that the legend lists the ranks in order; behind the data, which a fault
    # line in its rank's color hid where it crossed that rank's line.
    for rank, step in sorted({(rank, step) for rank, step, _ in faults}):
        ax.axvline(step, color=rank_color(rank), ls="--", lw=1.0, alpha=0.6, zorder=0.5,
                   label=label(f"fault on rank {rank} ({sites[rank]})"))
    for sync in sync_events(run):
        noop = sync.get("mode") == "noop"
        ax.plot([sync["step"]], [0.03], ls="", marker="^", ms=7, color=SYNC_COLOR,
                mfc="none" if noop else SYNC_COLOR, transform=ax.get_xaxis_transform(), clip_on=False,
                label=label("sync (no-op)" if noop else "sync (repair)"))
    for guard in run.events_of("guard"):
        action = str(guard.get("action", "?"))
        if action == "proceed":
            continue  # the verdict after a successful recompute: nothing was done
        marker, color, height = _GUARD_MARKERS.get(action, ("P", "dimgray", 0.93))
        ax.plot([guard["step"]], [height], ls="", marker=marker, ms=8, color=color,
                transform=ax.get_xaxis_transform(), clip_on=False, label=label(f"guard: {action}"))


def mark_alerts(ax: Axes, run: RunData, *detectors: str) -> None:
    """The monitor's alerts of ``detectors`` (the panel's metrics) at their steps: a ring
    around the value each judged, on the top edge where that is no finite number (a NaN,
    the ranks a ``nonfinite_local`` alert names). One artist and one legend entry per
    kind, however many alerts."""
    for detector in detectors:
        alerts = [a for a in run.events_of("alert") if a.get("detector") == detector]
        if not alerts:
            continue
        color = STATE_SPLIT_COLOR if detector == "state_split" else "crimson"
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
    of_ranks = [next((h for _, h, color in rows if same_color(color, rank_color(int(r)))), None) for r in ranks]
    if any(h is not None for h in of_ranks):
        return sorted({h for h in of_ranks if h is not None}, reverse=True)
    at_step = [h for steps, h, _ in rows if step in steps]
    return [at_step[0] if at_step else NONFINITE_ROW]


def finish(ax: Axes, run: RunData, title: str, ylabel: str) -> None:
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
    transform = ax.yaxis.get_transform()  # the panel's scale (linear, log, symlog), as a plot's height is
    bottom, top = transform.transform([lo, hi])
    ax.set_ylim(lo, float(transform.inverted().transform([bottom + (top - bottom) / 0.9])[0]))


def png(fig: Figure) -> bytes:
    data = io.BytesIO()
    fig.savefig(data, format="png", dpi=110)
    return data.getvalue()
