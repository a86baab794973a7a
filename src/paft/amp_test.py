"""A loss scaler (``torch.amp.GradScaler``) under paft: multi-process tests (gloo, CPU)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paft.amp import OptimizerStep
from paft.config import GuardConfig, MonitorConfig
from paft.protect import protect
from paft.records import RunRecorder, read_jsonl
from paft.testing import run_workers

# 2**127 scales the first losses past float32's range: the first steps overflow and are
# skipped while the scale backs off; a growth interval of 3 doubles it again later.
SCALER = {"init_scale": 2.0**127, "growth_interval": 3}


def _mlp() -> nn.Module:
    """The tests' model, with the same initial weights on every rank."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def _train(rank: int, world_size: int, mode: str, inject: list[str], run_dir: str = "",
           nan_at: int = -1, grad_clip: float = 0.0) -> dict[str, Any]:
    """``nan_at``: a step whose batch holds a NaN on rank 1 (bad data, a non-finite loss)."""
    model = _mlp()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    protector = None
    if mode != "plain":
        protector = protect(ddp, optimizer, scaler=scaler, guard=GuardConfig(enabled=mode == "guard", warmup=2),
                            monitor=MonitorConfig(enabled=mode != "unmonitored"), inject=inject,
                            recorder=RunRecorder(run_dir, rank, quiet=True) if run_dir else None, grad_clip=grad_clip)
    scales, applied, grads_left = [], [], []
    for step in range(16):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(10 * step + rank))
        if (rank, step) == (1, nan_at):
            x[0, 0] = math.nan

        def closure(x: torch.Tensor = x) -> torch.Tensor:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True) * 3)
            scaler.scale(loss).backward()
            return loss

        if protector is None:
            closure()
            if grad_clip:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            scaler.step(optimizer)
            scaler.update()
        else:
            applied.append(protector.step(closure).applied)
            if not applied[-1]:
                grads_left.append(any(p.grad is not None for p in model.parameters()))
        scales.append(scaler.get_scale())
    return {"params": [p.detach().clone() for p in model.parameters()], "scales": scales, "applied": applied,
            "counters": protector.counters if protector is not None else {}, "grads_left": grads_left}


def _same_params(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


@pytest.mark.parametrize("mode", ["monitor", "guard", "unmonitored"])
def test_a_loss_scaler_trains_as_with_plain_ddp(mode: str) -> None:
    # The scaler's overflows (the first steps) are skipped and back the scale off, its
    # clean steps grow it, exactly as without paft; the guard sees no fault in them.
    plain = run_workers(_train, 2, "plain", [])
    out = run_workers(_train, 2, mode, [])
    assert out[0]["scales"] == plain[0]["scales"]
    assert out[0]["scales"][0] < SCALER["init_scale"] and max(out[0]["scales"][6:]) > min(out[0]["scales"])
    if mode != "unmonitored":  # without the control collective, no rank knows the others skipped
        skipped = out[0]["applied"].count(False)
        assert 1 <= skipped < 8 and out[0]["applied"] == out[1]["applied"]
    assert out[0]["counters"]["detections"] == 0
    for a, b in zip(plain, out):
        assert _same_params(a, b)


def test_the_guard_recomputes_a_scaled_step_and_tells_a_fault_from_an_overflow() -> None:
    # A bit-30 flip in rank 1's aggregated (scaled) gradient at a clean step: the ranks'
    # gradients differ, so it is no overflow; the recompute unscales afresh (a second
    # unscale_() would raise) and the run ends as the fault-free one, scale included.
    clean = run_workers(_train, 2, "guard", [])
    hit = run_workers(_train, 2, "guard", ["bitflip:steps=9,bits=30,ranks=1"])
    assert hit[0]["counters"]["detections"] >= 1 and hit[0]["counters"]["recomputes"] >= 1
    assert hit[0]["scales"] == clean[0]["scales"] and hit[0]["applied"] == clean[0]["applied"]
    for a, b in zip(clean, hit):
        assert _same_params(a, b)


def test_an_update_rolled_back_by_the_guard_rolls_the_scaler_back_too() -> None:
    # NaN in rank 1's Adam state at rest at step 7 (a clean step, in the update ratio's
    # warm-up: armed): the update is rolled back and recomputed (after a repair). The
    # rolled-back step() had counted a clean step towards the scale's growth; the
    # rollback takes it back with the weights, so the scale grows when the fault-free
    # run's does, not a step early.
    clean = run_workers(_train, 2, "guard", [])
    hit = run_workers(_train, 2, "guard", ["nan:site=optimizer-state,steps=7,ranks=1"])
    assert hit[0]["counters"]["rollbacks"] == 1 and clean[0]["applied"][7]
    assert hit[0]["scales"] == hit[1]["scales"] == clean[0]["scales"] and hit[0]["applied"] == clean[0]["applied"]
    for a, b in zip(clean, hit):
        assert _same_params(a, b)


def test_a_non_finite_loss_under_the_guard_is_a_bad_batch_that_keeps_the_scale() -> None:
    # A NaN in rank 1's batch: every rank's aggregated gradient is NaN, as in an overflow,
    # but a smaller scale would not fix a forward pass gone non-finite. The guard
    # recomputes it and skips it as data, on every rank, without backing the scale off.
    clean = run_workers(_train, 2, "guard", [])
    out = run_workers(_train, 2, "guard", [], "", 10)
    assert out[0]["applied"][10] is out[1]["applied"][10] is False and clean[0]["applied"][10]
    assert out[0]["scales"][:11] == clean[0]["scales"][:10] + [clean[0]["scales"][9]]
    assert out[0]["scales"] == out[1]["scales"]
    c = out[0]["counters"]
    assert (c["data"], c["recomputes"], c["skipped_batches"]) == (1, 1, 1)


def test_a_non_finite_loss_without_the_guard_is_skipped_and_alerted_not_taken_for_an_overflow(tmp_path: Path) -> None:
    # The monitor alone: the scaler's skip of rank 1's NaN batch is no overflow (a NaN
    # loss), so the monitor's alerts stay on and name rank 1; taken for an overflow, the
    # skip was as silent as a routine one.
    out = run_workers(_train, 2, "monitor", [], str(tmp_path), 10)
    assert out[0]["applied"][10] is out[1]["applied"][10] is False
    alerts = [(e["step"], e["detector"], e["ranks"]) for e in read_jsonl(tmp_path / "events.jsonl")
              if e["event"] == "alert"]
    assert alerts == [(10, "nonfinite_local", [1])]  # the overflows before it alert nothing


def _random_value_in_the_scaled_gradient(rank: int, world_size: int, run_dir: str) -> list[float]:
    ddp = DistributedDataParallel(nn.Linear(4, 1, bias=False))
    with torch.no_grad():
        ddp.module.weight.zero_()
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    protector = protect(ddp, optimizer, scaler=scaler, inject=["random:steps=0,ranks=0,value=4096"],
                        recorder=RunRecorder(run_dir, rank, quiet=True))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = ddp(x).square().mean()
        scaler.scale(loss).backward()
        return loss

    assert protector.step(closure).applied
    return ddp.module.weight.detach().flatten().tolist()


def test_a_gradient_fault_strikes_the_scaled_gradient_and_is_recorded_scaled(tmp_path: Path) -> None:
    # "random:value=X puts X there, so the optimizer sees X / scale, and faults.jsonl
    # records the scaled values": from zero weights and lr 1, a weight is minus what the
    # optimizer saw; rank 1, not hit, took the fault-free aggregated gradient.
    out = run_workers(_random_value_in_the_scaled_gradient, 2, str(tmp_path))
    [fault] = read_jsonl(tmp_path / "faults.jsonl")
    [i], [before], [after] = fault["indices"], fault["before"], fault["after"]
    assert fault["rank"] == 0 and abs(after) <= 4096  # drawn in [-4096, 4096]
    assert out[0][i] == -after / 1024 and out[1][i] == -before / 1024  # unscaled after it
    assert [w for j, w in enumerate(out[0]) if j != i] == [w for j, w in enumerate(out[1]) if j != i]


def test_a_recompute_that_overflows_closes_the_detections_record(tmp_path: Path) -> None:
    # Step 1 overflows (the scale is still 2**126) and an inf lands in rank 1's
    # aggregated gradient, where the overflow had left a finite value: the ranks'
    # gradients differ, so the guard detects and recomputes; the recompute is a plain
    # overflow, skipped as the scaler skips it. The detection's record ended at
    # "recompute", with no verdict after it.
    clean = run_workers(_train, 2, "guard", [])
    out = run_workers(_train, 2, "guard", ["inf:steps=1,ranks=1"], str(tmp_path))
    guard = [(e["step"], e["attempt"], e["action"], e["detector"])
             for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "guard"]
    assert [g[:3] for g in guard] == [(1, 0, "recompute"), (1, 1, "skip")]
    assert guard[1][3] == "loss_scale_overflow" and out[0]["counters"]["skipped_batches"] == 0
    assert out[0]["applied"] == clean[0]["applied"] and out[0]["scales"] == clean[0]["scales"]
    for a, b in zip(clean, out):
        assert _same_params(a, b)


@pytest.mark.parametrize("mode", ["monitor", "unmonitored"])
def test_one_ranks_non_finite_gradient_skips_the_step_on_every_rank(mode: str, tmp_path: Path) -> None:
    # inf in rank 1's aggregated gradient at a clean step: each scaler alone would skip
    # only there, and from then on the ranks unscaled by different scales (gradients
    # 2x apart at every step). The ranks agree: every one skips and backs off.
    out = run_workers(_train, 2, mode, ["inf:steps=9,ranks=1"], str(tmp_path))
    if mode == "monitor":  # no overflow (the gradients differ) and no guard to name it: the monitor does
        splits = [e["step"] for e in read_jsonl(tmp_path / "events.jsonl") if e.get("detector") == "replicas_split"]
        assert splits == [9]
    clean = run_workers(_train, 2, mode, [])
    assert out[0]["scales"] == out[1]["scales"] and out[0]["scales"][9] == clean[0]["scales"][8] / 2
    assert out[0]["applied"][9] is out[1]["applied"][9] is False and clean[0]["applied"][9]
    # a skipped step leaves no gradient behind, non-finite or not, monitored or not
    assert out[0]["grads_left"] == out[1]["grads_left"] == [False] * out[0]["applied"].count(False)
    assert _same_params(out[0], out[1])


@pytest.mark.parametrize("mode", ["monitor", "guard", "unmonitored"])
def test_grad_clip_under_a_scaler_clips_the_unscaled_gradients_before_the_step(mode: str) -> None:
    plain = run_workers(_train, 2, "plain", [], "", -1, 0.5)
    assert not _same_params(plain[0], run_workers(_train, 2, "plain", [])[0])  # 0.5 clips
    out = run_workers(_train, 2, mode, [], "", -1, 0.5)
    assert out[0]["scales"] == plain[0]["scales"]
    for a, b in zip(plain, out):
        assert _same_params(a, b)


def _metrics(rank: int, world_size: int, init_scale: float | None) -> list[str]:
    ddp = DistributedDataParallel(_mlp())
    optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=2) if init_scale else None
    protector = protect(ddp, optimizer, scaler=scaler)
    out = []
    for step in range(6):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(10 * step + rank))

        def closure(x: torch.Tensor = x) -> torch.Tensor:
            optimizer.zero_grad()
            loss = nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True) * 3)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            return loss

        out.append(repr(protector.step(closure).metrics))
    return out


@pytest.mark.parametrize("init_scale", [2.0**10, 2.0**-8])
def test_the_metrics_under_a_loss_scaler_are_those_without_one(init_scale: float) -> None:
    # The hook captures the scaled gradients: their local norms are divided by the scale
    # (a power of two, growing every 2 steps here: exact; below 1 too), so the metrics
    # match bit for bit.
    plain = run_workers(_metrics, 2, None)
    assert "local_grad_norms" in plain[0][0]
    assert run_workers(_metrics, 2, init_scale) == plain


@pytest.mark.parametrize("fault", ["nan:site=params,steps=9,ranks=1", "scale:site=params,steps=5,ranks=1,factor=100"])
def test_a_corrupted_replica_is_a_fault_not_an_overflow(fault: str) -> None:
    # NaN in rank 1's weights spreads through the all-reduce like an overflow, but its
    # loss is NaN; weights x100 at a step that overflows anyway keep the loss finite, but
    # not the state fingerprints (taken then, though step 5 is no state-check step). The
    # guard repairs the replica (then the run is the fault-free one) instead of the
    # scaler skipping every later step with a halving scale, or until the next check.
    clean = run_workers(_train, 2, "guard", [])
    out = run_workers(_train, 2, "guard", [fault])
    assert out[0]["counters"]["detections"] >= 1 and out[0]["counters"]["state"] == 1
    assert out[0]["applied"] == clean[0]["applied"] and out[0]["scales"] == clean[0]["scales"]
    for a, b in zip(clean, out):
        assert _same_params(a, b)


@pytest.mark.parametrize(("init", "backoff"), [(12345.678, 0.45), (3.0, 0.3), (0.0077, 0.3), (2.0**20, 0.5)])
def test_a_skip_backs_the_scale_off_exactly_as_the_scaler_does(init: float, backoff: float) -> None:
    # The factor was rounded to float32 before the multiply; torch multiplies in double
    # and rounds once, so a backoff of 0.3 parted the scales by an ulp at the first skip.
    scales = []
    for own in (True, False):
        p = nn.Parameter(torch.ones(1))
        optimizer = torch.optim.SGD([p], lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=init, backoff_factor=backoff)
        scaler.scale(p.sum()).backward()
        if own:
            OptimizerStep(optimizer, scaler).skip()
        else:  # the scaler's own path: an inf found, the step skipped, the scale backed off
            p.grad.fill_(math.inf)
            scaler.step(optimizer)
            scaler.update()
        scales.append(scaler.get_scale())
        assert scaler.state_dict()["_growth_tracker"] == 0 and torch.equal(p.detach(), torch.ones(1))
    assert scales[0] == scales[1] != init


def test_a_step_after_an_overflow_is_the_scalers_skip() -> None:
    # step() is the scaler's: over gradients unscale() found non-finite it leaves the
    # parameters as they were and backs the scale off (a mutant that stepped the
    # optimizer itself survived: the protector calls skip() on an overflow it sees).
    p = nn.Parameter(torch.ones(1))
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, backoff_factor=0.5)
    stepper = OptimizerStep(torch.optim.SGD([p], lr=0.1), scaler)
    (scaler.scale(p.sum()) * math.inf).backward()
    assert stepper.unscale() == 8.0
    stepper.step()
    assert p.tolist() == [1.0] and scaler.get_scale() == 4.0


def _one_step(rank: int, world_size: int, scaled: bool, grad_clip: float) -> dict[str, Any]:
    model = _mlp()
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=scaled)
    protector = protect(ddp, optimizer, scaler=scaler, grad_clip=grad_clip)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(rank))

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), x.sum(1, keepdim=True))
        scaler.scale(loss).backward()
        return loss

    report = protector.step(closure)
    return {"params": [p.detach().clone() for p in model.parameters()], "grad_norm": report.grad_norm,
            "local_grad_norms": report.metrics["local_grad_norms"], "applied": report.applied}


@pytest.mark.parametrize("grad_clip", [0.0, 0.01])
def test_a_power_of_two_scale_leaves_the_norms_clipping_and_step_bit_for_bit_unscaled(grad_clip: float) -> None:
    # The hook captures the scaled local gradients, the norms and clipping see the
    # unscaled aggregated ones: at a scale of 2**10 every division is exact, so the
    # step is the unscaled one, bit for bit. Returning 1.0 as the scale (the local
    # norms 1024x), dividing the squared norm by the scale once, or no unscale_
    # before clipping (clipped by the scaled norm) kept the other amp tests passing.
    plain = run_workers(_one_step, 2, False, grad_clip)
    scaled = run_workers(_one_step, 2, True, grad_clip)
    for a, b in zip(plain, scaled):
        assert a["applied"] and b["applied"] and a["local_grad_norms"] == b["local_grad_norms"]
        assert a["grad_norm"] == b["grad_norm"] and _same_params(a, b)
    if grad_clip:  # the clip binds
        assert plain[0]["grad_norm"] > grad_clip


def test_restore_brings_back_the_saved_scale_and_a_fresh_iteration() -> None:
    # restore() over an attempt already unscaled: the saved scale and growth count, and
    # the next attempt unscales afresh (restore without its discard left unscale_
    # raising "unscale_() has already been called"; the protector restores only after
    # a step, whose update had reset the iteration, so no multi-rank test saw it).
    p = nn.Parameter(torch.ones(1))
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=1)
    stepper = OptimizerStep(torch.optim.SGD([p], lr=0.1), scaler)
    saved = stepper.state()
    scaler.scale(p.sum()).backward()
    assert stepper.unscale() == 8.0
    stepper.step()  # clean: the scale grows
    p.grad = None
    scaler.scale(p.sum()).backward()
    assert stepper.unscale() == 16.0
    stepper.restore(saved)
    assert stepper.state() == saved
    p.grad = None
    scaler.scale(p.sum()).backward()
    assert stepper.unscale() == 8.0 and p.grad.tolist() == [1.0]


def _partial_optimizer(rank: int, world_size: int, partial_on: list[int]) -> str:
    model = DistributedDataParallel(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1)))
    held = model.module[0] if rank in partial_on else model
    optimizer = torch.optim.SGD(held.parameters(), lr=0.1)
    try:
        protect(model, optimizer, scaler=torch.amp.GradScaler("cpu"))
    except ValueError as err:
        return str(err)
    return ""


def test_a_scaler_needs_the_optimizer_to_hold_every_trained_parameter() -> None:
    # unscale_ unscales the optimizer's parameters only: the rest stayed scaled in the
    # norms, the guard's statistics and clipping.
    out = run_workers(_partial_optimizer, 2, [0, 1])
    assert out[0] == out[1] and "the optimizer must hold every parameter that requires a gradient" in out[0]
    # On one rank only, every rank raises (after the agreement collective; checked
    # before it, rank 1 raised alone and left rank 0 waiting in that collective).
    out = run_workers(_partial_optimizer, 2, [1])
    assert out[0] == out[1] and "ranks disagree on the optimizer's parameter order" in out[0]


def _scaled_stepper(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> Callable[[], bool]:
    """One protected step under a loss scaler, on one batch, per call: whether it applied."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    protector = protect(ddp, optimizer, scaler=scaler)
    x, y = torch.randn(4, 8), torch.randn(4, 1)

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        scaler.scale(loss).backward()
        return loss

    return lambda: protector.step(closure).applied


@pytest.mark.usefixtures("one_rank_group")
def test_a_scalers_refusal_of_parameters_trained_later_advises_what_works() -> None:
    # It advised requires_grad_(False), too late once DDP is built (DDP waits for their
    # gradients and fails the next step), and useless for unfreezing them later (DDP
    # never all-reduces a parameter frozen when it was built). What it says now works.
    model = _mlp()
    ddp = DistributedDataParallel(model)
    with pytest.raises(ValueError, match=r"from protect\(\) on; one to train later \(progressive unfreezing\) goes in "
                       r"now, in a param group with lr=0 whose lr you raise then .* one never trained: "
                       r"requires_grad_\(False\) before DistributedDataParallel wraps the model$"):
        protect(ddp, torch.optim.Adam(model[2].parameters(), lr=1e-2), scaler=torch.amp.GradScaler("cpu"))
    # The body in the optimizer from protect() on, at lr=0 until it is unfrozen.
    model = _mlp()
    ddp = DistributedDataParallel(model)
    body = list(model[0].parameters())
    optimizer = torch.optim.Adam([{"params": model[2].parameters()}, {"params": body, "lr": 0.0}], lr=1e-2)
    frozen = [p.detach().clone() for p in body]
    step = _scaled_stepper(ddp, optimizer)
    assert step() and step() and all(torch.equal(a, p) for a, p in zip(frozen, body))
    optimizer.param_groups[1]["lr"] = 1e-2  # unfrozen
    assert step() and not any(torch.equal(a, p) for a, p in zip(frozen, body))
    # A body never trained, frozen before DDP wraps the model: accepted, and the head trains.
    model = _mlp()
    model[0].requires_grad_(False)
    ddp = DistributedDataParallel(model)
    step = _scaled_stepper(ddp, torch.optim.Adam(model[2].parameters(), lr=1e-2))
    assert step() and step()
    del step, ddp


def test_a_scaler_that_is_not_one_is_refused() -> None:
    model = nn.Linear(2, 1)
    with pytest.raises(TypeError, match="scaler= must be a torch.amp.GradScaler, got dict"):
        OptimizerStep(torch.optim.SGD(model.parameters(), lr=0.1), {"init_scale": 1.0})  # type: ignore[arg-type]
    disabled = OptimizerStep(torch.optim.SGD(model.parameters(), lr=0.1), torch.amp.GradScaler("cpu", enabled=False))
    assert disabled.scaler is None and disabled.unscale() == 1.0 and disabled.state() is None
    with pytest.raises(RuntimeError, match=r"skip\(\): no loss scaler \(without one, skipping is the guard's\)"):
        disabled.skip()
