"""Norms that stay finite wherever the values are: one rule for every reader.

A flipped exponent bit makes a finite float32 entry of ~1e20 to ~1e38; its square
overflows float32, so a plain norm reads it as inf, and a detector would call a finite
gradient or update non-finite (and clipping would scale by 0). Every norm paft judges
(the comm hook's local gradient norm, the aggregated gradient norm that clipping and
the guard use, the guard's update-to-weight ratio, a sync's divergence) comes from
here. The per-step norms are computed as torch computes them, in the values' own dtype
(fast; :func:`squared_norm` widens 16-bit values to float32 first), and redone in
float64 only where that came out inf on finite values; :func:`squared_norm_as_float` (a sync's
divergence, once per sync) accumulates in float64 throughout.

Example::

    >>> import torch
    >>> x = torch.full((4,), 1e20)
    >>> torch.linalg.vector_norm(x)   # float32's squares overflow
    tensor(inf)
    >>> total_norm([x]) == 2 * x[0]
    tensor(True)
    >>> norm_of([x, torch.zeros(3, dtype=torch.float16)]) == float(2 * x[0])
    True
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["wide_dtype", "widened", "squared_norm", "squared_norm_as_float", "total_norm", "judged_norm", "norm_of"]

_HALF = (torch.float16, torch.bfloat16)


def wide_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit floats, else ``dtype``: sums, means and divergences of float16 /
    bfloat16 values computed in their own dtype round by a 16-bit ulp or overflow."""
    return torch.float32 if dtype in _HALF else dtype


def widened(flat: Tensor) -> Tensor:
    """``flat`` in :func:`wide_dtype` (no copy when it already is)."""
    return flat.to(wide_dtype(flat.dtype))


def squared_norm(flat: Tensor) -> Tensor:
    """``||flat||^2`` (0-dim, on ``flat``'s device) via one BLAS dot, redone in float64
    where it came out inf on finite entries: non-finite exactly when ``flat`` holds
    inf/NaN (for float64 values, whose dot is returned as it is, also past ~1.3e154 in
    magnitude). On a GPU both are computed (a host read per call would drain the launch
    queue); on the CPU the float64 pass runs only when needed."""
    flat = widened(flat)
    sq = torch.dot(flat, flat)
    if sq.dtype == torch.float64:
        return sq
    if flat.device.type == "cpu":
        return _float64_norm(flat) ** 2 if math.isinf(sq) else sq
    return torch.where(torch.isinf(sq), _float64_norm(flat) ** 2, sq)


def squared_norm_as_float(x: Tensor) -> float:
    """``||x||^2`` as a float, accumulated in float64; inf past float64's range (a
    Python ``** 2`` would raise OverflowError there)."""
    return float(torch.linalg.vector_norm(x, dtype=torch.float64).square())


def _float64_norm(flat: Tensor) -> Tensor:
    return torch.linalg.vector_norm(flat, dtype=torch.float64)


def _scaled_norm(tensors: Sequence[Tensor]) -> Tensor:
    """The 2-norm of all of ``tensors`` in float64, each divided by its largest magnitude
    first (and the norms again by theirs), so that no square passes float64's range:
    entries of float64 above ~1.3e154 too. inf or NaN only where an entry is. Three
    passes a tensor: only where a norm has already come out inf."""
    device = tensors[0].device
    return _scaled(torch.stack([_scaled(_real(t).to(torch.float64)).to(device) for t in tensors]))


def _real(t: Tensor) -> Tensor:
    """A complex tensor as its (real, imaginary) pairs, whose 2-norm is its own: a cast
    to float64 kept the real parts alone (a gradient entry of 1e20j counted as 0), and
    ``aminmax`` takes real values only. Other tensors as they are."""
    return torch.view_as_real(t.resolve_conj()) if t.is_complex() else t


def _scaled(x: Tensor) -> Tensor:
    if x.numel() == 0:  # its 2-norm is 0; its largest magnitude (the inf norm) torch refuses
        return torch.linalg.vector_norm(x)
    peak = torch.linalg.vector_norm(x, ord=math.inf)
    if not 0 < float(peak) < math.inf:  # zeros, or an inf/NaN entry: torch's norm says it as is
        return torch.linalg.vector_norm(x)
    return peak * torch.linalg.vector_norm(x / peak)


def total_norm(tensors: Sequence[Tensor]) -> Tensor:
    """``torch.nn.utils.get_total_norm`` of ``tensors`` (what clipping uses), summed
    again in float64, scaled, where the squares overflowed on finite entries (a host read
    of the norm: the callers read it anyway), then back in the norm's dtype: inf/NaN
    only when an entry is, or the norm itself is past the dtype's range."""
    norm = torch.nn.utils.get_total_norm(list(tensors))
    if math.isinf(norm) and not _holds_inf(tensors):
        norm = _scaled_norm(tensors).to(norm.dtype)
    return norm


def judged_norm(norm: Tensor, tensors: Sequence[Tensor]) -> float:
    """``norm`` (:func:`total_norm`'s, which clipping keeps, as torch's does) as a float,
    or where it is inf past its dtype's range on finite entries (float16 gradients of
    norm above 65504; float64 ones above ~1.3e154, whose squares pass float64's range)
    the scaled float64 norm: what the guard, the loss scaler's agreed skips and the
    metrics judge, so finite values never read as non-finite."""
    value = float(norm)
    if math.isinf(value) and not _holds_inf(tensors):
        value = float(_scaled_norm(tensors))
    return value


def _holds_inf(tensors: Sequence[Tensor]) -> bool:
    """Whether an entry of ``tensors`` is infinite: their norm is then inf as it is, and
    the scaled float64 pass (a copy and a host read per tensor) has nothing to rescue. A
    loss scaler's every overflow step comes here. One host read; ``aminmax``, not the
    inf-norm, which took 6x as long on the CPU."""
    parts = [_real(t) for t in tensors if t.numel()]
    ends = [torch.stack(torch.aminmax(t)).to(tensors[0].device, torch.float64) for t in parts]
    return bool(ends) and math.isinf(float(torch.cat(ends).abs().max()))


def norm_of(tensors: Sequence[Tensor]) -> float:
    """The 2-norm of all of ``tensors`` together, as judged: ``judged_norm(total_norm(...))``;
    0 for none."""
    return judged_norm(total_norm(tensors), tensors) if tensors else 0.0
