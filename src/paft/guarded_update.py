"""The guard's side of a protected step: its attempts until one is applied.

:class:`GuardedUpdate` runs a step's attempts (each one a forward/backward and the
step's control collective, :mod:`paft.attempt`) through the :class:`~paft.guard.Guard`'s
verdicts: proceed, recompute, repair a state split first (:class:`~paft.resync.Resync`),
skip the batch, or stop; before the update, a step the loss scaler overflowed is
skipped. A rejected attempt leaves no trace (RNG draws, buffers, a comm hook's state:
:class:`~paft.snapshot.ForwardSnapshot`), and where the update-to-weight check is
armed the update is applied, judged over every rank and rolled back when rejected
(:class:`~paft.snapshot.StateSnapshot`). Every verdict that says something is
recorded (``events.jsonl``'s ``guard``) and said. The rules in prose: docs/GUARD.md.

Every rank reaches the same verdicts from the same gathered view, so every rank runs
the same collectives. :class:`paft.protect.Protector` builds one where the guard is
on, and calls it for each monitored step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paft.amp import OptimizerStep
from paft.attempt import AttemptRunner, StepOutcome, StepPlan
from paft.collectives import max_over_ranks
from paft.consistency import ControlView, PendingControl
from paft.guard import Guard, GuardVerdict
from paft.hook_state import HookStateSnapshot
from paft.records import RunRecorder
from paft.resync import Resync
from paft.snapshot import ForwardSnapshot, StateSnapshot

__all__ = ["GuardedUpdate", "verdict_line"]


class GuardedUpdate:
    """A protector's guarded steps (one per protector, where the guard is on).

    The parts are the protector's own, shared: ``stepper`` steps its optimizer,
    ``attempts`` clips, ``resync`` finishes overlapped syncs and repairs.
    ``buffer_slots``: the model's buffers by place (:func:`~paft.snapshot.buffer_slots`);
    ``hook_state``: a snapshot of the user's comm hook's state, restored with the
    buffers (``None``: none paft can take).
    """

    def __init__(self, guard: Guard, model: DistributedDataParallel, stepper: OptimizerStep,
                 attempts: AttemptRunner, resync: Resync, recorder: RunRecorder,
                 buffer_slots: Sequence[tuple[nn.Module, str]], hook_state: HookStateSnapshot | None) -> None:
        self.guard = guard
        self.model, self.optimizer, self.group = model, stepper.optimizer, model.process_group
        self._stepper, self._attempts, self.resync, self.recorder = stepper, attempts, resync, recorder
        self._buffer_slots, self._hook_state = buffer_slots, hook_state
        self._snapshot = StateSnapshot()

    def update(self, plan: StepPlan, run_attempt: Callable[[StepPlan, int], PendingControl]) -> StepOutcome:
        """The guard's state machine: attempts (``run_attempt``: one forward/backward of
        the step, its control collective launched) until one is applied or the batch is
        skipped (the guard's rerun caps bound them), or the run stops (the outcome's
        ``stopped``: the protector ends the step and raises)."""
        t = plan.step
        rerun_from = ForwardSnapshot(self._buffer_slots, self._hook_state)
        attempt, synced = 0, False
        while True:
            pending = run_attempt(plan, attempt)
            # Clipping touches only the gradients, which a recompute or a skip discards
            # anyway: do it while the collective is in flight, not after.
            self._attempts.clip()
            view = pending.wait()
            if self._stepper.overflow(view, self.model):  # the loss scaler's, not a fault: the step is skipped
                if attempt:  # the recompute of a detection: its record ends here, undecided
                    self._record_verdict(t, attempt, GuardVerdict("skip", "loss_scale_overflow"))
                synced = self.resync.finish(t) or synced
                self._stepper.apply(skip=True)
                return StepOutcome(view, attempt + 1, applied=False, overflow=True, synced=synced)
            verdict = self._record_verdict(t, attempt, self.guard.check(t, attempt, view))
            if verdict.action != "proceed":
                # The attempt leaves no trace (its RNG draws, its BatchNorm statistics, a
                # comm hook's state paft can take), on every rank before a repair: a skipped
                # NaN batch poisoned the running stats, and PowerSGD's warm start its Q.
                rerun_from.restore()
            if verdict.action == "stop":
                return StepOutcome(view, attempt + 1, applied=False, stopped=verdict)
            # A repair's verdict names the persistent fault where it found one, perhaps the
            # reduction's (docs/GUARD.md#state): the split is repaired all the same.
            if verdict.action in ("repair", "skip") and view.states_split():
                self.resync.repair(t, rerun=verdict.action == "repair")  # at the rerun cap too: the batch is skipped
                rerun_from.keep_buffers()
                synced = True
            if verdict.action in ("recompute", "repair"):
                attempt += 1
                continue
            finished = self.resync.finish(t)  # before a skip too: the next start needs it
            synced = finished or synced
            if verdict.action == "skip":
                self._stepper.discard()
                return StepOutcome(view, attempt + 1, applied=False, synced=synced)
            if not finished:  # else a sync just landed: it keeps its own reference
                self.resync.keep_agreed_state(view)
            outcome = self._checked_update(t, attempt, view, rerun_from, synced)
            if outcome is not None:
                return outcome
            attempt += 1

    def _checked_update(self, t: int, attempt: int, view: ControlView, rerun_from: ForwardSnapshot,
                        synced: bool) -> StepOutcome | None:
        """Apply the attempt's update; where the update-to-weight check is armed, judge it
        and roll a rejected one back (state, loss scale, RNG and buffers as before the
        attempt). The step's outcome, or ``None``: recompute it."""
        armed = self.guard.wants_snapshot(t, view)  # never without an update-ratio limit
        before = self._snapshot.capture(self.model, self.optimizer) if armed else None
        scaler_state = self._stepper.state() if armed else None
        self._stepper.apply(skip=False)  # every rank's aggregated gradient is finite here
        if before is None:
            return StepOutcome(view, attempt + 1, synced=synced)
        ratio = max_over_ranks(before.update_ratio(), self.group)
        verdict = self._record_verdict(t, attempt, self.guard.check_update(t, ratio))
        if verdict.action == "proceed":
            return StepOutcome(view, attempt + 1, ratio=ratio, synced=synced)
        before.restore(self.optimizer)
        self._stepper.restore(scaler_state)
        rerun_from.restore()
        if verdict.action == "skip":
            return StepOutcome(view, attempt + 1, applied=False, synced=synced)
        return None

    def _record_verdict(self, step: int, attempt: int, verdict: GuardVerdict) -> GuardVerdict:
        """Record and announce a guard verdict that says something; return it."""
        if verdict.detector is not None or verdict.action != "proceed":
            # With the run's counts so far: a run that ends without summary.json is still counted right.
            self.recorder.event({"step": step, "event": "guard", "attempt": attempt, **verdict.to_json(),
                                 "totals": dict(self.guard.counters)})
            self.recorder.say(verdict_line(step, attempt, verdict))
        return verdict


def verdict_line(step: int, attempt: int, verdict: GuardVerdict) -> str:
    """The console's line for a verdict that says something (docs/GUARD.md#records)."""
    cause = f", cause {verdict.cause}" if verdict.cause else ""
    what = f"{verdict.detector}{f' on rank(s) {verdict.ranks}' if verdict.ranks else ''}"
    # A proceed on a recompute keeps the detection it answers; a level shift's is no clean
    # recompute but the spike reproduced once more, applied as the new level.
    if attempt and verdict.action == "proceed" and verdict.detector != "level_shift":
        what = f"clean recompute (of {what})"
    return f"[guard] step {step} attempt {attempt}: {what} -> {verdict.action}{cause}"
