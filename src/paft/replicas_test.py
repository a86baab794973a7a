"""Tests for paft.replicas: grouping ranks by equal fingerprint, and the strict majority."""

from __future__ import annotations

import pytest
import torch

from paft.replicas import group_replicas, majority, outside_majority


@pytest.mark.parametrize(
    "fps, groups, maj",
    [
        ([], [], None),
        ([5], [[0]], [0]),
        ([5, 5], [[0, 1]], [0, 1]),
        ([5, 6], [[0], [1]], None),  # two ranks that disagree: no majority
        ([5, 5, 5], [[0, 1, 2]], [0, 1, 2]),
        ([5, 6, 5], [[0, 2], [1]], [0, 2]),
        ([6, 5, 5], [[1, 2], [0]], [1, 2]),
        ([1, 2, 3], [[0], [1], [2]], None),
        ([7, 9, 7, 9], [[0, 2], [1, 3]], None),  # tie: lowest rank's group first
        ([9, 7, 7, 9], [[0, 3], [1, 2]], None),
        ([4, 4, 4, 8], [[0, 1, 2], [3]], [0, 1, 2]),
        ([1, 2, 3, 3], [[2, 3], [0], [1]], None),
        ([-(2**63), 2**63 - 1, -(2**63), 0, -(2**63)], [[0, 2, 4], [1], [3]], [0, 2, 4]),
    ],
)
def test_group_replicas_and_majority(
    fps: list[int], groups: list[list[int]], maj: list[int] | None
) -> None:
    assert group_replicas(fps) == groups
    assert majority(fps) == maj


def test_a_gathered_tensor_of_fingerprints_groups_by_value() -> None:
    # The gathered tensor itself, not its .tolist(): its elements hash by identity, not value.
    fps = torch.tensor([7, 9, 7, 7], dtype=torch.int64)
    assert group_replicas(fps) == [[0, 2, 3], [1]]
    assert majority(fps) == [0, 2, 3]


@pytest.mark.parametrize(
    "groups, world_size, outside",
    [
        ([], 0, []),
        ([[0, 2], [1]], 3, [1]),
        ([[1, 2, 3], [4], [0]], 5, [0, 4]),
        ([[0], [1]], 2, []),  # two ranks that disagree: which is faulty is unknown
        ([[0, 2], [1, 3]], 4, []),  # an even split
    ],
)
def test_outside_majority(groups: list[list[int]], world_size: int, outside: list[int]) -> None:
    assert outside_majority(groups, world_size) == outside
