"""The guard's snapshots undo what they promise, bit for bit (single process)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from paft import snapshot
from paft.hook_state import hook_snapshot
from paft.norms import norm_of
from paft.protect_test import ReplacedRunningMean, batch, toy_model
from paft.snapshot import ForwardSnapshot, StateSnapshot, buffer_slots
from paft.state import state_fingerprint
from paft.testing import NestedStateSGD


def test_update_norms_of_half_precision_and_float64_tensors_do_not_overflow() -> None:
    # float16 norms ended at 65504 (a 1000 x 1000.0 layer read as inf: an update "ratio"
    # of inf or 0); float64 weights' squares summed as Python floats raised OverflowError;
    # float32 entries of 1e20 (a flipped exponent bit) overflowed float32's squares, so a
    # finite update read as non-finite, where clipping's norm of the same values did not.
    tensors = [torch.full((1000,), 1000.0, dtype=torch.float16), torch.full((4,), 3e38, dtype=torch.bfloat16),
               torch.full((2,), 1e150, dtype=torch.float64), torch.ones(9), torch.full((3,), 1e20)]
    expected = math.hypot(*[float(x) for t in tensors for x in t])
    assert norm_of(tensors) == pytest.approx(expected, rel=1e-6)
    # alone, float16 values get a float16 norm (as clipping's): rounded, but finite
    assert norm_of(tensors[:1]) == pytest.approx(1000 * math.sqrt(1000), rel=1e-3)
    assert norm_of(tensors[-1:]) == pytest.approx(1e20 * math.sqrt(3), rel=1e-6)
    assert norm_of(tensors[1:2]) == pytest.approx(6e38, rel=1e-2)


def test_a_finite_update_of_huge_entries_has_a_finite_ratio() -> None:
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    snap = StateSnapshot().capture(model, opt)
    with torch.no_grad():
        model.weight.add_(1e20)
    assert math.isfinite(snap.update_ratio()) and snap.update_ratio() > 1e19


def test_forward_snapshot_rewinds_the_rng_and_buffers_and_keeps_a_repairs_buffers() -> None:
    """A recompute starts where the step did: the same dropout draws, the BatchNorm
    statistics from before the forward; after keep_buffers, the repaired ones."""
    bn = nn.BatchNorm1d(3)
    buffers = list(bn.buffers())  # running_mean, running_var, num_batches_tracked
    before = [b.clone() for b in buffers]
    snap = ForwardSnapshot(buffer_slots(bn))
    draw = torch.rand(4)
    bn(torch.randn(5, 3))
    snap.restore()
    assert torch.equal(torch.rand(4), draw)
    assert all(torch.equal(b, old) for b, old in zip(buffers, before))
    with torch.no_grad():
        for b in buffers:
            b.add_(7)  # what a repair's sync put there
    repaired = [b.clone() for b in buffers]
    snap.keep_buffers()
    assert all(torch.equal(b, new) for b, new in zip(buffers, repaired))
    bn(torch.randn(5, 3))
    snap.restore()
    assert all(torch.equal(b, new) for b, new in zip(buffers, repaired))


def test_forward_snapshot_puts_back_a_buffer_the_forward_replaced() -> None:
    """A forward that replaces a buffer by assignment: the recompute starts from the
    tensor the step found, with its values then; after keep_buffers, from the one there
    then (a repair's)."""
    norm = ReplacedRunningMean(3)
    found = norm.mean
    snap = ForwardSnapshot(buffer_slots(norm))
    norm(torch.randn(5, 3))
    assert norm.mean is not found
    snap.restore()
    assert norm.mean is found and torch.equal(found, torch.zeros(3))
    norm.mean = torch.full((3,), 7.0)  # what a repair left there
    snap.keep_buffers()
    repaired = norm.mean
    norm(torch.randn(5, 3))
    snap.restore()
    assert norm.mean is repaired and torch.equal(repaired, torch.full((3,), 7.0))


def test_forward_snapshot_takes_a_comm_hooks_state_and_puts_it_back() -> None:
    """The guard's every undo of an attempt (recompute, skip, stop, rollback) restores
    the forward snapshot: the user's comm hook restarts from the state the step found."""

    class Feedback:
        def __init__(self) -> None:
            self.error = torch.zeros(3)

        def state_dict(self) -> dict[str, Any]:
            return {"error": self.error}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            self.error = state["error"]

    state = Feedback()
    hook = hook_snapshot(state)
    state.error += 2.0  # the state the step finds
    snap = ForwardSnapshot([], hook)
    state.error.fill_(1e30)  # the attempt's hook, in place
    snap.restore()
    assert state.error.tolist() == [2.0] * 3


def test_forward_snapshot_rewinds_every_cuda_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropout on a GPU draws from the CUDA generators: a recompute must start from their
    states too, on every device. CUDA faked (this suite runs on CPUs): a generator's
    state is a byte tensor that each draw advances."""
    generators = [torch.tensor([1, 2], dtype=torch.uint8), torch.tensor([3, 4], dtype=torch.uint8)]

    def set_all(states: list[torch.Tensor]) -> None:
        generators[:] = [s.clone() for s in states]

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: [g.clone() for g in generators])
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", set_all)
    before = [g.clone() for g in generators]
    snap = ForwardSnapshot([])
    for g in generators:
        g.add_(9)  # the attempt's draws
    snap.restore()
    assert len(generators) == 2 and all(torch.equal(g, b) for g, b in zip(generators, before))


def test_forward_snapshot_leaves_cuda_alone_where_the_process_never_started_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU run on a GPU machine: reading the CUDA generators would start CUDA (a context
    # on every GPU) in each worker, for generators nothing drew from.
    def started() -> list[torch.Tensor]:
        raise AssertionError("CUDA started")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", started)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", started)
    snap = ForwardSnapshot([])
    snap.restore()
    assert snap.cuda_rng is None


@pytest.mark.parametrize("batch_bytes", [64 << 20, 1])  # every parameter's difference a batch of its own
@pytest.mark.parametrize(
    ("old", "new", "ratio"),
    [
        ([3.0, 0.0, 4.0], [3.0, 0.0, 4.0], 0.0),
        ([3.0, 0.0, 4.0], [3.0, 3.0, 0.0], 1.0),  # only the last parameter moved: 5 / 5
        ([3.0, 0.0, 4.0], [6.0, 4.0, 4.0], 1.0),
        ([0.0, 0.0, 0.0], [1.0, 0.0, 0.0], 0.0),  # no scale to compare with
        ([3.0, 0.0, 4.0], [3.0, math.nan, 4.0], math.inf),
        ([3.0, 0.0, 4.0], [math.inf, 0.0, 4.0], math.inf),
        ([0.0, 0.0, 0.0], [math.inf, 0.0, 0.0], math.inf),  # not finite: inf, even with no scale
    ],
)
def test_update_ratio_by_hand(old: list[float], new: list[float], ratio: float, batch_bytes: int,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    """||w_new - w_old|| / ||w_old|| over the parameters alone (not the momentum)."""
    monkeypatch.setattr(snapshot, "DIFF_BATCH_BYTES", batch_bytes)
    model = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1, bias=False))
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=1.0, momentum=0.9)
    model(torch.ones(1, 1)).sum().backward()
    opt.step()  # momentum buffers, which the ratio leaves out
    with torch.no_grad():
        for p, v in zip(params, old):
            p.fill_(v)
    snap = StateSnapshot().capture(model, opt)
    with torch.no_grad():
        for p, v in zip(params, new):
            p.fill_(v)
    assert snap.update_ratio() == ratio


@pytest.mark.parametrize("held", ["head", "model"])
def test_frozen_parameters_are_neither_copied_nor_in_the_update_ratio(held: str) -> None:
    # Fine-tuning: a frozen backbone beside a trained head. The backbone never moves in
    # optimizer.step(); in the denominator it read the head's ratio of 1.0 as far less.
    # So also where the optimizer holds it (built from model.parameters(), as many
    # fine-tuning scripts do): without a gradient, torch's optimizers skip it.
    torch.manual_seed(0)
    backbone, head = nn.Linear(100, 100), nn.Linear(100, 1, bias=False)
    backbone.requires_grad_(False)
    model = nn.Sequential(backbone, head)
    opt = torch.optim.SGD((head if held == "head" else model).parameters(), lr=1.0)
    snap = StateSnapshot().capture(model, opt)
    with torch.no_grad():
        old = head.weight.clone()
        head.weight.mul_(2.0)  # an update as large as the weights: ratio 1
    assert snap.update_ratio() == 1.0
    assert [t.shape for t in snap._saved] == [head.weight.shape]  # one copy: the head's
    snap.restore(opt)
    assert torch.equal(head.weight, old)


def test_a_reused_snapshot_follows_a_new_state_layout() -> None:
    """The copies are reallocated when shapes or dtypes change, and a snapshot taken of
    another optimizer leaves nothing of the old one behind."""
    snap = StateSnapshot()
    for width, dtype in [(3, torch.float32), (3, torch.float64), (4, torch.float64)]:
        torch.manual_seed(width)
        model = nn.Linear(width, 2).to(dtype)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        model(torch.randn(3, width, dtype=dtype)).square().sum().backward()
        opt.step()  # momentum buffers: as many tensors as before the change
        before = state_fingerprint(model, opt)
        snap.capture(model, opt)
        opt.step()
        snap.restore(opt)
        assert state_fingerprint(model, opt) == before
        assert set(opt.state) <= set(model.parameters())


def test_state_snapshot_leaves_the_buffers_to_the_forward_snapshot() -> None:
    """The rollback puts back parameters and optimizer state only: the buffers it would
    copy at capture are the ones the attempt's forward already changed, not the ones
    before it (nor a repair's), which the ForwardSnapshot restores."""
    model = toy_model(batchnorm=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(batch(0, 0)[0]).sum().backward()
    params = [p.clone() for p in model.parameters()]
    snap = StateSnapshot().capture(model, opt)
    opt.step()
    with torch.no_grad():
        for b in model.buffers():
            b.add_(3)  # a repair, or the ForwardSnapshot's restore, after the capture
    buffers = [b.clone() for b in model.buffers()]
    snap.restore(opt)
    assert all(torch.equal(p, old) for p, old in zip(model.parameters(), params))
    assert all(torch.equal(b, new) for b, new in zip(model.buffers(), buffers))


class RebindingMomentum(torch.optim.Optimizer):
    """SGD with momentum as hand-written optimizers often have it: a new state tensor
    each step (``state["m"] = 0.9 * m + g``), not an update in place."""

    def __init__(self, params: Any, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                state["m"] = 0.9 * state["m"] + p.grad if "m" in state else p.grad.clone()
                p.add_(state["m"], alpha=-group["lr"])


class DeepStateSGD(torch.optim.Optimizer):
    """State nested two levels deep, changed at each level by step(): a dict whose
    tensor entry is replaced, a list in that dict that grows, and a list in that list
    that grows; and a state key that the second step adds."""

    def __init__(self, params: Any, lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "tree" in state:  # a key that only a later step adds
                    state["previous"] = state["tree"]["last"]
                tree = state.setdefault("tree", {"last": torch.zeros_like(p), "windows": [[]]})
                tree["last"] = p.grad.clone()
                tree["windows"].append([p.grad.clone()])
                tree["windows"][0].append(p.grad.clone())
                p.add_(tree["last"], alpha=-group["lr"])


@pytest.mark.parametrize("opt_name", ["sgd-momentum", "adamw", "nested", "rebinding", "deep"])
def test_state_snapshot_restores_params_and_optimizer_state_bitwise(opt_name: str) -> None:
    """The guard's rollback: a snapshot (buffers reused across steps) undoes a step exactly,
    including the optimizer state that a first step creates, and lists / dicts of
    tensors in the state that the step grows or rotates in place ("nested"), also
    nested in each other ("deep")."""
    model = toy_model()
    if opt_name == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    elif opt_name == "nested":
        opt = NestedStateSGD(model.parameters(), lr=0.05)
    elif opt_name == "rebinding":
        opt = RebindingMomentum(model.parameters())
    elif opt_name == "deep":
        opt = DeepStateSGD(model.parameters())
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def step(k: int) -> None:
        opt.zero_grad()
        x, y = batch(0, k)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    snap = StateSnapshot()
    for k in range(4):  # k = 0: no optimizer state yet, so restore must remove what step() created
        before = state_fingerprint(model, opt)
        keys = {id(p): set(opt.state.get(p, {})) for p in model.parameters()}
        snap.capture(model, opt)
        step(k)
        assert snap.update_ratio() > 0 and state_fingerprint(model, opt) != before
        snap.restore(opt)
        assert state_fingerprint(model, opt) == before
        assert {id(p): set(opt.state.get(p, {})) for p in model.parameters()} == keys
        if opt_name == "nested" and k:
            assert {len(opt.state[p]["history"]) for p in model.parameters()} == {min(k, 2)}
            assert {opt.state[p]["count"] for p in model.parameters()} == {k}
        step(k)  # then really take the step: the next round snapshots a grown state


@pytest.mark.parametrize("opt_name", ["nested", "deep"])
def test_one_capture_restores_exactly_twice(opt_name: str) -> None:
    # A restore hands the live state copies of the capture's lists, not the lists
    # themselves: the next step grows them in place, and the capture with them.
    model = toy_model()
    opt = NestedStateSGD(model.parameters(), lr=0.05) if opt_name == "nested" else DeepStateSGD(model.parameters())

    def step(k: int) -> None:
        opt.zero_grad()
        x, y = batch(0, k)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()

    step(0)
    before = state_fingerprint(model, opt)
    snap = StateSnapshot().capture(model, opt)
    for k in (1, 2):
        step(k)
        snap.restore(opt)
        assert state_fingerprint(model, opt) == before, k


class GroupStateSGD(torch.optim.Optimizer):
    """SGD whose step size adapts in its param group, as D-Adaptation and Prodigy keep
    ``d`` and ``k`` there (a float, an int, a tensor and a list, each changed by step(),
    the tensor and the list in place)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {"lr": 0.1, "d": 1.0, "k": 0, "scale": torch.ones(()), "seen": []})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            group["d"] *= 1.5
            group["k"] += 1
            group["scale"].mul_(2.0)
            group["seen"].append(group["k"])
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"] * group["d"] * float(group["scale"]))


def test_state_snapshot_restores_state_kept_in_param_groups() -> None:
    model = toy_model()
    opt = GroupStateSGD(model.parameters())
    model(batch(0, 0)[0]).sum().backward()
    opt.step()
    before = [dict(g, scale=g["scale"].clone()) for g in opt.param_groups]
    scale = opt.param_groups[0]["scale"]
    snap = StateSnapshot().capture(model, opt)
    weights = state_fingerprint(model, opt)
    opt.step()
    snap.restore(opt)
    group = opt.param_groups[0]
    assert (group["d"], group["k"]) == (before[0]["d"], before[0]["k"]) == (1.5, 1)
    assert group["scale"] is scale and float(scale) == 2.0  # the same tensor, its old value
    assert group["seen"] == [1]  # the list the step grew in place, as it was
    assert state_fingerprint(model, opt) == weights
    # A key the step adds goes again; a tensor it replaced by one of another shape is put back;
    # the list the first restore handed over is a copy, so this step's append is undone too.
    opt.step()
    group["added"], group["scale"] = 1, torch.ones(3)
    snap.restore(opt)
    assert set(group) == set(before[0]) and torch.equal(group["scale"], torch.tensor(2.0))
    assert group["seen"] == [1]


def _exactly(a: Any, b: Any) -> bool:
    """``a`` and ``b`` are the same value bit for bit: the same types, tensors of the same
    dtype, device and shape with the same bytes, containers of such (a rollback's promise)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return ((a.dtype, a.device, a.shape) == (b.dtype, b.device, b.shape)
                and torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8)))
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_exactly(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_exactly(a[k], b[k]) for k in a)
    return bool(a == b)


def _copied(value: Any) -> Any:
    """A deep copy of ``value``, tensors cloned: what the optimizer held, kept apart from it."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_copied(v) for v in value)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value


def _groups(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [_copied({k: v for k, v in g.items() if k != "params"}) for g in opt.param_groups]


@pytest.mark.parametrize("change", ["float64-tensor", "python-float", "new-tensor", "in-place", "nested-in-place"])
def test_state_snapshot_puts_back_the_captured_tensor_of_a_param_group(change: str) -> None:
    """A tensor-valued group option (a tensor ``lr``) that a scheduler or the user changes
    after the capture comes back as it was captured: the same object, dtype and bits.
    Before, a tensor of the same shape put in its place was written into (a float64
    ``lr`` stayed float64, holding float32's 0.1), and one nested in a list was not
    restored at all."""
    model = toy_model()
    opt = torch.optim.SGD(model.parameters(), lr=torch.tensor(0.1), momentum=0.9)
    group = opt.param_groups[0]
    group["window"] = [torch.tensor([1.0, 2.0])]
    model(batch(0, 0)[0]).sum().backward()
    opt.step()  # momentum buffers, which the rollback leaves as they are
    lr = group["lr"]
    before, state = _groups(opt), _copied(opt.state_dict()["state"])
    snap = StateSnapshot().capture(model, opt)
    if change == "float64-tensor":
        group["lr"] = torch.tensor(0.1, dtype=torch.float64)
    elif change == "python-float":
        group["lr"] = 0.05
    elif change == "new-tensor":
        group["lr"] = torch.tensor(0.05)
    elif change == "in-place":
        group["lr"].fill_(0.05)
    else:
        group["window"][0].add_(1.0)
    snap.restore(opt)
    assert _exactly(_groups(opt), before)
    assert _exactly(opt.state_dict()["state"], state)
    assert group["lr"] is lr  # what a scheduler holding it writes into is the group's again


@pytest.mark.parametrize("change", ["other-dtype", "other-shape", "in-place", "added", "removed", "dropped",
                                    "nested-replaced", "first-state"])
def test_state_snapshot_undoes_every_change_to_the_optimizer_state(change: str) -> None:
    """After restore(), state_dict() is the captured one bit for bit (types, dtypes, bytes)
    and the state's tensors the same objects, whatever happened to an entry in
    between: replaced by a tensor of another dtype or shape, written in place, a key
    added or removed, a parameter's whole state dropped, a nested list replaced, or state
    given to a parameter whose state was an empty dict (a hand-written optimizer's
    ``state = self.state[p]`` before it decides to keep anything)."""
    model = toy_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(batch(0, 0)[0]).sum().backward()
    opt.step()
    first, last = list(model.parameters())[0], list(model.parameters())[-1]
    opt.state[first]["nested"] = {"history": [torch.ones(2)]}
    opt.state[last] = {}
    before = _copied(opt.state_dict())
    objects = {k: v for k, v in opt.state[first].items() if isinstance(v, torch.Tensor)}
    snap = StateSnapshot().capture(model, opt)
    state = opt.state[first]
    if change == "other-dtype":
        state["exp_avg"] = state["exp_avg"].double()
    elif change == "other-shape":
        state["exp_avg_sq"] = torch.zeros(3)
    elif change == "in-place":
        state["exp_avg"].add_(1.0)
        state["step"].add_(1.0)
    elif change == "added":
        state["extra"] = torch.ones(1)
    elif change == "removed":
        del state["exp_avg_sq"]
    elif change == "dropped":
        del opt.state[first]
    elif change == "first-state":
        opt.state[last]["momentum"] = torch.ones(1)
    else:
        state["nested"]["history"] = [torch.zeros(3, dtype=torch.float64)]
        state["nested"]["added"] = 1
    snap.restore(opt)
    assert _exactly(opt.state_dict(), before)
    assert all(opt.state[first][k] is v for k, v in objects.items())
