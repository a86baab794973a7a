"""Writing a run's records: what goes where in the run directory, and how files are
written safely (:mod:`paft.rundir` checks and claims the directory itself).

Layout (the contract other tools read; every key: docs/RUN-DIRECTORY.md):

- ``config.json``: the resolved :class:`~paft.config.TrainConfig`;
- ``metrics/rank{r}.jsonl``: per rank, per step: step, local loss, global loss,
  grad norm, lr, attempts, whether the update was applied, step time, and whether the
  step was timed (the first :data:`UNTIMED_STEPS` of each leg of a run are not);
- ``consistency.jsonl`` (rank 0): the per-step worker metrics;
- ``faults.jsonl``: every injected fault (each rank appends its own lines; put in
  (step, attempt, rank) order once the ranks stop: :func:`sort_faults`);
- ``evals.jsonl`` (rank 0): the evaluations;
- ``events.jsonl`` (rank 0): detections, recomputes, syncs, skips, alerts; why a leg
  ended (the launcher's ``failed`` and ``interrupted``, the guard's ``stop``);
- ``checkpoints/step{NNNNNNN}/rank{r}.pt`` (the last two kept) and ``checkpoints/latest``
  (the name of the newest complete one);
- ``summary.json`` (rank 0) at the end; ``tb/`` with ``--tensorboard``.

Lines are written whole with one ``write`` on files opened for append, so lines
from several processes never interleave, and flushed so a crashed run keeps them.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import pathlib
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

_UMASK = os.umask(0)
os.umask(_UMASK)

__all__ = [
    "RunRecorder",
    "is_leg_end",
    "require_tensorboard",
    "console",
    "quiet_stdout",
    "atomic_write_bytes",
    "atomic_write_json",
    "stage_bytes",
    "write_together",
    "folders_to_make",
    "remove_made",
    "json_bytes",
    "read_jsonl",
    "read_utf8",
    "is_run_config",
    "is_file",
    "truncate_jsonl",
    "sort_faults",
    "jsonable",
    "jsonl_line",
    "from_jsonable",
    "max_or_nan",
    "Marker",
    "LOCK_FILE",
    "REPORT_MARKER",
    "BENCH_MARKER",
    "paft_folder",
    "holds_files",
    "output_dir_problem",
    "path_name_problem",
    "from_jsonable_float",
    "UNTIMED_STEPS",
    "SHARED_RECORDS",
    "record_files",
]

UNTIMED_STEPS = 3
"""The first steps of each leg of a run (the start, each resume) that the throughput
leaves out: they pay one-off costs (DDP's bucket rebuild, lazy optimizer state)."""


# What jsonable writes for a non-finite float (``str(value)``), with the spellings read back.
NONFINITE_TEXT = {"inf": math.inf, "+inf": math.inf, "-inf": -math.inf, "nan": math.nan, "-nan": math.nan}


def from_jsonable_float(value: Any) -> Any:
    """:func:`jsonable`'s inverse for one value: a non-finite float's string becomes the
    float again (any case); every other value is returned unchanged."""
    return NONFINITE_TEXT.get(value.lower(), value) if isinstance(value, str) else value


def from_jsonable(value: Any) -> Any:
    """:func:`jsonable`'s inverse: :func:`from_jsonable_float` through dicts and lists."""
    if isinstance(value, dict):
        return {k: from_jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_jsonable(v) for v in value]
    return from_jsonable_float(value)


def max_or_nan(values: Iterable[float]) -> float:
    """The largest of ``values``, NaN if any is NaN (``max`` skips a NaN unless it comes
    first): the worst replica's loss, where a NaN replica is the worst."""
    values = list(values)
    return math.nan if any(math.isnan(v) for v in values) else max(values)


def jsonable(value: Any) -> Any:
    """JSON-safe copy: non-finite floats become strings ("inf", "nan") instead of invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


LOCK_FILE = ".lock"
"""Held (flock) by the ``paft train`` or ``paft bench`` that uses a folder. Found alone,
it is what a launcher killed outright (``kill -9``) before its first write left: the
folder counts as empty."""


REPORT_MARKER = ".paft-report"
"""Marks a folder ``paft report`` wrote, which it may write into again."""
BENCH_MARKER = ".paft-bench"
"""Marks a folder ``paft bench`` wrote, which ``paft bench --overwrite`` may replace."""


def paft_folder(path: pathlib.Path) -> str | None:
    """What kind of paft output folder ``path`` is (a run directory by its ``config.json``,
    a report or a benchmark's folder by its marker), or None: what a refusal of a folder
    that is paft's, but another command's, says it is."""
    if is_run_config(path / "config.json"):
        return "a paft train run directory (its config.json)"
    if is_file(path / REPORT_MARKER):
        return f"a paft report folder (its {REPORT_MARKER})"
    if is_file(path / BENCH_MARKER):
        return f"a paft bench folder (its {BENCH_MARKER})"
    return None


def holds_files(path: pathlib.Path) -> bool:
    """Whether folder ``path`` holds anything but :data:`LOCK_FILE`."""
    return any(child.name != LOCK_FILE for child in path.iterdir())


Marker = Mapping[str, Callable[[pathlib.Path], bool]]
"""File name -> whether the file of that name in a folder is paft's own: what tells
paft's output folders from a user's."""


def output_dir_problem(path: pathlib.Path, option: str, markers: Marker, overwrite: bool) -> str | None:
    """Why ``path`` cannot become an output folder, or None; touches nothing.

    It must be creatable (its nearest existing ancestor a writable directory). An
    existing, non-empty folder is replaced only with ``overwrite``, and only if it
    holds one of ``markers`` that its check recognises as paft's (a benchmark's
    marker file; a run's ``config.json`` with a run config's keys, not a user's own
    ``config.json``): ``--overwrite`` deletes paft's own results, never a folder of
    other files, and never through a symbolic link.
    """
    try:
        return path_name_problem(path, option) or _output_dir_problem(path, option, markers, overwrite)
    except OSError as err:  # a permission error on a parent, ...
        return f"{option}: cannot use {path}: {err.strerror or err}"


def path_name_problem(path: pathlib.Path, option: str) -> str | None:
    """Why the file system cannot hold ``path``'s name (a NUL character, which a config
    file's string can hold; a component or the whole path too long), or None. Checked up
    front: creating it would fail halfway, after its parents were made."""
    if "\0" in str(path):  # the OS calls raise ValueError, not OSError, for it
        return f"{option}: {str(path)!r} holds a NUL character, which no file name can"
    limit = 255
    with contextlib.suppress(OSError, ValueError):
        limit = os.pathconf(".", "PC_NAME_MAX")
    for part in path.parts:
        if len(os.fsencode(part)) > limit:
            return f"{option}: {path}: the name {part[:24]}... is longer than the file system allows ({limit} bytes)"
    return None


def _output_dir_problem(path: pathlib.Path, option: str, markers: Marker, overwrite: bool) -> str | None:
    if path.is_symlink() and not path.exists():
        return f"{option}: {path} is a symbolic link to nothing ({os.readlink(path)})"
    if path.is_symlink() and overwrite:
        return f"--overwrite: {path} is a symbolic link; give the real directory to replace"
    if path.exists():
        if not path.is_dir():
            return f"{option}: {path} exists and is not a directory"
        if holds_files(path):
            if not any(ours(path / name) for name, ours in markers.items()):  # then --overwrite would not help
                said, what = ("--overwrite", "refusing to delete it") if overwrite else (option, "pick another")
                other = paft_folder(path)
                if other:  # paft's, but another command's: "not paft's output" was wrong
                    return (f"{said}: {path} is {other}, not a folder {option} writes (it holds no "
                            f"{' or '.join(markers)}); {what}")
                return (f"{said}: {path} holds no {' or '.join(markers)} of paft's, so it is not paft's "
                        f"output; {what}")
            if not overwrite and path.is_symlink():  # --overwrite refuses a link (above)
                return (f"{option}: {path} already exists, as a symbolic link to {path.resolve()}; give that "
                        "real directory with --overwrite to replace it")
            if not overwrite:
                return f"{option}: {path} already exists; pass --overwrite to replace it"
        return None if os.access(path, os.W_OK) else f"{option}: {path} is not writable"
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        if parent.is_symlink():  # mkdir would fail on it with "File exists"
            return f"{option}: cannot create {path}: {parent} is a symbolic link to nothing"
        parent = parent.parent
    if not parent.is_dir():
        return f"{option}: cannot create {path}: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{option}: cannot create {path}: {parent} is not writable"
    return None


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder and ``os.replace``
    (:func:`write_together` of one file)."""
    write_together({pathlib.Path(path): data})


def stage_bytes(path: str | os.PathLike[str], data: bytes) -> pathlib.Path:
    """A temp file beside ``path`` holding ``data``, written and synced, for the caller to
    ``os.replace`` onto ``path`` (or remove); none is left when writing it fails. Files
    that must appear together are each staged first: a full disk stops them before any
    old file is replaced."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_UMASK)  # mkstemp makes 0600; results are meant to be shared
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    return pathlib.Path(tmp)


def write_together(contents: dict[pathlib.Path, bytes]) -> None:
    """Write each file of ``contents`` whole, and all of them or none: each is staged
    (:func:`stage_bytes`) before the first replaces its old one, so a full disk or an
    interrupt while writing leaves the old files as they were, and no temp file; then
    renamed into place in ``contents``' order. An ``OSError`` names, as its
    ``filename``, the file it could not write."""
    staged: list[tuple[pathlib.Path, pathlib.Path]] = []
    try:
        for path, data in contents.items():
            try:
                staged.append((path, stage_bytes(path, data)))
            except OSError as err:
                raise OSError(err.errno, err.strerror or str(err), str(path)) from None
        for path, tmp in staged:
            os.replace(tmp, path)
    finally:  # what is not in place (a failure, an interrupt between two renames) leaves no temp
        for _, tmp in staged:
            tmp.unlink(missing_ok=True)


def folders_to_make(path: pathlib.Path) -> list[pathlib.Path]:
    """The folders that creating ``path`` makes, innermost first (none where it exists),
    for :func:`remove_made` to take away again."""
    return [d for d in (path, *path.parents) if not d.exists()]


def remove_made(made: Sequence[pathlib.Path]) -> None:
    """Remove the folders ``made`` (:func:`folders_to_make`'s, innermost first): the
    innermost with all it holds, its parents only while empty (a file put there meanwhile
    stays)."""
    if made:
        shutil.rmtree(made[0], ignore_errors=True)
    for parent in made[1:]:
        with contextlib.suppress(OSError):
            parent.rmdir()


def json_bytes(obj: Any) -> bytes:
    """``obj`` as the indented, key-sorted JSON file paft writes."""
    return (json.dumps(jsonable(obj), indent=2, sort_keys=True) + "\n").encode()


def atomic_write_json(path: str | os.PathLike[str], obj: Any) -> None:
    atomic_write_bytes(path, json_bytes(obj))


def is_file(path: pathlib.Path) -> bool:
    """``path.is_file()``, but False where the file system cannot even look (a name too
    long, a permission error on a parent): the callers' own checks then name the problem."""
    try:
        return path.is_file()
    except OSError:
        return False


def read_utf8(path: pathlib.Path) -> str:
    """``path``'s text; ``ValueError`` naming the file if it is not UTF-8 (damaged)."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}): damaged?") from None


# Keys every paft run's config.json has had: a user's own config.json is not a run's.
_RUN_CONFIG_KEYS = frozenset({"workload", "world_size", "steps", "seed", "inject", "monitor", "protect", "guard"})


def is_run_config(path: pathlib.Path) -> bool:
    """Whether ``path`` is a ``config.json`` that ``paft train`` wrote (what marks a run
    directory that ``--overwrite`` may replace, and ``paft report`` reads)."""
    try:
        data = json.loads(read_utf8(path))
    except (OSError, ValueError):  # missing, unreadable, not UTF-8, not JSON
        return False
    return isinstance(data, dict) and _RUN_CONFIG_KEYS <= data.keys()


def read_jsonl(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a ``.jsonl`` file (missing file: none). A partial last line (a
    writer killed mid-record: no newline after it) is dropped; any other line that is
    not a JSON object, or text that is not UTF-8, raises ``ValueError`` naming the file
    (and line)."""
    p = pathlib.Path(path)
    if not p.exists():
        return []
    text = read_utf8(p)
    lines = text.splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if i == last and not text.endswith("\n"):
                break
            raise ValueError(f"{p}: line {i + 1} is not JSON ({err})") from None
        if not isinstance(record, dict):
            raise ValueError(f"{p}: line {i + 1} is not a JSON object (got {type(record).__name__})")
        records.append(record)
    return records


def console(text: str) -> bool:
    """Print ``text`` to stdout now; ``False``, raising nothing, when the console went
    away (``| head``, a closed terminal): the work goes on, quietly."""
    try:
        print(text, flush=True)
        return True
    except OSError:
        quiet_stdout()
        return False


def jsonl_line(record: dict[str, Any]) -> str:
    """``record`` as one line of a run's jsonl files: keys sorted, non-finite floats as
    :func:`jsonable` writes them."""
    return json.dumps(jsonable(record), sort_keys=True) + "\n"


def quiet_stdout() -> None:
    """Point stdout at /dev/null, so that Python's flush at exit into a closed pipe
    cannot fail."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


def _after_every_event_file(tb: pathlib.Path) -> None:
    """Wait, two seconds at most, until a new TensorBoard event file would sort after
    every one in ``tb``. TensorBoard reads them in name order, and a name starts with
    the writer's start in whole seconds, then host and pid: a resumed leg started in the
    second the interrupted one did could sort first, and its purge_step then came before
    the steps it was to hide (TensorBoard showed them twice). A clock further behind
    than that (another host's) is not waited for."""
    starts = [int(m.group(1)) for f in tb.glob("*tfevents.*") if (m := re.search(r"tfevents\.(\d+)\.", f.name))]
    wait = max(starts, default=0) + 1 - time.time()
    if 0 < wait <= 2:
        time.sleep(wait)


def require_tensorboard(asked_by: str = "--tensorboard") -> None:
    """Raise :class:`ModuleNotFoundError`, naming what asked for TensorBoard (``asked_by``:
    the option, or a library user's ``RunRecorder(tensorboard=True)``) and the pip command,
    where the optional tensorboard package is not installed. A check on the machine, not
    on the options: a saved config with ``--tensorboard`` still reads everywhere."""
    if importlib.util.find_spec("tensorboard") is None:
        raise ModuleNotFoundError(
            f"{asked_by}: needs the tensorboard package, which is not installed: pip install 'paft[tensorboard]'",
            name="tensorboard",
        )


def is_leg_end(record: Mapping[str, Any]) -> bool:
    """Whether an ``events.jsonl`` record says why a leg of a run ended: a failed worker,
    a signal, the guard's stop (paft train's ``stop`` event, and the guard's verdict, all
    a library run has of it). A resume keeps them, though it re-does the steps they name.
    So the file is in the order things happened, not in step order: a kept line comes
    before the resumed leg's lines of the steps it re-does."""
    event = record.get("event")
    return event in ("failed", "interrupted", "stop") or (event == "guard" and record.get("action") == "stop")


SHARED_RECORDS = ("consistency.jsonl", "events.jsonl", "evals.jsonl", "faults.jsonl")
"""A run folder's records shared by the ranks (rank 0 writes them, but faults.jsonl, which
every rank appends to); each rank's own are metrics/rank<r>.jsonl."""


class RunRecorder:
    """Appends this rank's records to the run directory (``None`` run_dir: records dropped).

    Rank 0 writes the shared files (consistency, events, summary); every rank writes
    its own metrics and the faults it injected. ``tensorboard`` without the package is
    refused here (:func:`require_tensorboard`), not at rank 0's first scalar.

    A folder that already holds a run's records is taken only with ``append=True`` (a
    resumed run): two runs' records in one folder would read as one run. ``protect()``
    refuses it on every rank (:attr:`earlier_records`).
    """

    def __init__(
        self, run_dir: str | os.PathLike[str] | None, rank: int, tensorboard: bool = False, quiet: bool = False,
        append: bool = False,
    ) -> None:
        self.run_dir = pathlib.Path(run_dir) if run_dir is not None else None
        self.rank = rank
        self.quiet = quiet
        self._files: dict[str, Any] = {}
        if tensorboard and self.run_dir is not None:
            # Every rank refuses alike (only rank 0 writes tb/): none is left waiting in a
            # collective for a rank 0 that stopped. paft train refused --tensorboard before
            # its workers started, so this names the library's call.
            require_tensorboard("RunRecorder(tensorboard=True)")
        self._tensorboard = tensorboard and rank == 0 and self.run_dir is not None
        self._tb: Any = None  # the SummaryWriter, opened by the first scalar
        self._purge_step: int | None = None
        self._resumed_at: int | None = None  # a resume's step whose later records are still to drop
        self.earlier_records = [] if append or self.run_dir is None else _records_in(self.run_dir)
        """The records of an earlier run found in the folder (without ``append``)."""

    def resumed_at(self, step: int) -> None:
        """A resumed run re-does the steps after ``step``: TensorBoard hides what the
        interrupted leg logged for them (``purge_step``), and :meth:`drop_resumed_steps`
        drops them from the jsonl files. Call before the first record."""
        self._purge_step = step + 1
        self._resumed_at = step

    def drop_resumed_steps(self) -> None:
        """After :meth:`resumed_at`, drop the records of the steps the resumed run
        re-does: this rank's metrics, and on rank 0 the shared files. Every rank calls it
        before any rank records again (a fault another rank appended meanwhile would be
        lost), then a collective: :meth:`paft.protect.Protector.prime` does."""
        step, self._resumed_at = self._resumed_at, None
        if step is None or self.run_dir is None:
            return
        truncate_jsonl(self.run_dir / "metrics" / f"rank{self.rank}.jsonl", step)
        if self.rank == 0:
            for name in SHARED_RECORDS:  # an evaluation at ``step`` came before the checkpoint
                # Why the interrupted leg ended stays: the resume re-does its steps, not its end.
                truncate_jsonl(self.run_dir / name, step + (name == "evals.jsonl"),
                               keep=is_leg_end if name == "events.jsonl" else None)

    def _add_scalars(self, step: int, values: Iterable[tuple[str, float]]) -> None:
        if not self._tensorboard:
            return
        if self._tb is None:
            from torch.utils.tensorboard import SummaryWriter

            assert self.run_dir is not None  # _tensorboard says so
            if self._purge_step is not None:
                _after_every_event_file(self.run_dir / "tb")
            self._tb = SummaryWriter(str(self.run_dir / "tb"), purge_step=self._purge_step)
        for key, value in values:
            self._tb.add_scalar(key, value, step)

    def _append(self, name: str, records: Iterable[dict[str, Any]]) -> None:
        if self.run_dir is None:
            return
        f = self._files.get(name)
        if f is None:
            (self.run_dir / name).parent.mkdir(parents=True, exist_ok=True)  # metrics/
            f = self._files[name] = open(self.run_dir / name, "a", buffering=1)
        for record in records:
            f.write(jsonl_line(record))
        f.flush()

    def say(self, message: str) -> None:
        """A console line from rank 0 (progress, alerts, guard decisions) unless quiet."""
        if self.rank == 0 and not self.quiet:
            self.quiet = not console(message)

    def jsonl(self, name: str, record: dict[str, Any]) -> None:
        """Rank 0 appends ``record`` to ``<run_dir>/<name>``."""
        if self.rank == 0:
            self._append(name, [record])

    def metrics(self, record: dict[str, Any]) -> None:
        self._append(f"metrics/rank{self.rank}.jsonl", [record])

    def faults(self, records: Iterable[dict[str, Any]]) -> None:
        self._append("faults.jsonl", records)

    def consistency(self, record: dict[str, Any]) -> None:
        if self.rank == 0:
            self._append("consistency.jsonl", [record])
            # TensorBoard's step is the number of steps done, as for the training and
            # evaluation scalars: the record of 0-based step t goes to t + 1.
            self._add_scalars(record["step"] + 1, ((key, value) for key, value in record.items()
                                                   if isinstance(value, (int, float)) and "/" in key))

    def event(self, record: dict[str, Any]) -> None:
        if self.rank == 0:
            self._append("events.jsonl", [record])

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._add_scalars(step, values.items())

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def record_files(folder: pathlib.Path) -> list[pathlib.Path]:
    """A run's jsonl records in ``folder`` (the shared ones whether there or not, then
    each rank's metrics found): what a resume reads back and cuts at its step."""
    return [*(folder / name for name in SHARED_RECORDS), *sorted(folder.glob("metrics/rank*.jsonl"))]


def _records_in(folder: pathlib.Path) -> list[str]:
    """The run records in ``folder`` that hold something (names relative to it)."""
    found = record_files(folder) + sorted(folder.glob("tb/events.out.tfevents.*"))
    return [str(path.relative_to(folder)) for path in found if is_file(path) and path.stat().st_size > 0]


def truncate_jsonl(path: str | os.PathLike[str], step: int,
                   keep: Callable[[dict[str, Any]], bool] | None = None) -> None:
    """Drop records with ``step >= step`` (a resumed run re-does those steps), but those
    ``keep`` says to keep."""
    p = pathlib.Path(path)
    if not p.exists():
        return
    _rewrite_jsonl(p, [r for r in read_jsonl(p) if r.get("step", -1) < step or (keep is not None and keep(r))])


def sort_faults(run_dir: str | os.PathLike[str]) -> None:
    """Put ``faults.jsonl``'s lines in (step, attempt, rank) order. The ranks append
    their own lines as they inject, so two identical runs interleaved them differently;
    each rank's lines keep the order it wrote them in (a stable sort), so the file is
    the same for identical runs, and for a resumed run as for the uninterrupted one.
    Call it only once no rank writes any more (a line appended meanwhile would be lost
    with the rewrite); a file that does not read back (damaged) is left as it is."""
    p = pathlib.Path(run_dir) / "faults.jsonl"
    try:
        records = read_jsonl(p)
    except (OSError, ValueError):
        return
    ordered = sorted(records, key=lambda r: (r.get("step", -1), r.get("attempt", 0), r.get("rank", -1)))
    if ordered != records:
        _rewrite_jsonl(p, ordered)


def _rewrite_jsonl(path: pathlib.Path, records: list[dict[str, Any]]) -> None:
    # Each line as RunRecorder wrote it: JSON numbers read back exactly.
    atomic_write_bytes(path, "".join(jsonl_line(r) for r in records).encode())
