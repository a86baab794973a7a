"""Tests for paft.sync_plan: PAFT-Sync's plan from fingerprints and finite flags.
Pure logic: milliseconds. (sync_test.py runs the plans end to end on real ranks.)"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paft.sync_plan import COPY_MODES, SyncPlan, as_ddp_would, plan_sync

OK4 = [True] * 4


def test_identical_replicas_are_a_noop_in_every_mode() -> None:
    for mode in ("robust", "mean", "broadcast"):
        plan = plan_sync(mode, [5, 5, 5], [True] * 3)
        assert (plan.mode, plan.sources, plan.groups) == ("noop", [0, 1, 2], [[0, 1, 2]])
        assert all(plan.holds_result(r) for r in range(3))
    # Identical and non-finite: broadcast has nothing better to copy, so nothing moves.
    plan = plan_sync("broadcast", [5, 5], [False, False])
    assert (plan.mode, plan.sources) == ("noop", [0, 1])  # every rank still holds the result


def test_robust_copies_the_lowest_rank_of_a_finite_majority() -> None:
    plan = plan_sync("robust", [7, 9, 7, 7], OK4)
    assert (plan.mode, plan.src, plan.sources, plan.minority) == ("majority-copy", 0, [0], [1])
    assert [plan.holds_result(r) for r in range(4)] == [True, False, True, True]
    assert plan.groups == [[0, 2, 3], [1]]
    # Two off the majority: both are repaired, the majority keeps its bits.
    plan = plan_sync("robust", [1, 7, 7, 7, 2], [True] * 5)
    assert (plan.mode, plan.src, plan.minority) == ("majority-copy", 1, [0, 4])
    # A non-finite minority is repaired the same way: only the majority's own finiteness counts.
    plan = plan_sync("robust", [9, 7, 7, 7], [False, True, True, True])
    assert (plan.mode, plan.src, plan.minority) == ("majority-copy", 1, [0])


def test_robust_never_copies_a_non_finite_majority() -> None:
    # Three identical replicas holding NaN, one sound: the sound one is copied.
    plan = plan_sync("robust", [7, 7, 7, 9], [False, False, False, True])
    assert (plan.mode, plan.src, plan.minority) == ("finite-copy", 3, [0, 1, 2])
    assert plan.note == "majority is non-finite; non-finite ranks [0, 1, 2] excluded"
    assert [plan.holds_result(r) for r in range(4)] == [False, False, False, True]
    # Two sound replicas that differ: a median, in which the NaN ones vote where finite.
    plan = plan_sync("robust", [7, 7, 7, 9, 8], [False, False, False, True, True])
    assert (plan.mode, plan.sources) == ("median", [0, 1, 2, 3, 4])
    assert plan.note == "majority is non-finite; non-finite ranks [0, 1, 2] outvoted where non-finite"
    # None finite at all: a median of everything, and the note says why not a copy.
    plan = plan_sync("robust", [7, 7, 9], [False] * 3)
    assert (plan.mode, plan.note) == ("median", "majority is non-finite; every rank holds NaN/Inf; where the "
                                                "median is non-finite, the finite values' median")


def test_robust_takes_the_median_without_a_strict_majority() -> None:
    plan = plan_sync("robust", [1, 1, 2, 2], OK4)  # an even split is no majority
    assert (plan.mode, plan.note, plan.src) == ("median", "", -1)
    assert not any(plan.holds_result(r) for r in range(4))
    assert plan_sync("robust", [1, 2, 3], [True] * 3).mode == "median"


def test_world_size_two_breaks_the_tie_with_the_reference() -> None:
    plan = plan_sync("robust", [1, 2], [True, True], with_reference=True)
    assert (plan.mode, plan.sources, plan.reference_ok, plan.note) == ("median-with-reference", [0, 1], True, "")
    plan = plan_sync("robust", [1, 2], [True, True], with_reference=True, reference_ok=False)
    assert (plan.reference_ok, plan.note) == (False, "references disagree; used a zero reference")
    # One of the two non-finite: the other is copied, no reference needed.
    plan = plan_sync("robust", [1, 2], [True, False], with_reference=True)
    assert (plan.mode, plan.src, plan.minority) == ("finite-copy", 0, [1])


def test_broadcast_copies_src_or_the_lowest_finite_rank() -> None:
    plan = plan_sync("broadcast", [1, 2, 3], [True] * 3, src=2)
    assert (plan.mode, plan.src, plan.sources, plan.note) == ("broadcast", 2, [2], "")
    assert [plan.holds_result(r) for r in range(3)] == [False, False, True]
    plan = plan_sync("broadcast", [1, 2, 3], [False, True, False], src=2)
    assert (plan.src, plan.note) == (1, "source rank 2 is non-finite; copied rank 1")
    assert plan_sync("broadcast", [1, 2, 3, 4], [True, True, False, True], src=2).src == 0  # the lowest
    with pytest.raises(RuntimeError, match="mode='broadcast'.*no replica is finite.*restore a checkpoint"):
        plan_sync("broadcast", [1, 2], [False, False])


def test_mean_averages_the_finite_replicas_only() -> None:
    plan = plan_sync("mean", [1, 2, 3, 4], [True, False, True, True])
    assert (plan.mode, plan.sources, plan.count, plan.src) == ("mean", [0, 2, 3], 3, 0)
    assert plan.note == "non-finite ranks [1] excluded"
    assert not any(plan.holds_result(r) for r in range(4))
    assert plan_sync("mean", [1, 2], [False, True]).src == 1  # integer tensors come from a finite rank
    assert plan_sync("mean", [1, 2], [True, True]).note == ""  # every replica finite: nothing excluded
    # No finite replica: nothing to average from, even when they all agree.
    for fps in ([1, 2], [1, 1]):
        with pytest.raises(RuntimeError, match="mode='mean'.*no replica is finite"):
            plan_sync("mean", fps, [False, False])


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("median", [1, 2], [True, True]), {}, "mode must be one of"),
        (("robust", [], []), {}, "one fingerprint and one finite flag per rank, got 0 and 0"),
        (("robust", [1, 2], [True]), {}, "got 2 and 1"),
        (("robust", [1, 2], [True] * 3), {}, "got 2 and 3"),
        (("broadcast", [1, 2], [True, True]), {"src": 2}, r"src must be a rank in \[0, 2\), got 2"),
        (("broadcast", [1, 2], [True, True]), {"src": -1}, r"src must be a rank in \[0, 2\), got -1"),
    ],
)
def test_bad_inputs_are_refused(args: tuple, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_sync(*args, **kwargs)


def test_buffers_follow_ddps_source_rank() -> None:
    state = plan_sync("robust", [3, 3, 3, 3], OK4)
    buffers = plan_sync("robust", [1, 2, 3, 4], OK4)
    plan = as_ddp_would(buffers, state, source=0)
    assert (plan.mode, plan.src, plan.sources, plan.note) == ("broadcast", 0, [0], "DDP's buffer source, rank 0")
    assert [plan.holds_result(r) for r in range(4)] == [True, False, False, False]
    assert plan.groups == buffers.groups and plan.finite == buffers.finite
    # Not when the source's buffers are non-finite of their own ...
    sick = plan_sync("robust", [1, 2, 3, 4], [False, True, True, True])
    assert as_ddp_would(sick, state, source=0) is sick
    # ... nor when its parameters and optimizer state are about to be repaired ...
    repaired = plan_sync("robust", [9, 3, 3, 3], OK4)
    assert as_ddp_would(buffers, repaired, source=0) is buffers
    assert as_ddp_would(buffers, repaired, source=1).src == 1
    # ... and a majority of the buffers is copied as it is.
    majority = plan_sync("robust", [1, 1, 1, 4], OK4)
    assert as_ddp_would(majority, state, source=3) is majority
    # At world size 2 the reference median gives way to the source's buffers too.
    pair = plan_sync("robust", [1, 2], [True, True], with_reference=True, reference_ok=False)
    assert as_ddp_would(pair, plan_sync("robust", [3, 3], [True, True]), source=1).reference_ok


@settings(max_examples=300, deadline=None)
@given(
    mode=st.sampled_from(["robust", "mean", "broadcast"]),
    fps=st.lists(st.integers(0, 3), min_size=1, max_size=6),
    data=st.data(),
)
def test_nothing_non_finite_is_ever_a_source(mode: str, fps: list[int], data: st.DataObject) -> None:
    """Whatever the replicas: a plan that copies or averages takes only finite replicas,
    a copy's source holds the result and the ranks it repairs do not; a majority copy
    repairs exactly the ranks that differ from the majority, a finite copy all others."""
    ws = len(fps)
    finite = data.draw(st.lists(st.booleans(), min_size=ws, max_size=ws))
    src = data.draw(st.integers(0, ws - 1))
    try:
        plan = plan_sync(mode, fps, finite, src=src, with_reference=mode == "robust" and ws == 2)
    except RuntimeError:
        assert mode in ("mean", "broadcast") and not any(finite)
        return
    assert isinstance(plan, SyncPlan) and sorted(r for g in plan.groups for r in g) == list(range(ws))
    if plan.mode == "noop":
        assert len(set(fps)) == 1
        return
    if plan.mode in COPY_MODES or plan.mode == "mean":
        assert plan.sources and all(finite[r] for r in plan.sources)
    if plan.mode in COPY_MODES:
        assert plan.holds_result(plan.src) and plan.sources == [plan.src]
        assert all(not plan.holds_result(r) for r in plan.minority)
        if plan.mode == "majority-copy":
            assert plan.minority == [r for r in range(ws) if fps[r] != fps[plan.src]]
            assert 2 * (ws - len(plan.minority)) > ws
            assert all(plan.holds_result(r) for r in range(ws) if r not in plan.minority)
        if plan.mode == "finite-copy":
            assert plan.minority == [r for r in range(ws) if r != plan.src]
    if mode == "robust" and plan.mode in ("median", "median-with-reference"):
        assert sum(finite) != 1  # one finite replica is copied instead (none: a median of all)


def test_buffers_are_settled_per_coordinate_only_with_an_agreed_reference() -> None:
    """Two ranks whose buffers' NaN/Inf differ: the median with the last agreed buffers;
    with a zero reference (the references disagree) it would keep neither replica's value
    (a mask's -inf became 0), so the sound replica is copied."""
    plan = plan_sync("robust", [1, 2], [False, True], with_reference=True, per_coordinate=True)
    assert (plan.mode, plan.sources) == ("median-with-reference", [0, 1])  # both vote where finite
    assert plan.note == "non-finite ranks [0] outvoted where non-finite"
    plan = plan_sync("robust", [1, 2], [False, True], with_reference=True, reference_ok=False, per_coordinate=True)
    assert (plan.mode, plan.src) == ("finite-copy", 1)
    # Without a reference there is nothing to take the median with: the sound replica is copied.
    plan = plan_sync("robust", [1, 2], [False, True], per_coordinate=True)
    assert (plan.mode, plan.src) == ("finite-copy", 1)
    # Neither finite: no replica is outvoted, the median with the reference decides.
    plan = plan_sync("robust", [1, 2], [False, False], with_reference=True, per_coordinate=True)
    assert (plan.mode, plan.note) == ("median-with-reference", "every rank holds NaN/Inf")  # as the median says
