"""Fixtures the test modules share."""

from __future__ import annotations

import importlib.util
import pathlib
import signal
from collections.abc import Iterator

import pytest

from paft.testing import one_rank_group
from paft.workloads import data


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


@pytest.fixture
def data_dir(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[pathlib.Path]:
    """An empty folder that paft reads its packaged data files from (a damaged
    installation, for one test): the tests write what it holds. The loaders' caches are
    cleared before and after, so no other test sees these files."""
    monkeypatch.setattr(data, "_data_file", lambda name: tmp_path / name)
    for loader in (data.load_shakespeare, data.load_mnist):
        loader.cache_clear()
    yield tmp_path
    for loader in (data.load_shakespeare, data.load_mnist):
        loader.cache_clear()
