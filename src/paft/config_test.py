"""The config tree's errors: each names the field as Python spells it and its option."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import pytest

from paft.config import GuardConfig, MonitorConfig, ProtectConfig, TrainConfig, error_option
from paft.options import OPTIONS, add_train_options

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
        (lambda: TrainConfig(world_size=2, batch_size=3),
         "TrainConfig.batch_size (--batch-size): 3 cannot be split evenly across --world-size 2"),
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
