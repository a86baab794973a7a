"""Start N local workers for one run through torch's elastic launcher.

``paft train`` validates everything first (options, config file, run directory), so
bad input never starts a worker or leaves a directory behind; then it creates the
run directory and hands :func:`paft.train.run_worker` to
``torch.distributed.launcher.api.elastic_launch`` (the machinery behind torchrun:
c10d rendezvous on a free local port, one process per rank, failures propagated).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import pathlib
import shutil
import signal
import sys
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from paft.config import TrainConfig
from paft.records import atomic_write_bytes, console
from paft.rundir import (
    LOCK_FILE,
    RunDirError,
    check_run_dir,
    default_run_dir,
    has_checkpoint,
    records_size,
    resolve_run_dir,
    write_config,
)
from paft.train import EXIT_PERSISTENT_FAULT, check_devices, format_summary, run_worker

__all__ = [
    "TERMINATING_SIGNALS",
    "claim_run_dir",
    "ignore_further_signals",
    "interrupted",
    "launch",
    "local_workers",
    "on_sigterm",
    "set_aside",
    "settle",
    "unwind_on_termination",
    "EXIT_WORKER_FAILED",
]

EXIT_WORKER_FAILED = 1


def launch(cfg: TrainConfig) -> int:
    """Run ``cfg`` on ``cfg.world_size`` local workers; returns the exit code.

    Raises :class:`paft.rundir.RunDirError` or :class:`paft.train.DeviceError` (before
    anything is written) when the run directory or the devices cannot be used.

    A new run that fails or is interrupted before it trained a step leaves nothing
    behind; one that trained steps keeps its records (what ``paft report`` reads: they
    may explain the failure), even before its first checkpoint, when ``--resume``
    cannot continue it. ``--overwrite`` moves the old run aside instead of deleting it,
    and deletes it only once the new run has finished or written its first checkpoint;
    when the new run stops before that, the old run is moved back. A ``--resume``
    that stops before its next checkpoint leaves ``config.json`` as it was: the
    options of the checkpoint a later plain ``--resume`` goes on from.
    """
    cfg.run_dir = resolve_run_dir(cfg.run_dir or default_run_dir(cfg.workload))
    check_devices(cfg)
    check_run_dir(cfg)
    with claim_run_dir(cfg) as outcome:
        code = _run_workers(cfg)
        outcome["code"] = code
        return code


@contextlib.contextmanager
def claim_run_dir(cfg: TrainConfig, prog: str = "paft train") -> Iterator[dict[str, int]]:
    """Hold ``cfg.run_dir`` for one run (``paft train``, and rank 0 under torchrun).

    An existing directory (``--resume``, ``--overwrite``) is locked first: not while
    another run uses it. ``--overwrite`` moves it aside; a new directory is created
    exclusively, so a directory another start created meanwhile is never taken (nor
    removed), and locked before anything is written; then ``config.json``. The caller
    sets ``outcome["code"]`` to its exit code; on the way out what :func:`launch`
    describes is settled. ``cfg.run_dir`` holds no ".."
    (callers pass it through :func:`~paft.rundir.resolve_run_dir`), so the folders it
    creates are the path's missing prefixes as written.
    """
    run_dir = pathlib.Path(cfg.run_dir)
    outcome = {"code": EXIT_WORKER_FAILED}
    with contextlib.ExitStack() as locks:
        existed = run_dir.is_dir()
        # The folders this run creates, innermost first: an early stop removes them again.
        made = [] if existed else [d for d in (run_dir, *run_dir.parents) if not d.exists()]
        if existed:
            locks.enter_context(_lock(run_dir))
        replaced = set_aside(run_dir) if cfg.overwrite else None
        if replaced is not None or not existed:
            try:
                _create(run_dir)
                locks.enter_context(_lock(run_dir))
            except RunDirError:
                if replaced is not None:
                    settle(replaced, run_dir, keep_new=False, prog=prog)
                raise
        elif not cfg.resume and any(p.name != LOCK_FILE for p in run_dir.iterdir()):
            # An empty folder taken for a new run: another start filled it since the check.
            raise RunDirError(f"--run-dir: {run_dir} was just filled by another paft train; pick another --run-dir")
        saved = (run_dir / "config.json").read_bytes() if cfg.resume else b""  # resume checked it
        latest, recorded = _latest(run_dir), records_size(run_dir)
        try:
            write_config(cfg)  # on --resume: the options the run goes on with
            yield outcome
        finally:
            ended = outcome["code"] in (0, EXIT_PERSISTENT_FAULT)
            if cfg.resume:
                # The options belong with the checkpoint: a resume goes on from there.
                if not ended and _latest(run_dir) == latest:
                    atomic_write_bytes(run_dir / "config.json", saved)
                    print(f"{prog}: the resumed run stopped before a checkpoint: {run_dir}/config.json keeps "
                          "the options of its last one", file=sys.stderr)
            else:
                _settle_new_run(run_dir, made, replaced, ended, records_size(run_dir) > recorded, prog)


def _latest(run_dir: pathlib.Path) -> tuple[int, ...]:
    """Which ``checkpoints/latest`` file is there (() without one): it is replaced whole
    with each checkpoint, and a resume that fell back from a damaged one writes the
    same name again, so its name alone cannot tell."""
    try:
        st = os.stat(run_dir / "checkpoints" / "latest")
    except OSError:
        return ()
    return st.st_dev, st.st_ino, st.st_mtime_ns


def _settle_new_run(run_dir: pathlib.Path, made: list[pathlib.Path], replaced: pathlib.Path | None, ended: bool,
                    trained: bool, prog: str) -> None:
    """Keep a new run that ended, checkpointed, or (not replacing another) trained a
    step; remove it otherwise. Then delete the run it replaced, or move that one back."""
    resumable = ended or has_checkpoint(run_dir)
    keep = resumable or (trained and replaced is None)
    if not keep:
        _remove_new_run(run_dir, made if replaced is None else [run_dir])
        what = f"{run_dir} was removed" if made or replaced is not None else f"what it wrote in {run_dir} was removed"
        print(f"{prog}: the run stopped before {'its first checkpoint' if trained else 'a step'}; {what}",
              file=sys.stderr)
    elif not resumable:
        print(f"{prog}: the run stopped before its first checkpoint; its records stay in {run_dir} "
              f"(paft report {run_dir}); --resume cannot continue it, --overwrite starts it again",
              file=sys.stderr)
    if replaced is not None:
        settle(replaced, run_dir, keep_new=keep, prog=prog)


def _remove_new_run(run_dir: pathlib.Path, made: list[pathlib.Path]) -> None:
    """Remove what a run that cannot be resumed wrote: the folders it created (``made``,
    innermost first; parents only while empty), or, in an empty folder it was given, the
    files it wrote (the folder is the user's)."""
    if not made:
        for child in run_dir.iterdir():
            shutil.rmtree(child, ignore_errors=True) if child.is_dir() else child.unlink(missing_ok=True)
        return
    shutil.rmtree(made[0], ignore_errors=True)
    for parent in made[1:]:
        with contextlib.suppress(OSError):  # a file was put there meanwhile: it stays
            parent.rmdir()


def _create(run_dir: pathlib.Path) -> None:
    try:
        run_dir.mkdir(parents=True)
    except FileExistsError:
        raise RunDirError(f"--run-dir: {run_dir} was just created by another paft train; "
                          "pick another --run-dir") from None
    except OSError as err:
        raise RunDirError(f"--run-dir: cannot create {run_dir}: {err.strerror or err}") from None


@contextlib.contextmanager
def _lock(run_dir: pathlib.Path) -> Iterator[None]:
    """Hold ``run_dir/.lock`` (an advisory flock, released when the process ends, however
    it ends): a second ``paft train --resume`` or ``--overwrite`` of a run in progress
    would interleave two runs' records in one directory."""
    try:
        handle = open(run_dir / LOCK_FILE, "a+")  # noqa: SIM115 - held open for the run
    except OSError as err:
        raise RunDirError(f"--run-dir: cannot write {run_dir}: {err.strerror or err}") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirError(f"--run-dir: {run_dir} is in use by another paft train; wait for it to end "
                              "or pick another --run-dir") from None
        except OSError as err:  # a file system without flock (some network and FUSE mounts)
            print(f"paft train: warning: cannot lock {run_dir} ({err.strerror or err}); "
                  "nothing stops a second paft train from using it meanwhile", file=sys.stderr)
        yield


def on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (a scheduler's, ``kill``), SIGHUP and SIGQUIT unwind like Ctrl-C, so the clean-up in
    :func:`launch` runs: without it, a run killed while starting lost the run that
    ``--overwrite`` had moved aside, and left a directory holding only config.json.
    (torch's elastic launcher installs its own handler while the workers run, which
    raises the same exception.)"""
    raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))


# What torch's elastic launcher itself turns into an unwind (with SIGINT, which Python does).
TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def unwind_on_termination() -> None:
    """Install :func:`on_sigterm` for SIGTERM, SIGHUP (a closed terminal or ssh session)
    and SIGQUIT: their default action killed the process before its clean-up ran."""
    for sig in TERMINATING_SIGNALS:
        signal.signal(sig, on_sigterm)


def ignore_further_signals() -> None:
    """After an interrupt: one signal is enough, a second one (a key held, a group
    signalled twice) would only interrupt torch's exit handlers, with tracebacks."""
    for sig in (signal.SIGINT, *TERMINATING_SIGNALS):
        signal.signal(sig, signal.SIG_IGN)


def interrupted(err: BaseException, hint: str = "", prog: str = "paft train", say: bool = True) -> int:
    """Say (unless ``say`` is false) that the run was interrupted, and by what; the exit
    code the shell uses for that signal (130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP)."""
    sig = err.sigval if isinstance(err, SignalException) else signal.SIGINT
    what = "Ctrl-C" if sig == signal.SIGINT else signal.Signals(sig).name
    if say:
        print(f"\n{prog}: interrupted ({what}){hint}", file=sys.stderr)
    return 128 + int(sig)


def set_aside(run_dir: pathlib.Path) -> pathlib.Path | None:
    """Move an existing run directory to a sibling ``<name>.replaced-<id>`` (a rename:
    instant, same disk)."""
    if not run_dir.exists():
        return None
    real = run_dir.resolve()
    if real == pathlib.Path.cwd().resolve() or real in pathlib.Path.cwd().resolve().parents:
        raise RunDirError(f"--overwrite: {run_dir} is the working directory (or holds it); "
                          "give the run directory's path from its parent")
    aside = real.with_name(f"{real.name}.replaced-{uuid.uuid4().hex[:8]}")
    try:
        real.rename(aside)
    except OSError as err:
        raise RunDirError(f"--overwrite: cannot move {run_dir} aside: {err.strerror or err}") from None
    return aside


def settle(aside: pathlib.Path, run_dir: pathlib.Path, keep_new: bool, prog: str = "paft train") -> None:
    """Delete the replaced output once the new one is kept; else move it back (the new
    one's directory is gone by then)."""
    if keep_new:
        shutil.rmtree(aside, ignore_errors=True)
        return
    try:
        aside.rename(run_dir)
        print(f"{prog}: the output it was to replace is back in {run_dir}", file=sys.stderr)
    except OSError as err:
        print(f"{prog}: the output it was to replace is kept in {aside} (moving it back to {run_dir} "
              f"failed: {err.strerror or err})", file=sys.stderr)


def local_workers(entry: Callable[..., Any], world_size: int, name: str = "paft") -> Callable[..., dict[int, Any]]:
    """``entry`` as torchrun would start it on ``world_size`` local workers: call the
    result with ``entry``'s arguments; it returns rank -> ``entry``'s return value, or
    raises ``ChildFailedError`` when a worker fails (no restarts). ``entry`` must be a
    module-level function (the workers are spawned) that sets up its process group."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"{name}-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port, taken at bind time: no race between runs
        max_restarts=0,
        start_method="spawn",
    )
    return elastic_launch(config, entry)


def _run_workers(cfg: TrainConfig) -> int:
    try:
        results = local_workers(run_worker, cfg.world_size)(cfg.to_dict(), cfg.run_dir)
    except ChildFailedError as err:
        kept = ""
        if has_checkpoint(pathlib.Path(cfg.run_dir)):
            kept = f"; {cfg.run_dir} keeps its checkpoints (--resume continues from the last)"
        print(f"paft train: a worker failed (its traceback is above){kept}\n{err}", file=sys.stderr)
        return EXIT_WORKER_FAILED
    except (KeyboardInterrupt, SignalException) as err:
        hint = ""
        if has_checkpoint(pathlib.Path(cfg.run_dir)):
            hint = f"; to continue from the last checkpoint: paft train --run-dir {cfg.run_dir} --resume"
        return interrupted(err, hint)
    first = results[0]
    if first["status"] == "persistent_fault":
        print(f"paft train: {first['message']}", file=sys.stderr)
        return EXIT_PERSISTENT_FAULT
    console(format_summary(first["summary"], cfg.run_dir))
    return 0
