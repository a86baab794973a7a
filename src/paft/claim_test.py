"""Holding a run directory: its lock, an old run set aside and settled, a new run's
folders removed when it stopped early, a resume's options kept with its checkpoint,
and the tidying by the last torchrun rank out."""

from __future__ import annotations

import errno
import json
import os
import pathlib
import shutil
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from paft import claim, records
from paft.config import TrainConfig
from paft.exitcodes import EXIT_PERSISTENT_FAULT, EXIT_WORKER_FAILED
from paft.records import atomic_write_bytes
from paft.rundir import RunDirError

pytestmark = pytest.mark.usefixtures("sigint")


def old_run(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> pathlib.Path:
    """A run directory ``r`` holding a 2-step run's config.json, in ``tmp_path``, the working directory."""
    monkeypatch.chdir(tmp_path)
    run = pathlib.Path("r")
    run.mkdir()
    (run / "config.json").write_text(json.dumps(TrainConfig(run_dir="r", steps=2).to_dict()))
    return run


def run_claimed(cfg: TrainConfig, workers: Callable[[TrainConfig], int]) -> int:
    """What :func:`paft.launch.launch` does around its workers: ``workers`` run in the
    claimed run directory, their exit code the claim's outcome."""
    with claim.claim_run_dir(cfg) as outcome:
        outcome["code"] = workers(cfg)
    return outcome["code"]


def _must_not_start(cfg: TrainConfig) -> int:
    pytest.fail("the run must not start")


def _interrupting(real: Any, after: bool = False) -> Any:
    """``real``, with a Ctrl-C just before it starts (or just ``after`` it returned)."""
    def call(*args: Any, **kwargs: Any) -> Any:
        if not after:
            os.kill(os.getpid(), signal.SIGINT)  # unless held, the handler raises before ``real`` starts
        result = real(*args, **kwargs)
        if after:
            os.kill(os.getpid(), signal.SIGINT)
        return result

    return call


def test_ctrl_c_while_the_replaced_run_is_deleted_deletes_it_whole(tmp_path: pathlib.Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C while --overwrite deleted the run it replaced (the new one had finished)
    stopped the delete: a ``r.replaced-<id>`` folder stayed behind."""
    run = old_run(tmp_path, monkeypatch)

    def finished(cfg: TrainConfig) -> int:
        (run / "summary.json").write_text("{}")
        return 0

    monkeypatch.setattr(shutil, "rmtree", _interrupting(shutil.rmtree))
    with pytest.raises(KeyboardInterrupt):
        run_claimed(TrainConfig(run_dir="r", steps=1, overwrite=True), finished)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]
    assert (run / "summary.json").is_file() and json.loads((run / "config.json").read_text())["steps"] == 1


def test_ctrl_c_right_after_the_old_run_is_set_aside_brings_it_back(tmp_path: pathlib.Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C between moving the old run aside and the clean-up's ``try`` left it aside."""
    run = old_run(tmp_path, monkeypatch)
    monkeypatch.setattr(claim, "set_aside", _interrupting(claim.set_aside, after=True))
    with pytest.raises(KeyboardInterrupt):
        run_claimed(TrainConfig(run_dir="r", steps=1, overwrite=True), _must_not_start)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]
    assert json.loads((run / "config.json").read_text())["steps"] == 2


def test_an_old_run_comes_back_when_the_new_directory_cannot_be_made(tmp_path: pathlib.Path,
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """--overwrite moves the old run aside and then creates the new directory: when that
    fails (another start took the name meanwhile), the old run is moved back."""
    run = old_run(tmp_path, monkeypatch)

    def taken(run_dir: pathlib.Path) -> None:
        raise RunDirError(f"--run-dir: {run_dir} was just created by another paft train; pick another --run-dir")

    monkeypatch.setattr(claim, "_create", taken)
    with pytest.raises(RunDirError, match="r was just created by another paft train"):
        run_claimed(TrainConfig(run_dir="r", steps=1, overwrite=True), _must_not_start)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]
    assert json.loads((run / "config.json").read_text())["steps"] == 2
    assert "the output it was to replace is back in r" in capsys.readouterr().err


@pytest.mark.parametrize("how", ["checkpointed", "guard stop"])
def test_overwrite_deletes_the_old_run_once_the_new_one_checkpointed_or_ended(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], how: str) -> None:
    """A new run that failed after its first checkpoint (--resume continues it), or that the
    guard stopped (exit 3, an end the user asked for), replaces the old run for good, even
    with no step recorded; neither is said to have stopped early."""
    run = old_run(tmp_path, monkeypatch)

    def workers(cfg: TrainConfig) -> int:
        if how == "guard stop":
            (run / "events.jsonl").write_text('{"step": 0, "event": "stop"}\n')
            return EXIT_PERSISTENT_FAULT
        (run / "checkpoints").mkdir()
        (run / "checkpoints" / "latest").write_text("step0000001\n")
        return EXIT_WORKER_FAILED

    code = run_claimed(TrainConfig(run_dir="r", steps=4, overwrite=True), workers)
    assert code == (3 if how == "guard stop" else 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r"]
    assert json.loads((run / "config.json").read_text())["steps"] == 4
    assert (run / ("events.jsonl" if how == "guard stop" else "checkpoints/latest")).is_file()
    assert capsys.readouterr().err == ""


def test_a_run_stopped_before_a_step_removes_what_it_made_and_only_that(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The folders a new run created go again, a parent only while empty (a file put
    there meanwhile stays, with its folder); in an empty folder the user gave, what the
    run wrote goes (folders too) and the folder stays."""
    monkeypatch.chdir(tmp_path)
    pathlib.Path("outer").mkdir()
    pathlib.Path("given").mkdir()

    def workers(cfg: TrainConfig) -> int:
        (pathlib.Path(cfg.run_dir) / "checkpoints").mkdir()  # a first checkpoint begun, never done
        if cfg.run_dir.startswith("outer/new/"):
            pathlib.Path("outer/new/theirs").write_text("")
        return EXIT_WORKER_FAILED

    assert run_claimed(TrainConfig(run_dir="outer/made/deeper/r", steps=2), workers) == 1
    assert run_claimed(TrainConfig(run_dir="outer/new/deeper/r", steps=2), workers) == 1
    assert run_claimed(TrainConfig(run_dir="given", steps=2), workers) == 1
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "given", "outer", "outer/new", "outer/new/theirs"]
    assert capsys.readouterr().err == (
        "paft train: the run stopped before a step; outer/made/deeper/r was removed\n"
        "paft train: the run stopped before a step; outer/new/deeper/r was removed\n"
        "paft train: the run stopped before a step; what it wrote in given was removed\n")


def test_a_refused_claim_gives_the_signals_back(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The claim holds Ctrl-C and the terminating signals while it sets an old run aside;
    a claim refused there (the directory in use) must hand them back, or a later Ctrl-C
    is only noted and never acted on."""
    run = old_run(tmp_path, monkeypatch)
    before = signal.getsignal(signal.SIGTERM)
    with claim.hold_dir_lock(run), pytest.raises(RunDirError, match="in use"):
        with claim.claim_run_dir(TrainConfig(run_dir="r", steps=1, overwrite=True)):
            pytest.fail("the claim must be refused")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) == before
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the handler runs at the next bytecode; this is never reached


def test_each_old_run_set_aside_gets_a_name_of_its_own(tmp_path: pathlib.Path) -> None:
    """An old run kept aside (it could not go back) keeps its name: the next --overwrite
    sets the run now in its place aside beside it."""
    run = tmp_path / "r"
    asides = []
    for _ in range(2):
        run.mkdir()
        aside = claim.set_aside(run)
        assert aside is not None and aside.name.startswith("r.replaced-")
        asides.append(aside)
    assert asides[0] != asides[1] and all(a.is_dir() for a in asides)


def test_a_rewritten_latest_checkpoint_is_told_from_the_one_it_replaced(tmp_path: pathlib.Path) -> None:
    """A resume that stops before its next checkpoint puts config.json back: whether one
    was written meanwhile is read from checkpoints/latest's file identity. Each write
    replaces it whole, with the same name and maybe the same bytes; the file system may
    give it back an inode it freed (its number alone would say "the same file"), or a
    coarse clock the same time (its time alone would)."""
    latest = tmp_path / "checkpoints" / "latest"
    assert claim._latest(tmp_path) == ()
    atomic_write_bytes(latest, b"step 3")
    first, st = claim._latest(tmp_path), latest.stat()
    os.utime(latest, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # its inode, written later
    assert claim._latest(tmp_path) != first
    atomic_write_bytes(latest, b"step 3")  # another inode, at the same time
    os.utime(latest, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert latest.stat().st_ino != st.st_ino and claim._latest(tmp_path) != first


def test_an_old_run_that_cannot_go_back_stays_aside_and_is_named(tmp_path: pathlib.Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """The run --overwrite set aside goes back in place when the new one is not kept;
    where something took that place meanwhile, it stays aside, whole, and the user is
    told where."""
    run = tmp_path / "r"
    run.mkdir()
    (run / "summary.json").write_text("old")
    aside = claim.set_aside(run)
    assert aside is not None
    run.mkdir()
    (run / "theirs").write_text("")  # another start took the name
    claim.settle(aside, run, keep_new=False)
    assert (aside / "summary.json").read_text() == "old" and (run / "theirs").is_file()
    assert capsys.readouterr().err == (f"paft train: the output it was to replace is kept in {aside} (moving it "
                                       f"back to {run} failed: Directory not empty)\n")


def test_a_file_system_without_flock_is_warned_about(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # Some network and FUSE mounts refuse flock: the run goes on, and says what that leaves open.
    def no_flock(fd: Any, operation: int) -> None:
        raise OSError(37, "No locks available")

    monkeypatch.setattr(claim.fcntl, "flock", no_flock)
    with claim.hold_dir_lock(tmp_path):
        pass
    assert capsys.readouterr().err == (f"paft train: warning: cannot lock {tmp_path} (No locks available); nothing "
                                       "stops a second paft train from using it meanwhile\n")


def test_the_last_rank_out_leaves_a_directory_put_in_its_place_alone(tmp_path: pathlib.Path) -> None:
    """Rank 0's claim may remove the run, or move the run --overwrite replaced back in
    its place, while a peer is still on its way out: that one tidies nothing there."""
    run = tmp_path / "r"
    run.mkdir()
    unsorted = '{"attempt": 0, "rank": 0, "step": 1}\n{"attempt": 0, "rank": 0, "step": 0}\n'
    with claim.last_rank_out_tidies(run):
        run.rename(tmp_path / "gone")
        run.mkdir()
        (run / "faults.jsonl").write_text(unsorted)
    assert (run / "faults.jsonl").read_text() == unsorted


def test_overwrite_moves_the_old_run_aside_until_the_new_one_has_something(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    for keep_new in (True, False):
        shutil.rmtree(run, ignore_errors=True)
        run.mkdir()
        (run / "summary.json").write_text("old")
        aside = claim.set_aside(run)
        assert aside is not None and not run.exists() and aside.parent == tmp_path
        assert (aside / "summary.json").read_text() == "old"
        if keep_new:
            run.mkdir()
            (run / "summary.json").write_text("new")
        claim.settle(aside, run, keep_new=keep_new)  # a new run not kept was removed before
        assert (run / "summary.json").read_text() == ("new" if keep_new else "old")
        assert not aside.exists()
    assert f"the output it was to replace is back in {run}" in capsys.readouterr().err
    assert claim.set_aside(tmp_path / "none") is None  # nothing to move
    monkeypatch.chdir(run)
    for here in (".", ".."):  # the working directory, or one that holds it, is never moved
        with pytest.raises(RunDirError, match="is the working directory"):
            claim.set_aside(pathlib.Path(here))


def test_a_run_dir_another_start_took_meanwhile_is_left_alone(tmp_path: pathlib.Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Two new runs started together: the one that lost the directory removed the
    winner's files on its way out (the lock came after the directory was written)."""
    monkeypatch.chdir(tmp_path)
    cfg = TrainConfig(run_dir="d", steps=1)
    theirs = pathlib.Path("d")
    theirs.mkdir()
    (theirs / "config.json").write_text("theirs")
    with claim.hold_dir_lock(theirs), pytest.raises(RunDirError, match="d is in use by another paft train"):
        with claim.claim_run_dir(cfg):
            pass
    with pytest.raises(RunDirError, match="d was just filled by another paft train"):  # not locked yet
        with claim.claim_run_dir(cfg):
            pass
    real_is_dir, looked = pathlib.Path.is_dir, []

    def is_dir(path: pathlib.Path) -> bool:  # the first look misses it; the start that made it is just done
        if path == theirs and not looked:
            looked.append(path)
            return False
        return real_is_dir(path)

    monkeypatch.setattr(pathlib.Path, "is_dir", is_dir)
    with pytest.raises(RunDirError, match="d was just created by another paft train"):  # seen missing, then made
        with claim.claim_run_dir(cfg):
            pass
    assert (theirs / "config.json").read_text() == "theirs"


@pytest.mark.parametrize("code", [1, 3])  # a worker failed; the guard stopped the run (persistent fault)
def test_a_resume_that_stops_before_its_next_checkpoint_keeps_config_json(
        code: int, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Exit 3 counted as a finished run: the new options stayed in config.json, and a later
    --resume went on from the old checkpoint with options it was never trained with."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r" / "checkpoints").mkdir(parents=True)
    (tmp_path / "r" / "checkpoints" / "latest").write_text("step0000024")
    old = json.dumps(TrainConfig(steps=24).to_dict())
    (tmp_path / "r" / "config.json").write_text(old)
    with claim.claim_run_dir(TrainConfig(run_dir="r", steps=40, resume=True)) as outcome:
        assert json.loads((tmp_path / "r" / "config.json").read_text())["steps"] == 40
        outcome["code"] = code
    assert (tmp_path / "r" / "config.json").read_text() == old


def _resumable(tmp_path: pathlib.Path) -> bytes:
    """A run ``r`` in ``tmp_path`` (the working directory) with a checkpoint at step 24; its config.json."""
    (tmp_path / "r" / "checkpoints").mkdir(parents=True)
    (tmp_path / "r" / "checkpoints" / "latest").write_text("step0000024")
    old = json.dumps(TrainConfig(steps=24).to_dict()).encode()
    (tmp_path / "r" / "config.json").write_bytes(old)
    return old


def _disk_full(*args: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_resume_on_a_full_disk_is_refused_and_config_json_stays(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """config.json could not be written, and the claim then tried to put it back, which
    failed the same way: an OSError traceback (exit 1) instead of the refusal (exit 2)."""
    monkeypatch.chdir(tmp_path)
    old = _resumable(tmp_path)
    monkeypatch.setattr(records, "write_together", _disk_full)
    with pytest.raises(RunDirError, match="cannot write r: No space left on device"):
        run_claimed(TrainConfig(run_dir="r", steps=40, resume=True), _must_not_start)
    assert (tmp_path / "r" / "config.json").read_bytes() == old
    assert "stopped before a checkpoint" not in capsys.readouterr().err  # it never started


def test_a_resume_that_fills_the_disk_says_config_json_cannot_be_put_back(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A worker failed on a full disk before the resume's next checkpoint: putting back
    config.json failed too, and its OSError traceback replaced the run's own account."""
    monkeypatch.chdir(tmp_path)
    _resumable(tmp_path)

    def workers(cfg: TrainConfig) -> int:
        monkeypatch.setattr(records, "write_together", _disk_full)
        return EXIT_WORKER_FAILED

    assert run_claimed(TrainConfig(run_dir="r", steps=40, resume=True), workers) == EXIT_WORKER_FAILED
    assert json.loads((tmp_path / "r" / "config.json").read_text())["steps"] == 40
    err = capsys.readouterr().err
    assert "r/config.json could not be put back to its last one's options (No space left on device)" in err


def test_tidying_after_a_run_on_a_full_disk_warns_and_still_removes_the_temporaries(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A run that failed on a full disk: rewriting faults.jsonl in order failed too, an
    OSError traceback after the run's own account, and the checkpoint's temporary and
    its folder stayed."""
    faults = "".join(json.dumps({"step": step, "rank": rank}) + "\n" for step, rank in ((1, 1), (0, 0)))
    (tmp_path / "faults.jsonl").write_text(faults)
    (tmp_path / "checkpoints" / "step0000150").mkdir(parents=True)
    (tmp_path / "checkpoints" / "step0000150" / ".rank0.pt.abcd_123").write_text("")
    monkeypatch.setattr(records, "write_together", _disk_full)
    claim.tidy_after_workers(tmp_path)
    assert not (tmp_path / "checkpoints" / "step0000150").exists()
    assert (tmp_path / "faults.jsonl").read_text() == faults  # as written
    assert capsys.readouterr().err == (f"paft train: warning: cannot put {tmp_path}/faults.jsonl in (step, attempt, "
                                       "rank) order: No space left on device\n")


@pytest.mark.parametrize(("prog", "report"), [("paft train", "paft report"),
                                              ("python -m paft train", "python -m paft report"),
                                              ("python -m paft.train", "python -m paft report")])
def test_a_kept_run_names_the_report_command_as_this_one_was_run(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str], prog: str, report: str) -> None:
    """Where the paft script is not on PATH (python -m paft), "paft report" is not found."""
    run = tmp_path / "r"
    run.mkdir()
    claim._settle_new_run(run, [run], None, ended=False, trained=True, prog=prog)
    assert f"its records stay in {run} ({report} {run});" in capsys.readouterr().err
