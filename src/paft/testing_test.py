"""The helpers tests share (:mod:`paft.testing`)."""

from __future__ import annotations

import pytest
from torch.nn.parallel import DistributedDataParallel

from paft.testing import one_rank_group


def _model() -> DistributedDataParallel:
    """A DDP model as the check sees one, without a process group behind it."""
    return DistributedDataParallel.__new__(DistributedDataParallel)


def test_one_rank_group_fails_only_for_the_models_made_inside() -> None:
    """A DDP model from before the group (one a failed test's traceback keeps) failed
    every later test that took a group; one made inside and kept still fails."""
    earlier = _model()
    with one_rank_group():
        pass
    with pytest.raises(AssertionError, match="1 DistributedDataParallel model"):
        with one_rank_group():
            kept = _model()
    assert earlier is not kept
