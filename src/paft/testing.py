"""Helpers for multi-process tests: run a function on N gloo ranks and collect results.

Tests in paft are real multi-process runs (CPU, gloo), as torchft does it: no mocked
process groups. A worker function ``fn(rank, world_size, *args)`` runs inside an
initialized default process group; whatever it returns comes back to the caller,
indexed by rank.

Example (a script: the workers import ``fn`` from it, so it must be a module-level
function and the launch must sit under the ``__main__`` guard)::

    import torch
    import torch.distributed as dist
    from paft.testing import run_workers

    def work(rank, world_size):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t)
        return t.item()

    if __name__ == "__main__":
        print(run_workers(work, 2))  # [1.0, 1.0]
"""

from __future__ import annotations

import contextlib
import copy
import gc
import io
import os
import queue
import tempfile
import time
import traceback
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from paft.protect import protect

if TYPE_CHECKING:
    from torch import nn

    from paft.config import ProtectConfig
    from paft.protect import Protector, StepReport

__all__ = ["run_workers", "one_rank_group", "take_step", "resumed_runs", "Leg", "ResumedRuns", "WorkerError",
           "NestedStateSGD"]


def take_step(protector: Protector | None, optimizer: torch.optim.Optimizer,
              closure: Callable[[], torch.Tensor]) -> StepReport | None:
    """One training step: plain DDP's (``protector`` None: the closure, then
    ``optimizer.step()``, and None) or the protector's (its report), so that a test runs
    one loop both ways."""
    if protector is None:
        closure()
        optimizer.step()
        return None
    return protector.step(closure)


class Leg(NamedTuple):
    """One run of :func:`resumed_runs`, at its end (after ``close()``)."""

    observed: Any
    """What ``observe(model, protector.optimizer)`` returned."""
    synced: list[bool]
    """Each step's :attr:`StepReport.synced`, in order."""
    counters: dict[str, int]
    """:attr:`Protector.counters`."""
    checkpoint: tuple[dict[str, Any], dict[str, Any], dict[str, Any]]
    """Deep copies of the three state dicts docs/LIBRARY.md saves: ``model.module``'s,
    the protector's optimizer's (a list's :class:`paft.OptimizerChain`) and the protector's."""


class ResumedRuns(NamedTuple):
    """The uninterrupted run, and the same run stopped at a checkpoint and resumed from it."""

    full: Leg
    first: Leg
    """The steps before the checkpoint."""
    resumed: Leg
    """The steps from the checkpoint on, in fresh objects that loaded ``first.checkpoint``."""


def resumed_runs(
    rank: int,
    model: Callable[[], nn.Module],
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer | Sequence[torch.optim.Optimizer]],
    closure: Callable[[nn.Module, torch.optim.Optimizer, int, int], Callable[[], torch.Tensor]],
    observe: Callable[[DistributedDataParallel, torch.optim.Optimizer], Any],
    *,
    config: ProtectConfig,
    inject: Sequence[str],
    steps: int,
    checkpoint: int,
    seed: int = 3,
) -> ResumedRuns:
    """Inside a worker: ``steps`` steps of ``protect(DDP(model()), make_optimizer(...),
    protect=config, inject=inject, seed=seed)`` in one go, then the same steps in two
    legs split at step ``checkpoint``, each leg in fresh objects; the second resumes as
    docs/LIBRARY.md says (``close()``, save the model's, the optimizer's and the
    protector's state dicts; load them, ``prime()``, step on). ``closure(model,
    optimizer, rank, step)`` makes a step's closure; ``make_optimizer`` may return a
    list, which the protector chains. A resume that restores everything makes
    ``resumed`` end where ``full`` does."""

    def run(span: range, saved: tuple[dict[str, Any], ...] | None) -> Leg:
        ddp = DistributedDataParallel(model())
        protector = protect(ddp, make_optimizer(ddp), protect=config, inject=inject, seed=seed)
        synced = []
        for step in span:
            step_closure = closure(ddp, protector.optimizer, rank, step)
            if saved is not None and step == span[0]:
                ddp.module.load_state_dict(saved[0])
                protector.optimizer.load_state_dict(saved[1])
                protector.load_state_dict(saved[2])
                protector.prime(step_closure)
            synced.append(protector.step(step_closure).synced)
        protector.close()
        return Leg(observe(ddp, protector.optimizer), synced, dict(protector.counters),
                   copy.deepcopy((ddp.module.state_dict(), protector.optimizer.state_dict(), protector.state_dict())))

    full = run(range(steps), None)
    first = run(range(checkpoint), None)
    return ResumedRuns(full, first, run(range(checkpoint, steps), first.checkpoint))


class WorkerError(RuntimeError):
    """A worker raised; the message carries the rank and the remote traceback."""


def _entry(
    rank: int,
    world_size: int,
    init_file: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    results: Any,
) -> None:
    torch.set_num_threads(1)
    # What torch's elastic launcher tells a worker, which paft.launch sizes each worker's
    # threads by (cores // local world size): unset, a worker that runs paft train's own
    # worker path took every core, and so parallel chunks whose results could differ
    # between ranks. Measured: under load, 2 threads per rank made the first AdamW step
    # write the second half of one tensor differently on one rank in 7 of 170 pairs of
    # runs (docs/ARCHITECTURE.md, "Determinism").
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
        )
        out = fn(rank, world_size, *args)
        # Plain bytes: torch's shared-memory tensor pickling breaks once the worker exits.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    else:
        # Every rank done before any closes its connections, as paft train's workers
        # take their group down (launch.take_group_down): a rank that finished first and
        # tore down its group while a peer still worked aborted that peer in gloo
        # ('terminate called after throwing an instance of std::system_error', once in a
        # clean-clone run). A peer that failed breaks the barrier: its error is the report.
        with contextlib.suppress(RuntimeError):
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo default process group in this process (no workers); taken down
    on leaving, unless the code inside took it down itself.

    The code inside must drop its DDP models before leaving (it fails otherwise): a
    model that outlives its group can let the group's last reference go in a gloo
    thread, whose destructor then joins itself and aborts the process ("Resource
    deadlock avoided"), as paft's workers once did."""
    assert not dist.is_initialized()
    # Only the models made inside are this group's: one a failed test's traceback keeps
    # from before would fail every later test that takes a group.
    before = weakref.WeakSet(_ddp_models())
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
        gc.collect()  # models held only in reference cycles (hooks, closures) go here
        alive = sum(model not in before for model in _ddp_models())
        if alive:
            raise AssertionError(f"{alive} DistributedDataParallel model(s) outlive the one-rank group: "
                                 "drop them (del) before leaving it")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _ddp_models() -> list[DistributedDataParallel]:
    """The DDP models alive in this process."""
    # type(), not isinstance: that reads torch's deprecated reduce_op's __class__, which warns.
    return [o for o in gc.get_objects() if issubclass(type(o), DistributedDataParallel)]


def _context() -> Any:
    """Workers forked from a server process that has imported torch once, with what
    ``paft train``'s workers are forked with (:mod:`paft.workerserver`: torch._dynamo
    too, which DDP's constructor imports, 1.6 s in each rank of each test otherwise): a
    fresh process each, as with spawn, without each paying torch's import (with 4 ranks
    on 2 cores, about 7 s a call). Workers see the environment of the first call.
    Spawn where there is no fork server (Windows)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["paft.workerserver", "paft.testing"])
    return ctx


def run_workers(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` fresh gloo processes.

    ``fn`` must be importable (defined at module level). Returns the per-rank
    return values; raises :class:`WorkerError` if any rank fails or times out.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="paft-test-") as tmp:
        init_file = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_entry, args=(r, world_size, init_file, fn, args, results), daemon=True
            )
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        # Drain results while workers run: a large result blocks its sender until read.
        outs: dict[int, Any] = {}
        errors: list[str] = []
        deadline = time.monotonic() + timeout
        while len(outs) + len(errors) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, value = results.get(timeout=0.2)
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):
                    break  # a worker died without reporting (segfault, kill)
                continue
            if ok:
                outs[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
        for p in procs:
            p.join(5.0 if not errors else 0.5)
            if p.is_alive():
                p.kill()
        if errors:
            raise WorkerError("\n".join(errors))
        missing = [r for r in range(world_size) if r not in outs]
        if missing:
            codes = [p.exitcode for p in procs]
            raise WorkerError(
                f"ranks {missing} returned nothing within {timeout}s (exit codes {codes})"
            )
        return [outs[r] for r in range(world_size)]


class NestedStateSGD(torch.optim.Optimizer):
    """A test optimizer whose state nests tensors, as L-BFGS and Shampoo-style
    optimizers do: ``history`` (a list of the last two gradients), ``stats`` (a dict
    holding a running mean of squared gradients) and ``count`` (a Python int).
    The update is a normalized average of the history."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                history = state.setdefault("history", [])
                history.append(p.grad.clone())
                del history[:-2]
                stats = state.setdefault("stats", {"sq": torch.zeros_like(p)})
                stats["sq"].mul_(0.9).addcmul_(p.grad, p.grad, value=0.1)
                state["count"] = state.get("count", 0) + 1
                direction = torch.stack(history).mean(0) / (stats["sq"].sqrt() + 1e-8)
                p.add_(direction, alpha=-group["lr"])
