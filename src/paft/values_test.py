"""fits(): the one type rule for option values from Python, config files and --model."""

from __future__ import annotations

import numpy as np
import pytest

from paft.values import fits


@pytest.mark.parametrize(("kind", "value", "ok"), [
    (bool, True, True), (bool, 0, False), (bool, "no", False),
    (int, 3, True), (int, np.int64(3), True), (int, True, False), (int, 3.0, False), (int, "3", False),
    (float, 3, True), (float, 2.5, True), (float, np.float32(0.5), True), (float, float("inf"), True),
    (float, False, False), (float, "1e-3", False),
    (str, "sketch", True), (str, False, False), (str, 1, False),
])
def test_fits(kind: type, value: object, ok: bool) -> None:
    assert fits(kind, value) is ok
