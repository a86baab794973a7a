"""Robust running statistics for the guard's spike and rank-outlier detectors.

Pure logic over plain floats: what counts as an upward spike of a series (the loss,
the aggregated gradient norm, the update-to-weight ratio, the ranks' local values)
against the recent accepted values, and one rank's value against its peers'.

History limit (only accepted, clean steps enter a window; upward only)::

    limit = median + max(T * max(1.4826 * MAD, rel * |median|),
                         TAIL_FACTOR * (window max - median))

``T`` is the caller's threshold; ``rel`` its relative floor: REL_FLOOR_LOSS (5%) for
the loss, REL_FLOOR_GRAD (50%) for norms and the update ratio, REL_FLOOR_RANK (25%)
for per-rank values. The relative floor keeps steady series from firing on tiny
noise; the tail term keeps heavy-tailed, bimodal series (near-zero losses with an
occasional hard batch) from firing on values the window has already seen. Until the
caller arms the rule (its warm-up) only a gross jump fires: above GROSS_FACTOR (1e4)
times the largest accepted value (or the ranks' median, :func:`cross_rank_limit`). A
history (or set of ranks' values) that is all exactly 0 -- a hinge or margin loss at
its floor, and the zero gradients it gives -- has no scale to judge a rise by; then
only a value past GROSS_FACTOR itself fires, so a legitimate small positive loss is
not a spike, while a flipped exponent of a nonzero value (~1e38) still is. A flip of
an exact 0 gives at most 2.0 and passes there.

Example::

    >>> w = SpikeWindow(100, [1.0, 1.1, 0.9, 1.0, 1.05])
    >>> round(w.limit(threshold=10, rel=REL_FLOOR_LOSS, armed=True), 3)
    1.741
    >>> w.limit(threshold=10, rel=REL_FLOOR_LOSS, armed=False)   # warm-up: gross jumps only
    11001.1
    >>> cross_rank_limit([2.0, 2.1, 1.9, 40.0], threshold=20, armed=True)
    12.3
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable

__all__ = [
    "MAD_TO_STD",
    "pair_limit",
    "REL_FLOOR_LOSS",
    "REL_FLOOR_GRAD",
    "REL_FLOOR_RANK",
    "TAIL_FACTOR",
    "GROSS_FACTOR",
    "SpikeWindow",
    "cross_rank_limit",
    "median",
    "median_distance",
]

MAD_TO_STD = 1.4826  # MAD of a normal distribution times this is its standard deviation
REL_FLOOR_LOSS = 0.05  # default T=10: the loss must rise >= 50% over its median
REL_FLOOR_GRAD = 0.5  # norms / update ratios: >= 6x the median (clipping absorbs less)
REL_FLOOR_RANK = 0.25  # local values (one rank's batch) noisier still: T=20 -> >= 6x
TAIL_FACTOR = 3.0  # exceed the window's largest excursion above its median 3x over
GROSS_FACTOR = 1e4  # warm-up: only jumps no clean step makes (a bit-30 flip is ~1e38x)


class SpikeWindow:
    """The last ``size`` accepted finite values, kept sorted too, with cached robust statistics."""

    def __init__(self, size: int, values: Iterable[float] = ()) -> None:
        self.values: deque[float] = deque(maxlen=size)
        self._sorted: list[float] = []
        self._stats: tuple[float, float, float] | None = None
        for v in values:
            self.push(v)

    def push(self, x: float) -> None:
        """Add ``x`` (dropping the oldest value of a full window); a NaN/Inf is ignored."""
        if math.isfinite(x):
            x = float(x)
            if len(self.values) == self.values.maxlen:
                del self._sorted[bisect.bisect_left(self._sorted, self.values[0])]
            self.values.append(x)
            bisect.insort(self._sorted, x)
            self._stats = None

    def drop_oldest(self) -> None:
        """Remove the oldest value (the window must not be empty)."""
        del self._sorted[bisect.bisect_left(self._sorted, self.values.popleft())]
        self._stats = None

    def stats(self) -> tuple[float, float, float]:
        """(median, MAD, max); call only when non-empty."""
        if self._stats is None:
            xs = self._sorted
            med = median(xs)
            self._stats = (med, median_distance(xs, med), xs[-1])
        return self._stats

    def limit(self, threshold: float, rel: float, armed: bool, tail: float = TAIL_FACTOR) -> float:
        """The value above which ``x`` is an upward spike; ``inf`` with nothing to compare to."""
        if not self.values:
            return math.inf
        med, mad, top = self.stats()
        if not armed:
            reach = max(abs(top), abs(med))
            return top + GROSS_FACTOR * reach if reach else GROSS_FACTOR
        scale = max(MAD_TO_STD * mad, rel * abs(med))
        excursion = tail * (top - med)
        if not (scale or excursion):
            return GROSS_FACTOR  # every value so far exactly 0: no scale (see the module docstring)
        return med + max(threshold * scale, excursion)


def median(xs: list[float]) -> float:
    """The median of the sorted, non-empty ``xs``."""
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def median_distance(xs: list[float], center: float) -> float:
    """``median(sorted(abs(x - center) for x in xs))`` for sorted ``xs``, in O(log n).

    The distances of the values below ``center`` (read right to left) and of those at
    or above it (left to right) are two sorted runs; the median is found by bisecting
    how many of the smallest come from each, without building either run. Each step
    of the guard recomputes this for five windows of up to a few hundred values.
    """
    p = bisect.bisect_left(xs, center)
    na, nb = p, len(xs) - p

    def below(t: int) -> float:  # t-th smallest distance among values below center
        return center - xs[p - 1 - t]

    def above(t: int) -> float:
        return xs[p + t] - center

    def kth(k: int) -> float:  # k-th smallest distance overall (0-based)
        lo, hi = max(0, k + 1 - nb), min(k + 1, na)
        while True:
            i = (lo + hi) // 2  # i from below, k + 1 - i from above
            j = k + 1 - i
            if i < hi and j > 0 and above(j - 1) > below(i):
                lo = i + 1
            elif i > lo and j < nb and below(i - 1) > above(j):
                hi = i - 1
            else:
                return max(below(i - 1) if i else -math.inf, above(j - 1) if j else -math.inf)

    n = len(xs)
    return kth(n // 2) if n % 2 else 0.5 * (kth(n // 2 - 1) + kth(n // 2))


def _gross_above(x: float) -> float:
    """A jump no clean step makes: GROSS_FACTOR times ``x`` above it (an absolute
    GROSS_FACTOR where ``x`` is 0: no scale)."""
    return x + GROSS_FACTOR * abs(x) if x else GROSS_FACTOR


def pair_limit(values: list[float]) -> float:
    """The limit for either of two ranks' values with no history to judge by (the first
    step): a gross jump above the smaller. Their median is their mean, which a bit-30
    value drags along, so :func:`cross_rank_limit` cannot serve two ranks."""
    xs = sorted(x for x in values if math.isfinite(x))
    if len(xs) < 2:
        return math.inf
    return _gross_above(xs[0])


def cross_rank_limit(values: list[float], threshold: float, armed: bool) -> float:
    """The limit for one rank's value against the ranks' median (for 3+ ranks): ``T``
    floored MADs above it (REL_FLOOR_RANK), or before ``armed`` a gross jump."""
    xs = sorted(x for x in values if math.isfinite(x))
    if not xs:
        return math.inf
    med = median(xs)
    if not armed:
        return _gross_above(med)
    mad = median_distance(xs, med)
    scale = max(MAD_TO_STD * mad, REL_FLOOR_RANK * abs(med))
    return med + threshold * scale if scale else GROSS_FACTOR
