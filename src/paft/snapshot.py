"""Snapshots that let the guard undo part of a step, bit for bit.

* :class:`ForwardSnapshot` -- what a recomputation of the step starts from: the RNG
  states and the buffers the forward pass mutates (BatchNorm statistics), and the
  state of a user's comm hook (:mod:`paft.hook_state`);
* :class:`StateSnapshot` -- parameters and optimizer state before
  ``optimizer.step()``, for the rollback after a harmful update, and the
  update-to-weight ratio that decides it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paft.flat import consecutive_runs, copy_all_
from paft.hook_state import HookStateSnapshot
from paft.norms import norm_of
from paft.state import nested_tensors, state_tensors

__all__ = ["ForwardSnapshot", "StateSnapshot", "buffer_slots"]


def buffer_slots(module: nn.Module) -> list[tuple[nn.Module, str]]:
    """Where ``module``'s buffers live: (the submodule, the buffer's name) for each.

    The places, not the tensors: a forward may replace a buffer by assignment
    (``self.ema = 0.9 * self.ema + 0.1 * x.mean(0)``), which DDP allows (it lists the
    buffers it broadcasts afresh at each forward); a list of the tensors taken once
    would then hold one the module no longer has."""
    return [(m, name) for m in module.modules() for name, b in m._buffers.items() if b is not None]


class ForwardSnapshot:
    """What a recomputation of the step must start from: RNG states and buffers (``slots``,
    see :func:`buffer_slots`), and the state of a user's comm hook where paft can take
    it (``hook``, see :mod:`paft.hook_state`).

    Parameters and optimizer state are untouched until ``optimizer.step()``; only
    what the forward itself mutates (BatchNorm statistics, a buffer it replaces) and
    the RNG that dropout draws from are copied, both small, and what the backward's
    comm hook mutates.
    """

    def __init__(self, slots: Sequence[tuple[nn.Module, str]], hook: HookStateSnapshot | None = None) -> None:
        self.cpu_rng = torch.get_rng_state()
        # Only where this process started CUDA: get_rng_state_all() would start it (a
        # context on every GPU) in a CPU run on a GPU machine, which drew nothing from it.
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self._slots = slots
        self.buffers = self._take()
        self.hook = hook
        if hook is not None:
            hook.take()

    def _take(self) -> list[tuple[nn.Module, str, torch.Tensor, torch.Tensor]]:
        """Each slot's buffer now: the tensor itself and a copy of its values."""
        taken = []
        for module, name in self._slots:
            live = module._buffers.get(name)
            if live is not None:
                taken.append((module, name, live, live.detach().clone()))
        return taken

    def keep_buffers(self) -> None:
        """Take the buffers as they are now as the ones to restore: a repair synced
        them, and a later recompute of the same step must not bring back the
        corrupted statistics the repair replaced."""
        self.buffers = self._take()

    def restore(self) -> None:
        """Put the RNG states, the buffers and the hook's state back (before a recompute):
        each buffer the tensor it was, with its values then, also where the attempt's
        forward replaced it by another."""
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        with torch.no_grad():
            for module, name, tensor, saved in self.buffers:
                tensor.copy_(saved)
                if module._buffers.get(name) is not tensor:
                    setattr(module, name, tensor)
        if self.hook is not None:
            self.hook.restore()


DIFF_BATCH_BYTES = 64 << 20
"""The update ratio subtracts the parameters a run of at most this many bytes at a time."""


def _copy_structure(value: Any) -> Any:
    """``value`` with its lists and dicts copied (recursively) and everything else,
    tensors and immutable tuples included, shared: what a snapshot needs to undo
    in-place appends and replaced entries."""
    if isinstance(value, list):
        return [_copy_structure(v) for v in value]
    if isinstance(value, dict):
        return {k: _copy_structure(v) for k, v in value.items()}
    return value


class StateSnapshot:
    """Parameters and optimizer state before ``optimizer.step()``, for a post-step rollback.

    Taken only when the guard arms it (:meth:`Guard.wants_snapshot`). The copies are
    allocated once and reused, so a snapshot is one batched copy of the state (no
    allocation, no ``state_dict`` deep copy). Optimizer state that the step creates
    (the first step of Adam, SGD momentum) is removed again on restore; every state
    entry is put back: a tensor the step replaced by a new one (``state["m"] = beta
    * m + g``, as hand-written optimizers do) by the old object, and non-tensor
    entries from a copy of their structure (lists and dicts of tensors that the step
    grows or rotates in place get their old members back), the tensors with their
    old values; and so is every entry of each param group (state an optimizer keeps
    there, as D-Adaptation's and Prodigy's ``d`` and ``k``).
    """

    def __init__(self) -> None:
        self._saved: list[torch.Tensor] = []
        self._live: list[torch.Tensor] = []
        self._num_params = 0
        # Per parameter: its state's keys and entries (None: no state entry yet; an
        # empty dict, which state_dict() lists, is kept as one).
        self._param_state: dict[torch.Tensor, tuple[set[Any], dict[Any, Any]] | None] = {}
        self._groups: list[dict[str, Any]] = []
        # The tensors in the param groups (the objects) and copies of their values.
        self._group_tensors: list[torch.Tensor] = []
        self._group_values: list[torch.Tensor] = []

    def capture(self, model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> StateSnapshot:
        """Take the state as it is now (before ``optimizer.step()``); ``self``."""
        # What optimizer.step() can change: the optimizer's parameters and its state. A
        # frozen backbone never moves: copied, it cost a model-sized copy per armed step,
        # and in the ratio's denominator it diluted the trained parameters' update (a
        # small head's ratio of 287 read as 28.5 beside a frozen 1000 x 1000 layer). Also
        # where the optimizer holds it (AdamW(model.parameters()) beside requires_grad_(False)):
        # it gets no gradient, which torch's optimizers skip; one with a gradient counts.
        held = {id(p) for group in optimizer.param_groups for p in group["params"]
                if p.requires_grad or p.grad is not None}
        named = [(n, t) for n, t in state_tensors(model, optimizer, buffers=False)
                 if not n.startswith("param/") or id(t) in held]
        live = [t for _, t in named]
        layout = [(t.shape, t.dtype, t.device) for t in live]
        if layout != [(t.shape, t.dtype, t.device) for t in self._saved]:
            self._saved = [torch.empty_like(t) for t in live]
        with torch.no_grad():
            copy_all_(self._saved, live)
        self._live = live
        self._num_params = sum(1 for n, _ in named if n.startswith("param/"))
        self._param_state = {}
        # Optimizer state kept per group (D-Adaptation's and Prodigy's ``d`` and ``k``,
        # which step() changes): every entry but the parameters, and the values of the
        # tensors among them, which restore writes back into these same objects (a
        # scheduler may hold a tensor ``lr``).
        self._groups = [{k: _copy_structure(v) for k, v in group.items() if k != "params"}
                        for group in optimizer.param_groups]
        self._group_tensors = [t for group in self._groups for _, t in nested_tensors("", group)]
        self._group_values = [t.detach().clone() for t in self._group_tensors]
        for group in optimizer.param_groups:
            for p in group["params"]:
                state = optimizer.state.get(p)
                self._param_state[p] = None if state is None else (
                    set(state), {k: _copy_structure(v) for k, v in state.items()})
        return self

    def update_ratio(self) -> float:
        """||w_new - w_old|| / ||w_old|| over the optimizer's parameters (the live ones
        against the copy): inf when the update is not finite, 0 when every old weight is
        0 (a zero-initialised model has no scale to compare its first update with)."""
        old, new = self._saved[: self._num_params], self._live[: self._num_params]
        runs = consecutive_runs([t.numel() * t.element_size() for t in old], DIFF_BATCH_BYTES)
        with torch.no_grad():
            # The differences a batch at a time: all at once they were another copy of
            # the parameters (a second model on a GPU, on top of the snapshot).
            num = math.hypot(*(norm_of(torch._foreach_sub(new[i:j], old[i:j])) for i, j in runs))
            den = norm_of(old)
        if not math.isfinite(num):
            return math.inf
        return num / den if den > 0 else 0.0

    def restore(self, optimizer: torch.optim.Optimizer) -> None:
        """Put the captured state back (the rollback); again and again if need be: the
        snapshot's own structures are never handed out."""
        with torch.no_grad():
            copy_all_(self._live, self._saved)
        for p, entries in self._param_state.items():
            if entries is None:
                optimizer.state.pop(p, None)  # the step created this state: undo it
                continue
            keys, values = entries
            state = optimizer.state[p]
            for key in set(state) - keys:
                del state[key]
            # Copies again: the snapshot's own lists, handed over, would grow with the
            # next step, and a second restore from this capture would not be exact.
            state.update({k: _copy_structure(v) for k, v in values.items()})
        # The captured objects, not the group's present ones: a tensor put in place of
        # one (a float64 ``lr``) would keep its own dtype if written into.
        with torch.no_grad():
            for live, value in zip(self._group_tensors, self._group_values):
                live.copy_(value)
        for group, saved in zip(optimizer.param_groups, self._groups):
            for key in set(group) - set(saved) - {"params"}:
                del group[key]
            group.update({k: _copy_structure(v) for k, v in saved.items()})
