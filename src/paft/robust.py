"""Coordinate-wise robust merges of replicas: pure tensor functions, no communication.

PAFT-Sync's ``median`` modes merge replicas that disagree without a majority. Every
merge here returns, per coordinate, one of the inputs' own values (never an
average), so a flipped exponent bit (1e30) or a NaN on one replica is never mixed
into the result; NaN counts as +inf, so it loses every comparison it can lose. Where
the result comes out +inf and no input holds +inf there (a coordinate NaN on enough
replicas to take the median), it is NaN: never a value no replica held. A zero's sign
is a median's too: ``-0.0`` counts below ``+0.0`` (torch's minimum and maximum return
either of two zeros, by vector lane or scalar tail, so the sign came from a value's
place in a thread's share of the tensor, and ranks running other thread counts merged
other bits).

- :func:`replica_median`: the middle of ``n`` rows (world size >= 3); of the two middle
  values of an even ``n``, the one of smaller magnitude;
- :func:`median_of_finite`: the same over each column's finite values only;
- :func:`median_of_three`: ``clamp(ref, min(a, b), max(a, b))``, for two replicas and
  the last state both agreed on (world size 2);
- :func:`finite_where_outvoted_` and :func:`sound_where_it_can_tell_`: where replicas
  hold NaN/Inf of their own, what replaces a median that came out non-finite, and
  which of two ranks' buffers a median with the reference may overrule.

Example::

    >>> rows = torch.tensor([[1.0, float("nan")], [3.0, 2.0], [1e30, 5.0]])
    >>> replica_median(rows).tolist()
    [3.0, 5.0]
    >>> replica_median(torch.tensor([[1.0], [1.0], [-1e30], [-1e30]])).tolist()  # an even split
    [1.0]
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "replica_median",
    "median_of_finite",
    "median_of_three",
    "finite_where_outvoted_",
    "sound_where_it_can_tell_",
]

# The odd-even transposition network beats torch.kthvalue by ~10x for a handful of
# replicas (it is a few bandwidth-bound min/max passes); beyond this many replicas
# its O(n^2) passes lose to the selection kernel.
_NETWORK_MAX_REPLICAS = 16


def _nan_as_inf(x: Tensor) -> Tensor:
    """``x`` with NaN replaced by +inf (a copy; ``x`` itself if it cannot hold NaN)."""
    if not x.is_floating_point():
        return x
    return torch.nan_to_num(x, nan=math.inf, posinf=math.inf, neginf=-math.inf)


def _nan_where_no_input_is_inf_(merged: Tensor, inputs: list[Tensor]) -> Tensor:
    """``merged``, a median taken with NaN counted as +inf, with NaN put back in place,
    in place: where it is +inf but no input is, the inputs it came from held NaN."""
    if not merged.is_floating_point():
        return merged
    held = torch.isposinf(inputs[0])
    for x in inputs[1:]:
        held |= torch.isposinf(x)
    return merged.masked_fill_(torch.isposinf(merged) & ~held, math.nan)


def replica_median(rows: Tensor, out: Tensor | None = None, nan_free: bool = False) -> Tensor:
    """Per column, the median of the ``n`` rows, always one row's own value; NaN counts
    as +inf (a median that came out of NaN is NaN). For odd ``n`` the middle value; for
    even ``n``, of the two middle values the one of smaller magnitude, so that where the
    replicas split evenly a flipped exponent that enlarged a value (``-1e30``, ``inf``)
    loses the tie on either side (the lower middle value alone would take ``-1e30`` from
    two ranks of four).
    ``rows``: ``[n, m]``, not modified. ``nan_free=True`` skips the NaN pass (the
    caller knows every replica is finite)."""
    inputs = list(rows.unbind(0))
    if nan_free:
        merged = _median_of_rows(rows, rows, out)
    else:
        merged = _nan_where_no_input_is_inf_(_median_of_rows(rows, _nan_as_inf(rows), out), inputs)
    return _zero_signs_by_order_(merged, inputs, (rows.shape[0] - 1) // 2)


def _median_of_rows(rows: Tensor, work: Tensor, out: Tensor | None) -> Tensor:
    """:func:`replica_median` of ``work``: ``rows``, or a copy of it without NaN."""
    n = rows.shape[0]
    if n == 1:
        return work[0].clone() if out is None else out.copy_(work[0])
    lo, hi = _middle(work, owned=work is not rows)
    if hi is None:
        return lo if out is None else out.copy_(lo)  # _middle never hands back out itself
    return _smaller(lo, hi, out)


def median_of_finite(cols: Tensor) -> Tensor:
    """Per column, the median of its finite values only (their count varies by column),
    by :func:`replica_median`'s rule: of an even count's two middle values, the one of
    smaller magnitude; NaN where a column has no finite value."""
    finite = torch.isfinite(cols)
    kept = torch.where(finite, cols, math.nan)
    # torch's nanmedian is the lower median of the non-NaN values; negated, the upper.
    merged = _smaller(kept.nanmedian(dim=0).values, -(-kept).nanmedian(dim=0).values)
    return _zero_signs_by_order_(merged, list(kept.unbind(0)), (finite.sum(0) - 1) // 2)


def _zero_signs_by_order_(merged: Tensor, inputs: list[Tensor], k: int | Tensor) -> Tensor:
    """``merged``, a median of ``inputs`` (its ``k``-th smallest, or of an even count the
    smaller of the ``k``-th and the next), with the sign of each zero it holds set in
    place as that median takes it with ``-0.0`` below ``+0.0``: the same bits on every
    rank, and where most inputs hold one zero, theirs. ``k``: one for all coordinates,
    or one per coordinate."""
    if not merged.is_floating_point():
        return merged
    zero = merged == 0
    if not bool(zero.any()):
        return merged
    below = torch.zeros(int(zero.sum()), dtype=torch.int64, device=merged.device)
    negative_zeros = torch.zeros_like(below)
    for x in inputs:
        v = x[zero]
        below += v < 0  # NaN neither below nor a zero
        negative_zeros += (v == 0) & v.signbit()
    # The zero taken is the k-th smallest, or the next one where the k-th is negative (an
    # even count's smaller magnitude): place max(k, below), a -0.0 where -0.0s reach it.
    place = torch.clamp(below, min=k) if isinstance(k, int) else torch.maximum(below, k[zero])
    merged[zero] = torch.where(below + negative_zeros > place, -0.0, 0.0).to(merged.dtype)
    return merged


def _smaller(lo: Tensor, hi: Tensor, out: Tensor | None = None) -> Tensor:
    """Per coordinate, of ``lo`` and ``hi`` the one of smaller magnitude (``lo`` on a tie)."""
    smaller = hi.abs() < lo.abs()
    return torch.where(smaller, hi, lo) if out is None else torch.where(smaller, hi, lo, out=out)


def _middle(work: Tensor, owned: bool) -> tuple[Tensor, Tensor | None]:
    """The ``(n-1)//2``-th smallest of the rows, and for even ``n`` the ``n//2``-th
    (``owned``: ``work`` is a copy the sort may scramble)."""
    n = work.shape[0]
    if n == 2:
        return torch.minimum(work[0], work[1]), torch.maximum(work[0], work[1])
    if n == 3:  # med3 = max(min(a, b), min(max(a, b), c))
        a, b, c = work.unbind(0)
        hi = torch.maximum(a, b)
        return torch.maximum(torch.minimum(a, b), torch.minimum(hi, c, out=hi)), None
    if n == 4:  # the middle two: max(min(a, b), min(c, d)) and min(max(a, b), max(c, d)), in order
        a, b, c, d = work.unbind(0)
        x = torch.maximum(torch.minimum(a, b), torch.minimum(c, d))
        y = torch.minimum(torch.maximum(a, b), torch.maximum(c, d))
        return torch.minimum(x, y), torch.maximum(x, y)
    k = (n - 1) // 2
    if n > _NETWORK_MAX_REPLICAS:
        lo = torch.kthvalue(work, k + 1, dim=0).values
        return lo, (torch.kthvalue(work, k + 2, dim=0).values if n % 2 == 0 else None)
    r = list((work if owned else work.clone()).unbind(0))
    spare = torch.empty_like(r[0])
    # Odd-even transposition sort: n passes sort n rows; 2 kernels per compare-exchange.
    for p in range(n):
        for i in range(p % 2, n - 1, 2):
            lo = torch.minimum(r[i], r[i + 1], out=spare)
            torch.maximum(r[i], r[i + 1], out=r[i + 1])
            spare, r[i] = r[i], lo
    return r[k], (r[k + 1] if n % 2 == 0 else None)


def median_of_three(
    a: Tensor, b: Tensor, ref: Tensor, out: Tensor | None = None, nan_free: bool = False
) -> Tensor:
    """Per coordinate, the median of ``a``, ``b`` and ``ref`` = ``clamp(ref, min(a, b),
    max(a, b))``; NaN counts as +inf, and a +inf median is NaN where no input holds +inf
    (both replicas hold NaN: NaN, as they hold it; with ``ref`` at +inf: +inf). Inputs
    are not modified. ``nan_free=True`` skips the NaN pass: the caller knows ``a`` and
    ``b`` hold NaN only where both do (the sync's finite flags), and there the result is
    NaN; ``ref`` may hold NaN anywhere (the last agreed state held a NaN alike on both
    ranks), still counted as +inf."""
    if nan_free:
        merged = _clamp(a, b, ref, out)
    else:
        merged = _nan_where_no_input_is_inf_(_clamp(_nan_as_inf(a), _nan_as_inf(b), _nan_as_inf(ref), out), [a, b, ref])
    return _zero_signs_by_order_(merged, [a, b, ref], 1)


def _clamp(a: Tensor, b: Tensor, ref: Tensor, out: Tensor | None) -> Tensor:
    """``clamp(ref, min(a, b), max(a, b))``: a NaN in ``ref`` gives ``max(a, b)``, as
    +inf would (``fmin`` passes over it), a NaN in ``a`` or ``b`` propagates."""
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    return torch.maximum(torch.fmin(ref, hi, out=hi), lo, out=out)


def finite_where_outvoted_(merged: Tensor, rows: Tensor, good: list[int]) -> None:
    """Fix, in place, the coordinates where :func:`replica_median` of ``rows`` gave
    ``merged`` a non-finite value. Per coordinate NaN counts as +inf in the median, so a
    replica holding NaN or Inf somewhere still votes everywhere else (dropping it whole
    left two replicas with three ranks, whose lower median is their minimum: a -1e30 on
    the other won). Where so many values are non-finite that the median is too, take the
    median of the finite (``good``) replicas instead; with none, the median of the
    coordinate's finite values (a coordinate non-finite on every replica, a mask's
    -inf, stays): nothing non-finite spreads."""
    bad = ~torch.isfinite(merged)
    if not bool(bad.any()):
        return
    if good:
        merged[bad] = replica_median(rows[:, bad][good], nan_free=True)  # the bad columns first: a small gather
        return
    values = median_of_finite(rows[:, bad])  # NaN where no replica is finite: kept as it was
    merged[bad] = torch.where(torch.isnan(values), merged[bad], values)


def sound_where_it_can_tell_(merged: Tensor, sound: Tensor, other: Tensor) -> None:
    """Two ranks' buffers, one with NaN/Inf of its own (see
    :func:`paft.sync_plan.plan_sync`'s ``per_coordinate``), ``merged`` their
    :func:`median_of_three` with the reference: write into ``merged`` the sound copy's
    values, as a copy of it would give, except where the other holds an infinity the
    sound one lacks. There the median with the reference stays: a mask's -inf that the
    sound-looking copy lost comes back. A NaN is never state: there the sound value."""
    take = torch.isfinite(sound) & ~torch.isinf(other)
    merged[take] = sound[take]
