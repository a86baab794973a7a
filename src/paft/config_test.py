"""The config tree's errors: each names the field as Python spells it and its option."""

from __future__ import annotations

import argparse
import dataclasses
import math
import pathlib
from collections.abc import Callable

import pytest
import torch

from paft.config import (
    COSINE_MODES,
    DEVICES,
    ON_PERSISTENT,
    OPTIMIZERS,
    PROTECT_MODES,
    SYNC_MODES,
    GuardConfig,
    MonitorConfig,
    ProtectConfig,
    TrainConfig,
    error_option,
    long_option,
)
from paft.options import OPTIONS, add_train_options
from paft.workloads import DataFileError

SECTIONS = {None: TrainConfig, "monitor": MonitorConfig, "protect": ProtectConfig, "guard": GuardConfig}


@pytest.mark.parametrize(
    "build,message",
    [
        # It said "--dyn-target: ...": a library user had to guess that this is the target.
        (lambda: ProtectConfig(target=0), "ProtectConfig.target (--dyn-target): must be a finite number > 0, got 0"),
        (lambda: GuardConfig(max_reruns_per_step=0), "GuardConfig.max_reruns_per_step (--max-reruns): must be >= 1, "
                                                     "got 0"),
        (lambda: ProtectConfig(h_min=10, h_max=8),
         "ProtectConfig.h_max (--h-max): must be >= ProtectConfig.h_min (--h-min) = 10, got 8"),
        (lambda: MonitorConfig(interval=-1), "MonitorConfig.interval (--monitor-interval): must be >= 0, got -1"),
        (lambda: ProtectConfig(mode="dynn"), "ProtectConfig.mode (--protect): must be one of none, sync, dyn, "
                                             "averager, got 'dynn'"),
        # It raised TypeError ("argument of type 'NoneType' is not iterable") from a later check.
        (lambda: TrainConfig(model=None), "TrainConfig.model (--model): expected a dict of model fields "
                                          "(e.g. {'n_layer': 2}), got None"),
        (lambda: TrainConfig(world_size=2, batch_size=3),
         "TrainConfig.batch_size (--batch-size): 3 cannot be split evenly across --world-size 2"),
        (lambda: TrainConfig(workload="resnet", optimizer="muon"),
         "TrainConfig.optimizer (--optimizer): muon trains hidden weight matrices, which the resnet workload has "
         "none of (its layers are 4-D convolutions); use it with gpt or llama, or pick adamw"),
        (lambda: TrainConfig(guard=GuardConfig(enabled=True), monitor=MonitorConfig(enabled=False)),
         "GuardConfig.enabled (--guard): needs the per-step monitor; drop --no-monitor"),
    ],
)
def test_a_value_error_names_the_field_and_its_option(build: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError) as err:
        build()
    assert str(err.value) == message


def test_each_field_is_named_with_the_option_paft_train_takes() -> None:
    """A type error (and so any error) of each field that has an option names it as
    ``Class.field (--option)``, with the option ``paft train`` accepts."""
    parser = argparse.ArgumentParser()
    add_train_options(parser)
    checked = 0
    for opt in OPTIONS:
        cls = SECTIONS[opt.section]
        (f,) = (f for f in dataclasses.fields(cls) if f.name == opt.name)
        if type(f.default) not in (bool, int, float, str):  # --model and --inject: not type-checked here
            continue
        flag = f"--{opt.flag}"
        assert flag in parser._option_string_actions, flag
        with pytest.raises(ValueError) as err:
            cls(**{opt.name: object()})
        assert str(err.value).startswith(f"{cls.__name__}.{opt.name} ({flag}): expected {type(f.default).__name__}")
        assert error_option(str(err.value)) == (opt.flag, str(err.value).partition(": ")[2])
        checked += 1
    assert checked == len(OPTIONS) - 2


FLOAT32_MAX = float(torch.finfo(torch.float32).max)

# Each check's edge: the last value it takes and the first it refuses, on each side it has.
EDGES: list[tuple[type, str, list[object], list[object]]] = [
    (MonitorConfig, "interval", [0], [-1]),
    (MonitorConfig, "cosine", list(COSINE_MODES), ["fast"]),
    (MonitorConfig, "sketch_dim", [8, 65536], [7, 65537]),
    (MonitorConfig, "fingerprint_every", [0], [-1]),
    (MonitorConfig, "alert_loss_cv", [0.0], [-0.1, math.nan]),
    (MonitorConfig, "alert_cos_min", [-1.0, 1.0], [-1.01, 1.01, math.nan]),
    (ProtectConfig, "mode", list(PROTECT_MODES), ["always"]),
    (ProtectConfig, "sync_period", [1, 2**53], [0, 2**53 + 1]),
    (ProtectConfig, "sync_mode", list(SYNC_MODES), ["median"]),
    (ProtectConfig, "broadcast_src", [0], [-1]),
    (GuardConfig, "spike_threshold", [1e-9], [0.0, math.inf, math.nan]),
    (GuardConfig, "window", [5, 1_000_000], [4, 1_000_001]),
    (GuardConfig, "warmup", [0], [-1]),
    (GuardConfig, "update_ratio", [0.0, math.inf], [-0.1, math.nan]),
    (GuardConfig, "outlier_threshold", [1e-9], [0.0, math.inf, math.nan]),
    (GuardConfig, "max_reruns_per_step", [1], [0]),
    (GuardConfig, "max_reruns_per_run", [1], [0]),
    (GuardConfig, "shift_after", [0], [-1]),
    (GuardConfig, "on_persistent", list(ON_PERSISTENT), ["ignore"]),
    (TrainConfig, "workload", ["gpt", "llama", "resnet"], ["bert"]),
    (TrainConfig, "model", [{}], [3]),  # model_config's TypeError too
    (TrainConfig, "world_size", [1], [0]),
    (TrainConfig, "steps", [1], [0]),
    (TrainConfig, "seed", [0, 2**32 - 1], [-1, 2**32]),
    (TrainConfig, "optimizer", list(OPTIMIZERS), ["lion"]),
    (TrainConfig, "lr", [1e-9, FLOAT32_MAX], [0.0, 1e39, math.inf, math.nan]),  # the optimizers' float32 scalar
    (TrainConfig, "weight_decay", [0.0], [-0.1, math.inf, math.nan]),
    (TrainConfig, "warmup_steps", [0], [-1]),
    (TrainConfig, "min_lr_ratio", [0.0, 1.0], [-0.1, 1.1]),
    (TrainConfig, "grad_clip", [0.0], [-0.1, math.inf, math.nan]),
    (TrainConfig, "eval_every", [1], [0]),
    (TrainConfig, "eval_batches", [1], [0]),
    (TrainConfig, "log_every", [1], [0]),
    (TrainConfig, "checkpoint_every", [0], [-1]),
    (TrainConfig, "device", list(DEVICES), ["tpu"]),
    (TrainConfig, "dropout", [0.0, 0.99], [-0.1, 1.0]),
]


@pytest.mark.parametrize(("cls", "name", "good", "bad"), EDGES, ids=[f"{c.__name__}.{n}" for c, n, _, _ in EDGES])
def test_each_check_takes_its_edge_and_refuses_past_it(cls: type, name: str, good: list[object],
                                                       bad: list[object]) -> None:
    base = {"world_size": 1, "batch_size": 2} if cls is TrainConfig else {}  # a batch that any world size splits
    for value in good:
        assert getattr(cls(**{**base, name: value}), name) == value
    for value in bad:
        with pytest.raises(ValueError, match=rf"^{cls.__name__}\.{name} \(--{long_option(cls, name)}\): "):
            cls(**{**base, name: value})


@pytest.mark.parametrize(("message", "about"), [
    ("ProtectConfig.target (--dyn-target): must be a finite number > 0, got 0",
     ("dyn-target", "must be a finite number > 0, got 0")),
    # A bad fault spec names the field, but the spec follows it, not what is wrong.
    ("TrainConfig.inject (--inject) 'bitflip:bits=40': field 'bits' must be < 32", None),
    ("cannot read x.toml: TrainConfig.lr (--lr): must be > 0, got 0", None),  # not about the field it names
])
def test_error_option_reads_only_a_message_that_starts_with_its_field(message: str,
                                                                      about: tuple[str, str] | None) -> None:
    assert error_option(message) == about


def test_from_dict_takes_a_config_json_without_the_fields_paft_added_since() -> None:
    old = {"workload": "resnet", "world_size": 2, "batch_size": 8, "monitor": {"interval": 2}, "guard": {}}
    assert TrainConfig.from_dict(old) == TrainConfig(workload="resnet", world_size=2, batch_size=8,
                                                     monitor=MonitorConfig(interval=2))


@pytest.mark.usefixtures("no_tensorboard")
def test_tensorboard_is_a_value_a_machine_without_its_package_reads() -> None:
    # Whether the package is installed is the machine's to check (machine.check_machine):
    # a run's saved config.json said --tensorboard, and every reader of it (a resume,
    # the benchmarks) failed on a machine without the package.
    saved = TrainConfig(tensorboard=True).to_dict()
    assert TrainConfig.from_dict(saved).tensorboard is True


@pytest.mark.parametrize(("options", "message"), [
    (dict(batch_size=0), "TrainConfig.batch_size (--batch-size): must be >= 1, got 0"),
    (dict(resume=True, overwrite=True, run_dir="r"),
     "TrainConfig.resume (--resume): cannot be combined with --overwrite"),
    (dict(resume=True), "TrainConfig.resume (--resume): needs --run-dir, the run to continue"),
    (dict(world_size=2, batch_size=2, protect=ProtectConfig(sync_mode="broadcast", broadcast_src=2)),
     "ProtectConfig.broadcast_src (--broadcast-src): must be a rank in [0, 2), got 2"),
])
def test_checks_across_fields_refuse(options: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as err:
        TrainConfig(**options)  # type: ignore[arg-type]
    assert str(err.value) == message


@pytest.mark.parametrize("workload, missing", [("gpt", "tinyshakespeare.txt"),
                                               ("resnet", "mnist-t10k-images-idx3-ubyte.gz")])
def test_a_missing_data_file_is_refused_with_the_config_and_not_blamed_on_an_option(
        data_dir: pathlib.Path, workload: str, missing: str) -> None:
    # Before the workers start (resnet's files were first read in them, exit 1), and as
    # the installation's fault: gpt's error was "--model: ...", or a traceback.
    with pytest.raises(DataFileError) as err:
        TrainConfig(workload=workload)
    assert str(err.value).startswith(f"paft's data file {data_dir / missing} cannot be read")
    assert error_option(str(err.value)) is None


def test_each_rank_takes_an_even_share_of_the_batch() -> None:
    assert TrainConfig(workload="resnet", world_size=2, steps=20).per_rank_batch_size == 32  # the module's example
    assert TrainConfig(world_size=4, batch_size=8).per_rank_batch_size == 2


def test_checks_across_fields_take_what_they_do_not_concern() -> None:
    TrainConfig(workload="resnet", world_size=1, batch_size=8000)  # the whole training set in one batch
    TrainConfig(world_size=2, batch_size=2, protect=ProtectConfig(broadcast_src=5))  # no broadcast: no source
    TrainConfig(monitor=MonitorConfig(enabled=False))  # plain DDP, no guard


def test_the_defaults_the_readme_names() -> None:
    # README: --monitor-interval default 1, --fingerprint-every default 10; the guard's
    # caps --max-reruns (2) and --max-reruns-total (100), --shift-after (5), --on-persistent
    # repair (default); --sync-mode robust (default), --overlap the default. (The guard's
    # window, warm-up and threshold: guard_test's worked example of docs/GUARD.md.)
    from paft.options import parse_train_config

    cfg, _ = parse_train_config([])  # what paft train runs with, as the library's dataclasses
    for monitor, guard, protect in ((cfg.monitor, cfg.guard, cfg.protect),
                                    (MonitorConfig(), GuardConfig(), ProtectConfig())):
        assert (monitor.enabled, monitor.interval, monitor.fingerprint_every) == (True, 1, 10)
        assert (guard.max_reruns_per_step, guard.max_reruns_per_run, guard.shift_after) == (2, 100, 5)
        assert guard.on_persistent == "repair"
        assert (protect.sync_mode, protect.overlap) == ("robust", True)


@pytest.mark.parametrize(("sync_period", "first"), [(1, 5), (5, 5), (50, 50), (400, 400), (1000, 400)])
def test_dyn_starts_at_the_sync_period_clamped_into_its_bounds(sync_period: int, first: int) -> None:
    assert ProtectConfig(sync_period=sync_period, h_min=5, h_max=400).first_h == first


def test_numbers_of_other_kinds_are_kept_as_pythons_own() -> None:
    """numpy's numbers pass the type checks, and are stored as Python's: config.json is
    JSON, which knows no numpy type."""
    import json

    import numpy as np

    cfg = TrainConfig(steps=np.int64(5), lr=np.float32(0.5), monitor=MonitorConfig(interval=np.int32(2)))
    assert [type(v) for v in (cfg.steps, cfg.lr, cfg.monitor.interval)] == [int, float, int]
    assert json.loads(json.dumps(cfg.to_dict()))["steps"] == 5
