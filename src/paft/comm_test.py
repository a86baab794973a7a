"""Tests for paft.comm's boundary with torch: the one read of DDP's private state, and
a hook chain that uses public API only (the chain itself is tested through
paft.protect, in protect_test.py)."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from paft import comm
from paft.comm import registered_comm_hooks
from paft.testing import run_workers


def _hooks_before_and_after(rank: int, ws: int) -> tuple[list, list]:
    ddp = DistributedDataParallel(nn.Linear(2, 1))
    before = registered_comm_hooks(ddp)
    ddp.register_comm_hook("my state", default_hooks.allreduce_hook)
    return [(h.__name__, s) for h, s in before], [(h.__name__, s) for h, s in registered_comm_hooks(ddp)]


def test_registered_comm_hooks_sees_a_hook_this_torch_holds() -> None:
    """A canary for DDP's private ``_comm_hooks``: a torch that renamed it would leave
    protect() unable to refuse a model that already has a hook."""
    assert run_workers(_hooks_before_and_after, 1) == [([], [("allreduce_hook", "my state")])]


def _private_attributes(tree: ast.AST) -> set[str]:
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr.startswith("_")}


def test_private_api_is_read_in_one_documented_place() -> None:
    """The hook called CommHookState's private methods; preflight read DDP's
    ``_comm_hooks`` inline. Now the hook's chain is public methods, and only
    :func:`registered_comm_hooks` touches a private attribute of torch's."""
    assert _private_attributes(ast.parse(inspect.getsource(comm.paft_comm_hook))) == set()
    assert "_comm_hooks" in inspect.getsource(registered_comm_hooks)
    read = re.compile(r"""[.'"]_comm_hooks\b""")  # an attribute read, not registered_comm_hooks
    src = pathlib.Path(comm.__file__).parent
    users = sorted(p.name for p in src.rglob("*.py") if read.search(p.read_text()) and p.name != "comm_test.py")
    assert users == ["comm.py"]
