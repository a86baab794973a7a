"""Fixtures the test modules share."""

from __future__ import annotations

import importlib.util
import signal
from collections.abc import Iterator

import pytest

from paft.testing import one_rank_group


@pytest.fixture
def sigint() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt, as Python sets it up in a terminal; restored after.
    A shell starts a background job (as CI may run the suite) with SIGINT ignored, which
    children inherit (a handler they do not), and Python then leaves it so."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture
def no_tensorboard(monkeypatch: pytest.MonkeyPatch) -> None:
    """The optional tensorboard package reads as not installed (``find_spec``, what
    :func:`paft.records.require_tensorboard` asks)."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else find_spec(name, *a))


@pytest.fixture(name="one_rank_group")
def _one_rank_group() -> Iterator[None]:
    """A one-rank gloo default process group in this process (no workers), for one test."""
    with one_rank_group():
        yield
