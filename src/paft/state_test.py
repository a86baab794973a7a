"""Tests for paft.state: the canonical naming and order of a rank's state tensors
(wrappers unwrapped, nested optimizer state reached) and its fingerprint."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from paft.fingerprint import fingerprint
from paft.fingerprint_test import flip_bit
from paft.replicas import group_replicas
from paft.state import fingerprints_over_ranks, state_fingerprint, state_tensors
from paft.testing import NestedStateSGD, run_workers


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 6 * 6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.conv(x))).flatten(1))


def _trained(seed: int = 0) -> tuple[_Net, torch.optim.Adam]:
    torch.manual_seed(seed)
    model = _Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(5, 1, 8, 8)
    model(x).square().mean().backward()
    opt.step()
    return model, opt


def test_state_tensors_canonical_order() -> None:
    model, opt = _trained()
    names = [n for n, _ in state_tensors(model, opt)]
    params = ["conv.weight", "conv.bias", "bn.weight", "bn.bias", "head.weight", "head.bias"]
    buffers = ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    optim = [f"optim/{i}/{k}" for i in range(6) for k in ("exp_avg", "exp_avg_sq", "step")]
    assert names == [f"param/{p}" for p in params] + [f"buffer/{b}" for b in buffers] + optim
    assert names == [n for n, _ in state_tensors(model, opt)]  # stable
    named = dict(state_tensors(model, opt))
    assert named["buffer/bn.num_batches_tracked"].dtype == torch.int64
    assert named["optim/0/step"] is opt.state[model.conv.weight]["step"]
    assert [n for n, _ in state_tensors(model)] == names[:9]
    without = [n for n in names if not n.startswith("buffer/")]
    assert [n for n, _ in state_tensors(model, opt, buffers=False)] == without
    assert state_fingerprint(model, opt, buffers=False) == fingerprint(named[n] for n in without)


def test_state_tensors_groups_missing_state_and_non_tensors() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    opt = torch.optim.SGD(
        [{"params": [model[1].weight]}, {"params": [model[0].weight, model[0].bias]}],
        lr=0.1,
        momentum=0.9,
    )
    opt.state[model[1].weight]["note"] = "not a tensor"
    model(torch.randn(3, 2)).sum().backward()
    model[0].weight.grad = None  # index 1 gets no state, but keeps its number
    opt.step()
    names = [n for n, _ in state_tensors(model, opt) if n.startswith("optim/")]
    assert names == ["optim/0/momentum_buffer", "optim/2/momentum_buffer"]
    assert model[0].weight not in opt.state  # listing never grows the defaultdict


def test_state_tensors_reach_tensors_nested_in_optimizer_state() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = NestedStateSGD(model.parameters())
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 3)).square().sum().backward()
        opt.step()
    named = dict(state_tensors(model, opt))
    optim = [n for n in named if n.startswith("optim/")]
    # dict keys sorted, list positions in order; the Python int "count" is not a tensor
    assert optim == [f"optim/{i}/{key}" for i in (0, 1) for key in ("history/0", "history/1", "stats/sq")]
    assert named["optim/1/history/1"] is opt.state[model.bias]["history"][1]
    # tuples too, and a dict's keys sorted whatever their insertion order
    opt.state[model.bias]["extra"] = ({"b": torch.ones(1), "a": torch.zeros(1)}, 3)
    extra = [n for n, _ in state_tensors(model, opt) if n.startswith("optim/1/extra")]
    assert extra == ["optim/1/extra/0/a", "optim/1/extra/0/b"]
    del opt.state[model.bias]["extra"]
    before = state_fingerprint(model, opt)
    with torch.no_grad():
        opt.state[model.weight]["stats"]["sq"].view(-1).view(torch.int32)[3] ^= 1  # one mantissa bit
    assert state_fingerprint(model, opt) != before


@pytest.mark.parametrize(
    "name, index, bit",
    [
        ("param/conv.weight", 5, 3),
        ("param/head.bias", 2, 31),
        ("buffer/bn.running_mean", 1, 25),
        ("buffer/bn.num_batches_tracked", 0, 0),
        ("optim/4/exp_avg_sq", 17, 22),
        ("optim/1/step", 0, 23),
    ],
)
def test_state_fingerprint_sees_one_flipped_bit(name: str, index: int, bit: int) -> None:
    model, opt = _trained()
    before = state_fingerprint(model, opt)
    assert before == state_fingerprint(*_trained())  # same seed: bitwise same state
    target = dict(state_tensors(model, opt))[name]
    with torch.no_grad():
        flip_bit(target, index, bit)
        assert state_fingerprint(model, opt) != before
        flip_bit(target, index, bit)
    assert state_fingerprint(model, opt) == before


class _Wrapper(nn.Module):
    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


class _HasModuleChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.module = nn.Linear(2, 2)
        self.extra = nn.Linear(2, 2)


def test_wrappers_are_unwrapped_but_user_modules_named_module_are_not() -> None:
    model, opt = _trained()
    fp = state_fingerprint(model, opt)
    assert state_fingerprint(_Wrapper(model), opt) == fp
    assert [n for n, _ in state_tensors(_Wrapper(_Wrapper(model)))][0] == "param/conv.weight"
    assert state_tensors(torch.compile(model), opt) == state_tensors(model, opt)  # lazy: nothing compiles
    buffered = _Wrapper(model)
    buffered.register_buffer("own", torch.zeros(1))  # a wrapper with state of its own is kept whole
    assert [n for n, _ in state_tensors(buffered)][0] == "param/module.conv.weight"
    user = _HasModuleChild()
    assert [n for n, _ in state_tensors(user)][:2] == ["param/module.weight", "param/module.bias"]
    assert len(state_tensors(user)) == 4


def _ddp_worker(rank: int, world_size: int) -> tuple[list[str], int, int]:
    model, _ = _trained(seed=0)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    for step in range(2):
        torch.manual_seed(100 * step + rank)  # each rank its own batch
        ddp(torch.randn(4, 1, 8, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert state_fingerprint(ddp, opt) == state_fingerprint(model, opt)
    # BatchNorm running stats legitimately differ between ranks after a forward on
    # rank-local data (DDP re-broadcasts buffers at the start of the next forward),
    # so only parameters and optimizer state must agree bitwise here.
    fp = fingerprint(t for n, t in state_tensors(ddp, opt) if not n.startswith("buffer/"))
    fps = [None] * world_size
    dist.all_gather_object(fps, fp)
    return [n for n, _ in state_tensors(ddp, opt)], fp, len(set(fps))


@pytest.mark.usefixtures("one_rank_group")
def test_ddp_is_unwrapped_in_process() -> None:
    """One-rank gloo group in this process: DDP's ``module.`` prefix never shows."""
    model, opt = _trained()
    ddp = nn.parallel.DistributedDataParallel(model)
    assert "module.conv.weight" in dict(ddp.named_parameters())
    assert state_tensors(ddp, opt) == state_tensors(model, opt)
    assert state_fingerprint(ddp, opt) == state_fingerprint(model, opt)


def test_ddp_replicas_agree_and_names_are_unwrapped() -> None:
    results = run_workers(_ddp_worker, 2)
    (names0, fp0, distinct), (names1, fp1, _) = results
    assert distinct == 1 and fp0 == fp1
    assert names0 == names1
    assert not any("module." in n for n in names0)


def flip_buffer_and_fingerprint(rank: int, world_size: int) -> list[list[int]]:
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4))
    torch.manual_seed(0)
    for p in model.parameters():
        nn.init.normal_(p)
    if rank == 2:
        bits = model[1].running_var.view(torch.int32)
        bits[1] ^= 1 << 3  # one mantissa bit of one BatchNorm statistic
    return group_replicas(fingerprints_over_ranks(model))[1:]


def test_single_flipped_buffer_bit_names_the_rank() -> None:
    # state_fingerprint's buffers (the syncs compare them; the per-step check leaves them out)
    assert run_workers(flip_buffer_and_fingerprint, 3)[0] == [[2]]
