"""Every fault kind at every site, under each defense, on real gloo ranks (protect() on the toy model).

One event each (rank 1, step 3 of 5; the state fingerprinted every step), checked for what
the README and docs/GUARD.md promise:

(i) the monitor alone reports the split at the step it happens, naming the rank where a
    strict majority exists (3 ranks) and only the groups where none does (2 ranks); a
    local-gradient fault splits nothing (every rank receives the same average);
(ii) PAFT-Dyn leaves the replicas bitwise identical, and where a majority exists an
    aggregation or optimizer-state fault leaves the fault-free run's bits;
(iii) the guard detects the harmful ones at the step (an aggregation fault always, a NaN/Inf
    everywhere, any fault at rest), recomputes a transient one to the fault-free bits, and
    repairs one at rest (the majority's bits; with two ranks identical replicas, the finite
    one where a replica holds NaN/Inf).

Then persistent faults under the guard (``repair`` skips the batch at the rerun cap,
``stop`` raises PersistentFaultError naming the rank), faults on every rank at once,
and PAFT-Sync's robust merge at 4 ranks with faults on 2 (a 2-2 or 2-1-1 split: the
coordinate-wise median; 3-1: the majority's bits), bursts and several elements at once.
The workers of one world size run every case in one group, so the sweep costs seconds.
"""

from __future__ import annotations

import math
import pathlib
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from paft.config import GuardConfig, MonitorConfig, ProtectConfig
from paft.faultspec import KINDS, SITES, FaultSpecError
from paft.protect import PersistentFaultError, protect
from paft.protect_test import toy_closure, toy_model
from paft.records import RunRecorder, read_jsonl
from paft.state import state_tensors
from paft.testing import run_workers

STEPS, FAULT_STEP = 5, 3
MODES: dict[str, dict[str, Any]] = {
    "monitor": {},
    "dyn": {"protect": {"mode": "dyn"}},
    "guard": {"guard": {"enabled": True, "warmup": 2}},
}
KEYS = ("replicas/grad_distinct", "replicas/grad_minority_ranks", "replicas/grad_groups", "replicas/state_distinct",
        "replicas/state_minority_ranks", "replicas/state_groups", "consistency/nonfinite_ranks")
PERSISTENT = {  # spec -> the detector that fires on it
    "bitflip:steps=3,bits=30,ranks=1,persistent=true": "grad_mismatch",
    "nan:site=local-grad,steps=3,ranks=1,persistent=true": "nonfinite_local_grad",
    "bitflip:site=params,steps=3,bits=30,ranks=1,persistent=true": "state_mismatch",
    "nan:site=optimizer-state,steps=3,ranks=1,persistent=true": "state_mismatch",
}
EVERY_RANK_KINDS = ("bitflip:bits=30", "nan")
REFUSED = {  # refused before training, each naming the field
    "stale:site=params,steps=3,count=2": "field 'count' does not apply to kind 'stale'",
    "scale:steps=3,bits=2": "field 'bits' applies only to kind 'bitflip'",
    "bitflip:steps=3,bits=40": "field 'bits' must be < 32 for float32",
    "zero:steps=3,ranks=7": "field 'ranks' names rank 7",
}


def state_bits(model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Parameters and optimizer state as one float64 vector: float32 values and Adam's step
    counts are exact in it, and its int64 view compares NaN by its bits."""
    return torch.cat([t.detach().reshape(-1).double() for _, t in state_tensors(model, optimizer, buffers=False)])


def run_case(rank: int, world_size: int, case: dict[str, Any]) -> dict[str, Any]:
    """Train the toy model for ``steps`` under ``case``'s settings; a PersistentFaultError is
    noted and the loop steps on with the next batch, as the README allows."""
    model = DistributedDataParallel(toy_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    recorder = RunRecorder(case["run_dir"], rank, quiet=True) if case.get("run_dir") else None
    try:
        protector = protect(model, optimizer, monitor=MonitorConfig(fingerprint_every=1, cosine="off"),
                            protect=ProtectConfig(**case.get("protect", {})),
                            guard=GuardConfig(**case.get("guard", {})), inject=case.get("inject", []),
                            recorder=recorder)
    except (ValueError, FaultSpecError) as err:
        return {"refused": str(err)}
    reports: list[dict[str, Any]] = []
    stops: list[tuple[int, list[int], str]] = []
    states: list[torch.Tensor] = []
    for step in range(case.get("steps", STEPS)):
        try:
            r = protector.step(toy_closure(model, optimizer, rank, step))
        except PersistentFaultError as err:
            stops.append((err.step, err.ranks, str(err)))
            continue
        reports.append({"step": r.step, "attempts": r.attempts, "applied": r.applied, "synced": r.synced,
                        "metrics": {k: r.metrics[k] for k in KEYS if k in r.metrics}})
        if case.get("keep_states"):
            states.append(state_bits(model, optimizer))
    protector.close()
    if recorder is not None:
        recorder.close()
    return {"state": state_bits(model, optimizer), "reports": reports, "stops": stops, "states": states}


def run_cases(rank: int, world_size: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [run_case(rank, world_size, case) for case in cases]


def identical(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int64), b.view(torch.int64))


class Sweep:
    """Every case of one world size, run once by the same workers; results by name."""

    def __init__(self, world_size: int, root: pathlib.Path) -> None:
        self.world_size = world_size
        self.root = root
        names: list[tuple[Any, ...]] = []
        cases: list[dict[str, Any]] = []

        def add(name: tuple[Any, ...], inject: list[str], settings: dict[str, Any]) -> None:
            names.append(name)
            cases.append(dict(settings, inject=inject, run_dir=str(root / f"case{len(cases)}")))

        every = "+".join(map(str, range(world_size)))
        for mode, settings in MODES.items():
            add(("clean", mode), [], settings)
            for kind in KINDS:
                for site in SITES:
                    add(("one", mode, kind, site), [f"{kind}:site={site},steps={FAULT_STEP},ranks=1"], settings)
            for kind in EVERY_RANK_KINDS:
                for site in SITES:
                    name, _, extra = kind.partition(":")
                    spec = f"{name}:site={site},steps={FAULT_STEP},ranks={every}" + (f",{extra}" if extra else "")
                    add(("every", mode, name, site), [spec], settings)
        for policy in ("repair", "stop"):
            for spec in PERSISTENT:
                add(("persistent", policy, spec), [spec], {"guard": {"enabled": True, "warmup": 2,
                                                                     "on_persistent": policy}})
        guard_dyn = dict(MODES["guard"], **MODES["dyn"])
        add(("clean", "guard+dyn"), [], guard_dyn)
        add(("guard+dyn", "params"), [f"bitflip:site=params,steps={FAULT_STEP},bits=30,ranks=1"], guard_dyn)
        add(("burst", "random"), ["bitflip:steps=1,burst=3,bits=30,ranks=random"], MODES["guard"])
        # A fault that has nothing to hit at step 0 (no optimizer state yet, no previous result).
        add(("nothing", "optimizer-state"), ["zero:site=optimizer-state,steps=0"], MODES["guard"])
        add(("nothing", "stale"), ["stale:steps=0"], MODES["guard"])
        for spec in REFUSED:
            add(("refused", spec), [spec], {})
        out = run_workers(run_cases, world_size, cases)
        self.results = {name: [per_rank[i] for per_rank in out] for i, name in enumerate(names)}
        self.dirs = {name: pathlib.Path(case["run_dir"]) for name, case in zip(names, cases)}

    def __getitem__(self, name: tuple[Any, ...]) -> list[dict[str, Any]]:
        return self.results[name]

    def records(self, name: tuple[Any, ...], file: str) -> list[dict[str, Any]]:
        path = self.dirs[name] / file
        return read_jsonl(path) if path.exists() else []

    def guard_events(self, name: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        return [(e["step"], e["attempt"], e["detector"], e["ranks"], e["action"], e["cause"])
                for e in self.records(name, "events.jsonl") if e["event"] == "guard"]


_SWEEPS: dict[int, Sweep] = {}


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def sweep(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Sweep:
    ws = request.param
    if ws not in _SWEEPS:
        _SWEEPS[ws] = Sweep(ws, tmp_path_factory.mktemp(f"faults{ws}"))
    return _SWEEPS[ws]


def all_identical(results: list[dict[str, Any]]) -> bool:
    return all(identical(results[0]["state"], r["state"]) for r in results)


def fault_free(results: list[dict[str, Any]], clean: list[dict[str, Any]]) -> bool:
    return all(identical(r["state"], c["state"]) for r, c in zip(results, clean))


def step_metrics(results: list[dict[str, Any]], step: int) -> dict[str, Any]:
    (report,) = [r for r in results[0]["reports"] if r["step"] == step]
    return report["metrics"]


def split_named(sweep: Sweep) -> tuple[list[int], list[list[int]]]:
    """The minority and the groups the monitor reports for a split with rank 1 the odd one out."""
    if sweep.world_size == 2:
        return [], [[0], [1]]  # no majority: no rank named, the groups given
    return [1], [[0, 2], [1]]


@pytest.mark.parametrize("site", SITES)
def test_one_fault_of_each_kind_is_recorded_and_the_monitor_reports_its_split(sweep: Sweep, site: str) -> None:
    for kind in KINDS:
        for mode in MODES:
            name = ("one", mode, kind, site)
            faults = [(f["step"], f["attempt"], f["rank"], f["site"], f["kind"])
                      for f in sweep.records(name, "faults.jsonl")]
            assert faults == [(FAULT_STEP, 0, 1, site, kind)], name  # transient: not again on a recompute
        results = sweep[("one", "monitor", kind, site)]
        m = step_metrics(results, FAULT_STEP)
        minority, groups = split_named(sweep)
        if site == "aggregation":  # the aggregated gradients differ at the step
            assert (m["replicas/grad_distinct"], m["replicas/grad_minority_ranks"], m["replicas/grad_groups"]) == (
                2, minority, groups), kind
        elif site == "local-grad":  # every rank receives the same average: nothing splits
            assert m.get("replicas/grad_distinct", 1) == 1 and m.get("replicas/state_distinct", 1) == 1, kind
            assert m.get("consistency/nonfinite_ranks", []) == ([1] if kind in ("nan", "inf") else []), kind
            assert all_identical(results), kind
        else:  # at rest: the state fingerprints of this very step differ
            assert (m["replicas/state_distinct"], m["replicas/state_minority_ranks"], m["replicas/state_groups"]) == (
                2, minority, groups), kind
            assert m["replicas/grad_distinct"] == 1, kind


@pytest.mark.parametrize("site", SITES)
def test_dyn_leaves_identical_replicas_after_any_fault(sweep: Sweep, site: str) -> None:
    clean = sweep[("clean", "dyn")]
    for kind in KINDS:
        results = sweep[("one", "dyn", kind, site)]
        assert all_identical(results), kind
        if sweep.world_size >= 3 and site in ("aggregation", "optimizer-state"):
            # The majority's bits, before the next forward: the fault-free trajectory.
            assert fault_free(results, clean), kind
        if site == "params" and kind in ("nan", "inf"):
            # A parameter hit at rest already fed this step's forward on its rank, so DDP's
            # all-reduce carried the NaN into every replica's update (the README says so):
            # identical, but non-finite. The guard recomputes the step instead (below).
            assert not bool(torch.isfinite(results[0]["state"]).all()), kind


@pytest.mark.parametrize("site", SITES)
def test_the_guard_detects_recomputes_and_repairs_each_kind(sweep: Sweep, site: str) -> None:
    clean = sweep[("clean", "guard")]
    for kind in KINDS:
        name = ("one", "guard", kind, site)
        results = sweep[name]
        events = sweep.guard_events(name)
        attempts = [r["attempts"] for r in results[0]["reports"]]
        assert all_identical(results), kind
        assert bool(torch.isfinite(results[0]["state"]).all()), kind
        nonfinite = kind in ("nan", "inf")
        if site == "local-grad" and not nonfinite:
            # One finite element of one rank's gradient, during the warm-up: not harmful enough
            # to fire (only 1e4x jumps do); every rank applies the same average.
            assert attempts == [1] * STEPS and events == [], kind
            continue
        assert attempts == [1, 1, 1, 2, 1], kind
        named = [1] if sweep.world_size >= 3 or nonfinite and site in ("aggregation", "local-grad") else []
        if site in ("aggregation", "local-grad"):
            detector = ("nonfinite_agg_grad" if site == "aggregation" else "nonfinite_local_grad") if nonfinite \
                else "grad_mismatch"
            assert events == [(FAULT_STEP, 0, detector, named, "recompute", None),
                              (FAULT_STEP, 1, detector, named, "proceed", "transient")], kind
            assert fault_free(results, clean), kind  # the recompute is the fault-free step, bit for bit
        else:
            assert events == [(FAULT_STEP, 0, "state_mismatch", named, "repair", "state"),
                              (FAULT_STEP, 1, "state_mismatch", named, "proceed", "state")], kind
            assert [e["step"] for e in sweep.records(name, "events.jsonl") if e["event"] == "repair"] == [FAULT_STEP]
            if sweep.world_size >= 3 or nonfinite:  # the majority's bits, or the finite replica's
                assert fault_free(results, clean), kind


@pytest.mark.parametrize("policy", ["repair", "stop"])
@pytest.mark.parametrize("spec", PERSISTENT)
def test_a_persistent_fault_is_named_and_skipped_or_stops(sweep: Sweep, policy: str, spec: str) -> None:
    name = ("persistent", policy, spec)
    results = sweep[name]
    detector = PERSISTENT[spec]
    at_rest = detector == "state_mismatch"  # repaired first, then recomputed
    named = [] if at_rest and sweep.world_size == 2 else [1]  # two ranks: a state split names no one
    faults = [(f["step"], f["attempt"], f["rank"]) for f in sweep.records(name, "faults.jsonl")]
    events = sweep.guard_events(name)
    again = "repair" if at_rest else "recompute"
    assert events[0] == (FAULT_STEP, 0, detector, named, again, "state" if at_rest else None)
    assert events[1] == (FAULT_STEP, 1, detector, named, "stop" if policy == "stop" else again, "persistent")
    if policy == "repair":
        assert faults == [(FAULT_STEP, a, 1) for a in range(3)]  # again on each of the 2 recomputes
        assert events[2][:2] == (FAULT_STEP, 2) and events[2][3:] == (named, "skip", "persistent")
        report = results[0]["reports"][FAULT_STEP]
        assert (report["attempts"], report["applied"]) == (3, False)  # the batch skipped on every rank
        assert all(r["stops"] == [] for r in results)
    else:
        assert faults == [(FAULT_STEP, 0, 1), (FAULT_STEP, 1, 1)]
        for r in results:  # every rank raises, naming the rank where the values tell it
            ((step, ranks, message),) = r["stops"]
            assert (step, ranks) == (FAULT_STEP, named)
            assert message.startswith(f"step {FAULT_STEP}: ") and "on_persistent='stop'" in message
        if at_rest:  # the replicas left split are repaired by the next step's check
            assert events[2:] == [(FAULT_STEP + 1, 0, "state_mismatch", named, "repair", "state"),
                                  (FAULT_STEP + 1, 1, "state_mismatch", named, "proceed", "state")]
    assert all_identical(results)
    assert bool(torch.isfinite(results[0]["state"]).all())


@pytest.mark.parametrize("site", SITES)
def test_a_fault_on_every_rank_at_once_is_reported_and_survived(sweep: Sweep, site: str) -> None:
    ws = sweep.world_size
    singles = [[r] for r in range(ws)]
    for kind in ("bitflip", "nan"):
        for mode in MODES:
            name = ("every", mode, kind, site)
            results = sweep[name]
            assert len(results[0]["reports"]) == STEPS, name
            faults = sorted((f["step"], f["rank"]) for f in sweep.records(name, "faults.jsonl"))
            assert faults == [(FAULT_STEP, r) for r in range(ws)], name
        m = step_metrics(sweep[("every", "monitor", kind, site)], FAULT_STEP)
        if site == "aggregation":  # each rank its own aggregate: no majority, no rank named
            assert (m["replicas/grad_distinct"], m["replicas/grad_minority_ranks"], m["replicas/grad_groups"]) == (
                ws, [], singles), kind
        elif site == "local-grad":
            assert m["replicas/grad_distinct"] == 1, kind  # the same corrupted average everywhere
            if kind == "nan":
                assert m["consistency/nonfinite_ranks"] == list(range(ws))
        else:
            assert (m["replicas/state_distinct"], m["replicas/state_minority_ranks"], m["replicas/state_groups"]) == (
                ws, [], singles), kind
        dyn = sweep[("every", "dyn", kind, site)]
        assert all_identical(dyn), kind
        if site in ("aggregation", "optimizer-state"):  # merged before the next forward: nothing spreads
            assert bool(torch.isfinite(dyn[0]["state"]).all()), kind
        guarded = ("every", "guard", kind, site)
        assert all_identical(sweep[guarded]) and bool(torch.isfinite(sweep[guarded][0]["state"]).all()), kind
        events = sweep.guard_events(guarded)
        assert events[0][:2] == (FAULT_STEP, 0) and events[-1][4] == "proceed", kind
        if site in ("aggregation", "local-grad"):  # transient everywhere: the recompute is the fault-free step
            assert fault_free(sweep[guarded], sweep[("clean", "guard")]), kind


def test_the_guard_with_dyn_and_a_random_ranks_burst(sweep: Sweep) -> None:
    # The guard's state repair comes first and counts as PAFT-Dyn's trigger (README).
    name = ("guard+dyn", "params")
    events = [(e["event"], e["step"]) for e in sweep.records(name, "events.jsonl") if e["event"] != "alert"]
    assert events == [("guard", FAULT_STEP), ("dyn_trigger", FAULT_STEP), ("sync", FAULT_STEP), ("guard", FAULT_STEP)]
    assert all_identical(sweep[name])
    if sweep.world_size >= 3:
        assert fault_free(sweep[name], sweep[("clean", "guard+dyn")])
    # ranks=random: one rank per event, the same for the whole burst; each step recomputed.
    burst = ("burst", "random")
    faults = [(f["step"], f["attempt"], f["rank"]) for f in sweep.records(burst, "faults.jsonl")]
    assert [(s, a) for s, a, _ in faults] == [(1, 0), (2, 0), (3, 0)] and len({r for _, _, r in faults}) == 1
    assert [r["attempts"] for r in sweep[burst][0]["reports"]] == [1, 2, 2, 2, 1]
    assert fault_free(sweep[burst], sweep[("clean", "guard")])


def test_what_has_nothing_to_hit_is_not_recorded_and_bad_specs_are_refused(sweep: Sweep) -> None:
    clean = sweep[("clean", "guard")]
    for what in ("optimizer-state", "stale"):
        assert sweep.records(("nothing", what), "faults.jsonl") == []
        assert fault_free(sweep[("nothing", what)], clean)
    for spec, message in REFUSED.items():
        refusals = [r.get("refused", "") for r in sweep[("refused", spec)]]
        assert all(message in text for text in refusals), (spec, refusals)


# -- PAFT-Sync's robust merge at 4 ranks, faults on 2 of them ---------------------------------------

SYNC_PERIOD = 5
SPLITS = {  # spec -> the groups of the aggregated gradients while it fires
    # Identical corruption on ranks 1 and 2: a 2-2 split, no strict majority.
    "zero:fraction=1,ranks=1+2,steps=3,burst=3": [[0, 3], [1, 2]],
    "stale:ranks=1+2,steps=3,burst=3": [[0, 3], [1, 2]],
    # Each rank its own elements: 2-1-1.
    "bitflip:count=3,bits=exponent,ranks=1+2,steps=3,burst=3": [[0, 3], [1], [2]],
    "noise:fraction=0.5,sigma=2,ranks=1+2,steps=4,burst=2": [[0, 3], [1], [2]],
    # NaN/Inf on two ranks at the sync's own step (a step later DDP's all-reduce would
    # carry it into every replica before any fixed-period sync).
    "nan:fraction=1,ranks=1+2,steps=5": [[0, 3], [1, 2]],
    "inf:count=2,ranks=1+2,steps=5": [[0, 3], [1], [2]],
    # One rank: 3-1, the majority's bits.
    "scale:count=5,factor=-1e4,ranks=1,steps=3,burst=3": [[0, 2, 3], [1]],
}
DYN_BURSTS = ["nan:fraction=0.25,ranks=1+2,steps=3,burst=3", "inf:count=3,ranks=1+2,steps=3,burst=3"]
# Two faulty ranks of four pull the ranks' median along: the guard names the ranks whose own
# gradient norm moved on the recompute (docs/GUARD.md, persistent).
TWO_OF_FOUR = "scale:site=local-grad,steps=3,ranks=1+2,count=3,factor=1e8,persistent=true"


def even_median(rows: torch.Tensor) -> torch.Tensor:
    """The README's merge without a majority, for an even number of replicas: per
    coordinate, of the two middle values the one of smaller magnitude, NaN counting as +inf."""
    ordered = torch.where(torch.isnan(rows), math.inf, rows).sort(0).values
    lo, hi = ordered[rows.shape[0] // 2 - 1], ordered[rows.shape[0] // 2]
    return torch.where(hi.abs() < lo.abs(), hi, lo)


def test_robust_sync_at_four_ranks_takes_the_median_without_a_majority_and_spreads_no_nan() -> None:
    cases = []
    for spec in SPLITS:
        cases.append({"inject": [spec], "keep_states": True, "steps": 7})  # the replicas before the sync
        cases.append({"inject": [spec], "keep_states": True, "steps": 7,
                      "protect": {"mode": "sync", "sync_period": SYNC_PERIOD}})
    cases += [{"inject": [spec], "steps": 7, "protect": {"mode": "dyn"}} for spec in DYN_BURSTS]
    cases.append({"inject": [TWO_OF_FOUR], "guard": {"enabled": True, "warmup": 2, "on_persistent": "stop"}})
    out = run_workers(run_cases, 4, cases)
    for r in out:
        ((step, ranks, _),) = r[-1]["stops"]
        assert (step, ranks) == (FAULT_STEP, [1, 2])
    for i, (spec, groups) in enumerate(SPLITS.items()):
        unsynced, synced = [r[2 * i] for r in out], [r[2 * i + 1] for r in out]
        fired = [(r["step"], r["metrics"]["replicas/grad_groups"], r["metrics"]["replicas/grad_minority_ranks"])
                 for r in synced[0]["reports"] if r["metrics"].get("replicas/grad_distinct", 1) > 1]
        first = FAULT_STEP + (1 if "steps=4" in spec else 0) if "steps=5" not in spec else SYNC_PERIOD
        assert fired == [(s, groups, [1] if len(groups[0]) == 3 else []) for s in range(first, SYNC_PERIOD + 1)], spec
        assert [r["synced"] for r in synced[0]["reports"]] == [s == SYNC_PERIOD for s in range(7)], spec
        before = torch.stack([r["states"][SYNC_PERIOD] for r in unsynced])
        expected = before[0] if len(groups[0]) == 3 else even_median(before)
        for r in synced:
            assert identical(r["states"][SYNC_PERIOD], expected), spec
            assert bool(torch.isfinite(r["state"]).all()), spec
        assert all_identical(synced), spec
    for j, spec in enumerate(DYN_BURSTS):  # PAFT-Dyn merges at every step of the burst: no NaN reaches a forward
        dyn = [r[2 * len(SPLITS) + j] for r in out]
        assert [r["synced"] for r in dyn[0]["reports"]] == [s in (3, 4, 5) for s in range(7)], spec
        assert all_identical(dyn) and bool(torch.isfinite(dyn[0]["state"]).all()), spec
