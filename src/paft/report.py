"""Plots and a text summary of one run directory (``paft report``); the summary's
words are :mod:`paft.report_text`'s, the reading of the records both share
:mod:`paft.run_reading`'s, the drawing primitives :mod:`paft.report_draw`'s, the
replica-divergence figure :mod:`paft.report_divergence`'s.

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

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paft.records import REPORT_MARKER, folders_to_make, is_file, output_dir_problem, remove_made, write_together
from paft.report_divergence import plot_divergence
from paft.report_draw import edge_marks, figure, finish, legend_once, mark_alerts, plot, png, rank_color, scale
from paft.report_text import ranks_phrase, summary_text
from paft.run_reading import guard_incidents, series
from paft.rundata import ReportError, RunData, load_run, mean_local_loss, number

__all__ = ["Report", "build_report"]

_PLOTS = ("loss.png", "dispersion.png", "cosine.png", "divergence.png", "guard.png")  # every plot _plots may write
_TITLE = "# paft report: "
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


# -- the four plots ----------------------------------------------------------------------


def _visible_spread(values: list[float]) -> bool:
    """Whether the ranks' values differ by more than a plot can hide (1e-3 relative;
    replicas apart by rounding, 1e-7, drew four markers inside the mean's)."""
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < len(values):
        return 0 < len(finite) or len({str(v) for v in values}) > 1
    return bool(finite) and max(finite) - min(finite) > 1e-3 * max(abs(v) for v in finite)


def _plot_loss(run: RunData) -> bytes:
    fig, (ax,) = figure(1, 1, "Loss", run)
    everything: list[float] = []
    for rank, records in run.metrics.items():
        steps, values = series(records, "local_loss")
        plot(ax, steps, values, color=rank_color(rank), lw=0.7, alpha=0.7, label=f"rank {rank} local loss")
        everything += values
    steps, values = mean_local_loss(run.metrics)  # every step, where consistency.jsonl may skip some
    plot(ax, steps, values, color="black", lw=1.8, label="global loss (mean of ranks)")
    everything += values
    steps, values = series(run.evals, "val_loss")
    if steps:
        plot(ax, steps, values, color="black", ls="", marker="o", ms=7, mfc="white", label="validation loss (mean)")
        everything += values
        per_rank = [r["val_loss_per_rank"] for r in run.evals if isinstance(r.get("val_loss_per_rank"), list)]
        if any(_visible_spread([number(v) for v in row]) for row in per_rank):
            ranks = max(len(row) for row in per_rank)
            for rank in range(ranks):
                rows = [(r["step"], number(r["val_loss_per_rank"][rank])) for r in run.evals
                        if len(r.get("val_loss_per_rank", [])) > rank]
                # Largest first, each rank's smaller on top: ranks at one value (replicas in
                # agreement) show as nested markers, where one hid the others.
                plot(ax, [s for s, _ in rows], [v for _, v in rows], color=rank_color(rank), ls="",
                      marker="D", ms=3 + 2 * (min(ranks, 6) - 1 - min(rank, 5)),
                      label=f"rank {rank} validation loss")
                everything += [v for _, v in rows]
    scale(ax, everything)
    mark_alerts(ax, run, "nonfinite_local")
    finish(ax, run, "global and per-rank local loss" + (" (monitored steps only)" if run.library else ""), "loss")
    return png(fig)


def _plot_dispersion(run: RunData) -> bytes:
    fig, axes = figure(2, 2, "Worker dispersion", run)
    for ax, (key, title, ylabel) in zip(axes, _DISPERSION):
        steps, values = series(run.consistency, key)
        plot(ax, steps, values, color="black", lw=1.2, label=key)
        scale(ax, values)
        mark_alerts(ax, run, key.rpartition("/")[2])  # a threshold's alert is named as its metric (loss_cv)
        finish(ax, run, f"{title}\n({key})", ylabel)
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
    return png(fig)


def _plot_cosine(run: RunData) -> bytes:
    fig, (pairs, to_mean) = figure(2, 1, "Gradient cosine similarity between workers", run)
    # Drawn wide then thin: with two ranks there is one pair, and min == mean.
    for key, color, width in (("consistency/grad_cos_mean", "0.6", 3.0), ("consistency/grad_cos_min", "black", 1.2)):
        steps, values = series(run.consistency, key)
        plot(pairs, steps, values, color=color, lw=width, label=key.split("/")[1])
    mark_alerts(pairs, run, "grad_cos_min")
    finish(pairs, run, "pairwise cosine of local gradients", "cosine")
    rows = [(r["step"], r["consistency/cos_to_mean"]) for r in run.consistency
            if isinstance(r.get("consistency/cos_to_mean"), list)]
    for rank in range(max((len(v) for _, v in rows), default=0)):
        kept = [(s, number(v[rank])) for s, v in rows if len(v) > rank]
        plot(to_mean, [s for s, _ in kept], [v for _, v in kept], color=rank_color(rank), lw=0.9,
              label=f"rank {rank}")
    finish(to_mean, run, "cosine of each rank's local gradient to the mean gradient", "cosine")
    return png(fig)


# Where a guard event keeps the value its detector judged, and that detector's limit.
_GUARD_VALUES = (("value", "limit"), ("ratio", "limit"), ("grad_norm_value", "grad_norm_limit"),
                 ("loss_value", "loss_limit"))


def _plot_guard(run: RunData) -> bytes:
    """What the guard caught: each incident's judged value against its detector's limit,
    colored by the rank it flagged (the rejected attempt is in no other record: the
    step's records are the accepted one's)."""
    fig, (ax,) = figure(1, 1, "Guard detections", run)
    label = legend_once()
    for g in guard_incidents(run):
        found = g.get("values") or {}
        pair = next(((number(found[v]), number(found[lim])) for v, lim in _GUARD_VALUES
                     if v in found and lim in found), None)
        ranks = g.get("ranks") or []
        what = f"{g.get('detector', '?')} on {ranks_phrase(ranks)}" if ranks else str(g.get("detector", "?"))
        color = rank_color(int(ranks[0])) if ranks else "black"
        if pair is None or not math.isfinite(pair[0]):  # NaN/Inf, or a value not recorded: on the top edge
            edge_marks(ax, [g["step"]], 0.97, color, label(what))
        else:
            ax.plot([g["step"]], [pair[0]], ls="", marker="o", ms=7, color=color, label=label(what))
            if math.isfinite(pair[1]):
                ax.plot([g["step"]], [pair[1]], ls="", marker="_", ms=14, mew=2, color="0.4",
                        label=label("the detector's limit"))
    ax.set_yscale("log")
    finish(ax, run, "the value each detection judged (rejected attempt) against its limit",
            "loss, gradient norm or update ratio")
    return png(fig)


def _plots(run: RunData) -> dict[str, bytes]:
    """The report's PNG files by name, in the report's order."""
    plots = {"loss.png": _plot_loss(run)}
    # Only what was recorded: --monitor-interval 0 leaves the replica records alone.
    if any(key in r for r in run.consistency for key, *_ in _DISPERSION):
        plots["dispersion.png"] = _plot_dispersion(run)
        if any("consistency/grad_cos_mean" in r for r in run.consistency):
            plots["cosine.png"] = _plot_cosine(run)
    divergence = plot_divergence(run)
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
