"""The guard's detectors: what, if anything, is wrong with one attempt of a step.

:class:`Detectors` reads the step's gathered :class:`~paft.consistency.ControlView`
against the guard's spike history (the windows of accepted values) and names the
first detector that fires, its suspect ranks and the values it judged; the order and
the rules are in :mod:`paft.guard`'s docstring. Pure functions of the view and the
history: :class:`~paft.guard.Guard` builds one for each look, from its current state,
and decides what to do with the finding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from paft.config import GuardConfig
from paft.consistency import FLAG_AGG_NONFINITE, FLAG_LOCAL_NONFINITE, FLAG_LOSS_NONFINITE, ControlView
from paft.replicas import group_replicas, outside_majority
from paft.spikes import (
    MAD_TO_STD,
    REL_FLOOR_GRAD,
    REL_FLOOR_LOSS,
    REL_FLOOR_RANK,
    SpikeWindow,
    cross_rank_limit,
    pair_limit,
)

__all__ = ["Detectors", "Finding"]

Finding = tuple[str, list[int], dict[str, float]]
"""What fired: the detector, its suspect ranks, the values it judged."""

_ABS_FLOOR = 1e-12  # attribution of a mismatch without majority, against a zero median


@dataclass(frozen=True)
class Detectors:
    """The detectors over the guard's history as it stands (the guard's windows, read
    and never written; ``armed``: ``warmup`` clean steps are in them)."""

    config: GuardConfig
    world_size: int
    loss: SpikeWindow  # the global loss
    grad: SpikeWindow  # the aggregated gradient norm
    rank_loss: SpikeWindow  # every rank's local loss, pooled
    rank_norm: SpikeWindow  # every rank's local gradient norm, pooled
    armed: bool

    def detect(self, view: ControlView) -> Finding | None:
        """The first detector that fires on ``view``, in the guard's order; None: clean."""
        ws = self.world_size
        cfg = self.config
        losses = view.losses.tolist()
        local = view.local_norms.tolist()
        agg = view.agg_norms.tolist()
        flags = view.flags
        for name, flag, col in (("nonfinite_loss", FLAG_LOSS_NONFINITE, losses),
                                ("nonfinite_local_grad", FLAG_LOCAL_NONFINITE, local),
                                ("nonfinite_agg_grad", FLAG_AGG_NONFINITE, agg)):
            bad = [r for r in range(ws) if flags[r] & flag or not math.isfinite(col[r])]
            if bad:
                ranks = bad
                if name == "nonfinite_agg_grad" and len(bad) == ws:
                    ranks = self.local_suspects(losses, local)
                return name, ranks, {"value": col[bad[0]], "rank": float(bad[0]), "count": float(len(bad))}
        mismatch = self.grad_mismatch(view)
        if mismatch is not None:
            return mismatch
        armed = self.armed
        if ws > 1:  # with one rank, a rank outlier is just a spike
            ranks, values = self.rank_outliers(losses, local, cfg.outlier_threshold)
            if ranks:
                return "rank_outlier", ranks, values
        for name, value, window, rel in (("grad_spike", max(agg), self.grad, REL_FLOOR_GRAD),
                                         ("loss_spike", view.global_loss, self.loss, REL_FLOOR_LOSS)):
            limit = window.limit(cfg.spike_threshold, rel, armed)
            if value > limit:
                vals = {"value": value, "limit": limit}
                if window.values:
                    vals["median"] = window.stats()[0]
                return name, self.local_suspects(losses, local), vals
        return None

    def rank_outliers(self, losses: list[float], local: list[float], threshold: float,
                      peers: bool = True) -> tuple[list[int], dict[str, float]]:
        """Ranks whose local loss or norm fires every available test (pooled history; 3+
        ranks, unless ``peers`` is false: cross-rank; 2 ranks with no history yet: a
        gross gap between the two, or the first step would go unguarded)."""
        ranks: set[int] = set()
        values: dict[str, float] = {}
        for name, xs, window in (("loss", losses, self.rank_loss), ("grad_norm", local, self.rank_norm)):
            own = window.limit(threshold, REL_FLOOR_RANK, self.armed)
            if peers and self.world_size >= 3:
                cross = cross_rank_limit(xs, threshold, self.armed)
            elif peers and self.world_size == 2 and own == math.inf:
                cross = pair_limit(xs)
            elif own == math.inf:
                continue  # no test available: no history, no peers
            else:
                cross = -math.inf
            limit = max(own if own < math.inf else -math.inf, cross)
            hits = [r for r, x in enumerate(xs) if x > limit]
            if hits:
                worst = max(hits, key=lambda r: xs[r])
                values.setdefault(f"{name}_value", xs[worst])
                values.setdefault(f"{name}_limit", limit)
                ranks.update(hits)
        return sorted(ranks), values

    def rose_alike(self, view: ControlView) -> bool:
        """Whether every rank's local loss and norm rose above its history, or none did.
        Some but not all is a fault's pattern even where no rank was named (two faulty
        ranks of four pull the ranks' median along, so the cross-rank test names none)."""
        moved, _ = self.rank_outliers(view.losses.tolist(), view.local_norms.tolist(), self.config.spike_threshold,
                                      peers=False)
        return len(moved) in (0, self.world_size)

    def local_suspects(self, losses: list[float], local: list[float]) -> list[int]:
        """Attribution of a global anomaly: ranks whose local values spike (spike_threshold)."""
        ranks, _ = self.rank_outliers(losses, local, self.config.spike_threshold)
        return ranks if len(ranks) < self.world_size else []

    def grad_mismatch(self, view: ControlView) -> Finding | None:
        """``grad_mismatch`` where the ranks' aggregated-gradient checksums differ, whatever
        fires before it in :meth:`detect` (a replica corrupted at rest makes its rank's
        loss NaN, which must not hide a reduction failing beside it); None: they agree."""
        groups = group_replicas(view.agg_checksum_keys())
        if len(groups) < 2:
            return None
        agg = view.agg_norms.tolist()
        return "grad_mismatch", self.mismatch_suspects(groups, agg), {
            "distinct": float(len(groups)), "grad_norm_min": min(agg), "grad_norm_max": max(agg)}

    def mismatch_suspects(self, groups: list[list[int]], agg: list[float]) -> list[int]:
        """Attribution of a ``grad_mismatch``: the ranks outside the majority, or with none
        those whose aggregated norm stands out against the history."""
        minority = outside_majority(groups, self.world_size)  # groups hold a split: never empty with a majority
        if minority:
            return minority
        # No strict majority: blame the groups whose aggregated norm is far from the
        # history. Either way in principle; with the 50% relative floor a non-negative
        # norm can fall that far below the median only for spike_threshold < 2.
        if not self.grad.values:
            return []
        med, mad, _ = self.grad.stats()
        scale = max(MAD_TO_STD * mad, REL_FLOOR_GRAD * abs(med), _ABS_FLOOR)
        odd = [r for g in groups for r in g if abs(agg[r] - med) > self.config.spike_threshold * scale]
        return sorted(odd) if 0 < len(odd) < self.world_size else []
