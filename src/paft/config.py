"""The configuration tree of a paft run: one dataclass per concern, validated up front.

Every field has a docstring; every check lives in ``__post_init__`` and raises
``ValueError`` naming the field as both Python and the command line spell it
(``ProtectConfig.target (--dyn-target): must be ...``), so ``paft train`` can refuse
bad input before any worker starts and a library user need not guess the field. The
same tree is built from the command line, from a TOML/YAML/JSON file whose keys mirror
the long option names (``world-size = 4``), or from Python. A field's long option is
its name with dashes unless its ``option`` metadata says otherwise (:func:`long_option`).

Example::

    >>> cfg = TrainConfig(workload="resnet", world_size=2, steps=20)
    >>> cfg.per_rank_batch_size
    32
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import Any

import torch

from paft.dyn import MAX_PERIOD, DynConfig, check_bounds
from paft.records import from_jsonable_float
from paft.values import fits

__all__ = [
    "OPTIMIZERS",
    "PROTECT_MODES",
    "SYNC_MODES",
    "COSINE_MODES",
    "DEVICES",
    "ON_PERSISTENT",
    "long_option",
    "as_options",
    "error_option",
    "MonitorConfig",
    "ProtectConfig",
    "GuardConfig",
    "SECTIONS",
    "TrainConfig",
]

OPTIMIZERS = ("sgd", "momentum", "adam", "adamw", "muon")
PROTECT_MODES = ("none", "sync", "dyn", "averager")
SYNC_MODES = ("robust", "mean", "broadcast")
COSINE_MODES = ("sketch", "exact", "off")
DEVICES = ("auto", "cpu", "cuda")
ON_PERSISTENT = ("repair", "stop")


def _floats_back(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with ``cls``'s float fields read back from :func:`paft.records.jsonable`'s
    strings for non-finite values ("inf", "nan")."""
    for f in dataclasses.fields(cls):
        if isinstance(f.default, float) and f.name in data:
            data[f.name] = from_jsonable_float(data[f.name])
    return data


def _check_types(obj: Any) -> None:
    """Each field with a plain default holds a value of that default's type (an int
    where a float is asked is fine): from Python, ``enabled="no"`` would otherwise
    switch a feature on and ``interval=2.5`` would monitor steps 0, 5, 10..."""
    for f in dataclasses.fields(obj):
        kind = type(f.default)
        if kind not in (bool, int, float, str):
            continue
        value = getattr(obj, f.name)
        if not fits(kind, value):  # the command line and config files are type-checked before this
            raise ValueError(f"{_named(obj, f.name)}: expected {kind.__name__}, got {value!r}")
        if type(value) is not kind and not (kind is float and type(value) is int):
            # numpy's numbers (and Fractions) as Python's own: the tree is written as JSON and
            # checked again by the schedulers, which know only the built-in types.
            setattr(obj, f.name, kind(value))


def _option(name: str) -> dict[str, str]:
    """The metadata of a field whose long option is not its name with dashes."""
    return {"option": name}


def long_option(cls: type, name: str) -> str:
    """The long option (no dashes) of config field ``cls.name``: ``dyn-target`` for
    ``ProtectConfig.target``; the one home of the mapping, which :mod:`paft.options` reads."""
    (f,) = (f for f in dataclasses.fields(cls) if f.name == name)
    return f.metadata.get("option", name.replace("_", "-"))


# A field as a config error names it, the way Python and the command line spell it
# (:func:`_named` writes it; a message starts with it and may name others).
_FIELD = re.compile(r"\b[A-Z]\w*Config\.\w+ \(--([a-z][\w-]*)\)")


def _named(obj: Any, name: str) -> str:
    """Field ``name`` of config ``obj`` as its errors name it: ``ProtectConfig.target (--dyn-target)``."""
    return f"{type(obj).__name__}.{name} (--{long_option(type(obj), name)})"


def as_options(message: str) -> str:
    """``message`` with every field named as the command line knows it alone:
    ``ProtectConfig.target (--dyn-target): ...`` -> ``--dyn-target: ...``. The CLI prints
    config errors so (its user typed options, not dataclass fields)."""
    return _FIELD.sub(r"--\1", message)


def error_option(message: str) -> tuple[str, str] | None:
    """``(long option, what is wrong)`` of a config error's message that starts with the
    field it is about (``ProtectConfig.target (--dyn-target): must be ...``); None for one
    that does not (a bad fault spec)."""
    m = _FIELD.match(message)
    if m is None or not message.startswith(": ", m.end()):
        return None
    return m[1], message[m.end() + 2:]


def _require(ok: bool, obj: Any, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{_named(obj, name)}: {message}")


def _require_choice(obj: Any, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(obj, name)
    _require(value in choices, obj, name, f"must be one of {', '.join(choices)}, got {value!r}")


@dataclass
class MonitorConfig:
    """Worker-consistency diagnostics (loss / grad-norm dispersion, cosine, fingerprints)."""

    enabled: bool = field(default=True, metadata=_option("monitor"))
    """Run the per-step monitor: capture in the comm hook and ONE control collective per
    step. ``--no-monitor`` gives plain DDP (a baseline for benchmarks); the guard and
    PAFT-Dyn's fingerprint trigger need the monitor (``--monitor``)."""
    interval: int = field(default=1, metadata=_option("monitor-interval"))
    """Compute the worker metrics (dispersion, cosine) every this many steps; 0: never,
    only the replica checks that the guard and PAFT-Dyn read (``--monitor-interval``).
    The local losses and the aggregated-gradient checksum, which sees replicas split,
    are exchanged every step regardless (PAFT-Dyn's trigger; a record at every step of a
    split, at its end and at each state fingerprint), with the guard the local gradient
    norms too; the gradient sketch only on metric steps."""
    cosine: str = "sketch"
    """Gradient-direction consistency: ``sketch`` (k floats per rank), ``exact`` (full
    gradients gathered; small models only) or ``off`` (``--cosine``)."""
    sketch_dim: int = 256
    """k, the sketch dimension for ``--cosine sketch`` (``--sketch-dim``)."""
    fingerprint_every: int = 10
    """Fingerprint parameters + optimizer state every this many steps (memory SDC at rest
    shows within that many steps); 0 disables. The aggregated gradient is checksummed
    every step the monitor runs, so aggregation SDC shows at the step it happens. Each state
    fingerprint reads the whole state twice: on CPU about 3% of a default gpt step (3 ms
    of a rank's 94 ms of CPU time), so every step (1) is for tests and small models
    (``--fingerprint-every``)."""
    alert_loss_cv: float = 0.5
    """Alert when the coefficient of variation of the ranks' losses exceeds this
    (``--alert-loss-cv``)."""
    alert_cos_min: float = -0.8
    """Alert when the minimum pairwise gradient cosine falls below this
    (``--alert-cos-min``)."""

    def __post_init__(self) -> None:
        _check_types(self)
        _require(self.interval >= 0, self, "interval", f"must be >= 0, got {self.interval}")
        _require_choice(self, "cosine", COSINE_MODES)
        _require(8 <= self.sketch_dim <= 65536, self, "sketch_dim", f"must be in [8, 65536], got {self.sketch_dim}")
        _require(self.fingerprint_every >= 0, self, "fingerprint_every", f"must be >= 0, got {self.fingerprint_every}")
        # NaN would never fire and never say so; a cosine outside [-1, 1] is a typo.
        _require(self.alert_loss_cv >= 0, self, "alert_loss_cv", f"must be >= 0, got {self.alert_loss_cv}")
        _require(-1 <= self.alert_cos_min <= 1, self, "alert_cos_min", f"must be in [-1, 1], got {self.alert_cos_min}")


@dataclass
class ProtectConfig:
    """PAFT-Sync / PAFT-Dyn re-synchronization of replicas."""

    mode: str = field(default="none", metadata=_option("protect"))
    """``none``, ``sync`` (PAFT-Sync, fixed period), ``dyn`` (PAFT-Dyn, adaptive period) or
    ``averager`` (PyTorch's PeriodicModelAverager at ``--sync-period``: parameters only,
    blocking; the in-tree baseline) (``--protect``)."""
    sync_period: int = 50
    """H, steps between synchronizations for ``sync`` and ``averager``; the initial H
    for ``dyn``, clamped into [--h-min, --h-max] (``--sync-period``). PAFT-Sync syncs
    at steps H, 2H, ...; PyTorch's averager, counting its calls, at steps 0, H, 2H, ...:
    one more over a run."""
    sync_mode: str = "robust"
    """How replicas are merged: ``robust`` (majority copy, else median), ``mean`` or
    ``broadcast`` (``--sync-mode``)."""
    broadcast_src: int = 0
    """Source rank for ``--sync-mode broadcast`` (``--broadcast-src``)."""
    overlap: bool = True
    """Let a sync land behind the next step's compute (``--no-overlap``: blocking). A sync
    that finds the replicas split repairs them at once either way, and one that finds
    them in agreement moves nothing, so both give the same replicas (README: what
    overlaps) (``--overlap``)."""
    # PAFT-Dyn's bounds: defaults and checks are DynConfig's (paft.dyn), their one home.
    h_min: int = DynConfig.h_min
    """Smallest period PAFT-Dyn may choose (``--h-min``)."""
    h_max: int = DynConfig.h_max
    """Largest period PAFT-Dyn may choose (``--h-max``)."""
    target: float = field(default=DynConfig.target, metadata=_option("dyn-target"))
    """PAFT-Dyn divergence target: the parameters' largest relative L2 distance to the
    replica the sync takes (the mean, or the copied replica) (``--dyn-target``)."""

    def __post_init__(self) -> None:
        _check_types(self)
        _require_choice(self, "mode", PROTECT_MODES)
        _require(1 <= self.sync_period <= MAX_PERIOD, self, "sync_period",
                 f"must be in [1, 2**53], got {self.sync_period}")
        _require_choice(self, "sync_mode", SYNC_MODES)
        _require(self.broadcast_src >= 0, self, "broadcast_src", f"must be a rank >= 0, got {self.broadcast_src}")
        check_bounds(self.h_min, self.h_max, self.target, names=(_named(self, "h_min"), _named(self, "h_max"),
                                                                 _named(self, "target")))

    @property
    def first_h(self) -> int:
        """PAFT-Dyn's first period: ``sync_period`` clamped into [h_min, h_max]."""
        return min(max(self.sync_period, self.h_min), self.h_max)

    def dyn_config(self) -> DynConfig:
        """PAFT-Dyn's period rule under these options."""
        return DynConfig(h_init=self.first_h, h_min=self.h_min, h_max=self.h_max, target=self.target)


@dataclass
class GuardConfig:
    """Harmful-update detection, step recomputation and fault attribution (:mod:`paft.guard`)."""

    enabled: bool = field(default=False, metadata=_option("guard"))
    """Turn the guard on (``--guard``)."""
    spike_threshold: float = 10.0
    """Upward spike of the loss (mean of the local losses), the aggregated gradient
    norm or the update ratio: a value above median + threshold * scale of the last
    ``--guard-window`` accepted steps, scale = max(1.4826 * MAD, a floor of |median|:
    5% for the loss, 50% for norms and ratios), and more than 3x the window's largest
    excursion above its median (so heavy-tailed, near-zero losses do not fire). At
    10 a spike is at least +50% loss or 6x grad norm. Half of it marks a near miss,
    for which the guard asks for a pre-step snapshot (``--spike-threshold``)."""
    window: int = field(default=50, metadata=_option("guard-window"))
    """Accepted (clean, applied) steps of history for the robust running statistics;
    per-rank values are pooled over ranks (``--guard-window``)."""
    warmup: int = field(default=20, metadata=_option("guard-warmup"))
    """Accepted steps before the spike and rank-outlier detectors arm; until then
    they fire only on gross jumps (above 1e4 x the largest accepted value, or, with
    3+ ranks, the ranks' median; at the first step, with 2 ranks, the smaller rank's
    value; a single rank's first step has nothing to compare with), and with ``--update-ratio`` the guard asks for a
    snapshot before every update. The non-finite and gradient-mismatch detectors are
    always armed (``--guard-warmup``)."""
    update_ratio: float = 1.0
    """Post-step detector: ||w_new - w_old|| / ||w_old|| (max over ranks) non-finite,
    spiking (the --spike-threshold rule), or, once --guard-warmup positive ratios were
    accepted, above this cap rolls the step back to the pre-step snapshot and
    recomputes it, on steps where the guard asked for a snapshot (see docs/GUARD.md,
    update_ratio); elsewhere the ratio is not measured: it needs the pre-step
    weights. The spike rule compares it with the ratios measured in the last
    --guard-window steps only (none: only this cap). (The first updates of a small or zero initialisation legitimately
    exceed the weights.) A reproduced ratio skips the batch; after --shift-after such
    skips with no batch applied between them, the next is applied. inf: no cap (the
    spike rule stays); 0 disables the detector and the snapshots (``--update-ratio``)."""
    outlier_threshold: float = 20.0
    """Rank outlier: a rank's local loss or local grad norm above the ranks' median by
    more than this times max(1.4826 * MAD, 25% of |median|) AND above the pooled
    history of accepted local values by the same rule; with 2 ranks only the history
    test applies. Ranks see different data, so local losses legitimately differ by
    tens of percent: at 20 a rank needs about 6x its peers (``--outlier-threshold``)."""
    max_reruns_per_step: int = field(default=2, metadata=_option("max-reruns"))
    """Recomputations of one step (pre- and post-step detections together) before
    the guard skips its batch (``--max-reruns``)."""
    max_reruns_per_run: int = field(default=100, metadata=_option("max-reruns-total"))
    """Recomputations over the whole run; once spent, every detection skips its batch
    (``--max-reruns-total``)."""
    shift_after: int = 5
    """After this many batches skipped as data for a spike (finite values that
    reproduce on recomputation; once ``--max-reruns-total`` is spent, a spike in which
    every rank's own values rose alike) with no batch applied between them, the next
    such batch is applied and the spike statistics start over with a warm-up: the
    level itself moved (a learning-rate restart, a harder data phase), and skipping on
    would stall the run. A skip for another reason (a NaN batch) neither counts nor
    resets. 0: skip such batches forever (``--shift-after``)."""
    on_persistent: str = "repair"
    """A rank reproduces a harmful update on recomputation with different values
    (persistent fault): ``repair`` (recompute up to ``--max-reruns``, then skip the
    batch; the replicas stay equal, as the batch is skipped on every rank) or ``stop``
    (exit code 3) (``--on-persistent``)."""

    def __post_init__(self) -> None:
        _check_types(self)
        # inf would make a limit of inf * 0 = NaN on a flat history, which check_update reads as a spike.
        _require(0 < self.spike_threshold < math.inf, self, "spike_threshold",
                 f"must be a finite number > 0, got {self.spike_threshold}")
        _require(5 <= self.window <= 1_000_000, self, "window", f"must be in [5, 1000000], got {self.window}")
        _require(self.warmup >= 0, self, "warmup", f"must be >= 0, got {self.warmup}")
        _require(self.update_ratio >= 0, self, "update_ratio", f"must be >= 0, got {self.update_ratio}")
        _require(0 < self.outlier_threshold < math.inf, self, "outlier_threshold",
                 f"must be a finite number > 0, got {self.outlier_threshold}")
        _require(self.max_reruns_per_step >= 1, self, "max_reruns_per_step",
                 f"must be >= 1, got {self.max_reruns_per_step}")
        _require(self.max_reruns_per_run >= 1, self, "max_reruns_per_run",
                 f"must be >= 1, got {self.max_reruns_per_run}")
        _require(self.shift_after >= 0, self, "shift_after", f"must be >= 0, got {self.shift_after}")
        _require_choice(self, "on_persistent", ON_PERSISTENT)


@dataclass
class TrainConfig:
    """One training run: workload, optimization, logging, faults and defenses."""

    workload: str = "gpt"
    """Model and data: ``gpt`` (GPT-2-style, Tiny Shakespeare), ``llama`` (LLaMA-2-style,
    Tiny Shakespeare) or ``resnet`` (CIFAR-style ResNet, MNIST) (``--workload``)."""
    world_size: int = 4
    """Number of data-parallel workers (``--world-size``)."""
    steps: int = 200
    """Optimizer steps to train (``--steps``)."""
    batch_size: int = 64
    """Global batch size, split evenly across workers (``--batch-size``)."""
    optimizer: str = "adamw"
    """``sgd``, ``momentum`` (SGD, momentum 0.9), ``adam``, ``adamw``, or ``muon`` (gpt
    and llama): Muon for the hidden weight matrices and AdamW for the rest, both at
    ``--lr`` (``--optimizer``)."""
    lr: float = 3e-3
    """Peak learning rate (``--lr``)."""
    weight_decay: float = 0.0
    """Weight decay (``--weight-decay``)."""
    warmup_steps: int = 20
    """Linear learning-rate warm-up steps before the cosine decay (``--warmup-steps``)."""
    min_lr_ratio: float = 0.1
    """The cosine decays towards lr * this, reached at step ``--steps`` (the last step
    trains just above it) (``--min-lr-ratio``)."""
    grad_clip: float = 1.0
    """Clip the aggregated gradient to this global L2 norm; 0 disables (``--grad-clip``)."""
    seed: int = 0
    """Seed for weights, data order, dropout and fault schedules, in [0, 2**32) (``--seed``)."""
    eval_every: int = 50
    """Evaluate on the validation split every this many steps, and at the end
    (``--eval-every``)."""
    eval_batches: int = 8
    """Validation batches of 64 items per evaluation, the same for every replica: split
    among the ranks while the replicas are bitwise equal, evaluated by each rank on its
    own when they differ; more than the split holds evaluates the whole split
    (``--eval-batches``)."""
    log_every: int = 10
    """Console progress line every this many steps (``--log-every``)."""
    checkpoint_every: int = 100
    """Atomic checkpoint every this many steps and at the end; 0: only at the end
    (``--checkpoint-every``)."""
    run_dir: str = ""
    """Where the run writes its files; default ``runs/<workload>-<timestamp>-<pid>``
    (``--run-dir``)."""
    resume: bool = False
    """Continue the run in ``--run-dir`` from its latest checkpoint (``--resume``), with
    its saved options; ``--workload``, ``--model``, ``--world-size``, ``--batch-size``,
    ``--optimizer``, ``--seed``, ``--desync-seed``, ``--desync-shuffle``, ``--protect``
    (with its ``--sync-mode``, and under dyn its first ``--sync-period``) and ``--guard``
    cannot change. A larger ``--steps`` trains on, with the learning-rate schedule
    stretched to the new length from that step on."""
    overwrite: bool = False
    """Delete an existing ``--run-dir`` and start afresh (``--overwrite``); only a
    folder paft wrote (it holds ``config.json``) is ever deleted."""
    device: str = "auto"
    """``auto`` (CUDA if available, else CPU), ``cpu`` or ``cuda`` (``--device``)."""
    model: dict[str, Any] = field(default_factory=dict)
    """Model field overrides, one KEY=VALUE per ``--model`` (repeatable): ``--model
    n_layer=2 --model n_embd=64``. gpt: block_size, n_layer, n_head, n_embd, vocab_size,
    bias; llama: block_size, n_layer, n_head, n_embd, vocab_size, multiple_of, norm_eps,
    rope_theta; resnet: depth, width, num_classes, in_channels (1: MNIST) (dropout: ``--dropout``)
    (``--model``)."""
    dropout: float = 0.0
    """Dropout probability in the transformer workloads (``--dropout``)."""
    desync_shuffle: bool = False
    """Each rank shuffles the data with its own seed instead of one shared permutation
    (``--desync-shuffle``)."""
    desync_seed: bool = False
    """Each rank seeds its torch RNG (dropout, any sampling inside the model) with its
    own seed; the data order is ``--desync-shuffle``'s alone (``--desync-seed``)."""
    inject: list[str] = field(default_factory=list)
    """Fault specs, e.g. ``bitflip:rate=0.01,bits=exponent,ranks=1`` (``--inject``, repeatable)."""
    quiet: bool = False
    """No start-up header and no console progress from the workers (``--quiet``); warnings,
    errors and the final summary still print, and the run directory is written as usual."""
    tensorboard: bool = False
    """Also write TensorBoard scalars to ``<run-dir>/tb`` (``--tensorboard``); needs the
    optional tensorboard package (``pip install 'paft[tensorboard]'``). The machine that
    trains checks for it (:func:`paft.machine.check_machine`), not the config: a saved run's
    config reads on a machine without it."""
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    protect: ProtectConfig = field(default_factory=ProtectConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)

    def __post_init__(self) -> None:
        _check_types(self)
        # Local imports: the fault modules are leaves, and importing config stays cheap.
        from paft.faultspec import parse_specs
        from paft.workloads import MUON_WORKLOADS, WORKLOADS, DataFileError, model_config, train_items

        _require_choice(self, "workload", WORKLOADS)
        _require(isinstance(self.model, dict), self, "model",
                 f"expected a dict of model fields (e.g. {{'n_layer': 2}}), got {self.model!r}")
        try:
            model = model_config(self.workload, self.model)
            items = train_items(self.workload, model)  # block_size decides the LM's items
        except DataFileError:  # the installation's fault, not --model's: its message says so
            raise
        except (ValueError, TypeError) as err:
            raise ValueError(f"{_named(self, 'model')}: {err}") from None
        _require(self.world_size >= 1, self, "world_size", f"must be >= 1, got {self.world_size}")
        _require(self.steps >= 1, self, "steps", f"must be >= 1, got {self.steps}")
        # Every seed paft derives (per rank, per purpose) must stay a valid torch seed.
        _require(0 <= self.seed < 2**32, self, "seed", f"must be in [0, 2**32), got {self.seed}")
        _require(self.batch_size >= 1, self, "batch_size", f"must be >= 1, got {self.batch_size}")
        _require(
            self.batch_size % self.world_size == 0,
            self, "batch_size",
            f"{self.batch_size} cannot be split evenly across --world-size {self.world_size}",
        )
        # A language model's items are block_size-token windows: a huge block_size is the
        # likelier typo, so the message names it.
        unit = f"windows of --model block_size={model.block_size}" if hasattr(model, "block_size") else "items"
        _require(
            self.batch_size <= items,
            self, "batch_size",
            f"{self.batch_size} is more than the {self.workload} training set holds ({items} {unit})",
        )
        _require_choice(self, "optimizer", OPTIMIZERS)
        _require(self.optimizer != "muon" or self.workload in MUON_WORKLOADS, self, "optimizer",
                 f"muon trains hidden weight matrices, which the {self.workload} workload has none of (its "
                 f"layers are 4-D convolutions); use it with {' or '.join(MUON_WORKLOADS)}, or pick adamw")
        # The optimizers take lr as a scalar of the float32 parameters' type: beyond float32
        # it fails in every worker's first step.
        top = torch.finfo(torch.float32).max
        _require(0 < self.lr <= top, self, "lr", f"must be > 0 and <= {top:.6g} (float32), got {self.lr}")
        _require(0 <= self.weight_decay < math.inf, self, "weight_decay",
                 f"must be a finite number >= 0, got {self.weight_decay}")
        _require(self.warmup_steps >= 0, self, "warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        _require(0 <= self.min_lr_ratio <= 1, self, "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        _require(0 <= self.grad_clip < math.inf, self, "grad_clip",
                 f"must be a finite number >= 0 (0 disables), got {self.grad_clip}")
        _require(self.eval_every >= 1, self, "eval_every", f"must be >= 1, got {self.eval_every}")
        _require(self.eval_batches >= 1, self, "eval_batches", f"must be >= 1, got {self.eval_batches}")
        _require(self.log_every >= 1, self, "log_every", f"must be >= 1, got {self.log_every}")
        _require(self.checkpoint_every >= 0, self, "checkpoint_every", f"must be >= 0, got {self.checkpoint_every}")
        _require(not (self.resume and self.overwrite), self, "resume", "cannot be combined with --overwrite")
        _require(not self.resume or bool(self.run_dir), self, "resume", "needs --run-dir, the run to continue")
        _require_choice(self, "device", DEVICES)
        _require(0 <= self.dropout < 1, self, "dropout", f"must be in [0, 1), got {self.dropout}")
        # One home for it: with both, which one wins was a detail of the code.
        _require("dropout" not in self.model, self, "model", "dropout is set with --dropout (e.g. --dropout 0.1), "
                 "not --model")
        _require(
            self.monitor.enabled or not self.guard.enabled,
            self.guard, "enabled",
            "needs the per-step monitor; drop --no-monitor",
        )
        _require(
            self.protect.sync_mode != "broadcast" or 0 <= self.protect.broadcast_src < self.world_size,
            self.protect, "broadcast_src",
            f"must be a rank in [0, {self.world_size}), got {self.protect.broadcast_src}",
        )
        # Named so here, the FaultSpecError messages name the field, its option and the bad spec's field.
        inject = _named(self, "inject")
        specs = parse_specs(self.inject, option=inject)
        for text, spec in zip(self.inject, specs):  # the workloads train in float32
            try:
                spec.check_ranks(self.world_size, _named(self, "world_size"))
                spec.check_dtype(torch.float32)
            except ValueError as err:
                raise ValueError(f"{inject} {text!r}: {err}") from None

    @property
    def per_rank_batch_size(self) -> int:
        return self.batch_size // self.world_size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def check_keys(cls, data: dict[str, Any]) -> None:
        """Raise ``ValueError`` naming the keys of a :meth:`to_dict`-shaped mapping (a
        run's ``config.json``) that no field holds, a section's dotted (``guard.windw``)."""
        unknown = [str(k) for k in data if k not in _field_names(cls)]
        for key, section in SECTIONS.items():
            if isinstance(data.get(key), dict):
                unknown += [f"{key}.{k}" for k in data[key] if k not in _field_names(section)]
        if unknown:
            raise ValueError(f"unknown option(s) {', '.join(map(repr, unknown))} (from another paft version, "
                             "or edited by hand)")

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Rebuild from :meth:`to_dict` output, also as read back from ``config.json``
        (where ``records.jsonable`` wrote non-finite floats as "inf" / "nan")."""
        cls.check_keys(data)
        data = _floats_back(cls, dict(data))
        for key, section in SECTIONS.items():
            if key in data:
                data[key] = section(**_floats_back(section, dict(data[key])))
        return cls(**data)


SECTIONS: dict[str, type] = {"monitor": MonitorConfig, "protect": ProtectConfig, "guard": GuardConfig}
"""TrainConfig's nested config fields, by name, and their configs' types."""


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}
