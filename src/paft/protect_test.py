"""Multi-rank tests of the protector: injection, monitoring, guard and sync, on real DDP.

A small MLP on synthetic regression data keeps each test to a few seconds; fault
injection is keyed by (rank, step) through the fault specs.
"""

from __future__ import annotations

import copy
import functools
import gc
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

from paft.config import GuardConfig, MonitorConfig, ProtectConfig
from paft.consistency import pairwise_cosine
from paft.protect import PersistentFaultError, protect
from paft.records import RunRecorder, from_jsonable, read_jsonl
from paft.state import state_fingerprint
from paft.testing import one_rank_group, run_workers


def toy_model(batchnorm: bool = False, init_std: float | None = None) -> nn.Module:
    """``init_std``: weights drawn at that scale (0: zeros) and zero biases, not torch's default."""
    torch.manual_seed(0)
    norm = [nn.BatchNorm1d(64)] if batchnorm else []
    model = nn.Sequential(nn.Linear(16, 64), *norm, nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))
    if init_std is not None:
        for layer in model:
            if isinstance(layer, nn.Linear):
                nn.init.normal_(layer.weight, std=init_std) if init_std else nn.init.zeros_(layer.weight)
                nn.init.zeros_(layer.bias)
    return model


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 16, generator=g)
    return x, x[:, :1] * 0.5 - x[:, 1:2] + 0.1 * torch.randn(8, 1, generator=g)


class SaidRecorder(RunRecorder):
    """A quiet recorder that keeps rank 0's console lines (``say``) instead of printing them."""

    def __init__(self, run_dir: str, rank: int) -> None:
        super().__init__(run_dir, rank, quiet=True)
        self.said: list[str] = []

    def say(self, message: str) -> None:
        if self.rank == 0:
            self.said.append(message)


def toy_closure(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, step: int,
                dropout: float = 0.0) -> Callable[[], torch.Tensor]:
    """The closure of ``step`` on ``rank``'s toy batch: zero the gradients, forward, backward;
    ``dropout`` on the output draws from the RNG, which a recompute must restore."""
    x, y = batch(rank, step)

    def closure() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(nn.functional.dropout(model(x), dropout), y)
        loss.backward()
        return loss

    return closure


USER_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "divide": default_hooks.allreduce_hook}


def train_toy(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Train the toy model for ``steps``; ``opts`` picks the optimizer, faults and defenses."""
    steps = opts.get("steps", 10)
    dtype = opts.get("dtype", torch.float32)
    model = DistributedDataParallel(toy_model(opts.get("batchnorm", False), opts.get("init_std")).to(dtype),
                                    gradient_as_bucket_view=opts.get("bucket_view", False),
                                    bucket_cap_mb=opts.get("bucket_cap_mb", 25))
    opt_name = opts.get("optimizer", "adam")
    if opt_name == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    elif opt_name == "momentum":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    nan_at = opts.get("nan_input_at")  # (rank, step): bad data on one rank
    scaled_at = opts.get("scaled_targets_at")  # (rank, step): targets 1000x, finite bad data
    user_hook = USER_HOOKS.get(opts.get("comm_hook", ""))  # a comm hook of the user's own
    reports, divergence = [], []
    recorder = SaidRecorder(opts["run_dir"], rank) if "run_dir" in opts else None
    if opts.get("plain"):
        protector = None
        if user_hook is not None:
            model.register_comm_hook(None, user_hook)
    else:
        protector = protect(
            model, optimizer,
            monitor=MonitorConfig(**opts.get("monitor", {})),
            protect=ProtectConfig(**opts.get("protect", {})),
            guard=GuardConfig(**opts.get("guard", {})),
            inject=opts.get("inject", []), seed=3, comm_hook=user_hook, grad_clip=opts.get("grad_clip", 0.0),
            recorder=recorder,
        )
    for step in range(steps):
        x, y = (t.to(dtype) for t in batch(rank, step))
        if nan_at == [rank, step]:
            x[0, 0] = float("nan")
        if scaled_at == [rank, step]:
            y = y * 1000

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            if opts.get("accumulate"):  # two micro-batches, DDP all-reducing once, after the last
                with model.no_sync():
                    (nn.functional.mse_loss(model(x[:5]), y[:5]) * 5 / 8).backward()
                loss = nn.functional.mse_loss(model(x[5:]), y[5:]) * 3 / 8
                loss.backward()
                return loss
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            return loss

        if protector is None:
            closure()
            if opts.get("grad_clip"):
                nn.utils.clip_grad_norm_(model.parameters(), opts["grad_clip"])
            optimizer.step()
        else:
            if step == 0 and opts.get("prime"):
                protector.prime(closure)
            r = protector.step(closure)
            reports.append({"step": r.step, "applied": r.applied, "attempts": r.attempts,
                            "metrics": r.metrics, "synced": r.synced})
        divergence.append(_rel_divergence(model))
        if protector is not None and step == opts.get("close_after"):  # as a checkpoint does
            protector.close()
    if protector is not None:
        protector.close()
    return {
        "params": [p.detach().clone() for p in model.module.parameters()],
        "buffers": [b.detach().clone() for b in model.module.buffers()],
        "fingerprint": state_fingerprint(model, optimizer, buffers=False),
        "reports": reports,
        "divergence": divergence,
        "counters": protector.counters if protector is not None else {},
        "said": recorder.said if recorder is not None else [],
    }


def _rel_divergence(model: DistributedDataParallel) -> float:
    """max over ranks of ||w_r - mean(w)|| / ||mean(w)|| (a collective)."""
    flat = torch.cat([p.detach().flatten() for p in model.parameters()]).double()
    mean = flat.clone()
    dist.all_reduce(mean)
    mean /= dist.get_world_size()
    rel = torch.tensor([float((flat - mean).norm() / mean.norm())], dtype=torch.float64)
    dist.all_reduce(rel, op=dist.ReduceOp.MAX)
    return float(rel)


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


# -- fault injection and the monitor ---------------------------------------------------


@pytest.mark.parametrize("bucket_view", [False, True])
def test_protected_fault_free_path_is_bitwise_plain_ddp(bucket_view: bool) -> None:
    # world size 3: DDP's scaling by 1/3 must be reproduced bit for bit
    plain = run_workers(train_toy, 3, {"plain": True, "bucket_view": bucket_view})
    monitored = run_workers(train_toy, 3, {"bucket_view": bucket_view})
    rate_zero = run_workers(train_toy, 3, {"inject": ["bitflip:rate=0,bits=exponent"],
                                           "monitor": {"enabled": False}, "bucket_view": bucket_view})
    for p, m, z in zip(plain, monitored, rate_zero):
        assert same(p, m) and same(p, z)
    assert same(plain[0], plain[2])


def test_grad_clip_clips_as_clip_grad_norm_does_before_the_update() -> None:
    # 0.2: below the toy's gradient norms, so every step clips
    plain = run_workers(train_toy, 2, {"plain": True, "grad_clip": 0.2, "steps": 4})
    assert not same(plain[0], run_workers(train_toy, 2, {"plain": True, "steps": 4})[0])
    for opts in ({}, {"guard": {"enabled": True}}, {"monitor": {"enabled": False}}):
        out = run_workers(train_toy, 2, {**opts, "grad_clip": 0.2, "steps": 4})
        assert same(plain[0], out[0]) and same(plain[1], out[1]), opts


@pytest.mark.parametrize(("cosine", "dtype"), [("exact", torch.float32), ("sketch", torch.float32),
                                             ("exact", torch.float64)])
def test_step_zero_metrics_equal_the_local_gradients_computed_apart(cosine: str, dtype: torch.dtype) -> None:
    """Loss and gradient-norm dispersion and the gradient cosines of step 0 against the
    same local gradients computed here without DDP (exact: to rounding; sketch: to
    its documented error, k = 256). A float64 model's exact copy must be a copy: its
    bucket is all-reduced in place (without copy=True, every cosine read 1)."""
    out = run_workers(train_toy, 3, {"steps": 1, "monitor": {"cosine": cosine}, "dtype": dtype})
    losses, grads = [], []
    for rank in range(3):
        model = toy_model().to(dtype)
        x, y = (t.to(dtype) for t in batch(rank, 0))
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double())
    cos, to_mean = pairwise_cosine(torch.stack(grads))
    pairs = [cos[0, 1], cos[0, 2], cos[1, 2]]
    m = out[0]["reports"][0]["metrics"]
    assert m == out[2]["reports"][0]["metrics"]  # every rank knows the same
    assert m["local_losses"] == losses
    assert m["local_grad_norms"] == pytest.approx([float(g.norm()) for g in grads], rel=1e-6)
    tol = 1e-9 if cosine == "exact" else 4 / 256**0.5
    assert m["consistency/grad_cos_min"] == pytest.approx(min(pairs), abs=tol)
    assert m["consistency/grad_cos_mean"] == pytest.approx(sum(pairs) / 3, abs=tol)
    assert m["consistency/cos_to_mean"] == pytest.approx(list(to_mean), abs=tol)


def test_aggregation_fault_splits_only_the_faulty_rank_and_is_reported_that_step() -> None:
    out = run_workers(train_toy, 3, {"inject": ["bitflip:steps=4,ranks=1,bits=exponent"],
                                     "monitor": {"fingerprint_every": 1}})
    assert not same(out[0], out[1])
    assert same(out[0], out[2])
    m = out[0]["reports"][4]["metrics"]
    assert m["replicas/grad_distinct"] == 2 and m["replicas/grad_minority_ranks"] == [1]
    assert out[0]["reports"][3]["metrics"]["replicas/grad_distinct"] == 1
    # the state split shows from the next step on, naming the same rank
    assert out[0]["reports"][5]["metrics"]["replicas/state_minority_ranks"] == [1]
    assert out[1]["counters"]["faults_injected"] == 1 and out[0]["counters"]["faults_injected"] == 0


@pytest.mark.parametrize("hook", ["fp16", "divide"])
def test_a_users_comm_hook_is_wrapped_not_replaced(hook: str) -> None:
    """paft around PyTorch's own hooks (fp16 compression; the all-reduce that divides by
    the world size): fault-free, bit for bit the hook alone; an aggregation fault lands
    in the hook's result and is reported that step. (integration_hooks_test.py sweeps
    the rest of torch's hooks.)"""
    alone = run_workers(train_toy, 3, {"plain": True, "comm_hook": hook})
    wrapped = run_workers(train_toy, 3, {"comm_hook": hook})
    for a, w in zip(alone, wrapped):
        assert same(a, w)
    if hook == "fp16":  # the hook does change training: it was not silently dropped
        assert not same(alone[0], run_workers(train_toy, 3, {"plain": True})[0])
    m = wrapped[0]["reports"][0]["metrics"]
    assert m["replicas/grad_distinct"] == 1 and -1 <= m["consistency/grad_cos_min"] <= 1
    faulty = run_workers(train_toy, 3, {"comm_hook": hook, "inject": ["bitflip:steps=4,ranks=1,bits=exponent"]})
    assert faulty[0]["reports"][4]["metrics"]["replicas/grad_minority_ranks"] == [1]
    assert same(faulty[0], faulty[2]) and not same(faulty[0], faulty[1])
    # A stateless hook: the guard's recompute of a transient flip runs the hook again and
    # is the fault-free step bit for bit (docs/LIBRARY.md, comm hooks of your own).
    guarded = run_workers(train_toy, 3, {"comm_hook": hook, "guard": GUARD,
                                         "inject": ["bitflip:steps=4,ranks=1,bits=30,count=4"]})
    assert [r["attempts"] for r in guarded[0]["reports"]] == [1] * 4 + [2] + [1] * 5
    for a, g in zip(alone, guarded):
        assert same(a, g)


def test_local_grad_fault_changes_the_model_on_every_rank_alike() -> None:
    clean = run_workers(train_toy, 2, {})
    out = run_workers(train_toy, 2, {"inject": ["scale:site=local-grad,steps=3,ranks=0,factor=100,count=8"]})
    assert same(out[0], out[1])
    assert not same(out[0], clean[0])


def test_stale_aggregation_delivers_the_previous_result() -> None:
    out = run_workers(train_toy, 2, {"inject": ["stale:steps=5,ranks=1"]})
    assert not same(out[0], out[1])
    m = out[0]["reports"][5]["metrics"]
    # two ranks that disagree: no majority, so no rank is named, and the groups are given
    assert m["replicas/grad_minority_ranks"] == [] and m["replicas/grad_groups"] == [[0], [1]]


def test_bucket_faults_target_the_buckets_ddp_has_rebuilt(tmp_path: Path) -> None:
    """A 5 KB bucket cap: DDP's first pass has one bucket, its rebuilt layout two. The hook
    learns the count from each pass's last bucket and fixes it at the next begin(): a
    fault of step 1 picks among the one bucket known then (bucket 1 arrives, beyond the
    count: neither hit nor an error), from step 2 on among both; prime() tells the
    hook of both before step 0 (its second pass, on the rebuilt layout: with one pass,
    step 0 still picked among one). With the count never updated, or the bound on the
    index dropped (the injector then raised), the protect tests' one-bucket model
    had seen no difference."""
    targets = {}
    for prime in (False, True):
        run_dir = tmp_path / str(prime)
        run_workers(train_toy, 2, {"steps": 8, "bucket_cap_mb": 0.005, "prime": prime, "run_dir": str(run_dir),
                                   "inject": ["bitflip:steps=0-7,ranks=0,bits=3"]})
        records = read_jsonl(run_dir / "faults.jsonl")
        assert [(r["step"], r["rank"]) for r in records] == [(t, 0) for t in range(8)]
        targets[prime] = [r["target"] for r in records]
    assert targets[False][:2] == [0, 0] and targets[False][2:] == targets[True][2:]
    # Seed 3 picks bucket 1 of two at steps 0 and 1 (bucket 0 of one, unprimed).
    assert set(targets[True]) == {0, 1} and targets[True][:2] == [1, 1]


@pytest.mark.parametrize("world_size, opts, cosine_alert", [
    (2, {"nan_input_at": [1, 2]}, False),  # bad data: rank 1's loss and gradient are NaN
    (2, {"inject": ["inf:site=params,steps=2,ranks=1"]}, False),  # an Inf weight: a finite loss, an Inf gradient
    (2, {"inject": ["nan:site=local-grad,steps=2,ranks=1"]}, False),
    (2, {"inject": ["inf:site=local-grad,steps=2,ranks=1"]}, False),
    # Three ranks, rank 0's gradient negated besides: the two finite ones point apart
    # (cosine -0.32), which is alerted whatever rank 1 holds.
    (3, {"inject": ["nan:site=local-grad,steps=2,ranks=1",
                    "scale:site=local-grad,steps=2,ranks=0,factor=-1,fraction=1"],
         "monitor": {"alert_cos_min": -0.2}}, True),
], ids=["nan loss", "inf params", "nan local grad", "inf local grad", "3 ranks, low cosine too"])
def test_a_rank_gone_non_finite_is_alerted_once_by_name(tmp_path: Path, world_size: int, opts: dict[str, Any],
                                                        cosine_alert: bool) -> None:
    # Rank 1 non-finite at step 2, every replica from step 3 (the update spreads it). The
    # loss CV and the cosines it turns NaN measure nothing: nonfinite_local alone names
    # the cause (they used to be alerted too, as if the ranks disagreed).
    out = run_workers(train_toy, world_size, {"steps": 4, "optimizer": "sgd", "run_dir": str(tmp_path), **opts})
    alerts = [(e["step"], e["detector"], e["ranks"]) for e in read_jsonl(tmp_path / "events.jsonl")
              if e["event"] == "alert"]
    assert alerts == [(2, "nonfinite_local", [1]), *[(2, "grad_cos_min", [])] * cosine_alert,
                      (3, "nonfinite_local", list(range(world_size)))]
    assert out[0]["counters"]["alerts"] == len(alerts)  # the summary's count
    records = {r["step"]: from_jsonable(r) for r in read_jsonl(tmp_path / "consistency.jsonl")}
    # Two ranks, one non-finite: no pair of finite gradients, so no cosine (NaN, "nan" in the file).
    assert math.isnan(records[2]["consistency/grad_cos_min"]) == (world_size == 2)


@pytest.mark.parametrize("case,opts,alerted", [
    ("blocking", {"overlap": False}, [5, 10]),
    ("overlapped", {}, [5, 10]),
    # The fingerprint of the step an overlapped sync lands in was taken before it.
    ("overlapped, fingerprint every step", {"fingerprint_every": 1}, [2, 7]),
    ("blocking, fingerprint every step", {"fingerprint_every": 1, "overlap": False}, [2, 7]),
    # A checkpoint lands the sync between steps (close()), before the next fingerprint.
    ("overlapped, closed", {"close_after": 5}, [5, 10]),
    # A fault after the snapshot of a sync that found nothing to repair: one incident.
    ("fault during a no-op sync", {"fingerprint_every": 1, "faults": "6"}, [6]),
])
def test_every_split_gets_one_alert_across_syncs(tmp_path: Path, case: str, opts: dict[str, Any],
                                                 alerted: list[int]) -> None:
    # Faults at rest on rank 1, each repaired by the next sync (period 5): one alert per
    # incident. The first used to stay "active" until a fingerprint agreed, which a
    # sync's repair never recorded, so the second split went unreported.
    run_workers(train_toy, 3, {
        "steps": 12, "run_dir": str(tmp_path), "close_after": opts.get("close_after"),
        "monitor": {"fingerprint_every": opts.get("fingerprint_every", 5)},
        "protect": {"mode": "sync", "sync_period": 5, "overlap": opts.get("overlap", True)},
        "inject": [f"bitflip:site=params,steps={opts.get('faults', '2+7')},ranks=1,bits=mantissa"]})
    events = read_jsonl(tmp_path / "events.jsonl")
    splits = [e for e in events if e.get("detector") == "state_split"]
    assert [(e["step"], e["ranks"]) for e in splits] == [(step, [1]) for step in alerted], case
    for e in splits:  # how far apart, measured when the fingerprints disagree, and where
        far = e["divergence"]["params_per_rank"]
        assert far[1] > 0 and far[1] == max(far), (case, e)
        name, rel, rank = e["divergence"]["tensors"][0]
        assert name.startswith("param/") and rel > 0 and rank == [1], (case, e)


@pytest.mark.parametrize("site", ["params", "optimizer-state"])
def test_state_fault_at_rest_is_detected_and_the_rank_named(site: str) -> None:
    out = run_workers(train_toy, 3, {"inject": [f"bitflip:site={site},steps=6,ranks=2,bits=mantissa"],
                                     "monitor": {"fingerprint_every": 1}})
    m = out[0]["reports"][6]["metrics"]
    assert m["replicas/state_distinct"] == 2 and m["replicas/state_minority_ranks"] == [2]
    assert out[0]["reports"][5]["metrics"]["replicas/state_distinct"] == 1


# -- guard ----------------------------------------------------------------------------

GUARD = {"enabled": True, "warmup": 3}


@pytest.mark.parametrize(("site", "interval"), [("aggregation", 1), ("local-grad", 1), ("local-grad", 5)])
def test_guard_recomputes_a_transient_bit30_flip_exactly(site: str, interval: int, tmp_path: Path) -> None:
    # At --monitor-interval 5, step 7 computes no worker metrics; the guard still
    # reads every rank's local gradient norm there, and names the rank.
    opts = {"guard": GUARD, "steps": 12, "monitor": {"interval": interval}}
    clean = run_workers(train_toy, 2, opts)
    out = run_workers(train_toy, 2, {**opts, "run_dir": str(tmp_path),
                                     "inject": [f"bitflip:site={site},steps=7,ranks=1,bits=30,count=4"]})
    assert same(out[0], clean[0]) and same(out[1], clean[1])
    assert out[0]["reports"][7]["attempts"] == 2
    first = next(e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "guard")
    detector = "rank_outlier" if site == "local-grad" else "grad_mismatch"  # finite 1e36s: no overflow
    assert (first["step"], first["detector"], first["ranks"]) == (7, detector, [1])
    assert [line for line in out[0]["said"] if line.startswith("[guard]")] == [  # the console, as docs/GUARD.md shows
        f"[guard] step 7 attempt 0: {detector} on rank(s) [1] -> recompute",
        f"[guard] step 7 attempt 1: clean recompute (of {detector} on rank(s) [1]) -> proceed, cause transient"]
    c = out[0]["counters"]
    assert c["detections"] == 1 and c["recomputes"] == 1 and c["transient"] == 1 and c["skipped_batches"] == 0
    last = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "guard"][-1]
    # The guard's counts so far, for a run that ends without its summary.
    assert last["totals"] and last["totals"] == {k: c[k] for k in last["totals"]}


@pytest.mark.parametrize("site", ["aggregation", "local-grad"])
def test_gradient_accumulation_under_no_sync_is_plain_ddp_and_guarded(site: str) -> None:
    # The closure accumulates two micro-batches, the first under ddp.no_sync(): the hook
    # sees (and the guard judges) only the all-reduce of the accumulated gradient. The
    # protected run is plain DDP's bit for bit, and a transient flip there is recomputed
    # (both micro-batches: the closure zeroes first) back to the fault-free run.
    opts = {"accumulate": True, "steps": 8}
    plain = run_workers(train_toy, 3, {**opts, "plain": True})
    guarded = {**opts, "guard": GUARD}
    clean = run_workers(train_toy, 3, guarded)
    out = run_workers(train_toy, 3, {**guarded, "inject": [f"bitflip:site={site},steps=5,ranks=1,bits=30,count=4"]})
    for p, c, o in zip(plain, clean, out):
        assert same(p, c) and same(c, o)
    assert not any(r["attempts"] > 1 for r in clean[0]["reports"])
    assert [r["attempts"] for r in out[0]["reports"]] == [1] * 5 + [2] + [1] * 2
    assert out[0]["counters"]["transient"] == 1


def test_guard_recomputes_a_bit30_flip_at_the_first_step_of_two_ranks() -> None:
    # No history yet, and two ranks have no median: the gap between them names the rank
    # (undetected, the flip put inf into Adam's second moment on every rank for good).
    clean = run_workers(train_toy, 2, {"guard": GUARD, "steps": 4})
    out = run_workers(train_toy, 2, {"guard": GUARD, "steps": 4,
                                     "inject": ["bitflip:site=local-grad,steps=0,ranks=1,bits=30,count=4"]})
    assert same(out[0], clean[0]) and same(out[1], clean[1])
    assert out[0]["reports"][0]["attempts"] == 2
    assert (out[0]["counters"]["detections"], out[0]["counters"]["transient"]) == (1, 1)


class ReplacedRunningMean(nn.Module):
    """A running mean of its input that each training forward replaces by assignment, not
    updates in place, as hand-written normalizers do (DDP allows it: it lists the buffers
    it broadcasts afresh at each forward)."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.mean = 0.9 * self.mean + 0.1 * x.detach().mean(0)
        return x - self.mean


def _replaced_buffer_run(inject: list[str]) -> tuple[list[torch.Tensor], bool]:
    """Four guarded steps, primed, of a model whose forward replaces its buffer, on one
    rank: its parameters and buffer at the end, and whether prime() left the buffer alone."""
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(16, 8), ReplacedRunningMean(8), nn.Tanh(),
                                                  nn.Linear(8, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    protector = protect(model, optimizer, guard=GuardConfig(**GUARD), inject=inject)
    protector.prime(toy_closure(model, optimizer, 0, 0))
    primed = torch.equal(model.module[1].mean, torch.zeros(8))
    for step in range(4):
        protector.step(toy_closure(model, optimizer, 0, step))
    assert protector.counters["transient"] == len(inject)
    state = [t.detach().clone() for t in model.module.state_dict().values()]
    del protector, model
    return state, primed


@pytest.mark.usefixtures("one_rank_group")
def test_a_buffer_the_forward_replaces_is_put_back_before_a_recompute_and_after_prime() -> None:
    # The snapshot copied the buffer tensors listed once at protect(): a forward that
    # replaced one left the copy to a tensor the module no longer had, so the
    # recompute updated the running mean twice, and prime() changed it.
    clean, primed = _replaced_buffer_run([])
    out, _ = _replaced_buffer_run(["nan:site=local-grad,steps=2"])
    assert primed and all(torch.equal(a, b) for a, b in zip(clean, out))


def test_bad_data_on_one_rank_is_data_while_another_ranks_gradient_was_hit() -> None:
    # Rank 1's targets are 1000x at step 8 (data); rank 2's local gradient takes a bit-30
    # flip on the first attempt only. The recompute moves every rank's aggregated norm
    # but reproduces rank 1's own values: data, not a persistent fault (which would stop).
    opts = {"guard": {**GUARD, "on_persistent": "stop"}, "steps": 10, "scaled_targets_at": [1, 8]}
    out = run_workers(train_toy, 3, {**opts, "inject": ["bitflip:site=local-grad,steps=8,ranks=2,bits=30,count=4"]})
    data_only = run_workers(train_toy, 3, opts)
    assert out[0]["reports"][8]["applied"] is False and out[0]["reports"][8]["attempts"] == 2
    c = out[0]["counters"]
    assert (c["data"], c["persistent"], c["skipped_batches"]) == (1, 0, 1)
    assert all(same(o, d) for o, d in zip(out, data_only))  # as if only the bad batch had been skipped


def control_sizes(rank: int, world_size: int) -> dict[str, list[tuple[int, bool]]]:
    """Per monitor setting and step, the float64 count of the control vector, and
    whether the hook kept a copy of the local gradient."""
    attempt_module = sys.modules["paft.attempt"]  # where a step's control collective is launched
    sizes: list[int] = []
    launch = attempt_module.start_control

    def counting(vec: torch.Tensor, group: Any = None) -> Any:
        sizes.append(vec.numel())
        return launch(vec, group)

    def four_steps(monitor: MonitorConfig, guard: bool = False) -> list[tuple[int, bool]]:
        sizes.clear()
        copied: list[bool] = []
        model = DistributedDataParallel(toy_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        protector = protect(model, optimizer, monitor=monitor, guard=GuardConfig(enabled=guard))
        for step in range(4):
            protector.step(toy_closure(model, optimizer, rank, step))
            copied.append(bool(protector.hook.current.local_grads))
        protector.close()
        return list(zip(sizes, copied))

    attempt_module.start_control = counting
    return {"sketch": four_steps(MonitorConfig(interval=2, sketch_dim=16)),
            "exact": four_steps(MonitorConfig(interval=2, cosine="exact")),
            # the guard captures the local gradient's norm on every step, its copy still not
            "exact, guarded": four_steps(MonitorConfig(interval=2, cosine="exact"), guard=True)}


def test_the_control_vector_is_9_plus_k_float64_on_metric_steps_and_9_between() -> None:
    # README: 2.1 KB per rank for k = 256, 72 bytes without a sketch (between metric
    # steps, or with --cosine exact, whose gradients travel apart).
    # The exact mode's float64 copy of the local gradient is taken on metric steps only:
    # taken on every step, it doubled the gradient's memory and copy time for no reader.
    out = run_workers(control_sizes, 2)
    sketch = [(9 + 16, False), (9, False)] * 2
    exact = [(9, True), (9, False)] * 2
    assert out[0] == out[1] == {"sketch": sketch, "exact": exact, "exact, guarded": exact}


def half_model_run(rank: int, world_size: int) -> list[tuple[bool, int, float]]:
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(8, 8).half())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-9)
    protector = protect(model, optimizer, guard=GuardConfig(enabled=True))
    x = torch.ones(4, 8, dtype=torch.float16) * (rank + 1)

    def closure() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        # Weight gradients of 1e4 and 2e4 per entry, 1.5e4 averaged: all finite in
        # float16, their norm (about 1.2e5) past its 65504.
        loss = model(x).float().sum() * 2500
        loss.backward()
        return loss

    reports = [protector.step(closure) for _ in range(3)]
    return [(r.applied, r.attempts, r.grad_norm) for r in reports]


def test_finite_half_precision_gradients_past_the_dtypes_range_are_not_judged_non_finite() -> None:
    # Their float16 norm is inf: the guard recomputed every such step and skipped it as
    # bad data, and training stalled. The guard judges the float64 norm.
    out = run_workers(half_model_run, 2)
    assert out[0] == out[1]
    for applied, attempts, norm in out[0]:
        assert applied and attempts == 1
        assert 1.2e5 < norm < 1.3e5


def test_nan_in_input_data_is_attributed_to_data_and_skipped() -> None:
    out = run_workers(train_toy, 2, {"guard": GUARD, "nan_input_at": [1, 6]})
    assert same(out[0], out[1])
    assert out[0]["reports"][6]["applied"] is False
    c = out[0]["counters"]
    assert c["data"] == 1 and c["skipped_batches"] == 1
    assert all(torch.isfinite(p).all() for p in out[0]["params"])


def test_guard_repairs_a_replica_corrupted_at_rest_exactly() -> None:
    # A flipped exponent in rank 1's weights reproduces on every recompute; the state
    # fingerprints show it, the majority's bits are copied back, and the step reruns.
    opts = {"guard": GUARD, "monitor": {"fingerprint_every": 1}}
    clean = run_workers(train_toy, 3, opts)
    out = run_workers(train_toy, 3, {**opts, "inject": ["bitflip:site=params,steps=6,ranks=1,bits=30"]})
    assert all(same(o, c) for o, c in zip(out, clean))
    assert out[0]["reports"][6]["attempts"] == 2
    c = out[0]["counters"]
    assert (c["detections"], c["state"], c["data"], c["skipped_batches"], c["syncs"]) == (1, 1, 0, 0, 1)


def test_guard_repairs_nan_optimizer_state_instead_of_skipping_as_data() -> None:
    # Unseen until it makes rank 1's weights NaN; the rerun fingerprints the state.
    out = run_workers(train_toy, 2, {"guard": GUARD, "inject": ["nan:site=optimizer-state,steps=5,ranks=1"]})
    assert same(out[0], out[1]) and all(torch.isfinite(p).all() for p in out[1]["params"])
    c = out[0]["counters"]
    assert c["state"] >= 1 and c["data"] == 0 and c["skipped_batches"] == 0


def test_an_update_ratio_rejected_on_one_rank_is_rolled_back_on_every_rank(tmp_path: Path) -> None:
    # NaN in rank 1's Adam state at rest, on a step whose state is not fingerprinted:
    # only rank 1's update is non-finite. The rollback is decided on the max of the
    # ranks' ratios, so rank 0 (whose own ratio is fine) rolls back and recomputes too;
    # the rerun fingerprints the state and repairs rank 1. Judged on each rank's own
    # ratio, rank 0 stepped on while rank 1 recomputed, and their collectives parted.
    out = run_workers(train_toy, 2, {"guard": {"enabled": True}, "steps": 7, "run_dir": str(tmp_path),
                                     "inject": ["nan:site=optimizer-state,steps=5,ranks=1"]}, timeout=120)
    assert same(out[0], out[1]) and all(torch.isfinite(p).all() for p in out[1]["params"])
    guard = [(e["step"], e["attempt"], e["detector"], e["action"])
             for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "guard"]
    assert guard[0] == (5, 0, "update_ratio", "recompute")
    assert [r["attempts"] for r in out[0]["reports"]] == [r["attempts"] for r in out[1]["reports"]]
    assert out[0]["reports"][5]["applied"] and out[0]["reports"][5]["attempts"] >= 2


@pytest.mark.parametrize("protect_mode", ["none", "sync"])
def test_two_rank_repair_takes_the_median_with_the_last_agreed_state(tmp_path: Path, protect_mode: str) -> None:
    # Two ranks have no majority: a sign flip at rest on rank 1 is repaired to the
    # median of the two replicas and the state both agreed on at the last check (step
    # 4), never to a zero reference (the guard's repairer used to be built only at
    # its first repair, from replicas that already differed).
    opts = {"guard": GUARD, "monitor": {"fingerprint_every": 1}, "optimizer": "sgd", "steps": 6,
            "protect": {"mode": protect_mode, "sync_mode": "mean", "sync_period": 1000}}
    clean = run_workers(train_toy, 2, opts)
    out = run_workers(train_toy, 2, {**opts, "run_dir": str(tmp_path),
                                      "inject": ["bitflip:site=params,steps=5,ranks=1,bits=sign"]})
    assert same(out[0], out[1])
    (repair,) = [e for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "repair"]
    assert (repair["step"], repair["mode"], repair["note"]) == (5, "median-with-reference", "")
    (fault,) = read_jsonl(tmp_path / "faults.jsonl")
    # The repair names the one tensor the fault struck (the ranks' digests of it differ).
    assert (repair["differing_tensors"], repair["differing"]) == (1, {fault["target"]: [[0], [1]]})
    layer = int(fault["target"].split("/")[1].split(".")[0]) // 2  # Linear layers sit at 0, 2, 4
    index = fault["indices"][0]
    got, want = (o["params"][2 * layer].view(-1)[index].item() for o in (out[0], clean[0]))
    assert fault["target"].endswith(".weight") and abs(got - want) < 0.1 * abs(want)


def test_a_skipped_batch_leaves_no_trace_in_batchnorm_statistics() -> None:
    # The NaN batch's forward wrote its statistics into the running mean; the skip kept
    # them, DDP broadcast rank 0's buffers, and every later evaluation was NaN.
    out = run_workers(train_toy, 2, {"guard": GUARD, "batchnorm": True, "optimizer": "sgd", "steps": 8,
                                     "nan_input_at": [0, 5]})
    for o in out:
        assert [r["applied"] for r in o["reports"]] == [True] * 5 + [False] + [True] * 2
        assert o["counters"]["data"] == 1 and all(torch.isfinite(b).all() for b in o["buffers"])


def nan_adam_state_on_every_rank(rank: int, world_size: int) -> dict[str, Any]:
    """BatchNorm and dropout, the guard on; before step 2 every rank's Adam state is NaN
    alike, so the state fingerprints agree and no pre-step check sees it: only the
    update ratio, after each attempt's ``optimizer.step()``, which rolls it back."""
    model = DistributedDataParallel(toy_model(batchnorm=True))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    protector = protect(model, optimizer, guard=GuardConfig(**GUARD))
    out: dict[str, Any] = {}
    for step in range(3):
        closure = toy_closure(model, optimizer, rank, step, dropout=0.1)
        if step == 2:
            with torch.no_grad():
                for state in optimizer.state.values():
                    state["exp_avg"].fill_(math.nan)
            before = ([b.clone() for b in model.module.buffers()], torch.get_rng_state())
        report = protector.step(closure)
    out["step 2"] = (report.applied, report.attempts)
    out["no trace"] = (all(torch.equal(a, b) for a, b in zip(before[0], model.module.buffers()))
                       and torch.equal(before[1], torch.get_rng_state()))
    out["counters"] = {k: protector.counters[k] for k in ("rollbacks", "skipped_batches", "state")}
    return out


def test_an_update_the_guard_rolls_back_twice_leaves_no_trace_in_buffers_or_rng() -> None:
    # Each attempt's NaN update is rolled back; the recompute reproduces it (data: the
    # batch is skipped). Each rollback restores the RNG and BatchNorm's statistics as
    # the step found them, as a skip before the update does; without that, the skipped
    # batch's two forward passes stayed in the running stats and the RNG.
    out = run_workers(nan_adam_state_on_every_rank, 2)
    for o in out:
        assert o["step 2"] == (False, 2) and o["no trace"]
        assert o["counters"] == {"rollbacks": 2, "skipped_batches": 1, "state": 0}


def bn_repair_then_rerun(rank: int, world_size: int) -> dict[str, list[torch.Tensor]]:
    """3 ranks, conv + BatchNorm, the guard on, state checked every 2nd step. Step 7:
    rank 0's conv weights x1000 at rest, unchecked; BatchNorm hides them from the loss,
    but rank 0's running variance grows ~1e4-fold. Step 8: the state check fails and
    the guard repairs (majority copy; buffers: median); stuck hardware on rank 2 then
    fails every recompute of step 8 until the rerun cap skips the batch."""
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Sequential(
        nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 1)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    protector = protect(model, optimizer, monitor=MonitorConfig(fingerprint_every=2),
                        guard=GuardConfig(enabled=True, warmup=5), seed=1, inject=[
                            "scale:site=params,steps=7,ranks=0,factor=1000,count=36",
                            "scale:site=local-grad,steps=8,ranks=2,factor=1e6,count=4,persistent=true"])
    out: dict[str, list[torch.Tensor]] = {}
    for step in range(10):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(8, 1, 6, 6, generator=g)

        def closure(x: torch.Tensor = x) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), x.mean(dim=(1, 2, 3)).unsqueeze(1))
            loss.backward()
            return loss

        protector.step(closure)
        if step == 8:
            out["after_repair"] = [b.detach().clone() for b in model.module.buffers()]
    protector.close()
    out["end"] = [b.detach().clone() for b in model.module.buffers()]
    return out


def test_a_recompute_after_a_repair_keeps_the_repaired_buffers() -> None:
    # The recompute restored the buffers saved at the start of the step, from before
    # the repair: rank 0's corrupted running variance came back, and at the next
    # forward DDP broadcast it to every rank (~2.4e4 instead of ~0.5 everywhere).
    out = run_workers(bn_repair_then_rerun, 3)
    for o in out[1:]:
        assert all(torch.equal(a, b) for a, b in zip(out[0]["after_repair"], o["after_repair"]))
    for o in out:
        assert float(o["end"][1].max()) < 10.0  # running_var: the corrupted value neither kept nor spread


def persistent_run(rank: int, world_size: int, opts: dict[str, Any]) -> Any:
    try:
        return train_toy(rank, world_size, opts)
    except PersistentFaultError as err:
        return {"stopped": err.step, "ranks": err.ranks}


def test_persistent_faulty_rank_is_named_and_stops() -> None:
    out = run_workers(persistent_run, 3, {
        "guard": {**GUARD, "on_persistent": "stop"},
        "inject": ["bitflip:steps=6,ranks=2,bits=30,count=4,persistent=true"],
    })
    assert all(o == {"stopped": 6, "ranks": [2]} for o in out)


def test_a_persistent_fault_error_names_the_policy_as_python_and_the_command_line_do() -> None:
    # It said "as --on-persistent=stop asks" to a library user who had set GuardConfig.on_persistent.
    assert str(PersistentFaultError(6, [2])) == (
        "step 6: rank(s) [2] reproduced a harmful update on recomputation (persistent fault); stopping as "
        "on_persistent='stop' (--on-persistent stop) asks")


def stop_then_step_on(rank: int, world_size: int, mode: str) -> dict[str, Any]:
    """A persistent fault stops step 6; the caller catches the error and steps on."""
    torch.manual_seed(0)
    model = DistributedDataParallel(toy_model(batchnorm=True))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    protector = protect(model, optimizer, guard=GuardConfig(**GUARD, on_persistent="stop"),
                        protect=ProtectConfig(mode=mode, sync_period=5),
                        inject=["bitflip:steps=6,ranks=2,bits=30,count=4,persistent=true"], seed=3)
    out: dict[str, Any] = {}
    for step in range(8):
        closure = toy_closure(model, optimizer, rank, step, dropout=0.1)
        if step == 6:
            out["in flight"] = [protector.resync.in_flight]
            before = ([b.clone() for b in model.module.buffers()], torch.get_rng_state(),
                      state_fingerprint(model, optimizer))
            try:
                protector.step(closure)
            except PersistentFaultError as err:
                out["stopped"] = (err.step, err.ranks)
            out["no trace"] = (all(torch.equal(a, b) for a, b in zip(before[0], model.module.buffers()))
                               and torch.equal(before[1], torch.get_rng_state())
                               and before[2] == state_fingerprint(model, optimizer))
            out["grads"] = [p.grad for p in model.parameters()]
            out["next step"] = protector.step_idx
            out["in flight"].append(protector.resync.in_flight)
            continue
        report = protector.step(closure)
    if protector.resync.averager is not None:  # its own step counter decides when it averages
        out["averager"] = (protector.resync.averager.step, protector.step_idx)
    out["last"] = (report.step, report.applied, state_fingerprint(model, optimizer, buffers=False))
    return out


@pytest.mark.parametrize("mode", ["sync", "averager"])
def test_a_stopped_step_leaves_no_trace_and_the_caller_may_step_on(mode: str) -> None:
    out = run_workers(stop_then_step_on, 3, mode)
    for o in out:
        assert o["stopped"] == (6, [2]) and o["no trace"] and o["grads"] == [None] * len(o["grads"])
        assert o["next step"] == 7 and o["last"][:2] == (7, True)
        if mode == "sync":
            assert o["in flight"] == [True, False]  # the overlapped sync started after step 5 landed
        else:
            assert o["averager"] == (8, 8)
    assert len({o["last"][2] for o in out}) == 1


# Faults that stop a step (the second item) and leave the replicas split.
SPLIT_STOPS = {
    # Stuck memory in rank 1's weights, at a state check step.
    "stuck": (["bitflip:site=params,steps=5,ranks=1,bits=30,persistent=true"], 5),
    # Rank 2's reduction fails again on the recompute, which also finds rank 1's weights
    # corrupted at rest (step 6 checks no state: its recompute does).
    "reduction": (["scale:site=params,steps=6,ranks=1,factor=1.01",
                   "bitflip:site=aggregation,steps=6,ranks=2,bits=30,persistent=true"], 6),
}


def stop_on_split_state(rank: int, world_size: int, mode: str, resume: bool, fault: str) -> dict[str, Any]:
    """``SPLIT_STOPS[fault]`` stops a step; the caller catches the error and steps on,
    with the next state check steps away (every fifth step); ``resume``: from a
    checkpoint, each rank its own, taken after the stop."""
    inject, stop = SPLIT_STOPS[fault]

    def build() -> tuple[DistributedDataParallel, torch.optim.Optimizer, Any]:
        model = DistributedDataParallel(toy_model())
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        return model, optimizer, protect(
            model, optimizer, monitor=MonitorConfig(fingerprint_every=5), protect=ProtectConfig(mode=mode),
            guard=GuardConfig(**GUARD, on_persistent="stop"), seed=3,
            inject=inject)

    model, optimizer, protector = build()
    out: dict[str, Any] = {"fingerprints": []}
    for step in range(stop + 2):
        try:
            report = protector.step(toy_closure(model, optimizer, rank, step))
            out[step] = (report.applied, report.synced)
        except PersistentFaultError as err:
            out[step] = ("stopped", err.ranks)
        protector.close()
        out["fingerprints"].append(state_fingerprint(model, optimizer, buffers=False))
        if resume and step == stop:
            saved = copy.deepcopy((model.module.state_dict(), optimizer.state_dict(), protector.state_dict()))
            model, optimizer, protector = build()
            model.module.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            protector.load_state_dict(saved[2])
    return out


@pytest.mark.parametrize(("mode", "resume", "fault"), [("none", False, "stuck"), ("dyn", False, "stuck"),
                                                      ("dyn", True, "stuck"), ("none", False, "reduction")])
def test_the_step_after_a_stop_on_split_replicas_repairs_them(mode: str, resume: bool, fault: str) -> None:
    # The stopped step left rank 1's corrupted weights in place; the next step's check
    # repairs them (it waited for the next --fingerprint-every step, steps on, while the
    # replicas trained apart), also in a run resumed from a checkpoint of each rank's
    # own state, and where the stop named another rank's reduction (it left the split
    # to that next check too).
    ranks, named = (2, []) if fault == "stuck" else (3, [2])
    out = run_workers(stop_on_split_state, ranks, mode, resume, fault)
    stop = SPLIT_STOPS[fault][1]
    assert out[0]["fingerprints"][stop] != out[1]["fingerprints"][stop]  # split by the stop
    assert len({o["fingerprints"][stop + 1] for o in out}) == 1  # bitwise: params and optimizer state
    for o in out:
        assert o[stop] == ("stopped", named) and o[stop + 1] == (True, True)  # the repair is the step's sync


def test_a_persistent_fault_at_rest_strikes_the_rerun_and_names_the_rank() -> None:
    # Stuck memory: the repaired replica is corrupted again (elsewhere) when the step is
    # recomputed, so the state mismatch recurs on the same rank: persistent, not transient.
    out = run_workers(persistent_run, 3, {
        "guard": {**GUARD, "on_persistent": "stop"}, "monitor": {"fingerprint_every": 1},
        "inject": ["bitflip:site=params,steps=6,ranks=1,bits=30,persistent=true"],
    })
    assert all(o == {"stopped": 6, "ranks": [1]} for o in out)


def test_rerun_cap_holds() -> None:
    out = run_workers(train_toy, 3, {
        "guard": {**GUARD, "on_persistent": "repair", "max_reruns_per_step": 2, "max_reruns_per_run": 3},
        "inject": ["bitflip:steps=5-6,ranks=2,bits=30,count=4,persistent=true"],
    })
    reports = out[0]["reports"]
    assert reports[5]["attempts"] == 3 and reports[5]["applied"] is False  # 2 reruns, then skip
    assert reports[6]["attempts"] == 2 and reports[6]["applied"] is False  # run cap: 1 rerun left
    assert out[0]["counters"]["recomputes"] == 3
    assert same(out[0], out[1]) and same(out[0], out[2])


# -- PAFT-Sync / PAFT-Dyn ----------------------------------------------------------------

FAULTY = ["bitflip:rate=0.5,ranks=1,bits=mantissa,count=64"]


def test_sync_bounds_divergence_that_grows_without_it() -> None:
    unprotected = run_workers(train_toy, 3, {"steps": 30, "inject": FAULTY})[0]["divergence"]
    synced = run_workers(train_toy, 3, {"steps": 30, "inject": FAULTY,
                                        "protect": {"mode": "sync", "sync_period": 5, "overlap": False}})[0]
    div = synced["divergence"]
    assert unprotected[-1] > 0 and unprotected[-1] >= max(unprotected[:10])
    # after every sync (steps 5, 10, ...) the replicas are identical again
    for step in range(5, 30, 5):
        assert div[step] == 0.0, (step, div)
    assert max(div) < unprotected[-1]


@pytest.mark.parametrize(("optimizer", "interval"), [("sgd", 1), ("momentum", 1), ("adam", 1), ("adam", 10),
                                                     ("adam", 0)])
def test_dyn_repairs_a_split_within_one_step(optimizer: str, interval: int) -> None:
    # At --monitor-interval 10 step 4 computes no worker metrics (at 0 no step does), but
    # its checksums still see the split: Dyn's trigger does not wait for a metric step.
    opts = {"optimizer": optimizer, "steps": 12, "monitor": {"interval": interval},
            "protect": {"mode": "dyn", "sync_period": 50, "overlap": True}}
    clean = run_workers(train_toy, 3, opts)
    out = run_workers(train_toy, 3, {**opts, "inject": ["bitflip:steps=4,ranks=1,bits=exponent,count=8"]})
    report = out[0]["reports"][4]
    assert report["metrics"]["replicas/grad_minority_ranks"] == [1]
    if interval != 1:  # the split's record: the losses and replicas, no worker metrics
        assert report["metrics"]["local_losses"] and "consistency/loss_cv" not in report["metrics"]
        after = [out[0]["reports"][s]["metrics"] for s in (0, 3, 5, 6, 10)]
        assert after[1] == {} and after[3] == {}  # nothing to say of the replicas
        assert after[2]["replicas/grad_distinct"] == 1  # the step after the split: its end
        # The metric steps (0 and 10 at interval 10), or at interval 0 the state checks' records.
        assert all(("consistency/gnorm_cv" in m) == (interval > 0) for m in (after[0], after[4]))
        assert "replicas/state_distinct" in after[4]
    assert report["synced"] and out[0]["divergence"][4] == 0.0  # repaired in the step it happened
    # the majority's bits were copied to rank 1: the run is the fault-free run, bit for bit
    for o, c in zip(out, clean):
        assert same(o, c) and o["fingerprint"] == c["fingerprint"]


def test_the_aggregated_gradients_of_a_skipped_step_split_no_replicas(tmp_path: Path) -> None:
    # A persistent aggregation fault on rank 2: the guard skips each batch, nothing is
    # applied and the replicas agree. PAFT-Dyn synced at once and halved H each time,
    # and the records said the replicas split (an alert, grad_distinct 2).
    out = run_workers(train_toy, 3, {
        "steps": 12, "protect": {"mode": "dyn", "sync_period": 16, "h_min": 2, "h_max": 64},
        "guard": {"enabled": True, "warmup": 2}, "run_dir": str(tmp_path),
        "inject": ["bitflip:site=aggregation,steps=6+8+10,bits=30,ranks=2,persistent=true"],
    })
    reports = out[0]["reports"]
    assert [r["step"] for r in reports if not r["applied"]] == [6, 8, 10]
    assert not any(r["synced"] for r in reports)
    assert len({o["fingerprint"] for o in out}) == 1
    records = read_jsonl(tmp_path / "consistency.jsonl")
    assert [r["step"] for r in records] == list(range(12))
    assert all(r.get("replicas/grad_distinct", 1) == 1 for r in records)
    assert "replicas/grad_distinct" not in records[6] and records[7]["replicas/grad_distinct"] == 1
    events = read_jsonl(tmp_path / "events.jsonl")
    assert not [e for e in events if e["event"] == "dyn_trigger" or e.get("detector") == "replicas_split"]
    assert [e["step"] for e in events if e["event"] == "guard" and e["action"] == "skip"] == [6, 8, 10]


@pytest.mark.parametrize("mode,optimizer,fault", [
    ("dyn", "adam", "bitflip:site=optimizer-state,steps=9,ranks=1,bits=exponent,count=4"),
    ("sync", "momentum", "nan:site=aggregation,steps=9,ranks=1"),
])
def test_an_overlapped_sync_that_finds_a_split_repairs_it_before_the_next_step(mode: str, optimizer: str,
                                                                                fault: str) -> None:
    # Step 9's update corrupts rank 1 (unseen: no fingerprint), and the sync due after
    # step 9 finds it. Left in flight, step 10's forward/backward would run on rank 1's
    # weights and DDP's all-reduce would carry its gradient (a NaN, in the second case)
    # into every repaired replica. It repairs at once instead: the overlapped run is the
    # blocking one, bit for bit, and both are back on the fault-free trajectory.
    opts = {"steps": 12, "optimizer": optimizer, "monitor": {"fingerprint_every": 100}}
    protect_opts = {"mode": mode, "sync_period": 9, "h_min": 1}
    runs = {overlap: run_workers(train_toy, 3, {**opts, "inject": [fault],
                                                "protect": {**protect_opts, "overlap": overlap}})
            for overlap in (True, False)}
    clean = run_workers(train_toy, 3, {**opts, "protect": protect_opts})
    for out in runs.values():
        assert out[0]["reports"][9]["synced"] and out[0]["divergence"][9] == 0.0
        assert all(same(o, c) for o, c in zip(out, clean))


def test_dyn_repairs_at_once_a_split_the_overlapped_sync_finishing_meanwhile_could_not() -> None:
    # The no-op sync started after step 4 finishes in step 5, after step 5's state
    # fingerprints, which show rank 1's weights corrupted at rest in step 5. A no-op
    # repairs nothing (nor would a full sync: its correction keeps a fault after its
    # snapshot): the split is repaired in step 5, as without overlap. It used to wait
    # for a recheck at step 6, which trained on rank 1's corrupted gradient.
    opts = {"steps": 8, "monitor": {"fingerprint_every": 1},
            "inject": ["bitflip:site=params,steps=5,ranks=1,bits=exponent,count=4"]}
    runs = {overlap: run_workers(train_toy, 3, {**opts, "protect": {"mode": "dyn", "sync_period": 4, "h_min": 1,
                                                                      "overlap": overlap}})
            for overlap in (False, True)}
    for out in runs.values():
        reports = out[0]["reports"]
        assert reports[5]["metrics"]["replicas/state_minority_ranks"] == [1] and reports[5]["synced"]
        assert out[0]["divergence"][5] == 0.0 and reports[6]["metrics"]["replicas/state_distinct"] == 1
    assert runs[True][0]["fingerprint"] == runs[False][0]["fingerprint"]


@pytest.mark.parametrize("sync_mode", ["robust", "mean"])
def test_a_split_the_guard_repairs_shortens_dyns_period(tmp_path: Path, sync_mode: str) -> None:
    # With the guard on, its state_mismatch repair comes first and the step's own split
    # check then finds agreement: Dyn never heard of the split. The repair counted as a
    # calm sync (robust) or not at all (mean: the guard's own repairer), and H grew
    # 16 -> 32 -> 64 under repeated faults, where without the guard it shrinks.
    out = run_workers(train_toy, 3, {
        "steps": 14, "monitor": {"fingerprint_every": 1}, "run_dir": str(tmp_path),
        "protect": {"mode": "dyn", "sync_mode": sync_mode, "sync_period": 16, "h_min": 2, "h_max": 64},
        "guard": {"enabled": True, "warmup": 2},
        "inject": ["bitflip:site=params,steps=4+8+12,ranks=2,bits=0"],
    })
    events = read_jsonl(tmp_path / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "dyn_trigger"] == [4, 8, 12]
    # Each split is repaired once, and the scheduler heard of it (no second sync at once):
    # a robust PAFT-Sync repairs with its own sync, mean mode with the guard's repairer.
    fixes = [(e["step"], e["event"]) for e in events if e["event"] in ("sync", "repair") and e["step"] in (4, 8, 12)]
    assert fixes == [(s, "sync" if sync_mode == "robust" else "repair") for s in (4, 8, 12)], fixes
    periods = [e["period"] for e in events if "period" in e]
    assert periods[0] == 8 and min(periods) == 2 and periods == sorted(periods, reverse=True), periods
    assert len({o["fingerprint"] for o in out}) == 1


@pytest.mark.parametrize("init_std", [0.0, 1e-3])
def test_guard_trains_a_zero_or_small_initialised_model_like_ddp(init_std: float) -> None:
    # The first updates of such a model exceed its weights (from zeros: no ratio at all).
    # The cap on the update ratio rolled every step back, the recompute reproduced it,
    # and the batch was skipped as data: the model never left its initialisation.
    opts = {"steps": 8, "init_std": init_std}
    plain = run_workers(train_toy, 2, {**opts, "plain": True})
    guarded = run_workers(train_toy, 2, {**opts, "guard": {"enabled": True}})
    assert [r["applied"] for r in guarded[0]["reports"]] == [True] * 8
    assert guarded[0]["counters"]["detections"] == 0
    for a, b in zip(plain, guarded):
        assert same(a, b)


def test_guard_skip_while_an_overlapped_sync_is_in_flight() -> None:
    # Step 1's sync is in flight when step 2's batch (NaN on rank 1) is skipped.
    out = run_workers(train_toy, 2, {
        "steps": 5, "guard": {"enabled": True, "warmup": 3}, "nan_input_at": [1, 2],
        "protect": {"mode": "sync", "sync_period": 1, "overlap": True},
    })
    assert [r["applied"] for r in out[0]["reports"]] == [True, True, False, True, True]
    assert out[0]["counters"]["syncs"] == 4  # due after steps 1, 2 (the skipped one), 3, 4
    assert out[0]["fingerprint"] == out[1]["fingerprint"]


def test_overlapped_and_blocking_sync_agree() -> None:
    # the last sync is due after step 16; close() finishes the overlapped one
    opts = {"steps": 17, "inject": FAULTY, "protect": {"mode": "sync", "sync_period": 4}}
    overlapped = run_workers(train_toy, 3, opts)
    blocking = run_workers(train_toy, 3, {**opts, "protect": {"mode": "sync", "sync_period": 4, "overlap": False}})
    assert len({o["fingerprint"] for o in overlapped}) == 1
    assert len({o["fingerprint"] for o in blocking}) == 1
    assert overlapped[0]["counters"]["syncs"] == blocking[0]["counters"]["syncs"] == 4
    assert max(overlapped[0]["divergence"]) <= 2 * max(blocking[0]["divergence"])


def misuse(rank: int, world_size: int) -> dict[str, str]:
    """Each misuse on fresh DDP models; what protect() or the step raised ("" if nothing)."""
    def fresh() -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
        model = DistributedDataParallel(toy_model())
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    def wrapped(module: nn.Module) -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
        model = DistributedDataParallel(module)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    def mixed() -> tuple[DistributedDataParallel, torch.optim.Optimizer]:  # float64 beside float32
        return wrapped(nn.Sequential(nn.Linear(2, 2).double(), nn.Linear(2, 1)))

    x, y = batch(rank, 0)

    def forward_only(model: DistributedDataParallel) -> Any:
        return lambda: nn.functional.mse_loss(model(x), y)  # no backward()

    def stale(model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> None:
        protector = protect(model, optimizer)
        protector.step(toy_closure(model, optimizer, rank, 0))
        protector.step(forward_only(model))  # the last step's gradients are still there

    def zeroed_only(model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> None:
        protector = protect(model, optimizer)
        protector.step(toy_closure(model, optimizer, rank, 0))

        def closure() -> torch.Tensor:
            optimizer.zero_grad(set_to_none=False)  # bumps the gradients' versions, as backward() would
            return nn.functional.mse_loss(model(x), y)

        protector.step(closure)

    def under_no_sync_only(model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> None:
        def closure() -> torch.Tensor:  # accumulates, but never leaves no_sync(): DDP reduces nothing
            optimizer.zero_grad(set_to_none=True)
            with model.no_sync():
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
            return loss

        protect(model, optimizer).step(closure)

    def load_fails_late(model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> None:
        protector = protect(model, optimizer, guard=GuardConfig(enabled=True))
        protector.step(toy_closure(model, optimizer, rank, 0))
        def kept() -> Any:  # what a half-done load would have changed: the step, the guard's state, the counts
            return protector.step_idx, protector.guard.state_dict(), protector.counters  # type: ignore[union-attr]

        before = kept()
        try:  # passes the up-front checks; fails while loading, after the step and the guard's part
            protector.load_state_dict({**protector.state_dict(), "step": 5, "alerting": "x"})
        except ValueError as err:
            if kept() != before:
                raise RuntimeError("a failed load_state_dict() changed the protector") from err
            raise

    class Spare(nn.Module):  # a parameter the forward never uses, without find_unused_parameters
        def __init__(self) -> None:
            super().__init__()
            self.used, self.spare = toy_model(), nn.Linear(16, 1)

        def forward(self, inputs: torch.Tensor) -> torch.Tensor:
            return self.used(inputs)

    def unused(model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> None:
        protect(model, optimizer).step(toy_closure(model, optimizer, rank, 0))

    def dropped_first(m: DistributedDataParallel, o: torch.optim.Optimizer) -> None:
        gc.disable()  # freed by reference counting alone: no cycle keeps a dropped protector alive
        try:
            protect(m, o, monitor=MonitorConfig(enabled=False))
            protect(m, o, monitor=MonitorConfig(enabled=False))
        finally:
            gc.enable()

    def hooked_then_dropped(m: DistributedDataParallel, o: torch.optim.Optimizer) -> None:
        protect(m, o, inject=["scale:rate=1,ranks=1"])  # dropped at once: its hook stays with DDP
        protect(m, o, monitor=MonitorConfig(enabled=False))

    def corrected(m: DistributedDataParallel, o: torch.optim.Optimizer) -> None:
        try:  # refused before paft's hook is registered: a corrected call still works
            protect(m, o, protect=ProtectConfig(mode="sync", sync_mode="broadcast", broadcast_src=2))
        except ValueError:
            protect(m, o, protect=ProtectConfig(mode="sync", sync_mode="broadcast", broadcast_src=1))

    def changed_since(m: DistributedDataParallel, o: torch.optim.Optimizer) -> None:
        monitor = MonitorConfig()
        monitor.interval = -1  # after construction: its own check never saw it
        protect(m, o, monitor=monitor)

    def zeroed_in_place(m: DistributedDataParallel, o: torch.optim.Optimizer) -> None:
        protector = protect(m, o, monitor=MonitorConfig(enabled=False))
        for _ in range(2):  # the same gradient tensors, written into: a backward all the same
            def closure() -> torch.Tensor:
                o.zero_grad(set_to_none=False)
                loss = nn.functional.mse_loss(m(x), y)
                loss.backward()
                return loss
            protector.step(closure)

    def vector_loss(m: DistributedDataParallel, o: torch.optim.Optimizer) -> None:
        def closure() -> torch.Tensor:
            losses = (m(x) - y).square()
            losses.mean().backward()
            return losses
        protect(m, o).step(closure)

    class Renamed(torch.optim.Adam):  # Adam's hyperparameters, another type
        pass

    def scaled_frozen(m: DistributedDataParallel, o: torch.optim.Optimizer) -> None:
        module = nn.Sequential(nn.Linear(2, 2).requires_grad_(False), nn.Linear(2, 1))
        model = DistributedDataParallel(module)
        trained = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        protect(model, trained, scaler=torch.amp.GradScaler("cpu"))

    def keyword_hook(state: Any, bucket: Any, a: int = 0, b: int = 0) -> Any:  # refused before it is called
        return default_hooks.allreduce_hook(state, bucket)

    def frozen_on_one_rank(m: DistributedDataParallel, o: torch.optim.Optimizer) -> None:
        m.module[0].requires_grad_(rank == 0)  # after wrapping: DDP's own check of the model came before
        protect(m, o)

    cases: dict[str, Any] = {
        "bits beyond the dtype": lambda m, o: protect(m, o, inject=["bitflip:steps=1,bits=40"]),
        "a rank beyond the group": lambda m, o: protect(m, o, inject=["bitflip:steps=1,ranks=5"]),
        "foreign parameters in a later group": lambda m, o: protect(m, torch.optim.SGD(
            [{"params": m.parameters()}, {"params": toy_model().parameters()}], lr=0.1)),
        "a tuple of optimizers": lambda m, o: protect(m, (torch.optim.SGD(list(m.parameters())[:2], lr=0.1),
                                                          torch.optim.Adam(list(m.parameters())[2:]))),
        "sparse EmbeddingBag": lambda m, o: protect(*wrapped(nn.Sequential(nn.EmbeddingBag(10, 4, sparse=True)))),
        "betas per rank": lambda m, o: protect(m, torch.optim.Adam(m.parameters(), betas=(0.9, 0.99 + rank / 200))),
        "hook keywords per rank": lambda m, o: protect(
            m, o, comm_hook=functools.partial(keyword_hook, **({"b": 1} if rank else {"a": 1}))),
        "hook state type per rank": lambda m, o: protect(m, o, comm_hook=default_hooks.allreduce_hook,
                                                         comm_state=[None, dist.group.WORLD][rank]),
        "a layer frozen on one rank": frozen_on_one_rank,
        # DDP compares the ranks' parameter shapes, not their dtypes: it wraps this, its
        # broadcast writing rank 0's float32 bytes into rank 1's float64 parameters.
        "a layer float64 on one rank": lambda m, o: protect(*wrapped(nn.Sequential(
            nn.Linear(2, 1).to([torch.float32, torch.float64][rank])))),
        "local-grad bits beyond one dtype": lambda m, o: protect(
            *mixed(), inject=["bitflip:site=local-grad,steps=1,bits=40"]),
        # At rest a fault picks the tensors it can corrupt (the float64 ones here); a
        # gradient bucket may be a float32 one.
        "bits beyond one dtype, at rest": lambda m, o: protect(
            *mixed(), inject=["bitflip:site=params,steps=1,bits=40"]),
        "bits beyond one dtype, in a bucket": lambda m, o: protect(*mixed(), inject=["bitflip:steps=1,bits=40"]),
        # A frozen layer's weights never reach a gradient bucket (a frozen bfloat16 base
        # model beside a float32 adapter): only the trained dtypes bound a bucket fault.
        "bits beyond a frozen layer's dtype, in a bucket": lambda m, o: protect(*wrapped(nn.Sequential(
            nn.Linear(2, 2).requires_grad_(False), nn.Linear(2, 1).double())), inject=["bitflip:steps=1,bits=40"]),
        "random beyond float16": lambda m, o: protect(
            *wrapped(toy_model().half()), inject=["random:steps=1,value=1e6"]),
        "broadcast rank": lambda m, o: protect(m, o, protect=ProtectConfig(
            mode="sync", sync_mode="broadcast", broadcast_src=2)),
        "broadcast rank corrected": corrected,
        "broadcast rank, robust mode": lambda m, o: protect(m, o, protect=ProtectConfig(mode="sync", broadcast_src=3)),
        "lr per rank": lambda m, o: protect(m, torch.optim.SGD(m.parameters(), lr=0.1 * (1 + rank))),
        # a tensor lr was left out of the agreement, and tensor betas compared as their repr (4 digits)
        "tensor lr per rank": lambda m, o: protect(m, torch.optim.Adam(m.parameters(),
                                                                       lr=torch.tensor(0.1 * (1 + rank)))),
        "tensor betas per rank": lambda m, o: protect(m, torch.optim.Adam(m.parameters(), betas=(
            torch.tensor(0.9), torch.tensor(0.999 + rank * 1e-6)))),
        "tensor lr alike": lambda m, o: protect(m, torch.optim.Adam(m.parameters(), lr=torch.tensor(0.1))),
        "zero_grad without backward": zeroed_only,
        "foreign optimizer": lambda m, o: protect(m, torch.optim.SGD(toy_model().parameters(), lr=0.1)),
        "lbfgs": lambda m, o: protect(m, torch.optim.LBFGS(m.parameters())),
        "lbfgs in a list": lambda m, o: protect(m, [torch.optim.SGD(list(m.parameters())[:2], lr=0.1),
                                                    torch.optim.LBFGS(list(m.parameters())[2:])]),
        "one parameter in two optimizers": lambda m, o: protect(m, [torch.optim.SGD(m.parameters(), lr=0.1),
                                                                    torch.optim.Adam(list(m.parameters())[:1])]),
        "a list's order per rank": lambda m, o: protect(m, [
            (torch.optim.Adam, torch.optim.SGD)[rank](list(m.parameters())[:2], lr=1e-2),
            (torch.optim.SGD, torch.optim.Adam)[rank](list(m.parameters())[2:], lr=1e-2)]),
        "zero": lambda m, o: protect(m, ZeroRedundancyOptimizer(m.parameters(), torch.optim.Adam)),
        "grad_clip nan": lambda m, o: protect(m, o, grad_clip=float("nan")),
        "grad_clip inf": lambda m, o: protect(m, o, grad_clip=math.inf),
        "grad_clip negative": lambda m, o: protect(m, o, grad_clip=-1.0),
        "grad_clip True": lambda m, o: protect(m, o, grad_clip=True),
        "broadcast rank, dyn": lambda m, o: protect(m, o, protect=ProtectConfig(
            mode="dyn", sync_mode="broadcast", broadcast_src=2)),
        "config changed since": changed_since,
        "closure returns a vector": vector_loss,
        "no backward, unmonitored": lambda m, o: protect(m, o, monitor=MonitorConfig(enabled=False)).step(
            forward_only(m)),
        "zeroed in place, unmonitored": zeroed_in_place,
        "sparse gradients, unmonitored": lambda m, o: protect(
            *wrapped(nn.Sequential(nn.Embedding(10, 4, sparse=True))), monitor=MonitorConfig(enabled=False)),
        "scaler, a frozen parameter left out": scaled_frozen,
        "monitor per rank": lambda m, o: protect(m, o, monitor=MonitorConfig(interval=1 + rank)),
        "guard per rank": lambda m, o: protect(m, o, guard=GuardConfig(enabled=True, window=5 + rank)),
        "grad_clip per rank": lambda m, o: protect(m, o, grad_clip=float(rank)),
        "seed per rank": lambda m, o: protect(m, o, seed=rank),
        "inject per rank": lambda m, o: protect(m, o, inject=[f"bitflip:steps={1 + rank}"]),
        "optimizer type per rank": lambda m, o: protect(m, (torch.optim.Adam, Renamed)[rank](m.parameters(), lr=1e-2)),
        "loss scaler per rank": lambda m, o: protect(m, o, scaler=torch.amp.GradScaler("cpu", init_scale=2.0 ** rank)),
        "inject string": lambda m, o: protect(m, o, inject="bitflip:steps=1"),
        "malformed spec": lambda m, o: protect(m, o, inject=["bitflip:rate=2"]),
        "config dict": lambda m, o: protect(m, o, protect={"mode": "dyn"}),
        "closure returns None": lambda m, o: protect(m, o).step(lambda: None),
        "no backward": lambda m, o: protect(m, o).step(forward_only(m)),
        "no backward after a step": stale,
        "every backward under no_sync": under_no_sync_only,
        "unused parameters": lambda m, o: unused(*wrapped(Spare())),
        # the unwrapped model in the closure: its backward ran, DDP's reducer saw none of it
        "the module called, not DDP": lambda m, o: protect(m, o).step(toy_closure(m.module, o, rank, 0)),
        "protect twice": lambda m, o: (protect(m, o), protect(m, o)),
        "protect again, the first dropped": dropped_first,
        # A dropped protector's hook stays with DDP and went on injecting for an unmonitored one.
        "protect again unhooked, the first's hook left": hooked_then_dropped,
        "sparse gradients": lambda m, o: protect(*wrapped(nn.Sequential(nn.Embedding(10, 4, sparse=True)))),
        "sparse but frozen": lambda m, o: protect(*wrapped(nn.Sequential(
            nn.Embedding(10, 4, sparse=True).requires_grad_(False), nn.Linear(4, 1)))),
        "hook not a function": lambda m, o: protect(m, o, comm_hook="allreduce"),
        "hook of one argument": lambda m, o: protect(m, o, comm_hook=lambda bucket: None),
        # fp16 on one rank, none on the other: buckets of different sizes in the first backward.
        "hook on one rank": lambda m, o: protect(m, o, comm_hook=default_hooks.fp16_compress_hook if rank else None),
        "hook per rank": lambda m, o: protect(m, o, comm_hook=[default_hooks.allreduce_hook,
                                                               default_hooks.fp16_compress_hook][rank]),
        "state without a hook": lambda m, o: protect(m, o, comm_state=object()),
        # a folder where the recorder goes: taken before, then an AttributeError at the first step
        "recorder a path": lambda m, o: protect(m, o, recorder="runs/mine").step(toy_closure(m, o, rank, 0)),
        "own hook registered": lambda m, o: (m.register_comm_hook(None, default_hooks.allreduce_hook),
                                             protect(m, o)),
        # an unmonitored, fault-free protector registers no comm hook: refused all the same
        "protect twice, first unhooked": lambda m, o: (protect(m, o, monitor=MonitorConfig(enabled=False)),
                                                       protect(m, o)),
        "garbage state": lambda m, o: protect(m, o).load_state_dict({}),
        "state of another mode": lambda m, o: protect(m, o).load_state_dict(
            {"step": 3, "counters": {}, "scheduler": {"kind": "FixedScheduler", "period": 5}}),
        "guarded state, no guard": lambda m, o: protect(m, o).load_state_dict(
            protect(*fresh(), guard=GuardConfig(enabled=True)).state_dict()),
        "unguarded state, a guard": lambda m, o: protect(m, o, guard=GuardConfig(enabled=True)).load_state_dict(
            protect(*fresh()).state_dict()),
        "load that fails late": load_fails_late,
        "averager state": lambda m, o: protect(m, o).load_state_dict(
            protect(*fresh(), protect=ProtectConfig(mode="averager")).state_dict()),
        "period per rank": lambda m, o: protect(m, o, protect=ProtectConfig(mode="sync", sync_period=1 + rank)),
        "parameter order per rank": lambda m, o: protect(m, torch.optim.SGD(
            list(m.parameters())[::1 - 2 * rank], lr=0.1)),
    }
    out = {}
    for name, case in cases.items():
        model, optimizer = fresh()
        try:
            case(model, optimizer)
            out[name] = ""
        except (TypeError, ValueError, RuntimeError) as err:
            out[name] = f"{type(err).__name__}: {err}"
    return out


def refused_on_one_rank(rank: int, world_size: int) -> dict[str, str]:
    """Arguments refused on rank 1 only: what protect() raised on each rank."""
    def fresh() -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
        model = DistributedDataParallel(toy_model())
        return model, torch.optim.Adam(model.parameters(), lr=1e-2)

    one = rank == 1
    cases: dict[str, Any] = {
        "bits": lambda m, o: protect(m, o, inject=["bitflip:steps=1,bits=40"] if one else []),
        "guard without monitor": lambda m, o: protect(m, o, guard=GuardConfig(enabled=True),
                                                      monitor=MonitorConfig(enabled=not one)),
        "foreign optimizer": lambda m, o: protect(m, torch.optim.Adam(toy_model().parameters()) if one else o),
        "closure optimizer": lambda m, o: protect(m, torch.optim.LBFGS(m.parameters()) if one else o),
        # a list chained outside the agreement raised on rank 1 alone; the others hung
        "overlapping list": lambda m, o: protect(m, [torch.optim.SGD(list(m.parameters())[:2], lr=0.1),
                                                     torch.optim.Adam(list(m.parameters())[0 if one else 2:])]),
        "own hook": lambda m, o: protect(m if not one else
                                         m.register_comm_hook(None, default_hooks.allreduce_hook) or m, o),
        # and afterwards the ranks still work together: a collective that would hang otherwise
        "then a valid call": lambda m, o: protect(m, o).step(lambda: m(batch(rank, 0)[0]).sum().backward() or
                                                             torch.zeros(())),
    }
    out = {}
    for name, case in cases.items():
        try:
            case(*fresh())
            out[name] = ""
        except (TypeError, ValueError, RuntimeError) as err:
            out[name] = f"{type(err).__name__}: {err}"
    return out


def test_arguments_refused_on_one_rank_raise_on_every_rank() -> None:
    out = run_workers(refused_on_one_rank, 3)
    others = "ValueError: protect(): rank(s) [1] refused their arguments (the error is raised there)"
    own = {
        "bits": "ValueError: protect(): inject 'bitflip:steps=1,bits=40': field 'bits' must be < 32",
        "guard without monitor": "ValueError: protect(): the guard needs the per-step monitor",
        "foreign optimizer": "ValueError: protect(): the optimizer holds 6 parameter(s) that are not the model's",
        "closure optimizer": "TypeError: protect(): LBFGS.step() needs a closure",
        "overlapping list": "ValueError: OptimizerChain: a parameter of shape (64, 16) is held by optimizer 0",
        "own hook": "RuntimeError: protect(): this DDP model already has a comm hook",
    }
    for name, needle in own.items():
        assert out[1][name].startswith(needle), (name, out[1][name])
        assert out[0][name].startswith(others) and out[2][name] == out[0][name], (name, out[0][name])
    assert [o["then a valid call"] for o in out] == ["", "", ""]


def test_misuse_is_refused_up_front_with_the_fix_named() -> None:
    out = run_workers(misuse, 2)
    assert out[0] == out[1]  # every rank raises the same, so none is left waiting in a collective
    # Its first words name both causes: an unused parameter's backward() did run.
    no_gradient = ("RuntimeError: the closure ran no backward(), or its backward() left parameters without a "
                   "gradient (unused parameters: pass find_unused_parameters=True to DistributedDataParallel): DDP "
                   "all-reduced no gradient; call optimizer.zero_grad()")
    expect = {
        "bits beyond the dtype": "ValueError: protect(): inject 'bitflip:steps=1,bits=40': ",
        "a rank beyond the group": "FaultSpecError: protect(): inject 'bitflip:steps=1,ranks=5': field 'ranks' names "
                                   "rank 5 but world_size is 2",
        "foreign parameters in a later group": "ValueError: protect(): the optimizer holds 6 parameter(s) that are "
                                               "not the model's",
        "a tuple of optimizers": "",  # chained as a list is
        "sparse EmbeddingBag": "ValueError: protect(): module '0' makes sparse gradients",
        "betas per rank": "ValueError: protect(): ranks disagree on the optimizer's hyperparameters;",
        "hook keywords per rank": "ValueError: protect(): ranks disagree on the comm hook;",
        "hook state type per rank": "ValueError: protect(): ranks disagree on the comm hook;",
        "a layer frozen on one rank": "ValueError: protect(): ranks disagree on the model's parameter shapes;",
        "a layer float64 on one rank": "ValueError: protect(): ranks disagree on the model's parameter shapes;",
        "bits beyond one dtype, at rest": "",
        "bits beyond a frozen layer's dtype, in a bucket": "",
        "local-grad bits beyond one dtype": "ValueError: protect(): inject 'bitflip:site=local-grad,steps=1,bits=40': "
                                            "field 'bits' must be < 32 for float32",
        "bits beyond one dtype, in a bucket": "ValueError: protect(): inject 'bitflip:steps=1,bits=40': field 'bits' "
                                              "must be < 32 for float32",
        "random beyond float16": "ValueError: protect(): inject 'random:steps=1,value=1000000': field 'value' "
                                 "must be <= 65504 for float16",
        "broadcast rank": "ValueError: protect(): ProtectConfig.broadcast_src must be a rank in [0, 2), got 2",
        "broadcast rank corrected": "",
        "broadcast rank, robust mode": "",  # only broadcast reads it
        "lr per rank": "ValueError: protect(): ranks disagree on the optimizer's hyperparameters",
        "tensor lr per rank": "ValueError: protect(): ranks disagree on the optimizer's hyperparameters;",
        "tensor betas per rank": "ValueError: protect(): ranks disagree on the optimizer's hyperparameters;",
        "tensor lr alike": "",
        "zero_grad without backward": no_gradient,
        "foreign optimizer": "ValueError: protect(): the optimizer holds 6 parameter(s) that are not the model's",
        "lbfgs": "TypeError: protect(): LBFGS.step() needs a closure",
        "lbfgs in a list": "TypeError: protect(): LBFGS.step() needs a closure",
        "one parameter in two optimizers": "ValueError: OptimizerChain: a parameter of shape (64, 16) is held by "
                                           "optimizer 0 (SGD) and optimizer 1 (Adam)",
        "a list's order per rank": "ValueError: protect(): ranks disagree on the optimizer's type, the optimizer's "
                                   "hyperparameters;",
        "zero": "TypeError: protect(): ZeroRedundancyOptimizer is not supported",
        "grad_clip nan": "ValueError: protect(): grad_clip must be a finite number >= 0",
        "grad_clip inf": "ValueError: protect(): grad_clip must be a finite number >= 0 (0: no clipping), got inf",
        "grad_clip negative": "ValueError: protect(): grad_clip must be a finite number >= 0 (0: no clipping), "
                              "got -1.0",
        "grad_clip True": "ValueError: protect(): grad_clip must be a finite number >= 0 (0: no clipping), got True",
        "broadcast rank, dyn": "ValueError: protect(): ProtectConfig.broadcast_src must be a rank in [0, 2), got 2",
        "config changed since": "ValueError: MonitorConfig.interval (--monitor-interval): must be >= 0, got -1",
        "closure returns a vector": "TypeError: the closure must return the loss as a one-element tensor, got a "
                                    "tensor of shape (8, 1)",
        "no backward, unmonitored": "RuntimeError: the closure ran no backward(): no parameter's gradient was "
                                    "created or changed",
        "zeroed in place, unmonitored": "",
        "sparse gradients, unmonitored": "",  # DDP's own reducer takes sparse gradients
        "scaler, a frozen parameter left out": "",
        "monitor per rank": "ValueError: protect(): ranks disagree on the monitor config;",
        "guard per rank": "ValueError: protect(): ranks disagree on the guard config;",
        "grad_clip per rank": "ValueError: protect(): ranks disagree on grad_clip;",
        "seed per rank": "ValueError: protect(): ranks disagree on seed;",
        "inject per rank": "ValueError: protect(): ranks disagree on inject;",
        "optimizer type per rank": "ValueError: protect(): ranks disagree on the optimizer's type;",
        "loss scaler per rank": "ValueError: protect(): ranks disagree on the loss scaler;",
        "inject string": "TypeError: protect(): inject= must be a list of fault specs",
        "malformed spec": "FaultSpecError: protect(): inject 'bitflip:rate=2': field 'rate' must be in [0, 1]",
        "config dict": "TypeError: protect(): protect= must be a ProtectConfig, got dict",
        "closure returns None": "TypeError: the closure must return the loss as a one-element tensor, got NoneType",
        "no backward": no_gradient,
        "no backward after a step": no_gradient,
        "unused parameters": no_gradient,
        "protect twice": "RuntimeError: protect(): this DDP model is already protected by a live Protector",
        "protect twice, first unhooked": "RuntimeError: protect(): this DDP model is already protected",
        "protect again, the first dropped": "",
        "protect again unhooked, the first's hook left": "RuntimeError: protect(): this DDP model already has a "
                                                         "comm hook",
        "sparse gradients": "ValueError: protect(): module '0' makes sparse gradients, which paft's comm hook "
                            "cannot read; build it with sparse=False",
        "sparse but frozen": "",  # no gradient, in no bucket: it trained before the check, it trains now
        "hook not a function": "TypeError: protect(): comm_hook= must be a function (state, bucket) -> future, got str",
        "hook of one argument": "TypeError: protect(): comm_hook= must take two arguments, (state, bucket)",
        "hook on one rank": "ValueError: protect(): ranks disagree on the comm hook;",
        "hook per rank": "ValueError: protect(): ranks disagree on the comm hook;",
        "state without a hook": "ValueError: protect(): comm_state= is the state of comm_hook=, which is not given",
        "recorder a path": "TypeError: protect(): recorder= must be a paft.records.RunRecorder(run_dir, rank), "
                           "got str",
        "own hook registered": "RuntimeError: protect(): this DDP model already has a comm hook (from "
                               "register_comm_hook, or an earlier protector's: DDP keeps it); pass yours to "
                               "protect() as comm_hook=",
        "garbage state":
            "ValueError: Protector.load_state_dict(): not a protector state (missing ['step', 'counters'])",
        "state of another mode": "ValueError: Protector.load_state_dict(): the state has scheduler part and this "
                                 "protector has none",
        "averager state": "ValueError: Protector.load_state_dict(): the state was saved with protect mode "
                          "'averager', this protector has 'none'",
        "guarded state, no guard": "ValueError: Protector.load_state_dict(): the state has guard part and this "
                                   "protector has none",
        "unguarded state, a guard": "ValueError: Protector.load_state_dict(): the state has no guard part and "
                                    "this protector has one",
        "load that fails late": "ValueError: dictionary update sequence",  # and the protector kept its state
        "every backward under no_sync": no_gradient,
        "period per rank": "ValueError: protect(): ranks disagree on the protect config",
        "parameter order per rank": "ValueError: protect(): ranks disagree on the optimizer's parameter order",
    }
    for name, needle in expect.items():  # "": accepted, nothing raised
        assert out[0][name].startswith(needle) and (needle or not out[0][name]), (name, out[0][name])
    assert "call the DDP model, ddp(x), not the module it wraps" in out[0]["the module called, not DDP"]


def _w_unmonitored_hook_and_faults(rank: int, world_size: int) -> dict[str, int]:
    x, y = batch(rank, 0)

    def step(protector: Any, model: DistributedDataParallel) -> None:
        protector.step(lambda: nn.functional.mse_loss(model(x), y).backward() or torch.zeros(()))

    calls = {"n": 0}

    def counting(state: dict[str, int], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        state["n"] += 1
        return default_hooks.allreduce_hook(None, bucket)

    hooked = DistributedDataParallel(toy_model())
    step(protect(hooked, torch.optim.SGD(hooked.parameters(), lr=0.1), monitor=MonitorConfig(enabled=False),
                 comm_hook=counting, comm_state=calls), hooked)
    faulty = DistributedDataParallel(toy_model())
    protector = protect(faulty, torch.optim.SGD(faulty.parameters(), lr=0.1), monitor=MonitorConfig(enabled=False),
                        inject=["scale:rate=1,ranks=1"])
    step(protector, faulty)
    return {"hook calls": calls["n"], "faults": protector.counters["faults_injected"],
            "digests": len(protector.hook.current.agg_terms)}


def test_an_unmonitored_protector_still_calls_the_users_hook_and_injects() -> None:
    # Unmonitored, paft's comm hook is left out only when it has nothing to do: a hook of
    # the user's or a fault spec still needs it.
    out = run_workers(_w_unmonitored_hook_and_faults, 2)
    assert out[0]["hook calls"] >= 1 and out[1]["hook calls"] >= 1
    assert (out[0]["faults"], out[1]["faults"]) == (0, 1)
    # Unmonitored, no one reads the aggregated gradient's digest: none is computed (a
    # pass over every bucket per step for nothing).
    assert out[0]["digests"] == out[1]["digests"] == 0


def _equal(a: Any, b: Any) -> bool:
    """Nested states (tensors among them) equal, bit for bit."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _w_checkpoint_rules(rank: int, world_size: int) -> dict[str, Any]:
    """state_dict / load_state_dict around an overlapped sync, and refused states."""
    model = DistributedDataParallel(toy_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    protector = protect(model, optimizer, protect=ProtectConfig(mode="sync", sync_period=2),
                        guard=GuardConfig(enabled=True))
    closure = toy_closure(model, optimizer, rank, 0)
    for _ in range(3):  # the sync due after step 2 is left in flight
        protector.step(closure)
    out: dict[str, Any] = {}
    for name, call in (("save", protector.state_dict), ("load", lambda: protector.load_state_dict({}))):
        try:
            call()
            out[f"{name} in flight"] = ""
        except RuntimeError as err:
            out[f"{name} in flight"] = str(err)
    protector.close()
    saved = protector.state_dict()
    changed = {**saved, "step": 5, "counters": {key: value + 1 for key, value in saved["counters"].items()},
               "alerting": {"loss_cv": True}, "check_state": True}
    protector.load_state_dict(changed)
    out["restored"] = _equal(protector.state_dict(), changed)
    # Its parts round-trip on their own too, and the checkpoint keeps its on-disk shape.
    for part in (protector.resync, protector.monitor):
        part.load_state_dict(part.state_dict())
    out["parts restored"] = _equal(protector.state_dict(), changed)
    out["keys"] = sorted(changed), sorted(changed["counters"])
    # A checkpoint of an older version: no mode, alert state, repairer, averager or
    # check_state, nor an alert count.
    older = {k: v for k, v in changed.items() if k not in ("mode", "alerting", "repairer", "averager", "check_state")}
    protector.load_state_dict({**older, "counters": {k: v for k, v in changed["counters"].items() if k != "alerts"}})
    out["older"] = protector.state_dict()["counters"]
    protector.load_state_dict(changed)
    refused = {
        "step True": {**saved, "step": True},
        "step negative": {**saved, "step": -1},
        # refused midway through the restore, after the step and the sync counts were set
        "alerts not a number": {**changed, "step": 9, "counters": {**changed["counters"], "alerts": "many"}},
    }
    for name, state in refused.items():
        try:
            protector.load_state_dict(state)
            out[name] = ""
        except ValueError as err:
            out[name] = str(err)
    out["kept"] = _equal(protector.state_dict(), changed)
    protector.step(closure)  # checks the state, as the loaded state asks, once
    protector.close()
    out["check_state after a step"] = protector.state_dict()["check_state"]
    return out


def test_checkpoints_wait_for_close_and_a_refused_state_changes_nothing() -> None:
    out = run_workers(_w_checkpoint_rules, 2)
    assert out[0] == out[1]
    assert out[0]["save in flight"].startswith("Protector.state_dict(): an overlapped sync is in flight; call close()")
    assert out[0]["load in flight"].startswith("Protector.load_state_dict(): an overlapped sync is in flight")
    assert out[0]["restored"] and out[0]["parts restored"]
    assert out[0]["keys"] == (["alerting", "averager", "check_state", "counters", "guard", "mode", "repairer",
                               "scheduler", "step", "sync"], ["alerts", "faults_injected", "sync_bytes", "syncs"])
    assert out[0]["older"] == {**out[0]["older"], "alerts": 0} and out[0]["older"]["syncs"] > 0
    assert out[0]["step True"] == "Protector.load_state_dict(): step must be an int >= 0, got True"
    assert out[0]["step negative"] == "Protector.load_state_dict(): step must be an int >= 0, got -1"
    assert out[0]["alerts not a number"].startswith("invalid literal for int()")
    assert out[0]["kept"]  # all or nothing: the state loaded before the refused one
    assert out[0]["check_state after a step"] is False


def _w_averager_resumed(rank: int, world_size: int) -> bool:
    """Rank 1's weights doubled at step 4 (the averager's period 3 averages them back at
    step 6): resumed at step 4 from a checkpoint, is the run the uninterrupted one?"""
    def run(steps: range, saved: tuple[Any, ...] | None = None) -> tuple[Any, ...]:
        model = DistributedDataParallel(toy_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        protector = protect(model, optimizer, protect=ProtectConfig(mode="averager", sync_period=3),
                            inject=["scale:site=params,steps=4,ranks=1,factor=2"])
        if saved is not None:
            model.module.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            protector.load_state_dict(saved[2])
        for t in steps:
            protector.step(toy_closure(model, optimizer, rank, t))
        return copy.deepcopy((model.module.state_dict(), optimizer.state_dict(), protector.state_dict()))

    full = run(range(7))[0]
    resumed = run(range(4, 7), run(range(4)))[0]
    return all(torch.equal(full[k], resumed[k]) for k in full)


def test_an_averager_resumed_mid_period_averages_at_the_uninterrupted_runs_steps() -> None:
    # PeriodicModelAverager counts its own calls: a resume must move its count to the
    # step, or it averages at step 4 (healing the doubled weights two steps early).
    assert run_workers(_w_averager_resumed, 2) == [True, True]


def _w_subgroup_with_a_stateful_hook(rank: int, world_size: int) -> dict[str, Any]:
    group = dist.new_group([1, 2])  # every rank creates it; rank 0 is outside
    if rank == 0:
        return {}
    model = DistributedDataParallel(toy_model(batchnorm=True), process_group=group)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    calls = {"n": 0}

    def counting(state: dict[str, int], bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        state["n"] += 1  # a stateful hook, as PowerSGD's step counter and error feedback
        return default_hooks.allreduce_hook(group, bucket)

    protector = protect(model, optimizer, comm_hook=counting, comm_state=calls, inject=["bitflip:steps=0-1,bits=0"])
    x, y = batch(rank, 0)

    def closure() -> torch.Tensor:  # draws from the RNG (dropout), moves BatchNorm's statistics
        loss = nn.functional.mse_loss(nn.functional.dropout(model(x), 0.1), y)
        loss.backward()
        return loss

    protector.step(closure)  # a step first: optimizer state for prime() to leave alone
    optimizer.zero_grad(set_to_none=False)

    def now() -> tuple[Any, ...]:
        return ([b.clone() for b in model.module.buffers()], torch.get_rng_state(),
                state_fingerprint(model, optimizer), protector.step_idx, protector.counters["faults_injected"])

    before, hook_calls = now(), calls["n"]
    protector.prime(closure)
    after = now()
    unchanged = (all(torch.equal(a, b) for a, b in zip(before[0], after[0])) and torch.equal(before[1], after[1])
                 and before[2:] == after[2:])
    primed = calls["n"] - hook_calls
    grads = [p.grad for p in model.parameters()]
    protector.step(closure)
    return {"primed": primed, "stepped": calls["n"] > hook_calls, "speaker": protector.recorder.rank,
            "unchanged": unchanged, "grads": grads}


def test_prime_leaves_a_stateful_hook_alone_and_the_group_rank_0_speaks() -> None:
    """prime() called the user's hook on batches whose gradients it throws away (PowerSGD's
    state advanced: the run left plain DDP's); and the default recorder took the global
    rank, so a data-parallel group without global rank 0 said nothing."""
    out = run_workers(_w_subgroup_with_a_stateful_hook, 3)
    for rank in (1, 2):
        assert out[rank]["primed"] == 0 and out[rank]["stepped"]
        # "prime() takes any batch: it changes nothing": RNG, buffers, parameters and
        # optimizer state, the step; no fault injected; the gradients set to None.
        assert out[rank]["unchanged"] and out[rank]["grads"] == [None] * len(out[rank]["grads"])
    assert [out[r]["speaker"] for r in (1, 2)] == [0, 1]  # the group's ranks: global 1 speaks


def test_importing_paft_leaves_torch_distributed_optim_unloaded() -> None:
    # About a second for every command that imports paft (paft --help, paft report, the
    # launcher before it starts the workers); protect() only looks ZeroRedundancyOptimizer up.
    code = ("import sys, paft, paft.cli, paft.launch, paft.train; "
            "print('torch.distributed.optim' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_cuda_model_off_the_current_device_is_refused_under_nccl() -> None:
    # model.to(local_rank) without torch.cuda.set_device: paft's NCCL collectives would
    # all run on cuda:0, and NCCL refuses two ranks on one GPU deep in the first one.
    # No GPU here: a stand-in model whose parameters say where they are.
    from types import SimpleNamespace

    from paft.preflight import _check_cuda_device

    def on(*devices: str) -> Any:
        params = [SimpleNamespace(is_cuda=d.startswith("cuda"), device=torch.device(d)) for d in devices]
        return SimpleNamespace(parameters=lambda: iter(params))

    with pytest.raises(ValueError, match=r"the model is on cuda:1, but this process's current CUDA device is "
                                         r"cuda:0, .* call torch.cuda.set_device\(1\) before init_process_group"):
        _check_cuda_device("cpu:gloo,cuda:nccl", on("cuda:1"), 2, current=lambda: 0)
    _check_cuda_device("nccl", on("cuda:1"), 2, current=lambda: 1)  # set_device(1) was called
    _check_cuda_device("nccl", on("cuda:1"), 1, current=lambda: 0)  # one rank: no GPU shared
    _check_cuda_device("gloo", on("cuda:1"), 2, current=lambda: 0)  # gloo's collectives take CPU tensors
    _check_cuda_device("nccl", on("cpu"), 2, current=lambda: 0)


def test_the_refusal_of_a_model_off_the_current_device_is_gathered_on_the_models_gpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The refusal above travels to every rank through the agreement's gather; gathered
    # on the current device (cuda:0 on every rank without set_device) NCCL failed it
    # with "duplicate GPU" instead. No GPU here: torch's device switch is given a
    # stand-in current device, and the gather says where it would run.
    from types import SimpleNamespace

    from paft import collectives, preflight

    current = [0]

    def exchange(index: int) -> int:
        before, current[0] = current[0], index if index >= 0 else current[0]
        return before

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "_exchange_device", exchange)
    monkeypatch.setattr(torch.cuda, "_maybe_exchange_device", exchange)
    gathered_on: list[torch.device] = []

    def gather_rows(row: torch.Tensor, group: Any = None) -> torch.Tensor:
        gathered_on.append(collectives.collective_device(group))
        return row.reshape(1, -1)

    monkeypatch.setattr(preflight, "gather_rows", gather_rows)
    model = SimpleNamespace(process_group=None,
                            parameters=lambda: iter([SimpleNamespace(is_cuda=True, device=torch.device("cuda:1"))]))
    refusal = ValueError("the model is on cuda:1, but ...")
    for backend, where in (("nccl", "cuda:1"), ("cpu:gloo,cuda:nccl", "cuda:1"), ("gloo", "cpu")):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        with pytest.raises(ValueError) as raised:
            preflight._check_ranks_agree(model, None, refusal)
        assert raised.value is refusal
        assert gathered_on.pop() == torch.device(where), backend
        assert current == [0]  # the current device is back as it was


def test_a_sparse_embedding_is_named_as_the_model_where_it_is_the_root_module() -> None:
    from types import SimpleNamespace

    from paft.preflight import _check_sparse

    with pytest.raises(ValueError, match=r"^protect\(\): the model \(an Embedding with sparse=True\) makes sparse "
                                        r"gradients, which paft's comm hook cannot read"):
        _check_sparse(SimpleNamespace(module=nn.Embedding(10, 4, sparse=True)))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^protect\(\): module '1' makes sparse gradients"):
        inner = nn.Sequential(nn.Linear(1, 1), nn.Embedding(10, 4, sparse=True))
        _check_sparse(SimpleNamespace(module=inner))  # type: ignore[arg-type]


def test_a_model_not_wrapped_in_ddp_is_refused_with_the_fix_named() -> None:
    # Checked first, in one process: without DDP there is no process group to agree over.
    module = nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"^protect\(\) needs a DistributedDataParallel model, got Linear; wrap "
                                        r"the model in DistributedDataParallel\(model\)"):
        protect(module, torch.optim.SGD(module.parameters(), lr=0.1))


def test_step_refuses_a_loss_tensor_in_place_of_the_closure_before_it_starts() -> None:
    with one_rank_group():
        ddp = DistributedDataParallel(nn.Linear(2, 1))
        protector = protect(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
        loss = ddp(torch.ones(1, 2)).sum()
        loss.backward()
        with pytest.raises(TypeError, match=r"^step\(\) takes a closure that runs forward and backward and "
                                            r"returns the loss .*, got Tensor$"):
            protector.step(loss)  # type: ignore[arg-type]
        assert protector.step_idx == 0
        del protector, ddp
        gc.collect()


def test_an_unmonitored_closure_that_zeroes_the_gradients_and_runs_no_backward_is_refused() -> None:
    # After a step, zero_grad() sets each gradient to None: they changed, but no backward
    # ran, and the step had applied nothing while reporting the update applied.
    with one_rank_group():
        ddp = DistributedDataParallel(toy_model())
        optimizer = torch.optim.Adam(ddp.parameters(), lr=1e-2)
        protector = protect(ddp, optimizer, monitor=MonitorConfig(enabled=False))
        protector.step(toy_closure(ddp, optimizer, 0, 0))
        x, y = batch(0, 1)

        def closure(model: DistributedDataParallel = ddp) -> torch.Tensor:
            optimizer.zero_grad()
            return nn.functional.mse_loss(model(x), y)  # no backward()

        with pytest.raises(RuntimeError, match=r"^the closure ran no backward\(\): no parameter's gradient was "
                                               r"created or changed"):
            protector.step(closure)
        assert protector.step_idx == 1
        del protector, ddp, closure
        gc.collect()
