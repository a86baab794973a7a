"""The optimizer step, with or without a ``torch.amp.GradScaler``, made re-runnable.

A loss scaler's protocol is one pass per iteration: ``scaler.scale(loss).backward()``,
``scaler.unscale_(opt)`` (at most once), ``scaler.step(opt)`` (skipped when a gradient
overflowed), ``scaler.update()`` (the scale backs off after an overflow and grows
after ``growth_interval`` clean steps). The protector runs the backward pass again
on a recompute and may drop or roll back a step, which that protocol does not allow
(``unscale_() has already been called``). :class:`OptimizerStep` keeps the two in step:

* :meth:`~OptimizerStep.unscale` after every backward attempt, so that the norms, the
  guard and clipping see the true gradients; it returns the scale the loss was
  multiplied by, which the comm hook's captures (taken during the backward pass) are
  divided by;
* :meth:`~OptimizerStep.discard` for an attempt that will not be stepped: its inf
  checks are forgotten and the scale is left as it was (``update(new_scale=...)`` is
  the scaler's public reset);
* :meth:`~OptimizerStep.step`: ``scaler.step`` then ``scaler.update``; :meth:`~OptimizerStep.skip`
  when the ranks agreed that some rank overflowed, so every rank's scale backs off alike
  (:meth:`~OptimizerStep.apply` does one or the other; :meth:`~OptimizerStep.overflow`
  tells the scaler's overflow from a fault, alike on every rank);
* :meth:`~OptimizerStep.state` / :meth:`~OptimizerStep.restore` around a step the
  guard rolls back, so a recomputed step starts from the scale the first one had.

Without a scaler :meth:`~OptimizerStep.unscale` returns 1.0 and the state methods
carry nothing; :meth:`~OptimizerStep.skip` is refused (skipping is then the guard's).

Example::

    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> stepper = OptimizerStep(opt, torch.amp.GradScaler("cpu", init_scale=1024.0))
    >>> stepper.scaler.scale(model(torch.ones(1, 4)).sum()).backward()
    >>> stepper.unscale()           # the scale the loss was multiplied by
    1024.0
    >>> stepper.step()              # skipped by the scaler if one overflowed
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from paft.consistency import FLAG_AGG_NONFINITE, FLAG_LOSS_NONFINITE, ControlView
from paft.state import fingerprints_over_ranks

__all__ = ["OptimizerStep"]


class OptimizerStep:
    """``optimizer.step()``, or a loss scaler's unscale / step / update around it."""

    def __init__(self, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None = None) -> None:
        if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
            raise TypeError(f"protect(): scaler= must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        self.optimizer = optimizer
        # A disabled scaler (GradScaler(enabled=False)) scales nothing: the plain step.
        self.scaler = scaler if scaler is not None and scaler.is_enabled() else None

    def unscale(self) -> float:
        """Divide the gradients by the scale (``scaler.unscale_``); the scale, 1.0 without."""
        if self.scaler is None:
            return 1.0
        scale = self.scaler.get_scale()
        self.scaler.unscale_(self.optimizer)
        return scale

    def step(self) -> None:
        """Apply the update: ``optimizer.step()``, or ``scaler.step`` (which skips it if a
        gradient overflowed) then ``scaler.update`` (the scale backs off or grows)."""
        if self.scaler is None:
            self.optimizer.step()
            return
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def skip(self) -> None:
        """No step, and the scale backs off as after an overflow (``scaler.update`` after a
        found inf: scale times ``backoff_factor``, growth count back to 0), on a rank whose
        own gradients may be finite: every rank skips when any rank overflowed."""
        if self.scaler is None:
            raise RuntimeError("OptimizerStep.skip(): no loss scaler (without one, skipping is the guard's)")
        state = self.scaler.state_dict()
        # As torch's update kernel rounds it: float scale times double factor, rounded once.
        backed_off = torch.tensor(state["scale"] * state["backoff_factor"], dtype=torch.float32)
        state.update(scale=float(backed_off), _growth_tracker=0)
        self.scaler.load_state_dict(state)
        self.discard()

    def apply(self, skip: bool) -> bool:
        """The optimizer's step (the loss scaler's, where there is one); ``skip`` (only with
        a scaler, known alike on every rank: some rank's aggregated gradient is non-finite)
        skips it on every rank and backs the scale off, so the ranks' scales never part
        (each scaler alone decides from its own rank's gradients, which a fault makes
        differ). Whether the update was applied."""
        if skip:
            self.skip()
        else:
            self.step()
        return not skip

    def overflow(self, view: ControlView, model: DistributedDataParallel) -> bool:
        """Whether the step is a loss scaler's overflow, not a fault: every rank holds the
        same non-finite aggregated gradient, from finite losses and agreeing state (a NaN
        in one rank's weights spreads through the all-reduce alike, but its loss is NaN
        and its fingerprint differs: the state is fingerprinted here when this step did
        not). A fault that makes one rank's local gradient non-finite looks the same, and
        is skipped as the scaler would skip it. A collective over ``model``'s group where
        the state is fingerprinted here."""
        if not (self.scaler is not None and len(view.ranks_with(FLAG_AGG_NONFINITE)) == view.world_size
                and len(set(view.agg_checksum_keys())) == 1 and not view.ranks_with(FLAG_LOSS_NONFINITE)):
            return False
        states = view.state_fingerprints()
        if states is None:  # not a state-check step: look now (every rank alike; overflows are rare)
            states = fingerprints_over_ranks(model, self.optimizer, buffers=False, group=model.process_group)
        return len(set(states)) == 1

    def discard(self) -> None:
        """Forget this attempt's unscale and inf checks; the scale stays as it was."""
        if self.scaler is not None:
            self.scaler.update(self.scaler.get_scale())

    def state(self) -> dict[str, Any] | None:
        """The loss scaler's state (scale, growth count), ``None`` without one: taken
        before a step the guard may roll back, for :meth:`restore`."""
        return self.scaler.state_dict() if self.scaler is not None else None

    def restore(self, state: dict[str, Any] | None) -> None:
        """Put back what :meth:`state` took, so that a rolled-back step's recompute
        starts from the scale the first attempt had, and forget that attempt's unscale
        and inf checks (:meth:`discard`); with ``None`` or no scaler, nothing."""
        if self.scaler is not None and state is not None:
            self.scaler.load_state_dict(state)
            self.discard()
