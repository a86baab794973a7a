"""Integration sweep of :func:`paft.protect` around torch's own DDP comm hooks.

paft wraps a user's comm hook (``comm_hook=`` / ``comm_state=``): its own hook injects
and captures the local gradient, calls the user's hook in place of the all-reduce, then
injects into and checksums what that hook returns. This module runs every built-in hook
of ``torch.distributed.algorithms.ddp_comm_hooks`` that way on real DDP (gloo, CPU,
3 ranks): ``allreduce_hook``, ``fp16_compress_hook``, ``bf16_compress_hook``, the
fp16/bf16 compress wrappers around ``allreduce_hook``, ``powerSGD_hook`` (rank 1, both
its vanilla all-reduce phase, steps 0-2, and its compressed one, with and without warm
start), ``batched_powerSGD_hook``, and a hook of a user's own whose state has
``state_dict()`` / ``load_state_dict()`` (error feedback of a bfloat16 rounding). For each:

(a) protect() accepts it;
(b) a fault-free monitored run is plain DDP with the same hook registered, bit for bit
    (parameters and optimizer state), and the monitor's local norms and cosines are
    those of the uncompressed local gradients (computed apart, on a copy of the model);
(c) an aggregation fault under PAFT-Dyn is seen by the checksum of the hook's result
    and repaired: the replicas end bitwise identical;
(d) the guard with a transient local-gradient fault: the recompute is the fault-free
    run bit for bit, through a stateful hook too (PowerSGD, the user's): the guard
    restarts the hook from the state it had before the step's first attempt
    (:mod:`paft.hook_state`), and takes that state only when it can recompute.
"""

# No `from __future__ import annotations`: DDP's register_comm_hook reads the real
# annotations of the hooks defined here.
import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from paft.config import GuardConfig, MonitorConfig, ProtectConfig
from paft.consistency import pairwise_cosine
from paft.integration_optim_test import _equal, _state
from paft.protect import protect
from paft.protect_test import batch, toy_model
from paft.testing import run_workers, take_step

STEPS = 10
START_POWERSGD = 3  # steps 0-2 all-reduce plainly, 3 on compress (the faults hit steps 3 and 4)


def _bf16_on_gloo(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """bf16_compress_hook under another name: DDP's register_comm_hook refuses the hook
    by its name unless NCCL runs (gloo all-reduces bfloat16 fine), so the plain-DDP
    reference registers it so; paft calls the hook itself and does not refuse it."""
    return default_hooks.bf16_compress_hook(state, bucket)


def _bf16_wrap_on_gloo(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """bf16_compress_wrapper(allreduce_hook) under another name, as :func:`_bf16_on_gloo`."""
    return default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook)(state, bucket)


def _powersgd(warm_start: bool = True) -> powerSGD_hook.PowerSGDState:
    return powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                       start_powerSGD_iter=START_POWERSGD, warm_start=warm_start)


class _Feedback:
    """A user's hook state: per bucket, the residual of rounding the gradient to bfloat16,
    added to the next step's (error feedback, updated in place). ``state_dict()`` hands out
    the live tensors, so paft must copy them; ``taken`` counts its calls."""

    def __init__(self) -> None:
        self.error: dict[int, torch.Tensor] = {}
        self.taken = 0

    def state_dict(self) -> dict[str, Any]:
        self.taken += 1
        return {"error": self.error}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.error = state["error"]


def _feedback_hook(state: _Feedback, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    error = state.error.setdefault(bucket.index(), torch.zeros_like(buffer))
    buffer.add_(error)
    rounded = buffer.to(torch.bfloat16).to(buffer.dtype)
    error.copy_(buffer - rounded)
    buffer.copy_(rounded).div_(dist.get_world_size())
    return dist.all_reduce(buffer, async_op=True).get_future().then(lambda fut: fut.value()[0])


# Each run's (state, hook), fresh: PowerSGD's state advances with every step.
HOOKS: dict[str, Callable[[], tuple[Any, Callable[..., Any]]]] = {
    "allreduce": lambda: (None, default_hooks.allreduce_hook),
    "fp16": lambda: (None, default_hooks.fp16_compress_hook),
    "bf16": lambda: (None, _bf16_on_gloo),
    "fp16-wrapper": lambda: (None, default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook)),
    "bf16-wrapper": lambda: (None, _bf16_wrap_on_gloo),
    "powersgd": lambda: (_powersgd(), powerSGD_hook.powerSGD_hook),
    "batched-powersgd": lambda: (_powersgd(), powerSGD_hook.batched_powerSGD_hook),
    "powersgd-cold": lambda: (_powersgd(warm_start=False), powerSGD_hook.powerSGD_hook),
    "feedback": lambda: (_Feedback(), _feedback_hook),
}
GUARD = {"enabled": True, "warmup": 2}
METRICS = ("replicas/grad_distinct", "replicas/grad_minority_ranks", "local_grad_norms", "consistency/grad_cos_min")


def _local_grad(model: DistributedDataParallel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """This rank's own gradient of the batch, uncompressed, on a copy of the model (no DDP)."""
    local = copy.deepcopy(model.module)
    nn.functional.mse_loss(local(x), y).backward()
    return torch.cat([p.grad.reshape(-1) for p in local.parameters()]).double()


def _run(rank: int, name: str, opts: dict[str, Any]) -> dict[str, Any]:
    """``STEPS`` Adam steps of the toy model through hook ``name``: registered on plain DDP
    (``plain``) or passed to protect(). An error raised on the way is returned by type."""
    model = DistributedDataParallel(toy_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    state, hook = HOOKS[name]()
    if opts.get("plain"):
        model.register_comm_hook(state, hook)
        protector = None
    else:
        protector = protect(model, optimizer, monitor=MonitorConfig(**opts.get("monitor", {})),
                            protect=ProtectConfig(**opts.get("protect", {})),
                            guard=GuardConfig(**opts.get("guard", {})),
                            inject=opts.get("inject", []), seed=3, comm_hook=hook, comm_state=state)
    reports, local_grads = [], []
    try:
        for step in range(STEPS):
            x, y = batch(rank, step)
            local_grads.append(_local_grad(model, x, y))

            def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                optimizer.zero_grad(set_to_none=True)
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss

            r = take_step(protector, optimizer, closure)
            if r is not None:
                reports.append({"applied": r.applied, "attempts": r.attempts, "synced": r.synced,
                                **{k: r.metrics.get(k) for k in METRICS}})
    except Exception as e:  # noqa: BLE001 - compared between plain DDP and paft (batched PowerSGD)
        return {"error": (type(e).__name__, step)}
    if protector is not None:
        protector.close()
    return {"state": _state(model, optimizer), "reports": reports, "local_grads": local_grads,
            "counters": dict(protector.counters) if protector is not None else {},
            "taken": state.taken if isinstance(state, _Feedback) else None}


def _w_hooks(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per hook: plain DDP, monitored (sketch and exact cosines), PAFT-Dyn under an
    aggregation fault, and guarded under a transient local-gradient fault."""
    return {name: {
        "plain": _run(rank, name, {"plain": True}),
        "monitored": _run(rank, name, {}),
        "exact": _run(rank, name, {"monitor": {"cosine": "exact"}}),
        "dyn": _run(rank, name, {"protect": {"mode": "dyn"}, "inject": ["bitflip:steps=3,bits=30,ranks=1"]}),
        "guarded fault": _run(rank, name, {"guard": GUARD,
                                           "inject": ["bitflip:site=local-grad,steps=4,bits=30,ranks=1"]}),
    } for name in names}


def _w_stateful(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """:func:`_w_hooks`, and PowerSGD without warm start: plain, guarded under the fault."""
    guarded = {"guard": GUARD, "inject": ["bitflip:site=local-grad,steps=4,bits=30,ranks=1"]}
    return {**_w_hooks(rank, world_size, names),
            "powersgd-cold": {"plain": _run(rank, "powersgd-cold", {"plain": True}),
                              "guarded fault": _run(rank, "powersgd-cold", guarded)}}


FAMILIES = {"stateless": ["allreduce", "fp16", "bf16", "fp16-wrapper", "bf16-wrapper"],
            "stateful": ["powersgd", "batched-powersgd", "feedback"]}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_torchs_comm_hooks_are_plain_ddp_and_protected(family: str) -> None:
    worker = _w_stateful if family == "stateful" else _w_hooks
    runs = run_workers(worker, 3, FAMILIES[family], timeout=90)  # a rank that raises leaves the others waiting
    for name in FAMILIES[family]:
        out = [r[name] for r in runs]
        if "error" in out[0]["plain"]:
            # torch 2.13's batched_powerSGD_hook raises (AssertionError in _orthogonalize, a
            # 2-D matrix where it wants a batch) at its first compressed step on plain DDP
            # too: paft must raise the same there on every rank, not hang or hide it.
            for o in out:
                for run in o.values():
                    assert run == {"error": ("AssertionError", START_POWERSGD)}, name
            continue
        _check_hook(name, out)
    if family == "stateful":
        # Without warm start too (its Q drawn afresh from its numpy RNG, which the recompute
        # restarts where the step found it): the fault-free run, bit for bit.
        for o in (r["powersgd-cold"] for r in runs):
            guarded = o["guarded fault"]
            assert [r["attempts"] for r in guarded["reports"]] == [1] * 4 + [2] + [1] * 5
            assert guarded["counters"]["transient"] == 1
            assert _equal(guarded["state"], o["plain"]["state"])
        # The user's state is taken once per guarded step, and never without the guard.
        for run, taken in (("guarded fault", STEPS), ("monitored", 0), ("dyn", 0)):
            assert [r["feedback"][run]["taken"] for r in runs] == [taken] * 3, run


def _check_hook(name: str, out: list[dict[str, dict[str, Any]]]) -> None:
    for o in out:
        plain = o["plain"]["state"]
        # (b) bit for bit plain DDP with the hook registered.
        assert _equal(o["monitored"]["state"], plain), name
        assert _equal(o["exact"]["state"], plain), name
        # (c) the flipped result split rank 1 at step 3, PAFT-Dyn repaired it: the hook's
        # state (PowerSGD's error feedback) was taken before the flip, so this is plain DDP.
        r3 = o["dyn"]["reports"][3]
        assert r3["synced"] and r3["replicas/grad_distinct"] == 2 and r3["replicas/grad_minority_ranks"] == [1], name
        assert _equal(o["dyn"]["state"], plain), name
        # (d) the guard caught the flip at step 4 and recomputed.
        # Through PowerSGD (warm start: the flipped attempt's all-reduced Q, non-finite on
        # every rank, was the next start) the recompute restarts from the pre-step state.
        guarded = o["guarded fault"]
        assert [r["attempts"] for r in guarded["reports"]] == [1] * 4 + [2] + [1] * 5, name
        assert guarded["counters"]["transient"] == 1, name
        assert _equal(guarded["state"], plain), name
    for o in out[1:]:
        for run in ("plain", "dyn", "guarded fault"):
            assert _equal(o[run]["state"], out[0][run]["state"]), (name, run)
    # The monitor measures the local gradients before the user's hook compresses them
    # (PowerSGD adds its error feedback into the bucket in place): the norms and the
    # exact cosine are those of the gradients computed apart, every step.
    for step in range(STEPS):
        grads = torch.stack([o["monitored"]["local_grads"][step] for o in out])
        cos, _ = pairwise_cosine(grads)
        exact_min = min(float(cos[i, j]) for i in range(3) for j in range(i + 1, 3))
        for run, tol in (("monitored", 4 / 256**0.5), ("exact", 1e-6)):
            m = out[0][run]["reports"][step]
            assert m["local_grad_norms"] == pytest.approx([float(g.norm()) for g in grads], rel=1e-6), (name, step)
            assert m["consistency/grad_cos_min"] == pytest.approx(exact_min, abs=tol), (name, step, run)
        assert out[0]["monitored"]["reports"][step]["replicas/grad_distinct"] == 1
