"""This rank's side of one attempt at a protected step, up to the step's control collective.

A protected step (:class:`paft.protect.Protector`) is planned once (:class:`StepPlan`)
and then attempted, once or, where the guard recomputes it, again; how its attempts
ended is its :class:`StepOutcome`. :class:`AttemptRunner` does what each attempt
needs of this rank alone, and so never decides anything on its own:

- faults at rest (``params`` / ``optimizer-state`` sites) injected, and every fault
  this rank injects recorded and counted;
- the user's closure run and checked (a one-element loss, a backward pass that
  reached DDP's all-reduce);
- the aggregated gradient's norm, computed once: as the guard judges it, and as
  clipping reuses it (bitwise ``clip_grad_norm_``);
- this rank's :class:`~paft.consistency.ControlVector` packed from the comm hook's
  captures, and the step's one control collective launched.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from paft.comm import CommHookState
from paft.consistency import (
    FLAG_AGG_NONFINITE,
    FLAG_LOCAL_NONFINITE,
    FLAG_LOSS_NONFINITE,
    ControlVector,
    ControlView,
    PendingControl,
    start_control,
)
from paft.faults import FaultInjector
from paft.guard import GuardVerdict
from paft.norms import judged_norm, total_norm
from paft.records import RunRecorder
from paft.state import state_fingerprint, state_tensors

__all__ = ["StepPlan", "StepOutcome", "AttemptRunner"]


@dataclass(frozen=True)
class StepPlan:
    """What one protected step does, fixed before its first attempt."""

    step: int
    closure: Callable[[], torch.Tensor]
    rest_faults: int
    """Faults at rest injected before the first attempt."""
    check_state: bool
    """Fingerprint the state (every ``fingerprint_every`` steps; every rerun does)."""
    metric_step: bool
    """Capture the worker metrics (every ``interval`` steps)."""


@dataclass
class StepOutcome:
    """How a step's attempts ended."""

    view: ControlView
    """The control collective of the last attempt."""
    attempts: int = 1
    applied: bool = True
    ratio: float | None = None
    """The update-to-weight ratio, where the guard measured it."""
    overflow: bool = False
    """The loss scaler's overflow skipped the step."""
    synced: bool = False
    """A sync landed, or the guard repaired the replicas, during the attempts."""
    stopped: GuardVerdict | None = None
    """The guard's verdict that stops the run: nothing was applied, and the protector
    ends the step and raises."""


class AttemptRunner:
    """This rank's part in each attempt of a protector's steps (one per protector).

    ``hook``: the comm hook's state registered on ``model``, whose captures the control
    vector is packed from; ``hooked``: whether it is registered (else the closure's
    backward pass is checked by the gradients' versions). ``sketch_dim``: the
    sketch's length on metric steps (0: none travels). ``grad_clip``: 0 for none.
    """

    def __init__(self, model: DistributedDataParallel, optimizer: torch.optim.Optimizer, hook: CommHookState,
                 injector: FaultInjector, recorder: RunRecorder, *, hooked: bool, sketch_dim: int,
                 grad_clip: float) -> None:
        self.model, self.optimizer = model, optimizer
        self.hook, self.injector, self.recorder = hook, injector, recorder
        self.group = model.process_group
        self._hooked = hooked
        self.sketch_dim = sketch_dim
        self.grad_clip = grad_clip
        # Walking the module tree costs ~0.4 ms per call on a small model; the set of
        # parameters is fixed once DDP wraps the model, so collect it once.
        self._params = list(model.parameters())
        self._grad_norm: torch.Tensor | None = None
        self.faults_injected = 0  # at rest and in the hook: the run's ``faults_injected``

    def run_closure(self, closure: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The closure's loss, checked: a wrong return value or a missing backward() would
        otherwise fail deep inside the step, or train nothing without a word (a closure
        without backward() after an earlier step would apply that step's gradients again)."""
        # Without paft's hook: a backward pass creates each gradient or writes into it,
        # which bumps its version (so does a zero_grad(set_to_none=False): only the
        # hook, which sees every bucket DDP all-reduces, tells that apart). A gradient
        # zero_grad() set to None is no backward's: the optimizer would step nothing.
        before = [] if self._hooked else [(p.grad, p.grad._version if p.grad is not None else 0)
                                          for p in self._params]
        loss = closure()
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TypeError(f"the closure must return the loss as a one-element tensor, got {got}")
        fix = ("call optimizer.zero_grad() and loss.backward() inside the closure (with ddp.no_sync(), the last "
               "micro-batch outside it)")
        if self._hooked:
            # DDP reduces no bucket until each of its parameters has a gradient: the
            # unused parameters of a model are as likely as a missing backward().
            if self.hook.buckets_seen == 0:
                raise RuntimeError(
                    "the closure ran no backward(), or its backward() left parameters without a gradient (unused "
                    "parameters: pass find_unused_parameters=True to DistributedDataParallel): DDP all-reduced no "
                    f"gradient; {fix}, and call the DDP model, ddp(x), not the module it wraps"
                )
        elif not any(p.grad is not None and (p.grad is not g or p.grad._version != v)
                     for p, (g, v) in zip(self._params, before)):
            raise RuntimeError(f"the closure ran no backward(): no parameter's gradient was created or changed; {fix}")
        return loss

    def inject_at_rest(self, step: int, attempt: int = 0) -> int:
        """Faults at rest (``params`` / ``optimizer-state``) of this attempt; how many."""
        count = 0
        for site, prefix in (("params", "param/"), ("optimizer-state", "optim/")):
            if not self.injector.has_site(site):
                continue
            named = {n: t for n, t in state_tensors(self.model, self.optimizer) if n.startswith(prefix)}
            with torch.no_grad():
                records = self.injector.inject_tensors(site, step, named, attempt=attempt)
            self.record_faults(records)
            count += len(records)
        return count

    def record_faults(self, records: Sequence[Any]) -> None:
        """Record the faults this rank injected (:class:`~paft.faults.FaultRecord` s), and count them."""
        if records:
            self.faults_injected += len(records)
            self.recorder.faults(r.to_json() for r in records)

    def control(self, loss: torch.Tensor, scale: float, check_state: bool, metric_step: bool,
                rest_faults: int) -> PendingControl:
        """Pack this rank's view of the step and launch the step's one control collective
        (``scale``: the loss scaler's, which the hook's captures carry; ``rest_faults``: the
        attempt's faults at rest, counted with the hook's)."""
        cap = self.hook.current
        self.record_faults(cap.ordered_faults())
        agg_norm = self.aggregated_norm()
        # The step's host reads, after the backward pass (none inside the hook).
        local_loss = float(loss.detach())
        local_sq, agg_checksum, sketch = cap.totals()
        if scale != 1.0:  # captured from the scaled gradients (a power of two: exact)
            local_sq /= scale * scale
            sketch = sketch / scale if sketch is not None else None
        flags = 0
        if not math.isfinite(local_loss):
            flags |= FLAG_LOSS_NONFINITE
        if not math.isfinite(local_sq):  # a sum of squares: non-finite iff a bucket was
            flags |= FLAG_LOCAL_NONFINITE
        if not math.isfinite(agg_norm):
            flags |= FLAG_AGG_NONFINITE
        state_fp = None
        if check_state:
            state_fp = state_fingerprint(self.model, self.optimizer, buffers=False)
        vec = ControlVector(
            loss=local_loss,
            local_sq=local_sq,
            agg_norm=agg_norm,
            agg_checksum=agg_checksum,
            state_fingerprint=state_fp,
            flags=flags,
            faults=len(cap.faults) + rest_faults,
            sketch=sketch,
        )
        # Every rank agrees on ``metric_step``, so on the length of the vectors.
        return start_control(vec.pack(self.sketch_dim if metric_step else 0), self.group)

    def aggregated_norm(self) -> float:
        """The aggregated gradient's norm as the guard, the metrics and the scaler's agreed
        skips judge it; torch's, which clipping reuses (see clip), is kept in ``_grad_norm``."""
        grads = self._grads()
        self._grad_norm = total_norm(grads)
        return judged_norm(self._grad_norm, grads)

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self._params if p.grad is not None]

    def clip(self) -> None:
        """Clip exactly as ``clip_grad_norm_`` does, with the norm the control step computed."""
        if self.grad_clip > 0:
            norm = self._grad_norm
            if norm is None:  # unmonitored step: nothing computed it yet
                norm = total_norm(self._grads())
            torch.nn.utils.clip_grads_with_norm_(self._params, self.grad_clip, norm)
        self._grad_norm = None
