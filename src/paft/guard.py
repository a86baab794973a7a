"""Harmful-update guard: detect a bad step, recompute it, and say why it was bad.

A fault inside computation (a flipped bit in a matmul output, in a local gradient,
in the all-reduce) shows up as a non-finite value, a loss or gradient-norm spike, a
rank whose values are far from the others', or replicas that received different
"aggregated" gradients. Recomputing the most recent step removes a transient fault;
comparing the recomputation with the first attempt attributes it (the Megatron-LM
rerun state machine is the model): a clean rerun means *transient*, a bitwise
identical rerun means the input *data* is to blame, the same rank misbehaving
again with different values means a *persistent* hardware fault.

The guard is pure logic. Every decision is a function of the step's gathered
:class:`~paft.consistency.ControlView` (identical on all ranks) and of the guard's
own state, which every rank updates with the same inputs, so all ranks reach the
same verdict without another collective. Any rank's flag counts for all (an OR).

Detectors (:mod:`paft.guard_detect`), in the order they are tried (the first that fires
names the verdict):

- ``nonfinite_loss`` / ``nonfinite_local_grad`` / ``nonfinite_agg_grad``: a rank's
  FLAG_* bit or a non-finite value in its loss / local norm / aggregated norm.
  Suspects: the flagged ranks (for the aggregate, when every rank is flagged: the
  ranks whose local values are anomalous).
- ``grad_mismatch``: ranks hold different aggregated-gradient checksums, i.e. the
  all-reduce delivered different bytes (aggregation SDC; data never causes this).
  Suspects: the minority; without a strict majority (2 ranks, even split), the
  group whose aggregated norm is anomalous against the running history, else none.
- ``rank_outlier``: a rank's local loss or local grad norm is above the ranks'
  median by more than ``outlier_threshold`` floored MADs AND above the pooled
  history of accepted local values by the same rule (2 ranks: history only, and
  before any history, on the first step, a gap of 1e4x between the two; 1 rank: off).
  Both tests must fire: ranks see different data, so peers alone mislead.
- ``grad_spike``: the aggregated grad norm (max over ranks) above its history limit.
- ``loss_spike``: the global loss (mean of local losses) above its history limit.
- ``update_ratio`` (:meth:`Guard.check_update`): ``||w_new - w_old|| / ||w_old||``
  non-finite, above ``update_ratio``, or above its own history limit.

History limit: the median of the accepted values plus ``T`` floored MADs, or the
window's largest excursion three times over, whichever is higher
(:mod:`paft.spikes`, where the rule, its floors and its warm-up are spelled out).
``T`` is ``spike_threshold`` (``outlier_threshold`` for the per-rank history). Only
accepted, clean steps enter the windows; before ``warmup`` of them only a gross jump
(10^4 times) fires.

Decision table of :meth:`Guard.check` (pre-step; ``prev`` is the remembered detection
of this step)::

    attempt  this view    relation to prev                         action      cause
    any      state fingerprints disagree (tried first)             repair      state (persistent if decided)
    >= 1     state fingerprints disagree again, same minority      stop        persistent  (on_persistent=stop)
             (the repaired rank corrupted again: stuck memory),    repair      persistent  (on_persistent=repair)
             compared with the step's last split, even where a
             rollback or another detection came between
    >= 1     state fingerprints disagree, and the same view's      stop        persistent  (on_persistent=stop)
             grad_mismatch came back (as below): named by the      repair      persistent  (on_persistent=repair)
             verdict (detector grad_mismatch); the split is still
             repaired, except on a stop
    any      clean        no prev                                  proceed     None
    >= 1     clean        prev from check                          proceed     transient (persistent if decided)
    >= 1     clean        prev from check_update                   proceed     None (check_update decides)
    0        detected     -                                        recompute   None
    >= 1     detected     header rows reproduced (*)               skip        data
    >= 1     a spike reproduced, after shift_after such skips (none applied between) proceed  data, detector level_shift
             (the level moved: the spike statistics start over)
    >= 1     grad_mismatch again, same or unnamed suspects (bitwise   stop        persistent  (on_persistent=stop)
             or not: data never makes ranks' aggregates differ),      recompute   persistent  (on_persistent=repair)
             compared with the step's last grad_mismatch, even where
             a state repair or another detection came between; also
             one beside a non-finite value that fired first (named by
             the verdict; remembered where it does not come back)
    >= 1     detected     suspects overlap prev's, other values    stop        persistent  (on_persistent=stop)
             (unnamed both times, same detector: the suspects      recompute   persistent  (on_persistent=repair)
             are the ranks whose own loss / local norm moved, if
             only some did: healthy ranks recompute them bitwise)
    >= 1     detected     prev a state_mismatch (just repaired)    recompute   as decided so far
    >= 1     detected     anything else (new / unattributed)       recompute   as decided so far
    any      recompute wanted but a cap is spent                   skip        as decided, detector rerun_cap

(*) :func:`paft.rerun.reproduced`: the header rows (loss, local_sq, agg_norm,
fingerprints, flags, faults) bitwise, or within 1e-3 where all finite; only the
rows of the ranks both attempts name, where any are named both times.

:meth:`Guard.check_update` (post-step) follows the same table for the ratio, with
two differences: it can only roll back when :meth:`Guard.wants_snapshot` armed this
step (otherwise: ``proceed`` with ``detector="update_ratio"``, a record, and the
step's values stay out of the history), and it never names ranks (the ratio is a
max over ranks), so a recurring non-reproducible anomaly ends at ``rerun_cap``. A ratio
is compared with the step's last ratio detection, also where the recompute that
detection asked for found something else first (every attempt updates from the same
snapshot), unless a state repair came between. ``recompute`` and ``skip`` from it
both mean: restore the pre-step snapshot first.
:meth:`Guard.wants_snapshot` documents when the guard asks for that snapshot.

``repair``: the replicas' parameters / optimizer state differ, so every recompute
would reproduce the bad step (or none shows yet); the protector re-synchronizes them
(robust: the majority's bits; with 2 ranks, which have no majority, a NaN/Inf replica
is dropped, else the coordinate-wise median with the last agreed reference) and
recomputes. Past a rerun cap the verdict is ``skip`` with detector
``state_mismatch`` (``rerun_cap`` where it names a failing reduction): the protector
still repairs, then skips the batch: it repairs on a ``repair`` or a ``skip`` whose
view's state fingerprints disagree. The protector
fingerprints the state on every recompute, which is how a corrupted replica is told
from bad data; the state columns are left out of the comparison with a first attempt
that did not check them.

Caps: at most ``max_reruns_per_step`` recomputes per step (pre- and post-step
together) and ``max_reruns_per_run`` in the run; past either, ``skip``.

Limit: a persistent fault that corrupts the same bits on every rerun is
indistinguishable from bad data on the same rank (Megatron reruns on another GPU
to tell them apart); it is attributed ``data`` and its batch skipped.

Example::

    >>> import torch
    >>> from paft.config import GuardConfig
    >>> from paft.consistency import ControlVector, ControlView
    >>> def view(loss, agg):
    ...     vec = ControlVector(loss, 1.0, agg, 7, None, 0, 0, None)
    ...     return ControlView(torch.stack([vec.pack(0)] * 2))
    >>> guard = Guard(GuardConfig(enabled=True, warmup=5), world_size=2)
    >>> for step in range(10):
    ...     assert guard.check(step, 0, view(2.0, 1.0)).action == "proceed"
    ...     guard.accept(step, view(2.0, 1.0))
    >>> guard.check(10, 0, view(2.0, 1e36)).action   # bit 30 flipped in the aggregate
    'recompute'
    >>> v = guard.check(10, 1, view(2.0, 1.0))       # clean on recomputation
    >>> v.action, v.detector, v.cause
    ('proceed', 'grad_spike', 'transient')
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

from paft.config import GuardConfig
from paft.consistency import ControlView
from paft.guard_detect import Detectors
from paft.records import jsonable
from paft.replicas import group_replicas, outside_majority
from paft.rerun import bits_f64, close, f64_bits, reproduced, unsteady_ranks
from paft.spikes import REL_FLOOR_GRAD, REL_FLOOR_LOSS, SpikeWindow

__all__ = [
    "ACTIONS",
    "CAUSES",
    "COUNTERS",
    "DETECTORS",
    "GuardVerdict",
    "Guard",
]

ACTIONS = ("proceed", "recompute", "repair", "skip", "stop")
CAUSES = ("transient", "persistent", "data", "state")
COUNTERS = ("detections", "recomputes", "skipped_batches", "rollbacks", *CAUSES)
DETECTORS = ("state_mismatch", "nonfinite_loss", "nonfinite_local_grad", "nonfinite_agg_grad", "grad_mismatch",
             "loss_spike", "grad_spike", "rank_outlier", "update_ratio", "rerun_cap", "level_shift",
             "loss_scale_overflow")
_SPIKES = ("loss_spike", "grad_spike", "rank_outlier")  # finite values judged against the history


@dataclass
class GuardVerdict:
    """What to do with the current attempt of a step, and why."""

    action: str
    """``proceed`` | ``recompute`` | ``repair`` (re-synchronize the replicas from the
    majority, then recompute) | ``skip`` | ``stop``."""
    detector: str | None = None
    """The detector that fired (kept on the ``proceed`` that resolves a detection)."""
    ranks: list[int] = field(default_factory=list)
    """Suspect ranks. For a rank's own values (non-finite loss or local gradient, rank
    outlier): the ranks whose values fired, every rank if all did. For the shared
    aggregate (its spikes, its non-finite result on every rank): the ranks whose local
    values stand out, empty when none or all do. For a mismatch: the ranks outside the
    majority, or with no majority those whose aggregated norm stands out."""
    cause: str | None = None
    """None while undecided; ``transient`` | ``persistent`` | ``data`` | ``state`` once decided."""
    values: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The records' vocabulary is closed: a misspelt name would be counted nowhere.
        if self.action not in ACTIONS:
            raise ValueError(f"action must be one of {ACTIONS}, got {self.action!r}")
        if self.detector is not None and self.detector not in DETECTORS:
            raise ValueError(f"detector must be None or one of {DETECTORS}, got {self.detector!r}")
        if self.cause is not None and self.cause not in CAUSES:
            raise ValueError(f"cause must be None or one of {CAUSES}, got {self.cause!r}")

    def to_json(self) -> dict[str, Any]:
        """JSON-safe form: non-finite values become the strings ``nan`` / ``inf`` / ``-inf``."""
        return jsonable({**asdict(self), "values": {k: float(v) for k, v in self.values.items()}})


@dataclass
class _Detection:
    """The detection a rerun is compared against."""

    source: str  # "check" | "update"
    detector: str
    ranks: list[int]
    bits: list[list[int]]

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "detector": self.detector, "ranks": list(self.ranks),
                "bits": [list(r) for r in self.bits]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> _Detection:
        return cls(d["source"], d["detector"], list(d["ranks"]), [list(r) for r in d["bits"]])


# Detectors whose last detection in a step is remembered past a detection of another
# kind (_StepState.earlier): their recurrence attributes the step whatever came between.
# A grad_mismatch is never data, so coming back on the same ranks makes it persistent,
# a state repair between them too; so does a state split of a replica repaired earlier in
# the step (stuck memory), a rolled-back update or another fault's recompute between them
# too; an update ratio is measured from the same pre-step state on every attempt (until a
# repair changes it), so one that comes back the same is data.
_REMEMBERED = ("grad_mismatch", "state_mismatch", "update_ratio")


@dataclass
class _StepState:
    step: int
    reruns: int = 0
    cause: str | None = None
    pending: _Detection | None = None
    detected: bool = False  # anything detected in this step: arms the snapshot
    tainted: bool = False  # an update anomaly that could not be rolled back
    earlier: dict[str, _Detection] = field(default_factory=dict)  # by detector, of _REMEMBERED


class Guard:
    """Per-step harmful-update detection and the recompute / attribution state machine.

    Call protocol for one step ``t`` (attempts count every recomputation of ``t``,
    whether a pre- or a post-step detection asked for it):
    ``check(t, a, view)`` after the all-reduce of attempt ``a``; on ``proceed``:
    ``wants_snapshot(t, view)`` (snapshot params + optimizer state if True),
    ``optimizer.step()``, ``check_update(t, ratio)``; when the step stays applied,
    ``accept(t, view, ratio)``. Skipped steps are not accepted.
    """

    def __init__(self, config: GuardConfig, world_size: int) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.config = config
        self.world_size = world_size
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._restart_history()
        self._st: _StepState | None = None
        self._armed_step: int | None = None

    # -- pre-step -------------------------------------------------------------------

    @property
    def _armed(self) -> bool:
        """The spike and outlier rules judge against the history: ``warmup`` clean steps
        are in it (before, only a gross jump fires)."""
        return self._accepted >= self.config.warmup

    def check(self, step: int, attempt: int, view: ControlView) -> GuardVerdict:
        """Verdict on attempt ``attempt`` of ``step`` before ``optimizer.step()``."""
        if view.world_size != self.world_size:
            raise ValueError(f"view has {view.world_size} ranks, the guard was built for {self.world_size}")
        st = self._step_state(step, attempt)
        state = view.state_fingerprints()
        groups = group_replicas(state) if state is not None else []
        if len(groups) > 1:
            return self._repair(st, groups, view)
        found = self._detectors().detect(view)
        prev = st.pending
        if found is None:
            if prev is not None and prev.source == "check":
                st.pending = None
                cause = self._set_cause(st, st.cause or "transient")
                return GuardVerdict("proceed", prev.detector, prev.ranks, cause, self._summary(view))
            return GuardVerdict("proceed", values=self._summary(view))
        detector, ranks, values = found
        self._mark_detected(st)
        detection = _Detection("check", detector, ranks, view.header_bits())
        # Data cannot make ranks receive different aggregated gradients: a mismatch
        # that comes back, bitwise or not, is a reduction failing again (persistent),
        # even where 2 ranks leave the faulty one unnamed, and also where a repair of
        # the state or another detection came between (the repair that hid it moved
        # every value, not which rank's reduction fails).
        again = self._failed_again(st, detection)
        mismatch = self._detectors().grad_mismatch(view) if detector != "grad_mismatch" else None
        if mismatch is not None:
            # A non-finite value fired first, but the same view's checksums still tell of
            # the reduction (as a state split's do, see _repair): a mismatch beside it is
            # remembered, and where it comes back it names the verdict (a NaN loss on one
            # rank hid another rank's reduction failing again: never persistent).
            beside = _Detection("check", "grad_mismatch", mismatch[1], detection.bits)
            again = self._failed_again(st, beside)
            if again is not None:
                (detector, ranks, values), detection = mismatch, beside
        if again is not None:
            common = again
        elif prev is None or prev.source != "check" or prev.detector == "state_mismatch":
            # A first detection, also right after a repair: the repaired state moved the
            # ranks' values, so bad data coming back would read as a persistent fault.
            st.pending = detection
            verdict = self._recompute_unless_capped(st, detector, ranks, values)
            spent = verdict.detector == "rerun_cap" and self.counters["recomputes"] >= self.config.max_reruns_per_run
            if spent and detector in _SPIKES and not ranks and self._detectors().rose_alike(view):
                # No rerun left in the run to tell data from a fault: a rise of every rank
                # alike counts towards a level shift (skipping on would stall training for
                # good). Not where only the step's cap is spent (a detection after a repair
                # or a rolled-back update): the next batch is recomputed again.
                return self._spike_skipped(verdict, ranks, values)
            return verdict
        else:
            # Suspects named both times: only their rows must reproduce (another rank's
            # transient fault, on either attempt, does not make one rank's bad data persistent).
            rows = sorted(set(ranks) & set(prev.ranks)) or None
            if reproduced(prev.bits, detection.bits, rows):
                named = rows or ranks  # the ranks whose data reproduced
                # A level shift applies this attempt: never one where another rank was hit too.
                return self._skip_as_data(st, detector, named, values,
                                          may_shift=detector in _SPIKES and named == ranks)
            common = sorted(set(prev.ranks) & set(ranks))
            if not (common or prev.ranks or ranks) and detector == prev.detector:
                # Unnamed both times (two faulty ranks of four pull the ranks' median along):
                # healthy ranks recompute their own values bit for bit; the ranks whose
                # values moved are the ones the recurring anomaly comes from.
                common = unsteady_ranks(prev.bits, detection.bits)
        st.pending = detection
        if common or again is not None:
            self._set_cause(st, "persistent")
            if self.config.on_persistent == "stop":
                return GuardVerdict("stop", detector, common, "persistent", values)
            return self._recompute_unless_capped(st, detector, common or ranks, values)
        return self._recompute_unless_capped(st, detector, ranks, values)

    # -- post-step ------------------------------------------------------------------

    def wants_snapshot(self, step: int, view: ControlView) -> bool:
        """Whether to copy params + optimizer state before this step's ``optimizer.step()``.

        Copying every step costs ~1-2% of a step, so the guard arms only where a
        rollback is plausible: the update-ratio history is in warm-up (its spike rule
        is off, the first steps move weights the most); this step already needed a
        recompute; the loss or aggregated grad norm is a near miss (above the limit
        at half ``spike_threshold``, and above the window max). (Ranks whose state
        fingerprints disagree never get here: :meth:`check` repairs them first, and the
        recompute is armed as one this step needed.) A single-rank fault
        inside ``optimizer.step()`` on an unarmed step is left to PAFT-Sync: it splits
        the replicas, which the next fingerprint check sees.
        """
        armed = self._snapshot_due(step, view)
        self._armed_step = step if armed else None
        return armed

    def _snapshot_due(self, step: int, view: ControlView) -> bool:
        cfg = self.config
        if cfg.update_ratio <= 0:
            return False  # no post-step detector: nothing would roll back
        if self._ratios_seen < cfg.warmup or (self._st is not None and self._st.step == step and self._st.detected):
            return True  # the ratio's own spike rule is still off, or this step needed a recompute
        # A near miss of the loss or the aggregated gradient norm. The spike rules are armed
        # here: every ratio counted was of an accepted step, so _accepted >= _ratios_seen.
        half = cfg.spike_threshold / 2
        if view.global_loss > self._loss.limit(half, REL_FLOOR_LOSS, True, tail=1.0):
            return True
        return _grad_norm(view) > self._grad.limit(half, REL_FLOOR_GRAD, True, tail=1.0)

    def check_update(self, step: int, ratio: float) -> GuardVerdict:
        """Verdict after ``optimizer.step()`` of ``step``; ``ratio`` is the max over ranks.

        ``recompute`` / ``skip``: restore the pre-step snapshot, then recompute / drop
        the batch. Only returned when :meth:`wants_snapshot` armed this step.
        """
        cfg = self.config
        if cfg.update_ratio <= 0:
            return GuardVerdict("proceed")
        st = self._step_state(step)
        ratio = float(ratio)
        self._expire_ratios(step)
        # The cap holds once the ratios are warm: from a small or zero initialisation the
        # first updates are legitimately larger than the weights (Adam's first steps on
        # weights of std 1e-3: ratio 10), and a recompute reproduces them exactly.
        armed = self._ratios_seen >= cfg.warmup
        limit = self._ratio.limit(cfg.spike_threshold, REL_FLOOR_GRAD, armed)
        if armed:
            limit = min(cfg.update_ratio, limit)
        values = {"ratio": ratio, "limit": limit}
        prev = st.pending
        if math.isfinite(ratio) and ratio <= limit:
            if prev is not None and prev.source == "update":
                st.pending = None
                return GuardVerdict("proceed", "update_ratio", [], self._set_cause(st, st.cause or "transient"), values)
            return GuardVerdict("proceed", values=values)
        self._mark_detected(st)
        if self._armed_step != step:
            # No snapshot to return to: a record for the events log, and the step's
            # values are kept out of the history.
            st.tainted = True
            return GuardVerdict("proceed", "update_ratio", [], None, values)
        detection = _Detection("update", "update_ratio", [], [[f64_bits(ratio)]])
        # Compared with this step's last ratio detection, also where the recompute it
        # asked for found something else first: every attempt updates from the same state.
        before = self._remember(st, detection)
        if before is not None and (before.bits == detection.bits or close(bits_f64(before.bits[0][0]), ratio)):
            # As for a reproduced loss spike: a lasting rise is applied after
            # --shift-after skips; a NaN never.
            verdict = self._skip_as_data(st, "update_ratio", [], values, may_shift=math.isfinite(ratio))
        else:
            st.pending = detection
            verdict = self._recompute_unless_capped(st, "update_ratio", [], values)
        if verdict.action != "proceed":  # a level shift keeps the update
            self.counters["rollbacks"] += 1
        return verdict

    def _failed_again(self, st: _StepState, detection: _Detection) -> list[int] | None:
        """Remember ``detection`` (:meth:`_remember`); where it is a ``grad_mismatch`` that
        comes back after the step's last one, the reduction failing again: the ranks named
        both times (empty where either names none). None: no recurrence (another detector,
        none before, or a new fault on other ranks only)."""
        before = self._remember(st, detection)
        if detection.detector != "grad_mismatch":  # check()'s detectors remember no other
            return None
        if before is None or (detection.ranks and before.ranks and not set(detection.ranks) & set(before.ranks)):
            return None
        return sorted(set(before.ranks) & set(detection.ranks))

    @staticmethod
    def _remember(st: _StepState, detection: _Detection) -> _Detection | None:
        """Keep ``detection`` as its step's last of its detector, where that detector's
        are remembered (``_REMEMBERED``); return the one it replaces, if any."""
        if detection.detector not in _REMEMBERED:
            return None
        before = st.earlier.get(detection.detector)
        st.earlier[detection.detector] = detection
        return before

    def _mark_detected(self, st: _StepState) -> None:
        """Something was detected in ``st``'s step: one detection per step, whatever its
        recomputes find (they belong to the detection that started them)."""
        if not st.detected:
            self.counters["detections"] += 1
        st.detected = True

    def _expire_ratios(self, step: int) -> None:
        """Drop the ratios older than ``window`` steps: the spike rule judges an update
        against recent ones only (with none, only the ``update_ratio`` cap applies)."""
        while self._ratio_steps and self._ratio_steps[0] < step - self.config.window:
            self._ratio_steps.popleft()
            self._ratio.drop_oldest()

    def accept(self, step: int, view: ControlView, ratio: float | None = None) -> None:
        """``step`` was applied: its values join the history (unless its update was anomalous).

        Pass ``ratio`` whenever ``update_ratio > 0``: until ``warmup`` ratios were
        accepted the guard asks for a snapshot before every update.
        """
        st = self._st
        # An applied batch ends a run of skips towards a level shift, also where its update
        # was anomalous: its loss and gradient norm passed the check.
        self._data_skips = 0
        if not (st is not None and st.step == step and st.tainted):
            self._loss.push(view.global_loss)
            self._grad.push(_grad_norm(view))
            for x in view.losses.tolist():
                self._rank_loss.push(x)
            for x in view.local_norms.tolist():
                self._rank_norm.push(x)
            self._accepted += 1
            # A zero ratio (a zero learning rate, as warm-ups from 0 start; or all-zero
            # weights) says nothing of the updates' scale: kept, every later update would
            # be a gross jump over 0.
            if ratio is not None and math.isfinite(ratio) and ratio > 0:
                self._ratio.push(float(ratio))
                self._ratio_steps.append(step)
                self._ratios_seen += 1
        self._st = None
        self._armed_step = None

    def _step_state(self, step: int, attempt: int | None = None) -> _StepState:
        """``step``'s state, kept across its recomputes; begun afresh at a new step, and
        at a first attempt (``attempt == 0``) of :meth:`check`, unless the detection of
        :meth:`check_update` is pending (the attempt recomputes an update it rolled back)."""
        st = self._st
        if st is None or st.step != step or (
            attempt == 0 and not (st.pending is not None and st.pending.source == "update")
        ):
            st = self._st = _StepState(step)
        return st

    def _skip_as_data(self, st: _StepState, detector: str, ranks: list[int], values: dict[str, float],
                      may_shift: bool) -> GuardVerdict:
        """The detection reproduced on recomputation: the batch's data is to blame and it
        is skipped, or, where ``may_shift``, counted towards a level shift
        (:meth:`_spike_skipped`)."""
        st.pending = None
        self._set_cause(st, "data")
        self.counters["skipped_batches"] += 1
        skip = GuardVerdict("skip", detector, ranks, "data", values)
        return self._spike_skipped(skip, ranks, values) if may_shift else skip

    def _spike_skipped(self, skip: GuardVerdict, ranks: list[int], values: dict[str, float]) -> GuardVerdict:
        """``skip`` drops a batch for a spike that reproduced on recomputation, or that
        the run's rerun cap skipped where every rank rose alike (where some ranks
        stand out it may be their fault, which a level shift would apply). After
        ``shift_after`` such skips with no batch applied between them (other skips
        neither count nor reset) the level itself moved: this batch is
        applied instead, and the spike statistics start over."""
        if not self.config.shift_after or self._data_skips < self.config.shift_after:
            self._data_skips += 1
            return skip
        self.counters["skipped_batches"] -= 1
        self._restart_history()
        return GuardVerdict("proceed", "level_shift", ranks, skip.cause, values)

    def _restart_history(self) -> None:
        """Start the spike statistics afresh (at construction, and at a level shift: they
        re-warm from the new level)."""
        w = self.config.window
        self._loss, self._grad, self._ratio = SpikeWindow(w), SpikeWindow(w), SpikeWindow(w)
        # The step of each ratio in _ratio: ratios are measured only on armed steps, so
        # after the warm-up they come rarely, and a window of old ones (tiny, under a
        # learning-rate warm-up) would call a clean recompute's update a spike.
        self._ratio_steps: deque[int] = deque(maxlen=w)
        # Local values of all ranks pooled: ranks draw batches from one distribution,
        # and world_size times the samples describe its tails better than one rank's.
        self._rank_loss, self._rank_norm = SpikeWindow(w * self.world_size), SpikeWindow(w * self.world_size)
        self._accepted = self._ratios_seen = 0
        self._data_skips = 0  # consecutive batches skipped as data for a spike

    def _detectors(self) -> Detectors:
        """The detectors over the history as it stands now (a level shift or a checkpoint
        load replaces the windows)."""
        return Detectors(self.config, self.world_size, self._loss, self._grad, self._rank_loss, self._rank_norm,
                         self._armed)

    # -- state machine helpers --------------------------------------------------------

    def _repair(self, st: _StepState, groups: list[list[int]], view: ControlView) -> GuardVerdict:
        """The replicas' parameters / optimizer state differ (corrupted at rest, or by a
        fault inside ``optimizer.step()``): recomputing from that state would only
        reproduce it, so re-synchronize from the majority first, then recompute."""
        self._mark_detected(st)  # or what this step's recompute found: one detection
        minority = outside_majority(groups, self.world_size)
        bits = view.header_bits()
        # The step's last split, repaired since: compared whatever came between (a rolled-back
        # update, a recompute for another detection), as nothing but memory splits the state.
        detection = _Detection("check", "state_mismatch", minority, bits)
        split = self._remember(st, detection)
        again = sorted(set(split.ranks) & set(minority)) if split is not None else []
        # Split again after its repair: stuck memory, also where no majority names the
        # replica either time (2 ranks, an even split), as a grad_mismatch that comes back.
        persistent = bool(again) or (split is not None and not minority and not split.ranks)
        # The state check comes first, but the same view's checksums still tell of the
        # reduction: neither data nor a state split makes ranks' aggregates differ. A
        # mismatch here is compared with the step's last one and remembered for the
        # recompute after the repair; with one rerun left, the repair spends it, and this
        # view is the last sight of a reduction failing again.
        found = self._detectors().grad_mismatch(view)
        reduction = None
        if found is not None:
            reduction = self._failed_again(st, _Detection("check", "grad_mismatch", found[1], bits))
        if persistent:  # the stuck replica is the fault the verdict names
            reduction = None
        # A persistent fault this step already found stays its cause: a split found after it
        # (another replica corrupted at rest) does not explain it away.
        decided = st.cause == "persistent"
        self._set_cause(st, "persistent" if persistent or reduction is not None or decided else "state")
        st.pending = detection
        # The update starts from the repaired state from now on: the ratio of one before
        # would say nothing of the data. (A grad_mismatch stays comparable: see check.)
        st.earlier.pop("update_ratio", None)
        split_values = {"distinct": float(len(groups))}
        if reduction is not None and found is not None:
            # Named as check names a mismatch that comes back; the protector repairs the
            # split all the same (its record names the split replicas), also past a cap.
            if self.config.on_persistent == "stop":
                return GuardVerdict("stop", "grad_mismatch", reduction, "persistent", found[2])
            verdict = self._recompute_unless_capped(st, "grad_mismatch", reduction or found[1], found[2])
            if verdict.action == "skip":  # rerun_cap, as past a cap anywhere
                return verdict
            return GuardVerdict("repair", "grad_mismatch", verdict.ranks, "persistent", verdict.values)
        if persistent and self.config.on_persistent == "stop":
            return GuardVerdict("stop", "state_mismatch", again, "persistent", split_values)
        verdict = self._recompute_unless_capped(st, "state_mismatch", minority, split_values)
        # Past a cap: the replicas are still repaired, and the batch is skipped.
        action = "repair" if verdict.action == "recompute" else "skip"
        return GuardVerdict(action, "state_mismatch", minority, st.cause or "state", verdict.values)

    def _recompute_unless_capped(self, st: _StepState, detector: str, ranks: list[int],
                                 values: dict[str, float]) -> GuardVerdict:
        """``recompute`` the step, or past a rerun cap ``skip`` it (detector ``rerun_cap``)."""
        cfg = self.config
        if st.reruns >= cfg.max_reruns_per_step or self.counters["recomputes"] >= cfg.max_reruns_per_run:
            self.counters["skipped_batches"] += 1
            st.pending = None
            capped = {**values, "reruns_step": float(st.reruns), "reruns_run": float(self.counters["recomputes"])}
            return GuardVerdict("skip", "rerun_cap", ranks, st.cause, capped)
        st.reruns += 1
        self.counters["recomputes"] += 1
        return GuardVerdict("recompute", detector, ranks, st.cause, values)

    def _set_cause(self, st: _StepState, cause: str) -> str:
        """Record the step's cause once (a later, stronger finding replaces it)."""
        if st.cause != cause:
            if st.cause is not None:
                self.counters[st.cause] -= 1
            st.cause = cause
            self.counters[cause] += 1
        return cause

    @staticmethod
    def _summary(view: ControlView) -> dict[str, float]:
        return {"loss": view.global_loss, "grad_norm": _grad_norm(view)}

    # -- checkpoints ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe state: counters, history windows, and an in-flight step, if any."""
        st = self._st
        return {
            "version": 1,
            "world_size": self.world_size,
            "accepted": self._accepted,
            "ratios_seen": self._ratios_seen,
            "data_skips": self._data_skips,
            "counters": dict(self.counters),
            "windows": {name: list(w.values) for name, w in self._windows().items()},
            "ratio_steps": list(self._ratio_steps),
            "step": None if st is None else {
                # "incident" keeps its name from before _StepState.detected: checkpoints of
                # either version load.
                "step": st.step, "reruns": st.reruns, "cause": st.cause, "incident": st.detected,
                "tainted": st.tainted,
                "pending": None if st.pending is None else st.pending.to_json(),
                "earlier": {name: d.to_json() for name, d in st.earlier.items()},
            },
            "armed_step": self._armed_step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != 1:
            raise ValueError(f"unsupported guard state version {state.get('version')!r}")
        self._accepted = int(state["accepted"])
        self._ratios_seen = int(state["ratios_seen"])
        self._data_skips = int(state.get("data_skips", 0))  # older checkpoints lack it
        self.counters.update({k: int(v) for k, v in state["counters"].items()})
        for name, w in self._windows().items():
            setattr(self, f"_{name}", SpikeWindow(w.values.maxlen or 1, state["windows"][name]))
        steps = state.get("ratio_steps")
        # Older checkpoints (no steps) or a torn one: the ratio history starts afresh. Matched
        # against the saved ratios, not the loaded ones: a shorter --guard-window on resume
        # keeps the newest of both alike (the deque's maxlen drops the same oldest steps).
        if steps is None or len(steps) != len(state["windows"]["ratio"]):
            self._ratio = SpikeWindow(self.config.window)
            steps = []
        self._ratio_steps = deque((int(s) for s in steps), maxlen=self.config.window)
        s = state.get("step")
        self._st = None
        if s is not None:
            p = s["pending"]
            self._st = _StepState(s["step"], s["reruns"], s["cause"], None if p is None else _Detection.from_json(p),
                                  s["incident"], s["tainted"],
                                  # older checkpoints lack it
                                  {name: _Detection.from_json(d) for name, d in s.get("earlier", {}).items()})
        self._armed_step = state.get("armed_step")

    def _windows(self) -> dict[str, SpikeWindow]:
        return {"loss": self._loss, "grad": self._grad, "ratio": self._ratio,
                "rank_loss": self._rank_loss, "rank_norm": self._rank_norm}


def _grad_norm(view: ControlView) -> float:
    """The step's aggregated gradient norm, judged: the largest rank's (ranks that
    received different aggregates hold different norms)."""
    return float(view.agg_norms.max())
