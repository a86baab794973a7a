"""protect() under the DDP options and model shapes real training loops use.

Each setup -- a DDP option (``static_graph``, ``broadcast_buffers=False``, tiny buckets,
``find_unused_parameters``) or a model shape (tied weights, frozen layers, a branch
used on some steps only, an optimizer that grows a param group mid-run) -- changes
what DDP's reducer hands paft's comm hook, or which tensors the state holds. So each is
checked, on 2 gloo ranks, for what paft promises of any DDP model:

(b) without faults a monitored run, with PAFT-Sync's scheduled syncs, is plain DDP
    bit for bit (parameters, optimizer state and buffers; under
    ``broadcast_buffers=False``, where plain DDP's ranks keep buffers of their own, a
    sync makes them identical, as PAFT-Sync promises, and the rest is plain DDP's);
(c) after an aggregation fault PAFT-Dyn leaves the replicas bitwise identical;
(d) the guard's recompute of a transient local-gradient fault ends where the
    fault-free run ends, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_reduce
from torch.nn.parallel import DistributedDataParallel

from paft.config import GuardConfig, MonitorConfig, ProtectConfig
from paft.consistency import pairwise_cosine
from paft.protect import protect
from paft.protect_test import batch, toy_model
from paft.state import state_tensors
from paft.testing import run_workers

AGG_FAULT = "bitflip:steps=3,bits=30,ranks=1"
LOCAL_FAULT = "bitflip:site=local-grad,steps=4,bits=30,ranks=1"
VOCAB = 12


class TiedLM(nn.Module):
    """GPT-2's shape in small: the output layer's weight is the embedding's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.out = nn.Linear(16, VOCAB, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.mix(self.embed(tokens))))


class EvenBranch(nn.Module):
    """The toy model plus a head used only on even steps: its parameters get no
    gradient on odd ones."""

    def __init__(self) -> None:
        super().__init__()
        self.body = toy_model()
        self.extra = nn.Linear(16, 1)
        self.use_extra = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return y + self.extra(x) if self.use_extra else y


class CollectiveNorm(nn.Module):
    """SyncBatchNorm's pattern on CPU (torch's own refuses CPU tensors): the forward
    all-reduces the batch statistics over the ranks, differentiably, so the backward
    all-reduces too, and keeps a running mean of the global one. So the guard's
    recompute, which runs the forward again, runs these collectives again."""

    running_mean: torch.Tensor

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("running_mean", torch.zeros(features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ws = dist.get_world_size()
        mean = all_reduce(x.mean(0)) / ws
        var = all_reduce(((x - mean) ** 2).mean(0)) / ws
        with torch.no_grad():
            self.running_mean.mul_(0.9).add_(mean, alpha=0.1)
        return (x - mean) / torch.sqrt(var + 1e-5)


def _build(setup: str, opts: dict[str, Any]) -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
    kwargs: dict[str, Any] = {"bucket_cap_mb": opts.get("bucket_cap_mb", 25)}
    if setup == "static_graph":
        module: nn.Module = toy_model()
        kwargs["static_graph"] = True
    elif setup == "bn_no_broadcast":
        module = toy_model(batchnorm=True)
        kwargs["broadcast_buffers"] = False
    elif setup == "tied":
        module = TiedLM()
    elif setup.startswith("frozen"):
        module = toy_model()
        next(module.children()).requires_grad_(False)
        kwargs["find_unused_parameters"] = setup == "frozen_find_unused"
    elif setup == "even_branch":
        module = EvenBranch()
        kwargs["find_unused_parameters"] = True
    elif setup == "sync_norm":
        first, *rest = toy_model().children()
        module = nn.Sequential(first, CollectiveNorm(64), *rest)
    elif setup == "tiny_buckets":  # each tensor its own bucket, once DDP has rebuilt them
        module = toy_model()
        kwargs["bucket_cap_mb"] = 1e-6
    elif setup in ("toy", "unfreeze"):
        module = toy_model()
    else:
        raise ValueError(setup)
    model = DistributedDataParallel(module, **kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    if setup == "unfreeze":  # the head first; the body joins at step 4, with its own lr
        params = list(model.module[-1].parameters())
    return model, torch.optim.Adam(params, lr=1e-2)


def _closure(setup: str, model: DistributedDataParallel, optimizer: torch.optim.Optimizer, rank: int,
             step: int) -> Callable[[], torch.Tensor]:
    x, y = batch(rank, step)

    def closure() -> torch.Tensor:
        optimizer.zero_grad(set_to_none=True)
        if setup == "tied":
            tokens = (x[:, :4].abs() * 5).long() % VOCAB
            logits = model(tokens)
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens.roll(1, 1).reshape(-1))
        else:
            if setup == "even_branch":
                model.module.use_extra = step % 2 == 0
            loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    return closure


def train_setup(rank: int, world_size: int, setup: str, opts: dict[str, Any]) -> dict[str, Any]:
    """Train ``setup`` for ``steps``: plain DDP (``plain``) or under protect() with ``opts``."""
    model, optimizer = _build(setup, opts)
    protector = None
    if not opts.get("plain"):
        protector = protect(model, optimizer, monitor=MonitorConfig(**opts.get("monitor", {})),
                            protect=ProtectConfig(**opts.get("protect", {})),
                            guard=GuardConfig(**opts.get("guard", {})), inject=opts.get("inject", []), seed=3)
    reports = []
    for step in range(opts.get("steps", 8)):
        if setup == "unfreeze" and step == 4:
            body = [p for layer in list(model.module)[:-1] for p in layer.parameters()]
            optimizer.add_param_group({"params": body, "lr": 3e-3})
        closure = _closure(setup, model, optimizer, rank, step)
        if protector is None:
            closure()
            optimizer.step()
            continue
        if step == 0 and opts.get("prime"):
            protector.prime(closure)
        r = protector.step(closure)
        reports.append({"attempts": r.attempts, "metrics": r.metrics, "synced": r.synced})
    if protector is not None:
        protector.close()
    return {
        "state": [(n, t.detach().clone()) for n, t in state_tensors(model, optimizer, buffers=False)],
        "buffers": [b.detach().clone() for b in model.module.buffers()],
        "reports": reports,
        "buckets": protector.hook.buckets_seen if protector is not None else 0,
    }


def same_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Parameters and optimizer state, names and bits."""
    return [n for n, _ in a["state"]] == [n for n, _ in b["state"]] and all(
        torch.equal(x, y) for (_, x), (_, y) in zip(a["state"], b["state"]))


SETUPS = ["static_graph", "bn_no_broadcast", "sync_norm", "tied", "frozen", "frozen_find_unused", "even_branch",
          "tiny_buckets", "unfreeze"]


@pytest.mark.filterwarnings("ignore:`broadcast_buffers` is deprecated:FutureWarning")
@pytest.mark.parametrize("setup", SETUPS)
def test_a_ddp_setup_is_plain_ddp_without_faults_and_protected_with_them(setup: str) -> None:
    plain = run_workers(train_setup, 2, setup, {"plain": True})
    assert same_state(plain[0], plain[1])
    # Fault-free PAFT-Sync syncs change nothing either, but the buffers DDP leaves apart.
    monitored = run_workers(train_setup, 2, setup, {"protect": {"mode": "sync", "sync_period": 3}})
    assert sum(r["synced"] for r in monitored[0]["reports"]) == 2
    for p, m in zip(plain, monitored):
        assert same_state(p, m)  # (b)
        assert all(torch.equal(a, b) for a, b in zip(p["buffers"], m["buffers"])) == (setup != "bn_no_broadcast")
    if setup == "bn_no_broadcast":  # a run whose last step ends with a sync (step 3) ends with identical buffers
        ended = run_workers(train_setup, 2, setup, {"protect": {"mode": "sync", "sync_period": 3}, "steps": 4})
        assert all(torch.equal(a, b) for a, b in zip(ended[0]["buffers"], ended[1]["buffers"]))
        assert not all(torch.equal(a, b) for a, b in zip(plain[0]["buffers"], plain[1]["buffers"]))
    dyn = run_workers(train_setup, 2, setup, {"inject": [AGG_FAULT], "protect": {"mode": "dyn"}})
    assert dyn[0]["reports"][3]["metrics"]["replicas/grad_distinct"] == 2  # the fault struck
    assert same_state(dyn[0], dyn[1])  # (c)
    guarded = run_workers(train_setup, 2, setup, {"inject": [LOCAL_FAULT], "guard": {"enabled": True, "warmup": 2}})
    assert [r["attempts"] for r in guarded[0]["reports"]] == [1] * 4 + [2] + [1] * 3
    for p, g in zip(plain, guarded):
        assert same_state(p, g)  # (d)
        assert all(torch.equal(a, b) for a, b in zip(p["buffers"], g["buffers"]))


def test_many_small_buckets_give_the_metrics_of_one() -> None:
    """Six buckets (primed: DDP's first pass packs everything into one), the sketch
    cosine on: step 0's metrics are those of the local gradients computed apart, to
    the sketch's documented error, as with one bucket (protect_test's step-0 test)."""
    out = run_workers(train_setup, 3, "tiny_buckets", {"steps": 1, "prime": True, "monitor": {"cosine": "sketch"}})
    one = run_workers(train_setup, 3, "toy", {"steps": 1, "monitor": {"cosine": "sketch"}})
    assert out[0]["buckets"] == 6 and one[0]["buckets"] == 1
    losses, grads = [], []
    for rank in range(3):
        model = toy_model()
        x, y = batch(rank, 0)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None]).double())
    cos, to_mean = pairwise_cosine(torch.stack(grads))
    pairs = [cos[0, 1], cos[0, 2], cos[1, 2]]
    for m in (out[0]["reports"][0]["metrics"], one[0]["reports"][0]["metrics"]):
        assert m["local_losses"] == losses
        assert m["local_grad_norms"] == pytest.approx([float(g.norm()) for g in grads], rel=1e-6)
        assert m["consistency/grad_cos_min"] == pytest.approx(min(pairs), abs=4 / 256**0.5)
        assert m["consistency/cos_to_mean"] == pytest.approx(list(to_mean), abs=4 / 256**0.5)


def add_a_foreign_group(rank: int, world_size: int) -> str:
    model, optimizer = _build("unfreeze", {})
    protector = protect(model, optimizer)
    protector.step(_closure("unfreeze", model, optimizer, rank, 0))
    optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
    with pytest.raises(ValueError, match="add_param_group") as err:
        protector.step(_closure("unfreeze", model, optimizer, rank, 1))
    return str(err.value)


def test_a_group_added_after_protect_must_hold_the_models_parameters() -> None:
    # The unfreeze setup above adds the model's own: its state is fingerprinted and
    # synced from then on. A parameter of no model is neither: refused at the next step.
    (message, _) = run_workers(add_a_foreign_group, 2)
    assert "1 parameter(s) that are not the model's" in message
