"""Tests of :mod:`paft.resync`: the schedule rule for PyTorch's averager, and the step
protocol around the syncs and repairs, through the protector on real DDP (the real
ReplicaSync, scheduler and collectives; faults keyed by (rank, step)): what each sync
records as ``seen_from``, a Dyn trigger while a sync is in flight, a repair that finds
one in flight, and a split repaired after its step's fingerprints, which must not be
repaired again. More of the protocol is tested in protect_test.py."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paft.config import GuardConfig, MonitorConfig, ProtectConfig
from paft.protect import protect
from paft.protect_test import toy_closure, toy_model
from paft.records import RunRecorder, read_jsonl
from paft.resync import Resync, averages_at
from paft.state import fingerprints_over_ranks, state_fingerprint
from paft.testing import run_workers


def averager_steps(rank: int, world_size: int, period: int, start: int,
                   steps: int) -> list[tuple[bool, bool, int, int]]:
    """Per step from ``start`` (the averager moved along to it, as after a resume):
    whether Resync said it averaged, whether the replicas were then bitwise identical,
    and its sync and byte counts. Each step first moves every replica apart (a rank's
    own offset, after a backward pass)."""
    torch.manual_seed(0)
    model = DistributedDataParallel(nn.Linear(3, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    resync = Resync(model, optimizer, ProtectConfig(mode="averager", sync_period=period), guard=False,
                    recorder=RunRecorder(None, rank), replicas_agree=lambda: None)
    resync.set_next_step(start)
    out = []
    for step in range(start, start + steps):
        optimizer.zero_grad()
        model(torch.ones(1, 3)).sum().backward()  # the averager averages the parameters with a gradient
        with torch.no_grad():
            for p in model.parameters():
                p.add_(rank + 1)
        averaged = resync.maybe_sync(step, None)
        flat = torch.cat([p.detach().flatten() for p in model.parameters()])
        every = [torch.empty_like(flat) for _ in range(world_size)]
        dist.all_gather(every, flat)
        out.append((averaged, all(torch.equal(every[0], other) for other in every[1:]), resync.syncs,
                    resync.sync_bytes))
    return out


def test_the_averager_averages_exactly_at_the_steps_averages_at_names() -> None:
    """paft report counts an averager run's syncs with averages_at: it must be the
    steps PeriodicModelAverager really averages at, not a copy of its rule, also
    after the averager was moved along to a later step."""
    assert [s for s in range(10) if averages_at(s, 4)] == [0, 4, 8]  # from step 0, no warm-up
    period, start, steps = 3, 1, 8
    expected = [averages_at(s, period) for s in range(start, start + steps)]
    for out in run_workers(averager_steps, 2, period, start, steps):
        assert [averaged for averaged, _, _, _ in out] == expected
        assert [identical for _, identical, _, _ in out] == expected
        assert out[-1][2] == sum(expected) == 2
        assert out[-1][3] == 2 * 8 * 4  # two averages of 8 float32 parameters


# -- the step protocol, through the protector -------------------------------------------


def protected_run(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """protect_test's toy model under :func:`paft.protect` for ``steps`` steps (``opts``:
    the optimizer, the configs, the faults). Per step: the report's ``synced``,
    ``applied`` and ``attempts``, then :class:`Resync`'s ``stale_fingerprints`` and
    ``in_flight``, and whether the replicas' state fingerprints agree. ``close()`` after
    step ``close_after`` (as a checkpoint does) and at the end."""
    model = DistributedDataParallel(toy_model(opts.get("batchnorm", False)))
    optimizer: torch.optim.Optimizer = (torch.optim.SGD(model.parameters(), lr=0.05) if opts.get("sgd")
                                        else torch.optim.Adam(model.parameters(), lr=1e-2))
    protector = protect(model, optimizer, monitor=MonitorConfig(**opts.get("monitor", {})),
                        protect=ProtectConfig(**opts["protect"]), guard=GuardConfig(**opts.get("guard", {})),
                        inject=opts.get("inject", []), seed=3, recorder=RunRecorder(opts["run_dir"], rank, quiet=True))
    steps = []
    for step in range(opts["steps"]):
        r = protector.step(toy_closure(model, optimizer, rank, step))
        steps.append({"synced": r.synced, "applied": r.applied, "attempts": r.attempts,
                      "stale": protector.resync.stale_fingerprints, "in_flight": protector.resync.in_flight,
                      "agree": len(set(fingerprints_over_ranks(model, optimizer, buffers=False))) == 1})
        if step == opts.get("close_after"):
            protector.close()
    protector.close()
    return {"steps": steps, "fingerprint": state_fingerprint(model, optimizer, buffers=False),
            "counters": protector.resync.counters}


def column(out: list[dict[str, Any]], key: str) -> list[Any]:
    """The per-step ``key`` of :func:`protected_run`, the same on every rank."""
    values = [[s[key] for s in o["steps"]] for o in out]
    assert all(v == values[0] for v in values[1:]), key
    return values[0]


def steps_where(out: list[dict[str, Any]], key: str) -> list[int]:
    """The steps where :func:`protected_run`'s ``key`` is true."""
    return [step for step, value in enumerate(column(out, key)) if value]


def events(run_dir: Path, *keys: str) -> list[tuple[Any, ...]]:
    """events.jsonl's syncs, repairs and Dyn triggers, in the order written: (step,
    event, seen_from or None, then ``keys``)."""
    return [(e["step"], e["event"], e.get("seen_from"), *(e.get(k) for k in keys))
            for e in read_jsonl(run_dir / "events.jsonl") if e["event"] in ("sync", "repair", "dyn_trigger")]


@pytest.mark.parametrize("overlap", [True, False])
def test_seen_from_of_scheduled_overlapped_closed_and_repairing_syncs(tmp_path: Path, overlap: bool) -> None:
    """``seen_from``: the first step whose state fingerprints see a sync's result (what
    ``paft report`` plots it from). Period 3, overlapped: the sync started after step 3
    lands in close() between steps, so step 4's fingerprints see it; the one after
    step 6 lands in step 7, after step 7's fingerprints: seen from step 8; each is
    recorded at the step it started after. Blocking, each is seen from the next step.
    The sync after step 9 finds rank 1 corrupted at rest: a repair, blocking in
    either mode, seen from step 10, nothing left in flight."""
    out = run_workers(protected_run, 2, {
        "steps": 10, "close_after": 3, "run_dir": str(tmp_path), "monitor": {"fingerprint_every": 100},
        "protect": {"mode": "sync", "sync_period": 3, "overlap": overlap},
        "inject": ["bitflip:site=params,steps=9,ranks=1,bits=exponent,count=4"]})
    seen = (4, 8) if overlap else (4, 7)
    assert events(tmp_path, "mode") == [(3, "sync", seen[0], "noop"), (6, "sync", seen[1], "noop"),
                                        (9, "sync", 10, "median-with-reference")]
    # Overlapped, a step's report says synced where its sync lands: step 3's landed
    # between steps (close), step 6's in step 7.
    assert steps_where(out, "synced") == ([7, 9] if overlap else [3, 6, 9])
    assert steps_where(out, "in_flight") == ([3, 6] if overlap else [])
    assert not any(column(out, "stale"))  # no sync changed what a step's fingerprints saw
    assert all(column(out, "agree")) and out[0]["fingerprint"] == out[1]["fingerprint"]
    # The run's counters add up the syncs recorded (events.jsonl is rank 0's, whose bytes
    # differ from rank 1's: who sends what depends on the rank)
    sent = [e["bytes_sent"] for e in read_jsonl(tmp_path / "events.jsonl") if e["event"] == "sync"]
    assert out[0]["counters"] == {"syncs": 3, "sync_bytes": sum(sent)} and sent[2] > sent[0] > 0


def dyn_period(rank: int, world_size: int, config: ProtectConfig) -> int:
    """PAFT-Dyn's period as Resync sets it up from ``config``."""
    model = DistributedDataParallel(nn.Linear(2, 1))
    resync = Resync(model, torch.optim.SGD(model.parameters(), lr=0.1), config, guard=False,
                    recorder=RunRecorder(None, rank), replicas_agree=lambda: None)
    assert resync.scheduler is not None
    return resync.scheduler.period


def test_dyns_first_period_is_the_sync_period_within_its_bounds() -> None:
    """``--sync-period`` is PAFT-Dyn's first H, held to [h_min, h_max]: a period the
    fixed schedule accepts is no error for Dyn (its own config refuses an H outside)."""
    got = [run_workers(dyn_period, 1, ProtectConfig(mode="dyn", sync_period=period, h_min=4, h_max=16))[0]
           for period in (1, 8, 50)]
    assert got == [4, 8, 16]


def test_a_dyn_trigger_while_a_sync_is_in_flight_lands_it_then_syncs_blocking(tmp_path: Path) -> None:
    """The sync due after step 4 is in flight when step 5's all-reduce hands rank 1 a
    flipped bit (its checksum differs: PAFT-Dyn's trigger). The sync in flight lands
    first, before the update (recorded at step 4, seen from step 6); the trigger then
    halves H and syncs at once, blocking, never overlapped: also where the flip (bit 0,
    under SGD) left every replica's update the same and the sync finds nothing to
    repair. The exponent flip is repaired with the majority's bits: that run ends where
    the bit-0 run does, which no update of a replica ever left, the fault-free one."""
    runs = {}
    for bits, mode in (("0", "noop"), ("exponent", "majority-copy")):
        run_dir = tmp_path / bits
        runs[bits] = run_workers(protected_run, 3, {
            "steps": 6, "sgd": True, "run_dir": str(run_dir), "protect": {"mode": "dyn", "sync_period": 4, "h_min": 1},
            "inject": [f"bitflip:steps=5,ranks=1,bits={bits}"]})
        assert events(run_dir, "mode", "period") == [(4, "sync", 6, "noop", 4), (5, "dyn_trigger", None, None, 2),
                                                     (5, "sync", 6, mode, 2)], bits
        assert steps_where(runs[bits], "synced") == [5] and steps_where(runs[bits], "in_flight") == [4], bits
        assert all(column(runs[bits], "agree")), bits
    assert len({o["fingerprint"] for out in runs.values() for o in out}) == 1


def test_a_split_repaired_after_its_fingerprints_is_not_repaired_again(tmp_path: Path) -> None:
    """Rank 1's weights are corrupted at rest at step 5, persistently: the guard repairs
    them and recomputes (seen from step 5: the recompute fingerprints the repaired
    state), the fault strikes the recompute too, and at the rerun cap the guard repairs
    once more and skips the batch (seen from step 6: the step's fingerprints, which
    still show the split, predate it). Each repair is PAFT-Dyn's event (a trigger, H
    cut). After the step, the split those stale fingerprints show is no news: the state
    is looked at again and found repaired, so no third trigger and sync; nor does the
    monitor alert it. The stale flag lasts until the next step fingerprints afresh."""
    out = run_workers(protected_run, 2, {
        "steps": 7, "run_dir": str(tmp_path), "monitor": {"fingerprint_every": 1},
        "protect": {"mode": "dyn", "sync_period": 8, "h_min": 1},
        "guard": {"enabled": True, "max_reruns_per_step": 1},
        "inject": ["bitflip:site=params,steps=5,ranks=1,bits=exponent,count=4,persistent=true"]})
    assert events(tmp_path, "period") == [(5, "dyn_trigger", None, 4), (5, "sync", 5, 1), (5, "dyn_trigger", None, 1),
                                          (5, "sync", 6, 1), (6, "sync", 7, 1)]  # the last: due at 6, lands in close()
    assert [(s["applied"], s["attempts"]) for s in out[0]["steps"][5:]] == [(False, 2), (True, 1)]
    assert steps_where(out, "stale") == [5]
    assert not [e for e in read_jsonl(tmp_path / "events.jsonl") if e.get("detector") == "state_split"]
    assert all(column(out, "agree")) and out[0]["fingerprint"] == out[1]["fingerprint"]


def test_a_repair_lands_the_sync_in_flight_first(tmp_path: Path) -> None:
    """The sync due after step 4 is in flight when the guard finds rank 1 corrupted at
    rest in step 5. The sync lands before the repair (with ``--sync-mode mean`` the
    repair is the guard's own robust sync, which nothing else would stop from running
    first): recorded at step 4 and seen from step 6, then the repair, seen from step 5,
    whose recompute is the fault-free step: the replicas end bitwise as in the run
    without the fault. (Under the protector a sync left in flight found the replicas
    agreeing, so landing it moves no state: what its order decides is the record, and,
    with PAFT-Dyn, the schedule.)"""
    opts = {"steps": 6, "monitor": {"fingerprint_every": 1}, "guard": {"enabled": True},
            "protect": {"mode": "sync", "sync_period": 4, "sync_mode": "mean"}}
    clean = run_workers(protected_run, 3, {**opts, "run_dir": str(tmp_path / "clean")})
    out = run_workers(protected_run, 3, {**opts, "run_dir": str(tmp_path),
                                         "inject": ["bitflip:site=params,steps=5,ranks=1,bits=exponent,count=4"]})
    assert events(tmp_path, "mode") == [(4, "sync", 6, "noop"), (5, "repair", 5, "majority-copy")]
    assert out[0]["steps"][5]["attempts"] == 2 and steps_where(out, "synced") == [5]
    assert steps_where(out, "in_flight") == [4] and all(column(out, "agree"))
    assert [o["fingerprint"] for o in out] == [c["fingerprint"] for c in clean] == [clean[0]["fingerprint"]] * 3


@pytest.mark.parametrize("overlap", [True, False])
def test_a_buffers_only_sync_landing_mid_step_hides_no_split(tmp_path: Path, overlap: bool) -> None:
    """Every sync of a BatchNorm model moves buffers (each rank's running statistics
    differ). Overlapped, the one due after step 4 lands in step 5, after step 5's state
    fingerprints, which show rank 1's weights corrupted at rest in step 5. They leave
    the buffers out, and the sync moved nothing else (it found the weights agreeing):
    the split is real, and is alerted in step 5 as without overlap. Taken for a
    repaired one, it was never alerted at all (PAFT-Dyn repairs it in the same step)."""
    out = run_workers(protected_run, 2, {
        "steps": 6, "batchnorm": True, "run_dir": str(tmp_path), "monitor": {"fingerprint_every": 1},
        "protect": {"mode": "dyn", "sync_period": 4, "h_min": 1, "overlap": overlap},
        "inject": ["bitflip:site=params,steps=5,ranks=1,bits=exponent,count=4"]})
    alerts = [e for e in read_jsonl(tmp_path / "events.jsonl") if e.get("detector") == "state_split"]
    assert [e["step"] for e in alerts] == [5]
    assert events(tmp_path)[:3] == [(4, "sync", 6 if overlap else 5), (5, "dyn_trigger", None), (5, "sync", 6)]
    assert not any(column(out, "stale")) and all(column(out, "agree"))


def _leg(run_dir: Path, config: ProtectConfig, steps: range, saved: dict[str, Any] | None) -> dict[str, Any]:
    """A one-rank leg of a protected toy run recording into ``run_dir``: resumed from the
    protector state ``saved`` (primed, as paft train resumes) or fresh; its closed state."""
    model = DistributedDataParallel(toy_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    protector = protect(model, optimizer, protect=config,
                        recorder=RunRecorder(run_dir, 0, quiet=True, append=saved is not None))
    if saved is not None:
        protector.load_state_dict(saved)
    protector.prime(toy_closure(model, optimizer, 0, steps[0]))
    for step in steps:
        protector.step(toy_closure(model, optimizer, 0, step))
    protector.close()
    state = protector.state_dict()
    del protector, model
    return state


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("mode", ["dyn", "sync"])
def test_a_resume_that_changes_the_period_records_it_at_its_first_step(mode: str, tmp_path: Path) -> None:
    """A resume that clamps PAFT-Dyn's saved period into a new --h-max (or gives PAFT-Sync
    another --sync-period) recorded nothing: paft report drew the old period until the
    next sync, and the period the run began with from the rewritten config.json."""
    first = ProtectConfig(mode=mode, sync_period=6, h_min=1)
    saved = _leg(tmp_path, first, range(4), None)
    changed = dataclasses.replace(first, **({"h_max": 3} if mode == "dyn" else {"sync_period": 3}))
    _leg(tmp_path, changed, range(4, 8), saved)
    events = [(e["step"], e["event"], e.get("period"), e.get("first_period"))
              for e in read_jsonl(tmp_path / "events.jsonl")]
    # No sync before the resume (the first was due at step 6); the shorter period brought
    # it forward to the resumed run's first step, after the event.
    assert events == [(4, "period", 3, 6), (4, "sync", 3, None), (7, "sync", 3, None)]
    # A resume that changes nothing of the schedule records nothing, as the uninterrupted run.
    again = tmp_path / "again"
    _leg(again, first, range(4, 8), _leg(again, first, range(4), None))
    assert all(e["event"] != "period" for e in read_jsonl(again / "events.jsonl"))
    # A state saved before it kept the first period: the event says the new one alone (the
    # resume's options do not say what the run began with; paft report reads config.json).
    older = tmp_path / "older"
    saved = _leg(older, first, range(4), None)
    saved["scheduler"].pop("first_period")
    _leg(older, changed, range(4, 8), saved)
    assert [e for e in read_jsonl(older / "events.jsonl") if e["event"] == "period"] == [
        {"step": 4, "event": "period", "period": 3}]


@pytest.mark.usefixtures("one_rank_group")
def test_an_averager_resumed_with_another_period_records_it(tmp_path: Path) -> None:
    """PyTorch's averager records no event of its own: a resume with another --sync-period
    recorded nothing either, and paft report counted a run's averages before it at the
    rewritten config.json's period."""
    first = ProtectConfig(mode="averager", sync_period=6)
    changed = dataclasses.replace(first, sync_period=3)
    _leg(tmp_path, changed, range(8, 10), _leg(tmp_path, changed, range(4, 8), _leg(tmp_path, first, range(4), None)))
    # Each later resume says it too: config.json no longer says the period the run began with.
    assert [(e["step"], e["event"], e.get("period"), e.get("first_period"))
            for e in read_jsonl(tmp_path / "events.jsonl")] == [(4, "period", 3, 6), (8, "period", 3, 6)]
    again = tmp_path / "again"
    _leg(again, first, range(4, 8), _leg(again, first, range(4), None))
    assert not (again / "events.jsonl").exists() or not read_jsonl(again / "events.jsonl")
