"""The replica-divergence figure of ``paft report`` (``divergence.png``): the distinct
replicas (training state and aggregated gradients) with each split labelled, the
replicas' measured distance (at evaluations, syncs and state-split alerts), and the
PAFT sync period. Drawn with :mod:`paft.report_draw`'s primitives.
"""

from __future__ import annotations

import math
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.text import Text
from matplotlib.ticker import MaxNLocator

from paft.report_draw import (
    NONFINITE_ROW,
    STATE_SPLIT_COLOR,
    SYNC_COLOR,
    edge_marks,
    figure,
    finish,
    lone,
    mark_alerts,
    plot,
    png,
    scale,
)
from paft.report_text import ranks_phrase
from paft.run_reading import first_period, replica_splits, seen_from, series, split_syncs, sync_events
from paft.rundata import RunData, number

__all__ = ["plot_divergence"]

_SPLIT_LABELS = 6  # the most splits the replica panel labels; more are counted in one note


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
            ax.step(steps, values, where="post", **lone(values, style), label=f"distinct {label}")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(0, max(2, run.world_size) + 0.5)
    mark_alerts(ax, run, "replicas_split", "state_split")
    finish(ax, run, "distinct replicas (fingerprint groups)", "replicas")
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
    assert isinstance(fig, Figure)  # report_draw.figure's, never a subfigure
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


def _divergence_panel(ax: Axes, run: RunData, evals: tuple[list[int], list[float]],
                      alerts: list[tuple[int, float]]) -> None:
    """``evals``: :func:`_eval_divergence`'s, ``alerts``: :func:`_alert_divergence`'s
    (read once, by :func:`plot_divergence`, which decides on them whether to draw this)."""
    # Both kinds are measurements at single steps, drawn as points: a line between two of
    # them would claim values for the steps between (it rose before the fault, and ran
    # across the syncs that found identical replicas).
    steps, values = evals
    if steps:
        # Hollow and larger: a sync's point at an evaluation's step shows inside it.
        plot(ax, steps, values, color="black", ls="", marker="o", ms=8, mfc="none", label="at evaluations")
    # Syncs that found identical replicas (divergence 0) show only as the hollow triangles.
    syncs = [(int(e["step"]), number(e.get("divergence"))) for e in sync_events(run)]
    pos = [(s, v) for s, v in syncs if math.isfinite(v) and v > 0]
    if pos:
        ax.plot([s for s, _ in pos], [v for _, v in pos], ls="", marker="o", ms=5, color=SYNC_COLOR,
                label="before a sync that found replicas apart")
    if alerts:
        ax.plot([s for s, _ in alerts], [v for _, v in alerts], ls="", marker="D", ms=5, color=STATE_SPLIT_COLOR,
                label="at a state-split alert")
    bad = [s for s, v in syncs if not math.isfinite(v)]
    if bad:
        edge_marks(ax, bad, NONFINITE_ROW, "red", "non-finite replica at a sync")
    scale(ax, [*values, *(v for _, v in pos), *(v for _, v in alerts)])
    if ax.get_yscale() != "log":  # a distance: nothing below 0 (an all-zero panel showed -0.05, symlog -1e-2)
        ax.set_ylim(bottom=0)
    if not steps and not pos and not alerts and not bad:
        ax.text(0.5, 0.5, "every sync found identical replicas", transform=ax.transAxes, ha="center", color="0.4")
    # A sync measures against the replica it takes (about 1.5x the distance to the mean on 3 ranks).
    finish(ax, run, "relative L2 distance of the replicas (max over ranks)\n"
            "to their mean; at a sync, to the replica the sync takes", "divergence")


def _period_panel(ax: Axes, run: RunData, periods: list[tuple[int, float]]) -> None:
    protect = run.config.get("protect") or {}
    start = first_period(run)
    if start is not None and periods[0][0] > 0:
        periods = [(0, float(start)), *periods]
    if periods[-1][0] < run.last_step:  # hold the last period to the end of the run
        periods = [*periods, (run.last_step, periods[-1][1])]
    ax.step([s for s, _ in periods], [p for _, p in periods], where="post", color="black", lw=1.5,
            label="sync period H")
    scale(ax, [p for _, p in periods])
    if ax.get_yscale() == "linear":
        ax.set_ylim(bottom=0, top=1.15 * max(p for _, p in periods))
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    titles = {"dyn": "PAFT sync period H (PAFT-Dyn adapts it)", "averager": "PeriodicModelAverager period H"}
    finish(ax, run, titles.get(str(protect.get("mode")), "PAFT sync period H"), "period (steps)")


def _periods(run: RunData) -> list[tuple[int, float]]:
    """(step, sync period) of every event that set one (a guard's repair under PAFT-Dyn
    does; a resume that changed the period, at its first step). Sorted by step only: within a
    step the file's order holds (a trigger's period, then the sync's answer to it,
    which is the period in force from that step on)."""
    return sorted(((int(e["step"]), number(e["period"])) for e in run.events
                   if e.get("event") in ("sync", "repair", "dyn_trigger", "period") and "period" in e),
                  key=lambda p: p[0])


def plot_divergence(run: RunData) -> bytes | None:
    periods = _periods(run)
    evals, alerts = _eval_divergence(run), _alert_divergence(run)
    panels = [name for name, on in (("replicas", any("replicas/grad_distinct" in r for r in run.consistency)),
                                    ("divergence", bool(sync_events(run) or evals[0] or alerts)),
                                    ("period", bool(periods))) if on]
    if not panels:
        return None
    fig, axes = figure(len(panels), 1, "Replica divergence", run)
    # The replica panel last: it labels its splits in the figure's final layout.
    for ax, name in sorted(zip(axes, panels), key=lambda panel: panel[1] == "replicas"):
        if name == "replicas":
            _replica_panel(ax, run)
        elif name == "divergence":
            _divergence_panel(ax, run, evals, alerts)
        else:
            _period_panel(ax, run, periods)
    return png(fig)
