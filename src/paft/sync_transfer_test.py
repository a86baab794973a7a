"""Tests for paft.sync_transfer on a one-rank gloo group in this process (no workers):
what a part's launch and finish do with the live tensors, given a plan."""

from __future__ import annotations

import pytest
import torch

from paft.flat import Layout, build_layout, structure_key, transport_view
from paft.sync_plan import SyncPlan
from paft.sync_reference import SyncReference
from paft.sync_transfer import Entry, Transfer, pack_group


@pytest.fixture
def one_rank(one_rank_group: None) -> Transfer:
    """A Transfer over a one-rank gloo world (the default group)."""
    return Transfer(None, 0, 1, torch.device("cpu"))


# A mean over the one finite replica: this rank applies the result (the mean's ranks
# all do), which is its own state, so what finish() leaves shows copy vs correction.
MEAN_OF_ONE = SyncPlan("mean", [[0]], [0], [True], src=0, count=1)


def _entries(tensors: dict[str, torch.Tensor]) -> list[Entry]:
    return [(n, transport_view(t), t) for n, t in tensors.items()]


def _layout(entries: list[Entry]) -> Layout:
    named = [(n, t) for n, t, _ in entries]
    return build_layout(structure_key(named), named, 1 << 20)


def test_a_tensor_replaced_in_the_window_takes_the_correction(one_rank: Transfer) -> None:
    """The optimizer replaced a state tensor during an overlapped sync, without a step
    and with a version counter that happens to match: the new object is progress to
    keep (synced + (w - snapshot)), not a tensor to overwrite with the synced copy."""
    old = torch.tensor([1.0, 2.0, 3.0])
    entries = _entries({"optim/0/exp_avg": old})
    layout = _layout(entries)
    p = one_rank.launch(MEAN_OF_ONE, layout, entries, overlapped=True, opt_steps=0, reference=None)
    new = torch.tensor([1.0, 5.0, 7.0])
    assert new._version == old._version  # only the identity tells them apart
    done = one_rank.finish(p, None, live_entries=lambda: _entries({"optim/0/exp_avg": new}), opt_steps=0,
                           reference=None)
    assert done.delta_tensors == 1
    assert torch.equal(new, torch.tensor([1.0, 5.0, 7.0]))  # synced == snapshot: its own values stay
    assert torch.equal(old, torch.tensor([1.0, 2.0, 3.0]))


def test_a_dtype_whose_tensors_are_all_empty_moves_nothing(one_rank: Transfer) -> None:
    """An empty float64 tensor beside float32 state is a dtype group of no elements:
    nothing launched for it and nothing merged or written in finish."""
    w = torch.tensor([1.0, 2.0])
    state = {"param/w": w, "param/empty": torch.empty(0, dtype=torch.float64)}
    entries = _entries(state)
    layout = _layout(entries)
    assert [g.numel for g in layout.groups] == [2, 0]
    p = one_rank.launch(MEAN_OF_ONE, layout, entries, overlapped=False, opt_steps=0, reference=None)
    done = one_rank.finish(p, None, live_entries=lambda: entries, opt_steps=0, reference=None)
    assert (done.divergence, done.collectives) == (0.0, 2)  # w's one bucket, the divergence
    assert torch.equal(w, torch.tensor([1.0, 2.0]))


def test_a_tensor_reshaped_in_the_window_is_left_as_it_is(one_rank: Transfer) -> None:
    """A state tensor the window replaced by one of another shape or dtype has no place
    in the synced flat: finish() writes nothing into it (and does not fail)."""
    entries = _entries({"optim/0/a": torch.tensor([1.0, 2.0]), "optim/0/b": torch.tensor([3.0, 4.0])})
    layout = _layout(entries)
    p = one_rank.launch(MEAN_OF_ONE, layout, entries, overlapped=True, opt_steps=0, reference=None)
    now = {"optim/0/a": torch.tensor([5.0, 6.0, 7.0]), "optim/0/b": torch.tensor([8.0, 9.0], dtype=torch.float64)}
    done = one_rank.finish(p, True, live_entries=lambda: _entries(now), opt_steps=1, reference=None)
    assert done.delta_tensors == 0
    assert torch.equal(now["optim/0/a"], torch.tensor([5.0, 6.0, 7.0]))
    assert torch.equal(now["optim/0/b"], torch.tensor([8.0, 9.0], dtype=torch.float64))


def test_an_overlapped_noop_keeps_the_state_at_launch_as_the_reference(one_rank: Transfer) -> None:
    """At world size 2 the replicas may move apart behind an overlapped no-op: the next
    median's reference is the state they agreed on at launch, not at finish."""
    w = torch.tensor([1.0, 2.0])
    entries = _entries({"param/w": w})
    layout = _layout(entries)
    reference = SyncReference(layout, [torch.zeros_like(pack_group(g, entries, w.device)) for g in layout.groups],
                              w.device)
    noop = SyncPlan("noop", [[0]], [0], [True])
    p = one_rank.launch(noop, layout, entries, overlapped=True, opt_steps=0, reference=reference)
    w.add_(1.0)  # the step in the window
    done = one_rank.finish(p, None, live_entries=lambda: entries, opt_steps=1, reference=reference)
    assert (done.divergence, done.bytes_sent, done.collectives, done.delta_tensors) == (0.0, 0, 0, 0)
    assert torch.equal(reference.flat(layout.groups[0], True), torch.tensor([1.0, 2.0]))
    assert torch.equal(w, torch.tensor([2.0, 3.0]))


def test_a_second_moment_the_correction_would_make_negative_keeps_the_synced_value(one_rank: Transfer) -> None:
    """A replica whose second moment was corrupted huge decays it by its own step in the
    window: synced + (w - snapshot) made it negative, and its next Adam step's square
    root NaN. Where the correction alone turns such state negative, the synced value
    stands; a parameter, and state that holds negative values, keep the plain
    correction (exact for SGD, whose progress may cross zero)."""
    # A mean of this replica and three that hold zeros: a quarter of its own state.
    mean_of_four = SyncPlan("mean", [[0]], [0], [True], src=0, count=4)
    state = {"optim/0/exp_avg_sq": torch.tensor([8.0, 1e30]), "optim/0/exp_avg": torch.tensor([8.0, -4.0]),
             "param/w": torch.tensor([8.0, 1e30])}
    entries = _entries(state)
    p = one_rank.launch(mean_of_four, _layout(entries), entries, overlapped=True, opt_steps=0, reference=None)
    for t in state.values():
        t.mul_(0.5)  # the step in the window: a decay
    done = one_rank.finish(p, None, live_entries=lambda: entries, opt_steps=0, reference=None)
    assert done.delta_tensors == 3
    assert torch.equal(state["optim/0/exp_avg_sq"], torch.tensor([2.0, 2.5e29]))  # synced, not -2, -2.5e29
    assert torch.equal(state["optim/0/exp_avg"], torch.tensor([-2.0, 1.0]))
    assert torch.equal(state["param/w"], torch.tensor([-2.0, -2.5e29]))
