"""protect() under the set-ups users wrap their model in: torch.compile, either way round
DDP, activation checkpointing with dropout inside, clipping inside the closure, and an
EMA of the weights gated by ``report.applied``.

One pair of gloo workers runs every case (compiles are slow: dynamo's caches are shared
across cases, and the ranks spawn once); the tests below judge its results. What paft
promises of any DDP model, as in integration_ddp_test.py:

(b) without faults a monitored run is the same set-up without paft, bit for bit;
(c) after an aggregation fault PAFT-Dyn ends where that fault-free run ends;
(d) the guard's recompute of a transient local-gradient fault ends there too, and the
    fault's record names the step, rank and bucket it struck.

A compiled module inside DDP, and ``torch.compile(DDP(model))``, run under dynamo's
DDPOptimizer, which splits the graph at DDP's bucket boundaries; the comm hook must
still see every bucket.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from paft.config import GuardConfig, MonitorConfig, ProtectConfig
from paft.protect import protect
from paft.protect_test import batch, toy_model
from paft.records import RunRecorder
from paft.state import state_tensors
from paft.testing import run_workers, take_step

AGG_FAULT = "bitflip:steps=3,bits=30,ranks=1"
LOCAL_FAULT = "bitflip:site=local-grad,steps=4,bits=30,ranks=1"
STEPS = 7
CLIP = 0.05  # below every step's aggregated norm on the toy model: clipping always acts
EMA_DECAY = 0.9
NAN_STEP = 3  # the EMA case's rank 1 gets a NaN batch here: the guard skips it
# inductor compiles C++ on the CPU; a machine without a compiler runs the other cases.
HAS_CXX = shutil.which("g++") is not None


class KeptFaults(RunRecorder):
    """A quiet recorder that keeps the fault records instead of writing them."""

    def __init__(self, rank: int) -> None:
        super().__init__(None, rank, quiet=True)
        self.kept: list[dict[str, Any]] = []

    def faults(self, records: Any) -> None:
        self.kept.extend(records)


class Wide(nn.Module):
    """Three DDP buckets at ``bucket_cap_mb=1``. DDPOptimizer (dynamo's, for DDP around a
    compiled module too) refuses a bucket cap under its first bucket's, 1 MiB, with an
    ``AssertionError`` from torch, paft or not: so buckets need a model of megabytes.
    A class of the user's, as models are: dynamo does not compile a frame of torch's own
    (``nn.Sequential.forward``) it meets first, so ``torch.compile(DDP(Sequential))``
    would run eagerly."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(),
                                    nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class Small(nn.Module):
    """The toy model in a class of the user's: one bucket, one graph (inductor's C++
    compile is seconds a graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = toy_model()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class CheckpointedDropout(nn.Module):
    """The toy model's middle layer under non-reentrant activation checkpointing, with
    dropout inside: its backward reruns the block, which must draw the same mask."""

    def __init__(self) -> None:
        super().__init__()
        first, act, mid, act2, last = toy_model().children()
        self.first, self.last = nn.Sequential(first, act), last
        self.block = nn.Sequential(mid, nn.Dropout(0.3), act2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = checkpoint(self.block, self.first(x), use_reentrant=False)
        assert isinstance(y, torch.Tensor)
        return self.last(y)


def _build(setup: str, compiler: CompileCounterWithBackend) -> tuple[nn.Module, DistributedDataParallel,
                                                                       torch.optim.Optimizer]:
    """The module the closure calls, the DDP model inside it, the optimizer; a compiled
    one compiles with ``compiler``, which counts the graphs."""
    if setup == "ddp_of_compiled":
        ddp = DistributedDataParallel(torch.compile(Wide(), backend=compiler), bucket_cap_mb=1)
        called: nn.Module = ddp
    elif setup == "compiled_ddp":
        ddp = DistributedDataParallel(Wide(), bucket_cap_mb=1)
        called = torch.compile(ddp, backend=compiler)
    elif setup == "compiled_ddp_inductor":
        ddp = DistributedDataParallel(Small())
        called = torch.compile(ddp, backend=compiler)
    elif setup == "ddp_of_compiled_inductor":
        ddp = DistributedDataParallel(torch.compile(Small(), backend=compiler))
        called = ddp
    elif setup == "checkpoint_compiled":
        ddp = DistributedDataParallel(torch.compile(CheckpointedDropout(), backend=compiler))
        called = ddp
    elif setup == "checkpoint":
        ddp = DistributedDataParallel(CheckpointedDropout())
        called = ddp
    else:  # clip, ema
        ddp = DistributedDataParallel(toy_model())
        called = ddp
    return called, ddp, torch.optim.Adam(ddp.parameters(), lr=1e-2)


def _closure(setup: str, called: nn.Module, ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer,
             rank: int, step: int) -> Callable[[], torch.Tensor]:
    x, y = batch(rank, step)
    if setup == "ema" and step == NAN_STEP and rank == 1:
        x = x.clone()
        x[0, 0] = float("nan")

    def closure() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(called(x), y)
        loss.backward()
        if setup == "clip":
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), CLIP)
        return loss

    return closure


def train(rank: int, setup: str, opts: dict[str, Any]) -> dict[str, Any]:
    """``setup`` for STEPS steps: without paft (``plain``) or under protect() with ``opts``.
    ``skip``: steps the plain run leaves out (no closure, no update)."""
    # A fresh dynamo per case: past its recompile limit (8 frames of one code object:
    # DDP.forward, once per model) dynamo would run the later cases eagerly, unseen.
    torch._dynamo.reset()
    compiler = CompileCounterWithBackend("inductor" if setup.endswith("inductor") else "aot_eager")
    start = time.perf_counter()
    called, ddp, optimizer = _build(setup, compiler)
    recorder = KeptFaults(rank)
    protector = None
    if not opts.get("plain"):
        protector = protect(called, optimizer,
                            monitor=MonitorConfig(), protect=ProtectConfig(**opts.get("protect", {})),
                            guard=GuardConfig(**opts.get("guard", {})), inject=opts.get("inject", []), seed=3,
                            grad_clip=opts.get("grad_clip", 0.0), recorder=recorder)
    ema = [p.detach().clone() for p in ddp.parameters()]
    reports = []
    for step in range(STEPS):
        if protector is None and step in opts.get("skip", ()):
            continue
        r = take_step(protector, optimizer, _closure(setup, called, ddp, optimizer, rank, step))
        if r is not None:
            reports.append({"attempts": r.attempts, "applied": r.applied, "grad_norm": r.grad_norm,
                            "metrics": r.metrics, "buckets": protector.hook.buckets_seen})
        if r is None or r.applied:  # the EMA of the weights, as users keep one: only applied updates count
            with torch.no_grad():
                for e, p in zip(ema, ddp.parameters()):
                    e.lerp_(p, 1 - EMA_DECAY)
    if protector is not None:
        protector.close()
    return {
        "state": [(n, t.detach().clone()) for n, t in state_tensors(ddp, optimizer, buffers=False)],
        "ema": ema,
        "reports": reports,
        "faults": [{k: f[k] for k in ("step", "rank", "site", "target", "attempt")} for f in recorder.kept],
        "seconds": time.perf_counter() - start,
        "graphs": len(compiler.graphs),
    }


MONITORED: dict[str, Any] = {}
DYN = {"inject": [AGG_FAULT], "protect": {"mode": "dyn"}}
GUARDED = {"inject": [LOCAL_FAULT], "guard": {"enabled": True, "warmup": 2}}
CASES: list[tuple[str, str, dict[str, Any]]] = [
    *[(setup, name, opts) for setup in ("ddp_of_compiled", "compiled_ddp")
      for name, opts in (("plain", {"plain": True}), ("monitored", MONITORED), ("dyn", DYN), ("guarded", GUARDED))],
    *[(setup, name, opts) for setup in ("ddp_of_compiled_inductor", "compiled_ddp_inductor")
      for name, opts in (("plain", {"plain": True}), ("guarded", GUARDED)) if HAS_CXX],
    ("checkpoint", "plain", {"plain": True}),
    ("checkpoint", "guarded", GUARDED),
    ("checkpoint_compiled", "plain", {"plain": True}),
    ("checkpoint_compiled", "guarded", GUARDED),
    ("clip", "plain", {"plain": True}),
    ("clip", "monitored", MONITORED),
    ("clip", "guarded", GUARDED),
    ("clip", "guarded_agg", {"inject": [AGG_FAULT], "guard": {"enabled": True, "warmup": 2}}),
    ("toy", "grad_clip", {"grad_clip": CLIP}),
    ("ema", "plain", {"plain": True, "skip": (NAN_STEP,)}),
    ("ema", "guarded", {"guard": {"enabled": True, "warmup": 2}}),
]


def sweep(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    return {f"{setup}/{name}": train(rank, setup, opts) for setup, name, opts in CASES}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, dict[str, Any]]]:
    out = run_workers(sweep, 2)
    for name, result in out[0].items():  # what each case took, compiles included (pytest -s)
        print(f"{name}: {result['seconds']:.1f} s, {result['graphs']} graph(s)")
    return out


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Parameters and optimizer state, names and bits."""
    return [n for n, _ in a["state"]] == [n for n, _ in b["state"]] and all(
        torch.equal(x, y) for (_, x), (_, y) in zip(a["state"], b["state"]))


@pytest.mark.parametrize("setup", ["ddp_of_compiled", "compiled_ddp"])
def test_a_compiled_model_is_protected_either_way_round_ddp(runs: list[dict[str, dict[str, Any]]],
                                                            setup: str) -> None:
    for rank in range(2):
        plain, monitored = runs[rank][f"{setup}/plain"], runs[rank][f"{setup}/monitored"]
        dyn, guarded = runs[rank][f"{setup}/dyn"], runs[rank][f"{setup}/guarded"]
        assert same_state(plain, monitored)  # (b)
        # Every one of DDP's buckets reached paft's hook, at every step (the first
        # backward packs all gradients into one: DDP builds its buckets after it).
        for run in (monitored, dyn, guarded):
            assert [r["buckets"] for r in run["reports"]] == [1] + [3] * (STEPS - 1)
        # Compiled, not run eagerly: DDPOptimizer split the forward into a graph per bucket.
        assert plain["graphs"] == monitored["graphs"] == dyn["graphs"] == guarded["graphs"] == 3
        assert dyn["reports"][3]["metrics"]["replicas/grad_distinct"] == 2  # the fault struck
        assert same_state(plain, dyn)  # (c)
        assert [r["attempts"] for r in guarded["reports"]] == [1] * 4 + [2] + [1] * (STEPS - 5)
        assert same_state(plain, guarded)  # (d)
    # Rank 1's record: the one bucket struck, at step 3 / step 4's first attempt.
    assert runs[0][f"{setup}/dyn"]["faults"] == [] and runs[0][f"{setup}/guarded"]["faults"] == []
    (agg,) = runs[1][f"{setup}/dyn"]["faults"]
    (local,) = runs[1][f"{setup}/guarded"]["faults"]
    assert (agg["step"], agg["rank"], agg["site"], agg["attempt"]) == (3, 1, "aggregation", 0)
    assert (local["step"], local["rank"], local["site"], local["attempt"]) == (4, 1, "local-grad", 0)
    assert 0 <= agg["target"] < 3 and 0 <= local["target"] < 3


@pytest.mark.skipif(not HAS_CXX, reason="inductor needs a C++ compiler (g++) on the CPU")
@pytest.mark.parametrize("setup", ["ddp_of_compiled_inductor", "compiled_ddp_inductor"])
def test_the_inductor_backend_recomputes_to_the_fault_free_run(runs: list[dict[str, dict[str, Any]]],
                                                               setup: str) -> None:
    for rank in range(2):
        plain, guarded = runs[rank][f"{setup}/plain"], runs[rank][f"{setup}/guarded"]
        assert plain["graphs"] == guarded["graphs"] == 1
        assert [r["attempts"] for r in guarded["reports"]] == [1] * 4 + [2] + [1] * (STEPS - 5)
        assert same_state(plain, guarded)


@pytest.mark.parametrize("setup", ["checkpoint", "checkpoint_compiled"])
def test_a_checkpointed_block_with_dropout_recomputes_to_the_fault_free_step(
        runs: list[dict[str, dict[str, Any]]], setup: str) -> None:
    """The guard restores the RNG before its recompute: the rerun draws the first
    attempt's dropout masks, forward and checkpointed backward alike, eager or compiled."""
    for rank in range(2):
        plain, guarded = runs[rank][f"{setup}/plain"], runs[rank][f"{setup}/guarded"]
        assert plain["graphs"] == guarded["graphs"] == (setup == "checkpoint_compiled")
        assert [r["attempts"] for r in guarded["reports"]] == [1] * 4 + [2] + [1] * (STEPS - 5)
        assert same_state(plain, guarded)


def test_clipping_inside_the_closure(runs: list[dict[str, dict[str, Any]]]) -> None:
    """docs/LIBRARY.md, "Clipping inside the closure": paft reads the gradient the
    closure leaves, so the aggregated norm is the clipped one, while the local norms
    (the comm hook's, during backward) are not."""
    for rank in range(2):
        plain, monitored = runs[rank]["clip/plain"], runs[rank]["clip/monitored"]
        guarded, grad_clip = runs[rank]["clip/guarded"], runs[rank]["toy/grad_clip"]
        assert same_state(plain, monitored)
        assert same_state(plain, grad_clip)  # grad_clip= clips as clip_grad_norm_ does
        for step, (inside, outside) in enumerate(zip(monitored["reports"], grad_clip["reports"])):
            assert outside["grad_norm"] > CLIP  # grad_clip= reports the norm before clipping
            assert inside["grad_norm"] == pytest.approx(CLIP, rel=1e-5)  # the closure's clip: after
            if step == 0:  # the worker metrics' step: the local norms, before any clip
                assert inside["metrics"]["local_grad_norms"] == outside["metrics"]["local_grad_norms"]
        # The fault is clipped away from the aggregated norm, but not from rank 1's local
        # norm: the guard still sees the outlier, and recomputes.
        assert [r["attempts"] for r in guarded["reports"]] == [1] * 4 + [2] + [1] * (STEPS - 5)
        assert same_state(plain, guarded)
        # An aggregation fault, clipped on rank 1 alone: the replicas' aggregated
        # gradients still differ (the checksum is taken before the closure's clip).
        split = runs[rank]["clip/guarded_agg"]
        assert [r["attempts"] for r in split["reports"]] == [1] * 3 + [2] + [1] * (STEPS - 4)
        assert same_state(plain, split)


def test_an_ema_gated_by_applied_skips_what_the_guard_skipped(runs: list[dict[str, dict[str, Any]]]) -> None:
    """Rank 1's NaN batch at NAN_STEP: the guard skips the step on every rank; the EMA,
    updated under ``if report.applied``, is that of the run without that batch."""
    for rank in range(2):
        plain, guarded = runs[rank]["ema/plain"], runs[rank]["ema/guarded"]
        assert [r["applied"] for r in guarded["reports"]] == [s != NAN_STEP for s in range(STEPS)]
        assert same_state(plain, guarded)
        assert all(torch.equal(a, b) for a, b in zip(plain["ema"], guarded["ema"]))


def test_a_compiled_model_without_ddp_is_refused_with_the_fix_named() -> None:
    # Refused before any collective: no process group needed.
    model = torch.compile(toy_model(), backend="eager")
    with pytest.raises(TypeError, match=r"got torch.compile of a Sequential; wrap the model in "
                                        r"DistributedDataParallel\(model\)"):
        protect(model, torch.optim.SGD(model.parameters(), lr=0.1))
