"""The CountSketch of a gradient bucket: the local gradient in ``dim`` numbers, from
which the worker metrics estimate the cosine between ranks' gradients.

:mod:`paft.comm`'s hook sketches each bucket's local gradient on the steps that ask
(:meth:`CountSketch.add_`); the control collective gathers the sums, and
:func:`paft.consistency.pairwise_cosine` compares them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from paft.norms import squared_norm, widened

__all__ = ["CountSketch"]


def _prime_at_least(n: int) -> int:
    def prime(m: int) -> bool:
        return m > 1 and all(m % d for d in range(2, int(m**0.5) + 1))

    while not prime(n):
        n += 1
    return n


class CountSketch:
    """A fixed-seed CountSketch of a flat vector into ``dim`` coordinates.

    Coordinate i of a bucket goes to slot ``i mod p`` with a random sign, p a prime
    >= ``dim`` (257 for 256), and the ``p - dim`` slots past ``dim`` are folded onto the
    first ones. p is the smallest such prime that divides none of the bucket's strides
    (the products of each parameter's trailing dimensions: a ``[out, in]`` weight's
    ``in``), so each column of a weight spreads over all slots: where p divided a row's
    length (``i mod dim`` with rows of 768 for k = 256, or rows of 771 = 3 x 257 with
    257), a whole column landed in one slot, and one outlier input feature dominated the
    sketch (the cosine off by 10-17 standard errors, its sign flipped, at every step).
    The signs depend only on (bucket index, bucket length, seed) and p on the bucket's
    shapes, so every rank sketches the same way and ``<S a, S b>`` is an unbiased
    estimate of ``<a, b>`` with standard deviation about ``||a|| ||b|| / sqrt(dim)``.
    Cost: one multiply and one reduction over the bucket, no scatter, on the bucket's
    own device.
    """

    def __init__(self, dim: int, seed: int = 0x5EED) -> None:
        self.dim = dim
        self.seed = seed
        # One sign vector per bucket index, replaced when the bucket's layout changes: DDP
        # rebuilds its buckets after the first backward pass (one bucket of the whole model
        # becomes several), and kept, the first step's signs held a second gradient's size.
        self._signs: dict[int, tuple[tuple[int, torch.device, torch.dtype], torch.Tensor]] = {}
        self._strides: dict[tuple[int, int], int] = {}

    def stride(self, index: int, numel: int, shapes: Callable[[], list[torch.Size]] | None = None) -> int:
        """p for bucket ``index`` of ``numel`` elements (``shapes``: its parameters' shapes,
        asked once per bucket layout)."""
        key = (index, numel)
        p = self._strides.get(key)
        if p is None:
            strides = {math.prod(shape[k:]) for shape in (shapes() if shapes else []) for k in range(1, len(shape))}
            p = _prime_at_least(self.dim)
            while any(s % p == 0 for s in strides if s):
                p = _prime_at_least(p + 1)
            self._strides[key] = p
        return p

    def signs(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """Bucket ``index``'s ±1 signs, in ``like``'s dtype and on its device: a 16-bit
        gradient's signs stay 16-bit (±1 is exact there, and the product with the widened
        gradient is the same float32), not twice the gradient's size."""
        layout = (like.numel(), like.device, like.dtype)
        cached = self._signs.get(index)
        if cached is not None and cached[0] == layout:
            return cached[1]
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        bits = torch.randint(0, 2, (like.numel(),), generator=gen, dtype=torch.int8)
        signs = (bits * 2 - 1).to(device=like.device, dtype=like.dtype)
        self._signs[index] = (layout, signs)
        return signs

    def add_(self, out: torch.Tensor, index: int, flat: torch.Tensor,
             shapes: Callable[[], list[torch.Size]] | None = None) -> torch.Tensor:
        """``out += sketch(flat)`` for bucket ``index`` (``out`` is float64, length dim;
        ``shapes``: the bucket's parameters' shapes, see :meth:`stride`).

        Returns ``||flat||^2`` (0-dim, on ``flat``'s device), read off the signed copy
        (same magnitudes), so the caller needs no separate norm pass; non-finite if
        ``flat`` holds inf or NaN.
        """
        signed = widened(flat) * self.signs(index, flat)
        n, p = signed.numel(), self.stride(index, flat.numel(), shapes)
        full = n - n % p
        if full:
            self._fold(out, _slot_sums(signed[:full].view(-1, p)))
        if n > full:
            self._fold(out, signed[full:])
        return squared_norm(signed)

    def _fold(self, out: torch.Tensor, slots: torch.Tensor) -> None:
        """``out += slots`` for up to ``stride`` slots, slot j onto ``j mod dim``: those past
        ``dim`` onto the first, and again past ``2 * dim``, where every prime below that
        divided a stride (k = 8 with rows of 11 and 13 in one bucket: p = 17)."""
        slots = slots.to(out.device, torch.float64)
        k = self.dim
        for start in range(0, slots.numel(), k):
            chunk = slots[start : start + k]
            out[: chunk.numel()] += chunk


def _slot_sums(rows: torch.Tensor) -> torch.Tensor:
    """The column sums of ``rows``, in their dtype (a cast to float64 first costs 5x;
    each slot sums n/p values, far from float32's precision limits), redone in float64
    where a slot is not finite on finite values: a few entries near float32's max (a flipped
    exponent bit) made a finite gradient's sketch inf, and its rank's cosines NaN with no
    rank named non-finite. As in :func:`paft.norms.squared_norm`, on a GPU both sums are
    taken (a host read per bucket would drain the launch queue), on the CPU the float64
    one only where needed."""
    sums = rows.sum(0)
    if sums.dtype == torch.float64:
        return sums
    # Not finite rather than inf: partial sums of both signs that overflow meet as NaN.
    if rows.device.type == "cpu":
        return rows.sum(0, dtype=torch.float64) if not bool(torch.isfinite(sums).all()) else sums
    return torch.where(torch.isfinite(sums), sums, rows.sum(0, dtype=torch.float64))
