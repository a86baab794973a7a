"""Tests for paft.divergence: distances between replicas, measured across real gloo ranks."""

from __future__ import annotations

import math

import torch
from torch import nn

from paft.divergence import measure_divergence
from paft.testing import run_workers


def _w_float64(rank: int, ws: int) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(7, 5).double()
    with torch.no_grad():
        model.weight.fill_(0.1)  # 0.1 + 0.1 + 0.1 rounds: (3 * 0.1) / 3 != 0.1 in float64
    same = measure_divergence(model, per_tensor=True)
    with torch.no_grad():
        if rank == 1:
            model.bias[0] += 1.0
    moved = measure_divergence(model, per_tensor=True)
    with torch.no_grad():
        model.bias.fill_(0.2)
        if rank == 2:
            model.weight[0, 0] = math.nan  # left out of the mean: the others are still alike
    nan_rank = measure_divergence(model)
    return {"same": same, "moved": moved, "nan_rank": nan_rank}


def test_identical_float64_replicas_are_at_distance_zero() -> None:
    """Three bitwise identical float64 replicas measured ~1e-16 from their rounded mean,
    and the monitor listed tensors that did not move among those that moved most."""
    res = run_workers(_w_float64, 3)
    for r in res:
        same = r["same"]
        assert same.per_rank == [0.0] * 3 and same.state_per_rank == [0.0] * 3
        assert all(rel == 0.0 for _, rel, _ in same.per_tensor)
        moved = r["moved"]
        assert moved.per_rank[1] > 0 and moved.per_tensor[0][0] == "param/bias"
        assert dict((n, rel) for n, rel, _ in moved.per_tensor)["param/weight"] == 0.0
        assert r["nan_rank"].per_rank[:2] == [0.0, 0.0] and math.isinf(r["nan_rank"].per_rank[2])
