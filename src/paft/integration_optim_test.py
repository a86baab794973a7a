"""Integration sweep of :func:`paft.protect` under the optimizer set-ups users train with.

paft handles optimizer state generically (every tensor of ``optimizer.state`` is
fingerprinted, synced and snapshotted, every entry of each param group restored on a
rollback), so nothing in it names SGD or Adam. This module checks that claim end to
end on real DDP (gloo, CPU), one set-up at a time: SGD with Nesterov momentum, weight
decay or ``maximize``; Adam's ``amsgrad`` (its extra ``max_exp_avg_sq``), its
for-loop, ``foreach`` and ``fused`` kernels; RMSprop, Adagrad, Adamax, NAdam, RAdam;
param groups with their own learning rate and weight decay; Muon for the hidden
matrices chained with AdamW for the rest (:class:`paft.OptimizerChain`). For each:

(b) a fault-free monitored run is plain DDP's bit for bit (parameters and optimizer
    state);
(c) an aggregation fault under PAFT-Dyn leaves the replicas bitwise identical;
(d) the guard recomputes a transient local-gradient fault back to the fault-free run.

Then the user's learning-rate scheduler across a guard's rollback and a skipped
batch, and a checkpoint round trip of an AMSGrad run under PAFT-Dyn. The runs of a
family of set-ups share one set of worker processes (a fresh DDP model each), which
keeps the sweep to a few seconds per family.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paft.config import GuardConfig, MonitorConfig, ProtectConfig
from paft.optimizers import OptimizerChain, chained
from paft.protect import protect
from paft.protect_test import batch, toy_closure, toy_model
from paft.testing import ResumedRuns, resumed_runs, run_workers, take_step


def _groups(model: nn.Module) -> list[dict[str, Any]]:
    """GPT-style groups: weight decay on the matrices only, the biases at their own rate."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if p.dim() > 1], "weight_decay": 0.1},
            {"params": [p for n, p in named if p.dim() <= 1], "weight_decay": 0.0, "lr": 3e-3}]


def muon_adamw(model: nn.Module, fused: bool = False, hidden_from: int = 0) -> OptimizerChain:
    """Muon for the hidden matrices (2-D, more than one output), AdamW for the rest;
    ``hidden_from``: leave out the first that many hidden matrices (a group added later)."""
    hidden = [p for p in model.parameters() if p.dim() == 2 and p.shape[0] > 1]
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    return OptimizerChain([torch.optim.Muon(hidden[hidden_from:], lr=2e-2, adjust_lr_fn="match_rms_adamw"),
                           torch.optim.AdamW(rest, lr=1e-2, fused=fused)])


OPTIMIZERS: dict[str, Callable[[nn.Module], torch.optim.Optimizer]] = {
    "sgd-nesterov": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, nesterov=True, dampening=0,
                                              weight_decay=1e-4),
    "sgd-maximize": lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, maximize=True),
    "adam-amsgrad": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True),
    "adam-for-loop": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, foreach=False),
    "adam-foreach": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, foreach=True),
    "adamw-fused": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True),
    "rmsprop-centered": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-3, momentum=0.9, centered=True),
    "adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=0.05),
    "adamax": lambda m: torch.optim.Adamax(m.parameters(), lr=1e-2),
    "nadam": lambda m: torch.optim.NAdam(m.parameters(), lr=1e-2),
    "radam": lambda m: torch.optim.RAdam(m.parameters(), lr=1e-2),
    "adamw-groups": lambda m: torch.optim.AdamW(_groups(m), lr=1e-2),
    "muon-adamw": muon_adamw,
}

# What each set-up keeps per parameter: the sweep compares all of it.
STATE_KEYS = {
    "sgd-nesterov": {"momentum_buffer"}, "sgd-maximize": {"momentum_buffer"},
    "adam-amsgrad": {"exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"},
    **dict.fromkeys(["adam-for-loop", "adam-foreach", "adamw-fused", "radam", "adamw-groups"],
                    {"exp_avg", "exp_avg_sq", "step"}),
    "rmsprop-centered": {"grad_avg", "momentum_buffer", "square_avg", "step"},
    "adagrad": {"step", "sum"}, "adamax": {"exp_avg", "exp_inf", "step"},
    "nadam": {"exp_avg", "exp_avg_sq", "mu_product", "step"},
    "muon-adamw": {"momentum_buffer", "exp_avg", "exp_avg_sq", "step"},
}
STEPS = 8
GUARD = {"enabled": True, "warmup": 2}


def _closure(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
             sign: float) -> Callable[[], torch.Tensor]:
    """``sign`` -1: the loss is a reward to maximize (``SGD(maximize=True)``)."""
    def closure() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = sign * nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss
    return closure


def _state(model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
    """Parameters and every tensor of the optimizer state, named, copied; read from
    torch's own ``state_dict()``s, not through paft's listing of the state, so a
    tensor that listing missed would show here."""
    out = [(f"param/{n}", p.detach().clone()) for n, p in model.module.named_parameters()]
    for which, one in enumerate(chained(optimizer)):
        for index, entry in sorted(one.state_dict()["state"].items()):
            for key, value in sorted(entry.items()):
                # Every entry of these set-ups' state is a tensor, so each is compared.
                assert isinstance(value, torch.Tensor), (key, value)
                out.append((f"optim/{which}.{index}/{key}", value.clone()))
    return out


def _hyper(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]


def _run(rank: int, name: str, opts: dict[str, Any]) -> dict[str, Any]:
    """``STEPS`` steps of the toy model under optimizer set-up ``name``: plain DDP
    (``plain``) or protected (``monitor`` / ``protect`` / ``guard`` / ``inject``)."""
    model = DistributedDataParallel(toy_model())
    optimizer = OPTIMIZERS[name](model)
    sign = -1.0 if name == "sgd-maximize" else 1.0
    # A chain's optimizers go in as the list protect() takes, which chains them itself.
    given = chained(optimizer) if isinstance(optimizer, OptimizerChain) else optimizer
    protector = None if opts.get("plain") else protect(
        model, given, monitor=MonitorConfig(), protect=ProtectConfig(**opts.get("protect", {})),
        guard=GuardConfig(**opts.get("guard", {})), inject=opts.get("inject", []), seed=3)
    reports = []
    for step in range(STEPS):
        closure = _closure(model, optimizer, *batch(rank, step), sign)
        r = take_step(protector, optimizer, closure)
        if r is not None:
            reports.append((r.applied, r.attempts, r.synced))
    if protector is not None:
        protector.close()
    return {"state": _state(model, optimizer), "hyper": _hyper(optimizer), "reports": reports,
            "counters": dict(protector.counters) if protector is not None else {}}


def _w_setup(rank: int, world_size: int, name: str) -> dict[str, dict[str, Any]]:
    """Set-up ``name``: plain DDP, monitored, PAFT-Dyn under an aggregation fault, and
    guarded without and with a transient local-gradient fault."""
    guarded = {"guard": GUARD}
    return {
        "plain": _run(rank, name, {"plain": True}),
        "monitored": _run(rank, name, {}),
        # The scaled aggregate splits every parameter's state on rank 2, not one element's.
        "dyn": _run(rank, name, {"protect": {"mode": "dyn"}, "inject": ["bitflip:steps=3,bits=30,ranks=1",
                                                                        "scale:steps=5,fraction=1,factor=1.5,ranks=2"]}),
        "guarded": _run(rank, name, guarded),
        "guarded fault": _run(rank, name, {**guarded,
                                           "inject": ["bitflip:site=local-grad,steps=4,bits=30,ranks=1"]}),
    }


def _w_setups(rank: int, world_size: int, names: list[str]) -> dict[str, dict[str, dict[str, Any]]]:
    """:func:`_w_setup` of each set-up in ``names``, in one set of workers."""
    return {name: _w_setup(rank, world_size, name) for name in names}


def _equal(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> bool:
    """The same tensors under the same names, bit for bit (NaN included)."""
    return [n for n, _ in a] == [n for n, _ in b] and all(
        x.dtype == y.dtype and torch.equal(x.view(-1).view(torch.uint8) if x.is_floating_point() else x,
                                           y.view(-1).view(torch.uint8) if y.is_floating_point() else y)
        for (_, x), (_, y) in zip(a, b))


SETUPS = {"sgd": ["sgd-nesterov", "sgd-maximize"],
          "adam": ["adam-amsgrad", "adam-for-loop", "adam-foreach", "adamw-fused"],
          "others": ["rmsprop-centered", "adagrad", "adamax", "nadam", "radam"],
          "param groups": ["adamw-groups"], "chain": ["muon-adamw"]}


@pytest.mark.parametrize("family", list(SETUPS))
def test_optimizer_setups_are_plain_ddp_and_protected(family: str) -> None:
    runs = run_workers(_w_setups, 3, SETUPS[family])
    for name in SETUPS[family]:
        _check_setup(name, [r[name] for r in runs])


def _check_setup(name: str, out: list[dict[str, dict[str, Any]]]) -> None:
    for o in out:
        plain = o["plain"]["state"]
        # (b) fault-free and monitored: plain DDP's parameters and optimizer state, bit for bit.
        assert _equal(o["monitored"]["state"], plain)
        assert o["monitored"]["hyper"] == o["plain"]["hyper"]
        # (d) the guard recomputes the flipped local gradient: the fault-free run's state.
        assert _equal(o["guarded"]["state"], plain)
        assert _equal(o["guarded fault"]["state"], plain)
        assert o["guarded fault"]["reports"][4][:2] == (True, 2)
        assert o["guarded fault"]["counters"]["transient"] == 1
        # (c) the flipped aggregate split rank 1 at step 3, the scaled one rank 2 at step 5;
        # PAFT-Dyn repaired each at once.
        assert o["dyn"]["reports"][3][2] is True and o["dyn"]["reports"][5][2] is True
        assert all(torch.isfinite(t).all() for n, t in o["dyn"]["state"] if t.is_floating_point())
    for o in out[1:]:
        assert _equal(o["dyn"]["state"], out[0]["dyn"]["state"])
        assert _equal(o["plain"]["state"], out[0]["plain"]["state"])
    keys = {n.split("/")[2] for n, _ in out[0]["plain"]["state"] if n.startswith("optim/")}
    assert keys == STATE_KEYS[name]


# -- the user's learning-rate scheduler --------------------------------------------------

SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "warmup": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda t: min(1.0, (t + 1) / 4)),
    # Cycles Adam's betas too (cycle_momentum), which live in the param groups beside the lr.
    "one-cycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=1e-2, total_steps=STEPS + 2),
}
# The event that keeps one step's update out, and that step. ``rollback``: the flip's
# recompute arms the pre-step snapshot, and the tiny update-ratio cap rejects the
# clean update after optimizer.step(): rolled back, reproduced, skipped as data.
EVENTS: dict[str, tuple[dict[str, Any], int]] = {
    "rollback": ({"guard": {**GUARD, "update_ratio": 1e-6},
                  "inject": ["bitflip:site=local-grad,steps=5,bits=30,ranks=1"]}, 5),
    "nan-batch": ({"guard": GUARD, "nan_at": 6}, 6),
}


def scheduled_run(rank: int, make: Callable[[nn.Module], tuple[torch.optim.Optimizer, list[Any]]],
                  opts: dict[str, Any], skip: int | None = None) -> dict[str, Any]:
    """``STEPS`` steps of the toy model under ``make``'s optimizer (a chain goes to
    protect() as its list) and schedulers, stepped by the user after every step: guarded
    where ``opts`` has a guard, else plain DDP that leaves out step ``skip``'s update."""
    model = DistributedDataParallel(toy_model())
    optimizer, schedulers = make(model)
    given = chained(optimizer) if isinstance(optimizer, OptimizerChain) else optimizer
    protector = protect(model, given, guard=GuardConfig(**opts["guard"]), inject=opts.get("inject", []),
                        seed=3) if "guard" in opts else None
    hyper, applied = [], []
    for step in range(STEPS):
        x, y = batch(rank, step)
        if opts.get("nan_at") == step and rank == 1:
            x[0, 0] = float("nan")
        closure = _closure(model, optimizer, x, y, 1.0)
        if protector is None:
            closure()
            if step != skip:
                optimizer.step()
        else:
            applied.append(protector.step(closure).applied)
        for scheduler in schedulers:
            scheduler.step()  # after every batch, applied or not, as docs/LIBRARY.md says
        hyper.append(_hyper(optimizer))
    return {"state": _state(model, optimizer), "hyper": hyper, "applied": applied,
            "rollbacks": protector.counters["rollbacks"] if protector is not None else 0}


def _adam_under(schedule: str) -> Callable[[nn.Module], tuple[torch.optim.Optimizer, list[Any]]]:
    def make(model: nn.Module) -> tuple[torch.optim.Optimizer, list[Any]]:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        return optimizer, [SCHEDULERS[schedule](optimizer)]
    return make


def _w_scheduled(rank: int, world_size: int, schedule: str, event: str) -> dict[str, Any]:
    opts, skipped = EVENTS[event]
    make = _adam_under(schedule)
    return {"protected": scheduled_run(rank, make, opts), "plain": scheduled_run(rank, make, {}, skipped)}


@pytest.mark.parametrize("schedule", list(SCHEDULERS))
@pytest.mark.parametrize("event", list(EVENTS))
def test_a_users_scheduler_stays_in_step_across_skipped_and_rolled_back_updates(schedule: str,
                                                                              event: str) -> None:
    # The scheduler steps after every protector.step(); a step whose update the guard
    # kept out (applied=False on every rank) is plain DDP leaving out that update: the
    # same parameters, optimizer state and param groups (lr, betas) on every rank.
    out = run_workers(_w_scheduled, 2, schedule, event)
    skipped = EVENTS[event][1]
    for o in out:
        assert o["protected"]["applied"] == [step != skipped for step in range(STEPS)]
        assert _equal(o["protected"]["state"], o["plain"]["state"])
        assert o["protected"]["hyper"] == o["plain"]["hyper"]
        assert o["protected"]["rollbacks"] == (2 if event == "rollback" else 0)
    assert out[0]["protected"]["hyper"] == out[1]["protected"]["hyper"]
    assert _equal(out[0]["protected"]["state"], out[1]["protected"]["state"])


# -- checkpoints --------------------------------------------------------------------------


# PAFT-Dyn starting at H = 5, down to 1: the fault at step 2 shrinks H to 1, so scheduled
# syncs fall at step 3, before the checkpoint, and at 4 (the second calm one in a row: H
# doubles) and 7 after it. A resume that lost the schedule would sync at 5, not at 4.
# Blocking, so that each sync is reported at its own step: an overlapped one in flight at
# the checkpoint lands in close(), at no step of either leg.
RESUMED_DYN = ProtectConfig(mode="dyn", sync_period=5, h_min=1, overlap=False)
# Aggregation faults before and after the checkpoint, each splitting a replica.
RESUMED_FAULT_STEPS = (2, 6)


def assert_resumed_is_full(out: list[ResumedRuns]) -> None:
    """Each rank's resumed run ends where its uninterrupted run does: parameters and
    optimizer state bit for bit, the syncs, the counters and PAFT-Dyn's schedule."""
    for o in out:
        assert _equal(o.resumed.observed, o.full.observed)
        assert o.first.synced + o.resumed.synced == o.full.synced
        assert all(o.full.synced[s] for s in RESUMED_FAULT_STEPS)  # each split repaired at once
        saved, full, resumed = o.first.checkpoint[2], o.full.checkpoint[2], o.resumed.checkpoint[2]  # protector's
        assert saved["scheduler"]["period"] != RESUMED_DYN.first_h  # the checkpoint is mid-schedule
        assert (full["step"], resumed["step"]) == (STEPS, STEPS)
        assert resumed["scheduler"] == full["scheduler"] and o.resumed.counters == o.full.counters
    assert all(_equal(o.full.observed, out[0].full.observed) for o in out)


def _w_resumed(rank: int, world_size: int) -> ResumedRuns:
    """AMSGrad under PAFT-Dyn (:data:`RESUMED_DYN`), checkpointed at step 4: the
    uninterrupted run, and the run resumed from the checkpoint as docs/LIBRARY.md says."""
    inject = [f"bitflip:steps={RESUMED_FAULT_STEPS[0]},bits=30,ranks=1",
              f"bitflip:steps={RESUMED_FAULT_STEPS[1]},bits=30,ranks=2"]
    return resumed_runs(rank, toy_model, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True),
                        toy_closure, _state, config=RESUMED_DYN, inject=inject, steps=STEPS, checkpoint=4)


def test_an_amsgrad_dyn_run_resumed_from_a_checkpoint_is_the_uninterrupted_run() -> None:
    # Three ranks: the bucket order decides the all-reduce's sums, which prime() sets.
    out = run_workers(_w_resumed, 3)
    assert_resumed_is_full(out)
    assert all(any(n.endswith("/max_exp_avg_sq") for n, _ in o.full.observed) for o in out)
