"""Real training workloads for paft: three models on offline data, one interface.

``build_workload(name, seed, model_args)`` returns a :class:`Workload` bundling a
freshly initialized model (identical on every rank that passes the same seed), its
train and val datasets, the loss, and a deterministic evaluation:

* ``"gpt"``    -- GPT-2-style decoder on Tiny Shakespeare characters (:mod:`.gpt`)
* ``"llama"``  -- LLaMA-2-style decoder on the same data (:mod:`.llama`)
* ``"resnet"`` -- CIFAR-style ResNet on MNIST's 10k test set (:mod:`.resnet`)

Typical rank loop::

    wl = build_workload("gpt", seed=0)
    model = DistributedDataParallel(wl.model)
    sampler = ShardedSampler(len(wl.train), rank, world_size, batch_size=16, seed=0)
    for step, idx in zip(range(steps), sampler):
        inputs, targets = wl.train.get(idx)
        wl.loss(model, inputs, targets).backward()
        ...
    metrics = wl.evaluate(model)   # {"val_loss": ...} (+ "val_acc" for resnet)
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paft.values import fits
from paft.workloads.data import (
    ArrayDataset,
    CharVocab,
    DataFileError,
    Dataset,
    ShardedSampler,
    TokenDataset,
    mnist_datasets,
    shakespeare_datasets,
)
from paft.workloads.gpt import GPT, GPTConfig
from paft.workloads.llama import Llama, LlamaConfig
from paft.workloads.resnet import ResNet, ResNetConfig

__all__ = [
    "WORKLOADS",
    "MUON_WORKLOADS",
    "DROPOUT_WORKLOADS",
    "hidden_matrices",
    "Workload",
    "build_workload",
    "model_config",
    "parameter_count",
    "train_items",
    "Dataset",
    "ArrayDataset",
    "TokenDataset",
    "CharVocab",
    "DataFileError",
    "ShardedSampler",
    "GPT",
    "GPTConfig",
    "Llama",
    "LlamaConfig",
    "ResNet",
    "ResNetConfig",
]

WORKLOADS: tuple[str, ...] = ("gpt", "llama", "resnet")


def _without_ddp(model: nn.Module) -> nn.Module:
    # Evaluate on the inner module: a DDP forward may run collectives (buffer
    # broadcast), which would hang if only some ranks evaluate. torch.compile(ddp) is
    # unwrapped first: its forward is DDP's.
    model = getattr(model, "_orig_mod", model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return model.module
    return model


@dataclass
class Workload:
    """A model with its data, loss and evaluation. ``model`` is on CPU, in train mode."""

    name: str
    model: nn.Module
    train: Dataset
    val: Dataset
    has_accuracy: bool
    """True when :meth:`evaluate` also reports ``val_acc`` (classification)."""
    config: Any = None
    """The model's config dataclass (GPTConfig, LlamaConfig or ResNetConfig)."""
    vocab: CharVocab | None = None
    """The character vocabulary of the language-model workloads (None for resnet)."""

    def loss(self, model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of ``model(inputs)``; calls ``model`` itself, so DDP hooks run."""
        logits = model(inputs)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def evaluate(
        self, model: nn.Module, batch_size: int = 64, max_batches: int | None = 20
    ) -> dict[str, float]:
        """Loss (and accuracy) over the first ``max_batches`` val batches, in order.

        Deterministic given the weights: fixed batches, ``eval()`` mode (BatchNorm uses
        running stats, dropout off); the previous training mode is restored. A
        DDP-wrapped model (compiled or not) is unwrapped, so this runs no collectives and
        may be called on a single rank. ``max_batches=None`` covers the whole val split.
        """
        return self.summarize(self.batch_sums(model, batch_size, max_batches))

    @torch.no_grad()
    def batch_sums(
        self, model: nn.Module, batch_size: int = 64, max_batches: int | None = 20, share: tuple[int, int] = (0, 1)
    ) -> torch.Tensor:
        """What :meth:`evaluate` adds up, per val batch: float64 ``[batches, 3]`` rows of
        (summed loss, correct predictions, targets). ``share=(i, n)`` evaluates only the
        batches ``b`` with ``b % n == i`` and leaves the other rows zero, so ``n`` ranks
        holding the same weights can split the work and add their tables up (``x + 0``
        is exact): :meth:`summarize` then gives what one rank evaluating them all would,
        to the bit, since each batch's numbers depend only on the weights and buffers
        (BatchNorm's running statistics, which DDP lets differ between ranks)."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if max_batches is not None and max_batches < 1:
            raise ValueError(f"max_batches must be >= 1 (or None: the whole split), got {max_batches}")
        index, parts = share
        if not 0 <= index < parts:
            raise ValueError(f"share must be (i, n) with 0 <= i < n, got {share}")
        module = _without_ddp(model)
        was_training = module.training
        device = next(module.parameters()).device
        n = len(self.val)
        n_batches = -(-n // batch_size)
        if max_batches is not None:
            n_batches = min(n_batches, max_batches)
        sums = torch.zeros(n_batches, 3, dtype=torch.float64)
        module.eval()
        try:
            for b in range(index, n_batches, parts):
                idx = torch.arange(b * batch_size, min((b + 1) * batch_size, n))
                inputs, targets = self.val.get(idx)
                inputs, targets = inputs.to(device), targets.to(device)
                logits = module(inputs)
                flat_logits = logits.reshape(-1, logits.shape[-1]).float()
                flat_targets = targets.reshape(-1)
                sums[b, 0] = F.cross_entropy(flat_logits, flat_targets, reduction="sum").item()
                sums[b, 1] = int((flat_logits.argmax(-1) == flat_targets).sum())
                sums[b, 2] = flat_targets.numel()
        finally:
            module.train(was_training)
        return sums

    def summarize(self, sums: torch.Tensor) -> dict[str, float]:
        """:meth:`evaluate`'s metrics from :meth:`batch_sums`' table (the losses added in
        batch order, as one float64 each)."""
        loss_sum = 0.0
        for loss in sums[:, 0].tolist():
            loss_sum += loss
        count = int(sums[:, 2].sum())
        out = {"val_loss": loss_sum / count}
        if self.has_accuracy:
            out["val_acc"] = int(sums[:, 1].sum()) / count
        return out


def _make_config(workload: str, cls: type, defaults: dict[str, Any], model_args: dict[str, Any] | None) -> Any:
    """``cls(**defaults, **model_args)`` with each ``--model`` key checked first: an
    unknown key is refused with the nearest valid one, and a value must fit its field's
    type (then converted to it), so a typo or a config file's string is a clear
    ``ValueError`` naming the key rather than a ``TypeError`` or a model built wrong."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    args = dict(model_args or {})
    for key, value in args.items():
        if key not in fields:
            near = difflib.get_close_matches(str(key), fields, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ValueError(f"unknown key {key!r} for the {workload} model{hint}; valid: {', '.join(sorted(fields))}")
        # The type of the field's default is the type asked for (the fields are int,
        # float or bool); an integer is fine where a float is, and so is a YAML 1.1
        # float read as a string ("1e-5"); numpy numbers count as numbers.
        default = fields[key].default
        assert isinstance(default, (bool, int, float)), f"{cls.__name__}.{key}: a model field has a number default"
        kind = type(default)
        want = {bool: "true or false", int: "an integer", float: "a finite number"}.get(kind, kind.__name__)
        if kind is float and isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        ok = fits(kind, value)
        if ok and kind is float:
            try:  # an int beyond float's range overflows
                ok = math.isfinite(value)
            except OverflowError:
                ok = False
        if not ok:
            raise ValueError(f"{key} must be {want}, got {value!r}")
        args[key] = kind(value)
    return cls(**{**defaults, **args})


def model_config(name: str, model_args: dict[str, Any] | None = None) -> Any:
    """The validated model config of workload ``name`` with ``model_args`` applied;
    builds no model (cheap enough to check options before any worker starts)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if name == "resnet":
        config = _make_config(name, ResNetConfig, {}, model_args)
        if config.in_channels != 1:
            raise ValueError(f"in_channels must be 1 (MNIST images have one channel), got {config.in_channels}")
        if config.num_classes < 10:
            raise ValueError(f"num_classes must be >= 10 (MNIST has 10 classes), got {config.num_classes}")
        return config
    vocab_size = len(shakespeare_datasets()[2])
    config = _make_config(name, GPTConfig if name == "gpt" else LlamaConfig, {"vocab_size": vocab_size}, model_args)
    if config.vocab_size < vocab_size:
        raise ValueError(f"vocab_size {config.vocab_size} is smaller than the data's {vocab_size}")
    return config


def train_items(name: str, config: Any) -> int:
    """How many training items workload ``name`` has with model config ``config``
    (the language models cut the text into ``block_size + 1`` windows); cheap after
    the first call. It reads the data, so a missing or damaged data file is a
    :class:`DataFileError` here, before any worker starts, for every workload."""
    if name == "resnet":
        return len(mnist_datasets()[0])
    return len(shakespeare_datasets(config.block_size)[0])


def _model(name: str, config: Any) -> nn.Module:
    if name == "resnet":
        return ResNet(config)
    return GPT(config) if name == "gpt" else Llama(config)


def parameter_count(name: str, model_args: dict[str, Any] | None = None) -> int:
    """Parameters of workload ``name``'s model, counted from its config (its
    ``parameter_count``) without building it: an absurd ``--model`` size is refused
    before any worker starts, in the time its options take to check."""
    return model_config(name, model_args).parameter_count


MUON_WORKLOADS: tuple[str, ...] = ("gpt", "llama")
"""The workloads with hidden weight matrices for ``--optimizer muon``: ResNet's layers
are 4-D convolutions (``torch.optim.Muon`` takes 2-D parameters) and one output head."""

DROPOUT_WORKLOADS: tuple[str, ...] = ("gpt", "llama")
"""The workloads whose model takes ``--dropout`` (a ``dropout`` field in its config):
ResNet has no dropout layers."""


def hidden_matrices(model: nn.Module) -> list[torch.Tensor]:
    """The weights of ``model``'s hidden ``nn.Linear`` layers, which Muon trains: every
    Linear's but the last one's (the output head) and any tied to an embedding.
    Embeddings, the head, norms and biases are left to AdamW, as Muon's authors do."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    return [m.weight for m in linears[:-1] if id(m.weight) not in embedded]


def build_workload(
    name: str, seed: int = 0, model_args: dict[str, Any] | None = None
) -> Workload:
    """Build workload ``name`` with a model initialized deterministically from ``seed``.

    ``model_args`` overrides fields of the model's config (e.g. ``{"n_layer": 2}``);
    for the language models ``block_size`` also sets the dataset's window length.
    The global RNG state is left untouched (initialization runs under ``fork_rng``).
    """
    config = model_config(name, model_args)
    with torch.random.fork_rng(devices=[]):
        # The CPU generator only (what fork_rng restores): torch.manual_seed would also
        # reseed every CUDA generator, for good. The model is built on the CPU.
        torch.default_generator.manual_seed(seed)
        if name in ("gpt", "llama"):
            train, val, vocab = shakespeare_datasets(config.block_size)
            return Workload(name, _model(name, config), train, val, False, config, vocab)
        mtrain, mval = mnist_datasets()
        return Workload(name, _model(name, config), mtrain, mval, True, config, None)
