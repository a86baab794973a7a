"""Tests for paft.comm's boundary with torch: the one read of DDP's private state, and
a hook chain that uses public API only (the chain itself is tested through
paft.protect, in protect_test.py), and the order a rank records a step's faults in."""

from __future__ import annotations

import ast
import inspect
import pathlib
import re

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel

from paft import comm
from paft.comm import registered_comm_hooks
from paft.config import MonitorConfig
from paft.faults import FaultInjector, FaultSchedule
from paft.protect import protect
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


@pytest.mark.usefixtures("one_rank_group")
def test_a_rank_records_an_attempts_faults_in_one_order_whatever_the_threads_timing() -> None:
    """Local-grad faults are injected on the autograd thread, aggregation ones on the
    all-reduce callbacks': whether bucket 0's result comes back before bucket 1's
    local gradient was the ranks' timing, and two identical runs wrote their
    faults.jsonl lines in different orders (the file's sort keeps a rank's order)."""
    specs = ["bitflip:site=local-grad,steps=0-19,ranks=0", "zero:site=aggregation,steps=0-19,ranks=0",
             "scale:site=aggregation,steps=0-19,ranks=0"]
    state = comm.CommHookState(FaultInjector(FaultSchedule(specs, seed=0, world_size=1), rank=0), cosine="off")
    state.num_buckets = 3
    interleavings = (
        [(site, i) for i in range(3) for site in ("local-grad", "aggregation")],  # each result back at once
        [(site, i) for site in ("local-grad", "aggregation") for i in reversed(range(3))],  # results late
    )
    orders_differed = False
    for step in range(20):
        seen = []
        for calls in interleavings:
            state.begin(step)
            for site, index in calls:
                state.inject(site, index, torch.ones(4))
            seen.append(state.current)
        ordered = [[(r.site, r.target, r.spec_index) for r in cap.ordered_faults()] for cap in seen]
        assert ordered[0] == ordered[1] and len(ordered[0]) == 3
        assert ordered[0] == sorted(ordered[0], key=lambda r: (r[0] != "local-grad", r[1], r[2]))
        orders_differed |= [r.site for r in seen[0].faults] != [r.site for r in seen[1].faults]
    assert orders_differed  # the case that needs the order


class TwoDtypes(nn.Module):
    """A float32 layer, then a float64 one: DDP buckets each dtype apart."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 4)
        self.second = nn.Linear(4, 1).double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)).double())


def _first_static_step() -> tuple[list[int], list[int], list[int], int]:
    """One protected step of a fresh ``static_graph`` DDP model of two dtypes (a local-grad
    fault at it): the exact copy's and the checksum's bucket indices, the copies'
    sizes, and the faults injected."""
    model = DistributedDataParallel(TwoDtypes(), static_graph=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    protector = protect(model, optimizer, monitor=MonitorConfig(cosine="exact"),
                        inject=["bitflip:site=local-grad,steps=0,bits=3"])

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        loss = model(torch.ones(2, 4)).square().mean()
        loss.backward()
        return loss

    protector.step(closure)
    captured = protector.hook.current
    return (sorted(captured.local_grads), sorted(captured.agg_terms),
            sorted(t.numel() for t in captured.local_grads.values()), protector.counters["faults_injected"])


@pytest.mark.usefixtures("one_rank_group")
def test_static_graphs_first_pass_gives_each_bucket_its_own_index() -> None:
    """DDP's first backward pass under ``static_graph=True`` all-reduces every bucket at
    its end, and hands each one ``index() == 0``. A model of two dtypes has two buckets
    then: keyed by that index, the second overwrote the first's exact copy and checksum
    (which bucket's callback finished last decided the checksum: replicas split with no
    fault), and one fault event struck both buckets."""
    assert _first_static_step() == ([0, 1], [0, 1], [5, 20], 1)


class Spare(nn.Module):
    """A small used layer and a large one the forward uses only while ``on``: under
    ``find_unused_parameters`` its gradient slots fill most of the one bucket."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used = nn.Linear(4, 1)
        self.spare = nn.Linear(100, 100)
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.used(x)
        return out + self.spare(torch.ones(1, 100)).sum() if self.on else out


def _unused_slot_step(fault: bool, set_to_none: bool, as_bucket_view: bool,
                      used_first: bool) -> tuple[int, dict[str, torch.Tensor | None], int]:
    """Two steps of :class:`Spare` (its spare layer used at step 0 where ``used_first``,
    never at step 1), ``fault``: an aggregation fault at step 1. Step 1's aggregated
    checksum, the gradients it left, and the faults injected."""
    model = DistributedDataParallel(Spare(), find_unused_parameters=True, gradient_as_bucket_view=as_bucket_view)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    protector = protect(model, optimizer, inject=["bitflip:steps=1,bits=exponent"] if fault else [])
    for step in range(2):
        model.module.on = used_first and step == 0

        def closure() -> torch.Tensor:
            optimizer.zero_grad(set_to_none=set_to_none)
            loss = model(torch.ones(2, 4)).square().mean()
            loss.backward()
            return loss

        protector.step(closure)
    grads = {n: None if p.grad is None else p.grad.clone() for n, p in model.module.named_parameters()}
    return protector.hook.current.totals()[1], grads, protector.counters["faults_injected"]


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize(("set_to_none", "as_bucket_view", "used_first", "reached"), [
    (True, False, False, False),  # never a gradient: the slot reaches none
    (True, True, False, False),
    (False, False, True, False),  # a gradient DDP leaves as it was (zeroed by zero_grad)
    (False, True, True, True),  # a gradient that is a view of the bucket: the fault reaches it
], ids=["no-grad", "no-grad-bucket-view", "zeroed-grad", "zeroed-grad-bucket-view"])
def test_the_checksum_leaves_out_the_slots_of_parameters_no_rank_used(
        set_to_none: bool, as_bucket_view: bool, used_first: bool, reached: bool) -> None:
    """A fault in an unused parameter's slot of the aggregated bucket reaches no
    gradient (DDP leaves the parameters no rank used as they were): its checksum said the
    replicas split where they had not (a false replicas_split alert, a guard's recompute,
    a PAFT-Dyn trigger). Where the slot is the gradient itself, it still counts."""
    clean = _unused_slot_step(False, set_to_none, as_bucket_view, used_first)
    faulty = _unused_slot_step(True, set_to_none, as_bucket_view, used_first)
    assert faulty[2] == 1
    # The fault struck the spare layer's slot (the used layer's gradients are the clean ones) ...
    for name in ("used.weight", "used.bias"):
        assert torch.equal(faulty[1][name], clean[1][name])
    spare = [name for name in clean[1] if name.startswith("spare.")]
    changed = any(not torch.equal(faulty[1][n], clean[1][n]) for n in spare if clean[1][n] is not None)
    # ... and the checksum differs exactly where it reached a gradient.
    assert changed == reached
    assert (faulty[0] != clean[0]) == reached


@pytest.mark.usefixtures("one_rank_group")
def test_an_event_strikes_once_where_micro_batches_accumulate_without_no_sync() -> None:
    """Micro-batches accumulated without ``ddp.no_sync()`` each run a backward pass that
    reaches the hook: each pass struck the bucket again (the same element and bit, so a
    second bit flip undid the first), counting and recording one fault per pass."""
    model = DistributedDataParallel(TwoDtypes())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    protector = protect(model, optimizer, inject=["bitflip:site=local-grad,steps=0-1,bits=3",
                                                  "bitflip:site=aggregation,steps=0-1,bits=3"])

    def closure() -> torch.Tensor:
        optimizer.zero_grad()
        for _ in range(3):  # every micro-batch all-reduced, as plain DDP allows
            loss = model(torch.ones(2, 4)).square().mean()
            loss.backward()
        return loss

    faults = []
    for _ in range(2):  # DDP's first step, then one on its rebuilt buckets
        protector.step(closure)
        faults.append(len(protector.hook.current.faults))
    assert faults == [2, 2]
    assert protector.counters["faults_injected"] == 4
