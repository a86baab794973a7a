"""Tests for paft.rerun: when a recomputed step counts as the first attempt reproduced."""

from __future__ import annotations

import copy
import math

from paft.consistency import COL_AGG_HI, COL_AGG_LO, COL_FLAGS, COL_STATE_HI, FLAG_STATE_CHECKED
from paft.rerun import close, f64_bits, reproduced, unsteady_ranks

NAN = math.nan


def row(loss: float, local_sq: float = 1.0, agg: float = 1.0, fp: int = 7, state: int = 0,
        flags: int = 0) -> list[int]:
    """A header row: loss, local_sq, agg_norm, the aggregated and state fingerprints, flags, faults."""
    cells = [f64_bits(loss), f64_bits(local_sq), f64_bits(agg)] + [0] * 6
    cells[COL_AGG_HI], cells[COL_AGG_LO] = 0, fp
    cells[COL_STATE_HI] = state
    cells[COL_FLAGS] = f64_bits(float(flags))
    return cells


def test_finite_values_within_the_tolerance_reproduce_and_others_do_not() -> None:
    first = [row(2.0), row(3.0)]
    assert reproduced(first, [row(2.0), row(3.0)])
    assert reproduced(first, [row(2.0 * (1 + 5e-4)), row(3.0)])  # GPU atomics move the low bits
    assert not reproduced(first, [row(2.0 * (1 + 5e-3)), row(3.0)])
    assert not reproduced(first, [row(2.0), row(3.0, fp=8)])  # the replica grouping changed
    assert not reproduced(first, [row(2.0), row(3.0, state=1)])  # the state changed
    assert not reproduced(first, [row(math.inf), row(3.0)])  # finite on one attempt only
    assert not reproduced(first, [row(2.0, agg=math.inf), row(3.0, agg=math.inf)])


def test_close_is_relative_to_the_larger_magnitude_and_never_holds_for_an_infinity() -> None:
    assert close(1.0, 1.0 + 1.0005e-3) and close(1.0 + 1.0005e-3, 1.0)  # 0.9995e-3 of the larger
    assert not close(1.0, 1.0 + 1.002e-3)
    # An infinity would be within any relative tolerance of every value.
    assert not close(2.0, math.inf) and not close(-math.inf, -2.0) and not close(math.inf, math.inf)
    assert not close(NAN, NAN)


def test_a_nan_must_reproduce_bitwise_where_the_other_ranks_are_deterministic() -> None:
    first = [row(NAN), row(3.0)]
    other_nan = [f64_bits(NAN) ^ 1] + row(3.0)[1:]  # a NaN of other bits: another element hit
    assert reproduced(first, [row(NAN), row(3.0)], rows=[0])
    assert not reproduced(first, [other_nan, row(3.0)], rows=[0])
    # Where the other ranks' own values moved (non-deterministic kernels), so does the
    # suspect's aggregated checksum, a sum over the ranks: NaN again is data.
    moved = [row(NAN, fp=8), row(3.0 * (1 + 1e-6), fp=8)]
    assert reproduced(first, moved, rows=[0])
    assert not reproduced(first, [row(5.0, fp=8), row(3.0 * (1 + 1e-6), fp=8)], rows=[0])
    # In kind: a NaN of other bits, an infinity again; not where its state moved.
    assert reproduced(first, [other_nan, row(3.0 * (1 + 1e-6))], rows=[0])
    inf_first = [row(math.inf, local_sq=2.0), row(3.0)]
    assert reproduced(inf_first, [row(math.inf, local_sq=2.0 * (1 + 1e-6)), row(3.0 * (1 + 1e-6))], rows=[0])
    checked = [row(NAN, state=5, flags=FLAG_STATE_CHECKED), row(3.0, state=5, flags=FLAG_STATE_CHECKED)]
    assert not reproduced(checked, [row(NAN, state=6, flags=FLAG_STATE_CHECKED),
                                    row(3.0 * (1 + 1e-6), state=5, flags=FLAG_STATE_CHECKED)], rows=[0])
    # Another rank's fault on one attempt moved its aggregate: that takes no part either.
    hit = [row(NAN, agg=5e30, fp=9), row(3.0, local_sq=9e60, agg=5e30, fp=9)]
    assert reproduced(hit, first, rows=[0])


def test_every_suspect_must_reproduce_not_only_the_first_in_kind() -> None:
    # Rank 2's own values moved (non-deterministic kernels): rank 0's NaN coming back in
    # kind is data, but rank 1, the other suspect, moved past the tolerance.
    first = [row(NAN), row(3.0), row(4.0)]
    moved = [row(NAN), row(3.0 * (1 + 1e-2)), row(4.0 * (1 + 1e-6))]
    assert not reproduced(first, moved, rows=[0, 1])
    assert reproduced(first, [row(NAN), row(3.0 * (1 + 1e-6)), row(4.0 * (1 + 1e-6))], rows=[0, 1])


def test_only_the_suspects_rows_count_when_both_attempts_name_them() -> None:
    """A transient fault on another rank's first attempt does not make bad data persistent."""
    first = [row(NAN), row(3.0, fp=9), row(3.0)]
    again = [row(NAN), row(3.0), row(3.0)]
    assert reproduced(first, again, rows=[0])
    assert not reproduced(first, again)


def test_state_columns_take_no_part_when_only_the_rerun_checked_the_state() -> None:
    checked = FLAG_STATE_CHECKED
    first = [row(2.0), row(3.0)]
    assert reproduced(first, [row(2.0, state=5, flags=checked), row(3.0, state=5, flags=checked)])
    both = [row(2.0, state=5, flags=checked), row(3.0, state=5, flags=checked)]
    assert reproduced(both, both)
    assert not reproduced(both, [row(2.0, state=6, flags=checked), row(3.0, state=6, flags=checked)])


def test_a_flags_cell_corrupted_into_a_non_integer_reads_as_every_non_finite_flag() -> None:
    # The control collective itself hit: the view reads such a cell as "every non-finite
    # flag" (ControlView.flags), and the rerun comparison must read it alike, not raise.
    bad = row(2.0)
    bad[COL_FLAGS] = f64_bits(NAN)
    assert reproduced([bad, row(1.0)], [bad, row(1.0)])
    assert not reproduced([row(2.0), row(1.0)], [bad, row(1.0)])
    assert not reproduced([bad, row(1.0)], [row(2.0, flags=7), row(1.0)])  # bits differ


def test_the_attempts_rows_are_left_as_they_were() -> None:
    # The guard keeps a rerun's rows as the next rerun's first attempt.
    checked = FLAG_STATE_CHECKED
    first = [row(NAN, fp=8), row(3.0)]
    again = [row(NAN, state=5, flags=checked), row(3.0 * (1 + 1e-6), state=5, flags=checked)]
    copies = copy.deepcopy((first, again))
    assert reproduced(first, again, rows=[0]) and not reproduced(first, again)
    assert (first, again) == copies


def test_unsteady_ranks_are_those_moved_outside_the_steady_ranks_range() -> None:
    first = [row(2.0), row(2.5), row(3.0), row(9.0)]
    assert unsteady_ranks(first, [row(2.0), row(2.5), row(3.0), row(11.0)]) == [3]
    assert unsteady_ranks(first, [row(2.0), row(2.5), row(3.0), row(2.7)]) == []  # moved back into range
    assert unsteady_ranks(first, [row(2.0), row(2.5), row(3.0), row(1.0)]) == [3]  # below the range
    assert unsteady_ranks(first, [row(2.1), row(2.6), row(3.1), row(11.0)]) == []  # every rank moved
