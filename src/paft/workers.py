"""Start N local worker processes through torch's elastic launcher, as torchrun would,
and say plainly what went wrong when one fails.

``paft train`` and ``paft bench`` both launch their workers here. On top of
``torch.distributed.launcher.api.elastic_launch`` this adds:

- workers forked from a server that imported torch once (:mod:`paft.workerserver`);
- nothing left behind: the launcher's per-run log directory (``torchelastic_*``) lives
  in a temporary directory removed when the launch ends, and a worker's exception is
  recorded there only, not also in torch.multiprocessing's ``pytorch-errorfile-*``
  pickle, which nothing ever removes from the system's temporary directory;
- one account of a failure: the failed rank's traceback once and a one-line cause
  (:class:`WorkerFailed`), instead of the launcher's log of it plus its summary of it;
- workers that end with the launcher, also when it is killed outright (Linux).

Example (a script: the workers import ``work`` from it)::

    import torch.distributed as dist
    from paft.workers import local_workers

    def work(x):
        dist.init_process_group("gloo")
        rank = dist.get_rank()
        dist.destroy_process_group()
        return rank * x

    if __name__ == "__main__":
        print(local_workers(work, 2)(10))  # {0: 0, 1: 10}
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import multiprocessing.forkserver
import os
import pathlib
import select
import signal
import tempfile
import threading
import traceback
import uuid
from collections.abc import Callable
from multiprocessing import resource_tracker
from typing import Any

from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure, get_error_handler
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

__all__ = ["WorkerFailed", "local_workers"]


class WorkerFailed(RuntimeError):
    """A launched worker failed: ``rank``, ``cause`` (one line: the exception, the
    signal or the exit code) and ``traceback`` (the worker's, where it raised)."""

    def __init__(self, rank: int, cause: str, traceback: str | None) -> None:
        super().__init__(f"rank {rank} {cause}")
        self.rank = rank
        self.cause = cause
        self.traceback = traceback

    @classmethod
    def from_launcher(cls, err: ChildFailedError) -> WorkerFailed:
        """The first failure the launcher saw (read while the error files still exist),
        or, where that rank only lost its connection to a peer, the peer's own error
        (:func:`_own_error`)."""
        rank, failure = err.get_first_failure()
        data = failure.error_file_data.get("message")
        if isinstance(data, dict) and _peer_lost(data["message"]):
            rank, data = _own_error(failure) or (rank, data)
        if isinstance(data, dict):  # what the worker recorded (see _run_entry)
            return cls(rank, _failed(data["message"]), data["extraInfo"]["py_callstack"])
        if failure.exitcode < 0:
            # SIGKILL, which no process sends itself: most often the kernel's, out of memory.
            hint = f" ({_KILLED_HINT})" if failure.exitcode == -signal.SIGKILL else ""
            return cls(rank, f"was killed by {failure.signal_name()}{hint}", None)
        return cls(rank, f"exited with code {failure.exitcode} and left no traceback", None)

    @classmethod
    def from_exception(cls, rank: int, err: Exception) -> WorkerFailed:
        """A rank's own exception, told as :meth:`from_launcher` tells it (where no
        launcher of paft's outlives the ranks: torchrun), with its traceback."""
        return cls(rank, _failed(f"{type(err).__name__}: {err}"), "".join(traceback.format_exception(err)))

    def describe(self, prog: str) -> str:
        """For the console: the worker's traceback, then ``prog: rank N <cause>``."""
        head = self.traceback.rstrip("\n") + "\n" if self.traceback else ""
        return f"{head}{prog}: {self}"


# How gloo and NCCL say that a peer went away mid-collective. A rank killed outright
# (the OOM killer, SIGKILL) leaves no traceback, and torch's launcher names the lowest
# rank it finds dead: often a rank that was waiting on the killed one.
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "remote process exited")
_PEER_LOST_HINT = "its connection to a peer broke: another rank may have died first, killed without a traceback"


_KILLED_HINT = "out of memory? the kernel's OOM killer sends it, as does kill -9"


def _peer_lost(message: str) -> bool:
    """Whether a worker's exception (``Type: message``) says only that a peer went away."""
    return any(sign in message for sign in _PEER_LOST)


def _failed(message: str) -> str:
    """A failed worker's cause, one line, from its exception's ``Type: message``. An
    error raised through a callback (DDP's comm-hook future: a peer lost mid-backward)
    ends with the Python frames pybind11 appends (``\\n\\nAt:\\n  comm.py(344): after``),
    which the traceback holds already; the other lines of a message are joined."""
    message = " ".join(line.strip() for line in message.split(_PYBIND_FRAMES)[0].splitlines() if line.strip())
    hint = f" ({_PEER_LOST_HINT})" if _peer_lost(message) else ""
    return f"failed: {message}{hint}"


# What pybind11 puts between an error's message and the Python frames it was raised through.
_PYBIND_FRAMES = "\n\nAt:\n"


def _own_error(failure: ProcessFailure) -> tuple[int, dict[str, Any]] | None:
    """The rank, and the error it recorded, that failed of its own accord (an error other
    than a broken connection), where ``failure``, the rank the launcher names, only lost
    its connection: earliest first (the files say it in whole seconds), then the lowest
    rank; None where no rank recorded one. The launcher names the first rank it finds
    dead, of ranks that died together the lowest: a rank 1 that raised took rank 0's
    collective down with it, and the run was told as rank 0's broken connection, with
    the hint that a peer may have been killed without a traceback, while rank 1's own
    error and traceback went untold. Every rank's error file lies beside the others, in
    a folder named by its local rank (``<attempt>/<local rank>/error.json``), which on
    paft's one machine is its rank."""
    own = pathlib.Path(failure.error_file)
    if own.parent.name != str(failure.local_rank):  # not the launcher's layout: nothing to compare
        return None
    found = []
    for path in own.parent.parent.glob("*/error.json"):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))["message"]
            when, rank = int(data["extraInfo"]["timestamp"]), int(path.parent.name)
            lost = _peer_lost(data["message"])
        except (OSError, ValueError, KeyError, TypeError):  # half-written by a rank stopped meanwhile
            continue
        if not lost:
            found.append((when, rank, data))
    if not found:
        return None
    _, rank, data = min(found, key=lambda f: f[:2])
    return rank, data


# The launcher's words on a failure or a stop, by logger and message template: paft says
# what happened, and what to do, in its own lines (the failure's traceback was logged
# in full here, then printed again in the failure's summary).
_LAUNCHER_CHATTER = {
    "torch.distributed.elastic.agent.server.api": {"Received %s death signal, shutting down workers"},
    "torch.distributed.elastic.multiprocessing.api": {
        "Closing process %s via signal %s",
        "failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s (start_method: %s)",
    },
    "torch.multiprocessing.spawn": {"Terminating process %s via signal SIGTERM"},  # a failed rank's peers
}


def _drop_launcher_chatter(record: logging.LogRecord) -> bool:
    return record.msg not in _LAUNCHER_CHATTER.get(record.name, ())


def local_workers(entry: Callable[..., Any], world_size: int, name: str = "paft") -> Callable[..., dict[int, Any]]:
    """``entry`` as torchrun would start it on ``world_size`` local workers: call the
    result with ``entry``'s arguments; it returns rank -> ``entry``'s return value, or
    raises :class:`WorkerFailed` when a worker fails (no restarts). ``entry`` must be a
    module-level function (the workers are forked from a server, or spawned) that sets
    up its process group. The fork server starts here."""
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    for logger_name in _LAUNCHER_CHATTER:
        logger = logging.getLogger(logger_name)
        if _drop_launcher_chatter not in logger.filters:
            logger.addFilter(_drop_launcher_chatter)
    _start_resource_tracker()
    start_method = _worker_start_method()
    run_id = f"{name}-{uuid.uuid4().hex[:8]}"

    def launch(*args: Any) -> dict[int, Any]:
        with tempfile.TemporaryDirectory(prefix=f"{name}-launch-") as logs:
            config = _launch_config(world_size, run_id, start_method, logs)
            try:
                return elastic_launch(config, _run_entry)(os.getpid(), entry, *args)
            except ChildFailedError as err:
                raise WorkerFailed.from_launcher(err) from None

    return launch


def _launch_config(world_size: int, run_id: str, start_method: str, log_dir: str) -> LaunchConfig:
    """One node, ``world_size`` workers, no restarts, the launcher's files in ``log_dir``."""
    return LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=run_id,
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",  # a free port, taken at bind time: no race between runs
        max_restarts=0,
        start_method=start_method,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )


def _run_entry(launcher: int, entry: Callable[..., Any], *args: Any) -> Any:
    """In a worker: ``entry(*args)``, ended with the process ``launcher`` (a pid: see
    :func:`_end_with`); an exception is recorded in the launcher's error file and the
    worker exits 1. Left to propagate, torch.multiprocessing would also pickle its
    traceback into a file of its own in the system's temporary directory, which nothing
    removes (one per failed worker)."""
    _end_with(launcher)
    try:
        return entry(*args)
    except Exception as err:
        get_error_handler().record_exception(err)
        raise SystemExit(1) from None


def _end_with(launcher: int) -> None:
    """Send this worker SIGTERM, as the launcher's own shutdown does, when the process
    ``launcher`` exits. The launcher stops its workers on every way out but one: killed
    outright (SIGKILL, the OOM killer), it left them training on into a run directory
    no longer claimed (a ``--resume`` of it was accepted beside them), then waiting
    forever for it to collect their results. They are the fork server's children, not
    the launcher's, so no parent-death signal can tell them. A daemon thread waits on a
    pidfd of the launcher: Linux 5.3 on (``os.pidfd_open``); elsewhere they outlive it."""
    if not hasattr(os, "pidfd_open"):
        return

    def wait_for_launcher() -> None:
        try:
            fd = os.pidfd_open(launcher)
        except ProcessLookupError:  # gone already, before this worker looked
            pass
        except OSError:  # no pidfds here (a kernel before 5.3, a seccomp filter): outlive it, as elsewhere
            return
        else:
            watch = select.poll()  # not select(): a descriptor past 1023 is refused there
            watch.register(fd, select.POLLIN)
            watch.poll()  # readable once the launcher has exited
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait_for_launcher, name="paft-launcher-watch", daemon=True).start()


def _worker_start_method() -> str:
    """Fork the workers from a server that has imported what they need once (see
    :mod:`paft.workerserver`), or spawn them where there is no fork server (Windows).
    The server starts here, deaf to Ctrl-C (an ignored signal stays ignored across
    exec, and Python leaves it so), and ends with the launcher; ``paft bench`` forks
    every run's workers from the same one."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(["paft.workerserver"])
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.signal(signal.SIGINT, previous)
    # Wait for its imports here, through a process that needs nothing of the launcher.
    # The first worker's start waited for them inside the elastic launcher, and a Ctrl-C
    # meanwhile left that worker out of the launcher's shutdown: forked once the imports
    # were done, it found the launcher's semaphores gone and printed a traceback.
    ready = multiprocessing.get_context("forkserver").Process(target=os.getpid)
    ready.start()
    ready.join()
    return "forkserver"


def _start_resource_tracker() -> None:
    """Start multiprocessing's resource tracker (the helper process that spawning the
    workers needs) deaf to SIGHUP and SIGQUIT, as Python makes it deaf to SIGINT and
    SIGTERM. It shares the launcher's process group: a closed terminal, or ``kill -QUIT``
    of the group, killed it with the workers, and the launcher, on its way out, started
    a new one, which printed a KeyError traceback for each semaphore it never knew.
    Blocked while it starts, the signals stay blocked in it (its own set-up unblocks
    only SIGINT and SIGTERM, which it ignores); it still ends with the launcher."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGHUP, signal.SIGQUIT))
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
