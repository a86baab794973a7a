"""Which replicas agree: ranks grouped by an equal 64-bit value, and the strict majority.

Every rank contributes one value that is equal exactly when its replica is (a state
fingerprint, an aggregated-gradient checksum; see :mod:`paft.fingerprint`); these
pure functions, which every rank runs alike on the gathered values, say who agrees
with whom. A strict majority is more than half of all ranks, so with two ranks that
disagree, or an even split, which side is faulty is unknown and none is named.

Example::

    >>> group_replicas([7, 9, 7, 7])
    [[0, 2, 3], [1]]
    >>> majority([7, 9, 7, 7]), outside_majority(group_replicas([7, 9, 7, 7]), 4)
    ([0, 2, 3], [1])
    >>> majority([7, 9])  # two ranks that disagree: no majority
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "group_replicas",
    "majority",
    "outside_majority",
]


def group_replicas(fps: Sequence[int]) -> list[list[int]]:
    """Ranks grouped by equal fingerprint (``fps[r]`` is rank ``r``'s), each group in
    ascending rank order; largest group first, ties broken by the lowest rank.

    ``group_replicas([7, 9, 7, 9]) == [[0, 2], [1, 3]]``.
    """
    groups: dict[int, list[int]] = {}
    for rank, fp in enumerate(fps):
        groups.setdefault(int(fp), []).append(rank)
    return sorted(groups.values(), key=lambda g: (-len(g), g[0]))


def _first_is_majority(groups: list[list[int]], world_size: int) -> bool:
    # The one strict-majority rule: more than half of all ranks.
    return bool(groups) and 2 * len(groups[0]) > world_size


def outside_majority(groups: list[list[int]], world_size: int) -> list[int]:
    """The ranks outside the group that holds a strict majority of ``world_size`` ranks
    (``groups`` as :func:`group_replicas` orders them), or none when no group holds one:
    with two ranks that disagree, or an even split, which side is faulty is unknown."""
    return sorted(r for g in groups[1:] for r in g) if _first_is_majority(groups, world_size) else []


def majority(fps: Sequence[int]) -> list[int] | None:
    """The ranks of the group holding a strict majority (more than half of all
    ranks) of identical fingerprints, or ``None`` (no ranks, even split, all
    different, two ranks that disagree)."""
    groups = group_replicas(fps)
    return groups[0] if _first_is_majority(groups, len(fps)) else None
