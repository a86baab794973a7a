"""Integration sweep of an :class:`paft.OptimizerChain` (Muon + AdamW) where it meets the
rest of paft, on real DDP (gloo, CPU).

integration_optim_test checks the chain's plain steps, PAFT-Dyn and the guard's
recompute. This module takes the paths that reach the chained optimizers' state and
groups in other ways: the guard's post-step rollback (of the very first step too, whose
state must leave the optimizer that owns it) under a scheduler on each chained
optimizer or on the chain; a loss scaler; fused AdamW in the chain under PAFT-Sync and
PAFT-Dyn, and under ReplicaSync's overlapped correction, which learns of a fused step
from the chain's step hook alone; the averager; a persistent fault under the guard
beside PAFT-Dyn; a param group added to a chained optimizer after protect(), which
lands among the chain's groups; a checkpoint of the chain resumed with prime(). The
cases of a test share one set of worker processes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paft.config import GuardConfig, ProtectConfig
from paft.integration_optim_test import (
    RESUMED_DYN,
    RESUMED_FAULT_STEPS,
    _closure,
    _equal,
    _state,
    assert_resumed_is_full,
    muon_adamw,
    scheduled_run,
)
from paft.optimizers import OptimizerChain
from paft.protect import protect
from paft.protect_test import batch, toy_closure, toy_model
from paft.sync import ReplicaSync
from paft.testing import ResumedRuns, resumed_runs, run_workers

STEPS = 8


def _scaled_closure(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                    scaler: torch.amp.GradScaler | None) -> Callable[[], torch.Tensor]:
    def closure() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        # 16x: at a scale of 2**127 the first gradients overflow float32.
        loss = 16 * nn.functional.mse_loss(model(x), y)
        (scaler.scale(loss) if scaler is not None else loss).backward()
        return loss
    return closure


# -- the guard's rollback, under a scheduler per chained optimizer -------------------------

# The flip's recompute arms the pre-step snapshot and the tiny update-ratio cap rejects
# the clean update after optimizer.step(): rolled back, reproduced, skipped as data.
ROLLBACK_AT = {"first": 0, "later": 5}


def _chain_under(on: str) -> Callable[[nn.Module], tuple[OptimizerChain, list[Any]]]:
    """The chain under a warm-up schedule on ``each`` of its optimizers or on the ``chain``."""
    def make(model: nn.Module) -> tuple[OptimizerChain, list[Any]]:
        chain = muon_adamw(model)
        return chain, [torch.optim.lr_scheduler.LambdaLR(o, lambda t: min(1.0, (t + 1) / 4))
                       for o in (chain.optimizers if on == "each" else [chain])]
    return make


def _w_rollback(rank: int, world_size: int, at: int) -> dict[str, dict[str, Any]]:
    opts = {"guard": {"enabled": True, "warmup": 0 if at == 0 else 2, "update_ratio": 1e-6},
            "inject": [f"bitflip:site=local-grad,steps={at},bits=30,ranks=1"]}
    return {on: {"protected": scheduled_run(rank, _chain_under(on), opts),
                 "plain": scheduled_run(rank, _chain_under(on), {}, at)} for on in ("each", "chain")}


@pytest.mark.parametrize("when", list(ROLLBACK_AT))
def test_a_rolled_back_chain_step_is_plain_ddp_leaving_it_out(when: str) -> None:
    # The rollback of the first step removes the state it created from the optimizer that
    # owns it (Muon's momentum, AdamW's moments and step): restored as left in place, the
    # later steps ran from a step count of 1 and a momentum that the plain run never had.
    at = ROLLBACK_AT[when]
    out = run_workers(_w_rollback, 2, at)
    for on in ("each", "chain"):
        for o in (r[on] for r in out):
            assert o["protected"]["applied"] == [step != at for step in range(STEPS)]
            assert o["protected"]["rollbacks"] == 2
            assert _equal(o["protected"]["state"], o["plain"]["state"])
            assert o["protected"]["hyper"] == o["plain"]["hyper"]
        assert _equal(out[0][on]["protected"]["state"], out[1][on]["protected"]["state"])


# -- a loss scaler -------------------------------------------------------------------------

# A scale of 2**10 that doubles every 2 clean steps divides exactly: the unscaled run, bit
# for bit. 2**127 overflows the first steps, which back the scale off and are skipped.
SCALES = {"exact": {"init_scale": 2.0**10, "growth_interval": 2},
          "overflow": {"init_scale": 2.0**127, "growth_interval": 3}}


def _scaled(rank: int, scale: str | None, guarded: bool, plain: bool) -> dict[str, Any]:
    model = DistributedDataParallel(toy_model())
    chain = muon_adamw(model)
    scaler = torch.amp.GradScaler("cpu", **SCALES[scale]) if scale is not None else None
    protector = None if plain else protect(model, chain.optimizers, scaler=scaler,
                                           guard=GuardConfig(enabled=guarded, warmup=2))
    scales, applied = [], []
    for step in range(STEPS):
        closure = _scaled_closure(model, chain, *batch(rank, step), scaler)
        if protector is not None:
            applied.append(protector.step(closure).applied)
        elif scaler is not None:
            closure()
            scaler.step(chain)
            scaler.update()
        else:
            closure()
            chain.step()
        scales.append(scaler.get_scale() if scaler is not None else 1.0)
    return {"state": _state(model, chain), "scales": scales, "applied": applied}


def _w_scaled(rank: int, world_size: int) -> dict[str, Any]:
    return {"unscaled": _scaled(rank, None, False, True),
            **{f"{scale} {how}": _scaled(rank, scale, how == "guard", how == "plain")
               for scale in SCALES for how in ("plain", "monitor", "guard")}}


def test_a_loss_scaler_steps_a_chain_as_plain_ddp_does() -> None:
    # One unscale_ and one skip decision for the whole chain: an overflow backs the scale
    # off once (the scales are plain DDP's scaler.step(chain)'s), and no chained
    # optimizer steps on it.
    out = run_workers(_w_scaled, 2)
    for o in out:
        assert _equal(o["exact plain"]["state"], o["unscaled"]["state"])
        scales = o["overflow plain"]["scales"]
        before = [SCALES["overflow"]["init_scale"], *scales[:-1]]
        # The first steps overflowed and backed off by half each, the later ones grew.
        assert scales[0] == 2.0**126 and max(scales[4:]) > min(scales)
        for scale in SCALES:
            for how in ("monitor", "guard"):
                run = o[f"{scale} {how}"]
                assert _equal(run["state"], o[f"{scale} plain"]["state"]), (scale, how)
                assert run["scales"] == o[f"{scale} plain"]["scales"], (scale, how)
                assert run["applied"] == ([s >= b for s, b in zip(scales, before)] if scale == "overflow"
                                          else [True] * STEPS)
    assert _equal(out[0]["overflow guard"]["state"], out[1]["overflow guard"]["state"])


# -- fused AdamW under PAFT-Sync and PAFT-Dyn, the averager, a persistent fault -------------

FAMILY: dict[str, dict[str, Any]] = {
    "plain": {"plain": True},
    "plain fused": {"plain": True, "fused": True},
    "plain skip": {"plain": True, "skip": 5},
    # Fault-free overlapped syncs of agreeing replicas: the corrections must keep each step.
    "sync fused": {"fused": True, "protect": {"mode": "sync", "sync_period": 2}},
    "dyn fused": {"fused": True, "protect": {"mode": "dyn"}},
    "dyn fused fault": {"fused": True, "protect": {"mode": "dyn"},
                        "inject": ["scale:steps=3,fraction=1,factor=1.5,ranks=2"]},
    # Rank 1's weights scaled at rest at step 4; averaged back at step 6.
    "averager": {"protect": {"mode": "averager", "sync_period": 3},
                 "inject": ["scale:site=params,steps=4,ranks=1,factor=1.01"]},
    "guard dyn persistent": {"protect": {"mode": "dyn"},
                             "guard": {"enabled": True, "warmup": 2, "on_persistent": "repair"},
                             "inject": ["bitflip:steps=5,ranks=2,bits=30,count=4,persistent=true"]},
}


def _family(rank: int, opts: dict[str, Any]) -> dict[str, Any]:
    model = DistributedDataParallel(toy_model())
    chain = muon_adamw(model, fused=opts.get("fused", False))
    protector = None if opts.get("plain") else protect(
        model, chain.optimizers, protect=ProtectConfig(**opts.get("protect", {})),
        guard=GuardConfig(**opts.get("guard", {})), inject=opts.get("inject", []), seed=3)
    reports = []
    for step in range(STEPS):
        closure = _closure(model, chain, *batch(rank, step), 1.0)
        if protector is None:
            closure()
            if step != opts.get("skip"):
                chain.step()
        else:
            r = protector.step(closure)
            reports.append((r.applied, r.synced))
    if protector is not None:
        protector.close()
    return {"state": _state(model, chain), "reports": reports,
            "counters": dict(protector.counters) if protector is not None else {}}


def _synced_by_hand(rank: int) -> dict[str, Any]:
    """ReplicaSync used directly: each step between an overlapped start() and finish(),
    rank 1's Muon matrix corrupted at rest before step 3's start(). Fused AdamW moves no
    version counter, so only the chain's step hook tells finish() to correct its tensors
    by the step (else it writes the synced state from start() over them: the step lost)."""
    model = DistributedDataParallel(toy_model())
    chain = muon_adamw(model, fused=True)
    sync = ReplicaSync(model, chain)
    bias = model.module[4].bias  # AdamW's, fused
    kept = []
    for step in range(STEPS):
        if (rank, step) == (1, 3):
            with torch.no_grad():
                model.module[0].weight.mul_(1.5)
        before = bias.detach().clone()
        sync.start()
        _closure(model, chain, *batch(rank, step), 1.0)()
        chain.step()
        sync.finish()
        kept.append(not torch.equal(bias, before))
    return {"kept": kept}


def _w_family(rank: int, world_size: int) -> dict[str, Any]:
    return {"by hand": _synced_by_hand(rank), **{name: _family(rank, opts) for name, opts in FAMILY.items()}}


def test_a_chain_with_fused_adamw_under_sync_dyn_averager_and_a_persistent_fault() -> None:
    out = run_workers(_w_family, 3)
    for o in out:
        assert _equal(o["sync fused"]["state"], o["plain fused"]["state"])
        assert _equal(o["dyn fused"]["state"], o["plain fused"]["state"])
        assert o["by hand"]["kept"] == [True] * STEPS  # the repair at step 3 too
        assert o["dyn fused fault"]["reports"][3][1] is True
        assert [step for step, (_, synced) in enumerate(o["averager"]["reports"]) if synced] == [0, 3, 6]
        # The flipped aggregate reproduced on both reruns: persistent, the batch skipped at
        # the rerun cap, as plain DDP leaving out step 5's update.
        assert o["guard dyn persistent"]["reports"][5] == (False, False)
        assert o["guard dyn persistent"]["counters"]["persistent"] == 1
        assert _equal(o["guard dyn persistent"]["state"], o["plain skip"]["state"])
    # (Not "by hand": rank 1 corrects by its own progress from its corrupted start, which
    # differs from the others' in the last bits; the next sync takes those.)
    for name in FAMILY:
        for o in out[1:]:
            assert _equal(o[name]["state"], out[0][name]["state"]), name


# -- a param group added to a chained optimizer after protect() -----------------------------


def _w_added_group(rank: int, world_size: int, plain: bool) -> dict[str, Any]:
    """Muon without its first hidden matrix, which joins it at step 3 as a group of its own
    (inserted before AdamW's groups in the chain); rank 2's whole aggregate scaled at step
    5, which PAFT-Dyn repairs (the new group's state included)."""
    model = DistributedDataParallel(toy_model())
    chain = muon_adamw(model, hidden_from=1)
    protector = None if plain else protect(model, chain.optimizers, protect=ProtectConfig(mode="dyn"),
                                           inject=["scale:steps=5,fraction=1,factor=1.5,ranks=2"], seed=3)
    synced = []
    for step in range(STEPS):
        if step == 3:
            chain.optimizers[0].add_param_group({"params": [model.module[0].weight], "lr": 1e-2})
        closure = _closure(model, chain, *batch(rank, step), 1.0)
        if protector is None:
            closure()
            chain.step()
        else:
            synced.append(protector.step(closure).synced)
    out: dict[str, Any] = {"state": _state(model, chain), "synced": synced}
    if protector is not None:
        # A parameter that is not the model's, added to the chain's first optimizer (its
        # group lands in the middle of the chain's groups): refused at the next step.
        # Then a parameter AdamW holds already, added to Muon: it would be stepped twice.
        for name, param in (("foreign", nn.Parameter(torch.zeros(4, 4))), ("twice", model.module[4].weight)):
            chain.optimizers[0].add_param_group({"params": [param]})
            try:
                protector.step(_closure(model, chain, *batch(rank, STEPS), 1.0))
                out[name] = "accepted"
            except ValueError as err:
                out[name] = str(err)
            chain.optimizers[0].param_groups.pop()
    return out


def test_a_group_added_to_a_chained_optimizer_is_checked_and_synced() -> None:
    plain = run_workers(_w_added_group, 3, True)
    out = run_workers(_w_added_group, 3, False)
    for o in out:
        assert o["synced"][5] is True
        assert "the new group(s) hold 1 parameter(s) that are not the model's" in o["foreign"], o["foreign"]
        assert o["twice"] == ("optimizer.add_param_group() after protect(): a parameter of shape (1, 64) is held by "
                              "optimizer 0 (Muon) and optimizer 1 (AdamW); each parameter needs exactly one optimizer")
        assert any(n.startswith("optim/0.") and n.endswith("/momentum_buffer") for n, _ in o["state"])
    for o in out[1:]:
        assert _equal(o["state"], out[0]["state"])
    assert len(plain[0]["state"]) == len(out[0]["state"])


# -- a checkpoint of the chain, resumed with prime() ----------------------------------------


def _w_resumed(rank: int, world_size: int) -> ResumedRuns:
    """The chain under PAFT-Dyn (integration_optim_test's :data:`RESUMED_DYN`),
    checkpointed at step 4: the uninterrupted run, and the run resumed from the
    checkpoint (the chain's own state_dict())."""
    inject = [f"bitflip:steps={RESUMED_FAULT_STEPS[0]},bits=30,ranks=1",
              f"scale:steps={RESUMED_FAULT_STEPS[1]},fraction=1,factor=1.5,ranks=2"]
    return resumed_runs(rank, toy_model, lambda m: muon_adamw(m).optimizers, toy_closure, _state,
                        config=RESUMED_DYN, inject=inject, steps=STEPS, checkpoint=4)


def test_a_chain_resumed_from_a_checkpoint_is_the_uninterrupted_run() -> None:
    assert_resumed_is_full(run_workers(_w_resumed, 3))
