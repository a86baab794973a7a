"""The run directory before and between runs: the checks that refuse one, resume's
checks, the checkpoint files, ``config.json``.

Everything here reads or refuses; only :func:`prepare_run_dir` and
:func:`write_config` write, and :func:`remove_checkpoint_temporaries` deletes what
stopped workers left. ``paft train`` claims the directory itself under a lock
(:func:`paft.claim.claim_run_dir`); the training ranks write their checkpoints
(:class:`paft.train.Trainer`) and logs (:class:`paft.records.RunRecorder`) into it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import fcntl
import json
import os
import pathlib
import re
import shutil
import zipfile
from typing import Any, NamedTuple

import torch

from paft.config import TrainConfig
from paft.records import (
    LOCK_FILE,
    atomic_write_json,
    holds_files,
    is_file,
    is_run_config,
    output_dir_problem,
    path_name_problem,
    read_jsonl,
    record_files,
)
from paft.workloads import model_config

__all__ = [
    "FIXED_ON_RESUME",
    "fixed_on_resume_error",
    "RunDirError",
    "default_run_dir",
    "resolve_run_dir",
    "check_run_dir",
    "ResumePoint",
    "has_checkpoint",
    "finished",
    "latest_step",
    "in_use",
    "ranks_inside",
    "records_size",
    "stale_checkpoints",
    "remove_checkpoint_temporaries",
    "checkpoint_candidates",
    "load_checkpoint_file",
    "prepare_run_dir",
    "write_config",
]

_KEEP_CHECKPOINTS = 2


class RunDirError(ValueError):
    """The run directory cannot be used as asked (exists, or nothing to resume)."""


def default_run_dir(name: str, root: str = "runs") -> str:
    """``root/<name>-<time>-<process id>``: the process id keeps runs started in the same
    second apart (``for s in 1 2 3; do paft train --seed $s & done`` collided, and one
    was refused, naming options the user never gave)."""
    return os.path.join(root, f"{name}-{datetime.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}")


# What a resumed run cannot change: its state would not load, or it would be another run.
FIXED_ON_RESUME = (
    ("workload", "--workload"), ("model", "--model"), ("world_size", "--world-size"),
    ("batch_size", "--batch-size"), ("optimizer", "--optimizer"), ("seed", "--seed"),
    ("protect.mode", "--protect"), ("protect.sync_mode", "--sync-mode"), ("guard.enabled", "--guard"),
    # Under --protect dyn, the first period: the checkpoint's scheduler goes on from its own.
    ("protect.sync_period", "--sync-period"),
    # The checkpoint's RNG state replaces the seeding: a changed flag would not take effect.
    ("desync_seed", "--desync-seed"),
    # The epoch under way would be redrawn from another permutation: items repeated or skipped.
    ("desync_shuffle", "--desync-shuffle"),
)


def resolve_run_dir(run_dir: str) -> str:
    """``run_dir`` as the kernel walks it, where the text says otherwise: a leading "~"
    is the home folder (a config file's value, or ``--run-dir=~/x``, which no shell
    expands), and a path with ".." is resolved (symbolic links, then "..") up front, so
    the checks, the folders a run creates and their clean-up all mean the folder its
    files land in ("missing/../a" is ``a`` and creates no ``missing/``; "link/../r" is
    beside the link's target, not beside the link)."""
    run_dir = os.path.expanduser(run_dir)
    return os.path.realpath(run_dir) if ".." in pathlib.PurePath(run_dir).parts else run_dir


class ResumePoint(NamedTuple):
    """The checkpoint a ``--resume`` continues from (the one its workers will load)."""

    step: int
    """Its steps done: the step the resumed leg starts at."""
    schedule: dict[str, Any] | None
    """The sync scheduler's state saved in it (rank 0's, the same on every rank; None
    where the run has none): the period it goes on with, which ``paft train``'s plan says."""


def check_run_dir(cfg: TrainConfig) -> ResumePoint | None:
    """Refuse a run directory that would be overwritten, cannot be created, or cannot be
    resumed as asked. Writes nothing. Returns, for a resume, where it continues from."""
    path = pathlib.Path(cfg.run_dir)
    problem = path_name_problem(path, "--run-dir")
    if problem:
        raise RunDirError(problem)
    try:
        return _check_run_dir(cfg, path)
    except OSError as err:  # e.g. a name too long for the file system
        raise RunDirError(f"--run-dir: cannot use {path}: {err.strerror or err}") from None


def _check_run_dir(cfg: TrainConfig, path: pathlib.Path) -> ResumePoint | None:
    if cfg.resume:
        return _check_resume(cfg, path)
    if path.is_dir() and not path.is_symlink() and not cfg.overwrite:
        _refuse_in_use(path)  # also a folder a run has just taken, its lock alone in it
        if holds_files(path):
            if not is_run_config(path / "config.json"):  # --resume and --overwrite would be refused too
                raise RunDirError(f"--run-dir: {path} holds no config.json of paft's, so it is not a paft run; "
                                  "pick another --run-dir")
            if not has_checkpoint(path):
                raise RunDirError(f"--run-dir: {path} holds a run that stopped before its first checkpoint; "
                                  "pass --overwrite to start it again")
            raise RunDirError(
                f"--run-dir: {path} already exists; pass --resume to continue it or --overwrite to replace it"
            )
    if path.is_symlink() and not cfg.overwrite and is_run_config(path / "config.json"):
        # output_dir_problem would advise --overwrite, which refuses a link.
        raise RunDirError(f"--run-dir: {path} is a symbolic link to a paft run; pass --resume to continue it, "
                          f"or give the real directory ({path.resolve()}) with --overwrite to replace it")
    problem = output_dir_problem(path, "--run-dir", {"config.json": is_run_config}, cfg.overwrite)
    if problem:
        raise RunDirError(problem)
    return None


def stale_checkpoints(folders: list[pathlib.Path], latest: str) -> list[pathlib.Path]:
    """The checkpoint folders to delete once ``latest`` is written: all but the newest
    ``_KEEP_CHECKPOINTS`` up to it, and every one past it. Those are from a timeline a
    resume fell back from (``latest`` was damaged): kept, a damaged newer folder would
    outlive the good ones, each new checkpoint deleting the one before."""
    # By step number: names are padded to 7 digits, and past 9999999 they grow longer.
    ordered, at = sorted(folders, key=lambda f: _step_of(f.name)), _step_of(latest)
    upto = [f for f in ordered if _step_of(f.name) <= at]
    return upto[:-_KEEP_CHECKPOINTS] + [f for f in ordered if _step_of(f.name) > at]


# What atomic_write_bytes leaves of a checkpoint file when its writer is killed
# (mkstemp's name: "." + the file's name + "." + 8 characters).
_CHECKPOINT_TEMPORARY = re.compile(r"\.(rank\d+\.pt|latest)\.[a-z0-9_]{8}")


def remove_checkpoint_temporaries(run_dir: pathlib.Path) -> None:
    """Delete what workers stopped while writing a checkpoint left in ``run_dir``: the
    temporaries of their ``rank{r}.pt`` and ``latest`` (no resume reads them; they
    stayed until a resume's next checkpoint pruned their folder, or for good beside
    ``latest``), then the step folders left empty (that one's, or one rank 0 was
    pruning). A complete file is never touched. Call it only once no worker writes
    any more."""
    root = run_dir / "checkpoints"
    for path in (*root.glob(".latest.*"), *root.glob("step*/.rank*.pt.*")):
        if _CHECKPOINT_TEMPORARY.fullmatch(path.name):
            with contextlib.suppress(OSError):
                path.unlink()
    for folder in root.glob("step*"):
        with contextlib.suppress(OSError):  # not empty (or not a folder): it stays
            folder.rmdir()


def _step_of(name: str) -> int:
    """The step of a checkpoint folder's name (``step0000040`` -> 40); -1 for another name."""
    return int(name[4:]) if _CHECKPOINT_NAME.fullmatch(name) else -1


def latest_step(run_dir: pathlib.Path) -> int:
    """The step a ``--resume`` of ``run_dir`` starts at, that of the checkpoint
    ``checkpoints/latest`` names; 0 where none reads (:func:`check_run_dir` refuses to
    resume such a folder)."""
    try:
        return max(0, _step_of(checkpoint_candidates(run_dir / "checkpoints")[0]))
    except RunDirError:
        return 0


def has_checkpoint(run_dir: pathlib.Path) -> bool:
    """Whether ``run_dir`` holds a checkpoint to resume (``checkpoints/latest``); False
    where the file system cannot look (:func:`check_run_dir` names such errors)."""
    return is_file(run_dir / "checkpoints" / "latest")


def in_use(run_dir: pathlib.Path) -> bool:
    """Whether a paft train holds ``run_dir``'s lock now, or a torchrun rank of one is
    still inside it (probes: each lock taken and let go)."""
    try:
        with open(run_dir / LOCK_FILE, "rb") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # no lock file, or a file system without flock
        pass
    return ranks_inside(run_dir)


def ranks_inside(run_dir: pathlib.Path) -> bool:
    """Whether a rank of a torchrun run is still inside ``run_dir`` (a probe). Each
    rank holds a shared flock on the directory itself until it is out
    (:func:`paft.claim.last_rank_out_tidies`): rank 0, the holder of :data:`LOCK_FILE`,
    waits for its peers to be out only so long, and one may still be tidying or writing
    when it has gone. (A probe that lands between the last rank's letting go and its
    try for the exclusive lock makes that rank leave its run untidied: a window of
    microseconds.)"""
    try:
        handle = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # missing, or not a directory
        return False
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:  # a file system without flock
        return False
    finally:
        os.close(handle)  # lets the probe's lock go
    return False


def records_size(run_dir: pathlib.Path) -> int:
    """Bytes of rank 0's per-step records (``metrics/rank0.jsonl``; 0 without): grows by
    a line with every step trained, so a caller tells whether a run got anywhere."""
    try:
        return (run_dir / "metrics" / "rank0.jsonl").stat().st_size
    except OSError:
        return 0


def _refuse_in_use(path: pathlib.Path) -> None:
    """Refuse ``path`` while a run holds it: before its first checkpoint a run in progress
    looks like one that stopped, and the advice for that (``--overwrite``) would be refused
    as in use in turn."""
    if in_use(path):
        raise RunDirError(f"--run-dir: {path} is in use by another paft train (a run in progress); "
                          "wait for it to end or pick another --run-dir")


def _check_resume(cfg: TrainConfig, path: pathlib.Path) -> ResumePoint:
    if not has_checkpoint(path):
        _refuse_in_use(path)
        if not path.exists():
            raise RunDirError(f"--resume: {path} does not exist; leave out --resume to start a run there")
        if not path.is_dir():
            raise RunDirError(f"--resume: {path} is not a directory, let alone a run's")
        if not is_run_config(path / "config.json"):
            raise RunDirError(f"--resume: {path} holds no paft run (no config.json of paft's)")
        raise RunDirError(f"--resume: no checkpoint to resume in {path} (checkpoints/latest is missing); "
                          "pass --overwrite instead of --resume to start it again")
    try:
        saved = TrainConfig.from_dict(json.loads((path / "config.json").read_text(encoding="utf-8"))).to_dict()
    except (OSError, ValueError, TypeError, AttributeError) as err:
        raise RunDirError(f"--resume: cannot read {path / 'config.json'}: {err}") from None
    _check_fixed(saved, cfg.to_dict(), str(path))
    _check_logs(path)
    root = path / "checkpoints"
    name, rank0 = _intact_checkpoint(root, cfg.world_size)
    # The checkpoint's own options (config.json is a user's to edit, by hand or by a
    # resume's options): a changed seed went on silently, a changed optimizer failed in
    # a worker. Checkpoints written before they held it have only config.json's word.
    held = rank0.get("config")
    if isinstance(held, dict):
        try:
            trained = TrainConfig.from_dict(held).to_dict()
        except (ValueError, TypeError, AttributeError) as err:
            raise RunDirError(f"--resume: {root / name / 'rank0.pt'} holds unreadable options: {err}") from None
        # config.json passed the check above, so it no longer says what the run trained with.
        _check_fixed(trained, cfg.to_dict(), f"its checkpoint {name}", why=f": {path / 'config.json'} was edited since")
    done = _step_of(name)
    # A run stopped after its final checkpoint but before summary.json only lacks the
    # summary: resuming it at the same --steps writes it (Trainer.train trains nothing).
    if done > cfg.steps or (done == cfg.steps and finished(path, done)):
        raise RunDirError(
            f"--resume: {path} has trained {done} steps already (--steps {cfg.steps}); "
            f"pass --steps above {done} to train on"
        )
    protector = rank0["protector"]
    schedule = protector.get("scheduler") if isinstance(protector, dict) else None
    return ResumePoint(done, schedule if isinstance(schedule, dict) else None)


def _check_logs(path: pathlib.Path) -> None:
    """Refuse a resume of run directory ``path`` whose logs do not read: the resume reads
    them back and cuts them at the checkpoint's step."""
    for log in record_files(path):
        try:
            read_jsonl(log)
        except ValueError as err:
            raise RunDirError(f"--resume: {err}") from None


def _intact_checkpoint(root: pathlib.Path, world_size: int) -> tuple[str, dict[str, Any]]:
    """The checkpoint folder in ``root`` the workers will resume from, and its rank 0
    file (tensors memory-mapped): the newest with every rank's file intact. The workers
    fall back from a damaged latest checkpoint to older ones; this checks, before
    config.json is rewritten, that one of them will do."""
    names = checkpoint_candidates(root)
    damaged: dict[str, list[int]] = {}
    for name in names:  # newest first, as the workers try them
        files = {r: _intact(root / name / f"rank{r}.pt") for r in range(world_size)}
        damaged[name] = [r for r, state in files.items() if state is None]
        rank0 = files[0]
        if rank0 is not None and not damaged[name]:
            return name, rank0
    raise RunDirError(f"--resume: no checkpoint in {root} has an intact file for every rank "
                      f"({names[0]}: rank(s) {damaged[names[0]]} missing or damaged)")


def _check_fixed(saved: dict[str, Any], asked: dict[str, Any], where: str, why: str = "") -> None:
    """Refuse a resume that changes an option of :data:`FIXED_ON_RESUME` (config dicts);
    ``why`` tells where a change that passed the command line's check came from."""
    # Compare what takes effect: model fields at their defaults, no sync mode without a
    # sync, a sync period only as PAFT-Dyn's first (PAFT-Sync's and the averager's may change).
    for d in (saved, asked):
        d["model"] = dataclasses.asdict(model_config(d["workload"], d["model"]))
        if d["protect"]["mode"] not in ("sync", "dyn"):
            d["protect"]["sync_mode"] = None
        if d["protect"]["mode"] != "dyn":
            d["protect"]["sync_period"] = None
    for key, flag in FIXED_ON_RESUME:
        was, now = saved, asked
        for part in key.split("."):
            was, now = was[part], now[part]
        if was != now:
            if isinstance(was, dict):  # name only the fields that differ
                keys = sorted(k for k in was.keys() | now.keys() if was.get(k) != now.get(k))
                was, now = ({k: d.get(k) for k in keys} for d in (was, now))
            raise fixed_on_resume_error(flag, was, now, where, why)


def fixed_on_resume_error(flag: str, was: Any, now: Any, where: str, why: str = "") -> RunDirError:
    """The refusal of a resume that changes ``flag``, one of :data:`FIXED_ON_RESUME`'s (saved
    ``was`` in ``where``, ``now`` asked), in the one wording of both checks: the command
    line's before the config is built (:mod:`paft.options`) and this module's after."""
    return RunDirError(f"--resume: cannot change {flag} ({was!r} in {where}, {now!r} asked{why}); start a new run")


def finished(path: pathlib.Path, steps: int) -> bool:
    """Whether the run in ``path`` trained its ``steps`` steps and wrote ``summary.json``:
    a ``--resume`` of it at those ``--steps`` is refused (one stopped after its final
    checkpoint but before the summary is not: it only writes the summary). Its last
    checkpoint must be of ``steps`` too: a resume keeps the summary of the leg before it
    until it ends, and one that fell back from a damaged final checkpoint trains again."""
    return _summary_steps(path) == steps and latest_step(path) == steps


def _summary_steps(path: pathlib.Path) -> int | None:
    """The steps ``summary.json`` in run directory ``path`` reports; None where it is
    missing or unreadable (an interrupted end: the resume rewrites it)."""
    try:
        steps = json.loads((path / "summary.json").read_text(encoding="utf-8"))["steps"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return steps if isinstance(steps, int) else None


_CHECKPOINT_NAME = re.compile(r"step\d+")


def checkpoint_candidates(root: pathlib.Path) -> list[str]:
    """Checkpoint folders in the order a resume tries them: the one ``latest`` names,
    then the older ones, newest first."""
    try:
        latest = (root / "latest").read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError) as err:
        raise RunDirError(f"--resume: cannot read {root / 'latest'}: {err}") from None
    if not _CHECKPOINT_NAME.fullmatch(latest):
        raise RunDirError(f"--resume: {root / 'latest'} names {latest[:40]!r}, not a checkpoint folder (stepNNNNNNN)")
    older = (p.name for p in root.glob("step*") if 0 <= _step_of(p.name) < _step_of(latest))
    return [latest, *sorted(older, key=_step_of, reverse=True)]


_CHECKPOINT_KEYS = frozenset({"step", "model", "optimizer", "scheduler", "sampler", "protector", "rng_cpu"})


def load_checkpoint_file(path: pathlib.Path, mmap: bool = False) -> dict[str, Any]:
    """One rank's checkpoint; ``ValueError`` if it is not a paft checkpoint (truncated,
    another zip, another torch file) or any byte differs from the CRC-32 torch.save
    wrote beside it (torch.load does not check them: damage inside a tensor loaded as
    wrong values). With ``mmap`` the tensors are not loaded, only read once for the
    check."""
    if not path.is_file():
        raise ValueError(f"{path} is missing")
    try:
        zipped = zipfile.is_zipfile(path)  # torch.save's format ends in a zip directory
        if zipped:
            with zipfile.ZipFile(path) as archive:
                folder = next((r.filename for r in archive.infolist() if r.external_attr & _MSDOS_FOLDER), None)
                bad = archive.testzip()
    except OSError:
        raise
    except Exception as err:  # a damaged zip directory: not only BadZipFile (NotImplementedError, UnicodeDecodeError)
        raise ValueError(f"{path}: {type(err).__name__}: {err}") from None
    if not zipped:
        raise ValueError(f"{path} is not a torch checkpoint (truncated or overwritten)")
    if folder is not None:
        raise ValueError(f"{path} is damaged (its zip directory marks {folder} as a folder)")
    if bad is not None:
        raise ValueError(f"{path} is damaged ({bad} does not match its CRC-32)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:
        raise ValueError(f"{path}: {type(err).__name__}: {err}") from None
    if not isinstance(state, dict) or not _CHECKPOINT_KEYS <= state.keys():
        raise ValueError(f"{path} is a torch file but not a paft checkpoint")
    return state


# The MS-DOS folder bit of a zip entry's attributes. zipfile's testzip reads such an entry's
# bytes and checks them; torch's reader (miniz) takes it for a folder and reads nothing, so
# one flipped bit there loaded that tensor as uninitialized memory, silently.
_MSDOS_FOLDER = 0x10


def _intact(path: pathlib.Path) -> dict[str, Any] | None:
    """A checkpoint file the workers will load (see :func:`load_checkpoint_file`),
    checked without loading its tensors (memory-mapped); ``None`` if it is not one."""
    try:
        return load_checkpoint_file(path, mmap=True)
    except (OSError, ValueError):
        return None


def prepare_run_dir(cfg: TrainConfig) -> pathlib.Path:
    """Create (or, with --overwrite, replace) the run directory and write ``config.json``:
    for benchmarks and tests, which own their folders. ``paft train`` and its torchrun
    form claim the directory under a lock instead (:func:`paft.claim.claim_run_dir`)."""
    path = pathlib.Path(cfg.run_dir)
    try:
        if cfg.overwrite and path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise RunDirError(f"--run-dir: cannot write {path}: {err.strerror or err}") from None
    write_config(cfg)
    return path


def write_config(cfg: TrainConfig) -> None:
    """Write ``config.json`` into the existing run directory; on --resume, the options
    the run continues under."""
    try:
        atomic_write_json(pathlib.Path(cfg.run_dir) / "config.json", cfg.to_dict())
    except OSError as err:
        raise RunDirError(f"--run-dir: cannot write {cfg.run_dir}: {err.strerror or err}") from None
