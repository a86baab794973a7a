"""Holding a run directory for one run, and settling it once the run's workers are gone.

``paft train``'s launcher, and rank 0 under torchrun, claim the run directory
(:func:`claim_run_dir`): locked (:func:`hold_dir_lock`: not while another run uses it),
an old run moved aside for ``--overwrite`` (:func:`set_aside`) and deleted or moved back
once the new one is settled (:func:`settle`), a run that stopped before its first step
or checkpoint removed again. Under torchrun each rank also holds the directory while it
runs, and the last one out tidies it (:func:`last_rank_out_tidies`). ``paft bench``
holds its ``--out`` folder the same way. The rules in prose: docs/RUN-DIRECTORY.md.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import shlex
import shutil
import sys
import uuid
from collections.abc import Iterator

from paft.config import TrainConfig
from paft.exitcodes import EXIT_PERSISTENT_FAULT, EXIT_WORKER_FAILED
from paft.records import LOCK_FILE, atomic_write_bytes, folders_to_make, holds_files, remove_made, sort_faults
from paft.rundir import (
    RunDirError,
    has_checkpoint,
    ranks_inside,
    records_size,
    remove_checkpoint_temporaries,
    write_config,
)
from paft.signals import SignalHold

__all__ = [
    "claim_run_dir",
    "hold_dir_lock",
    "last_rank_out_tidies",
    "set_aside",
    "settle",
    "tidy_after_workers",
]


@contextlib.contextmanager
def claim_run_dir(cfg: TrainConfig, prog: str = "paft train") -> Iterator[dict[str, int]]:
    """Hold ``cfg.run_dir`` for one run (``paft train``, and rank 0 under torchrun).

    An existing directory (``--resume``, ``--overwrite``) is locked first: not while
    another run uses it. ``--overwrite`` moves it aside; a new directory is created
    exclusively, so a directory another start created meanwhile is never taken (nor
    removed), and locked before anything is written; then ``config.json``. The caller
    sets ``outcome["code"]`` to its exit code; on the way out the directory is settled.
    ``cfg.run_dir`` holds no ".." (callers pass it through
    :func:`~paft.rundir.resolve_run_dir`), so the folders it creates are the path's
    missing prefixes as written.

    A new run that fails or is interrupted before it trained a step leaves nothing
    behind; one that trained steps keeps its records (what ``paft report`` reads: they
    may explain the failure), even before its first checkpoint, when ``--resume``
    cannot continue it. ``--overwrite`` moves the old run aside instead of deleting it,
    and deletes it only once the new run has finished or written its first checkpoint;
    when the new run stops before that, the old run is moved back. A ``--resume``
    that stops before its next checkpoint leaves ``config.json`` as it was: the
    options of the checkpoint a later plain ``--resume`` goes on from.
    """
    run_dir = pathlib.Path(cfg.run_dir)
    outcome = {"code": EXIT_WORKER_FAILED}
    with contextlib.ExitStack() as locks:
        # Between moving an old run aside and settling it, a signal is held until the
        # settling code runs: one landing in between left the old run aside for good.
        hold = SignalHold()
        try:
            made, replaced = _take_run_dir(cfg, run_dir, locks, prog)
            saved = (run_dir / "config.json").read_bytes() if cfg.resume else b""  # resume checked it
            latest, recorded = _latest(run_dir), records_size(run_dir)
        except BaseException:
            hold.release()
            raise
        rewritten = False  # config.json: written whole or not at all
        try:
            hold.release()  # a signal held since the set-up unwinds from here, through the settling below
            write_config(cfg)  # on --resume: the options the run goes on with
            rewritten = True
            yield outcome
        finally:
            # Settling (moving the old run back, or deleting it) must not stop halfway: an
            # interrupted delete left a half-deleted ".replaced-" folder.
            with SignalHold():
                ended = outcome["code"] in (0, EXIT_PERSISTENT_FAULT)
                if cfg.resume:
                    # The options belong with the checkpoint: a resume goes on from there (also
                    # after the guard stopped it, exit 3: a later --resume goes on from the last).
                    if rewritten and outcome["code"] != 0 and _latest(run_dir) == latest:
                        _put_back_config(run_dir, saved, prog)
                else:
                    _settle_new_run(run_dir, made, replaced, ended, records_size(run_dir) > recorded, prog)


def _put_back_config(run_dir: pathlib.Path, saved: bytes, prog: str) -> None:
    """Put back the ``config.json`` of the last checkpoint (``saved``) after a resume that
    stopped before its next one; where it cannot be written (a full disk: perhaps what
    stopped the run), say so instead of raising over the run's own account of its stop."""
    try:
        atomic_write_bytes(run_dir / "config.json", saved)
    except OSError as err:
        print(f"{prog}: warning: the resumed run stopped before a checkpoint, but {run_dir}/config.json could "
              f"not be put back to its last one's options ({err.strerror or err}): it holds this resume's",
              file=sys.stderr)
        return
    print(f"{prog}: the resumed run stopped before a checkpoint: {run_dir}/config.json keeps "
          "the options of its last one", file=sys.stderr)


def _take_run_dir(cfg: TrainConfig, run_dir: pathlib.Path, locks: contextlib.ExitStack,
                  prog: str) -> tuple[list[pathlib.Path], pathlib.Path | None]:
    """Lock ``run_dir`` (an existing one first), set an old run aside (``--overwrite``)
    and create the new directory; returns the folders created (innermost first) and
    where the old run went (``None``: nothing set aside)."""
    existed = run_dir.is_dir()
    # The folders this run creates, innermost first: an early stop removes them again.
    made = [] if existed else folders_to_make(run_dir)
    if existed:
        locks.enter_context(hold_dir_lock(run_dir))
    # An empty folder (but for the lock just taken) holds nothing to set aside: --overwrite
    # runs in it as a new run does (set aside, it came back with the lock in it).
    holds = existed and holds_files(run_dir)
    replaced = set_aside(run_dir) if cfg.overwrite and holds else None
    if replaced is not None or not existed:
        try:
            _create(run_dir)
            locks.enter_context(hold_dir_lock(run_dir))
        except RunDirError:
            if replaced is not None:
                settle(replaced, run_dir, keep_new=False, prog=prog)
            raise
    elif not cfg.resume and holds:
        # An empty folder taken for a new run: another start filled it since the check.
        raise RunDirError(f"--run-dir: {run_dir} was just filled by another paft train; pick another --run-dir")
    return made, replaced


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
        # The report command as this one was run: where the paft script may not be on PATH
        # (python -m paft train, or python -m paft.train under torchrun), python -m paft report.
        report = "paft report" if prog == "paft train" else "python -m paft report"
        print(f"{prog}: the run stopped before its first checkpoint; its records stay in {run_dir} "
              f"({report} {shlex.quote(str(run_dir))}); --resume cannot continue it, --overwrite starts it again",
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
    remove_made(made)


def _create(run_dir: pathlib.Path) -> None:
    try:
        run_dir.mkdir(parents=True)
    except FileExistsError:
        raise RunDirError(f"--run-dir: {run_dir} was just created by another paft train; "
                          "pick another --run-dir") from None
    except OSError as err:
        raise RunDirError(f"--run-dir: cannot create {run_dir}: {err.strerror or err}") from None


@contextlib.contextmanager
def hold_dir_lock(run_dir: pathlib.Path, option: str = "--run-dir", prog: str = "paft train") -> Iterator[None]:
    """Hold ``run_dir/.lock`` (an advisory flock, released when the process ends, however
    it ends): a second ``paft train --resume`` or ``--overwrite`` of a run in progress
    would interleave two runs' records in one directory (two benchmarks' too). Refused
    also while a torchrun rank is still inside ``run_dir``: its rank 0, which held the
    lock, may have gone before a peer it stopped waiting for (:func:`paft.launch._peers_out_first`)
    finished writing and tidying (:func:`~paft.rundir.ranks_inside`)."""
    try:
        handle = open(run_dir / LOCK_FILE, "a+")
    except OSError as err:
        raise RunDirError(f"{option}: cannot write {run_dir}: {err.strerror or err}") from None
    with handle:
        busy = False
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            busy = True
        except OSError as err:  # a file system without flock (some network and FUSE mounts)
            print(f"{prog}: warning: cannot lock {run_dir} ({err.strerror or err}); "
                  f"nothing stops a second {prog} from using it meanwhile", file=sys.stderr)
        # Probed once the lock is held: a rank enters only while its rank 0 holds it.
        if busy or ranks_inside(run_dir):
            raise RunDirError(f"{option}: {run_dir} is in use by another {prog}; wait for it to end "
                              f"or pick another {option}")
        yield


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


def tidy_after_workers(run_dir: pathlib.Path, prog: str = "paft train") -> None:
    """Once no worker writes to ``run_dir`` any more: the temporaries of a checkpoint a
    worker was writing when it was stopped are removed, and a failed or interrupted run's
    faults are put in order too (rank 0 does it at a run's end). A full disk, which may
    be what stopped the run, leaves the faults as written, with a warning: its OSError
    was a traceback after the run's own account, and left the temporaries behind."""
    remove_checkpoint_temporaries(run_dir)  # first: the space they free may be what the rewrite needs
    try:
        sort_faults(run_dir)
    except OSError as err:
        print(f"{prog}: warning: cannot put {run_dir}/faults.jsonl in (step, attempt, rank) order: "
              f"{err.strerror or err}", file=sys.stderr)


@contextlib.contextmanager
def last_rank_out_tidies(run_dir: pathlib.Path, prog: str = "paft train") -> Iterator[None]:
    """Under torchrun no launcher outlives the ranks to tidy ``run_dir`` once they are
    gone, as ``paft train``'s does (:func:`paft.launch.launch`): a failed run left its faults in the
    order the ranks happened to append them. So each rank holds a shared flock on the
    directory while it runs and, on its way out however it leaves, lets go and tries
    for an exclusive one: the rank that gets it has no peer left that could still write
    (a peer killed outright loses its lock with its process), and tidies. Of two ranks
    leaving together the later try wins; a rank that takes its shared lock late (when the
    others have left) tidies again on its own way out. The directory is tidied only if
    it is still at ``run_dir``: rank 0's claim may have removed it, or moved an old run
    back there. A file system without flock leaves it untidied.

    The shared locks also keep the directory claimed once rank 0 has let its
    :data:`~paft.rundir.LOCK_FILE` go: :func:`hold_dir_lock` refuses a new claim while
    any rank on this machine is still inside."""
    try:
        handle: int | None = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:  # not on this machine's disk: rank 0 claimed it on another
        handle = None
    if handle is not None:
        try:
            fcntl.flock(handle, fcntl.LOCK_SH)
        except OSError:  # a file system without flock
            os.close(handle)
            handle = None
    try:
        yield
    finally:
        if handle is not None:
            try:
                fcntl.flock(handle, fcntl.LOCK_UN)
                try:
                    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    last = os.path.samestat(os.fstat(handle), os.stat(run_dir))
                except OSError:  # BlockingIOError: a peer is still in, and tidies as it leaves
                    last = False
                if last:
                    tidy_after_workers(run_dir, prog)
            finally:
                os.close(handle)
