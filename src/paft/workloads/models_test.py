"""Tests for the paft workloads: the three models, build_workload, loss and evaluate."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from paft.testing import run_workers
from paft.workloads import (
    DROPOUT_WORKLOADS,
    GPT,
    MUON_WORKLOADS,
    WORKLOADS,
    GPTConfig,
    Llama,
    LlamaConfig,
    ResNet,
    ResNetConfig,
    ShardedSampler,
    Workload,
    build_workload,
    hidden_matrices,
    model_config,
    parameter_count,
)
from paft.workloads.llama import Attention, RMSNorm, apply_rope, rope_tables


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # As in the trainer's workers; also keeps these tests from oversubscribing the two
    # cores when other test processes run alongside.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


PARAM_RANGES = {"gpt": (700_000, 900_000), "llama": (700_000, 900_000), "resnet": (50_000, 120_000)}


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _state_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------- models


@pytest.mark.parametrize("name", WORKLOADS)
def test_forward_shape_and_param_count(name: str) -> None:
    wl = build_workload(name)
    inputs, targets = wl.train.get(torch.arange(3))
    logits = wl.model(inputs)
    if name == "resnet":
        assert inputs.shape == (3, 1, 28, 28) and logits.shape == (3, 10)
    else:
        assert inputs.shape == (3, 64) and logits.shape == (3, 64, 65)
    assert targets.shape == logits.shape[:-1]
    lo, hi = PARAM_RANGES[name]
    assert lo <= _num_params(wl.model) <= hi
    assert wl.model.training


@pytest.mark.parametrize("name", WORKLOADS)
def test_build_is_deterministic_for_a_seed(name: str) -> None:
    rng_before = torch.get_rng_state()
    a = build_workload(name, seed=3).model.state_dict()
    b = build_workload(name, seed=3).model.state_dict()
    c = build_workload(name, seed=4).model.state_dict()
    assert _state_equal(a, b)
    assert not _state_equal(a, c)
    assert torch.equal(torch.get_rng_state(), rng_before)  # build leaves global RNG alone


@pytest.mark.parametrize("seed", [3, 5])
def test_build_initializes_from_the_seed_itself(seed: int) -> None:
    # Exactly the model a CPU generator seeded with ``seed`` builds: a mutant that folded
    # seeds together (seed % 2) kept 3 and 4 apart and survived the test above.
    wl = build_workload("gpt", seed=seed, model_args={"n_layer": 1})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        ref = GPT(wl.config)
    assert _state_equal(wl.model.state_dict(), ref.state_dict())


def test_build_leaves_the_cuda_generators_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # torch.manual_seed also reseeds every CUDA generator, which fork_rng(devices=[])
    # does not restore: a caller's seeded GPU dropout changed after a build.
    seeded: list[int] = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", seeded.append)
    build_workload("gpt", seed=5, model_args={"n_layer": 1})
    assert seeded == []


def test_muon_leaves_tied_matrices_to_adamw_wherever_they_are() -> None:
    # A Linear tied to an embedding is not hidden even when it is not the last one (in
    # the shipped models the tied head is last, so a mutant without this check survived).
    emb, tied, hidden, head = nn.Embedding(5, 4), nn.Linear(4, 5), nn.Linear(4, 4), nn.Linear(4, 3)
    tied.weight = emb.weight
    assert hidden_matrices(nn.Sequential(emb, tied, hidden, head)) == [hidden.weight]


@pytest.mark.parametrize("cls, cfg", [(GPT, GPTConfig()), (Llama, LlamaConfig())])
def test_causal_masking(cls: type, cfg: Any) -> None:
    torch.manual_seed(0)
    model = cls(cfg).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 32))
    changed = idx.clone()
    changed[:, 20] = (changed[:, 20] + 1) % cfg.vocab_size
    with torch.no_grad():
        a, b = model(idx), model(changed)
    assert torch.equal(a[:, :20], b[:, :20])  # the future token cannot leak backwards
    assert not torch.equal(a[:, 20:], b[:, 20:])


@pytest.mark.parametrize("cls, cfg", [
    (GPT, GPTConfig()),
    (GPT, GPTConfig(vocab_size=7, block_size=5, n_layer=3, n_head=3, n_embd=24)),
    (GPT, GPTConfig(n_layer=1, n_head=2, n_embd=10, bias=False)),
    (Llama, LlamaConfig()),
    (Llama, LlamaConfig(vocab_size=7, block_size=5, n_layer=3, n_head=3, n_embd=24, multiple_of=7)),
    (Llama, LlamaConfig(n_layer=1, n_head=1, n_embd=10, multiple_of=1)),
    (ResNet, ResNetConfig()),
    (ResNet, ResNetConfig(depth=14, width=3, num_classes=12, in_channels=3)),
    (ResNet, ResNetConfig(depth=20, width=1)),
])
def test_parameter_count_is_the_models(cls: type, cfg: Any) -> None:
    # Exactly: the memory check counts from the config alone, without building the model.
    assert cfg.parameter_count == _num_params(cls(cfg))


@pytest.mark.parametrize("name, model_args", [
    ("gpt", None), ("gpt", {"n_layer": 2, "n_embd": 48, "n_head": 3, "bias": False, "vocab_size": 70}),
    ("llama", None), ("llama", {"n_layer": 1, "n_embd": 40, "n_head": 2, "multiple_of": 24}),
    ("resnet", None), ("resnet", {"depth": 14, "width": 5, "num_classes": 11}),
])
def test_the_workloads_parameter_count_is_its_models(name: str, model_args: dict[str, Any] | None) -> None:
    assert parameter_count(name, model_args) == _num_params(build_workload(name, model_args=model_args).model)


def test_gpt_ties_and_llama_does_not() -> None:
    gpt = GPT(GPTConfig())
    assert gpt.lm_head.weight is gpt.tok_emb.weight
    llama = Llama(LlamaConfig())
    assert llama.lm_head.weight is not llama.tok_emb.weight


@pytest.mark.parametrize("name", WORKLOADS)
def test_muon_trains_the_hidden_matrices_alone(name: str) -> None:
    # Every block's attention and MLP matrices; no embedding, head, norm or bias. ResNet
    # has none (its one Linear is the head), so --optimizer muon is refused for it.
    model = build_workload(name).model
    hidden = {id(p) for p in hidden_matrices(model)}
    names = sorted(n for n, p in model.named_parameters() if id(p) in hidden)
    blocks = model.blocks if hasattr(model, "blocks") else []
    matrices = sorted(f"blocks.{i}.{n}" for i, b in enumerate(blocks) for n, p in b.named_parameters()
                      if p.dim() == 2)
    assert names == matrices and bool(names) == (name in MUON_WORKLOADS)
    assert all(p.dim() == 2 for p in hidden_matrices(model))


@pytest.mark.parametrize("name", WORKLOADS)
def test_dropout_workloads_are_those_whose_config_takes_dropout(name: str) -> None:
    # Training passes --dropout to these alone, and warns that it is ignored elsewhere.
    assert hasattr(model_config(name), "dropout") == (name in DROPOUT_WORKLOADS)


@pytest.mark.parametrize("cls, cfg, residual", [
    (GPT, GPTConfig(), ("attn.proj", "mlp.proj")),
    (Llama, LlamaConfig(), ("attn.wo", "mlp.w2")),
])
def test_init_scales_residual_projections_by_depth(cls: type, cfg: Any, residual: tuple[str, ...]) -> None:
    # N(0, 0.02) everywhere, 0.02 / sqrt(2 n_layer) on each block's residual output
    # projections, biases zero (mutants that dropped the depth scaling or left torch's
    # uniform biases survived before). 16k+ draws per matrix: the std's own error is ~0.6%.
    torch.manual_seed(0)
    model = cls(cfg)
    resid_std = 0.02 / (2 * cfg.n_layer) ** 0.5
    linears = [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    model.requires_grad_(False)
    assert len(linears) > 4 * cfg.n_layer
    for name, m in linears:
        want = resid_std if name.endswith(residual) else 0.02
        assert abs(float(m.weight.std()) / want - 1) < 0.05, (name, float(m.weight.std()), want)
        assert abs(float(m.weight.mean())) < want / 10, name
        if isinstance(m, nn.Linear) and m.bias is not None:
            assert not m.bias.any(), name


@pytest.mark.parametrize("cls, cfg", [
    (GPT, GPTConfig(n_layer=2, dropout=0.5)),
    (Llama, LlamaConfig(n_layer=2, dropout=0.5)),
])
def test_dropout_trains_and_stays_off_in_eval(cls: type, cfg: Any) -> None:
    # In eval() the model is the dropout-free one with the same weights, bit for bit
    # (mutants that kept attention dropout on in eval survived before); in train() it drops.
    torch.manual_seed(0)
    model = cls(cfg)
    plain = cls(dataclasses.replace(cfg, dropout=0.0))
    plain.load_state_dict(model.state_dict())
    idx = torch.randint(0, cfg.vocab_size, (2, 16))
    with torch.no_grad():
        reference = plain.eval()(idx)
        assert torch.equal(model.eval()(idx), reference)
        assert not torch.equal(model.train()(idx), reference)


def test_rope_tables_are_the_rotary_angles() -> None:
    # Row t, column i: the angle t * theta^(-2i/d), the same for dimension i + d/2 (its
    # rotation partner in apply_rope's rotate-half form).
    cos, sin = rope_tables(8, 5, 100.0)
    t = torch.arange(5, dtype=torch.float64).unsqueeze(1)
    inv_freq = 100.0 ** (-torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    angles = (t * inv_freq).repeat(1, 2)
    assert cos.shape == sin.shape == (5, 8)
    assert torch.allclose(cos.double(), angles.cos(), atol=1e-6)
    assert torch.allclose(sin.double(), angles.sin(), atol=1e-6)


def test_rope_attention_sees_relative_positions_only() -> None:
    # Queries and keys both rotated: the attention output is the same wherever the
    # sequence sits (positions 0.. or 40..), up to rounding. A mutant that rotated the
    # queries alone, or paired dimension i with a different angle than i + d/2, survived.
    cfg = LlamaConfig(n_layer=1, n_head=2, n_embd=16, block_size=48)
    torch.manual_seed(0)
    attn = Attention(cfg).eval()
    cos, sin = rope_tables(cfg.n_embd // cfg.n_head, cfg.block_size, cfg.rope_theta)
    x = torch.randn(2, 8, cfg.n_embd)
    with torch.no_grad():
        at_start, later = attn(x, cos[:8], sin[:8]), attn(x, cos[40:], sin[40:])
    assert torch.allclose(at_start, later, atol=1e-5), (at_start - later).abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_llama_runs_in_a_lower_precision(dtype: torch.dtype) -> None:
    # A model cast to bfloat16 or float16 (model.to(dtype)): the rotation runs in the
    # float32 tables' precision and returns the input's dtype, as LLaMA's type_as does.
    # Left in float32, the rotated queries and keys met bfloat16 values in the attention,
    # which refused them ("Expected query, key, and value to have the same dtype").
    cfg = LlamaConfig(n_layer=1, n_head=2, n_embd=16, block_size=8)
    torch.manual_seed(0)
    model = Llama(cfg).to(dtype)
    logits = model(torch.randint(0, cfg.vocab_size, (2, 8)))
    assert logits.dtype == dtype and bool(logits.isfinite().all())
    cos, sin = rope_tables(cfg.n_embd // cfg.n_head, cfg.block_size, cfg.rope_theta)
    x = torch.randn(2, 2, 8, 8).to(dtype)
    assert torch.equal(apply_rope(x, cos, sin), apply_rope(x.float(), cos, sin).to(dtype))


def test_rmsnorm_normalizes_in_float32_whatever_the_models_dtype() -> None:
    # LLaMA's _norm(x.float()).type_as(x) * weight: in float16, 300 squared is inf, and the
    # row normalized in its own dtype came out all 0 (the rms of every row then read inf).
    norm = RMSNorm(4, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.5, 0.5, 2.0, 1.0]))
        x = torch.tensor([[300.0, 1.0, -2.0, 0.5], [1e-3, 2e-3, -1e-3, 5e-4]])
        want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        for dtype in (torch.float16, torch.bfloat16):
            low = norm.to(dtype)(x.to(dtype))
            assert low.dtype == dtype
            assert torch.equal(low, want.to(dtype) * norm.weight), (dtype, low)
        # float32 is the formula's bits, unchanged; float64 is not narrowed to float32.
        assert torch.equal(norm.float()(x), want * norm.weight)
        wide = x.double()
        assert torch.equal(norm.double()(wide),
                           wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight)


def test_llama_has_no_biases_and_no_buffers() -> None:
    # The RoPE tables are no buffers: as buffers DDP broadcast them before every forward,
    # and rank 0's corrupted table became every rank's unseen.
    model = Llama(LlamaConfig())
    assert not [n for n, _ in model.named_parameters() if "bias" in n]
    assert all(m.bias is None for m in model.modules() if isinstance(m, nn.Linear))
    assert LlamaConfig().ffn_hidden == 352 and LlamaConfig(n_embd=96).ffn_hidden == 256
    assert list(model.named_buffers()) == []


def test_resnet_depth_layout() -> None:
    model = ResNet(ResNetConfig(depth=14, width=8))
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)]
    assert len(convs) + 1 == 14  # 3x3 convs + the classifier
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)


@pytest.mark.parametrize("theta", [1e-50, 1e-44, 1e-40, 1e-38, 1e-30, 1e-3, 1.0, 1e4, 1e38])
def test_rope_theta_is_refused_where_the_rope_tables_are_not_finite(theta: float) -> None:
    """A float32 rope_theta of 0 (1e-50), or one so small that the fastest frequency times
    the last position overflows, made every output NaN from step 0, and was accepted."""
    cfg = LlamaConfig()
    cos, sin = rope_tables(cfg.n_embd // cfg.n_head, cfg.block_size, theta)
    finite = bool(cos.isfinite().all() and sin.isfinite().all())
    if finite:
        LlamaConfig(rope_theta=theta)
    else:
        with pytest.raises(ValueError, match="rope_theta"):
            LlamaConfig(rope_theta=theta)


def test_norm_eps_of_1_and_beyond_is_refused() -> None:
    """norm_eps=1e30 was accepted: RMSNorm then scales every activation by 1e-15, and
    the gradients of most of the blocks' weights are exactly 0 in float32."""
    cfg = LlamaConfig(n_layer=2, n_head=2, n_embd=16, block_size=8)
    cfg.norm_eps = 1e30  # past the check, to show what it let through
    torch.manual_seed(0)
    model = Llama(cfg)
    model(torch.randint(0, cfg.vocab_size, (2, 8))).square().sum().backward()
    dead = [n for n, p in model.named_parameters() if p.grad is not None and not p.grad.any()]
    assert "blocks.0.mlp.w1.weight" in dead, dead
    for eps in (1.0, 1e30, 3e38):
        with pytest.raises(ValueError, match=r"norm_eps must be in \(0, 1\)"):
            LlamaConfig(norm_eps=eps)
    assert LlamaConfig(norm_eps=0.5).norm_eps == 0.5


@pytest.mark.parametrize(
    "cls, kwargs, field",
    [
        (GPTConfig, {"n_head": 3}, "n_embd"),
        (GPTConfig, {"n_layer": 0}, "n_layer"),
        (GPTConfig, {"dropout": 1.0}, "dropout"),
        (LlamaConfig, {"n_head": 128}, "n_head"),
        (LlamaConfig, {"norm_eps": 0.0}, "norm_eps"),
        (LlamaConfig, {"norm_eps": 1e-50}, "norm_eps"),  # 0 in float32
        (LlamaConfig, {"rope_theta": 1e-50}, "rope_theta"),  # see test_rope_theta_is_refused_where...
        (LlamaConfig, {"rope_theta": math.inf}, "rope_theta"),
        (ResNetConfig, {"depth": 10}, "depth"),
        (ResNetConfig, {"width": 0}, "width"),
    ],
)
def test_config_validation_names_the_field(cls: type, kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        cls(**kwargs)


@pytest.mark.parametrize("value", [0, True, 2.0, "2"])
@pytest.mark.parametrize("cls, field", [(GPTConfig, "n_head"), (LlamaConfig, "multiple_of"), (ResNetConfig, "width")])
def test_config_sizes_must_be_positive_ints(cls: type, field: str, value: object) -> None:
    # The three configs share one check (paft.values.require_positive_ints): same words.
    with pytest.raises(ValueError) as err:
        cls(**{field: value})
    assert str(err.value) == f"{field} must be a positive int, got {value!r}"


# ------------------------------------------------------------- build_workload


def test_build_workload_errors() -> None:
    with pytest.raises(ValueError, match="gpt.*llama.*resnet"):
        build_workload("bert")
    with pytest.raises(ValueError, match="n_layers"):
        build_workload("gpt", model_args={"n_layers": 2})
    with pytest.raises(ValueError, match="vocab_size"):
        build_workload("llama", model_args={"vocab_size": 10})
    with pytest.raises(ValueError, match="depth"):
        build_workload("resnet", model_args={"depth": 9})
    # The bounds are the data's, exactly: 65 characters, 10 digit classes.
    assert model_config("gpt", {"vocab_size": 65}).vocab_size == 65
    with pytest.raises(ValueError, match="vocab_size 64 is smaller than the data's 65"):
        model_config("gpt", {"vocab_size": 64})
    assert model_config("resnet", {"num_classes": 10}).num_classes == 10
    with pytest.raises(ValueError, match="num_classes must be >= 10"):
        model_config("resnet", {"num_classes": 9})


def test_model_args_override_config_and_block_size() -> None:
    wl = build_workload("llama", model_args={"n_layer": 1, "block_size": 16})
    assert isinstance(wl.config, LlamaConfig) and wl.config.n_layer == 1
    assert len(wl.model.blocks) == 1
    inputs, targets = wl.train.get(torch.tensor([0]))
    assert inputs.shape == targets.shape == (1, 16)
    assert wl.vocab is not None and len(wl.vocab) == 65
    assert build_workload("resnet", model_args={"width": 8}).model.fc.in_features == 32


# ----------------------------------------------------- loss, training, evaluate


@pytest.mark.parametrize("name", WORKLOADS)
def test_loss_decreases_with_adam(name: str) -> None:
    torch.manual_seed(0)
    wl = build_workload(name, seed=0)
    before = wl.evaluate(wl.model, batch_size=32, max_batches=2)["val_loss"]
    opt = torch.optim.Adam(wl.model.parameters(), lr=3e-3)
    sampler = ShardedSampler(len(wl.train), 0, 1, batch_size=16, seed=0)
    first: list[float] = []
    # ResNet's eval-mode loss lags: its BatchNorm running statistics trail the weights,
    # so after 30 steps its held-out loss had moved by 0.04 to 0.1 depending on the
    # CPU's kernels (a margin a test cannot rest on); after 60 it has halved.
    for _step, idx in zip(range(60 if name == "resnet" else 30), sampler):
        loss = wl.loss(wl.model, *wl.train.get(idx))
        opt.zero_grad()
        loss.backward()
        opt.step()
        first.append(loss.item())
    after = wl.evaluate(wl.model, batch_size=32, max_batches=2)["val_loss"]
    assert after < before - 0.5, (before, after)
    assert sum(first[:5]) / 5 - sum(first[-5:]) / 5 > 0.3, first


def test_evaluate_metrics_mode_and_determinism() -> None:
    for name in WORKLOADS:
        wl = build_workload(name, model_args=None if name == "resnet" else {"n_layer": 1})
        wl.model.train()
        m1 = wl.evaluate(wl.model, batch_size=16, max_batches=2)
        assert wl.model.training  # training mode restored
        wl.model.eval()
        m2 = wl.evaluate(wl.model, batch_size=16, max_batches=2)
        assert not wl.model.training  # eval mode restored too
        assert m1 == m2  # fixed batches, eval mode: bitwise reproducible
        assert set(m1) == ({"val_loss", "val_acc"} if name == "resnet" else {"val_loss"})
        assert wl.has_accuracy == (name == "resnet")
    wl = build_workload("resnet", model_args={"width": 4})
    full = wl.evaluate(wl.model, batch_size=512, max_batches=None)  # 4 batches, last partial
    assert 0.0 <= full["val_acc"] <= 1.0
    # The whole split, its partial last batch included (a mutant that dropped it survived).
    sums = wl.batch_sums(wl.model, batch_size=512, max_batches=None)
    assert sums.shape == (4, 3) and sums[:, 2].tolist() == [512, 512, 512, 464]
    with pytest.raises(ValueError, match="max_batches must be >= 1"):  # it divided by zero
        wl.evaluate(wl.model, batch_size=512, max_batches=0)
    # More batches asked than the split has: the split's 4, not indices past its end.
    assert torch.equal(wl.batch_sums(wl.model, batch_size=512, max_batches=10), sums)
    with pytest.raises(ValueError, match="batch_size must be >= 1"):
        wl.evaluate(wl.model, batch_size=0)


@pytest.mark.parametrize("name", WORKLOADS)
def test_shares_of_the_evaluation_add_up_to_it_bit_for_bit(name: str) -> None:
    wl = build_workload(name, model_args=None if name == "resnet" else {"n_layer": 1})
    whole = wl.batch_sums(wl.model, batch_size=16, max_batches=5)
    shares = [wl.batch_sums(wl.model, batch_size=16, max_batches=5, share=(i, 3)) for i in range(3)]
    for i, share in enumerate(shares):  # each evaluates its own batches, zero elsewhere
        assert all(bool(share[b].any()) == (b % 3 == i) for b in range(5))
    assert torch.equal(shares[0] + shares[1] + shares[2], whole)
    assert wl.summarize(whole) == wl.evaluate(wl.model, batch_size=16, max_batches=5)
    # What evaluate reports, computed here batch by batch.
    wl.model.eval()
    losses = []
    with torch.no_grad():
        for b in range(5):
            inputs, targets = wl.val.get(torch.arange(16 * b, 16 * b + 16))
            logits = wl.model(inputs)
            losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                          reduction="sum").item())
            # The correct predictions are the argmax's (a mutant counting argmin survived).
            assert whole[b, 1] == int((logits.argmax(-1) == targets).sum())
    total = 0.0
    for loss in losses:
        total += loss
    assert wl.summarize(whole)["val_loss"] == total / (5 * whole[0, 2].item())
    for bad in ((3, 3), (-1, 3)):  # a negative index wrote into the last rows
        with pytest.raises(ValueError, match=r"share must be \(i, n\)"):
            wl.batch_sums(wl.model, share=bad)


def _ddp_worker(rank: int, world_size: int, name: str, model_args: dict[str, Any], compiled: bool = False) -> Any:
    torch.manual_seed(100 + rank)  # ranks' global RNGs differ; the build must not care
    wl: Workload = build_workload(name, seed=1, model_args=model_args)
    model = nn.parallel.DistributedDataParallel(wl.model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = ShardedSampler(len(wl.train), rank, world_size, batch_size=4, seed=0)
    for _step, idx in zip(range(3), sampler):
        opt.zero_grad()
        wl.loss(model, *wl.train.get(idx)).backward()
        opt.step()
    # Only rank 0 evaluates: must not issue collectives through the DDP wrapper, nor
    # through torch.compile(ddp), whose forward is DDP's (its buffer broadcast hung).
    evaluated = torch.compile(model, backend="eager") if compiled else model
    metrics = wl.evaluate(evaluated, batch_size=8, max_batches=1) if rank == 0 else None
    dist.barrier()
    # Return numpy (pickled by value): a torch tensor would travel through shared memory
    # whose owner, this worker, may exit before the parent unpickles it.
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return flat.numpy().copy(), metrics


@pytest.mark.parametrize("compiled", [False, True])
def test_loss_and_evaluate_under_ddp(compiled: bool) -> None:
    results = run_workers(_ddp_worker, 2, "resnet", {"width": 4}, compiled, timeout=120)
    (params0, metrics0), (params1, metrics1) = results
    assert torch.equal(torch.from_numpy(params0), torch.from_numpy(params1))
    assert metrics0 is not None and "val_acc" in metrics0 and metrics1 is None


# ------------------------------------------------- the architecture, written out


def _randomized(model: nn.Module) -> nn.Module:
    # Every parameter and buffer drawn at random (norm weights not 1, biases not 0, BatchNorm
    # statistics not 0 and 1), so a dropped or misplaced term changes the output.
    torch.manual_seed(1)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.is_floating_point():
                t.copy_(torch.rand_like(t) + 0.5 if t.dim() == 1 else torch.randn_like(t) * 0.5)
    return model.eval()


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Softmax attention with an explicit lower-triangular mask, ``(B, H, T, d)``."""
    T = q.shape[-2]
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    return scores.softmax(-1) @ v


def _heads(x: torch.Tensor, n_head: int) -> torch.Tensor:
    B, T, C = x.shape
    return x.view(B, T, n_head, C // n_head).transpose(1, 2)


def _merge(y: torch.Tensor) -> torch.Tensor:
    B, H, T, d = y.shape
    return y.transpose(1, 2).reshape(B, T, H * d)


def test_gpt_forward_is_the_documented_pre_norm_decoder() -> None:
    # Learned token + position embeddings, x + attn(ln_1(x)), x + mlp(ln_2(x)) with a GELU
    # MLP, a final LayerNorm and the tied head: mutants that moved the norms after the
    # residual add, dropped ln_f or the position table, swapped q and k, or used ReLU survived.
    cfg = GPTConfig(vocab_size=7, block_size=6, n_layer=2, n_head=2, n_embd=8)
    model = _randomized(GPT(cfg))
    idx = torch.tensor([[1, 4, 0, 6, 2], [3, 3, 5, 1, 0]])
    p = dict(model.named_parameters())
    x = p["tok_emb.weight"][idx] + p["pos_emb.weight"][:5]
    for b in range(cfg.n_layer):
        def w(name: str, _b: int = b) -> tuple[torch.Tensor, torch.Tensor]:
            return p[f"blocks.{_b}.{name}.weight"], p[f"blocks.{_b}.{name}.bias"]
        h = F.layer_norm(x, (8,), *w("ln_1"))
        q, k, v = (_heads(t, 2) for t in F.linear(h, *w("attn.qkv")).split(8, dim=-1))
        x = x + F.linear(_merge(_causal_attention(q, k, v)), *w("attn.proj"))
        h = F.layer_norm(x, (8,), *w("ln_2"))
        x = x + F.linear(F.gelu(F.linear(h, *w("mlp.fc"))), *w("mlp.proj"))
    expected = F.layer_norm(x, (8,), p["ln_f.weight"], p["ln_f.bias"]) @ p["tok_emb.weight"].T
    with torch.no_grad():
        assert torch.allclose(model(idx), expected.detach(), atol=1e-5)


def test_llama_forward_is_the_documented_pre_norm_decoder() -> None:
    # RMSNorm (x / sqrt(mean(x^2) + eps) * weight) before attention and the SwiGLU MLP,
    # rotary embeddings on q and k (pair i with i + d/2, rotated by +t * theta^(-2i/d)),
    # a final RMSNorm and an untied head.
    cfg = LlamaConfig(vocab_size=7, block_size=6, n_layer=2, n_head=2, n_embd=8, multiple_of=4, rope_theta=50.0)
    model = _randomized(Llama(cfg))
    idx = torch.tensor([[1, 4, 0, 6, 2], [3, 3, 5, 1, 0]])
    p = dict(model.named_parameters())

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.norm_eps) * weight

    def rotate(x: torch.Tensor) -> torch.Tensor:  # (B, H, T, 4): pairs (0, 2) and (1, 3)
        angle = torch.arange(5.0).unsqueeze(1) * 50.0 ** (-torch.arange(0, 4, 2) / 4)  # (T, 2)
        z = torch.complex(x[..., :2], x[..., 2:]) * torch.polar(torch.ones_like(angle), angle)
        return torch.cat((z.real, z.imag), dim=-1)

    x = p["tok_emb.weight"][idx]
    for b in range(cfg.n_layer):
        def w(name: str, _b: int = b) -> torch.Tensor:
            return p[f"blocks.{_b}.{name}.weight"]
        h = rms(x, w("attn_norm"))
        q, k, v = (_heads(F.linear(h, w(f"attn.{n}")), 2) for n in ("wq", "wk", "wv"))
        x = x + F.linear(_merge(_causal_attention(rotate(q), rotate(k), v)), w("attn.wo"))
        h = rms(x, w("mlp_norm"))
        x = x + F.linear(F.silu(F.linear(h, w("mlp.w1"))) * F.linear(h, w("mlp.w3")), w("mlp.w2"))
    expected = F.linear(rms(x, p["norm.weight"]), p["lm_head.weight"])
    with torch.no_grad():
        assert torch.allclose(model(idx), expected.detach(), atol=1e-4)


def test_resnet_forward_is_the_documented_network() -> None:
    # relu(bn(stem)), blocks relu(bn2(conv2(relu(bn1(conv1 x)))) + shortcut x) with the
    # stride-2 first block of stages 2 and 3 (28 -> 14 -> 7), global average pooling and
    # the classifier: mutants that never downsampled, strided both convs, put the ReLU
    # before the add or max-pooled survived.
    model = _randomized(ResNet(ResNetConfig(depth=14, width=2)))
    x = torch.randn(2, 1, 28, 28)

    def bn(x: torch.Tensor, m: nn.Module) -> torch.Tensor:
        assert isinstance(m, nn.BatchNorm2d)
        return F.batch_norm(x, m.running_mean, m.running_var, m.weight, m.bias, eps=m.eps)

    y = F.relu(bn(F.conv2d(x, model.stem.weight, padding=1), model.bn))
    sizes = []
    for stage in model.stages:
        for j, block in enumerate(stage):
            stride = 2 if j == 0 and len(sizes) > 0 else 1
            out = F.relu(bn(F.conv2d(y, block.conv1.weight, stride=stride, padding=1), block.bn1))
            out = bn(F.conv2d(out, block.conv2.weight, padding=1), block.bn2)
            if isinstance(block.shortcut, nn.Sequential):
                conv, norm = block.shortcut
                y = bn(F.conv2d(y, conv.weight, stride=stride), norm) + out
            else:
                y = y + out
            y = F.relu(y)
        sizes.append(y.shape[-1])
    assert sizes == [28, 14, 7]
    expected = F.linear(y.mean((2, 3)), model.fc.weight, model.fc.bias)
    with torch.no_grad():
        assert torch.allclose(model(x), expected.detach(), atol=1e-4)


@pytest.mark.parametrize("cls, cfg, residual", [
    (GPT, GPTConfig(n_layer=1, dropout=0.5), ("attn.proj", "mlp.proj")),
    (Llama, LlamaConfig(n_layer=1, dropout=0.5), ("attn.wo", "mlp.w2")),
])
def test_dropout_also_drops_the_embeddings(cls: type, cfg: Any, residual: tuple[str, ...]) -> None:
    # With the residual branches' output projections (and biases) zeroed, only the
    # embedding dropout is left between train() and eval(): a mutant without it survived
    # the dropout test above, where the attention and residual dropouts still differ.
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():
        for name, m in model.named_modules():
            if name.endswith(residual):
                for p in m.parameters():
                    p.zero_()
        idx = torch.randint(0, cfg.vocab_size, (2, 16))
        assert not torch.equal(model.train()(idx), model.eval()(idx))


def test_resnet_convs_are_kaiming_normal_over_fan_out() -> None:
    # std sqrt(2 / (out_channels * k * k)); the convs that change the channel count tell it
    # from fan_in (a fan_in mutant survived).
    model = ResNet(ResNetConfig(width=32))
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d) and m.weight.numel() >= 4096]
    assert any(m.in_channels != m.out_channels for m in convs)
    for m in convs:
        want = (2 / (m.out_channels * m.kernel_size[0] * m.kernel_size[1])) ** 0.5
        std = float(m.weight.detach().std())
        assert abs(std / want - 1) < 0.05, (m, std, want)
