"""Tests of :mod:`paft.resync`'s schedule rule for PyTorch's averager (the step
protocol around the syncs and repairs is tested through the protector, in protect_test.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paft.config import ProtectConfig
from paft.records import RunRecorder
from paft.resync import Resync, averages_at
from paft.testing import run_workers


def averager_steps(rank: int, world_size: int, period: int, start: int,
                   steps: int) -> list[tuple[bool, bool, int, int]]:
    """Per step from ``start`` (the averager moved along to it, as after a resume):
    whether Resync said it averaged, whether the replicas were then bitwise identical,
    and its sync and byte counts. Each step first moves every replica apart (a rank's
    own offset, after a backward pass)."""
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    resync = Resync(model, optimizer, ProtectConfig(mode="averager", sync_period=period), guard=False,
                    recorder=RunRecorder(None, rank), replicas_agree=lambda: None, fingerprints_now=lambda: [])
    resync.set_next_step(start)
    out = []
    for step in range(start, start + steps):
        optimizer.zero_grad()
        model(torch.ones(1, 3)).sum().backward()  # the averager averages the parameters with a gradient
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rank + 1)
        averaged = resync.maybe_sync(step, None)
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        every = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(every, flat)
        out.append((averaged, all(torch.equal(every[0], other) for other in every[1:]), resync.syncs,
                    resync.sync_bytes))
    return out


def test_the_averager_averages_exactly_at_the_steps_averages_at_names() -> None:
    """paft report counts an averager run's syncs with averages_at: it must be the
    steps PeriodicModelAverager really averages at, not a copy of its rule, also
    after the averager was moved along to a later step."""
    assert [s for s in range(10) if averages_at(s, 4)] == [0, 4, 8]  # from step 0, no warm-up
    period, start, steps = 3, 1, 8
    expected = [averages_at(s, period) for s in range(start, start + steps)]
    for out in run_workers(averager_steps, 2, period, start, steps):
        assert [averaged for averaged, _, _, _ in out] == expected
        assert [identical for _, identical, _, _ in out] == expected
        assert out[-1][2] == sum(expected) == 2
        assert out[-1][3] == 2 * 8 * 4  # two averages of 8 float32 parameters
