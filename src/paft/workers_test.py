"""The local launcher: what a failed worker leaves (its traceback once, nothing on disk)
and how it is told; the fork server and resource tracker it starts."""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

import paft
from paft import workers

_SRC = str(pathlib.Path(paft.__file__).parents[1])  # this paft, not an installed one


def _in_a_launcher(code: str, tmp: pathlib.Path | None = None) -> subprocess.CompletedProcess[str]:
    """``code`` run by a fresh Python standing for ``paft train``'s launcher, in its own
    session (a test may signal its group), with TMPDIR at ``tmp`` if given."""
    env = {**os.environ, "PYTHONPATH": _SRC}
    if tmp is not None:
        env["TMPDIR"] = str(tmp)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240, env=env,
                          start_new_session=True)


def _raise_on_rank_1(x: int) -> int:
    if os.environ["RANK"] == "1":
        raise ValueError(f"bad value {x}")
    return x


def _die_on_rank_1(how: str) -> None:
    if os.environ["RANK"] == "1":
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(3)


def _kill_rank_1_in_a_collective() -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.all_reduce(torch.ones(4))  # rank 0 waits on rank 1, which is gone


def _run_id(x: int) -> tuple[int, str]:
    return x * int(os.environ["RANK"]), os.environ["TORCHELASTIC_RUN_ID"]


def test_a_failed_worker_is_told_once_and_leaves_nothing_behind(tmp_path: pathlib.Path) -> None:
    """torch's launcher logged the failure's traceback, then printed it again in its
    summary, which pointed into a ``torchelastic_*`` log directory; that directory stayed
    in the temporary directory after every launch, and torch.multiprocessing's
    ``pytorch-errorfile-*.pickle`` after every worker that raised."""
    code = """if True:
        import json
        from paft import workers, workers_test as t
        out = {"ok": workers.local_workers(t._run_id, 2, "paft-bench")(5)}
        for name, fn, arg in [("raised", t._raise_on_rank_1, 7), ("killed", t._die_on_rank_1, "kill"),
                              ("exited", t._die_on_rank_1, "exit"), ("lost", t._kill_rank_1_in_a_collective, None)]:
            try:
                workers.local_workers(fn, 2)(*([] if arg is None else [arg]))
            except workers.WorkerFailed as err:
                out[name] = [err.rank, err.cause, err.traceback, err.describe("paft train")]
        print(json.dumps(out))
        """
    done = _in_a_launcher(code, tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""  # the launcher's own account of the failures is gone
    out = json.loads(done.stdout)
    assert {rank: value for rank, (value, _) in out["ok"].items()} == {"0": 0, "1": 5}
    assert all(run_id.startswith("paft-bench-") for _, run_id in out["ok"].values())  # named by the caller
    rank, cause, trace, told = out["raised"]
    assert (rank, cause) == (1, "failed: ValueError: bad value 7")
    assert "in _raise_on_rank_1" in trace and trace.endswith("ValueError: bad value 7\n")
    assert told == trace + "paft train: rank 1 failed: ValueError: bad value 7"
    killed = f"was killed by SIGKILL ({workers._KILLED_HINT})"
    assert out["killed"] == [1, killed, None, f"paft train: rank 1 {killed}"]
    assert out["exited"][:3] == [1, "exited with code 3 and left no traceback", None]
    # Rank 1 killed in a collective: torch's launcher names the lowest rank it finds dead,
    # here (almost always) rank 0, whose broken connection then says what may lie behind it
    # (gloo words it "Connection reset by peer" or "... closed by peer", by which end of the
    # socket notices first: one CI run in many got the second).
    rank, cause, *_ = out["lost"]
    assert (rank, cause) == (1, killed) or (
        rank == 0 and cause.startswith("failed: RuntimeError: ") and any(sign in cause for sign in workers._PEER_LOST)
        and cause.endswith(f"({workers._PEER_LOST_HINT})")), cause
    # (torch's compile cache, one per user and kept on purpose, is made by its import)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith("torchinductor_")] == []


@pytest.mark.parametrize(("name", "msg", "args", "kept"), [
    ("torch.distributed.elastic.multiprocessing.api", "Closing process %s via signal %s", (12, "SIGINT"), False),
    ("torch.distributed.elastic.agent.server.api", "Received %s death signal, shutting down workers", (2,), False),
    ("torch.distributed.elastic.multiprocessing.api",
     "failed (exitcode: %s) local_rank: %s (pid: %s) of fn: %s (start_method: %s)", (1, 0, 12, "f", "spawn"), False),
    ("torch.multiprocessing.spawn", "Terminating process %s via signal SIGTERM", (12,), False),
    # The launcher's other words stay: a worker that would not stop, say.
    ("torch.distributed.elastic.multiprocessing.api",
     "Unable to shutdown process %s via %s, forcefully exiting via %s", (12, "SIGINT", "SIGKILL"), True),
])
def test_the_launchers_own_account_of_a_stop_is_dropped(name: str, msg: str, args: tuple, kept: bool) -> None:
    workers.local_workers(print, 1)  # sets the launcher's logging up; starts nothing
    record = logging.LogRecord(name, logging.WARNING, __file__, 1, msg, args, None)
    assert bool(logging.getLogger(name).filter(record)) == kept
def test_sigquit_or_sighup_to_the_process_group_leaves_the_resource_tracker_alive() -> None:
    """``kill -QUIT`` of ``paft train``'s whole group (or SIGHUP, a closed terminal) also
    killed multiprocessing's resource tracker, which the launcher's spawned workers
    need; on its way out the launcher started a new one, which printed a KeyError
    traceback for every semaphore the first one knew. Here one process stands for the
    launcher: it starts the workers' machinery (not the workers), takes a semaphore,
    has its group signalled, and lets the semaphore go."""
    code = """if True:
        import multiprocessing, os, signal, time
        from paft.workers import local_workers
        for sig in (signal.SIGHUP, signal.SIGQUIT):  # the launcher's handlers unwind
            signal.signal(sig, lambda signum, frame: None)
        local_workers(print, 1)  # only set up: the workers start when it is called
        lock = multiprocessing.get_context("spawn").Lock()
        for sig in (signal.SIGHUP, signal.SIGQUIT):
            os.killpg(0, sig)
        time.sleep(0.5)
        del lock
        """
    done = _in_a_launcher(code)
    assert done.returncode == 0 and done.stderr == "", done.stderr


def test_the_workers_fork_from_a_server_deaf_to_ctrl_c_that_gives_them_the_default() -> None:
    """The launcher forks its workers from a server that imports torch once for all of
    them. A Ctrl-C during those imports printed their traceback (the launcher handles
    it); and a worker must still end on the Ctrl-C the launcher forwards before it has
    set up its own handler, where an inherited ignore left the launcher waiting 30 s."""
    code = """if True:
        import multiprocessing, multiprocessing.forkserver, os, signal
        from paft.workers import local_workers
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a background job's is ignored)
        local_workers(print, 1)  # starts the server
        os.kill(multiprocessing.forkserver._forkserver._forkserver_pid, signal.SIGINT)  # while it imports
        with multiprocessing.get_context("forkserver").Pool(1) as pool:
            print(pool.apply(signal.getsignal, (signal.SIGINT,)) is signal.SIG_DFL)
        """
    done = _in_a_launcher(code)
    assert (done.returncode, done.stdout, done.stderr) == (0, "True\n", ""), done.stderr


def _say_pid_and_wait(folder: str) -> None:
    (pathlib.Path(folder) / f"rank{os.environ['RANK']}").write_text(str(os.getpid()))
    time.sleep(300)


def _alive(pid: int) -> bool:
    """Running, not exited (a zombie, its parent gone, waits for init to reap it)."""
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="workers watch their launcher through a pidfd (Linux)")
def test_the_workers_end_with_a_launcher_killed_outright(tmp_path: pathlib.Path) -> None:
    """A launcher killed by SIGKILL (the OOM killer) cannot stop its workers: they trained
    on into a run directory no longer claimed, then hung waiting for it."""
    code = ("from paft import workers, workers_test as t; "
            f"workers.local_workers(t._say_pid_and_wait, 2)({str(tmp_path)!r})")
    launcher = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": _SRC},
                                start_new_session=True, stderr=subprocess.DEVNULL)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while len(pids) < 2 and time.monotonic() < deadline and launcher.poll() is None:
            time.sleep(0.1)
            pids = [int(f.read_text()) for f in tmp_path.glob("rank*") if f.read_text()]
        assert len(pids) == 2 and all(map(_alive, pids))
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while any(map(_alive, pids)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, pids))
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        launcher.kill()


def test_a_worker_that_cannot_watch_its_launcher_trains_on_without_a_word(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel has no pidfd_open (before 5.3) or a seccomp filter refuses it,
    each worker printed its watcher thread's OSError traceback."""
    def refused(pid: int) -> int:
        raise OSError(errno.ENOSYS, "Function not implemented")

    raised: list[BaseException | None] = []
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "pidfd_open", refused, raising=False)
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    monkeypatch.setattr(threading, "excepthook", lambda args: raised.append(args.exc_value))
    workers._end_with(os.getpid())
    for thread in threading.enumerate():
        if thread.name == "paft-launcher-watch":
            thread.join(10)
    assert (raised, killed) == ([], [])


def _failure(tmp: pathlib.Path, exitcode: int, message: str | None) -> ChildFailedError:
    """The launcher's account of rank 3 failing: its error file as _run_entry's
    record_exception writes it (``message`` None: no error file)."""
    error_file = tmp / "error.json"
    if message is not None:
        error_file.write_text(json.dumps({"message": {"message": message, "extraInfo": {
            "py_callstack": f"Traceback (most recent call last):\n{message}\n", "timestamp": "1"}}}))
    failure = ProcessFailure(local_rank=3, pid=1, exitcode=exitcode, error_file=str(error_file))
    return ChildFailedError("work", {3: failure})


@pytest.mark.parametrize("lost", ["Connection reset by peer", "Connection closed by peer", "Broken pipe",
                                  "remote process exited"])
def test_a_broken_connection_says_another_rank_may_have_died_first(tmp_path: pathlib.Path, lost: str) -> None:
    err = workers.WorkerFailed.from_launcher(_failure(tmp_path, 1, f"RuntimeError: [gloo] read: {lost}"))
    assert (err.rank, err.cause) == (3, f"failed: RuntimeError: [gloo] read: {lost} ({workers._PEER_LOST_HINT})")
    assert err.traceback == f"Traceback (most recent call last):\nRuntimeError: [gloo] read: {lost}\n"
    plain = workers.WorkerFailed.from_launcher(_failure(tmp_path, 1, "ValueError: connection"))
    assert (plain.cause, str(plain)) == ("failed: ValueError: connection", "rank 3 failed: ValueError: connection")
    # A rank's own exception (torchrun's ranks record theirs) is told the same way.
    try:
        raise RuntimeError(f"[gloo] read: {lost}")
    except RuntimeError as raised:
        own = workers.WorkerFailed.from_exception(3, raised)
    assert own.cause == err.cause and own.traceback is not None
    assert own.traceback.startswith("Traceback (most recent call last):\n")
    assert own.traceback.endswith(f"RuntimeError: [gloo] read: {lost}\n")


def test_a_cause_is_one_line_without_the_python_frames_a_callbacks_error_carries(tmp_path: pathlib.Path) -> None:
    """A rank killed while a peer's backward all-reduced: the peer's error came through
    DDP's comm-hook future, whose message ends with the Python frames pybind11 appends
    ("\\n\\nAt:\\n  comm.py(344): after"). The console's "rank 0 failed: ..." line, the
    events.jsonl cause and the report's note ran over three lines, the hint that a peer
    may have died first on a line of its own after a frame; the frames are in the
    traceback already."""
    lost = ("RuntimeError: Got the following error when running the callback: RuntimeError: [gloo] Read error "
            "[127.0.0.1]:48011: Connection reset by peer. GLHF!")
    err = workers.WorkerFailed.from_launcher(_failure(tmp_path, 1, f"{lost}\n\nAt:\n  /src/paft/comm.py(344): after"))
    assert err.cause == f"failed: {lost} ({workers._PEER_LOST_HINT})"
    assert "comm.py(344)" in (err.traceback or "")
    # A message of several lines of its own is told on one.
    own = workers.WorkerFailed.from_exception(3, ValueError("first line\n  second line\n"))
    assert own.cause == "failed: ValueError: first line second line"


def _recorded(folder: pathlib.Path, message: str, timestamp: int) -> str:
    """An error file as _run_entry's record_exception writes it, in ``folder``; its path."""
    folder.mkdir(parents=True)
    (folder / "error.json").write_text(json.dumps({"message": {"message": message, "extraInfo": {
        "py_callstack": f"Traceback (most recent call last):\n{message}\n", "timestamp": str(timestamp)}}}))
    return str(folder / "error.json")


def test_a_rank_that_raised_is_named_not_the_peer_whose_connection_it_broke(tmp_path: pathlib.Path) -> None:
    """Rank 1 raised (its traceback recorded), which broke rank 0's collective; the
    launcher, finding both dead at once, names the lowest. paft train said "rank 0
    failed: ... Connection closed by peer (... killed without a traceback)", and rank
    1's error was in neither the console nor events.jsonl."""
    attempt = tmp_path / "run" / "attempt_0"  # the launcher's layout: <attempt>/<local rank>/error.json
    lost = "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1234"
    first = _recorded(attempt / "0", lost, 100)
    _recorded(attempt / "1", "ValueError: bad batch", 100)
    _recorded(attempt / "2", "KeyError: 'later'", 101)  # raised a second later: not the first
    _recorded(attempt / "3", lost, 99)
    (attempt / "4").mkdir()
    (attempt / "4" / "error.json").write_text('{"message": {"mess')  # half-written when it was stopped
    err = workers.WorkerFailed.from_launcher(
        ChildFailedError("work", {0: ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=first)}))
    assert (err.rank, err.cause) == (1, "failed: ValueError: bad batch")
    assert err.traceback == "Traceback (most recent call last):\nValueError: bad batch\n"
    # Where no rank raised of its own accord (the peer was killed outright), the named one is told, with the hint.
    (attempt / "1" / "error.json").unlink()
    (attempt / "2" / "error.json").unlink()
    err = workers.WorkerFailed.from_launcher(
        ChildFailedError("work", {0: ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=first)}))
    assert (err.rank, err.cause) == (0, f"failed: {lost} ({workers._PEER_LOST_HINT})")


def test_a_worker_that_left_no_error_file_is_told_by_its_exit() -> None:
    missing = pathlib.Path("/nonexistent-paft-dir")
    killed = workers.WorkerFailed.from_launcher(_failure(missing, -9, None))
    assert str(killed) == f"rank 3 was killed by SIGKILL ({workers._KILLED_HINT})"  # most often out of memory
    assert str(workers.WorkerFailed.from_launcher(_failure(missing, -15, None))) == "rank 3 was killed by SIGTERM"
    exited = workers.WorkerFailed.from_launcher(_failure(missing, 2, None))
    assert (str(exited), exited.traceback) == ("rank 3 exited with code 2 and left no traceback", None)
    assert exited.describe("paft bench") == "paft bench: rank 3 exited with code 2 and left no traceback"
    # A traceback is followed by one line break, whatever it ends with.
    for trace in ("Traceback\nValueError: x", "Traceback\nValueError: x\n\n"):
        assert workers.WorkerFailed(0, "failed", trace).describe("p") == "Traceback\nValueError: x\np: rank 0 failed"
