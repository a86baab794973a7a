"""What the per-step monitor writes: the step's ``consistency.jsonl`` record and the
threshold alerts in ``events.jsonl`` and on the console.

Pure bookkeeping over the step's shared :class:`~paft.consistency.ControlView`: every
rank holds the same view and the same alert state, so every rank decides alike
(only rank 0's recorder writes). The one collective an alert may need, the
replicas' distance when their state fingerprints disagree, is the caller's
``divergence`` function, called on every rank alike.

Alerts are edge-triggered: written when a condition starts, not every step it holds
(a split that regroups while it lasts is a new one).

- ``nonfinite_local``: ranks whose local loss or gradient is NaN/Inf, named;
- ``loss_cv``: the ranks' loss coefficient of variation above ``alert_loss_cv``;
- ``grad_cos_min``: the lowest pairwise gradient cosine (over the ranks with finite
  gradients) below ``alert_cos_min``. Either fires on NaN too, except where a
  non-finite rank made it: that step it measured nothing, and ``nonfinite_local``
  alone is alerted;
- ``replicas_split``: the ranks received different aggregated gradients;
- ``state_split``: the ranks' parameters / optimizer state differ (with the
  replicas' distance from the mean replica and the tensors that moved most).

Example::

    >>> import torch
    >>> from paft.config import MonitorConfig
    >>> from paft.consistency import ControlVector, ControlView
    >>> from paft.records import RunRecorder
    >>> def view(*losses):
    ...     rows = [ControlVector(x, 1.0, 1.0, 7, None, 0, 0, None).pack(0) for x in losses]
    ...     return ControlView(torch.stack(rows))
    >>> monitor = Monitor(MonitorConfig(alert_loss_cv=0.5), RunRecorder(None, rank=1), divergence=None)
    >>> monitor.record(0, view(2.0, 2.2), metric_step=True)["consistency/loss_cv"] < 0.5
    True
    >>> _ = monitor.record(1, view(2.0, 9.0), metric_step=True)
    >>> _ = monitor.record(2, view(2.0, 9.5), metric_step=True)   # still on: no new alert
    >>> monitor.alerts
    1
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from paft.config import MonitorConfig
from paft.consistency import ControlView, replica_metrics, worker_metrics
from paft.divergence import DivergenceReport, farthest
from paft.records import RunRecorder, jsonable

__all__ = ["Monitor", "SPLIT_TENSORS"]

SPLIT_TENSORS = 5  # the tensors a state-split alert names, farthest apart first


@dataclass(frozen=True)
class _Condition:
    """One alert: the metric it reads, when it fires, and what sets it apart."""

    name: str
    key: str
    """Its metric in the step's record; a step without it leaves the alert's state be."""
    fires: Callable[[Any, MonitorConfig], bool]
    split: str | None = None
    """The part of the replicas a split alert is about, ``grad`` or ``state``: the
    ranks it names are the minority, and a split that regroups is new. A ``state``
    split is read from the state fingerprints: none where a sync changed the state
    after them; the alert measures the replicas' distance (``divergence``)."""
    unmeasured_if_nonfinite: bool = False
    """A threshold a non-finite rank turns NaN: that NaN measured nothing."""
    names_ranks: bool = False
    """Its value is the ranks it names; another rank while it lasts is new."""

    def shown(self, value: float, config: MonitorConfig) -> str:
        """``value`` for the console: 4 significant digits, or as many more as it takes to
        read as past the threshold (a cosine of 0.99996 under an ``alert_cos_min`` of
        0.99999 read "1", on the threshold's safe side)."""
        return next((text for text in (f"{value:.{digits}g}" for digits in range(4, 17))
                     if self.fires(float(text), config)), repr(value))


_CONDITIONS = (
    # A rank's non-finite loss or local gradient, named at once: the dispersion turns NaN
    # alike whichever rank it is, and the cosines leave the rank out.
    _Condition("nonfinite_local", "consistency/nonfinite_ranks", lambda v, cfg: bool(v), names_ranks=True),
    # Written so that NaN fires too: one no non-finite rank explains (finite losses whose
    # sum overflows) is news.
    _Condition("loss_cv", "consistency/loss_cv", lambda v, cfg: not v <= cfg.alert_loss_cv,
               unmeasured_if_nonfinite=True),
    _Condition("grad_cos_min", "consistency/grad_cos_min", lambda v, cfg: not v >= cfg.alert_cos_min,
               unmeasured_if_nonfinite=True),
    _Condition("replicas_split", "replicas/grad_distinct", lambda v, cfg: v > 1, split="grad"),
    _Condition("state_split", "replicas/state_distinct", lambda v, cfg: v > 1, split="state"),
)


# A gradient split a repair ended: truthy (its next step is recorded), and unlike any
# split's groups (a split found then is alerted); JSON, as the checkpoint holds it.
_ENDED = ["ended by a repair"]


class Monitor:
    """The step records and alerts of one protector (one per rank, all in step).

    ``divergence``: measures the replicas' distance per tensor, a collective (see
    :func:`paft.divergence.measure_divergence`), for the ``state_split`` alert; with
    None that alert names the disagreeing ranks without the distance.
    """

    def __init__(self, config: MonitorConfig, recorder: RunRecorder,
                 divergence: Callable[[], DivergenceReport] | None) -> None:
        self.config = config
        self.recorder = recorder
        self.divergence = divergence
        self.alerts = 0
        """Alerts raised in the run."""
        self.alerting: dict[str, bool | list[Any]] = {}
        """Which conditions hold now (a condition still on is not alerted again), a
        split's as its groups (a split that regroups is alerted again), non-finite ranks
        as their list (another rank is alerted again)."""

    def record(self, step: int, view: ControlView, metric_step: bool, grads: torch.Tensor | None = None,
               alerts: bool = True, applied: bool = True, stale_fingerprints: bool = False,
               guarded: bool = False) -> dict[str, Any]:
        """The step's ``consistency.jsonl`` record and alerts: every metric on a metric
        step (``grads``: the ranks' exact local gradients, for ``--cosine exact``).
        Between them (--monitor-interval) a record of what every step carries (the
        losses, the ``replicas/*`` keys) where there is news of the replicas: a split,
        the step after one (its end), a state fingerprint. The aggregated gradients of
        an update that was not ``applied`` split no replicas: their keys are left out.
        ``alerts`` false (a loss scaler's overflow: its non-finite norms are routine)
        writes the record only; ``stale_fingerprints``: a sync changed the state after
        this step's fingerprints, which then raise no ``state_split`` alert. ``guarded``:
        a guard protects the step, and its events name a gradient split it skipped;
        else (a loss scaler's skip of one rank's non-finite aggregated gradient) that
        split is still alerted, as nothing else would name it."""
        metrics = worker_metrics(view, grads) if metric_step else replica_metrics(view)
        split = {k: v for k, v in metrics.items() if k.startswith("replicas/grad_")}
        if not applied:
            metrics = {k: v for k, v in metrics.items() if k not in split}
        judged = split if applied or not guarded else {}  # the gradient split the alerts judge
        if not metric_step:
            was_split = self.alerting.get("replicas_split", False) or self.alerting.get("state_split", False)
            if not (was_split or judged.get("replicas/grad_distinct", 1) > 1 or "replicas/state_distinct" in metrics):
                return {}
        metrics["step"] = step
        metrics["loss"] = view.global_loss
        metrics["local_losses"] = view.losses.tolist()
        if metric_step:
            metrics["local_grad_norms"] = view.local_norms.tolist()
        metrics["faults"] = view.faults
        self.recorder.consistency(metrics)
        if alerts:
            self._alerts(step, {**metrics, **judged}, stale_fingerprints)
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """The monitor's parts of the protector's checkpoint, in its shape: ``alerting``
        (an alert still active after a resume is not new) and the ``alerts`` counter."""
        return {"alerting": dict(self.alerting), "counters": {"alerts": self.alerts}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` wrote (``state``: its own, or the protector's
        checkpoint holding it). Older checkpoints may lack the alert state or count, and saved
        a condition that held as ``True`` where :attr:`alerting` now keeps a split's
        groups or the non-finite ranks (:meth:`_is_new` takes either)."""
        self.alerts = int(state["counters"].get("alerts", 0))
        self.alerting = dict(state.get("alerting", {}))

    def replicas_agree(self) -> None:
        """The replicas were made identical (a sync, a repair): a split found later,
        by the fingerprints or by the next step's aggregated gradients, is a new one,
        and gets its own alert. A gradient split's next step is still recorded (the
        split's end, see :meth:`record`): it is marked ended, not off."""
        self.alerting["state_split"] = False
        if self.alerting.get("replicas_split"):
            self.alerting["replicas_split"] = list(_ENDED)

    def _alerts(self, step: int, m: dict[str, Any], stale_fingerprints: bool) -> None:
        """Edge-triggered: a condition whose metric this step lacks (not computed at this
        step, e.g. the state fingerprint between checks, or a threshold's NaN that a
        non-finite rank made) keeps its state."""
        # A non-finite rank turns the loss CV NaN, and the cosines once no pair of finite
        # gradients is left: such a NaN measured nothing (the other ranks may agree) and
        # nonfinite_local names the cause, so the threshold keeps its state, unmeasured.
        explained = bool(m.get("consistency/nonfinite_ranks"))
        for c in _CONDITIONS:
            if c.key not in m or (c.split == "state" and stale_fingerprints):
                continue
            value = m[c.key]
            if explained and c.unmeasured_if_nonfinite and math.isnan(value):
                continue
            active = bool(c.fires(value, self.config))
            ranks, groups = self._who(c, value, m)
            if active and self._is_new(c, groups):
                self._alert(step, c, value, ranks, groups)
            self.alerting[c.name] = groups if active and groups else active

    @staticmethod
    def _who(c: _Condition, value: Any, m: dict[str, Any]) -> tuple[list[int], list[Any] | None]:
        """(the ranks the alert names, what makes an alert new while one lasts: a split's
        groups, the non-finite ranks; ``None`` for a threshold)."""
        if c.split:
            return m.get(f"replicas/{c.split}_minority_ranks", []), m.get(f"replicas/{c.split}_groups")
        if c.names_ranks:
            return value, sorted(value)
        return [], None

    def _is_new(self, c: _Condition, groups: list[Any] | None) -> bool:
        """Whether condition ``c``, on now, is news: it was off, or while it lasts
        another rank went non-finite, or a split regrouped (another rank hit meanwhile)."""
        before = self.alerting.get(c.name, False)
        if not before:
            return True
        if c.names_ranks:  # before True: an older checkpoint's (see load_state_dict)
            return bool(set(groups or []) - set(before if isinstance(before, list) else []))
        return bool(groups) and isinstance(before, list) and before != groups

    def _alert(self, step: int, c: _Condition, value: Any, ranks: list[int],
               groups: list[Any] | None) -> None:
        """Record the alert in ``events.jsonl`` and say it on the console."""
        self.alerts += 1
        event = {"step": step, "event": "alert", "detector": c.name, "value": value, "ranks": ranks}
        if not c.split:
            who = ""
        elif ranks:
            who = f" (rank(s) {ranks} disagree)"
        else:  # no strict majority: which side is faulty is unknown
            who = f" (no majority: groups {groups})"
        if c.split == "state" and self.divergence is not None:  # every rank alike: a shared view
            event["divergence"], far = self._split_magnitude()
            who += far
        self.recorder.event(event)
        shown = c.shown(value, self.config) if isinstance(value, float) else value
        self.recorder.say(f"[alert] step {step}: {c.name} = {shown}{who}")

    def _split_magnitude(self) -> tuple[dict[str, Any], str]:
        """How far apart the replicas are, now that their fingerprints disagree: each
        rank's relative L2 distance to the mean replica, over the parameters and over the
        parameters and optimizer state, and the tensors that moved most. For the alert's
        record, and a few words for its line. Measured on the state after this step's
        update (the fingerprints were taken before it), so it may be 0: a difference
        the update rounded away."""
        assert self.divergence is not None
        try:
            d = self.divergence()
        except RuntimeError as err:  # the states differ in structure: no value-by-value distance (all ranks alike)
            return {"error": str(err)}, "; the states differ in structure"
        moved = [(name, rel, ranks) for name, rel, ranks in d.per_tensor or [] if rel > 0]
        worst = moved[:SPLIT_TENSORS]
        record = {"params_per_rank": d.per_rank, "state_per_rank": d.state_per_rank, "tensors": worst,
                  "moved_tensors": len(moved)}
        top = d.state_max
        if top > 0:  # every rank tied there (two replicas are equally far from their mean)
            words = f"; farthest from the mean: rank(s) {farthest(d.state_per_rank)}, {top:.3g}"
        else:  # the fingerprints were taken before this step's update, the distance after it
            words = "; equal in value after this step's update"
        if worst:
            words += f", most in {worst[0][0]} ({worst[0][1]:.3g})"
        return jsonable(record), words
