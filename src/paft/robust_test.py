"""Tests for paft.robust: the coordinate-wise merges against sorting, NaN and outliers,
and the fallback where a median comes out non-finite."""

from __future__ import annotations

import doctest
import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paft import robust
from paft.robust import (
    finite_where_outvoted_,
    median_of_finite,
    median_of_three,
    replica_median,
    sound_where_it_can_tell_,
)

nan, inf = math.nan, math.inf


def test_replica_median_matches_sort_and_nan_loses():
    torch.manual_seed(0)
    for n in (2, 3, 4, 5, 6, 8, 17, 18):
        for nan_free in (False, True):
            rows = torch.randn(n, 1000)
            rows[-1, 10:20] = -math.inf
            if not nan_free:
                rows[0, :10] = math.nan
            ranked = torch.sort(torch.where(rows.isnan(), math.inf, rows), dim=0).values
            lo = ranked[(n - 1) // 2]
            hi = ranked[n // 2]  # == lo for odd n
            expected = torch.where(hi.abs() < lo.abs(), hi, lo)
            before = rows.clone()
            assert torch.equal(replica_median(rows, nan_free=nan_free), expected), n
            out = torch.empty(1000)
            assert replica_median(rows, out=out, nan_free=nan_free) is out and torch.equal(out, expected), n
            assert torch.equal(rows.nan_to_num(7.0), before.nan_to_num(7.0)), n  # the input is not sorted in place
    # one outlier on either side never wins for 3+ replicas; the result is a replica value
    rows = torch.tensor([[1.0, 1e30, math.nan], [2.0, 2.0, 2.0], [3.0, 3.0, 3.0]])
    assert replica_median(rows).tolist() == [2.0, 3.0, 3.0]
    ints = torch.tensor([[5, 1], [7, 9], [6, 3]])
    assert replica_median(ints).tolist() == [6, 3]


def _reference_median(column: list[float]) -> float:
    """replica_median's rule for one column, by sorting: NaN as +inf; of an even count's
    middle pair the one of smaller magnitude (the lower on a tie); +inf no row held: NaN."""
    ranked = sorted(inf if math.isnan(v) else v for v in column)
    lo, hi = ranked[(len(column) - 1) // 2], ranked[len(column) // 2]
    m = hi if abs(hi) < abs(lo) else lo
    return nan if m == inf and inf not in column else m


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 20).flatmap(lambda n: st.lists(
    st.lists(st.sampled_from([0.5, -0.5, 2.0, -2.0, 1e30, -1e30, inf, -inf, nan]), min_size=n, max_size=n),
    min_size=1, max_size=6)))
def test_replica_median_is_the_sorted_rule(columns: list[list[float]]) -> None:
    """Every replica count (the 2, 3, 4 formulas, the sorting network, kthvalue), ties of
    equal magnitude, infinities and NaN: the rule by sorting, value for value; without
    NaN, nan_free=True gives the same; median_of_finite is the rule over the finite values."""
    rows = torch.tensor(columns).T.contiguous()
    expected = torch.tensor([_reference_median(c) for c in columns])
    got = replica_median(rows)
    assert torch.equal(got.isnan(), expected.isnan()) and torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0))
    if not rows.isnan().any():
        assert torch.equal(replica_median(rows, nan_free=True), expected)
    finite = torch.tensor([_reference_median(f) if (f := [v for v in c if math.isfinite(v)]) else nan for c in columns])
    got = median_of_finite(rows)
    assert torch.equal(got.isnan(), finite.isnan()) and torch.equal(got.nan_to_num(7.0), finite.nan_to_num(7.0))


def _sign(x: float) -> float:
    return math.copysign(1.0, x)


def _ordered_median(column: list[float]) -> float:
    """The median rule with ``-0.0`` below ``+0.0`` (finite values)."""
    ranked = sorted(column, key=lambda v: (v, _sign(v)))
    lo, hi = ranked[(len(column) - 1) // 2], ranked[len(column) // 2]
    return hi if abs(hi) < abs(lo) else lo


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 18])
def test_a_zeros_sign_is_the_medians_wherever_it_lies_in_the_tensor(n: int) -> None:
    """Replicas holding +0.0 and -0.0 at a coordinate: torch's minimum and maximum return
    either zero, one way in the vector lanes and the other in a chunk's scalar tail, so
    the merged sign depended on the coordinate's place (and on the thread count that
    cuts the chunks: ranks running other counts merged other bits), and two replicas of
    three holding +0.0 could get the third's -0.0. Every column, body and tail alike,
    takes the median with -0.0 below +0.0."""
    width = 1003  # vector lanes and a scalar tail
    for column in itertools.product([0.0, -0.0, 1.0, -1.0], repeat=n if n <= 5 else 1):
        column = [*column, *([0.0, -0.0] * n)][:n]
        rows = torch.tensor(column).unsqueeze(1).repeat(1, width)
        want = _sign(_ordered_median(column))
        for merged in (replica_median(rows), replica_median(rows, nan_free=True), median_of_finite(rows)):
            assert torch.equal(merged.signbit(), torch.full((width,), want < 0)), column
        if n == 3:
            a, b, ref = rows.unbind(0)
            for merged in (median_of_three(a, b, ref), median_of_three(a, b, ref, nan_free=True)):
                assert torch.equal(merged.signbit(), torch.full((width,), want < 0)), column


def test_a_single_replica_median_is_a_copy() -> None:
    """The result is written into afterwards (finite_where_outvoted_): it must not be a
    view of ``rows``, also where no NaN pass copied them (nan_free, integers)."""
    for rows in (torch.tensor([[1.0, 2.0]]), torch.tensor([[1, 2]])):
        for nan_free in (False, True):
            merged = replica_median(rows, nan_free=nan_free)
            merged[0] = 9
            assert rows.tolist() == [[1, 2]], (rows.dtype, nan_free)


def test_an_even_split_keeps_the_value_a_flipped_exponent_did_not_enlarge() -> None:
    """2 ranks of 4 holding -1e30 took the coordinate: the lower middle value is theirs."""
    for bad in (-1e30, 1e30, math.inf, -math.inf, math.nan):
        rows = torch.tensor([[0.5], [0.5], [bad], [bad]])
        assert replica_median(rows).tolist() == [0.5], bad
        assert replica_median(rows.flip(0)).tolist() == [0.5], bad


@pytest.mark.parametrize("values", [
    [1.0, -1.0],
    [-5.0, -1.0, 1.0, 5.0],  # four replicas' middle pair comes out as (1, -1): ordered before the tie
    [5.0, 4.0, 1.0, -1.0, -4.0, -5.0],
    [float(v) for v in range(-9, 10) if v],  # 18 replicas: past the sorting network
])
def test_middle_values_of_equal_magnitude_give_the_lower(values: list[float]) -> None:
    assert replica_median(torch.tensor(values).unsqueeze(1)).tolist() == [-1.0]


def test_median_of_finite_values_only() -> None:
    cols = torch.tensor([[inf, 1.0, 2.0, -1.0, nan],
                         [inf, nan, 1.0, 1.0, -inf],
                         [3.0, 2.0, nan, inf, nan]])
    # inf ignored; an even count: the smaller magnitude (1 and 2, either order); on a tie the lower; none: NaN
    assert median_of_finite(cols).nan_to_num(7.0).tolist() == [3.0, 1.0, 1.0, -1.0, 7.0]


def test_median_of_three_is_clamp_of_reference():
    a = torch.tensor([1.0, 1e30, 0.2, -1.0, math.nan, 5.0])
    b = torch.tensor([1.1, 0.1, 0.4, 1.0, 0.3, 5.0])
    r = torch.tensor([0.9, 0.0, 0.3, 0.0, 0.25, 4.0])
    out = median_of_three(a, b, r)
    # same direction -> the replica that moved less; opposite -> the reference;
    # the huge and the NaN coordinate are dropped
    assert out.tolist() == pytest.approx([1.0, 0.1, 0.3, 0.0, 0.3, 5.0])
    assert a[1].item() > 1e29 and math.isnan(a[4].item())  # inputs untouched


def test_a_reference_nan_is_no_value_of_the_nan_free_median() -> None:
    """Replicas free of NaN (nan_free: the sync's finite flags), the reference NaN where
    both ranks once held a NaN alike: min/max propagated it, and both ranks took a NaN
    neither held. NaN counts as +inf there too: the larger replica value, as without
    nan_free."""
    a = torch.tensor([1.0, 3.0, -inf, nan])
    b = torch.tensor([2.0, -1.0, 4.0, nan])  # a NaN both replicas hold alike stays
    ref = torch.tensor([nan, nan, nan, 0.0])
    for nan_free in (True, False):
        out = median_of_three(a, b, ref, nan_free=nan_free)
        assert out.nan_to_num(7.0).tolist() == [2.0, 3.0, 4.0, 7.0], nan_free


_values = st.sampled_from([0.5, -2.0, 3.0, 1e30, -1e30, inf, -inf])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_values, _values, st.one_of(_values, st.just(nan)), st.booleans()), min_size=1, max_size=20))
def test_median_of_three_nan_free_is_the_same_median(cols: list[tuple[float, float, float, bool]]) -> None:
    """nan_free=True (replicas NaN only where both are, the reference anything) gives
    the median of nan_free=False, one of the three inputs' values with NaN as +inf,
    except that a NaN both replicas hold stays NaN even beside a reference's +inf."""
    both = torch.tensor([c[3] for c in cols])
    a, b, ref = (torch.tensor([nan if c[3] and i < 2 else c[i] for c in cols]) for i in range(3))
    fast, slow = median_of_three(a, b, ref, nan_free=True), median_of_three(a, b, ref)
    assert torch.equal(fast.isnan(), both | slow.isnan())
    assert torch.equal(fast[~both], slow[~both])
    for x, y, r, m in zip(a[~both].tolist(), b[~both].tolist(), ref[~both].tolist(), fast[~both].tolist()):
        assert m == sorted(inf if math.isnan(v) else v for v in (x, y, r))[1]


def test_a_median_where_every_replica_holds_nan_somewhere_spreads_none() -> None:
    """No replica entirely finite: a coordinate NaN on 2 of 3 ranks kept the median's +inf
    and copied it onto the rank that was finite there."""
    rows = torch.tensor([[math.nan, 1.0, 2.0, -math.inf],
                         [0.0, math.nan, 7.0, -math.inf],
                         [0.0, math.nan, 2.0, -math.inf]])
    merged = replica_median(rows)
    finite_where_outvoted_(merged, rows, good=[])
    # The finite value where one rank had one; a -inf every replica holds (a mask) stays.
    assert merged.tolist() == [0.0, 1.0, 2.0, -math.inf]
    # An even split of the finite values: the smaller magnitude wins, as in replica_median.
    rows = torch.tensor([[math.nan, 0.0], [math.nan, 0.0], [math.nan, 1.0], [1.0, math.nan], [-1e30, math.nan]])
    merged = replica_median(rows)
    finite_where_outvoted_(merged, rows, good=[])
    assert merged.tolist() == [1.0, 1.0]  # (the second: NaN counts as +inf, 1 is the middle of 5)


def test_a_median_that_comes_out_of_nan_is_nan_never_an_infinity_no_input_held() -> None:
    """NaN counts as +inf inside the median: where enough inputs held NaN to take it, the
    +inf leaked out as a value no replica held (both replicas NaN at world size 2)."""
    a = torch.tensor([nan, nan, nan, inf, 1.0, nan, -inf, 1.0])
    b = torch.tensor([nan, nan, inf, nan, nan, 2.0, nan, nan])
    r = torch.tensor([0.3, nan, 1.0, nan, nan, 0.5, 0.5, inf])
    out = torch.empty(8)
    assert median_of_three(a, b, r, out=out) is out
    # NaN on both replicas stays NaN (reference finite or not); a real +inf, whichever input holds it, stays +inf
    assert out.nan_to_num(nan=7.0, posinf=inf).tolist() == [7.0, 7.0, inf, inf, 7.0, 2.0, 0.5, inf]
    rows = torch.tensor([[nan, nan, inf, nan, 1.0], [nan, inf, nan, nan, nan], [nan, nan, nan, inf, 3.0]])
    merged = replica_median(rows)
    assert merged.nan_to_num(nan=7.0, posinf=inf).tolist() == [7.0, inf, inf, inf, 3.0]
    finite_where_outvoted_(merged, rows, good=[])  # NaN or +inf on every replica: nothing finite to take
    assert merged.nan_to_num(nan=7.0, posinf=inf).tolist() == [7.0, inf, inf, inf, 3.0]
    out = torch.empty(3)
    assert replica_median(torch.tensor([[nan, -inf, 2.0]]), out=out) is out  # a single replica: its own values
    assert out.nan_to_num(nan=7.0, neginf=-inf).tolist() == [7.0, -inf, 2.0]


def test_a_median_outvoted_by_non_finite_values_takes_the_finite_replicas_median() -> None:
    """Rank 3 alone is finite everywhere: where NaN (as +inf) or -inf took the median,
    its value replaces it, not the median of every finite value there (which would take
    rank 4's 1.0 or 2.0, from a replica holding NaN elsewhere)."""
    rows = torch.tensor([[nan, -inf, 0.0],
                         [nan, -inf, 0.0],
                         [nan, -inf, 0.0],
                         [4.0, 3.0, 0.0],
                         [1.0, 2.0, nan]])
    merged = replica_median(rows)
    finite_where_outvoted_(merged, rows, good=[3])
    assert merged.tolist() == [4.0, 3.0, 0.0]


def test_sound_copy_is_taken_except_where_the_other_holds_an_infinity() -> None:
    merged = torch.zeros(6)
    sound = torch.tensor([1.0, 2.0, 3.0, 4.0, -inf, nan])
    other = torch.tensor([9.0, inf, -inf, nan, 3.0, 5.0])
    sound_where_it_can_tell_(merged, sound, other)
    # the other's NaN is no state: the sound value; its infinity, or no finite sound value: the median stays
    assert merged.tolist() == [1.0, 0.0, 0.0, 4.0, 0.0, 0.0]


def test_docstring_example_runs() -> None:
    result = doctest.testmod(robust)
    assert result.attempted >= 1 and result.failed == 0
