"""Comparing a recomputed step with its first attempt: the evidence the guard attributes by.

A step's evidence is its header rows, one per rank: the control vector's columns
0..8 (loss, local squared gradient norm, aggregated norm, the aggregated-gradient
and state fingerprints, flags, fault counts) as int64 bit patterns, so NaN == NaN.

- :func:`reproduced`: whether a rerun gave the first attempt's result, which makes
  the data the cause. Bitwise; or, where every compared value is finite, within
  RERUN_RTOL (1e-3) with equal flags, fault counts, state fingerprints and replica
  grouping: GPU kernels with atomics do not reproduce the low bits, and a persistent
  fault does not reproduce a spike to 3 digits. Of the rows of the ranks both
  attempts name (the suspects) only, without the replica grouping (a transient fault
  on another rank, on either attempt, does not make bad data persistent). Their
  aggregated norm, checksum and non-finite flag, sums over all ranks that a fault
  elsewhere moves, take part only for a suspect whose own values are NaN/Inf where
  the other ranks recompute their own loss and gradient norm bit for bit
  (deterministic kernels): its NaN's place, which the checksum alone shows, must
  then reproduce. Where theirs moved (GPU atomics, or another rank's fault on one
  attempt), its own values coming back in kind (NaN as NaN, finite within
  RERUN_RTOL) with the same flags and state is data.
  A rerun fingerprints the state, the first attempt may not have: the state
  columns then take no part.
- :func:`unsteady_ranks`: where neither attempt named a suspect, the ranks whose own
  values moved on the rerun while the others' did not, and still lie outside the
  range of those that did not.

Example::

    >>> row = [f64_bits(x) for x in (2.0, 1.0, 1.0)] + [0] * 6
    >>> reproduced([row, row], [row, row])
    True
    >>> moved = [f64_bits(x) for x in (9.0, 1.0, 1.0)] + [0] * 6
    >>> reproduced([row, row], [row, moved]), unsteady_ranks([row, row], [row, moved])
    (False, [1])
"""

from __future__ import annotations

import math

import torch

from paft.consistency import (
    COL_AGG_HI,
    COL_AGG_LO,
    COL_AGG_NORM,
    COL_FLAGS,
    COL_LOCAL_SQ,
    COL_LOSS,
    COL_STATE_HI,
    COL_STATE_LO,
    FLAG_AGG_NONFINITE,
    FLAG_STATE_CHECKED,
    checksum_keys,
    read_flags,
)
from paft.replicas import group_replicas

__all__ = ["RERUN_RTOL", "bits_f64", "close", "f64_bits", "reproduced", "unsteady_ranks"]

RERUN_RTOL = 1e-3  # finite reruns this close count as the same result

# A rank's own values (local loss, local squared gradient norm): unlike the aggregate
# columns, no other rank's fault moves them.
_OWN = slice(COL_LOSS, COL_LOCAL_SQ + 1)


def f64_bits(x: float) -> int:
    """The bit pattern of ``x`` as a float64, as a signed int64 (a header cell)."""
    return int(torch.tensor([x], dtype=torch.float64).view(torch.int64).item())


def bits_f64(bits: int) -> float:
    """The float64 whose bit pattern is ``bits`` (inverse of :func:`f64_bits`)."""
    return float(torch.tensor([bits], dtype=torch.int64).view(torch.float64).item())


def close(a: float, b: float) -> bool:
    """Both finite and within RERUN_RTOL of each other, relative to the larger magnitude
    (an infinity would be within any relative tolerance of every value)."""
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= RERUN_RTOL * max(abs(a), abs(b))


def _cleared(row: list[int], cols: tuple[int, ...], flag: int) -> list[int]:
    """A copy of a header row with ``cols`` zeroed and ``flag`` cleared in its flags."""
    row = list(row)
    for col in cols:
        row[col] = 0
    row[COL_FLAGS] = f64_bits(float(read_flags(bits_f64(row[COL_FLAGS])) & ~flag))
    return row


def _rows_without_state(bits: list[list[int]]) -> list[list[int]]:
    """Header rows with the state fingerprint and its flag cleared."""
    return [_cleared(row, (COL_STATE_HI, COL_STATE_LO), FLAG_STATE_CHECKED) for row in bits]


def _without_aggregate(row: list[int]) -> list[int]:
    """A header row with the aggregated norm, checksum and non-finite flag cleared."""
    return _cleared(row, (COL_AGG_NORM, COL_AGG_HI, COL_AGG_LO), FLAG_AGG_NONFINITE)


def _state_checked(bits: list[list[int]]) -> bool:
    return all(read_flags(bits_f64(row[COL_FLAGS])) & FLAG_STATE_CHECKED for row in bits)


def _same(x: float, y: float) -> bool:
    return (math.isnan(x) and math.isnan(y)) or x == y or close(x, y)


def reproduced(prev: list[list[int]], cur: list[list[int]], rows: list[int] | None = None) -> bool:
    """Whether a rerun reproduced the first result: bitwise, or within RERUN_RTOL when all
    finite; only the ``rows`` given (the suspects), if any, and then without the replica
    grouping. A rerun fingerprints the state, the first attempt may not have: the state
    columns then take no part."""
    strict = True
    if rows is not None:
        # A NaN/Inf must reproduce bitwise (see below) where the kernels are deterministic,
        # as the other ranks show by recomputing their own values bit for bit; where
        # theirs moved (GPU atomics) the suspects' own values must come back in kind.
        strict = all(prev[r][_OWN] == cur[r][_OWN] for r in range(len(prev)) if r not in rows)
        # The aggregate (norm, checksum, non-finite flag) is a sum over all ranks: a fault
        # elsewhere, on either attempt, moves it. It is a suspect's evidence only where
        # that suspect's own values are NaN/Inf and the kernels deterministic: the NaN's
        # place shows in the checksum alone (a faulty unit moves it, bad data does not).
        # Elsewhere the suspects' own values, flags and state must come back.
        def evidence(p: list[int], c: list[int]) -> tuple[list[int], list[int]]:
            finite = all(math.isfinite(bits_f64(x)) for x in p[_OWN] + c[_OWN])
            return (_without_aggregate(p), _without_aggregate(c)) if finite or not strict else (p, c)

        pairs = [evidence(prev[r], cur[r]) for r in rows]
        prev, cur = [p for p, _ in pairs], [c for _, c in pairs]
    if _state_checked(prev) != _state_checked(cur):
        prev, cur = _rows_without_state(prev), _rows_without_state(cur)
    if prev == cur:
        return True
    a = torch.tensor(prev, dtype=torch.int64).view(torch.float64).tolist()
    b = torch.tensor(cur, dtype=torch.int64).view(torch.float64).tolist()
    for ra, rb, pa, pb in zip(a, b, prev, cur):
        # A NaN / Inf must reproduce bitwise: a faulty unit hitting another element
        # changes the fingerprint, while a NaN in the input reproduces exactly.
        if not all(math.isfinite(x) for x in ra[:COL_AGG_HI] + rb[:COL_AGG_HI]):
            if strict or pa[COL_STATE_HI:] != pb[COL_STATE_HI:] or not all(
                    _same(x, y) for x, y in zip(ra[:COL_AGG_HI], rb[:COL_AGG_HI])):
                return False
            continue
        if pa[COL_STATE_HI:] != pb[COL_STATE_HI:] or not all(
            close(x, y) for x, y in zip(ra[:COL_AGG_HI], rb[:COL_AGG_HI])
        ):
            return False
    return rows is not None or group_replicas(checksum_keys(prev)) == group_replicas(checksum_keys(cur))


def unsteady_ranks(prev: list[list[int]], cur: list[list[int]]) -> list[int]:
    """The ranks whose own values (local loss, local gradient norm) changed on the rerun
    AND still lie outside the range of the ranks whose values did not: if only some
    moved (where every rank's did, as non-deterministic GPU kernels can make them, they
    tell nothing), and not a one-off fault on the first attempt that has since gone."""
    moved = [r for r, (a, b) in enumerate(zip(prev, cur)) if a[_OWN] != b[_OWN]]
    steady = [r for r in range(len(cur)) if r not in moved]
    if not moved or not steady:
        return []
    values = [[bits_f64(x) for x in row[_OWN]] for row in cur]
    bounds = [(min(values[r][c] for r in steady), max(values[r][c] for r in steady)) for c in range(2)]
    return [r for r in moved if any(not lo <= values[r][c] <= hi for c, (lo, hi) in enumerate(bounds))]
