"""docs/ARCHITECTURE.md's module table says what each module imports of paft, as its
imports say: written by hand, it drifted (a module's new import left out, modules moved)."""

from __future__ import annotations

import ast
import pathlib
import re

import paft

PACKAGE = pathlib.Path(paft.__file__).resolve().parent
ARCHITECTURE = PACKAGE.parents[1] / "docs" / "ARCHITECTURE.md"
NOT_PAFT = {"none", "torch", "numpy"}  # what the column may name besides paft's modules
NO_ROW = {"__init__", "__main__", "conftest"}  # the package itself, and pytest's fixtures


def module_table() -> list[tuple[str, str]]:
    """The table's (module, depends-on column) rows, in order: ``train`` for
    ``train.py``, ``bench`` for ``bench/``."""
    section = ARCHITECTURE.read_text().split("## Modules", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)(?:\.py|/)` \| .* \| ([^|]*) \|$", section, re.MULTILINE)
    assert len(rows) > 40, "the module table was not found"
    return rows


def paft_imports(module: str) -> set[str]:
    """The paft modules that ``module`` (a package: its non-test files) imports anywhere,
    lazily or for types only too, by their top-level name (``workloads`` for
    ``paft.workloads.data``)."""
    path = PACKAGE / module
    files = sorted(p for p in path.rglob("*.py") if not p.stem.endswith("_test")) if path.is_dir() else [
        path.with_suffix(".py")]
    names: set[str] = set()
    for file in files:
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "paft":
                # A module by name; not the package's own attributes (``__version__``).
                names.update(f"paft.{alias.name}" for alias in node.names if not alias.name.startswith("__"))
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
    return {name.split(".")[1] for name in names if name.startswith("paft.")} - {module}


def test_every_module_has_a_row() -> None:
    modules = {p.stem for p in PACKAGE.glob("*.py") if not p.stem.endswith("_test")} - NO_ROW
    modules |= {p.parent.name for p in PACKAGE.glob("*/__init__.py")}
    assert modules == {module for module, _ in module_table()}


def test_each_row_names_the_modules_imports_and_only_modules_above_it() -> None:
    rows = module_table()
    order = [module for module, _ in rows]
    for i, (module, column) in enumerate(rows):
        # A note in parentheses may name an import too: train's lazy one of launch, the
        # one import allowed from below (the text above the table says so).
        listed = set(re.findall(r"\w+", column)) & set(order)
        assert listed == paft_imports(module), f"{module}: the table's row lists {sorted(listed)}"
        plain = re.findall(r"\w+", re.sub(r"\(.*?\)", "", column))
        assert set(plain) - NOT_PAFT <= set(order[:i]), f"{module}: {plain} are not all modules above it"
