"""fits(): the one type rule for option values from Python, config files and --model."""

from __future__ import annotations

import numpy as np
import pytest

from paft.values import fits


@pytest.mark.parametrize(("kind", "value", "ok"), [
    (bool, True, True), (bool, 0, False), (bool, "no", False),
    (int, 3, True), (int, np.int64(3), True), (int, True, False), (int, 3.0, False), (int, "3", False),
    (float, 3, True), (float, 2.5, True), (float, np.float32(0.5), True), (float, float("inf"), True),
    (float, False, False), (float, "1e-3", False), (float, 1j, False),
    (str, "sketch", True), (str, False, False), (str, 1, False), (str, 2.5, False),
])
def test_fits(kind: type, value: object, ok: bool) -> None:
    assert fits(kind, value) is ok


def test_config_fields_hold_python_numbers() -> None:
    # numpy's numbers passed the type rule and stayed in the tree: JSON could not write
    # them and PAFT-Dyn's scheduler refused them after protect() had changed the model.
    import json
    from fractions import Fraction

    from paft.config import MonitorConfig, ProtectConfig

    p = ProtectConfig(mode="dyn", h_min=np.int64(2), target=np.float32(0.5), sync_period=8)
    assert type(p.h_min) is int and type(p.target) is float and p.target == 0.5
    assert ProtectConfig(target=Fraction(1, 1000)).target == 0.001
    assert json.dumps([MonitorConfig(interval=np.int64(2)).interval, p.h_min, p.target]) == "[2, 2, 0.5]"
