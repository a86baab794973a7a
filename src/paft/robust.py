"""Coordinate-wise robust merges of replicas: pure tensor functions, no communication.

PAFT-Sync's ``median`` modes merge replicas that disagree without a majority. Both
merges here return, per coordinate, one of the inputs' own values (never an
average), so a flipped exponent bit (1e30) or a NaN on one replica is never mixed
into the result; NaN counts as +inf, so it loses every comparison it can lose.

- :func:`lower_median`: the ``(n-1)//2``-th smallest of ``n`` rows (world size >= 3);
- :func:`median_of_three`: ``clamp(ref, min(a, b), max(a, b))``, for two replicas and
  the last state both agreed on (world size 2).

Example::

    >>> rows = torch.tensor([[1.0, float("nan")], [3.0, 2.0], [1e30, 5.0]])
    >>> lower_median(rows).tolist()
    [3.0, 5.0]
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["lower_median", "median_of_three"]

# The odd-even transposition network beats torch.kthvalue by ~10x for a handful of
# replicas (it is a few bandwidth-bound min/max passes); beyond this many replicas
# its O(n^2) passes lose to the selection kernel.
_NETWORK_MAX_REPLICAS = 16


def _nan_as_inf(x: Tensor) -> Tensor:
    """``x`` with NaN replaced by +inf (a copy; ``x`` itself if it cannot hold NaN)."""
    if not x.is_floating_point():
        return x
    return torch.nan_to_num(x, nan=math.inf, posinf=math.inf, neginf=-math.inf)


def lower_median(rows: Tensor, out: Tensor | None = None, nan_free: bool = False) -> Tensor:
    """Per column, the lower median of the ``n`` rows (the ``(n-1)//2``-th smallest,
    an actual row's value); NaN counts as +inf. ``rows``: ``[n, m]``, not modified.
    ``nan_free=True`` skips the NaN pass (the caller knows every replica is finite)."""
    n = rows.shape[0]
    work = rows if nan_free else _nan_as_inf(rows)
    if n == 1:
        return work[0].clone() if out is None else out.copy_(work[0])
    if n == 2:
        return torch.minimum(work[0], work[1], out=out)
    if n == 3:  # med3 = max(min(a, b), min(max(a, b), c))
        a, b, c = work.unbind(0)
        hi = torch.maximum(a, b)
        return torch.maximum(torch.minimum(a, b), torch.minimum(hi, c, out=hi), out=out)
    if n == 4:  # 2nd smallest = min(max(min(a, b), min(c, d)), min(max(a, b), max(c, d)))
        a, b, c, d = work.unbind(0)
        s1, s2 = torch.minimum(a, b), torch.minimum(c, d)
        l1, l2 = torch.maximum(a, b), torch.maximum(c, d)
        return torch.minimum(torch.maximum(s1, s2, out=s1), torch.minimum(l1, l2, out=l1), out=out)
    if n > _NETWORK_MAX_REPLICAS:
        v = torch.kthvalue(work, (n - 1) // 2 + 1, dim=0).values
        return v if out is None else out.copy_(v)
    r = list((work.clone() if work is rows else work).unbind(0))
    spare = torch.empty_like(r[0])
    # Odd-even transposition sort: n passes sort n rows; 2 kernels per compare-exchange.
    for p in range(n):
        for i in range(p % 2, n - 1, 2):
            lo = torch.minimum(r[i], r[i + 1], out=spare)
            torch.maximum(r[i], r[i + 1], out=r[i + 1])
            spare, r[i] = r[i], lo
    m = r[(n - 1) // 2]
    return m if out is None else out.copy_(m)


def median_of_three(
    a: Tensor, b: Tensor, ref: Tensor, out: Tensor | None = None, nan_free: bool = False
) -> Tensor:
    """Per coordinate, the median of ``a``, ``b`` and ``ref`` = ``clamp(ref, min(a, b),
    max(a, b))``; NaN counts as +inf. Inputs are not modified."""
    if not nan_free:
        a, b, ref = _nan_as_inf(a), _nan_as_inf(b), _nan_as_inf(ref)
    lo, hi = torch.minimum(a, b), torch.maximum(a, b)
    return torch.minimum(torch.maximum(ref, lo, out=lo), hi, out=out)
