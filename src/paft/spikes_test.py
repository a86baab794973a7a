"""Tests for paft.spikes: the robust running statistics behind the guard's spike rules."""

from __future__ import annotations

import doctest
import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paft import spikes
from paft.spikes import (
    GROSS_FACTOR,
    MAD_TO_STD,
    REL_FLOOR_GRAD,
    REL_FLOOR_LOSS,
    REL_FLOOR_RANK,
    TAIL_FACTOR,
    SpikeWindow,
    cross_rank_limit,
    median,
    median_distance,
    pair_limit,
)

finite = st.floats(-1e6, 1e6) | st.sampled_from([0.0, 1.0, 2.5])


@settings(max_examples=300, deadline=None)
@given(xs=st.lists(finite, min_size=1, max_size=60), center=st.none() | st.floats(-2e6, 2e6))
def test_median_distance_is_the_sorted_definition(xs: list[float], center: float | None) -> None:
    """The O(log n) MAD equals the sort-everything definition bit for bit (ties, repeats,
    a center outside the values, the window's own median)."""
    xs = sorted(xs)
    if center is None:
        center = median(xs)
    assert median_distance(xs, center) == median(sorted(abs(x - center) for x in xs))


@settings(max_examples=200, deadline=None)
@given(size=st.integers(1, 12), ops=st.lists(finite | st.sampled_from([math.nan, math.inf, None]), max_size=40))
def test_window_keeps_the_last_finite_values_and_their_statistics(size: int, ops: list[float | None]) -> None:
    """Past its size (or at drop_oldest, None here) the window drops the oldest value
    from the sorted copy too, and the cached statistics are, after every change, those
    of exactly the values it holds; NaN/Inf never enter."""
    w = SpikeWindow(size)
    expect: list[float] = []
    for x in ops:
        if x is None:
            if expect:
                w.drop_oldest()
                expect.pop(0)
        else:
            w.push(x)
            expect = (expect + [x])[-size:] if math.isfinite(x) else expect
        assert list(w.values) == expect
        if expect:
            med = median(sorted(expect))
            assert w.stats() == (med, median(sorted(abs(x - med) for x in expect)), max(expect))
        else:
            assert w.limit(10, REL_FLOOR_LOSS, armed=True) == math.inf


def test_pushed_values_are_kept_as_python_floats() -> None:
    """A 0-d tensor (a loss not yet read out) or an int enters as a Python float: the
    guard's state_dict saves ``list(w.values)`` as JSON, and the limits are floats, not
    tensors computed in float32."""
    loss = torch.tensor(0.1, dtype=torch.float32)
    w = SpikeWindow(10, [loss, 3, 2.0])
    assert [type(v) for v in w.values] == [float] * 3 and list(w.values) == [float(loss), 3.0, 2.0]
    assert json.loads(json.dumps(list(w.values))) == list(w.values)
    limit = w.limit(10, REL_FLOOR_LOSS, armed=True)
    assert type(limit) is float and limit == SpikeWindow(10, [float(loss), 3.0, 2.0]).limit(10, REL_FLOOR_LOSS, True)


def test_limit_is_median_plus_floored_mads_or_the_tail() -> None:
    w = SpikeWindow(100, [10.0, 10.0, 10.0, 11.0, 9.0])  # median 10, MAD 0 -> the 5% floor
    assert w.limit(10, REL_FLOOR_LOSS, armed=True) == 10 + max(10 * 0.05 * 10, 3 * (11 - 10))
    spread = SpikeWindow(100, [0.0, 10.0, 20.0])  # median 10, MAD 10
    assert spread.limit(2, REL_FLOOR_LOSS, armed=True, tail=1.0) == 10 + 2 * MAD_TO_STD * 10
    assert w.limit(10, REL_FLOOR_LOSS, armed=False) == 11 + GROSS_FACTOR * 11  # warm-up: gross jumps only
    # One earlier excursion, MAD 0: the tail (3 x the max's distance) is above 10 floors.
    tail = SpikeWindow(100, [1.0] * 9 + [5.0])
    assert tail.limit(10, REL_FLOOR_LOSS, armed=True) == 1 + 3 * (5 - 1)


@pytest.mark.parametrize("values, limit", [
    ([0.0] * 9 + [1.0], 3.0),  # median and MAD 0: the tail alone, 3 x (1 - 0)
    ([4.0] * 5, 4.0 + 10 * 0.05 * 4.0),  # no excursion: the relative floor alone
])
def test_either_the_floor_or_the_tail_gives_a_scale(values: list[float], limit: float) -> None:
    assert SpikeWindow(100, values).limit(10, REL_FLOOR_LOSS, armed=True) == limit


def test_a_negative_series_scales_by_its_magnitude() -> None:
    """A loss can be negative (a continuous density's NLL): the floor and the warm-up
    reach are magnitudes, so the limit still lies above the values."""
    w = SpikeWindow(100, [-10.0, -10.0, -10.0, -9.0, -11.0])  # median -10, MAD 0, max -9
    assert w.limit(10, REL_FLOOR_LOSS, armed=True) == -10 + 10 * 0.05 * 10
    assert w.limit(10, REL_FLOOR_LOSS, armed=False) == -9 + GROSS_FACTOR * 10
    assert cross_rank_limit([-4.0, -4.0, -4.0, -5.0], 20, armed=True) == -4 + 20 * 0.25 * 4
    assert cross_rank_limit([-4.0, -4.0, -5.0], 20, armed=False) == -4 + GROSS_FACTOR * 4


def test_an_all_zero_history_fires_only_past_the_gross_factor() -> None:
    """A hinge loss at its floor: no scale to judge a rise by, so a small positive value
    is not a spike (it was, against a limit of 1e-11), while a flipped exponent is."""
    w = SpikeWindow(50, [0.0] * 30)
    for armed in (True, False):
        limit = w.limit(10, REL_FLOOR_LOSS, armed)
        assert limit == GROSS_FACTOR and 0.5 < limit < 1e36
    assert cross_rank_limit([0.0, 0.0, 0.0], 20, armed=True) == GROSS_FACTOR


def test_cross_rank_limit_is_the_median_plus_floored_mads() -> None:
    assert cross_rank_limit([1.0, 2.0, 3.0, 4.0, 100.0], 20, armed=True) == 3 + 20 * MAD_TO_STD * 1.0
    assert cross_rank_limit([4.0, 4.0, 4.0, 5.0], 20, armed=True) == 4 + 20 * REL_FLOOR_RANK * 4  # MAD 0: the floor


def test_cross_rank_limit_ignores_non_finite_values() -> None:
    assert cross_rank_limit([math.nan, math.inf], 20, armed=True) == math.inf
    assert cross_rank_limit([2.0, math.nan, 2.0, 2.0], 20, armed=True) == cross_rank_limit([2.0] * 3, 20, armed=True)
    assert cross_rank_limit([2.0, 2.0, 2.0], 20, armed=False) == 2.0 + GROSS_FACTOR * 2.0


@pytest.mark.parametrize("values, limit", [
    ([1.0, 2.0, 40.0], 2.0 + GROSS_FACTOR * 2.0),  # above the median, not the outlier
    ([0.0, 0.0, 5.0], GROSS_FACTOR),  # a median of 0: no scale
])
def test_cross_rank_warm_up_limit_is_a_gross_jump_above_the_median(values: list[float], limit: float) -> None:
    assert cross_rank_limit(values, 20, armed=False) == limit


@pytest.mark.parametrize("values, limit", [
    ([3.0, 2.0], 2.0 + GROSS_FACTOR * 2.0),  # above the smaller: a bit-30 value cannot raise it
    ([-2.0, math.inf, 3.0], -2.0 + GROSS_FACTOR * 2.0),
    ([0.0, 5.0], GROSS_FACTOR),
    ([2.0, math.nan], math.inf),  # one finite value: nothing to compare to
    ([], math.inf),
])
def test_pair_limit_is_a_gross_jump_above_the_smaller_value(values: list[float], limit: float) -> None:
    assert pair_limit(values) == limit


def test_documented_floors_and_factors() -> None:
    assert (MAD_TO_STD, REL_FLOOR_LOSS, REL_FLOOR_GRAD, REL_FLOOR_RANK, TAIL_FACTOR, GROSS_FACTOR) == (
        1.4826, 0.05, 0.5, 0.25, 3.0, 1e4
    )


def test_docstring_examples_run() -> None:
    result = doctest.testmod(spikes)
    assert result.attempted >= 3 and result.failed == 0
