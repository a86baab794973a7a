"""The docstrings' examples run as written: the doctests, and the script examples
under the launch commands their docstrings give."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pathlib
import subprocess
import sys
import textwrap
from typing import Any

import pytest

import paft
import paft.testing

PACKAGE = pathlib.Path(paft.__file__).parent
DOCTEST_MODULES = sorted(
    f"paft.{p.stem}" for p in PACKAGE.glob("*.py") if not p.stem.endswith("_test") and ">>>" in p.read_text()
)


def script_example(obj: Any) -> str:
    """The literal block after the docstring's ``Example ...::`` line, dedented."""
    lines = inspect.getdoc(obj).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Example"))
    colons = next(i for i in range(start, len(lines)) if lines[i].endswith("::"))
    block = []
    for line in lines[colons + 1 :]:
        if line.strip() and not line.startswith(" "):
            break
        block.append(line)
    return textwrap.dedent("\n".join(block)).strip() + "\n"


def test_doctests_are_found() -> None:
    assert {"paft.config", "paft.dyn", "paft.guard", "paft.amp"} <= set(DOCTEST_MODULES)


@pytest.mark.parametrize("name", DOCTEST_MODULES)
def test_doctests_pass(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name))
    assert result.attempted > 0 and result.failed == 0


def _run(args: list[str], cwd: pathlib.Path) -> list[str]:
    out = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def test_run_workers_example(tmp_path: pathlib.Path) -> None:
    (tmp_path / "example.py").write_text(script_example(paft.testing))
    assert _run([sys.executable, "example.py"], tmp_path) == ["[1.0, 1.0]"]


def test_protect_example_runs_under_torchrun(tmp_path: pathlib.Path) -> None:
    (tmp_path / "example.py").write_text(script_example(paft.protect))
    lines = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  "example.py"], tmp_path)
    (line,) = [line for line in lines if " syncs, loss " in line]
    assert int(line.split()[0]) >= 2 and float(line.split()[-1]) < 1.0
