"""When to re-synchronize replicas: PAFT-Sync's fixed period and PAFT-Dyn's adaptive one.

Pure logic, no process groups: every rank feeds its scheduler the same numbers (taken
from the shared per-step control vector), so every rank takes the same decision.
The caller's loop (:class:`paft.resync.Resync`'s) is, after each step's update::

    if fingerprints_disagree:           # a per-step event, e.g. paft.fingerprint
        sched.trigger(step)             # -> due(step) is True at once
    if sched.due(step):
        divergence = measure()          # relative L2 distance to the replica the sync
        synchronize()                   # takes, measured BEFORE the sync
        sched.observe(step, divergence)

The event first: checked after the due sync instead, a split at a step where a sync
was due anyway would be repaired by that sync and still call for a second one, due
at once but run only after the next step.

PAFT-Dyn rule (:class:`DynScheduler`, parameters in :class:`DynConfig`)
-----------------------------------------------------------------------
The period ``H`` starts at ``h_init``; the first sync is due at ``start + H``. At
each completed sync at step ``s`` with divergence ``d`` measured before it:

* ``d`` not finite (NaN / inf): ``H = h_min`` at once.
* ``d > target``: shrink, in proportion to the excess but at least by ``shrink``:
  ``H = max(h_min, floor(H * min(shrink, target / d)))``. The ``target / d`` term
  assumes divergence grows about linearly with the period, so one sync at ``10 x``
  the target cuts ``H`` tenfold instead of needing several halvings.
* ``d < low_water * target`` for ``patience`` consecutive syncs: grow,
  ``H = min(h_max, ceil(H * grow))``, and the calm count starts again from zero.
* otherwise (``low_water * target <= d <= target``): keep ``H``; the calm count
  resets.

Then the next sync is due at ``s + H``. A :meth:`~SyncScheduler.trigger` at step
``s`` (an event such as a per-step fingerprint mismatch) makes the sync due at once
(``due(s)`` is True) and shrinks ``H`` by ``shrink`` immediately; the sync it calls
for counts as a high-divergence sync: it never grows ``H``, resets the calm count,
and shrinks further only if its measured ``d`` asks for more than ``shrink``
(``floor(H_before_trigger * min(shrink, target / d))``). Further triggers before that
sync completes change nothing more. Products are rounded to 9 decimals before
``floor`` / ``ceil`` so that, e.g., ``100 * 0.29`` gives 29, not 28.

:class:`FixedScheduler` is PAFT-Sync: the same protocol with a constant period.
"""

from __future__ import annotations

import abc
import math
import operator
from dataclasses import dataclass
from typing import Any

__all__ = ["SyncScheduler", "FixedScheduler", "DynScheduler", "DynConfig", "check_bounds", "MAX_PERIOD"]


def _step(step: int) -> int:
    if isinstance(step, bool):
        raise TypeError("step must be an int, got bool")
    return operator.index(step)


MAX_PERIOD = 2**53
"""The longest period (in steps) a scheduler takes: PAFT-Dyn scales periods by floats,
which hold every whole number up to here (a TOML integer of 309 digits overflowed them
at the first trigger, in the middle of a run)."""


def _check_period(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PERIOD:
        raise ValueError(f"{name}: must be an int in [1, 2**53], got {value!r}")
    return value


def check_bounds(h_min: Any, h_max: Any, target: Any, names: tuple[str, str, str]) -> None:
    """Check PAFT-Dyn's period bounds and divergence target: the one home of these
    checks, for :class:`DynConfig` and :class:`paft.config.ProtectConfig` alike. The
    ``ValueError`` names each value as ``names`` does, the caller's fields
    (``DynConfig.h_min``; ``ProtectConfig.h_min (--h-min)``, with its option)."""
    n_min, n_max, n_target = names
    _check_period(n_min, h_min)
    _check_period(n_max, h_max)
    if h_max < h_min:
        raise ValueError(f"{n_max}: must be >= {n_min} = {h_min}, got {h_max}")
    if isinstance(target, bool) or not isinstance(target, (int, float)) or not 0 < target < math.inf:
        raise ValueError(f"{n_target}: must be a finite number > 0, got {target!r}")


class SyncScheduler(abc.ABC):
    """Decides at which steps replicas re-synchronize (the policy; the sync itself
    lives elsewhere). Subclasses say how the period reacts to each measured
    divergence (:meth:`_adapt`) and to an event (:meth:`_on_trigger`).

    ``step`` is whatever step counter the caller uses (e.g. completed optimizer
    steps); the first sync is due at ``start + period``.

    Example::

        >>> sched = FixedScheduler(period=4)
        >>> synced = []
        >>> for step in range(1, 13):
        ...     if sched.due(step):
        ...         _ = sched.observe(step, divergence=0.0)  # measure, sync, report
        ...         synced.append(step)
        >>> synced
        [4, 8, 12]
        >>> sched.trigger(13); sched.due(13)
        True
    """

    def __init__(self, period: int, *, start: int = 0) -> None:
        self._period = period
        self._next = _step(start) + period
        self._pending_trigger = False
        self._period_before_trigger = period
        self._first_period = period

    @property
    def period(self) -> int:
        """The current period H, in steps."""
        return self._period

    @property
    def first_period(self) -> int:
        """The period the run began with: this scheduler's first, or after
        :meth:`load_state_dict` the saved run's (a resume may change the options that set
        it; a state saved before it was kept leaves this scheduler's own)."""
        return self._first_period

    @property
    def next_sync_step(self) -> int:
        """The step at which the next sync is due."""
        return self._next

    def due(self, step: int) -> bool:
        """Whether a sync is due at ``step`` (also true if the due step was missed)."""
        return _step(step) >= self._next

    def observe(self, step: int, divergence: float) -> int:
        """Report a completed sync at ``step`` and the divergence measured just before
        it; returns the new period. The next sync is due at ``step + period``."""
        step = _step(step)
        divergence = float(divergence)
        if math.isfinite(divergence) and divergence < 0:  # a bug, not a measurement
            raise ValueError(f"divergence must be >= 0 (or non-finite), got {divergence}")
        self._period = self._adapt(divergence)
        self._pending_trigger = False
        self._next = step + self._period
        return self._period

    def trigger(self, step: int) -> None:
        """An event at ``step`` (e.g. a fingerprint mismatch): a sync is due at once."""
        step = _step(step)
        if not self._pending_trigger:
            self._pending_trigger = True
            self._period_before_trigger = self._period
            self._period = self._on_trigger()
        self._next = min(self._next, step)

    @abc.abstractmethod
    def _adapt(self, divergence: float) -> int:
        """The period after a sync that measured ``divergence``."""

    def _on_trigger(self) -> int:
        """The period right after an event; default: unchanged."""
        return self._period

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue identically after :meth:`load_state_dict`."""
        return {
            "kind": type(self).__name__,
            "period": self._period,
            "next_sync_step": self._next,
            "pending_trigger": self._pending_trigger,
            "period_before_trigger": self._period_before_trigger,
            "first_period": self._first_period,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != type(self).__name__:
            raise ValueError(
                f"state_dict is for {state.get('kind')!r}, not {type(self).__name__!r}"
            )
        self._period = int(state["period"])
        self._next = int(state["next_sync_step"])
        self._pending_trigger = bool(state["pending_trigger"])
        self._period_before_trigger = int(state["period_before_trigger"])
        self._first_period = int(state.get("first_period", self._first_period))  # older states lack it

    def _restore_period(self, period: int) -> None:
        """Replace a restored period by ``period`` (the loading scheduler's own, or the
        saved one clamped into its bounds). A shorter one brings the next sync forward by
        as much, unless a trigger is pending: that sync is due at once already, and
        moving it before the event's step would report it due at a step long gone
        (negative, for an event early in a run)."""
        if not self._pending_trigger:
            self._next -= max(0, self._period - period)
        self._period = period


class FixedScheduler(SyncScheduler):
    """PAFT-Sync: a sync every ``period`` steps. A :meth:`trigger` makes one due at
    once; the period never changes."""

    def __init__(self, period: int, *, start: int = 0) -> None:
        super().__init__(_check_period("period", period), start=start)

    def _adapt(self, divergence: float) -> int:
        return self._period

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the schedule. The period stays this scheduler's own, so a resumed
        run may change it (as PAFT-Dyn's bounds); a shorter one brings the next sync
        forward by as much."""
        period = self._period
        super().load_state_dict(state)
        self._restore_period(period)
        self._period_before_trigger = period


@dataclass
class DynConfig:
    """Parameters of the PAFT-Dyn period rule (see the :mod:`paft.dyn` docstring)."""

    h_init: int = 50
    """Period (steps between syncs) at the start; ``h_min <= h_init <= h_max``."""

    h_min: int = 5
    """Smallest period: never sync more often than every ``h_min`` steps."""

    h_max: int = 400
    """Largest period: never sync less often than every ``h_max`` steps."""

    target: float = 1e-4
    """Divergence target: the replicas' largest relative L2 distance to the replica the
    sync takes (their mean, or the copied one: :attr:`paft.sync.SyncReport.divergence`),
    measured just before a sync, that the period is tuned to stay under."""

    shrink: float = 0.5
    """Factor (0 < shrink < 1) applied to the period at least, when divergence
    exceeds ``target`` or an event triggers a sync."""

    grow: float = 2.0
    """Factor (> 1) applied to the period after ``patience`` calm syncs."""

    low_water: float = 0.25
    """A sync is calm when divergence < ``low_water * target`` (0 <= low_water <= 1;
    0 disables growth)."""

    patience: int = 2
    """Consecutive calm syncs needed before the period grows (>= 1)."""

    def __post_init__(self) -> None:
        def named(name: str) -> str:  # as paft.config's errors name a field
            return f"{type(self).__name__}.{name}"

        check_bounds(self.h_min, self.h_max, self.target, names=(named("h_min"), named("h_max"), named("target")))
        for name in ("h_init", "patience"):
            _check_period(named(name), getattr(self, name))
        if not self.h_min <= self.h_init <= self.h_max:
            raise ValueError(f"{named('h_init')}: must lie in [h_min, h_max] = [{self.h_min}, {self.h_max}], "
                             f"got {self.h_init}")
        checks = {
            "shrink": (lambda x: 0 < x < 1, "in (0, 1)"),
            "grow": (lambda x: 1 < x < math.inf, "a finite number > 1"),
            "low_water": (lambda x: 0 <= x <= 1, "in [0, 1]"),
        }
        for name, (ok, what) in checks.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ValueError(f"{named(name)}: must be {what}, got {value!r}")


def _floor(x: float) -> int:
    return math.floor(round(x, 9))


def _ceil(x: float) -> int:
    return math.ceil(round(x, 9))


class DynScheduler(SyncScheduler):
    """PAFT-Dyn: the period adapts to the divergence measured at each sync; the rule
    is in the :mod:`paft.dyn` docstring.

    Example::

        >>> sched = DynScheduler(DynConfig(h_init=40, target=1e-4))
        >>> sched.next_sync_step
        40
        >>> sched.observe(40, divergence=3e-4)  # 3x the target: cut to a third
        13
        >>> sched.observe(53, 1e-6), sched.observe(66, 1e-6)  # two calm syncs: grow
        (13, 26)
        >>> sched.observe(92, float("nan"))
        5
    """

    def __init__(self, config: DynConfig | None = None, *, start: int = 0) -> None:
        self.config = config if config is not None else DynConfig()
        super().__init__(self.config.h_init, start=start)
        self._calm = 0

    def _shrunk(self, period: int, divergence: float) -> int:
        cfg = self.config
        factor = cfg.shrink
        if divergence > cfg.target:
            factor = min(factor, cfg.target / divergence)
        return max(cfg.h_min, _floor(period * factor))

    def _adapt(self, divergence: float) -> int:
        cfg = self.config
        if not math.isfinite(divergence):
            self._calm = 0
            return cfg.h_min
        if self._pending_trigger:  # the sync an event called for: a high one
            self._calm = 0
            return self._shrunk(self._period_before_trigger, divergence)
        if divergence > cfg.target:
            self._calm = 0
            return self._shrunk(self._period, divergence)
        if divergence < cfg.low_water * cfg.target:
            self._calm += 1
            if self._calm >= cfg.patience:
                self._calm = 0
                return _ceil(min(self._period * cfg.grow, cfg.h_max))  # no float overflow: grow may be huge
            return self._period
        self._calm = 0
        return self._period

    def _on_trigger(self) -> int:
        self._calm = 0
        return self._shrunk(self._period, 0.0)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["calm"] = self._calm
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the dynamic state. The scheduler keeps its own config (so a resumed
        run may change it); the period is clamped into its ``[h_min, h_max]``."""
        super().load_state_dict(state)
        self._calm = int(state["calm"])
        cfg = self.config
        self._restore_period(min(cfg.h_max, max(cfg.h_min, self._period)))
        self._period_before_trigger = min(cfg.h_max, max(cfg.h_min, self._period_before_trigger))

