"""A comm hook's state is put back as taken, again and again (single process, no DDP)."""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from paft.hook_state import hook_snapshot


def _powersgd() -> PowerSGDState:
    state = PowerSGDState(process_group=None, start_powerSGD_iter=2)
    state.iter = 5
    state.error_dict = {0: torch.arange(6.0), 1: torch.ones(3)}
    state.p_memory_dict = {0: torch.full((4,), 2.0)}
    state.q_memory_dict = {0: torch.full((2,), 3.0)}
    state.total_numel_before_compression, state.total_numel_after_compression = 60, 12
    state.next_stats_report = 7
    return state


def _powersgd_view(state: PowerSGDState) -> dict[str, Any]:
    return {"iter": state.iter, "totals": (state.total_numel_before_compression, state.total_numel_after_compression,
                                           state.next_stats_report),
            **{name: {k: t.tolist() for k, t in getattr(state, name).items()}
               for name in ("error_dict", "p_memory_dict", "q_memory_dict")}}


def _attempt(state: PowerSGDState) -> None:
    """What one attempt of PowerSGD's hook does to its state: in place and by replacing."""
    state.iter += 1
    state.error_dict[0] = torch.full((6,), 1e30)  # replaced (input_tensor_cp - input_tensor)
    state.error_dict[2] = torch.zeros(5)  # a bucket the snapshot did not have
    state.p_memory_dict[0].mul_(float("inf"))  # written in place (matmul out=)
    state.q_memory_dict.clear()  # without warm start
    state.total_numel_before_compression += 60
    state.total_numel_after_compression += 12
    state.next_stats_report += 1
    state.rng.randint(1_000_000_000)


def test_powersgd_state_is_restored_in_place_bit_for_bit_as_often_as_asked() -> None:
    state = _powersgd()
    snap = hook_snapshot(state)
    assert snap is not None
    snap.take()
    before, draw = _powersgd_view(state), PowerSGDState(None, start_powerSGD_iter=2).rng.randint(1_000_000_000)
    live_p = state.p_memory_dict[0]
    for _ in range(2):  # a second recompute starts from the same state: the snapshot was not handed out
        _attempt(state)
        snap.restore()
        assert _powersgd_view(state) == before
        assert state.p_memory_dict[0] is live_p  # copied back into the hook's own tensor
        assert state.rng.randint(1_000_000_000) == draw  # Q's seed as on the first attempt


def test_a_snapshot_is_retaken_each_step_into_the_same_buffers() -> None:
    state = _powersgd()
    snap = hook_snapshot(state)
    assert snap is not None
    snap.take()
    saved = snap._saved["error_dict"][0]
    _attempt(state)  # the step proceeded: its state is the next step's start
    snap.take()
    assert snap._saved["error_dict"][0] is saved  # no new buffer while the shape stays
    after = _powersgd_view(state)
    _attempt(state)
    snap.restore()
    assert _powersgd_view(state) == after


class _UserState:
    """A user's hook state with the state_dict protocol; ``state_dict()`` hands out its
    live tensor (as ``nn.Module.state_dict`` does), ``load_state_dict`` keeps what it gets."""

    def __init__(self) -> None:
        self.error = torch.zeros(4)
        self.calls = 0

    def state_dict(self) -> dict[str, Any]:
        return {"error": self.error, "calls": self.calls, "shapes": [(4,)]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.error, self.calls = state["error"], state["calls"]


def test_a_users_state_dict_is_copied_and_loaded_back_as_a_copy() -> None:
    state = _UserState()
    snap = hook_snapshot(state)
    assert snap is not None
    state.error += 1.0
    snap.take()
    for _ in range(2):
        state.error.mul_(1e30)  # in place: the live tensor of the state_dict
        state.calls += 1
        snap.restore()
        assert state.error.tolist() == [1.0] * 4 and state.calls == 0


def test_stateless_and_unknown_states_get_no_snapshot() -> None:
    class OnlySaves:
        def state_dict(self) -> dict[str, Any]:
            return {}

    # attributes of those names that are not methods: not the protocol either
    data = SimpleNamespace(state_dict={}, load_state_dict={})
    for state in (None, object(), OnlySaves(), {"state_dict": 1}, data):
        assert hook_snapshot(state) is None


class _ChangingState:
    """A user's hook state whose structure changes between steps: tensors that change
    shape or dtype (a bucket rebuilt), a list that grows, a set written in place, a
    ``defaultdict`` (a dict subclass that is not built from pairs)."""

    def __init__(self) -> None:
        self.error, self.scale = torch.arange(6.0), torch.ones(2)
        self.history: list[torch.Tensor] = [torch.zeros(2)]
        self.seen: set[int] = {1}
        self.counts: defaultdict[str, int] = defaultdict(int, {"a": 1})

    def state_dict(self) -> dict[str, Any]:
        return {"error": self.error, "scale": self.scale, "history": self.history, "seen": self.seen,
                "counts": self.counts}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.error, self.scale, self.history = state["error"], state["scale"], state["history"]
        self.seen, self.counts = state["seen"], state["counts"]


def test_a_state_that_changes_structure_is_taken_as_it_is_now() -> None:
    state = _ChangingState()
    snap = hook_snapshot(state)
    assert snap is not None
    with pytest.raises(RuntimeError, match=r"restore\(\) before take\(\)"):
        snap.restore()
    snap.take()
    kept = snap._saved["history"][0]
    state.error, state.scale = torch.arange(3.0), torch.full((2,), 0.5, dtype=torch.float64)
    snap.take()  # the next step's start: new shapes and dtypes
    assert snap._saved["history"][0] is kept  # a tensor in a list is written into its buffer too
    state.history.append(torch.ones(2))
    snap.take()  # one more entry
    state.error.mul_(1e30)
    state.history[1].mul_(1e30)
    state.seen.add(2)
    state.counts["b"] += 1
    snap.restore()
    assert state.error.tolist() == [0.0, 1.0, 2.0]
    assert state.scale.dtype == torch.float64 and state.scale.tolist() == [0.5, 0.5]
    assert [t.tolist() for t in state.history] == [[0.0, 0.0], [1.0, 1.0]]
    assert state.seen == {1} and state.counts == {"a": 1}
