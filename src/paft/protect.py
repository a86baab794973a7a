"""The facade users touch: wrap a DDP model and its optimizer, keep training correct.

:func:`protect` registers paft's comm hook on the DDP model and returns a
:class:`Protector`. Its :meth:`Protector.step` takes the same closure as
``optimizer.step(closure)`` (zero grads, forward, backward, return the loss) and
runs one protected step:

1. faults at rest (``params`` / ``optimizer-state`` sites; tests and benchmarks only);
2. the closure: forward, backward; the hook chain injects and captures per bucket;
3. ONE control collective (:mod:`paft.consistency`): every rank gets every rank's
   loss, norms, fingerprints, flags and gradient sketch;
4. the guard's verdict from that shared matrix: proceed, recompute the step, skip
   the batch, or stop (all ranks reach the same verdict, so none deadlocks);
5. an overlapped sync started after the previous step is finished (it found the
   replicas in agreement, so it writes nothing; a fault at rest since, e.g. in step 1,
   stays, and the fingerprints see it), then clip and ``optimizer.step()``;
6. post-step: update-ratio check (guard), then PAFT-Sync / PAFT-Dyn: on a
   fingerprint mismatch (Dyn) or when the period is due, synchronize parameters,
   buffers and optimizer state, blocking, or overlapped with the next step's
   forward/backward where the replicas agree (a split is repaired at once: the next
   gradient must come from repaired replicas).

This module is the step around its parts: what each attempt does on this rank
(steps 1 to 3) is :class:`paft.attempt.AttemptRunner`'s; the guard's attempts,
verdicts and rollbacks (steps 4 and 6) are :class:`paft.guarded_update.GuardedUpdate`'s;
when and how the replicas are synchronized or repaired (steps 4 to 6) is
:class:`paft.resync.Resync`'s; the loss scaler's steps are
:class:`paft.amp.OptimizerStep`'s.

Usage: :func:`protect`, whose docstring has a complete example.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from paft.attempt import AttemptRunner, StepOutcome, StepPlan
from paft.collectives import max_over_ranks
from paft.comm import CommHook, CommHookState, paft_comm_hook
from paft.config import GuardConfig, MonitorConfig, ProtectConfig
from paft.consistency import FLAG_AGG_NONFINITE, ControlView, PendingControl, gather_exact_grads
from paft.divergence import measure_divergence
from paft.faults import FaultInjector, FaultSchedule
from paft.faultspec import FaultSpec
from paft.guard import COUNTERS, Guard, GuardVerdict
from paft.guarded_update import GuardedUpdate
from paft.hook_state import hook_snapshot
from paft.monitor import Monitor
from paft.preflight import ProtectSettings, check_added_groups, ddp_of, mark_protected, preflight, wants_comm_hook
from paft.records import RunRecorder
from paft.resync import Resync
from paft.snapshot import ForwardSnapshot, buffer_slots

__all__ = ["protect", "Protector", "StepReport", "PersistentFaultError"]


class PersistentFaultError(RuntimeError):
    """The guard found a persistently faulty rank and the policy is ``stop``."""

    def __init__(self, step: int, ranks: list[int]) -> None:
        who = f"rank(s) {ranks}" if ranks else "a rank (which one the ranks' values cannot tell)"
        super().__init__(
            f"step {step}: {who} reproduced a harmful update on recomputation "
            "(persistent fault); stopping as on_persistent='stop' (--on-persistent stop) asks"
        )
        self.step = step
        self.ranks = ranks


@dataclass
class StepReport:
    """What happened in one protected step (identical on every rank except ``local_loss``,
    ``grad_norm``, and ``loss`` with the monitor off)."""

    step: int
    loss: float
    """Mean of the ranks' local losses (of the attempt that was applied); with the
    monitor off (no control collective), this rank's local loss. For a batch the guard
    skipped (``applied`` False) it is that batch's last attempt's: NaN on every rank
    where any rank's loss was NaN."""
    local_loss: float
    grad_norm: float
    """Norm of this rank's aggregated gradient, before clipping; NaN with the monitor
    off (nothing computes it)."""
    applied: bool = True
    """False when the guard skipped the batch, or the loss scaler the step (an overflow)."""
    attempts: int = 1
    """Forward/backward passes this step took: 1, plus one per guard recompute."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """The monitor's record of this step (what ``consistency.jsonl`` gets); between
    metric steps only where there is news of the replicas, else empty; empty with the
    monitor off."""
    synced: bool = False
    """A sync changed or checked the replicas in this step: a scheduled or triggered
    PAFT-Sync, an overlapped one that landed, or the guard's repair."""


def protect(
    model: DistributedDataParallel | torch.nn.Module,
    optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
    *,
    monitor: MonitorConfig | None = None,
    protect: ProtectConfig | None = None,
    guard: GuardConfig | None = None,
    inject: Sequence[str | FaultSpec] = (),
    seed: int = 0,
    grad_clip: float = 0.0,
    recorder: RunRecorder | None = None,
    comm_hook: CommHook | None = None,
    comm_state: Any = None,
    scaler: torch.amp.GradScaler | None = None,
) -> Protector:
    """Wrap ``model`` (DDP) and ``optimizer``; train with :meth:`Protector.step`.

    A collective: every rank of the model's process group calls it with the same
    settings (checked by one collective, so a setting that differs, or one refused on
    some ranks, raises on every rank). Every rank then calls :meth:`Protector.step`
    equally often: uneven inputs under DDP's ``join()`` are not supported (Join stands
    in for a finished rank in DDP's own all-reduces only, not in paft's per-step
    collective, so the others would wait for it).

    Args:
        model: the DDP-wrapped model, or ``torch.compile`` of it (the DDP model may
            wrap a compiled module too); paft registers its comm hook on it.
        optimizer: the optimizer over ``model``'s parameters, in the same order on
            every rank; or a list of optimizers over disjoint parameters (Muon for the
            hidden matrices, AdamW for the rest), which paft steps and protects as one
            (:class:`paft.OptimizerChain`, the protector's ``optimizer``).
        monitor: the worker metrics, fingerprints and alerts (default: on).
        protect: PAFT-Sync / PAFT-Dyn / model averaging (default: none).
        guard: harmful-update detection and recomputation (default: off).
        inject: fault specs (:mod:`paft.faultspec`) to inject; tests and benchmarks.
        seed: the seed of the fault schedule, the same on every rank.
        grad_clip: clip the aggregated gradient to this norm (0: no clipping); paft
            clips with the norm it computes anyway.
        recorder: where ``consistency.jsonl``, ``events.jsonl`` and ``faults.jsonl``
            go (:class:`paft.records.RunRecorder`, made with this rank's rank in DDP's
            process group: another is refused); default: the console only.
        comm_hook / comm_state: a comm hook of your own (e.g. a compression hook),
            which paft wraps instead of the default all-reduce.
        scaler: the loss scaler of float16 mixed precision; the closure calls
            ``scaler.scale(loss).backward()``, and paft unscales, steps and updates
            it (see :mod:`paft.amp`).

    Example (a script, ``torchrun --nproc-per-node 2 example.py``)::

        import gc

        import torch
        import torch.distributed as dist
        import torch.nn.functional as F
        from torch.nn.parallel import DistributedDataParallel

        import paft

        dist.init_process_group("gloo")
        torch.manual_seed(0)  # the same initial weights on every rank
        ddp = DistributedDataParallel(torch.nn.Linear(8, 2))
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
        protector = paft.protect(ddp, opt, protect=paft.ProtectConfig(mode="dyn", sync_period=10),
                                 guard=paft.GuardConfig(enabled=True))
        gen = torch.Generator().manual_seed(dist.get_rank())  # each rank its own data
        for _ in range(30):
            x, y = torch.randn(16, 8, generator=gen), torch.randint(0, 2, (16,), generator=gen)

            def closure():  # the closure optimizer.step(closure) takes
                opt.zero_grad()
                loss = F.cross_entropy(ddp(x), y)
                loss.backward()
                return loss

            report = protector.step(closure)  # .loss, .metrics, .applied, .attempts, .synced
        protector.close()  # finish an in-flight overlapped sync
        if dist.get_rank() == 0:
            print(f"{protector.counters['syncs']} syncs, loss {report.loss:.3f}")
        # DDP's reducer holds the process group: left to the exit, after the group is
        # destroyed, it aborted a rank now and then (torch's gloo teardown). Free it first.
        del protector, ddp
        gc.collect()  # modules hold reference cycles
        dist.barrier()  # no rank closes its gloo connections while a peer still reads them
        dist.destroy_process_group()
    """
    settings = ProtectSettings(monitor=monitor or MonitorConfig(), protect=protect or ProtectConfig(),
                               guard=guard or GuardConfig(), inject=inject, seed=seed, grad_clip=grad_clip,
                               recorder=recorder, comm_hook=comm_hook, comm_state=comm_state, scaler=scaler)
    return Protector(
        ddp_of(model),  # torch.compile(ddp): the DDP model the closure's compiled wrapper runs
        optimizer,  # a list is chained by the preflight, on every rank alike
        settings,
    )


class Protector:
    """Per-step protection of a DDP model. Build it with :func:`protect`: the constructor
    is internal (it takes protect()'s arguments as one
    :class:`paft.preflight.ProtectSettings`, after checking them)."""

    def __init__(
        self,
        model: DistributedDataParallel,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
        settings: ProtectSettings,
    ) -> None:
        specs, self._stepper = preflight(model, optimizer, settings)
        self.model = model
        self.optimizer = self._stepper.optimizer  # a list's OptimizerChain
        # Param groups the optimizer had when last checked: one added since (progressive
        # unfreezing) is checked at the next step (check_added_groups).
        self._groups_known = len(self.optimizer.param_groups)
        # Walking the module tree costs ~0.4 ms per call on a small model; the places of
        # the buffers are fixed once DDP wraps the model, so collect them once (the places,
        # not the tensors: a forward may replace a buffer by assignment, and DDP lists the
        # buffers it broadcasts afresh at each forward).
        self._buffer_slots = buffer_slots(model.module)
        # The settings the steps read from here on; the rest of ``settings`` is used up
        # below, building the parts (hook, attempts, guard, monitor, resync) that keep their own.
        self.monitor_cfg = settings.monitor
        self.protect_cfg = settings.protect
        self.group = model.process_group
        self.rank = dist.get_rank(self.group)
        # Rank 0 of the DDP group speaks (a data-parallel group without global rank 0, in a
        # hybrid layout, was silent); the ranks in its messages are the group's too.
        self.recorder = settings.recorder or RunRecorder(None, self.rank)
        self.world_size = dist.get_world_size(self.group)
        self.injector = FaultInjector(FaultSchedule(specs, settings.seed, self.world_size), self.rank)
        self.hook = CommHookState(
            self.injector,
            cosine=settings.monitor.cosine,
            sketch_dim=settings.monitor.sketch_dim,
            process_group=self.group,
            inner_hook=settings.comm_hook,
            inner_state=settings.comm_state,
            unused_params=model.find_unused_parameters or model.static_graph,
        )
        # A dropped protector (or one whose construction fails below) leaves plain DDP
        # behind: DDP keeps the hook for good. The finalizer holds the hook state, not
        # self, so it keeps no protector alive.
        weakref.finalize(self, self.hook.retire)
        hooked = wants_comm_hook(settings.monitor, specs, settings.comm_hook)
        if hooked:
            try:
                model.register_comm_hook(self.hook, paft_comm_hook)
            except RuntimeError as err:  # preflight's check missed it (torch changed DDP's internals)
                raise RuntimeError(f"protect(): {err}") from None
        mark_protected(model, self)
        sketch_dim = settings.monitor.sketch_dim if settings.monitor.cosine == "sketch" else 0
        self._attempts = AttemptRunner(model, self.optimizer, self.hook, self.injector, self.recorder, hooked=hooked,
                                       sketch_dim=sketch_dim, grad_clip=settings.grad_clip)
        self.guard = Guard(settings.guard, self.world_size) if settings.guard.enabled else None
        self.step_idx = 0
        # Not self in the lambdas: a cycle would keep a dropped protector alive.
        group, opt = self.group, self.optimizer
        self.monitor = Monitor(settings.monitor, self.recorder, divergence=lambda: measure_divergence(
            model, opt, per_tensor=True, group=group, buffers=False))
        self.resync = Resync(model, opt, settings.protect, guard=self.guard is not None, recorder=self.recorder,
                             replicas_agree=self.monitor.replicas_agree)
        # A recompute restarts the user's hook from the state the step found it in (PowerSGD's
        # error feedback and warm start kept a faulty attempt's values): only the guard
        # recomputes, and only a state paft knows how to take is copied, every step.
        self._guarded = None if self.guard is None else GuardedUpdate(
            self.guard, model, self._stepper, self._attempts, self.resync, self.recorder, self._buffer_slots,
            hook_snapshot(settings.comm_state) if settings.comm_hook is not None else None)
        # A stop on a state mismatch left the replicas split: the next step checks the
        # state, whatever --fingerprint-every says, and so repairs them (the stop is
        # decided alike on every rank, so every rank sends the same control vector).
        self._check_state_next = False

    # -- one step -----------------------------------------------------------------

    def step(self, closure: Callable[[], torch.Tensor]) -> StepReport:
        """Run one protected training step; ``closure`` zeroes grads, runs forward and backward.

        The closure builds the step's whole gradient from zero (gradient accumulation
        inside it): the guard recomputes a step by calling it again."""
        if not callable(closure):  # a loss tensor passed in would fail deep inside the step
            raise TypeError("step() takes a closure that runs forward and backward and returns the loss "
                            f"(as optimizer.step(closure) does), got {type(closure).__name__}")
        t = self.step_idx
        if len(self.optimizer.param_groups) != self._groups_known:
            check_added_groups(self.model, self.optimizer)
            self._groups_known = len(self.optimizer.param_groups)
        rest_faults = self._attempts.inject_at_rest(t)
        if not self.monitor_cfg.enabled:
            return self._unmonitored_step(t, closure)
        # The worker metrics (every --monitor-interval steps) need the local gradients'
        # norms and directions; the guard, every step, their norms; the aggregated
        # gradient's checksum, which sees replicas split, runs every step.
        check_state = self._check_state_next or self._due(self.monitor_cfg.fingerprint_every, t)
        plan = StepPlan(t, closure, rest_faults, check_state=check_state,
                        metric_step=self._due(self.monitor_cfg.interval, t))
        out = self._update(plan) if self._guarded is None else self._guarded.update(plan, self._attempt)
        if out.stopped is not None:
            raise self._stop(t, out.stopped, out.view)
        self._check_state_next = False  # once a step got this far: one that raised keeps it (a stop sets it anew)
        if self.guard is not None and out.applied:
            self.guard.accept(t, out.view, out.ratio)
        if not out.applied:
            self.optimizer.zero_grad(set_to_none=True)
        grads = None
        if plan.metric_step and self.monitor_cfg.cosine == "exact" and self.hook.current.local_grads:
            grads = gather_exact_grads(self.hook.current.local_flat(), self.group)
        metrics = self.monitor.record(t, out.view, plan.metric_step, grads, alerts=not out.overflow,
                                      applied=out.applied, stale_fingerprints=self.resync.stale_fingerprints,
                                      guarded=self.guard is not None)
        synced = self.resync.maybe_sync(t, out.view, state_is_stale=out.synced, applied=out.applied) or out.synced
        self.step_idx += 1
        return StepReport(
            step=t,
            loss=out.view.global_loss,
            local_loss=float(out.view.losses[self.rank]),
            grad_norm=float(out.view.agg_norms[self.rank]),
            applied=out.applied,
            attempts=out.attempts,
            metrics=metrics,
            synced=synced,
        )

    def _attempt(self, plan: StepPlan, attempt: int) -> PendingControl:
        """One forward/backward of the step, its control collective launched."""
        self.resync.new_attempt()
        rest_faults = plan.rest_faults
        if attempt:  # a persistent fault at rest (stuck memory) strikes the rerun too
            rest_faults = self._attempts.inject_at_rest(plan.step, attempt)
            self._stepper.discard()  # the loss scaler unscales the rerun's gradients afresh
        self.hook.begin(plan.step, attempt, local=plan.metric_step or self.guard is not None,
                        direction=plan.metric_step)
        loss = self._attempts.run_closure(plan.closure)
        # A rerun always fingerprints the state: corrupted replicas would reproduce
        # the bad step, and only the fingerprints tell them from bad data.
        return self._attempts.control(loss, self._stepper.unscale(), plan.check_state or attempt > 0,
                                      plan.metric_step, rest_faults)

    def _update(self, plan: StepPlan) -> StepOutcome:
        """Without the guard: nothing to decide before the update, so the control
        collective overlaps it (a loss scaler's step waits for it: the ranks agree on
        its skips)."""
        pending = self._attempt(plan, 0)
        synced = self.resync.finish(plan.step)
        self._attempts.clip()
        if self._stepper.scaler is None:
            self._stepper.apply(skip=False)
            return StepOutcome(pending.wait(), synced=synced)
        view = pending.wait()
        applied = self._stepper.apply(skip=bool(view.ranks_with(FLAG_AGG_NONFINITE)))
        return StepOutcome(view, applied=applied, overflow=not applied and self._stepper.overflow(view, self.model),
                           synced=synced)

    def _unmonitored_step(self, t: int, closure: Callable[[], torch.Tensor]) -> StepReport:
        """Plain DDP (plus injection and the periodic sync/averager): no control collective."""
        self.hook.begin(t, 0, local=False, checksum=False)
        loss = float(self._attempts.run_closure(closure).detach())
        self._stepper.unscale()
        self._attempts.record_faults(self.hook.current.ordered_faults())
        synced = self.resync.finish(t)
        # One flag all-reduced: the ranks agree on the scaler's skips, as the monitor's view makes them.
        overflow = self._stepper.scaler is not None and max_over_ranks(
            0.0 if math.isfinite(self._attempts.aggregated_norm()) else 1.0, self.group) > 0
        self._attempts.clip()
        applied = self._stepper.apply(skip=overflow)
        if not applied:  # as a monitored skip: no non-finite gradient is left behind
            self.optimizer.zero_grad(set_to_none=True)
        synced = self.resync.maybe_sync(t, None) or synced
        self.step_idx += 1
        return StepReport(step=t, loss=loss, local_loss=loss, grad_norm=math.nan, applied=applied, synced=synced)

    def prime(self, closure: Callable[[], torch.Tensor]) -> None:
        """Forward/backward passes that change nothing, so DDP builds its final buckets now.

        DDP re-orders its gradient buckets after the first iteration. With more than
        two ranks the bucket layout decides the order in which the all-reduce sums
        each element, so a run resumed from a checkpoint (whose first iteration is
        some step N) would differ in the last bits from the uninterrupted run, and so
        would a guard's recompute of a fresh run's first step (its second backward
        pass, on the rebuilt layout) from the fault-free step; and bucket-site faults
        pick their bucket among the buckets of the final layout. ``paft train`` calls
        it before the first step of every run, fresh or resumed.
        Two passes: the first records the order, the second runs on the rebuilt layout
        and tells the hook how many buckets it has. RNG and buffers are restored, the
        gradients set to None; nothing is injected or recorded (after a
        :meth:`load_state_dict`, the recorder's records of the steps the resumed run re-does
        are dropped: :class:`~paft.records.RunRecorder` ``append=True``; a ``period`` event
        says a sync period the resume's options changed), and a ``comm_hook=`` is not
        called (a plain mean all-reduce runs instead; a hook registered on the DDP model
        directly, where paft registers none, runs as DDP calls it). Without it, the first two steps
        still inject reproducibly, but only into the buckets the hook knew of then, and a
        bucket-site ``stale`` fault finds no previous result to replay at steps 1 and 2.
        """
        # Before this rank's first collective, so before any rank records again.
        self.recorder.drop_resumed_steps()
        self.resync.resumed(self.step_idx)
        before = ForwardSnapshot(self._buffer_slots)
        for _ in range(2):
            # The mean all-reduce, not a user's hook: a stateful one (PowerSGD's step counter,
            # error feedback) would advance on batches whose gradients are thrown away.
            self.hook.begin(self.step_idx, local=False, checksum=False, inject=False, priming=True)
            closure()
            before.restore()
        self.optimizer.zero_grad(set_to_none=True)

    def close(self) -> None:
        """Finish an in-flight overlapped sync, so that the replicas are identical now (at
        the end of training, or before a checkpoint: :meth:`state_dict` needs it).

        A collective when a sync is in flight: call it on every rank, between the same
        two steps (never on rank 0 alone). Training may go on after it."""
        self.resync.finish(self.step_idx, in_step=False)

    @property
    def counters(self) -> dict[str, int]:
        """Run totals: faults injected here, syncs, bytes, alerts, and the guard's counts."""
        guard = self.guard.counters if self.guard is not None else {}
        out = self._saved_counters()
        for key in COUNTERS:
            out[key] = guard.get(key, 0)
        return out

    def _saved_counters(self) -> dict[str, int]:
        """The counts a checkpoint keeps under ``counters`` (the guard keeps its own):
        faults injected here, the syncs' and the alerts'."""
        return {"faults_injected": self._attempts.faults_injected, **self.resync.counters,
                "alerts": self.monitor.alerts}

    # -- pieces of the step ---------------------------------------------------------

    @staticmethod
    def _due(every: int, step: int) -> bool:
        return every > 0 and step % every == 0

    def _stop(self, step: int, verdict: GuardVerdict, view: ControlView) -> PersistentFaultError:
        """End a step the guard stops (``on_persistent="stop"``; the caller restored its
        RNG draws and buffers): no update is applied, the gradients are set to None, an
        overlapped sync in flight lands, and the step index moves on, so that a caller
        that catches the error may :meth:`close` and checkpoint, or step on with the next
        batch as step ``step + 1``. A stop on a state mismatch leaves the replicas split
        (the faulty rank's state reproduced the fault), as does one on a reduction that
        failed again where the state split too; the next step checks the state, due or
        not, and repairs them. (Only the pre-step checks stop:
        :meth:`Guard.check_update` never does.)"""
        self._stepper.discard()
        self.optimizer.zero_grad(set_to_none=True)
        self.resync.finish(step)
        self._check_state_next = view.states_split()
        self.step_idx = step + 1
        self.resync.set_next_step(self.step_idx)
        return PersistentFaultError(step, verdict.ranks)

    # -- checkpoints --------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The protector's part of a checkpoint. Call :meth:`close` first on every rank
        when an overlapped sync may be in flight: its result is not part of the state."""
        if self.resync.in_flight:
            raise RuntimeError(
                "Protector.state_dict(): an overlapped sync is in flight; call close() on every rank first"
            )
        resync, monitor = self.resync.state_dict(), self.monitor.state_dict()
        # The values a stale fault at the next step replays: only where a stale spec can hit
        # this rank, so that the checkpoints of other runs do not grow.
        kept = self.injector.state_dict()
        return {
            "step": self.step_idx,
            "mode": self.protect_cfg.mode,
            # The run's counts in one place, as checkpoints have always kept them.
            "counters": self._saved_counters(),
            "scheduler": resync["scheduler"],
            "sync": resync["sync"],
            "guard": self.guard.state_dict() if self.guard is not None else None,
            "repairer": resync["repairer"],
            "averager": resync["averager"],
            "alerting": monitor["alerting"],
            "check_state": self._check_state_next,  # replicas left split by a stop, saved rank by rank
            **({"stale_values": kept} if kept else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output saved by a protector with the same settings.
        Checked before anything changes, and all or nothing: on an error the protector
        keeps its state."""
        if self.resync.in_flight:
            raise RuntimeError("Protector.load_state_dict(): an overlapped sync is in flight; call close() first")
        if not isinstance(state, dict):
            raise TypeError(f"Protector.load_state_dict(): expected a dict, got {type(state).__name__}")
        missing = [k for k in ("step", "counters") if k not in state]
        if missing:
            raise ValueError(f"Protector.load_state_dict(): not a protector state (missing {missing})")
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"Protector.load_state_dict(): step must be an int >= 0, got {step!r}")
        mode = state.get("mode", self.protect_cfg.mode)  # older states lack it
        if mode != self.protect_cfg.mode:  # none and averager have no parts to tell them apart
            raise ValueError(f"Protector.load_state_dict(): the state was saved with protect mode {mode!r}, this "
                             f"protector has {self.protect_cfg.mode!r}")
        parts = (("scheduler", self.resync.scheduler), ("sync", self.resync.sync), ("guard", self.guard))
        for part, mine in parts:
            if (state.get(part) is None) != (mine is None):
                has = "has" if state.get(part) is not None else "has no"
                raise ValueError(f"Protector.load_state_dict(): the state {has} {part} part and this protector "
                                 f"{'has none' if mine is None else 'has one'}: it was saved with other settings "
                                 "(protect mode or guard)")
        before = self.state_dict()
        try:
            self._load(state)
        except Exception:
            self._load(before)
            raise
        self.recorder.resumed_at(self.step_idx)  # prime() drops the records of the steps re-done

    def _load(self, state: dict[str, Any]) -> None:
        self.resync.load_state_dict(state)
        if self.guard is not None:
            self.guard.load_state_dict(state["guard"])
        self.step_idx = state["step"]
        self.resync.set_next_step(self.step_idx)
        self.monitor.load_state_dict(state)
        self._attempts.faults_injected = state["counters"].get("faults_injected", self._attempts.faults_injected)
        self._check_state_next = bool(state.get("check_state", False))  # older states lack it
        # Absent where no stale spec could hit this rank when it was saved, and in older states.
        self.injector.load_state_dict(state.get("stale_values", []))
