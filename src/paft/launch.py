"""Both sides of starting a run's workers: the launcher, and what runs in each worker.

``paft train`` validates everything first (options, config file, run directory), so
bad input never starts a worker or leaves a directory behind; then it claims the
run directory (:func:`paft.claim.claim_run_dir`) and starts :func:`run_worker` on each rank through
:func:`paft.workers.local_workers` (torch's elastic launcher, the machinery behind
torchrun: c10d rendezvous on a free local port, one process per rank, failures
propagated).
Under torchrun (``python -m paft.train``) each rank runs :func:`torchrun_main`
instead, and rank 0 claims the run directory as the launcher would (and settles it
once its peers are out). Either way a worker trains with :class:`paft.train.Trainer`.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shlex
import signal
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SignalException

from paft.claim import claim_run_dir, last_rank_out_tidies, tidy_after_workers
from paft.config import TrainConfig
from paft.exitcodes import EXIT_PERSISTENT_FAULT, EXIT_USAGE, EXIT_WORKER_FAILED
from paft.machine import MachineError, check_machine, uses_cuda
from paft.protect import PersistentFaultError
from paft.records import console, jsonl_line, read_jsonl, sort_faults
from paft.rundir import (
    ResumePoint,
    RunDirError,
    check_run_dir,
    default_run_dir,
    finished,
    has_checkpoint,
    resolve_run_dir,
)
from paft.signals import SignalHold, interrupted, signal_of, unwind_on_termination
from paft.train import Trainer, format_plan, format_summary
from paft.workers import WorkerFailed, local_workers

__all__ = [
    "launch",
    "run_worker",
    "start_launched_worker",
    "take_group_down",
    "torchrun_main",
    "resume_hint",
]


def launch(cfg: TrainConfig, resumed_with: Sequence[str] = (), prog: str = "paft train") -> int:
    """Run ``cfg`` on ``cfg.world_size`` local workers; returns the exit code.
    ``resumed_with``: the options a ``--resume`` changes, as command-line words
    (:func:`paft.resume_options.resume_args`), which the line saying how to continue names;
    ``prog``: how the command was run (``python -m paft train``), which its lines name.

    Raises :class:`paft.rundir.RunDirError` or :class:`paft.machine.MachineError` (before
    anything is written) when the run directory or this machine (its devices, the
    tensorboard package for ``--tensorboard``) cannot be used. What a run that fails or
    is interrupted leaves in its run directory: :func:`paft.claim.claim_run_dir`.
    """
    cfg.run_dir = resolve_run_dir(cfg.run_dir or default_run_dir(cfg.workload))
    check_machine(cfg)
    resumed = check_run_dir(cfg)
    with claim_run_dir(cfg, prog) as outcome:
        code = _run_workers(cfg, resumed_with, resumed, prog)
        tidy_after_workers(pathlib.Path(cfg.run_dir), prog)  # the workers are gone, however they ended
        outcome["code"] = code
        return code


def resume_hint(cfg: TrainConfig, command: str, resumed_with: Sequence[str] = ()) -> str:
    """What an interrupted run's line adds where ``cfg.run_dir`` keeps a checkpoint: how
    to continue from it (``command``: how the run was started; ``resumed_with``: see
    :func:`_resuming`)."""
    if not cfg.run_dir or not has_checkpoint(pathlib.Path(cfg.run_dir)):
        return ""
    return _finished_note(cfg) or (f"; to continue from the last checkpoint: {command} "
                                   f"--run-dir {shlex.quote(cfg.run_dir)} {_resuming(cfg, resumed_with)}")


def _finished_note(cfg: TrainConfig) -> str:
    """What the line of a run stopped once it had trained its ``--steps`` and written its
    summary (a worker killed, or a signal, in the last barrier or the group's teardown)
    says in place of a resume, which :func:`paft.rundir.check_run_dir` would refuse; ""
    where the run had not finished."""
    if not finished(pathlib.Path(cfg.run_dir), cfg.steps):
        return ""
    return (f"; {cfg.run_dir} holds the finished run: it had trained its {cfg.steps} steps and written "
            f"summary.json (a --resume trains on with --steps above {cfg.steps})")


def _resuming(cfg: TrainConfig, resumed_with: Sequence[str]) -> str:
    """The options that continue ``cfg``'s run. A resume stopped before its next
    checkpoint puts back the ``config.json`` of the last one, so it names what it
    changed: its ``--steps`` (a plain ``--resume`` of a run that trained that far is
    refused with the smaller one) and ``resumed_with``, the other options it changed
    (command-line words), which a plain ``--resume`` would take back."""
    if not cfg.resume:
        return "--resume"
    return shlex.join(["--resume", "--steps", str(cfg.steps), *resumed_with])


def _run_workers(cfg: TrainConfig, resumed_with: Sequence[str], resumed: ResumePoint | None = None,
                 prog: str = "paft train") -> int:
    """``resumed``: what :func:`paft.rundir.check_run_dir` returned; ``prog``: :func:`launch`'s."""
    if not cfg.quiet:
        console(format_plan(cfg, prog, resumed.schedule if resumed else None))
    start = leg_start(pathlib.Path(cfg.run_dir), resumed.step if resumed else 0)
    try:
        results = local_workers(run_worker, cfg.world_size)(cfg.to_dict(), cfg.run_dir)
    except WorkerFailed as err:
        record_failure(pathlib.Path(cfg.run_dir), err, prog, start)
        kept = ""
        if has_checkpoint(pathlib.Path(cfg.run_dir)):
            kept = _finished_note(cfg) or (f"; {cfg.run_dir} keeps its checkpoints ({_resuming(cfg, resumed_with)} "
                                           "continues from the last)")
        print(err.describe(prog) + kept, file=sys.stderr)
        return EXIT_WORKER_FAILED
    except (KeyboardInterrupt, SignalException) as err:
        record_interruption(pathlib.Path(cfg.run_dir), err, prog, start)
        return interrupted(err, resume_hint(cfg, prog, resumed_with), prog)
    stopped = _exit_code(results[0]) == EXIT_PERSISTENT_FAULT
    return _tell_result(results[0], cfg.run_dir, prog, hint=resume_hint(cfg, prog, resumed_with) if stopped else "")


def _exit_code(result: dict[str, Any]) -> int:
    """The exit code of a run that ended with ``result`` (:func:`_train`'s): 0 when it
    finished, 3 when the guard stopped it."""
    return EXIT_PERSISTENT_FAULT if result["status"] == "persistent_fault" else 0


def _tell_result(result: dict[str, Any], run_dir: str, prog: str, say: bool = True, hint: str = "") -> int:
    """Say how a run that ended went (unless ``say`` is false: under torchrun rank 0 alone
    says it), the guard's reason for stopping it, with ``hint`` (:func:`resume_hint`: a
    resume stopped before its next checkpoint puts back the options of its last one, so
    only the command it names goes on as the run did), or the summary table (--quiet
    silences progress, not the result); returns its exit code (:func:`_exit_code`)."""
    code = _exit_code(result)
    if say and code == EXIT_PERSISTENT_FAULT:
        print(f"{prog}: {result['message']}{hint}", file=sys.stderr, flush=True)
    elif say:
        console(format_summary(result["summary"], run_dir))
    return code


class LegStart(NamedTuple):
    """Where a leg of a run (the start, or a resume) started, taken before any of its
    workers trains: what the step a leg's end is recorded at is judged by."""

    step: int
    """The steps done it started from (a resume's checkpoint; 0)."""
    records: tuple[int, int] | None
    """Which file rank 0's ``metrics/rank0.jsonl`` was (device, inode; None: none)."""


def leg_start(run_dir: pathlib.Path, step: int) -> LegStart:
    """The leg about to start in ``run_dir`` from ``step`` (a resume's checkpoint; 0)."""
    return LegStart(step, _identity(run_dir / "metrics" / "rank0.jsonl"))


def record_failure(run_dir: pathlib.Path, err: WorkerFailed, prog: str = "paft train",
                   start: LegStart | None = None) -> None:
    """Put the failure in the run's ``events.jsonl`` (``"event": "failed"``: the step it
    interrupted, the rank, the cause, the traceback), so that the run directory, kept
    for ``paft report`` or ``--resume``, says why it stopped; the console's account is
    gone once the terminal is. ``start``: see :func:`_record_leg_end`."""
    record = {"event": "failed", "rank": err.rank, "cause": err.cause, "traceback": err.traceback}
    _record_leg_end(run_dir, record, "the failure", prog, start)


def record_interruption(run_dir: pathlib.Path, err: KeyboardInterrupt | SignalException,
                        prog: str = "paft train", start: LegStart | None = None) -> None:
    """Put the signal that stopped the workers in the run's ``events.jsonl``
    (``"event": "interrupted"``: the step it interrupted, the signal's name): without it
    the run directory of a run stopped by Ctrl-C or a scheduler's SIGTERM did not say why
    it ended early. ``start``: see :func:`_record_leg_end`."""
    _record_leg_end(run_dir, {"event": "interrupted", "signal": signal_of(err).name}, "the interruption",
                    prog, start)


def _record_leg_end(run_dir: pathlib.Path, record: dict[str, Any], what: str, prog: str,
                    start: LegStart | None = None) -> None:
    """Append ``record`` (why the run stopped), with the step it stopped in (the one after
    rank 0's last recorded, and not before the leg's ``start``), to ``events.jsonl``. A
    resume cuts the records of the steps it re-does only once its workers are up (the
    file rewritten, :meth:`paft.records.RunRecorder.drop_resumed_steps`): while rank 0's
    metrics are still the file the leg found, their steps are the earlier leg's, and
    this one stopped at its start (it was recorded where the earlier leg stopped, and the
    report then said the resume stopped there again). One write to the file opened for
    appending: under torchrun a peer may append its own lines meanwhile."""
    metrics = run_dir / "metrics" / "rank0.jsonl"
    step = start.step if start else 0
    if start is None or start.records is None or _identity(metrics) != start.records:
        try:
            steps = [r["step"] for r in read_jsonl(metrics)]
        except (OSError, ValueError, KeyError):
            steps = []
        if steps and all(isinstance(s, int) for s in steps):
            step = max(step, max(steps) + 1)
    line = jsonl_line({"step": step, **record}).encode()
    try:  # into the directory as it is: a torchrun peer late out must not make a removed run's again
        fd = os.open(run_dir / "events.jsonl", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError as oserr:  # the console still says it all
        print(f"{prog}: warning: cannot record {what} in {run_dir}/events.jsonl: "
              f"{oserr.strerror or oserr}", file=sys.stderr)


# -- inside a worker ------------------------------------------------------------------


def _init_process_group(cfg: TrainConfig) -> None:
    if dist.is_initialized():
        return
    # On GPUs, NCCL moves CUDA tensors (gradients, syncs, the control vector) and gloo
    # the trainer's few host-side values (evaluation losses, summary counters).
    dist.init_process_group("cpu:gloo,cuda:nccl" if uses_cuda(cfg) else "gloo")


def _set_threads(workers_here: int) -> None:
    # N workers share the machine's cores: one BLAS pool each, sized to its share.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers_here))


def start_launched_worker(cfg: TrainConfig) -> None:
    """Set up a worker that ``paft train`` or ``paft bench`` launched: its threads, its
    process group, and Ctrl-C, which ends it at once. The terminal signals the launcher
    too, which stops every worker and cleans up; a KeyboardInterrupt here only printed
    each worker's traceback, and a worker waiting in C++ (the rendezvous, a collective)
    never saw it, so the launcher waited 30 s before killing it. Records are flushed
    line by line and checkpoints written atomically: a worker killed mid-write leaves
    no half-written checkpoint in its place (only a ``.rankN.pt.*`` temporary beside it,
    which no resume reads and :func:`launch` removes once the workers are gone). (Under
    torchrun rank 0 holds the run directory itself and must unwind:
    :func:`torchrun_main` keeps Python's handler.)"""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    _set_threads(int(os.environ.get("LOCAL_WORLD_SIZE", "1")))  # the elastic launcher sets it
    _init_process_group(cfg)


def run_worker(cfg_dict: dict[str, Any], run_dir: str) -> dict[str, Any]:
    """Entry point of one worker launched by ``paft train`` (elastic launcher, env:// rendezvous)."""
    cfg = TrainConfig.from_dict(cfg_dict)
    start_launched_worker(cfg)
    return _train_in_group(cfg, run_dir)


def _train_in_group(cfg: TrainConfig, run_dir: str) -> dict[str, Any]:
    """Train in the process group already up (a launched worker's, or a torchrun rank's),
    then take it down."""
    done = False  # the run finished, or the guard stopped it (every rank stops at the same step)
    try:
        result = _train(cfg, run_dir)
        done = True
        return result
    finally:
        take_group_down(every_rank_done=done)


def _train(cfg: TrainConfig, run_dir: str) -> dict[str, Any]:
    """Train; a persistent fault the guard stops on is a result, not an error. The
    Trainer goes with this frame, and with it the DDP model, whose reducer holds the
    process group: freed after the group's destruction (at the interpreter's exit), gloo's
    teardown aborted a rank now and then ("terminate called without an active exception")."""
    trainer = Trainer(cfg, pathlib.Path(run_dir))
    try:
        return {"status": "ok", "summary": trainer.train()}
    except PersistentFaultError as err:
        if dist.get_rank() == 0:
            trainer.recorder.event({"step": err.step, "event": "stop", "ranks": err.ranks, "reason": str(err)})
            # Every rank wrote its faults of the step before the decision they all stop on.
            sort_faults(run_dir)
        trainer.recorder.close()
        return {"status": "persistent_fault", "message": str(err)}


def take_group_down(every_rank_done: bool) -> None:
    """Destroy the process group: once every rank is done, after a barrier, so that no
    rank closes its gloo connections while a peer still reads them (a rank aborted in
    gloo's teardown: 'terminate called without an active exception'); where this rank
    failed, at once, since a barrier would wait for peers that may never come.

    Free what holds the group first (a DDP model, whose reducer does: see :func:`_train`).
    Left to outlive it, the group's last reference could go with one in a gloo worker
    thread, whose destructor then joined its own thread ('Resource deadlock avoided')."""
    if every_rank_done:
        dist.barrier()
    dist.destroy_process_group()


def _identity(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """Which directory is at ``path`` (device, inode); None where there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


# How long rank 0 waits under torchrun for its peers to be out before it settles the run
# directory: well inside the 30 s torchrun leaves a rank between its SIGTERM and SIGKILL.
_PEERS_OUT_SECONDS = 10.0


@contextlib.contextmanager
def _peers_out_first(run_dir: pathlib.Path, token: str, prog: str) -> Iterator[None]:
    """Under torchrun, hold rank 0 back on its way out until every peer is out too, so
    that its claim settles ``run_dir`` only once no rank writes there any more, as
    ``paft train``'s launcher does once its workers are gone: a peer still training when
    rank 0 failed wrote by path (its checkpoint file, a first record) into the old run
    that the claim had just moved back for ``--overwrite``, or made a removed run's
    folders again. Each peer says it is out in the process group's store as it leaves,
    under ``token``, this run's (torchrun's own store outlives a restart's ranks); rank
    0 waits for them at most :data:`_PEERS_OUT_SECONDS` (a peer killed, or stuck in a
    collective with rank 0 gone, never says so), then warns and goes on. Signals are
    held meanwhile: torchrun stops every rank when one fails, and its SIGTERM would cut
    the wait for the others short."""
    store = dist.distributed_c10d._get_default_store()  # kept here, it outlives the group
    rank, world_size = dist.get_rank(), dist.get_world_size()
    keys = [f"paft/out/{token}/{r}" for r in range(world_size)]
    try:
        yield
    finally:
        if rank:
            with contextlib.suppress(dist.DistError):  # rank 0, which may host the store, gave up on it
                store.set(keys[rank], "")
        else:
            missing, deadline = list(range(1, world_size)), time.monotonic() + _PEERS_OUT_SECONDS
            with SignalHold():
                while missing and time.monotonic() < deadline:
                    time.sleep(0.01)
                    missing = [r for r in missing if not store.check([keys[r]])]
            if missing:
                print(f"{prog}: warning: rank(s) {', '.join(map(str, missing))} not out after "
                      f"{_PEERS_OUT_SECONDS:g} s (stopped, or stuck in a collective); {run_dir} is put in order "
                      "without them", file=sys.stderr)


def torchrun_main(argv: Sequence[str] | None = None) -> int:
    """``python -m paft.train`` under torchrun: every rank parses the same options.

    The world size is torchrun's (``WORLD_SIZE``) unless ``--world-size`` or a config
    file sets it; a value that differs from the processes torchrun started is refused
    (exit 2), since the per-rank batch and the fault ranks are derived from it."""
    from paft.options import parse_train_config

    prog = "python -m paft.train"
    # What torchrun sets for the env:// rendezvous; without it, the process group's set-up
    # fails with a traceback.
    torchrun_env = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    problem = ", ".join(f"{name} not set" for name in torchrun_env if name not in os.environ)
    launched = None
    if not problem:
        try:
            launched = int(os.environ["WORLD_SIZE"])
        except ValueError:
            problem = f"WORLD_SIZE={os.environ['WORLD_SIZE']!r}"
    # Every rank parses and refuses alike: the first to exit makes torchrun stop the
    # others, maybe before rank 0 has written a word.
    cfg, resumed_with = parse_train_config(argv, prog=prog, launched=launched, warn=os.environ.get("RANK", "0") == "0")
    if problem:
        print(f"{prog}: error: {problem}: run it under torchrun, which sets {', '.join(torchrun_env)} (e.g. "
              f"torchrun --standalone --nproc-per-node 4 -m paft.train), or use paft train, which starts its own "
              f"workers", file=sys.stderr)
        return EXIT_USAGE
    try:
        local = os.environ.get("LOCAL_WORLD_SIZE", str(cfg.world_size))
        if not local.isdigit() or int(local) < 1:
            raise MachineError(f"LOCAL_WORLD_SIZE={local!r}: run it under torchrun, which sets it")
        workers_here = int(local)
        check_machine(cfg, local_workers=workers_here)
    except MachineError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    _set_threads(workers_here)
    # DDP's constructor imports torch._dynamo, and torch.fx's wrap(), run by that import,
    # keeps its own frame in a reference cycle, and so every caller's frame until a full
    # garbage collection: the Trainer's too, whose DDP model then outlived the process
    # group (see _train). Imported here, it holds this frame only. (paft train's workers
    # have it from their fork server.)
    import torch._dynamo  # noqa: F401
    # A rank waiting for its peers waits in C++, where no Python handler runs (SIGTERM's
    # and Ctrl-C's went unheard for the rendezvous' 30 minutes): until the group is up,
    # when nothing needs undoing yet, a signal ends it by its default action.
    interrupt = signal.getsignal(signal.SIGINT)
    if interrupt is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    _init_process_group(cfg)
    signal.signal(signal.SIGINT, interrupt)
    # From here torchrun's SIGTERM (when a rank fails, or torchrun is stopped), the SIGHUP
    # and SIGQUIT it passes on, and Ctrl-C unwind, so that rank 0's claim cleans up as
    # paft train's launcher does.
    unwind_on_termination()
    rank0 = dist.get_rank() == 0
    hint: list[str] = []  # how to go on, where _main asked it before its claim settled
    try:
        return _main(cfg, prog, rank0, resumed_with, hint)
    except (KeyboardInterrupt, SignalException) as err:
        said = hint[0] if hint else resume_hint(cfg, _TORCHRUN, resumed_with) if rank0 else ""
        return interrupted(err, said, prog=prog, say=rank0)


# How a run under torchrun was started, as the line saying how to go on names it.
_TORCHRUN = "torchrun ... -m paft.train"


@contextlib.contextmanager
def _hint_on_interruption(cfg: TrainConfig, resumed_with: Sequence[str], hint: list[str]) -> Iterator[None]:
    """Rank 0's claim held: an interruption puts how to go on (:func:`resume_hint`) in
    ``hint`` before the claim settles, while the directory still holds this run."""
    try:
        yield
    except (KeyboardInterrupt, SignalException):
        hint.append(resume_hint(cfg, _TORCHRUN, resumed_with))
        raise


def _main(cfg: TrainConfig, prog: str, rank0: bool, resumed_with: Sequence[str] = (),
          hint: list[str] | None = None) -> int:
    """:func:`torchrun_main` once the process group is up (``resumed_with``: see
    :func:`launch`). Rank 0 asks how to go on (:func:`resume_hint`) while the directory
    still holds this run, as paft train's launcher does: once the claim has put back the
    old run an ``--overwrite`` stopped before its first checkpoint was to replace, a
    checkpoint there is that run's. An interruption's is put in ``hint``; a guard's
    stop's is said with it."""
    # One run-dir name for all ranks, and the same checks everywhere, so all ranks agree.
    name = [resolve_run_dir(cfg.run_dir or default_run_dir(cfg.workload)), uuid.uuid4().hex]
    dist.broadcast_object_list(name, src=0)
    cfg.run_dir, token = name
    with contextlib.ExitStack() as claim:
        # Rank 0 claims the directory as paft train does (the lock, --overwrite's set-aside,
        # the clean-up of a run that stopped before its first checkpoint); every rank
        # learns whether it could.
        told: list[Any] = ["", 0]  # rank 0's refusal ("": none), and the step the leg starts at (a resume's)
        outcome = {"code": 0}
        resumed = None
        if rank0:
            try:
                resumed = check_run_dir(cfg)
                told[1] = resumed.step if resumed else 0
                outcome = claim.enter_context(claim_run_dir(cfg, prog))
                if hint is not None:  # left before the claim settles, as contexts leave in reverse
                    claim.enter_context(_hint_on_interruption(cfg, resumed_with, hint))
            except RunDirError as err:
                told[0] = str(err)
        dist.broadcast_object_list(told, src=0)
        if told[0]:
            if rank0:
                print(f"{prog}: error: {told[0]}", file=sys.stderr)
            take_group_down(every_rank_done=True)  # every rank refuses, on the broadcast
            return EXIT_USAGE
        # Entered after the claim, so that on the way out each rank tidies (when last out),
        # then rank 0 waits for its peers to be out, then settles.
        claim.enter_context(_peers_out_first(pathlib.Path(cfg.run_dir), token, prog))
        claim.enter_context(last_rank_out_tidies(pathlib.Path(cfg.run_dir), prog))
        # Before the barrier, which no rank passes to train (and rank 0 to cut a resume's
        # records) until every rank has taken it.
        start = leg_start(pathlib.Path(cfg.run_dir), told[1])
        # Rank 0 leaves (and lets the claim's lock go) only once every rank holds its shared
        # lock: a peer slow to take it was not yet inside for a new claim to see.
        dist.barrier()
        if rank0 and not cfg.quiet:
            console(format_plan(cfg, prog, resumed.schedule if resumed else None))
        rank = dist.get_rank()  # asked now: _train_in_group takes the group down, failed or not
        ours = _identity(cfg.run_dir)
        try:
            result = _train_in_group(cfg, cfg.run_dir)
        except SignalException:  # an Exception of torch's: a stop, told as one (interrupted)
            raise
        except Exception as err:
            # No launcher of paft's outlives torchrun's ranks to record why the run
            # stopped, as paft train's does: each rank that raises records its own (a rank
            # that lost a peer says so), the first failure first. Only into this run: a
            # peer out late finds the old run rank 0's claim put back at the path.
            if ours is not None and _identity(cfg.run_dir) == ours:
                record_failure(pathlib.Path(cfg.run_dir), WorkerFailed.from_exception(rank, err), prog, start)
            raise
        outcome["code"] = code = _exit_code(result)
        stopped = resume_hint(cfg, _TORCHRUN, resumed_with) if rank0 and code == EXIT_PERSISTENT_FAULT else ""
    return _tell_result(result, cfg.run_dir, prog, say=rank0, hint=stopped)  # once the claim settled the directory
