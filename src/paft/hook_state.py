"""The state of a user's comm hook as a guarded step found it, to restart a recompute from.

The guard recomputes a step by running the closure again, and with it the user's comm
hook (``protect(..., comm_hook=, comm_state=)``). A hook with state of its own advances
it on every attempt: torch's PowerSGD counts an iteration, keeps the attempt's residual
as error feedback and, with its default warm start, the attempt's all-reduced P and Q
as the next start. After a huge transient fault that Q is non-finite on every rank, and
so is every later compressed aggregate: the guard skipped every step from then on.
:class:`HookStateSnapshot` takes the hook's state before a step's first attempt and puts
it back before a recompute, so the recompute is the fault-free step bit for bit.

paft knows how to take two kinds of state (:func:`hook_snapshot`):

- torch's ``PowerSGDState``: its iteration count, error feedback, P and Q memories, the
  numpy RNG that seeds Q's random start, and its compression statistics;
- any object with ``state_dict()`` and ``load_state_dict()`` (a hook of your own): the
  dict's tensors are copied, everything else deep-copied, and a copy is loaded back.

Any other state (``None``, a process group: the stateless hooks) gets no snapshot. The
tensors' copies are kept between steps and reused while their shapes stay (one copy of
PowerSGD's error feedback: a gradient's size, on its device).
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["HookStateSnapshot", "hook_snapshot"]

_POWERSGD_DICTS = ("error_dict", "p_memory_dict", "q_memory_dict")
_POWERSGD_COUNTS = ("iter", "total_numel_before_compression", "total_numel_after_compression", "next_stats_report")


def _copy_into(value: Any, kept: Any) -> Any:
    """A copy of ``value`` that shares nothing mutable with it, written into ``kept`` (the
    previous copy) where a tensor keeps its shape, dtype and device."""
    if isinstance(value, torch.Tensor):
        if (isinstance(kept, torch.Tensor) and kept.shape == value.shape and kept.dtype == value.dtype
                and kept.device == value.device):
            return kept.copy_(value.detach())
        return value.detach().clone()
    if type(value) in (dict, OrderedDict):  # exactly: a subclass may not build from pairs
        old = kept if isinstance(kept, dict) else {}
        return type(value)((k, _copy_into(v, old.get(k))) for k, v in value.items())
    if type(value) in (list, tuple):
        old_seq = kept if isinstance(kept, type(value)) and len(kept) == len(value) else [None] * len(value)
        return type(value)(_copy_into(v, o) for v, o in zip(value, old_seq))
    return copy.deepcopy(value)


def _powersgd_state(state: Any) -> dict[str, Any]:
    """PowerSGD's mutable state, live (not copied)."""
    out = {name: getattr(state, name) for name in (*_POWERSGD_DICTS, *_POWERSGD_COUNTS)}
    out["rng"] = state.rng.get_state()
    return out


def _load_powersgd_state(state: Any, saved: dict[str, Any]) -> None:
    """Put ``saved`` back into PowerSGD's ``state``: into its own tensors where they kept
    their shapes (the hook replaces some of them every step: error feedback, the all-reduced
    P and Q), fresh copies elsewhere, so ``saved`` stays unchanged for another recompute;
    entries the attempt added (or cleared, without warm start) are dropped (or brought back)."""
    for name in _POWERSGD_DICTS:
        live: dict[int, torch.Tensor] = getattr(state, name)
        for key in [k for k in live if k not in saved[name]]:
            del live[key]
        for key, tensor in saved[name].items():
            live[key] = _copy_into(tensor, live.get(key))
    for name in _POWERSGD_COUNTS:
        setattr(state, name, saved[name])
    state.rng.set_state(saved["rng"])


class HookStateSnapshot:
    """The state of one comm hook, taken by :meth:`take` and put back by :meth:`restore`.

    Args:
        get: the state's current value (a structure of dicts, lists, tuples, tensors and
            plain values; it may share tensors with the live state: it is copied here).
        load: puts such a value back; it is given a copy, never the snapshot itself,
            unless ``load_copies`` says it copies what it is given.
    """

    def __init__(self, get: Callable[[], Any], load: Callable[[Any], None], *, load_copies: bool = False) -> None:
        self._get = get
        self._load = load
        self._load_copies = load_copies
        self._saved: Any = None
        self._taken = False

    def take(self) -> None:
        """Copy the state as it is now (before a step's first attempt)."""
        self._saved = _copy_into(self._get(), self._saved)
        self._taken = True

    def restore(self) -> None:
        """Put the state of the last :meth:`take` back (before a recompute); again and again
        if need be: the snapshot itself is never handed out."""
        if not self._taken:
            raise RuntimeError("HookStateSnapshot.restore() before take()")
        self._load(self._saved if self._load_copies else _copy_into(self._saved, None))


def hook_snapshot(state: Any) -> HookStateSnapshot | None:
    """A snapshot of a comm hook's ``state`` if paft knows how to take one: torch's
    ``PowerSGDState``, or an object with ``state_dict()`` and ``load_state_dict()``;
    ``None`` for any other (stateless hooks' ``None`` or process group)."""
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

    if isinstance(state, PowerSGDState):
        return HookStateSnapshot(lambda: _powersgd_state(state), lambda saved: _load_powersgd_state(state, saved),
                                 load_copies=True)
    if callable(getattr(state, "state_dict", None)) and callable(getattr(state, "load_state_dict", None)):
        return HookStateSnapshot(state.state_dict, state.load_state_dict)
    return None
