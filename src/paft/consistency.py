"""Worker-level consistency: the per-step control vector and the silent-inconsistency metrics.

Synchronous all-reduce makes the weights equal after every step, but it hides how
differently the workers behaved before aggregation. Each step every rank packs what
it saw into ONE small float64 vector (:class:`ControlVector`): its local loss, its
local and aggregated gradient norms, a checksum of its aggregated gradient, a fingerprint of
its training state, detector flags, the number of faults injected, and on metric
steps a k-dim sketch of its local gradient. One gather of that vector (``8 * (9 + k)``
bytes per rank, 2.1 KB for k = 256; 72 bytes between metric steps) gives every rank the same matrix, from which
every rank computes the same metrics and takes the same decisions, so ranks never
disagree on control flow.

Metrics (namespaced keys, population statistics over ranks):

- ``consistency/loss_{mean,std,cv,range}``: dispersion of local losses;
- ``consistency/gnorm_{mean,std,cv,range}``: dispersion of local gradient norms;
- ``consistency/grad_cos_{mean,min}``: pairwise cosine of local gradients, and
  ``consistency/cos_to_mean`` (per rank) / ``consistency/cos_to_mean_min``;
- ``consistency/nonfinite_ranks``: the ranks whose local loss or local gradient holds
  NaN/Inf (empty when none);
- ``replicas/grad_distinct`` and ``replicas/state_distinct``: number of distinct
  aggregated-gradient checksums and state fingerprints, with
  ``replicas/grad_minority_ranks`` and ``replicas/state_minority_ranks`` (the ranks
  outside a strict majority; none without one) and, at a split,
  ``replicas/grad_groups`` / ``replicas/state_groups``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from paft.collectives import all_gather_flat, start_gather_rows
from paft.fingerprint import join_int64, split_int64
from paft.replicas import group_replicas, outside_majority

__all__ = [
    "FLAG_LOSS_NONFINITE",
    "FLAG_LOCAL_NONFINITE",
    "FLAG_AGG_NONFINITE",
    "FLAG_STATE_CHECKED",
    "HEADER",
    "COL_LOSS",
    "COL_LOCAL_SQ",
    "COL_AGG_NORM",
    "COL_AGG_HI",
    "COL_AGG_LO",
    "COL_STATE_HI",
    "COL_STATE_LO",
    "checksum_keys",
    "read_flags",
    "COL_FLAGS",
    "COL_FAULTS",
    "ControlVector",
    "ControlView",
    "start_control",
    "PendingControl",
    "gather_exact_grads",
    "worker_metrics",
    "replica_metrics",
    "dispersion",
    "pairwise_cosine",
]

FLAG_LOSS_NONFINITE = 1
FLAG_LOCAL_NONFINITE = 2
FLAG_AGG_NONFINITE = 4
FLAG_STATE_CHECKED = 8

# The control vector's header columns, in order; the k sketch values follow. The
# guard reads the same layout (its rerun comparison works on the header's bits).
HEADER = 9
(COL_LOSS, COL_LOCAL_SQ, COL_AGG_NORM, COL_AGG_HI, COL_AGG_LO, COL_STATE_HI, COL_STATE_LO, COL_FLAGS,
 COL_FAULTS) = range(HEADER)

@dataclass
class ControlVector:
    """What one rank contributes to the step's control collective."""

    loss: float
    local_sq: float
    """Squared norm of this rank's local gradient (summed over buckets)."""
    agg_norm: float
    """Norm of this rank's aggregated gradient."""
    agg_checksum: int
    """64-bit digest of this rank's aggregated gradient (equal on every rank unless the
    all-reduce results differ: the replicas split at this step)."""
    state_fingerprint: int | None
    flags: int
    faults: int
    sketch: torch.Tensor | None

    def pack(self, sketch_dim: int) -> torch.Tensor:
        vec = np.zeros(HEADER + sketch_dim, dtype=np.float64)
        agg_hi, agg_lo = split_int64(self.agg_checksum)
        st_hi, st_lo = split_int64(self.state_fingerprint or 0)
        flags = self.flags | (FLAG_STATE_CHECKED if self.state_fingerprint is not None else 0)
        vec[:HEADER] = (self.loss, self.local_sq, self.agg_norm, agg_hi, agg_lo, st_hi, st_lo, flags, self.faults)
        if sketch_dim and self.sketch is not None:
            vec[HEADER:] = self.sketch.numpy()
        return torch.from_numpy(vec)


class ControlView:
    """The gathered ``[world_size, 9 + k]`` control matrix, read the same way on every rank.

    Columns come out as numpy arrays: the matrix is a few KB, and numpy's per-call
    cost is a fraction of torch's, which matters for a per-step computation.
    """

    def __init__(self, matrix: torch.Tensor | np.ndarray) -> None:
        self.matrix = _array(matrix)
        self.world_size = self.matrix.shape[0]

    @property
    def losses(self) -> np.ndarray:
        return self.matrix[:, COL_LOSS]

    @property
    def local_norms(self) -> np.ndarray:
        return np.sqrt(self.matrix[:, COL_LOCAL_SQ])

    @property
    def agg_norms(self) -> np.ndarray:
        return self.matrix[:, COL_AGG_NORM]

    @property
    def flags(self) -> list[int]:
        """Each rank's FLAG_* bits (see :func:`read_flags`)."""
        return [read_flags(f) for f in self.matrix[:, COL_FLAGS].tolist()]

    @property
    def faults(self) -> list[int]:
        return [_count(f, 0) for f in self.matrix[:, COL_FAULTS].tolist()]

    @property
    def sketches(self) -> np.ndarray:
        return self.matrix[:, HEADER:]

    def header_bits(self) -> list[list[int]]:
        """The header columns' exact float64 bit patterns, per rank."""
        return np.ascontiguousarray(self.matrix[:, :HEADER]).view(np.int64).tolist()

    def agg_checksum_keys(self) -> list[int]:
        """Each rank's aggregated-gradient checksum as a key: equal keys, equal checksums."""
        return checksum_keys(self.header_bits())

    def state_fingerprints(self) -> list[int] | None:
        """Each rank's state fingerprint, where every rank checked its state this step. A
        half the control collective corrupted into a non-integer gives a key no int64
        fingerprint equals (its halves' bits above 2**128): that rank's state stands
        apart, as corrupted, instead of raising."""
        if not all(f & FLAG_STATE_CHECKED for f in self.flags):
            return None
        out = []
        for (hi, lo), bits in zip(self.matrix[:, [COL_STATE_HI, COL_STATE_LO]].tolist(), self.header_bits()):
            try:
                out.append(join_int64(hi, lo))
            except ValueError:
                out.append((1 << 128) | ((bits[COL_STATE_HI] & _M64) << 64) | (bits[COL_STATE_LO] & _M64))
        return out

    def states_split(self) -> bool:
        """Whether the ranks checked their state this step and their fingerprints differ."""
        states = self.state_fingerprints()
        return states is not None and len(set(states)) > 1

    def ranks_with(self, flag: int) -> list[int]:
        return [r for r, f in enumerate(self.flags) if f & flag]

    @property
    def global_loss(self) -> float:
        """Mean of the local losses: what DDP users usually log (inf where finite losses
        near the float64 limit overflow their sum, quietly, as the dispersion's)."""
        with np.errstate(over="ignore"):
            return float(self.losses.mean())


_M64 = (1 << 64) - 1


def _count(value: float, corrupt: int) -> int:
    """A float64 column that carries a small integer, or ``corrupt`` where it does not."""
    return int(value) if math.isfinite(value) and value == int(value) else corrupt


def read_flags(cell: float) -> int:
    """A flags cell's FLAG_* bits; a value the control collective corrupted into a
    non-integer reads as every non-finite flag (the rank's row cannot be trusted)."""
    return _count(cell, FLAG_LOSS_NONFINITE | FLAG_LOCAL_NONFINITE | FLAG_AGG_NONFINITE)


def checksum_keys(bits: list[list[int]]) -> list[int]:
    """Each rank's aggregated-gradient checksum, from the control rows' float64 bit
    patterns (:meth:`ControlView.header_bits`), as one 128-bit integer: compared by
    their bits, the halves need no :func:`join_int64`, which raises on a half that was
    corrupted into a non-integer."""
    return [(row[COL_AGG_HI] << 64) + (row[COL_AGG_LO] & _M64) for row in bits]


class PendingControl:
    """The step's control collective in flight; :meth:`wait` gives the gathered view."""

    def __init__(self, out: torch.Tensor, work: Any) -> None:
        self._out, self._work = out, work
        self._view: ControlView | None = None

    def wait(self) -> ControlView:
        if self._view is None:
            self._work.wait()
            self._view = ControlView(self._out)
        return self._view


def start_control(vec: torch.Tensor, group: dist.ProcessGroup | None = None) -> PendingControl:
    """Launch the step's one control collective (an async gather of every rank's vector).

    Without a guard nothing needs the result before ``optimizer.step()``, so the
    protector overlaps the two; on an oversubscribed CPU this also spares the ranks
    that arrive early from spinning in the collective.
    """
    return PendingControl(*start_gather_rows(vec, group))


def gather_exact_grads(flat: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``exact`` cosine mode: gather every rank's full local gradient (O(params) bytes)."""
    return all_gather_flat(flat, group).view(dist.get_world_size(group), -1).cpu()


def _array(values: torch.Tensor | np.ndarray) -> np.ndarray:
    return np.asarray(values.cpu() if isinstance(values, torch.Tensor) else values, dtype=np.float64)


def dispersion(values: torch.Tensor | np.ndarray) -> dict[str, float]:
    """Population mean, std, coefficient of variation and max - min of per-rank values."""
    # A handful of numpy calls, not np.std's generic machinery: this runs every step.
    v = _array(values).ravel()
    with np.errstate(invalid="ignore", over="ignore"):  # a non-finite loss gives NaN stats, quietly
        mean = float(v.sum()) / v.size
        if v.size == 1:  # one rank: no spread, even if its value is not finite
            return {"mean": mean, "std": 0.0, "cv": 0.0, "range": 0.0}
        dev = v - mean
        std = math.sqrt(float(dev @ dev) / v.size)
        spread = float(v.max() - v.min())
    cv = std / abs(mean) if mean != 0 else (0.0 if std == 0 else math.inf)
    return {"mean": mean, "std": std, "cv": cv, "range": spread}


def pairwise_cosine(vectors: torch.Tensor | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(pairwise cosine matrix, each row's cosine to the mean row) of ``[ranks, dim]`` vectors.

    A row holding NaN/Inf (a rank whose local gradient is non-finite) gets NaN in its
    row and column and stays out of the mean, so the healthy pairs keep their values.
    An all-zero row has no direction: its cosines are 0 (orthogonal to every other).
    The norms and the cosines come from one Gram matrix (a per-step computation);
    rounding past +-1 is clipped.
    """
    v = _array(vectors)
    finite = np.isfinite(v).all(axis=1)
    healthy = bool(finite.all())
    if not healthy:
        v = np.where(finite[:, None], v, 0.0)
    # One power-of-two scale for all rows (exact: the cosines are the same bits): float64
    # rows of 1e200 overflowed the Gram matrix to NaN, rows of 1e-200 underflowed it to 0.
    top = float(np.abs(v).max()) if v.size else 0.0
    if top > 0:
        v = np.ldexp(v, -np.frexp(top)[1])
    gram = v @ v.T
    norms = np.maximum(np.sqrt(np.diagonal(gram)), 1e-300)
    cos = np.clip(gram / norms[:, None] / norms[None, :], -1.0, 1.0)  # one division each: 1e-300 squared underflows
    # The mean row explicitly, not from the Gram matrix: when ranks' gradients nearly
    # cancel, sum_ij <v_i, v_j> would lose its few significant digits.
    mean = (v if healthy else v[finite]).mean(axis=0) if finite.any() else np.zeros(v.shape[1])
    to_mean = np.clip((v @ mean) / norms / max(float(np.sqrt(mean @ mean)), 1e-300), -1.0, 1.0)
    if not healthy:
        cos[~finite, :] = cos[:, ~finite] = np.nan
        to_mean[~finite] = np.nan
    return cos, to_mean


@functools.lru_cache(maxsize=8)
def _upper_pairs(world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the pairs ``i < j`` (computed once per world size, not every step)."""
    return np.triu_indices(world_size, k=1)


def worker_metrics(view: ControlView, grads: torch.Tensor | None = None) -> dict[str, Any]:
    """All per-step consistency metrics from the gathered control matrix.

    ``grads`` overrides the sketches with full local gradients (``exact`` mode);
    with neither (cosine ``off``, or k = 0) the cosine metrics are omitted.
    """
    out: dict[str, Any] = {}
    for name, values in (("loss", view.losses), ("gnorm", view.local_norms)):
        for stat, value in dispersion(values).items():
            out[f"consistency/{name}_{stat}"] = value
    out["consistency/nonfinite_ranks"] = [
        r for r, (loss, norm) in enumerate(zip(view.losses.tolist(), view.local_norms.tolist()))
        if not (math.isfinite(loss) and math.isfinite(norm))]
    vectors = _array(grads) if grads is not None else view.sketches
    if vectors.shape[1] > 0 and view.world_size > 1:
        cos, to_mean = pairwise_cosine(vectors)
        pairs = cos[_upper_pairs(view.world_size)]
        pairs = pairs[np.isfinite(pairs)]  # the pairs of ranks with finite gradients
        out["consistency/grad_cos_mean"] = float(pairs.mean()) if pairs.size else math.nan
        out["consistency/grad_cos_min"] = float(pairs.min()) if pairs.size else math.nan
        out["consistency/cos_to_mean"] = to_mean.tolist()
        finite = [c for c in out["consistency/cos_to_mean"] if math.isfinite(c)]
        out["consistency/cos_to_mean_min"] = min(finite) if finite else math.nan
    out.update(replica_metrics(view))
    return out


def replica_metrics(view: ControlView) -> dict[str, Any]:
    """``replicas/*``: how many distinct aggregated gradients (and, when this step
    fingerprinted it, training states) the ranks hold; the ranks outside a strict
    majority (none when no group holds one: with two ranks that disagree, or an even
    split, which side is faulty is unknown); and, at a split, the groups themselves."""
    out: dict[str, Any] = {}
    _replica_keys(out, "grad", view.agg_checksum_keys())
    state = view.state_fingerprints()
    if state is not None:
        _replica_keys(out, "state", state)
    return out


def _replica_keys(out: dict[str, Any], kind: str, fps: list[int]) -> None:
    groups = group_replicas(fps)
    out[f"replicas/{kind}_distinct"] = len(groups)
    out[f"replicas/{kind}_minority_ranks"] = outside_majority(groups, len(fps))
    if len(groups) > 1:
        out[f"replicas/{kind}_groups"] = groups
