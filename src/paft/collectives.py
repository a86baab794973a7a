"""The few-number collectives paft's protocol is built from, on any backend.

- :func:`start_gather_rows` / :func:`gather_rows`: every rank's small 1-D row, as an
  all-gather gives it (on gloo an all-to-all, which costs less there): the per-step
  control vector, settings digests, sync decisions, evaluation results;
- :func:`start_gather_into`: an all-gather into a ``[world_size, n]`` tensor of the
  caller's (a sync's all-gathered buckets);
- :func:`max_over_ranks`: one float's max, the same on every rank;
- :func:`all_gather_flat`: every rank's flat tensor, concatenated;
- :func:`collective_device`: where a group's collectives take their tensors.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["start_gather_rows", "start_gather_into", "gather_rows", "max_over_ranks", "all_gather_flat",
           "collective_device"]

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def start_gather_rows(row: torch.Tensor, group: dist.ProcessGroup | None = None) -> tuple[torch.Tensor, Any]:
    """``(out, work)``: ``out[r]`` (``[world_size, n]``, on the group's collective device)
    receives rank r's 1-D ``row``, as an all-gather does, once ``work.wait()`` returns.

    On gloo it is an all-to-all of ``row`` repeated once per rank: gloo's all-gather is
    a ring of world_size - 1 dependent rounds, each a thread wake-up, whereas its
    all-to-all posts every send and receive at once. For the 2 KB control vector at 4
    ranks on 2 CPU cores, a collective alone took 0.9 against 1.6 ms of CPU per rank,
    and paired training steps 0.4-0.6 points of step time less (the README's overhead
    section). ``collectives_test`` checks the rows bit for bit. Other backends keep
    their own all-gather, and so do a mixed group's CUDA collectives
    (``cpu:gloo,cuda:nccl``, as ``paft train`` makes on GPUs: NCCL moves them).
    """
    world_size = dist.get_world_size(group)
    device = collective_device(group, row)
    row = row.reshape(-1).to(device)
    out = torch.empty(world_size, row.numel(), dtype=row.dtype, device=device)
    if device.type == "cpu" and "gloo" in str(dist.get_backend(group)).lower():
        work = dist.all_to_all_single(out, row.repeat(world_size, 1), group=group, async_op=True)
    else:
        work = start_gather_into(out, row, group)
    return out, work


def start_gather_into(out: torch.Tensor, row: torch.Tensor, group: dist.ProcessGroup | None = None) -> Any:
    """Launch the all-gather of every rank's ``row`` into the rows of the contiguous
    ``[world_size, n]`` tensor ``out`` (both on the group's collective device); its work.
    Into one tensor: the list form made NCCL gather into a temporary of its own and copy
    each row out, twice the memory."""
    return _all_gather_single(out.view(-1), row, group=group, async_op=True)  # gloo takes the flat form only


def gather_rows(row: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's 1-D ``row`` (same length and dtype everywhere) as a ``[world_size, n]``
    tensor on the group's collective device: the blocking form of the control
    collective, for the few-number exchanges outside the step (settings digests,
    sync decisions, evaluation results, final fingerprints)."""
    out, work = start_gather_rows(row, group)
    work.wait()
    return out


def max_over_ranks(value: float, group: dist.ProcessGroup | None = None) -> float:
    """The max of ``value`` over the group's ranks (blocking, 8 bytes), the same on every
    rank; NaN anywhere gives inf (gloo's MAX keeps a NaN only when rank 0 holds it)."""
    value = math.inf if math.isnan(value) else value
    t = torch.tensor([value], dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def all_gather_flat(flat: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Every rank's 1-D ``flat`` (same length everywhere), rank order, as one tensor on
    the group's collective device."""
    out = torch.empty(dist.get_world_size(group) * flat.numel(), dtype=flat.dtype, device=collective_device(group))
    _all_gather_single(out, flat.to(out.device), group=group)
    return out


def collective_device(group: dist.ProcessGroup | None = None, like: torch.Tensor | None = None) -> torch.device:
    """Where tensors must live for ``group``'s collectives: NCCL moves CUDA tensors, gloo
    CPU tensors; another backend gets ``like``'s device (CPU without one)."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend:
        return torch.device("cuda", torch.cuda.current_device())
    if "gloo" in backend or like is None:
        return torch.device("cpu")
    return like.device
