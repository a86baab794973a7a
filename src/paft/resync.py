"""When and how a protector brings its replicas back together: PAFT-Sync, PAFT-Dyn,
PyTorch's model averager, and the guard's repairs.

:class:`Resync` holds everything a protector's replicas are synchronized with (the
:class:`~paft.sync.ReplicaSync`, its :class:`~paft.dyn.SyncScheduler`, or a
``PeriodicModelAverager``; the guard's robust repairer) and decides, from the step's
shared :class:`~paft.consistency.ControlView`, when a sync runs, whether it overlaps
the next step or blocks, and what it records. :mod:`paft.protect` calls it at fixed
points of a step (an overlapped sync lands before the update; the guard repairs a
state split; after the update a sync may be due), and so stays the step protocol.

Every decision is taken from values every rank holds alike (the view, the step,
the scheduler's state), so every rank runs the same collectives. The protector is
reached through narrow inputs only: the recorder and the monitor's ``replicas_agree``
(a sync's result is a new start for its split alerts).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.nn.parallel import DistributedDataParallel

from paft.config import ProtectConfig
from paft.consistency import ControlView
from paft.dyn import DynScheduler, FixedScheduler, SyncScheduler
from paft.records import RunRecorder
from paft.replicas import group_replicas
from paft.state import fingerprints_over_ranks
from paft.sync import ReplicaSync, SyncReport

__all__ = ["Resync", "averages_at"]


def averages_at(step: int, period: int) -> bool:
    """Whether PyTorch's model averager (``--protect averager``, no warm-up) averages
    the replicas at ``step``: every ``period``-th step from step 0, as
    ``PeriodicModelAverager`` counts its calls. One rule for :class:`Resync`, which
    counts the averages, and :mod:`paft.report_text`, which counts them again from the
    recorded steps when a run has no summary (the averager records no event)."""
    return step % period == 0


class Resync:
    """One protector's syncs and repairs (one per rank, all in step).

    ``guard``: the guard is on, so a robust repairer is kept for the state splits it
    finds. ``replicas_agree``: told after every sync and repair.
    """

    def __init__(
        self,
        model: DistributedDataParallel,
        optimizer: torch.optim.Optimizer,
        config: ProtectConfig,
        *,
        guard: bool,
        recorder: RunRecorder,
        replicas_agree: Callable[[], None],
    ) -> None:
        self.config = config
        self.recorder = recorder
        self._replicas_agree = replicas_agree
        self._model, self._optimizer = model, optimizer
        self._params = list(model.parameters())  # what the averager averages and counts
        group = self._group = model.process_group
        self.sync: ReplicaSync | None = None
        self.scheduler: SyncScheduler | None = None
        self.averager: PeriodicModelAverager | None = None
        if config.mode == "averager":
            self.averager = PeriodicModelAverager(period=config.sync_period, warmup_steps=0, process_group=group)
        elif config.mode != "none":
            # broadcast_src is only checked (and only means anything) in broadcast mode.
            src = config.broadcast_src if config.sync_mode == "broadcast" else 0
            self.sync = ReplicaSync(model, optimizer, mode=config.sync_mode, src=src, group=group)
            if config.mode == "dyn":
                self.scheduler = DynScheduler(config.dyn_config())
            else:
                self.scheduler = FixedScheduler(config.sync_period)
        # The guard's repairs: PAFT-Sync's own when it is robust, else a robust one of the
        # guard's, built now, while the replicas agree: with two ranks a repair takes the
        # median with the last agreed state, which both ranks must hold alike.
        self.repairer: ReplicaSync | None = None
        if guard:
            robust = self.sync is not None and self.sync.mode == "robust"
            self.repairer = self.sync if robust else ReplicaSync(model, optimizer, mode="robust", group=group)
        self.syncs = 0
        """Syncs and repairs in the run (an averager's: the steps it averaged at)."""
        self.sync_bytes = 0
        """What they sent, in bytes."""
        # A repair landed in this step after its state fingerprints and changed the state:
        # the alerts do not judge those fingerprints (they would re-alert a repaired split).
        # Set by repair(); cleared by new_attempt(), which fingerprints afresh. A sync left
        # in flight never sets it: start(repair_now=True) repairs a split at once and syncs
        # the buffers blocking, so one still in flight found the parameters and optimizer
        # state agreeing, and landing it moves nothing: a split the fingerprints show is real.
        self._stale_fingerprints = False
        # What a resume changed of the schedule (the period it continues with, the one its
        # options would have begun with), recorded at its first step by resumed().
        self._first_period = (self.scheduler.first_period if self.scheduler is not None
                              else config.sync_period if self.averager is not None else None)
        self._resumed_schedule: dict[str, int] | None = None

    @property
    def in_flight(self) -> bool:
        """An overlapped sync is in flight (it lands in :meth:`finish`)."""
        return self.sync is not None and self.sync.in_flight

    @property
    def stale_fingerprints(self) -> bool:
        """A repair changed the state during this attempt, after its state fingerprints."""
        return self._stale_fingerprints

    def new_attempt(self) -> None:
        """An attempt of a step begins: its control collective fingerprints the state
        after whatever landed before it."""
        self._stale_fingerprints = False

    @property
    def counters(self) -> dict[str, int]:
        """The run's ``syncs`` and ``sync_bytes``."""
        return {"syncs": self.syncs, "sync_bytes": self.sync_bytes}

    # -- during a step ------------------------------------------------------------

    def maybe_sync(self, step: int, view: ControlView | None, state_is_stale: bool = False,
                   applied: bool = True) -> bool:
        """After the update of ``step``: start (overlap) or run (blocking) a sync if due.

        ``state_is_stale``: a sync finished during this step, after ``view``'s state
        fingerprints were taken, so a split they show may be repaired already: the
        state is fingerprinted again before a sync is triggered on old news.
        ``applied``: whether the step's update was (a skipped one split nothing, whatever
        its aggregated gradients were).
        """
        if self.averager is not None:
            due = averages_at(step, self.averager.period)
            self.averager.average_parameters(self._params)
            if due:
                self.syncs += 1
                self.sync_bytes += sum(p.numel() * p.element_size() for p in self._params)
            return due
        if self.sync is None or self.scheduler is None:
            return False
        triggered = (
            view is not None and isinstance(self.scheduler, DynScheduler)
            and self._replicas_split(view, state_is_stale, applied)
        )
        if triggered:
            self._dyn_trigger(step)
        if not self.scheduler.due(step):
            return False
        # A repair blocks: the next gradient must come from repaired replicas (a faulty
        # replica's would reach every rank through DDP's all-reduce), so that a majority
        # copy puts the faulty rank back on the exact fault-free trajectory. An overlapped
        # sync that finds the replicas split is such a repair.
        report = self.sync.start(repair_now=True) if self.config.overlap and not triggered else self.sync.sync()
        if report is None:
            return False  # in flight behind the next step; finished before its update
        self._on_sync(step, report, seen_from=step + 1)
        return True

    def _replicas_split(self, view: ControlView, state_is_stale: bool, applied: bool) -> bool:
        state_split = view.states_split()
        if state_split and state_is_stale:
            # The finished sync may have repaired the split, or not: a no-op or buffers-only
            # sync, or a fault after its snapshot, which its correction w + (synced -
            # snapshot) keeps. Look again now (every rank alike: the view is shared), so a
            # split still there is repaired in this step, not the next.
            fps = fingerprints_over_ranks(self._model, self._optimizer, buffers=False, group=self._group)
            state_split = len(group_replicas(fps)) > 1
        return state_split or (applied and len(group_replicas(view.agg_checksum_keys())) > 1)

    def repair(self, step: int, rerun: bool) -> None:
        """The guard found replicas with different state: a blocking robust sync (the
        majority's bits; see :class:`~paft.sync.ReplicaSync`) before the recompute, or
        (``rerun`` false, at the rerun cap) before the batch is skipped."""
        assert self.repairer is not None
        self.finish(step)
        # A recompute fingerprints the repaired state again, in this step; a skip leaves
        # the step's fingerprints from before the repair.
        seen_from = step if rerun else step + 1
        self._stale_fingerprints = True  # until the recompute's own
        dyn = isinstance(self.scheduler, DynScheduler)
        if dyn:  # the split the guard found is Dyn's event too: H shrinks as at its own trigger
            self._dyn_trigger(step)
        report = self.repairer.sync()
        if self.repairer is self.sync or dyn:  # the scheduler hears of it (Dyn with any sync mode)
            self._on_sync(step, report, seen_from, event="sync" if self.repairer is self.sync else "repair")
        else:  # without PAFT-Sync, or with a fixed period and a mode that averages
            self._record_sync(step, report, "repair", seen_from=seen_from)

    def _dyn_trigger(self, step: int) -> None:
        """Replicas split at ``step``: PAFT-Dyn's event trigger (a sync due at once, H shrunk)."""
        assert self.scheduler is not None
        self.scheduler.trigger(step)
        self.recorder.event({"step": step, "event": "dyn_trigger", "period": self.scheduler.period})

    def keep_agreed_state(self, view: ControlView) -> None:
        """This step's state fingerprints agree: with two ranks, that state is what a
        later repair takes the median with (see :meth:`ReplicaSync.set_reference`)."""
        fps = view.state_fingerprints()
        if self.repairer is not None and fps is not None and len(set(fps)) == 1:
            self.repairer.set_reference(fps[0])

    def finish(self, step: int, in_step: bool = True) -> bool:
        """Land an in-flight overlapped sync (recorded at the step it started after):
        during ``step``, after its state fingerprints, or (``in_step`` false, from
        :meth:`paft.protect.Protector.close`) between steps, before them. Whether one landed."""
        if self.sync is None or not self.sync.in_flight:
            return False
        report = self.sync.finish()
        self._on_sync(step - 1, report, seen_from=step + 1 if in_step else step)
        return True

    def _on_sync(self, step: int, report: SyncReport, seen_from: int, event: str = "sync") -> None:
        assert self.scheduler is not None
        self._record_sync(step, report, event, seen_from, period=self.scheduler.observe(step, report.divergence))

    def _record_sync(self, step: int, report: SyncReport, event: str, seen_from: int, **extra: Any) -> None:
        """Count and record a sync or repair. ``seen_from``: the first step whose state
        fingerprints see its result (what ``paft report`` plots it from)."""
        self._replicas_agree()
        extra["seen_from"] = seen_from
        self.syncs += 1
        self.sync_bytes += report.bytes_sent
        self.recorder.event({"step": step, "event": event, **extra, **report.to_json()})

    # -- checkpoints --------------------------------------------------------------

    def resumed(self, step: int) -> None:
        """The resumed run's first step is ``step`` (its records after the checkpoint
        dropped): a ``period`` event where :meth:`load_state_dict` changed the schedule,
        so that the records say the periods the run used."""
        if self._resumed_schedule is not None:
            self.recorder.event({"step": step, "event": "period", **self._resumed_schedule})
            self._resumed_schedule = None

    def set_next_step(self, step: int) -> None:
        """The protector's next step is ``step`` (after a stopped step, or a resume): the
        averager's own call counter decides when it averages, so it moves along."""
        if self.averager is not None:
            self.averager.step = step

    @property
    def _own_repairer(self) -> ReplicaSync | None:
        """The guard's repairer when it is not PAFT-Sync's (whose state is saved as ``sync``)."""
        return self.repairer if self.repairer is not self.sync else None

    def state_dict(self) -> dict[str, Any]:
        """Resync's parts of the protector's checkpoint, in its shape: ``scheduler``,
        ``sync``, ``repairer`` and ``averager`` (its period and the one the run began with)
        (None where this protector has none) and the :attr:`counters`. Nothing may be in
        flight (the caller checks :attr:`in_flight`)."""
        own = self._own_repairer
        return {
            "averager": None if self.averager is None else {"period": self.averager.period,
                                                             "first_period": self._first_period},
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "sync": self.sync.state_dict() if self.sync is not None else None,
            "repairer": own.state_dict() if own is not None else None,
            "counters": self.counters,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` wrote (``state``: its own, or the protector's
        checkpoint holding it); the caller checked that its parts match this one's."""
        self._resumed_schedule = None
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
            # The saved period clamped into new --h-min / --h-max, or PAFT-Sync's new
            # --sync-period; or options that would have begun the run with another period
            # (config.json, rewritten by the resume, no longer says the one it began with).
            first = self.scheduler.first_period
            if self.scheduler.period != int(state["scheduler"]["period"]) or first != self._first_period:
                self._resumed_schedule = {"period": self.scheduler.period}
                if "first_period" in state["scheduler"]:  # an older state's would be this resume's options'
                    self._resumed_schedule["first_period"] = first
        saved = state.get("averager")  # older checkpoints lack it
        if self.averager is not None and saved is not None:
            # A new --sync-period averages at its own steps from the resume on: paft report
            # counts the averages of a run without a summary from the periods recorded.
            self._first_period = int(saved["first_period"])
            if self.averager.period != int(saved["period"]) or self.averager.period != self._first_period:
                self._resumed_schedule = {"period": self.averager.period, "first_period": self._first_period}
        if self.sync is not None:
            self.sync.load_state_dict(state["sync"])
        own = self._own_repairer
        if own is not None and state.get("repairer") is not None:  # older checkpoints lack it
            own.load_state_dict(state["repairer"])
        counts = state["counters"]
        self.syncs = counts.get("syncs", self.syncs)
        self.sync_bytes = counts.get("sync_bytes", self.sync_bytes)
