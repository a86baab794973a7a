"""Starting a run's workers: the launcher around them (a failed run's faults put in
order, a guard's stop as exit 3), and under torchrun each rank's part (the last one
out tidies, rank 0 settles the run directory once its peers are out, a signal or a
failure takes the group down). What a claim keeps or removes: claim_test.py."""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import pytest
import torch.distributed as dist

import paft
from paft import claim
from paft import launch as launcher
from paft.config import TrainConfig
from paft.exitcodes import EXIT_WORKER_FAILED
from paft.protect import PersistentFaultError
from paft.records import RunRecorder, atomic_write_bytes, read_jsonl
from paft.rundir import RunDirError, in_use
from paft.signals import unwind_on_termination
from paft.testing import run_workers
from paft.train import format_plan, format_summary
from paft.workers import WorkerFailed

pytestmark = pytest.mark.usefixtures("sigint")


def test_the_faults_of_a_failed_run_are_put_in_order(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 sorts faults.jsonl at a run's end; a run whose workers failed (or were
    interrupted) never got there: the launcher sorts it once they are gone."""
    monkeypatch.chdir(tmp_path)

    def failed(cfg: TrainConfig, *_: object) -> int:
        run = pathlib.Path(cfg.run_dir)
        (run / "metrics").mkdir()
        (run / "metrics" / "rank0.jsonl").write_text('{"step": 0}\n')  # a step trained: the run is kept
        (run / "faults.jsonl").write_text("".join(f'{{"attempt": 0, "rank": {r}, "step": {s}}}\n'
                                                  for s, r in ((0, 1), (0, 0), (1, 1), (1, 0))))
        return EXIT_WORKER_FAILED

    monkeypatch.setattr(launcher, "_run_workers", failed)
    assert launcher.launch(TrainConfig(run_dir="r", steps=2)) == EXIT_WORKER_FAILED
    assert _steps_and_ranks(tmp_path / "r") == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_a_guard_stop_exits_3_with_its_reason(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    # The workers return a guard's stop (--on-persistent stop) as a result: exit code 3, not a failure's 1.
    reason = str(PersistentFaultError(5, [2]))
    stopped = [{"status": "persistent_fault", "message": reason}] * 2
    monkeypatch.setattr(launcher, "local_workers", lambda worker, n: lambda *args: stopped)
    assert launcher._run_workers(TrainConfig(run_dir=str(tmp_path), world_size=2), ()) == 3
    assert capsys.readouterr().err == f"paft train: {reason}\n"


def test_a_resume_the_guard_stopped_names_the_command_that_goes_on(tmp_path: pathlib.Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A resume the guard stops before its next checkpoint puts back the options of the
    last one (claim.py): its stop line names the command that goes on as it did, as an
    interrupted one's does; a plain --resume trained to the old --steps, without its changes."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step0000020")
    stopped = [{"status": "persistent_fault", "message": "step 25: stopping"}] * 2
    monkeypatch.setattr(launcher, "local_workers", lambda worker, n: lambda *args: stopped)
    cfg = TrainConfig(run_dir=str(tmp_path), world_size=2, steps=40, resume=True, quiet=True)
    assert launcher._run_workers(cfg, ["--log-every", "5"]) == 3
    assert capsys.readouterr().err == (f"paft train: step 25: stopping; to continue from the last checkpoint: "
                                       f"paft train --run-dir {tmp_path} --resume --steps 40 --log-every 5\n")


@pytest.mark.parametrize("how", ["failed", "interrupted"])
def test_a_run_stopped_after_its_summary_offers_no_resume_that_is_refused(tmp_path: pathlib.Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str],
                                                                          how: str) -> None:
    """A worker killed, or a signal, once the run had written its final checkpoint and
    summary.json (rank 0's last barrier, the group's teardown): the line said "--resume
    continues from the last", and that --resume was refused (exit 2: "has trained 8 steps
    already"). It says the run had finished, and what trains on."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step0000008")
    (tmp_path / "summary.json").write_text('{"steps": 8}')

    def stopped(*args: object) -> Any:
        if how == "failed":
            raise WorkerFailed(1, "was killed by SIGKILL", None)
        raise KeyboardInterrupt

    monkeypatch.setattr(launcher, "local_workers", lambda worker, n: stopped)
    cfg = TrainConfig(run_dir=str(tmp_path), world_size=2, steps=8, quiet=True)
    assert launcher._run_workers(cfg, ()) == (EXIT_WORKER_FAILED if how == "failed" else 130)
    finished = (f"{tmp_path} holds the finished run: it had trained its 8 steps and written summary.json "
                "(a --resume trains on with --steps above 8)")
    said = capsys.readouterr().err
    assert said == (f"paft train: rank 1 was killed by SIGKILL; {finished}\n" if how == "failed"
                    else f"\npaft train: interrupted (Ctrl-C); {finished}\n")
    # Not finished (no summary.json, or one of fewer steps: a resume to more; or the summary of
    # the leg before a resume that fell back to an earlier checkpoint), the resume goes on.
    continues = f"; to continue from the last checkpoint: paft train --run-dir {tmp_path} --resume"
    (tmp_path / "checkpoints" / "latest").write_text("step0000004")
    assert launcher.resume_hint(cfg, "paft train") == continues
    (tmp_path / "summary.json").write_text('{"steps": 6}')
    assert launcher.resume_hint(cfg, "paft train") == continues


@pytest.mark.usefixtures("one_rank_group")
def test_a_guard_stop_is_a_result_recorded_with_its_reason(tmp_path: pathlib.Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard stops every rank at the same step: a result (exit 3), not a failure.
    Rank 0 records the stop with its ranks and reason, and puts the faults in order (each
    rank wrote those of the step before the decision); the records are closed (what
    TensorBoard buffers is written then). One rank, in process; training replaced."""
    stop = PersistentFaultError(5, [1])
    closed: list[bool] = []

    class Recorder(RunRecorder):
        def close(self) -> None:
            closed.append(True)
            super().close()

    class Trainer:
        def __init__(self, cfg: TrainConfig, run_dir: pathlib.Path) -> None:
            self.recorder = Recorder(run_dir, 0)

        def train(self) -> dict[str, Any]:
            self.recorder.faults([{"attempt": 0, "rank": 1, "step": 5}, {"attempt": 0, "rank": 0, "step": 5}])
            raise stop

    monkeypatch.setattr(launcher, "Trainer", Trainer)
    result = launcher._train_in_group(TrainConfig(), str(tmp_path))
    assert not dist.is_initialized()
    assert (result, closed) == ({"status": "persistent_fault", "message": str(stop)}, [True])
    assert read_jsonl(tmp_path / "events.jsonl") == [{"step": 5, "event": "stop", "ranks": [1], "reason": str(stop)}]
    assert _steps_and_ranks(tmp_path) == [(5, 0), (5, 1)]


def _steps_and_ranks(run: pathlib.Path) -> list[tuple[int, int]]:
    """(step, rank) of each line of ``run``'s faults.jsonl, in file order."""
    return [(f["step"], f["rank"]) for f in read_jsonl(run / "faults.jsonl")]


def _failing_in_turn(rank: int, world_size: int, run_dir: str) -> list[tuple[int, int]]:
    """Torchrun's entry once the process group is up, training replaced: rank 0 appends
    two faults out of order and fails; rank 1, still in, then appends one more and
    fails too. Returns the faults rank 1 saw before its own (rank 0's must be as
    written: it was not the last out)."""
    seen: list[tuple[int, int]] = []

    def train(cfg: TrainConfig, run_dir: str) -> dict[str, Any]:
        dist.barrier()  # both training (the Trainer's own first collectives: DDP's, protect's)
        recorder = RunRecorder(pathlib.Path(run_dir), rank)
        if rank == 0:
            recorder.metrics({"step": 0})  # a step trained: rank 0's claim keeps the run
            recorder.faults([{"attempt": 0, "rank": 0, "step": 1}, {"attempt": 0, "rank": 0, "step": 0}])
        else:
            dist.barrier()  # rank 0 is out
            seen.extend(_steps_and_ranks(pathlib.Path(run_dir)))
            recorder.faults([{"attempt": 0, "rank": 1, "step": 0}])
        recorder.close()
        raise RuntimeError("a failing rank")

    launcher._train_in_group = train  # this worker's own module: it ends with the test
    # Rank 1 stays in until rank 0 is out, so rank 0 waits for it in vain: not 10 s.
    launcher._PEERS_OUT_SECONDS = 0.5
    with contextlib.suppress(RuntimeError):
        launcher._main(TrainConfig(run_dir=run_dir, world_size=2, steps=1), "torchrun", rank == 0)
    if rank == 0:
        dist.barrier()
    return seen


def test_under_torchrun_the_last_rank_out_puts_the_faults_in_order(tmp_path: pathlib.Path) -> None:
    """No launcher outlives torchrun's ranks to sort a failed run's faults.jsonl, as
    paft train's does: they stayed in the order the ranks happened to append them. The
    last rank out sorts them now (and not one that leaves while a peer may still write)."""
    seen = run_workers(_failing_in_turn, 2, str(tmp_path / "r"), timeout=120)
    assert seen[1] == [(1, 0), (0, 0)]
    assert _steps_and_ranks(tmp_path / "r") == [(0, 0), (0, 1), (1, 0)]
    # Each rank that raised recorded its failure, as paft train's launcher records the
    # first: under torchrun nothing did, and paft report could not say why the run stopped.
    failed = read_jsonl(tmp_path / "r" / "events.jsonl")
    assert [(e["event"], e["step"], e["rank"], e["cause"]) for e in failed] == [
        ("failed", 1, rank, "failed: RuntimeError: a failing rank") for rank in (0, 1)]
    assert all(e["traceback"].endswith("RuntimeError: a failing rank\n") and "in train" in e["traceback"]
               for e in failed)


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("case", ["error", "signal", "replaced", "elsewhere", "unwritable"])
def test_under_torchrun_a_rank_records_its_failure_after_its_group_is_down(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    # The real _train_in_group takes the process group down before the failure reaches
    # _main (the test above replaces it whole): the record must not ask the group for the
    # rank then. It did, and raised ValueError ("Default process group has not been
    # initialized") in place of the rank's error, recording nothing. One rank, in process.
    # Not recorded: torchrun's SIGHUP/SIGTERM (SignalException, an Exception of torch's:
    # a stop, not a failure), nor a failure once another directory is at the path (a
    # peer out late found the old run that rank 0's --overwrite claim had put back, and
    # wrote its record there: seen in CI), nor by a rank on a machine whose disk never had
    # the run directory (rank 0 claimed it on another; a record would make it there). A
    # record that cannot be written is warned about, by the torchrun command's name.
    def failing_trainer(cfg: TrainConfig, run_dir: pathlib.Path) -> None:
        if case == "elsewhere":
            raise RuntimeError("a failing rank")
        RunRecorder(run_dir, 0).metrics({"step": 0})  # a step trained: rank 0's claim keeps the run
        if case == "signal":
            raise launcher.SignalException("got signal: 1", signal.SIGHUP)
        if case == "replaced":
            run_dir.rename(run_dir.with_name("elsewhere"))
            run_dir.mkdir()
        if case == "unwritable":
            (run_dir / "events.jsonl").mkdir()
        raise RuntimeError("a failing rank")

    recorded: list[pathlib.Path] = []
    record = launcher.record_failure
    monkeypatch.setattr(launcher, "record_failure", lambda run_dir, *args: (recorded.append(run_dir),
                                                                            record(run_dir, *args)))
    monkeypatch.setattr(launcher, "Trainer", failing_trainer)
    with pytest.raises(launcher.SignalException if case == "signal" else RuntimeError):
        launcher._main(TrainConfig(run_dir=str(tmp_path / "r"), world_size=1, steps=1, quiet=True), "torchrun",
                       case != "elsewhere")  # not rank 0 there: no claim
    assert not dist.is_initialized()
    if case == "unwritable":
        assert capsys.readouterr().err.startswith(f"torchrun: warning: cannot record the failure in {tmp_path}/r/"
                                                  "events.jsonl: Is a directory\n")
        return
    if case != "error":  # (the claim removes the replaced directory, with or without a record in it)
        assert recorded == [] and not list(tmp_path.glob("*/events.jsonl"))
        return
    (failed,) = read_jsonl(tmp_path / "r" / "events.jsonl")
    assert (failed["event"], failed["step"], failed["rank"], failed["cause"]) == (
        "failed", 1, 0, "failed: RuntimeError: a failing rank")


def _claiming_while_a_peer_lingers(rank: int, world_size: int, run_dir: str) -> str:
    """Torchrun's entry once the process group is up, training replaced by a guard's
    stop (the run is kept): rank 0 leaves, then tries to claim the directory for an
    --overwrite while rank 1 is still inside (as when it tidies a long faults.jsonl).
    Returns, on rank 0, how the claim went."""
    run, tried = pathlib.Path(run_dir), pathlib.Path(run_dir).with_name("tried")

    def train(cfg: TrainConfig, run_dir: str) -> dict[str, Any]:
        deadline = time.monotonic() + 60
        while rank == 1 and not tried.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"status": "persistent_fault", "message": "stopped"}

    launcher._train_in_group = train  # this worker's own module: it ends with the test
    # Rank 1 lingers until rank 0 has tried its claim, so rank 0 waits for it in vain: not 10 s.
    launcher._PEERS_OUT_SECONDS = 0.5
    launcher._main(TrainConfig(run_dir=run_dir, world_size=2, steps=1), "torchrun", rank == 0)
    outcome = ""
    if rank == 0:
        probed = in_use(run)
        try:
            with claim.claim_run_dir(TrainConfig(run_dir=run_dir, world_size=2, steps=1, overwrite=True)):
                outcome = "claimed"
        except RunDirError as err:
            outcome = str(err)
        outcome = f"in use: {probed}; {outcome}"
        tried.touch()
    dist.barrier()  # rank 1 is out
    return outcome


def test_under_torchrun_the_run_dir_stays_claimed_until_the_last_rank_is_out(tmp_path: pathlib.Path) -> None:
    """Rank 0 let the run directory's lock go on its way out while its peers were still
    writing or tidying there: a second run started then took the directory (an
    --overwrite moved it aside and deleted it under them). Each rank's shared lock now
    keeps it claimed until the last rank on this machine is out."""
    run = tmp_path / "r"
    outcomes = run_workers(_claiming_while_a_peer_lingers, 2, str(run), timeout=120)
    assert outcomes[0] == f"in use: True; --run-dir: {run} is in use by another paft train; " \
                          "wait for it to end or pick another --run-dir"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r", "tried"]  # not set aside
    assert not in_use(run)
    with claim.hold_dir_lock(run):  # free once every rank is out
        pass


def _writing_after_rank_0_failed(rank: int, world_size: int, run_dir: str, wait: float, bound: float,
                                 signalled: bool = False) -> str:
    """Torchrun's entry once the process group is up, twice, training replaced: a run the
    guard stops (beside ``run_dir``: every rank is out of it), then an --overwrite of the
    old run in ``run_dir``, where rank 0 fails at once (and, ``signalled``, gets
    torchrun's SIGTERM half a second later, as when a rank failed); rank 1, still
    training, writes its checkpoint file by path, as
    :meth:`~paft.train.Trainer.save_checkpoint` does, once the old run is back in its
    place (after at most ``wait`` seconds), then fails too (its next collective would).
    Rank 0 waits at most ``bound`` seconds for its peers. Returns what rank 0 said."""
    run = pathlib.Path(run_dir)

    def train(cfg: TrainConfig, run_dir: str) -> dict[str, Any]:
        pid = [os.getpid()]
        dist.broadcast_object_list(pid, src=0)  # both training
        if rank == 0:
            raise RuntimeError("rank 0 failed")
        if signalled:
            time.sleep(0.5)  # rank 0 waiting for its peers
            os.kill(pid[0], signal.SIGTERM)
        deadline = time.monotonic() + wait
        while not (run / "old").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        atomic_write_bytes(run / "checkpoints" / "step0000002" / "rank1.pt", b"new")
        raise RuntimeError("rank 1 failed")

    # This worker's own module: it ends with the test.
    launcher._train_in_group = lambda cfg, run_dir: {"status": "persistent_fault", "message": "stopped"}
    launcher._main(TrainConfig(run_dir=str(run.with_name("before")), world_size=2, steps=4), "torchrun", rank == 0)
    launcher._train_in_group, launcher._PEERS_OUT_SECONDS = train, bound
    unwind_on_termination()  # as torchrun_main
    said = io.StringIO()
    with contextlib.suppress(RuntimeError), contextlib.redirect_stderr(said):
        launcher._main(TrainConfig(run_dir=run_dir, world_size=2, steps=4, overwrite=True), "torchrun", rank == 0)
    return said.getvalue()


def _old_run_with_checkpoint(tmp_path: pathlib.Path) -> pathlib.Path:
    run = tmp_path / "r"
    (run / "checkpoints" / "step0000002").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(TrainConfig(run_dir=str(run), world_size=2, steps=2).to_dict()))
    (run / "checkpoints" / "latest").write_text("step0000002")
    for r in (0, 1):
        (run / "checkpoints" / "step0000002" / f"rank{r}.pt").write_text("old")
    (run / "old").touch()
    return run


@pytest.mark.parametrize("signalled", [False, True])
def test_under_torchrun_rank_0_settles_the_run_dir_once_its_peers_are_out(tmp_path: pathlib.Path,
                                                                          signalled: bool) -> None:
    """Rank 0 moved the old run --overwrite replaced back (or removed the new run) as soon
    as it failed, while a peer still trained: that peer's checkpoint file, written by
    path, replaced the old run's own (or brought a removed run back, half-written).
    Rank 0 now settles the directory only once every rank is out, also when torchrun's
    SIGTERM comes meanwhile."""
    run = _old_run_with_checkpoint(tmp_path)
    said = run_workers(_writing_after_rank_0_failed, 2, str(run), 2.0, 30.0, signalled, timeout=120)
    assert (run / "checkpoints" / "step0000002" / "rank1.pt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["before", "r"]
    assert said[0] == f"torchrun: the run stopped before a step; {run} was removed\n" \
                      f"torchrun: the output it was to replace is back in {run}\n"


def test_under_torchrun_rank_0_waits_for_a_stuck_peer_only_so_long(tmp_path: pathlib.Path) -> None:
    """A peer that never gets out (killed, or stuck in a collective) holds rank 0 back only
    a bounded time, well inside the 30 s torchrun gives a rank between its SIGTERM and
    its SIGKILL; rank 0 says which rank it settled without."""
    run = _old_run_with_checkpoint(tmp_path)
    said = run_workers(_writing_after_rank_0_failed, 2, str(run), 60.0, 0.5, timeout=120)
    assert said[0].startswith("torchrun: warning: rank(s) 1 not out after 0.5 s")
    assert said[0].endswith(f"torchrun: the output it was to replace is back in {run}\n")


def _finishing_apart(rank: int, world_size: int, tmp: str, how: str) -> tuple[str, str]:
    """:func:`launch._train_in_group` with the trainer replaced. ``how``: "finish" (rank 1
    the slower), "stop" (the guard stops both; rank 1 the slower), or "fail" (rank 1
    fails at once; rank 0, still training, fails once rank 1 has taken its group down, as
    its next collective would). Returns how this rank ended, and which ranks were done
    when it took its group down."""
    root = pathlib.Path(tmp)
    destroy = dist.destroy_process_group

    def taken_down() -> None:
        (root / f"down{rank}").write_text(" ".join(sorted(p.name for p in root.glob("done*"))))
        destroy()

    class Trainer:
        def __init__(self, cfg: TrainConfig, run_dir: pathlib.Path) -> None:
            self.recorder = RunRecorder(None, rank)

        def train(self) -> dict[str, Any]:
            if how == "fail":
                if rank == 1:
                    raise RuntimeError("rank 1 failed")
                deadline = time.monotonic() + 60
                while not (root / "down1").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
                raise RuntimeError(f"rank 1 took its group down: {(root / 'down1').exists()}")
            if rank == 1:
                time.sleep(1)  # the slower: a rank that did not wait would be down by then
            (root / f"done{rank}").touch()
            if how == "stop":
                raise PersistentFaultError(3, [1])
            return {}

    # This worker's own modules: they end with the test.
    launcher.Trainer = Trainer
    dist.destroy_process_group = taken_down
    try:
        outcome = launcher._train_in_group(TrainConfig(), tmp)["status"]
    except RuntimeError as err:
        outcome = str(err)
    return outcome, (root / f"down{rank}").read_text()


@pytest.mark.parametrize("how, outcomes", [
    ("finish", [("ok", "done0 done1")] * 2),
    ("stop", [("persistent_fault", "done0 done1")] * 2),
    ("fail", [("rank 1 took its group down: True", ""), ("rank 1 failed", "")]),
])
def test_a_rank_takes_its_group_down_once_every_rank_is_done_unless_one_failed(
        tmp_path: pathlib.Path, how: str, outcomes: list[tuple[str, str]]) -> None:
    """A rank that destroyed its process group while a peer still talked to it aborted
    now and then in gloo's teardown ('terminate called without an active exception'):
    a run that finished, or that the guard stopped, takes its group down after a
    barrier. A failed rank does not wait there (its peers may never come): it leaves with
    its error while its peer is still training."""
    assert run_workers(_finishing_apart, 2, str(tmp_path), how, timeout=120) == outcomes


def test_a_failed_run_leaves_no_checkpoint_temporaries(tmp_path: pathlib.Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers stopped while writing a checkpoint (a failing peer, Ctrl-C) left their
    temporaries; the launcher removes them, and the folders left empty, and nothing
    else, once the workers are gone."""
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "r" / "checkpoints"

    def stopped_mid_checkpoint(cfg: TrainConfig, *_: object) -> int:
        for name in ("step0000002/rank0.pt", "step0000002/rank1.pt", "latest", "step0000006/rank0.pt",
                     "step0000002/.rank0.pt.notes"):  # not a temporary's name: the user's
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text("step0000002" if name == "latest" else "complete")
        for name in ("step0000004/.rank0.pt.", "step0000004/.rank1.pt.", "step0000006/.rank1.pt.", ".latest."):
            (root / name).parent.mkdir(exist_ok=True)
            os.close(tempfile.mkstemp(prefix=pathlib.PurePath(name).name, dir=(root / name).parent)[0])
        (root / "step0000001").mkdir()  # pruned but for the folder
        return EXIT_WORKER_FAILED

    monkeypatch.setattr(launcher, "_run_workers", stopped_mid_checkpoint)
    assert launcher.launch(TrainConfig(run_dir="r", steps=8)) == EXIT_WORKER_FAILED
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == [
        "latest", "step0000002", "step0000002/.rank0.pt.notes", "step0000002/rank0.pt", "step0000002/rank1.pt",
        "step0000006", "step0000006/rank0.pt"]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_torchrun_rank_waiting_for_its_peers_ends_on_a_signal(tmp_path: pathlib.Path, sig: int) -> None:
    """Rank 0 of two, alone, waits in the rendezvous (in C++, where no Python handler
    runs): Ctrl-C and SIGTERM went unheard there for its 30-minute timeout."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "PYTHONPATH": str(pathlib.Path(paft.__file__).parents[1])}
    rank = subprocess.Popen([sys.executable, "-m", "paft.train", "--run-dir", "r", "--world-size", "2"], cwd=tmp_path,
                            env=env, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal
    try:
        while True:  # rank 0 hosts the rendezvous' store: up once it waits there
            assert rank.poll() is None, rank.communicate()[1]
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        time.sleep(0.5)
        rank.send_signal(sig)
        err = rank.communicate(timeout=30)[1]
    finally:
        rank.kill()
    assert (rank.returncode, err, list(tmp_path.iterdir())) == (-sig, "", [])


_DDP_ALIVE_AT_DESTROY = """
import gc, sys
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from paft.launch import torchrun_main

destroy, alive = dist.destroy_process_group, []
def destroy_counting(*args, **kwargs):
    alive.append(sum(type(o) is DistributedDataParallel for o in gc.get_objects()))
    destroy(*args, **kwargs)
dist.destroy_process_group = destroy_counting
gc.disable()  # only reference counting frees: what a run without a full collection gets
code = torchrun_main(["--run-dir", "r", "--steps", "1", "--quiet"])
print(code, alive)
"""


def test_under_torchrun_the_ddp_model_is_freed_before_the_group_is_destroyed(tmp_path: pathlib.Path) -> None:
    """The Trainer (and its DDP model, whose reducer holds the process group) outlived
    the group to the interpreter's exit, where gloo's teardown aborted a rank now and
    then: torch.fx's wrap(), run by the import of torch._dynamo in DDP's constructor,
    keeps every caller's frame in a reference cycle, the Trainer's constructor's too."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "PYTHONPATH": str(pathlib.Path(paft.__file__).parents[1])}
    done = subprocess.run([sys.executable, "-c", _DDP_ALIVE_AT_DESTROY], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines()[-1:] == ["0 [0]"], done.stderr[-2000:]


def _threads_as_launched(rank: int, world_size: int) -> tuple[str | None, int]:
    launcher.start_launched_worker(TrainConfig(world_size=world_size, batch_size=12))
    import torch

    return os.environ.get("LOCAL_WORLD_SIZE"), torch.get_num_threads()


def test_test_workers_take_the_share_of_the_cores_paft_train_gives_them() -> None:
    """The suite's multi-rank workers run paft train's worker path with the thread share
    the elastic launcher gives (cores // local ranks): with every core each, under load
    the first AdamW step wrote half of one tensor differently on one rank about once in
    30 runs (docs/ARCHITECTURE.md, "Determinism")."""
    share = max(1, (os.cpu_count() or 1) // 3)
    assert run_workers(_threads_as_launched, 3) == [("3", share)] * 3


@pytest.mark.parametrize("cpus, workers, threads", [(8, 1, 8), (8, 3, 2), (8, 16, 1), (None, 2, 1)])
def test_each_worker_gets_its_share_of_the_cores(monkeypatch: pytest.MonkeyPatch, cpus: int | None, workers: int,
                                                 threads: int) -> None:
    """N workers on one machine each take 1/N of its cores for their BLAS pool (at least
    one): one pool each as large as the machine oversubscribed it N times."""
    set_to: list[int] = []
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(launcher.torch, "set_num_threads", set_to.append)
    launcher._set_threads(workers)
    assert set_to == [threads]


def _as_torchrun_rank(monkeypatch: pytest.MonkeyPatch, rank: int, world_size: int, local: str) -> None:
    """The variables torchrun sets for rank ``rank`` (``local``: LOCAL_WORLD_SIZE)."""
    for name, value in {"RANK": str(rank), "WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "1", "LOCAL_WORLD_SIZE": local}.items():
        monkeypatch.setenv(name, value)


@pytest.mark.parametrize("local", ["0", "-1", "two", ""])
def test_a_bad_local_world_size_under_torchrun_exits_2(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str], local: str) -> None:
    """LOCAL_WORLD_SIZE sizes each rank's share of the cores: a value torchrun never sets
    is a usage error named by its variable (0 divided by zero), before any rendezvous."""
    _as_torchrun_rank(monkeypatch, 0, 1, local)
    monkeypatch.setattr(launcher, "_init_process_group", lambda cfg: pytest.fail("no rendezvous"))
    assert launcher.torchrun_main(["--run-dir", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err == (f"python -m paft.train: error: LOCAL_WORLD_SIZE={local!r}: run it under "
                                       "torchrun, which sets it\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("no_tensorboard")
def test_tensorboard_without_its_package_under_torchrun_exits_2(tmp_path: pathlib.Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Each rank checks its machine for the package before any rendezvous."""
    _as_torchrun_rank(monkeypatch, 0, 1, "1")
    monkeypatch.setattr(launcher, "_init_process_group", lambda cfg: pytest.fail("no rendezvous"))
    assert launcher.torchrun_main(["--run-dir", str(tmp_path / "r"), "--tensorboard"]) == 2
    assert capsys.readouterr().err == ("python -m paft.train: error: --tensorboard: needs the tensorboard package, "
                                       "which is not installed: pip install 'paft[tensorboard]'\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("rank", [0, 1])
def test_under_torchrun_rank_0_alone_says_the_run_was_interrupted(tmp_path: pathlib.Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str],
                                                                  rank: int) -> None:
    """torchrun stops every rank (its SIGTERM) and prints what each says: each exits with
    the signal's code, and rank 0 alone says so, with how to continue from the run's
    checkpoint. Ctrl-C ends a rank at once while it waits in the rendezvous, and unwinds
    once the process group is up. In process, as rank ``rank`` of two; the rest replaced."""
    _as_torchrun_rank(monkeypatch, rank, 2, "2")
    run = tmp_path / "r"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step0000002")
    # Ctrl-C's handler in the rendezvous, the other signals set to unwind (the test process
    # keeps its own), Ctrl-C's handler once the process group is up.
    ctrl_c: list[Any] = []
    monkeypatch.setattr(launcher, "_init_process_group", lambda cfg: ctrl_c.append(signal.getsignal(signal.SIGINT)))
    monkeypatch.setattr(launcher, "_set_threads", lambda workers_here: None)
    monkeypatch.setattr(launcher, "unwind_on_termination", lambda: ctrl_c.append("unwind"))
    monkeypatch.setattr(launcher.dist, "get_rank", lambda: rank)

    def stopped(cfg: TrainConfig, prog: str, rank0: bool, *asked: object) -> int:
        ctrl_c.append(signal.getsignal(signal.SIGINT))
        raise launcher.SignalException("got signal: 15", signal.SIGTERM)

    monkeypatch.setattr(launcher, "_main", stopped)
    assert launcher.torchrun_main(["--run-dir", str(run)]) == 128 + signal.SIGTERM
    assert ctrl_c == [signal.SIG_DFL, "unwind", signal.default_int_handler]
    hint = f"to continue from the last checkpoint: torchrun ... -m paft.train --run-dir {run} --resume"
    assert capsys.readouterr().err == ("" if rank else f"\npython -m paft.train: interrupted (SIGTERM); {hint}\n")


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("where", ["_train_in_group", "format_plan"])
def test_under_torchrun_an_overwrite_stopped_before_its_first_checkpoint_names_no_resume(
    where: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An --overwrite interrupted before its first checkpoint gets the old run put back:
    a --resume there goes on with that run, not this one, so rank 0's line names none, as
    paft train's does (it named one, asked once the old run was back); in training, or
    before it (``where``: the plan line, after the claim). In process, as the only rank;
    training replaced."""
    run = _old_run_with_checkpoint(tmp_path)
    _as_torchrun_rank(monkeypatch, 0, 1, "1")
    monkeypatch.setattr(launcher, "_set_threads", lambda workers_here: None)
    monkeypatch.setattr(launcher, "unwind_on_termination", lambda: None)

    def stopped(*args: object) -> Any:
        raise launcher.SignalException("got signal: 15", signal.SIGTERM)

    monkeypatch.setattr(launcher, where, stopped)
    argv = ["--run-dir", str(run), "--overwrite", "--world-size", "1", "--steps", "4",
            *(["--quiet"] if where == "_train_in_group" else [])]
    assert launcher.torchrun_main(argv) == 128 + signal.SIGTERM
    assert capsys.readouterr().err.splitlines() == [
        f"python -m paft.train: the run stopped before a step; {run} was removed",
        f"python -m paft.train: the output it was to replace is back in {run}",
        "",
        "python -m paft.train: interrupted (SIGTERM)",
    ]
    assert (run / "old").exists()


def _main_exit_codes(rank: int, world_size: int, run_dir: str) -> list[int]:
    """Torchrun's entry once the process group is up, training replaced by a guard's
    stop, twice: the new run (exit 3), then a second new run into its directory, which
    the claim refuses (exit 2). Returns the codes this rank exited with."""
    # This worker's own module: it ends with the test.
    launcher._train_in_group = lambda cfg, run_dir: {"status": "persistent_fault", "message": "stopped"}
    return [launcher._main(TrainConfig(run_dir=run_dir, world_size=2, steps=1), "torchrun", rank == 0)
            for _ in range(2)]


def test_under_torchrun_every_rank_exits_3_on_a_guard_stop_and_2_on_a_refused_claim(tmp_path: pathlib.Path) -> None:
    """torchrun says which rank failed first, and with what code: each rank's must be
    paft train's (3: the guard stopped the run; 2: a usage error, the run directory)."""
    assert run_workers(_main_exit_codes, 2, str(tmp_path / "r"), timeout=120) == [[3, 2], [3, 2]]


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("rank0", [True, False], ids=["rank 0", "rank 1"])
def test_under_torchrun_rank_0_alone_says_the_plan_and_the_result(tmp_path: pathlib.Path,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str],
                                                                   rank0: bool) -> None:
    """torchrun prints what every rank says: the plan, the summary and a guard's stop are
    said once, by rank 0; --quiet silences the plan, not the result (as paft train). A
    run that ended (exit 0, or the guard's 3) is kept. In process, as the only rank, told
    whether it is rank 0; training replaced."""
    results = iter([{"status": "ok", "summary": {"steps": 1}}] * 2 + [{"status": "persistent_fault",
                                                                       "message": "stopped"}])
    monkeypatch.setattr(launcher, "_train_in_group", lambda cfg, run_dir: next(results))
    said = []
    for name, quiet in (("plan", False), ("quiet", True), ("stop", True)):
        cfg = TrainConfig(run_dir=str(tmp_path / name), world_size=1, steps=1, quiet=quiet)
        said.append((launcher._main(cfg, "torchrun", rank0), *capsys.readouterr()))
    plan = format_plan(TrainConfig(run_dir=str(tmp_path / "plan"), world_size=1, steps=1), "torchrun")
    summary = [format_summary({"steps": 1}, str(tmp_path / name)) for name in ("plan", "quiet")]
    assert said == ([(0, f"{plan}\n{summary[0]}\n", ""), (0, f"{summary[1]}\n", ""), (3, "", "torchrun: stopped\n")]
                    if rank0 else [(0, "", ""), (0, "", ""), (3, "", "")])
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == (["plan", "quiet", "stop"] if rank0 else [])


def test_a_launched_worker_ends_on_ctrl_c_and_joins_gloo_or_on_gpus_nccl_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker paft train launched ends at once on Ctrl-C (the launcher stops the others
    and cleans up). Its process group is gloo; on GPUs NCCL moves the CUDA tensors and
    gloo the trainer's host-side values. A group already up (the test workers') is its own."""
    backends: list[str] = []
    monkeypatch.setattr(launcher, "_set_threads", lambda workers_here: None)
    monkeypatch.setattr(launcher.dist, "init_process_group", backends.append)
    monkeypatch.setattr(launcher.dist, "is_initialized", lambda: False)
    for device in ("cpu", "cuda"):
        launcher.start_launched_worker(TrainConfig(device=device))
    monkeypatch.setattr(launcher.dist, "is_initialized", lambda: True)
    launcher.start_launched_worker(TrainConfig(device="cuda"))
    assert backends == ["gloo", "cpu:gloo,cuda:nccl"]
    assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL  # (the sigint fixture restores it)


def test_a_failure_is_recorded_at_the_step_it_interrupted_whatever_the_metrics_hold(
    tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = WorkerFailed(1, "failed: ValueError: x", "Traceback (most recent call last):\nValueError: x\n")
    recorder = RunRecorder(tmp_path / "r", 0)
    for step in range(3):
        recorder.metrics({"step": step})
    recorder.close()
    launcher.record_failure(tmp_path / "r", err)
    assert read_jsonl(tmp_path / "r" / "events.jsonl") == [
        {"step": 3, "event": "failed", "rank": 1, "cause": err.cause, "traceback": err.traceback}]
    # No step recorded, or records the failure cannot read (a line not JSON, a record
    # without its step or with one not an integer): it is still recorded, at step 0.
    (tmp_path / "fresh").mkdir()
    for name, text in (("not-json", '{"step": 0}\nnot json\n{"step": 1}\n'), ("no-step", '{"step": 0}\n{}\n'),
                       ("text-step", '{"step": 0}\n{"step": "1"}\n'), ("float-step", '{"step": 0.5}\n')):
        (tmp_path / name / "metrics").mkdir(parents=True)
        (tmp_path / name / "metrics" / "rank0.jsonl").write_text(text)
    for name in ("fresh", "not-json", "no-step", "text-step", "float-step"):
        launcher.record_failure(tmp_path / name, err)
        events = read_jsonl(tmp_path / name / "events.jsonl")
        assert [(e["event"], e["step"], e["rank"], e["cause"]) for e in events] == [("failed", 0, 1, err.cause)], name
    # A run directory it cannot write to, or one gone (removed by rank 0's claim under
    # torchrun, and not made again): the console still has it all.
    (tmp_path / "file").write_text("")
    launcher.record_failure(tmp_path / "file", err)
    assert capsys.readouterr().err.startswith(f"paft train: warning: cannot record the failure in {tmp_path}/file/")
    launcher.record_failure(tmp_path / "gone", err, "python -m paft.train")
    assert capsys.readouterr().err == (f"python -m paft.train: warning: cannot record the failure in {tmp_path}/gone/"
                                       "events.jsonl: No such file or directory\n")
    assert not (tmp_path / "gone").exists()


def test_a_resume_stopped_before_it_cut_the_records_is_recorded_at_its_checkpoint(tmp_path: pathlib.Path) -> None:
    """A resume from step 10 of a leg that stopped at step 20, interrupted while its
    workers started: rank 0's metrics still held the earlier leg's steps, and the
    interruption was recorded at step 20 (the report: "a resume was interrupted there
    again"). Once the resume has cut them, its own steps count, never below its start."""
    run = tmp_path / "r"
    recorder = RunRecorder(run, 0)
    for step in range(20):
        recorder.metrics({"step": step})
    recorder.close()
    start = launcher.leg_start(run, 10)
    sigterm = launcher.SignalException("got signal: 15", signal.SIGTERM)
    launcher.record_interruption(run, sigterm, start=start)
    recorder = RunRecorder(run, 0, append=True)
    recorder.resumed_at(10)  # as the protector loaded from the checkpoint does
    recorder.drop_resumed_steps()
    launcher.record_interruption(run, sigterm, start=start)  # cut, nothing trained since
    for step in range(10, 13):
        recorder.metrics({"step": step})
    recorder.close()
    launcher.record_interruption(run, sigterm, start=start)
    ends = [e["step"] for e in read_jsonl(run / "events.jsonl")]
    assert ends == [10, 10, 13]
