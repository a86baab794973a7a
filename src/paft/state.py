"""A rank's training state, tensor by tensor, in an order every rank shares.

Replicas are fingerprinted, compared, snapshotted and synchronized tensor by tensor,
so every rank must list the same tensors under the same names in the same order,
whatever wrapper (DDP, DataParallel, ``torch.compile``) it put around its model and
however its optimizer nests its state. :func:`state_tensors` is that listing (the live
tensors, not copies); :func:`state_fingerprint` is its
:func:`~paft.fingerprint.fingerprint`, the one number per rank whose agreement across
ranks says that the replicas are bitwise identical, and
:func:`fingerprints_over_ranks` gathers that number from every rank.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from paft.collectives import gather_rows
from paft.fingerprint import fingerprint

__all__ = [
    "state_tensors",
    "state_fingerprint",
    "fingerprints_over_ranks",
    "nested_tensors",
]


def _unwrap(model: nn.Module) -> nn.Module:
    """The user's module under DDP / DataParallel / torch.compile wrappers, so the
    tensor names (and the fingerprint) do not depend on how a rank wrapped it."""
    while True:
        if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
            model = model.module
            continue
        inner = getattr(model, "_orig_mod", None)  # torch.compile's OptimizedModule
        if isinstance(inner, nn.Module):
            model = inner
            continue
        inner = getattr(model, "module", None)
        # A generic wrapper exposing ``.module``: unwrap only when it owns nothing
        # of its own, so a user model with a submodule named "module" is kept whole.
        if (
            isinstance(inner, nn.Module)
            and {id(p) for p in model.parameters()} == {id(p) for p in inner.parameters()}
            and {id(b) for b in model.buffers()} == {id(b) for b in inner.buffers()}
        ):
            model = inner
            continue
        return model


def state_tensors(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, buffers: bool = True
) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of the training state, named, in a canonical rank-independent order.

    1. ``param/<name>`` for ``model.named_parameters()`` (DDP / DataParallel /
       ``torch.compile`` wrappers unwrapped, so names carry no ``module.`` prefix);
    2. ``buffer/<name>`` for ``model.named_buffers()``, integer buffers included
       (BatchNorm ``num_batches_tracked``);
    3. ``optim/<param index>/<state key>`` for every tensor in ``optimizer.state``,
       params numbered by their position in ``optimizer.param_groups`` order and
       keys sorted within a param (Adam: ``exp_avg``, ``exp_avg_sq``, ``step``).
       Tensors nested in lists, tuples and dicts (L-BFGS's history, per-block
       preconditioners of Shampoo-style optimizers) follow their entry as
       ``optim/<param index>/<state key>/<position or key>/...``. Other values
       (Python numbers, strings, None) are skipped: they are host-side bookkeeping
       that every replica updates alike.

    The tensors are the live objects (not copies): writing into them writes the state.

    ``buffers=False`` leaves out 2.: under DDP each rank updates its BatchNorm
    statistics from its own batch and DDP re-broadcasts rank 0's at the next
    forward, so buffers legitimately differ between ranks after a step. Replica
    agreement checks compare parameters and optimizer state only.
    """
    module = _unwrap(model)
    out: list[tuple[str, torch.Tensor]] = [
        (f"param/{name}", p) for name, p in module.named_parameters()
    ]
    if buffers:
        out.extend((f"buffer/{name}", b) for name, b in module.named_buffers())
    if optimizer is not None:
        index = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p)  # .get: never grows the defaultdict
                if state:
                    for key in sorted(state, key=str):
                        out.extend(nested_tensors(f"optim/{index}/{key}", state[key]))
                index += 1
    return out


def nested_tensors(name: str, value: object) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` for ``value`` itself or every tensor nested in its lists,
    tuples and dicts (dict keys in sorted order, so the names and their order are
    the same on every rank)."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from nested_tensors(f"{name}/{i}", item)
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            yield from nested_tensors(f"{name}/{key}", value[key])


def state_fingerprint(
    model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *, buffers: bool = True
) -> int:
    """:func:`fingerprint` of :func:`state_tensors` ``(model, optimizer, buffers=...)``."""
    return fingerprint(t for _, t in state_tensors(model, optimizer, buffers=buffers))


def fingerprints_over_ranks(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    buffers: bool = True,
    group: dist.ProcessGroup | None = None,
) -> list[int]:
    """Every rank's :func:`state_fingerprint` ``(model, optimizer, buffers=...)`` as it is
    now, in rank order: a collective, which every rank of ``group`` calls alike."""
    mine = torch.tensor([state_fingerprint(model, optimizer, buffers=buffers)], dtype=torch.int64)
    return gather_rows(mine, group)[:, 0].tolist()
