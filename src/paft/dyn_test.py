"""Tests for paft.dyn: the PAFT-Dyn period rule, events, checkpoint round trips,
and the fixed PAFT-Sync schedule. Pure logic: milliseconds."""

from __future__ import annotations

import doctest
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paft import dyn
from paft.dyn import DynConfig, DynScheduler, FixedScheduler, SyncScheduler

T = 1e-4  # the default target
HIGH, MID, CALM = 2 * T, 0.5 * T, 0.1 * T


def test_docstring_examples_run() -> None:
    result = doctest.testmod(dyn)
    assert result.attempted >= 8 and result.failed == 0


def test_defaults() -> None:
    cfg = DynConfig()
    assert (cfg.h_init, cfg.h_min, cfg.h_max) == (50, 5, 400)
    assert (cfg.target, cfg.shrink, cfg.grow, cfg.low_water, cfg.patience) == (
        1e-4, 0.5, 2.0, 0.25, 2
    )
    sched = DynScheduler()
    assert sched.period == 50 and sched.next_sync_step == 50
    assert isinstance(sched, SyncScheduler)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"h_init": 0, "h_min": 1}, "h_init"),
        ({"h_init": 2.0}, "h_init"),
        ({"h_init": 7.5}, "h_init"),  # within the bounds, but not an int
        ({"h_min": 0}, "h_min"),
        ({"h_min": True}, "h_min"),
        ({"h_max": -3}, "h_max"),
        ({"h_max": 2**53 + 1}, "h_max"),  # see test_the_longest_periods_stay_exact
        ({"h_min": 10, "h_max": 8, "h_init": 9}, "h_min"),
        ({"h_init": 4}, "h_init"),  # below h_min
        ({"h_init": 401}, "h_init"),  # above h_max
        ({"target": 0.0}, "target"),
        ({"target": float("nan")}, "target"),
        ({"target": float("inf")}, "target"),
        ({"target": True}, "target"),
        ({"target": "1e-4"}, "target"),
        ({"shrink": 1.0}, "shrink"),
        ({"shrink": 0.0}, "shrink"),
        ({"grow": 1.0}, "grow"),
        ({"grow": float("inf")}, "grow"),
        ({"low_water": -0.1}, "low_water"),
        ({"low_water": 1.5}, "low_water"),
        ({"low_water": "0.2"}, "low_water"),
        ({"low_water": True}, "low_water"),
        ({"patience": 0}, "patience"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        DynConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [{"h_min": 0}, {"h_min": 10, "h_max": 8}, {"h_max": 0}, {"target": 0.0},
                                    {"target": float("inf")}, {"target": float("nan")}])
def test_protect_config_checks_the_bounds_as_dyn_config_does(kwargs: dict) -> None:
    """One home for PAFT-Dyn's bounds: ProtectConfig (a run's config, also the command
    line's) and DynConfig (the scheduler's) hold the same defaults and refuse the same
    values with the same message, each naming its own fields (ProtectConfig's with their
    options)."""
    from paft.config import ProtectConfig

    options = {"h_min": "--h-min", "h_max": "--h-max", "target": "--dyn-target"}
    assert {k: getattr(ProtectConfig(), k) for k in options} == {k: getattr(DynConfig(), k) for k in options}
    with pytest.raises(ValueError) as dyn:
        DynConfig(**kwargs, h_init=kwargs.get("h_min", 5))
    with pytest.raises(ValueError) as protect:
        ProtectConfig(**kwargs)
    expected = str(dyn.value)
    assert expected.startswith("DynConfig.")
    for field, option in options.items():
        expected = expected.replace(f"DynConfig.{field}", f"ProtectConfig.{field} ({option})")
    assert str(protect.value) == expected


@pytest.mark.parametrize("kwargs", [{"h_min": 7, "h_init": 7, "h_max": 7}, {"h_init": 5}, {"h_init": 400},
                                    {"low_water": 0.0}, {"low_water": 1.0}])
def test_config_bounds_are_inclusive(kwargs: dict) -> None:
    DynConfig(**kwargs)


def test_the_longest_periods_stay_exact() -> None:
    """Periods up to MAX_PERIOD, scaled by any factor the config takes, stay whole
    numbers: a 10**400-step period overflowed a float at the first trigger (an
    OverflowError in the middle of a run), and so did a calm sync's growth by 1e300."""
    top = dyn.MAX_PERIOD
    sched = DynScheduler(DynConfig(h_min=1, h_init=top, h_max=top, grow=1e300, patience=1))
    sched.trigger(3)
    assert sched.observe(3, CALM) == top // 2  # the trigger's halving, exact
    assert sched.observe(4 + top // 2, CALM) == top  # grown by 1e300, clamped
    FixedScheduler(top)
    with pytest.raises(ValueError, match="period: must be an int in"):
        FixedScheduler(top + 1)


def test_equal_bounds_pin_the_period() -> None:
    sched = DynScheduler(DynConfig(h_min=7, h_init=7, h_max=7, patience=1))
    assert [sched.observe(s, d) for s, d in enumerate([HIGH, CALM, float("nan"), 0.0])] == [7] * 4


@pytest.mark.parametrize("bad", [True, 2.5])
@pytest.mark.parametrize("call", ["due", "trigger", "observe"])
def test_steps_must_be_ints(call: str, bad: object) -> None:
    sched = DynScheduler()
    args = (bad, 0.0) if call == "observe" else (bad,)
    with pytest.raises(TypeError):
        getattr(sched, call)(*args)


def test_shrinks_to_h_min_and_not_below() -> None:
    sched = DynScheduler()
    periods = [sched.observe(step, HIGH) for step in range(1, 7)]
    assert periods == [25, 12, 6, 5, 5, 5]
    assert sched.next_sync_step == 6 + 5


def test_shrink_is_severity_proportional() -> None:
    assert DynScheduler().observe(50, 1.5 * T) == 25  # at least `shrink`
    assert DynScheduler().observe(50, 4 * T) == 12  # 50 * 1/4
    assert DynScheduler().observe(50, 10 * T) == 5
    assert DynScheduler().observe(50, 1e30) == 5  # a flipped exponent
    assert DynScheduler(DynConfig(h_init=100, shrink=0.29)).observe(0, HIGH) == 29  # not 28


def test_grows_after_patience_calm_syncs_to_h_max_and_not_above() -> None:
    sched = DynScheduler()
    periods = [sched.observe(step, CALM) for step in range(1, 11)]
    assert periods == [50, 100, 100, 200, 200, 400, 400, 400, 400, 400]
    sched = DynScheduler(DynConfig(patience=1, grow=1.5, h_max=100))
    assert [sched.observe(s, 0.0) for s in range(4)] == [75, 100, 100, 100]


@pytest.mark.parametrize("h_init, grow, grown", [
    (100, 1.1, 110),  # 100 * 1.1 = 110.00000000000001: rounded before ceil
    (13, 1.5, 20),  # 19.5 rounds up...
    (5, 1.1, 6),  # ...so that a small period still grows
])
def test_growth_rounds_up(h_init: int, grow: float, grown: int) -> None:
    assert DynScheduler(DynConfig(h_init=h_init, grow=grow, patience=1)).observe(0, 0.0) == grown


@pytest.mark.parametrize("low_water, calm, period", [(0.0, 0.0, 50), (1.0, 0.99 * T, 100)])
def test_low_water_bounds_what_counts_as_calm(low_water: float, calm: float, period: int) -> None:
    """low_water = 0: nothing is calm, not even zero divergence (growth is off);
    low_water = 1: anything under the target is."""
    sched = DynScheduler(DynConfig(low_water=low_water, patience=1))
    assert sched.observe(50, calm) == period


def test_holds_in_between_and_calm_streak_must_be_consecutive() -> None:
    sched = DynScheduler(DynConfig(patience=3))
    seq = [CALM, CALM, MID, CALM, CALM, T, 0.25 * T, CALM, CALM, CALM]
    assert [sched.observe(s, d) for s, d in enumerate(seq)] == [50] * 9 + [100]
    # divergence exactly at target holds; exactly at low_water * target is not calm


def test_high_divergence_resets_calm_streak() -> None:
    sched = DynScheduler()
    assert [sched.observe(s, d) for s, d in enumerate([CALM, HIGH, CALM, CALM])] == [
        50, 25, 25, 50
    ]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_divergence_goes_to_h_min(bad: float) -> None:
    sched = DynScheduler()
    sched.observe(50, CALM)  # a calm streak in progress...
    assert sched.observe(60, bad) == 5
    assert sched.next_sync_step == 65
    assert sched.observe(65, CALM) == 5  # ...was reset
    triggered = DynScheduler()
    triggered.trigger(3)
    assert triggered.observe(3, bad) == 5  # an event's sync too: h_min, not the event's 25


def test_negative_divergence_is_rejected() -> None:
    with pytest.raises(ValueError, match="divergence"):
        DynScheduler().observe(1, -1e-9)


def test_due() -> None:
    sched = DynScheduler(DynConfig(h_init=10, h_min=2), start=100)
    assert [s for s in range(100, 131) if sched.due(s)][:1] == [110]
    assert not sched.due(109) and sched.due(110) and sched.due(115)  # missed: still due
    sched.observe(112, HIGH)
    assert sched.next_sync_step == 117 and not sched.due(116) and sched.due(117)


def test_trigger_makes_sync_due_now_and_shrinks_once() -> None:
    sched = DynScheduler()
    sched.observe(50, MID)
    assert not sched.due(63)
    sched.trigger(63)
    assert sched.due(63) and sched.next_sync_step == 63
    assert sched.period == 25  # shrunk as for a high divergence, at once
    sched.trigger(63)
    sched.trigger(64)
    assert sched.period == 25 and sched.next_sync_step == 63  # no double shrink
    assert sched.observe(63, MID) == 25  # the triggered sync: no second shrink
    assert sched.next_sync_step == 88


def test_triggered_sync_is_never_calm_but_honours_severity() -> None:
    sched = DynScheduler(DynConfig(patience=1))
    sched.trigger(3)
    assert sched.observe(3, 0.0) == 25  # tiny divergence: no growth right after an event
    assert sched.observe(28, 0.0) == 50  # calm again afterwards
    sched.trigger(30)
    assert sched.observe(30, 10 * T) == 5  # 50 * 1/10 from the pre-event period
    sched.trigger(31)
    assert sched.period == 5  # h_min holds
    assert sched.observe(31, float("nan")) == 5


def test_triggered_sync_shrinks_from_the_period_at_its_event() -> None:
    """The period an event's sync shrinks from is the one when the event came, after
    the growth and shrinks since the start or the last event, not theirs."""
    sched = DynScheduler()
    assert [sched.observe(50, CALM), sched.observe(100, CALM)] == [50, 100]
    sched.trigger(120)
    assert sched.period == 50
    assert sched.observe(120, 4 * T) == 25  # 100 / 4, not the initial 50 / 4
    sched.trigger(130)
    assert sched.period == 12
    assert sched.observe(130, MID) == 12  # 25 * shrink: the first event's 100 is gone


def test_fixed_scheduler_due_every_period() -> None:
    sched = FixedScheduler(7)
    synced = []
    for step in range(1, 50):
        if sched.due(step):
            assert sched.observe(step, HIGH if step % 2 else float("nan")) == 7
            synced.append(step)
    assert synced == [7, 14, 21, 28, 35, 42, 49]
    sched.trigger(52)
    assert sched.due(52) and sched.period == 7
    sched.observe(52, 0.0)
    assert sched.next_sync_step == 59
    with pytest.raises(ValueError, match="period"):
        FixedScheduler(0)
    with pytest.raises(ValueError, match="period"):
        FixedScheduler(2.5)  # type: ignore[arg-type]


_EVENT = st.one_of(
    st.tuples(st.just("observe"), st.sampled_from([0.0, CALM, MID, T, HIGH, 30 * T, math.nan])),
    st.tuples(st.just("trigger"), st.just(0.0)),
    st.tuples(st.just("step"), st.just(0.0)),
)


def _drive(sched: SyncScheduler, step: int, events: list[tuple[str, float]]) -> int:
    for kind, div in events:
        step += 1
        if kind == "observe" or sched.due(step):
            sched.observe(step, div)
        if kind == "trigger":  # its sync at the next event: a checkpoint may fall in between
            sched.trigger(step)
        cfg = getattr(sched, "config", None)
        assert type(sched.period) is int  # a float period (one scaled, not floored) would fail the next sync's step
        if cfg is not None:
            assert cfg.h_min <= sched.period <= cfg.h_max
    return step


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    st.sampled_from(["dyn", "fixed"]),
    st.lists(_EVENT, max_size=40),
    st.lists(_EVENT, max_size=40),
)
def test_state_dict_round_trip_continues_identically(
    kind: str, before: list, after: list
) -> None:
    def make() -> SyncScheduler:
        if kind == "dyn":
            return DynScheduler(DynConfig(h_init=8, h_min=2, h_max=32, patience=2))
        return FixedScheduler(6)

    original = make()
    step = _drive(original, 0, before)
    # Through JSON, as a checkpoint's side file would carry it.
    state = json.loads(json.dumps(original.state_dict()))
    restored = make()
    restored.load_state_dict(state)
    assert json.dumps(restored.state_dict()) == json.dumps(original.state_dict())
    _drive(original, step, after)
    _drive(restored, step, after)
    assert json.dumps(restored.state_dict()) == json.dumps(original.state_dict())
    assert restored.period == original.period
    assert restored.next_sync_step == original.next_sync_step


def test_load_state_dict_checks_kind_and_clamps_to_own_config() -> None:
    with pytest.raises(ValueError, match="FixedScheduler"):
        DynScheduler().load_state_dict(FixedScheduler(3).state_dict())
    big = DynScheduler(DynConfig(h_init=300))
    small = DynScheduler(DynConfig(h_max=100, h_init=50))
    small.load_state_dict(big.state_dict())
    assert small.period == 100 and small.next_sync_step == 100  # last sync 0 + the clamped period
    assert small.first_period == 300  # the run began with the saved scheduler's, not clamped
    large_min = DynScheduler(DynConfig(h_min=10))
    large_min.load_state_dict(DynScheduler(DynConfig(h_min=2, h_init=4)).state_dict())
    assert large_min.period == 10 and large_min.next_sync_step == 4  # a longer period postpones nothing


def test_pending_trigger_restored_into_a_smaller_h_max() -> None:
    """The triggered sync shrinks from the pre-event period as the new bounds clamp it."""
    big = DynScheduler(DynConfig(h_init=300))
    big.trigger(10)
    small = DynScheduler(DynConfig(h_max=100, h_init=50))
    small.load_state_dict(big.state_dict())
    assert small.due(10) and small.period == 100
    assert small.next_sync_step == 10  # the event's step, not 10 - (150 - 100) = -40
    assert small.observe(10, 4 * T) == 25  # 100 / 4, not 300 / 4


def test_fixed_period_is_the_loading_schedulers_own() -> None:
    """A resumed PAFT-Sync run may change --sync-period: the loaded state kept the saved
    period, and the new setting was silently ignored for the rest of the run."""
    short = FixedScheduler(2)
    for step in (2, 4):
        short.observe(step, 0.0)
    longer = FixedScheduler(10)
    longer.load_state_dict(short.state_dict())
    assert (longer.period, longer.next_sync_step) == (10, 6)  # the sync already due stays due
    longer.observe(6, 0.0)
    assert longer.next_sync_step == 16
    shorter = FixedScheduler(4)
    shorter.load_state_dict(FixedScheduler(10).state_dict())
    assert (shorter.period, shorter.next_sync_step) == (4, 4)  # brought forward by 10 - 4
    triggered = FixedScheduler(10)
    triggered.trigger(3)
    shorter.load_state_dict(triggered.state_dict())
    assert (shorter.period, shorter.next_sync_step) == (4, 3)  # due at once already: not moved to 3 - 6
    # The checkpoint it writes next carries its own period throughout, not the saved 10,
    # but the saved run's first (paft report draws the run's start from it).
    assert shorter.state_dict() == {"kind": "FixedScheduler", "period": 4, "next_sync_step": 3,
                                    "pending_trigger": True, "period_before_trigger": 4, "first_period": 10}
    older = {k: v for k, v in FixedScheduler(10).state_dict().items() if k != "first_period"}
    fresh = FixedScheduler(4)
    fresh.load_state_dict(older)  # a checkpoint from before the first period was kept
    assert fresh.first_period == 4


# Any config DynConfig takes (small periods, so floors and ceilings bite), divergences
# as multiples of its target (so that every row of the rule is drawn): NaN and inf
# farthest of all.
_CONFIG = st.builds(
    lambda bounds, target, shrink, grow, low_water, patience: DynConfig(
        h_min=bounds[0], h_init=bounds[1], h_max=bounds[2], target=target, shrink=shrink, grow=grow,
        low_water=low_water, patience=patience),
    st.lists(st.integers(1, 200), min_size=3, max_size=3).map(sorted),
    st.floats(1e-8, 1.0), st.floats(0.01, 0.99), st.floats(1.01, 8.0), st.floats(0.0, 1.0), st.integers(1, 4))
_TIMES_TARGET = st.one_of(st.floats(0.0, 1.0), st.floats(1.0, 50.0), st.just(math.nan), st.just(math.inf))
_HISTORY = st.lists(st.tuples(st.sampled_from(["observe", "trigger"]), _TIMES_TARGET), max_size=12)


def _farness(d: float) -> tuple[int, float]:
    return (1, 0.0) if not math.isfinite(d) else (0, d)


def _rule(cfg: DynConfig, state: dict, d: float) -> int:
    """The period after a sync measuring ``d`` from ``state``, as the paft.dyn docstring
    writes each row."""
    if not math.isfinite(d):
        return cfg.h_min
    h = state["period_before_trigger"] if state["pending_trigger"] else state["period"]
    if d > cfg.target or state["pending_trigger"]:
        factor = min(cfg.shrink, cfg.target / d) if d > cfg.target else cfg.shrink
        return max(cfg.h_min, math.floor(round(h * factor, 9)))
    if d < cfg.low_water * cfg.target and state["calm"] + 1 >= cfg.patience:
        return min(cfg.h_max, math.ceil(round(h * cfg.grow, 9)))
    return h


@settings(max_examples=300, deadline=None, derandomize=True)
@given(_CONFIG, _HISTORY, _TIMES_TARGET, _TIMES_TARGET)
def test_the_period_answers_divergence_as_the_rule_says(
    cfg: DynConfig, history: list[tuple[str, float]], x1: float, x2: float
) -> None:
    """From any state a history of syncs and events leaves, each sync's new period is
    the documented row's, an int within [h_min, h_max], and the next sync is due that
    many steps on; a sync that measured more never gets a longer period than one that
    measured less; an event cuts the period by ``shrink`` and makes a sync due at once
    (or keeps the earlier step one was due at)."""
    sched = DynScheduler(cfg)
    for step, (kind, x) in enumerate(history, start=1):
        before = sched.state_dict()
        if kind == "trigger":  # H cut by `shrink` at once; a second event before its sync changes nothing
            sched.trigger(step)
            cut = max(cfg.h_min, math.floor(round(before["period"] * cfg.shrink, 9)))
            assert sched.period == (before["period"] if before["pending_trigger"] else cut)
            assert sched.next_sync_step == min(before["next_sync_step"], step) and sched.due(step)
        else:
            assert sched.observe(step, x * cfg.target) == _rule(cfg, before, x * cfg.target)
        assert type(sched.period) is int and cfg.h_min <= sched.period <= cfg.h_max
    step, answers = len(history) + 1, []
    for x in sorted((x1, x2), key=_farness):
        probe = DynScheduler(cfg)
        probe.load_state_dict(sched.state_dict())
        answers.append(probe.observe(step, x * cfg.target))
        assert answers[-1] == _rule(cfg, sched.state_dict(), x * cfg.target)
        assert type(answers[-1]) is int and cfg.h_min <= answers[-1] <= cfg.h_max
        assert probe.next_sync_step == step + answers[-1] and not probe.due(step + answers[-1] - 1)
    assert answers[1] <= answers[0]
