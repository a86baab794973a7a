"""Several optimizers over disjoint parameters, stepped and protected as one.

Modern recipes split a model between optimizers: Muon for the hidden weight
matrices, AdamW for embeddings, head, norms and biases (``torch.optim.Muon`` takes
2-D parameters only). paft fingerprints, syncs, snapshots and rolls back one
optimizer's state, so :func:`paft.protect` takes a list of optimizers and chains
them in an :class:`OptimizerChain`: a ``torch.optim.Optimizer`` whose
``param_groups`` are the chained optimizers' own group dicts, in order, and whose
``state`` reads and writes each parameter's entry in the optimizer that owns it.
Nothing is copied, so an LR scheduler built on one of the chained optimizers, or
``add_param_group`` on one of them, is seen by paft at once.

Example::

    >>> import torch
    >>> from paft.optimizers import OptimizerChain
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False), torch.nn.LayerNorm(4))
    >>> muon = torch.optim.Muon([model[0].weight], lr=0.02, adjust_lr_fn="match_rms_adamw")
    >>> adamw = torch.optim.AdamW(model[1].parameters(), lr=1e-3)
    >>> chain = OptimizerChain([muon, adamw])
    >>> model(torch.randn(8, 4)).square().mean().backward()
    >>> _ = chain.step()
    >>> sorted(chain.state[model[0].weight]), sorted(chain.state[model[1].weight])
    (['momentum_buffer'], ['exp_avg', 'exp_avg_sq', 'step'])
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, MutableMapping, Sequence
from typing import Any

import torch

__all__ = ["OptimizerChain", "chained", "check_disjoint"]


def check_disjoint(optimizers: Sequence[torch.optim.Optimizer], context: str) -> None:
    """Raise ``ValueError`` (``context`` first) if a parameter is in two of ``optimizers``:
    each would step it. torch refuses a parameter twice within one optimizer only."""
    owner: dict[int, int] = {}
    for i, optimizer in enumerate(optimizers):
        for group in optimizer.param_groups:
            for p in group["params"]:
                first = owner.setdefault(id(p), i)
                if first != i:
                    raise ValueError(f"{context}: a parameter of shape {tuple(p.shape)} is held by optimizer {first} "
                                     f"({type(optimizers[first]).__name__}) and optimizer {i} "
                                     f"({type(optimizer).__name__}); each parameter needs exactly one optimizer")


def chained(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers a chain steps, or ``[optimizer]`` for one that is not a chain."""
    return list(optimizer.optimizers) if isinstance(optimizer, OptimizerChain) else [optimizer]


def _holds(place: tuple[torch.optim.Optimizer, dict[str, Any], int], param: torch.Tensor) -> bool:
    """Whether ``param`` is still at ``place``: that index of that group, which that
    optimizer still has."""
    optimizer, group, index = place
    params = group["params"]
    return index < len(params) and params[index] is param and any(g is group for g in optimizer.param_groups)


class _ChainedState(MutableMapping[torch.Tensor, Any]):
    """``optimizer.state`` of a chain: each parameter's entry lives in its owner's
    ``state``; reading one that has none creates it there, as a ``defaultdict`` does."""

    def __init__(self, chain: OptimizerChain) -> None:
        self._chain = chain
        self._places: dict[int, tuple[torch.optim.Optimizer, dict[str, Any], int]] = {}

    def _owner(self, param: torch.Tensor) -> torch.optim.Optimizer:
        # Each parameter's place (optimizer, group, index), checked at each lookup: a place
        # that no longer holds it (groups added, removed or moved, parameters moved,
        # swapped or replaced in place) rebuilds them all. A few identity tests per
        # lookup, not a walk over every parameter.
        place = self._places.get(id(param))
        if place is None or not _holds(place, param):
            self._places = {id(p): (o, g, i) for o in self._chain.optimizers
                            for g in o.param_groups for i, p in enumerate(g["params"])}
            place = self._places.get(id(param))
            if place is None:
                raise KeyError(f"a parameter of shape {tuple(param.shape)} that no chained optimizer holds")
        return place[0]

    def __getitem__(self, param: torch.Tensor) -> Any:
        return self._owner(param).state[param]

    def __setitem__(self, param: torch.Tensor, value: Any) -> None:
        self._owner(param).state[param] = value

    def __delitem__(self, param: torch.Tensor) -> None:
        del self._owner(param).state[param]

    def get(self, param: torch.Tensor, default: Any = None) -> Any:
        # Never creates an entry: a missing one stays missing (Mapping.get would call
        # __getitem__, which grows the owner's defaultdict).
        for optimizer in self._chain.optimizers:
            if param in optimizer.state:
                return optimizer.state[param]
        return default

    def pop(self, param: torch.Tensor, *default: Any) -> Any:
        """As a dict's: the entry removed from its owner, else ``default`` (Mapping's
        would create an empty entry through the owner's defaultdict and return that)."""
        for optimizer in self._chain.optimizers:
            if param in optimizer.state:
                return optimizer.state.pop(param)
        if default:
            return default[0]
        raise KeyError(param)

    def setdefault(self, param: torch.Tensor, default: Any = None) -> Any:
        """As a dict's: the entry, or ``default`` stored in the owner and returned."""
        owner = self._owner(param)
        if param not in owner.state:
            owner.state[param] = default
        return owner.state[param]

    def __contains__(self, param: object) -> bool:
        return any(param in optimizer.state for optimizer in self._chain.optimizers)

    def __iter__(self) -> Iterator[torch.Tensor]:
        for optimizer in self._chain.optimizers:
            yield from optimizer.state

    def __len__(self) -> int:
        return sum(len(optimizer.state) for optimizer in self._chain.optimizers)


class OptimizerChain(torch.optim.Optimizer):
    """Optimizers over disjoint parameters, as one ``torch.optim.Optimizer``.

    ``step()`` steps each in order; ``zero_grad()``, ``state_dict()`` and
    ``load_state_dict()`` go to each; ``param_groups`` and ``state`` are live views of
    theirs (see the module docstring). Add a param group to one of the chained
    optimizers, not to the chain. Step hooks registered on the chain run around the
    whole chain's step; those on a chained optimizer around its own.

    Raises ``TypeError`` for something that is not an optimizer (or is itself a
    chain) and ``ValueError`` for an empty list, the same optimizer twice, or a
    parameter held by two of them.
    """

    def __init__(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        optimizers = list(optimizers)
        if not optimizers:
            raise ValueError("OptimizerChain: needs at least one optimizer")
        for i, optimizer in enumerate(optimizers):
            if isinstance(optimizer, OptimizerChain) or not isinstance(optimizer, torch.optim.Optimizer):
                kind = "a chain" if isinstance(optimizer, OptimizerChain) else type(optimizer).__name__
                raise TypeError(f"OptimizerChain: optimizer {i} must be a torch.optim.Optimizer that is not "
                                f"itself a chain, got {kind}")
            if any(optimizer is other for other in optimizers[:i]):
                raise ValueError(f"OptimizerChain: optimizer {i} ({type(optimizer).__name__}) is listed twice")
        check_disjoint(optimizers, "OptimizerChain")
        self.optimizers = optimizers
        self._building = True
        # torch's own set-up: step hooks and profiling. The group and state it makes
        # are dropped (see the setters below): the chained optimizers hold the real ones.
        super().__init__([p for o in optimizers for g in o.param_groups for p in g["params"]], {})
        self._building = False
        self._state = _ChainedState(self)

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The chained optimizers' group dicts themselves, in chain order."""
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._refuse_assignment("param_groups")

    @property  # type: ignore[override]
    def state(self) -> _ChainedState:
        """Each parameter's state, in the optimizer that owns it."""
        return self._state

    @state.setter
    def state(self, value: Any) -> None:
        self._refuse_assignment("state")

    def _refuse_assignment(self, name: str) -> None:
        if not self.__dict__.get("_building", False):
            raise AttributeError(f"OptimizerChain.{name} is a view of the chained optimizers'; set theirs")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self.__dict__.get("_building", False):
            return  # torch's __init__ adding the placeholder group
        raise TypeError("OptimizerChain.add_param_group(): add the group to one of the chained optimizers "
                        "(chain.optimizers[i].add_param_group(...)); the chain sees it at once")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Step every chained optimizer, in order; ``closure`` (if given) is evaluated
        once, before the first."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"optimizers": [optimizer.state_dict() for optimizer in self.optimizers]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = state_dict.get("optimizers") if isinstance(state_dict, dict) else None
        if not isinstance(saved, list) or len(saved) != len(self.optimizers):
            got = len(saved) if isinstance(saved, list) else "no"
            raise ValueError(f"OptimizerChain.load_state_dict(): expected the state of {len(self.optimizers)} "
                             f"optimizers (a chain's state_dict()), got {got}")
        for optimizer, state in zip(self.optimizers, saved):
            optimizer.load_state_dict(state)

    def __reduce__(self) -> tuple[type, tuple[list[torch.optim.Optimizer]]]:
        # copy.deepcopy and pickle: a chain of the copied optimizers (torch's
        # __getstate__ would carry the views' contents, which the setters refuse).
        return OptimizerChain, (self.optimizers,)

    def _no_state_dict_hooks(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError("OptimizerChain: register state-dict hooks on the chained optimizers, whose "
                        "state_dict() and load_state_dict() the chain's call")

    # The chain's state_dict() is its optimizers': a hook on the chain would never run.
    register_state_dict_pre_hook = _no_state_dict_hooks
    register_state_dict_post_hook = _no_state_dict_hooks
    register_load_state_dict_pre_hook = _no_state_dict_hooks
    register_load_state_dict_post_hook = _no_state_dict_hooks

    def __repr__(self) -> str:
        return f"OptimizerChain({', '.join(type(o).__name__ for o in self.optimizers)})"
