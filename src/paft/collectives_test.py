"""The protocol's collectives on real gloo ranks: every bit of every row arrives."""

from __future__ import annotations

import math
import struct
from typing import Any

import pytest
import torch
import torch.distributed as dist

from paft import collectives
from paft.collectives import all_gather_flat, collective_device, gather_rows, max_over_ranks, start_gather_rows
from paft.testing import run_workers

# Values a control row carries that arithmetic would lose: -0.0, a NaN with a payload,
# infinities, the smallest subnormal, and a fingerprint's half as a float.
SPECIAL = [-0.0, struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_DEAD_BEEF))[0], math.inf, -math.inf, 5e-324,
           float(2**53 - 1)]


def row_of(rank: int) -> torch.Tensor:
    return torch.tensor([float(rank), *SPECIAL, rank * 1.5 - 7.25], dtype=torch.float64)


def exchange(rank: int, world_size: int) -> dict[str, Any]:
    out, work = start_gather_rows(row_of(rank))
    work.wait()
    ints = gather_rows(torch.tensor([rank, -(2**63), 2**63 - 1 - rank], dtype=torch.int64))
    return {
        "async": out.view(torch.int64).tolist(),
        "blocking": gather_rows(row_of(rank)).view(torch.int64).tolist(),
        "ints": ints.tolist(),
        "max": max_over_ranks(float(rank)),
        "max_nan": max_over_ranks(math.nan if rank == world_size - 1 else float(rank)),
        "max_fine": max_over_ranks(1.0 + rank * 2.0**-40),  # a float64's precision, not a float32's
        "flat": all_gather_flat(torch.arange(3, dtype=torch.float32) + 10 * rank).tolist(),
        # gloo moves CPU tensors, whatever device the row is on (a CUDA one, under gloo)
        "device": str(collective_device(like=torch.empty(1, device="meta"))),
    }


def test_rows_arrive_bit_for_bit_in_rank_order_and_maxima_agree() -> None:
    world_size = 3
    out = run_workers(exchange, world_size)
    expect = [row_of(r).view(torch.int64).tolist() for r in range(world_size)]
    for rank, got in enumerate(out):
        assert got["async"] == got["blocking"] == expect, rank
        assert got["ints"] == [[r, -(2**63), 2**63 - 1 - r] for r in range(world_size)]
        assert got["max"] == world_size - 1
        assert got["max_nan"] == math.inf  # a NaN on the last rank, not rank 0: still seen
        assert got["max_fine"] == 1.0 + (world_size - 1) * 2.0**-40
        assert got["flat"] == [10.0 * r + i for r in range(world_size) for i in range(3)]
        assert got["device"] == "cpu"


def test_a_mixed_groups_cuda_rows_take_nccls_all_gather(monkeypatch: pytest.MonkeyPatch) -> None:
    # paft train's GPU group is "cpu:gloo,cuda:nccl": its CUDA rows go through NCCL,
    # whose all-gather needs no row repeated per rank (gloo's all-to-all did, there).
    # No GPU here: the device and the two collectives stand in, the choice is real.
    called: list[str] = []
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    # both launched, not waited for: start_gather_rows hands the work back
    monkeypatch.setattr(dist, "all_to_all_single", lambda *a, async_op, **k: called.append(f"all_to_all {async_op}"))
    monkeypatch.setattr(collectives, "_all_gather_single",
                        lambda *a, async_op, **k: called.append(f"all_gather {async_op}"))
    for device in (torch.device("meta"), torch.device("cpu")):
        monkeypatch.setattr(collectives, "collective_device", lambda group=None, like=None, d=device: d)
        start_gather_rows(torch.zeros(3, dtype=torch.float64))
    assert called == ["all_gather True", "all_to_all True"]


def test_each_backend_takes_its_tensors_where_it_moves_them(monkeypatch: pytest.MonkeyPatch) -> None:
    # NCCL (alone, or a mixed group's CUDA part) on the current CUDA device, as set by
    # torch.cuda.set_device; gloo on the CPU whatever the tensor; another backend where
    # the tensor is. No GPU here: the device is named, never touched.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    meta = torch.empty(1, device="meta")
    for backend, like, device in (("nccl", None, "cuda:1"), ("cpu:gloo,cuda:nccl", meta, "cuda:1"),
                                  ("gloo", meta, "cpu"), ("mpi", meta, "meta"), ("mpi", None, "cpu")):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, b=backend: b)
        assert collective_device(like=like) == torch.device(device), backend
