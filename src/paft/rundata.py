"""One run directory read back: every record ``paft report`` draws from, checked.

Reads only the run-directory contract (:mod:`paft.records`): ``config.json``,
``metrics/rank{r}.jsonl``, ``consistency.jsonl``, ``evals.jsonl``, ``events.jsonl``,
``faults.jsonl`` and ``summary.json``. A missing record file means nothing to show for
that layer; a damaged one (not UTF-8, not JSON, a field of the wrong type) is a
:class:`ReportError` naming the file.

A library run's folder (``paft.protect`` with a ``RunRecorder``) has no ``config.json``,
metrics or summary: its per-rank losses are read from ``consistency.jsonl``'s
``local_losses`` (:attr:`RunData.library`).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from paft.records import from_jsonable, is_run_config, read_jsonl, read_utf8

__all__ = [
    "ReportError", "RunData", "load_run", "read_records", "read_metrics", "mean_local_loss", "is_number", "number",
]


class ReportError(ValueError):
    """The path is not a readable paft run directory."""


@dataclass
class RunData:
    """Every record of one run directory, non-finite strings turned back into floats."""

    path: Path
    config: dict[str, Any]
    summary: dict[str, Any] | None
    metrics: dict[int, list[dict[str, Any]]]
    consistency: list[dict[str, Any]]
    evals: list[dict[str, Any]]
    events: list[dict[str, Any]]
    faults: list[dict[str, Any]]
    stale_summary: int | None = None
    """The steps of a ``summary.json`` that the records have gone past (a resumed run
    still running or interrupted): it is set aside, and the records speak."""
    library: bool = False
    """A library run's folder (no ``config.json``): ``config`` is empty, and ``metrics``
    holds each rank's ``local_loss`` (and the ``loss``) of the ``consistency.jsonl``
    records, so at the monitored steps only, with no step times."""

    def events_of(self, kind: str) -> list[dict[str, Any]]:
        """The ``events.jsonl`` records of one ``event`` kind (``"guard"``, ``"alert"``,
        ``"stop"``, ...), in the file's order: what the report's sections each draw on."""
        return [e for e in self.events if e.get("event") == kind]

    @property
    def name(self) -> str:
        """The run directory's name, also when it was given as ``.``."""
        return self.path.resolve().name

    @property
    def last_step(self) -> int:
        """The last step index any rank recorded."""
        return max((recs[-1]["step"] for recs in self.metrics.values() if recs), default=-1)

    @property
    def world_size(self) -> int:
        if self.summary and "world_size" in self.summary:
            return int(self.summary["world_size"])
        return int(self.config.get("world_size", len(self.metrics)))


# -- reading -------------------------------------------------------------------------


@contextlib.contextmanager
def _reading(path: Path) -> Iterator[None]:
    """A damaged (not UTF-8, not JSON) or unreadable ``path`` as a ReportError naming it."""
    try:
        yield
    except ValueError as err:  # records.read_utf8 / read_jsonl name the file and line
        raise ReportError(str(err)) from None
    except OSError as err:
        raise ReportError(f"{path}: cannot read ({err.strerror or err})") from None


def _read_text(path: Path) -> str:
    with _reading(path):
        return read_utf8(path)


def _is_rank(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_rank_list(value: Any) -> bool:
    return isinstance(value, list) and all(_is_rank(r) for r in value)


_TEXT = frozenset({"event", "action", "reason", "cause", "detector", "mode", "site", "kind", "traceback", "signal"})
"""Fields that hold words, kept as written: the fault kinds "nan" and "inf" are not numbers."""

# The record fields the report reads as other than numbers (which it reads leniently: a
# non-number is a gap in a plot), with what they must be. A name matches a key's last
# "/" part ("cos_to_mean": "consistency/cos_to_mean"); one starting with "_" matches a
# key's end ("_minority_ranks": "replicas/grad_minority_ranks").
_FIELDS: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    ("ranks", _is_rank_list, "a list of ranks"),
    ("_minority_ranks", _is_rank_list, "a list of ranks"),
    ("nonfinite_ranks", _is_rank_list, "a list of ranks"),
    ("val_loss_per_rank", lambda v: isinstance(v, list), "a list"),
    ("local_losses", lambda v: isinstance(v, list), "a list"),
    ("cos_to_mean", lambda v: isinstance(v, list), "a list"),
    ("totals", lambda v: isinstance(v, dict), "an object"),
    ("values", lambda v: isinstance(v, dict), "an object"),
    ("differing", lambda v: isinstance(v, dict), "an object"),
    ("groups", lambda v: isinstance(v, list) and all(_is_rank_list(g) for g in v), "a list of lists of ranks"),
    ("before", lambda v: isinstance(v, list), "a list"),
    ("after", lambda v: isinstance(v, list), "a list"),
    ("bits", lambda v: v is None or isinstance(v, list), "a list"),
    *((key, lambda v: v is None or isinstance(v, str), "a string") for key in sorted(_TEXT)),
)


@functools.cache
def _rule_for(key: str) -> tuple[Callable[[Any], bool], str] | None:
    """The :data:`_FIELDS` rule of a record key, if any (looked up once per key: the keys
    repeat in every record)."""
    for name, ok, what in _FIELDS:
        if key.endswith(name) if name.startswith("_") else key.rpartition("/")[2] == name:
            return ok, what
    return None


def _check_fields(path: Path, i: int, record: dict[str, Any]) -> None:
    for key in ("step", "rank"):  # every record has a step; faults name a rank
        value = record.get(key, 0 if key == "rank" else None)
        if not _is_rank(value):
            raise ReportError(f"{path}: record {i + 1}: {key} must be an integer >= 0, got {value!r}")
    for key, value in record.items():
        rule = _rule_for(key)
        if rule is not None and not rule[0](value):
            raise ReportError(f"{path}: record {i + 1}: {key} must be {rule[1]}, got {value!r}")


def read_records(path: Path) -> list[dict[str, Any]]:
    """The records of one ``.jsonl`` record file (missing: none), checked, non-finite
    strings turned back into floats; a damaged file is a :class:`ReportError` naming it."""
    if not path.exists():
        return []
    with _reading(path):
        raw = read_jsonl(path)  # a crashed writer's partial last line is dropped
    for i, record in enumerate(raw):  # as written: from_jsonable reads a fault kind "nan" as a float
        _check_fields(path, i, record)
    return [{k: v if k in _TEXT else from_jsonable(v) for k, v in r.items()} for r in raw]


def _by_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # One record per step, the last one winning: a resumed run re-does steps.
    kept = {r["step"]: r for r in records}
    return [kept[s] for s in sorted(kept)]


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        data = json.loads(_read_text(path))
    except json.JSONDecodeError as err:
        raise ReportError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return from_jsonable(data)


# The summary fields the report computes with (the trainer writes them as numbers).
_SUMMARY_NUMBERS = ("steps", "world_size", "steps_per_s", "wall_s", "replicas_distinct", "max_replica_rel_diff",
                    "faults_injected", "syncs", "detections", "recomputes", "skipped_batches")


def _check_config(path: Path, config: dict[str, Any]) -> None:
    """The config.json fields the report reads, checked for their types."""
    for key, kind, name in (("protect", dict, "an object"), ("guard", dict, "an object"),
                            ("monitor", dict, "an object"), ("inject", list, "a list"), ("steps", int, "an integer"),
                            ("world_size", int, "an integer"), ("workload", str, "a string")):
        value = config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, kind)):
            raise ReportError(f"{path}: {key} must be {name}, got {value!r}")
    if not all(isinstance(spec, str) for spec in config.get("inject") or []):
        raise ReportError(f"{path}: inject must be a list of fault specs (strings), got {config['inject']!r}")


def _check_summary_numbers(path: Path, summary: dict[str, Any] | None) -> None:
    for key, value in (summary or {}).items():
        if key in _SUMMARY_NUMBERS or key.startswith(("initial_", "final_")):
            if not is_number(value):
                raise ReportError(f"{path}: {key} must be a number, got {value!r}")


def is_number(value: Any) -> bool:
    """A record's number (a bool is not one); NaN and the infinities are."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def number(value: Any) -> float:
    """A record's value as a float; NaN for one that is no number."""
    return float(value) if is_number(value) else math.nan


def read_metrics(run_dir: str | Path) -> dict[int, list[dict[str, Any]]]:
    """rank -> its ``metrics/rank{r}.jsonl`` records, checked, one per step (the last
    one a resumed run wrote), ranks in order; the ranks without a record left out."""
    metrics: dict[int, list[dict[str, Any]]] = {}
    for file in sorted((Path(run_dir) / "metrics").glob("rank*.jsonl")):
        suffix = file.stem[len("rank"):]
        if suffix.isdigit():
            records = _by_step(read_records(file))
            if records:
                metrics[int(suffix)] = records
    return dict(sorted(metrics.items()))


def _library_metrics(consistency: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """rank -> a metrics record per ``consistency.jsonl`` record that holds the ranks'
    losses: the rank's ``local_loss`` and the step's ``loss``, as ``metrics/rank{r}.jsonl``
    has them, so that the report reads a library run as it reads a ``paft train`` one."""
    metrics: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for r in consistency:
        for rank, local in enumerate(r.get("local_losses") or []):
            metrics[rank].append({"step": r["step"], "local_loss": local,
                                  **({"loss": r["loss"]} if "loss" in r else {})})
    return dict(sorted(metrics.items()))


def mean_local_loss(metrics: dict[int, list[dict[str, Any]]]) -> tuple[list[int], list[float]]:
    """(steps, the mean of the ranks' own losses) at each step every rank recorded: the
    global loss whatever the run's defenses (a record's ``loss`` is that mean only where
    the monitor gathered the ranks' losses; unmonitored, it is the rank's own), and with
    every step, where ``consistency.jsonl`` may have every ``--monitor-interval``-th."""
    by_step: dict[int, list[float]] = defaultdict(list)
    for records in metrics.values():
        for r in records:
            if "local_loss" in r:  # a value that is no number (null) is drawn as a gap: NaN
                by_step[int(r["step"])].append(number(r["local_loss"]))
    steps = [s for s in sorted(by_step) if len(by_step[s]) == len(metrics)]
    return steps, [_mean(by_step[s]) for s in steps]


def _mean(values: list[float]) -> float:
    """The exact mean; of finite values whose sum passes float64's range (float64 losses
    of 1e308, an exponent flip) too, where fsum raises OverflowError."""
    try:
        return math.fsum(values) / len(values)
    except OverflowError:
        return math.fsum(v / len(values) for v in values)


def load_run(run_dir: str | Path) -> RunData:
    """Read a run directory; :class:`ReportError` naming it if it is not one."""
    path = Path(run_dir).expanduser()
    try:
        is_dir = path.is_dir()
    except OSError as err:  # e.g. a name too long for the file system
        raise ReportError(f"{path}: cannot read ({err.strerror or err})") from None
    if not is_dir:
        what = "not a directory" if path.exists() else "does not exist"
        raise ReportError(f"{path}: {what} (expected a paft run directory, e.g. runs/<dir>)")
    config = _read_json(path / "config.json")
    if config is None:
        # Not paft train's: a library run's, if its recorder wrote the ranks' losses.
        consistency = _by_step(read_records(path / "consistency.jsonl"))
        metrics = _library_metrics(consistency)
        if not metrics:
            raise ReportError(
                f"{path}: not a paft run directory (no config.json, and no consistency.jsonl record with "
                "local_losses): expected a paft train run directory, or the folder of a library run's "
                "RunRecorder with the monitor on"
            )
        summary = None  # paft train's: a RunRecorder writes none
    else:
        _check_config(path / "config.json", config)
        metrics = read_metrics(path)
        if not metrics:
            if not is_run_config(path / "config.json"):  # another program's folder
                raise ReportError(f"{path}: not a paft run directory (its config.json is not paft's)")
            raise ReportError(
                f"{path}: no per-step metrics (metrics/rank*.jsonl is missing or empty); "
                "the run has not completed a step"
            )
        summary = _read_json(path / "summary.json")
        _check_summary_numbers(path / "summary.json", summary)
        consistency = _by_step(read_records(path / "consistency.jsonl"))
    run = RunData(
        path=path,
        config=config or {},
        summary=summary,
        metrics=metrics,
        consistency=consistency,
        evals=_by_step(read_records(path / "evals.jsonl")),
        events=read_records(path / "events.jsonl"),
        faults=read_records(path / "faults.jsonl"),
        library=config is None,
    )
    # A resume rewrites summary.json only when it ends: until then the old one describes
    # other steps than the records hold (fewer; or more, after a resume from an earlier
    # checkpoint cut the records back), and mixing the two would contradict itself.
    if summary is not None and isinstance(summary.get("steps"), int) and summary["steps"] != run.last_step + 1:
        run.stale_summary, run.summary = summary["steps"], None
    return run
