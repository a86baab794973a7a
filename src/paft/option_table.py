"""The option table: each field of the config tree tied to its ``--long-option``.

:data:`OPTIONS` is read both by the command line's parser (:mod:`paft.options`) and by the
config files' reader (:mod:`paft.config_files`), which name an option the same way:
the config field's long option (:func:`paft.config.long_option`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paft.config import (
    COSINE_MODES,
    DEVICES,
    ON_PERSISTENT,
    OPTIMIZERS,
    PROTECT_MODES,
    SECTIONS,
    SYNC_MODES,
    TrainConfig,
    long_option,
)
from paft.workloads import WORKLOADS

__all__ = ["Option", "OPTIONS", "BY_FLAG", "SECTION_TYPES"]


@dataclass(frozen=True)
class Option:
    """One option: the config field it sets (its section's ``name``) and how its value is typed."""

    section: str | None  # None: a top-level TrainConfig field
    name: str
    kind: Any  # int, float, str, bool, "list", "model"
    choices: tuple[str, ...] | None = None
    metavar: str | None = None

    @property
    def flag(self) -> str:
        """The long option, without its dashes: the config field's (:func:`paft.config.long_option`)."""
        return long_option(SECTION_TYPES[self.section], self.name)


SECTION_TYPES: dict[str | None, type] = {None: TrainConfig}  # an option's section: None is the top level
SECTION_TYPES.update(SECTIONS.items())

OPTIONS: tuple[Option, ...] = (
    Option(None, "workload", str, WORKLOADS),
    Option(None, "world_size", int),
    Option(None, "steps", int),
    Option(None, "batch_size", int),
    Option(None, "optimizer", str, OPTIMIZERS),
    Option(None, "lr", float),
    Option(None, "weight_decay", float),
    Option(None, "warmup_steps", int),
    Option(None, "min_lr_ratio", float),
    Option(None, "grad_clip", float),
    Option(None, "seed", int),
    Option(None, "eval_every", int),
    Option(None, "eval_batches", int),
    Option(None, "log_every", int),
    Option(None, "checkpoint_every", int),
    Option(None, "run_dir", str, metavar="DIR"),
    Option(None, "resume", bool),
    Option(None, "overwrite", bool),
    Option(None, "device", str, DEVICES),
    Option(None, "model", "model", metavar="KEY=VALUE"),
    Option(None, "dropout", float),
    Option(None, "desync_shuffle", bool),
    Option(None, "desync_seed", bool),
    Option(None, "inject", "list", metavar="SPEC"),
    Option(None, "tensorboard", bool),
    Option(None, "quiet", bool),
    Option("monitor", "enabled", bool),
    Option("monitor", "interval", int),
    Option("monitor", "cosine", str, COSINE_MODES),
    Option("monitor", "sketch_dim", int),
    Option("monitor", "fingerprint_every", int),
    Option("monitor", "alert_loss_cv", float),
    Option("monitor", "alert_cos_min", float),
    Option("protect", "mode", str, PROTECT_MODES),
    Option("protect", "sync_period", int),
    Option("protect", "sync_mode", str, SYNC_MODES),
    Option("protect", "broadcast_src", int),
    Option("protect", "overlap", bool),
    Option("protect", "h_min", int),
    Option("protect", "h_max", int),
    Option("protect", "target", float),
    Option("guard", "enabled", bool),
    Option("guard", "spike_threshold", float),
    Option("guard", "window", int),
    Option("guard", "warmup", int),
    Option("guard", "update_ratio", float),
    Option("guard", "outlier_threshold", float),
    Option("guard", "max_reruns_per_step", int),
    Option("guard", "max_reruns_per_run", int),
    Option("guard", "shift_after", int),
    Option("guard", "on_persistent", str, ON_PERSISTENT),
)
BY_FLAG = {opt.flag: opt for opt in OPTIONS}
