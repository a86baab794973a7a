"""``paft bench``: schedules, the desync / detection analyses, and real runs through the CLI.

The schedule and analysis tests are pure logic (synthetic run directories, ms).
The matrix, overhead, desync and detection tests launch real gloo workers through
``paft.cli.main`` on tiny settings (seconds each on 2 cores).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import pathlib
import struct
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import pytest
import torch
import torch.distributed as dist

from paft.bench import desync, detection, matrix, overhead, runner, scaling
from paft.bench.runner import (
    Run,
    alternate,
    make_config,
    markdown_table,
    run_all,
    throughput_ratios,
    trailing_mean,
)
from paft.cli import main
from paft.config import TrainConfig
from paft.consistency import HEADER
from paft.records import read_jsonl
from paft.rundata import mean_local_loss, read_metrics

# The results committed under docs/results, which the README quotes.
RESULTS = pathlib.Path(__file__).resolve().parents[3] / "docs" / "results"


def assert_no_stale_keys(benchmark: str, fresh: dict[str, Any]) -> None:
    """The committed ``docs/results/<benchmark>/results.json`` holds no key, at its top or
    in its rows, that the benchmark no longer writes: a reader takes such a leftover for
    a measurement of the current code. (Keys added since may be missing from it.)"""
    committed = json.loads((RESULTS / benchmark / "results.json").read_text())
    assert set(committed) - set(fresh) == set()
    assert {k for r in committed["rows"] for k in r} - {k for r in fresh["rows"] for k in r} == set()


# -- (a) schedules -------------------------------------------------------------------------


def test_alternate_exact_schedule() -> None:
    assert alternate("R", ["a", "b", "c", "d", "e"]) == ["R", "a", "b", "R", "c", "d", "R", "e", "R"]
    assert alternate("R", ["a", "b", "c", "d"], every=3) == ["R", "a", "b", "c", "R", "d", "R"]
    assert alternate("R", ["a", "b"], every=1) == ["R", "a", "R", "b", "R"]
    assert alternate("R", []) == ["R"]


def test_loss_curves_are_the_mean_of_every_ranks_own_loss(tmp_path: pathlib.Path) -> None:
    # A record's "loss" is the ranks' mean only where the monitor gathered it: the
    # curves compare runs with and without it, so they average "local_loss" themselves.
    (tmp_path / "metrics").mkdir()
    for rank, losses in enumerate([[4.0, 3.0], [2.0, 1.0], [3.0, 8.0]]):
        lines = [json.dumps({"step": s, "loss": 99.0, "local_loss": v}) for s, v in enumerate(losses)]
        (tmp_path / "metrics" / f"rank{rank}.jsonl").write_text("\n".join(lines) + "\n")
    assert mean_local_loss(read_metrics(tmp_path)) == ([0, 1], [3.0, 4.0])
    # A value that is no number is a gap in the curve (NaN), not an error that loses the plot.
    (tmp_path / "metrics" / "rank1.jsonl").write_text('{"step": 0, "loss": 1.0, "local_loss": null}\n'
                                                      '{"step": 1, "loss": 1.0, "local_loss": 1.0}\n')
    steps, losses = mean_local_loss(read_metrics(tmp_path))
    assert steps == [0, 1] and math.isnan(losses[0]) and losses[1] == 4.0


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 7])
def test_alternate_properties(n: int, every: int) -> None:
    names = [f"v{i}" for i in range(n)]
    schedule = alternate("R", names, every=every)
    assert schedule[0] == "R" and schedule[-1] == "R"
    assert [s for s in schedule if s != "R"] == names  # every run once, in order
    # The reference comes back after every `every` runs: never more than `every` in a row.
    run_length = 0
    for s in schedule:
        run_length = 0 if s == "R" else run_length + 1
        assert run_length <= every
    # With every <= 2, each run sits next to a reference run.
    for i, s in enumerate(schedule):
        if s != "R":
            assert "R" in (schedule[i - 1], schedule[i + 1])


def test_alternate_rejects_every_below_one() -> None:
    with pytest.raises(ValueError, match="every"):
        alternate("R", ["a"], every=0)


def test_throughput_ratios_uses_nearest_references_on_each_side() -> None:
    schedule = ["R", "a", "b", "R", "c", "R", "a"]
    rates = [10.0, 5.0, 45.0, 20.0, 30.0, 40.0, 8.0]
    ratios = throughput_ratios(schedule, rates, "R")
    # a, b: between R=10 and R=20 -> 15; c: between R=20 and R=40 -> 30; the last a: only R=40 before it.
    assert ratios == {"a": [5.0 / 15.0, 8.0 / 40.0], "b": [3.0], "c": [1.0]}


def test_throughput_ratios_rejects_bad_schedules() -> None:
    with pytest.raises(ValueError, match="never runs the reference"):
        throughput_ratios(["a", "b"], [1.0, 2.0], "R")
    with pytest.raises(ValueError, match="length"):
        throughput_ratios(["R", "a"], [1.0], "R")


def test_trailing_mean_skips_non_finite_values_and_looks_back_k_points() -> None:
    nan = math.nan
    out = trailing_mean([nan, 1.0, nan, 3.0, 5.0, 8.0], 3)
    assert math.isnan(out[0])  # nothing finite yet
    assert out[1:] == [1.0, 1.0, 2.0, 4.0, 16.0 / 3]
    # An infinite loss (a blown-up replica) is skipped like NaN, not averaged into inf.
    assert trailing_mean([1.0, math.inf, 3.0, -math.inf], 2) == [1.0, 1.0, 3.0, 3.0]


def test_markdown_table_formats_floats_to_four_digits_and_nan_as_na() -> None:
    assert markdown_table(["a", "b"], [[1, 2.345678], ["x", math.nan]]) == (
        "| a | b |\n|---|---|\n| 1 | 2.346 |\n| x | n/a |")


def test_run_all_gives_each_run_rank_0s_summary(monkeypatch: pytest.MonkeyPatch) -> None:
    # Step rates and wall times are each rank's own: the summary is rank 0's, as its
    # state fingerprint is (a mutant that read another rank's survived).
    monkeypatch.setattr(runner, "run_on_workers", lambda entry, world_size, configs, names: {
        r: [{"rank": r, "run": name} for name in names] for r in range(world_size)})
    runs = [Run("a", {}), Run("b", {})]
    run_all(runs, world_size=3)
    assert [r.summary for r in runs] == [{"rank": 0, "run": "a"}, {"rank": 0, "run": "b"}]


def test_make_config_merges_sections_but_replaces_the_model(tmp_path: pathlib.Path) -> None:
    base = TrainConfig(workload="gpt", world_size=2, batch_size=8, model={"n_layer": 1}).to_dict()
    cfg = make_config(base, tmp_path / "r", workload="resnet", model={"depth": 8}, monitor={"interval": 5})
    assert cfg["model"] == {"depth": 8}  # another workload's keys: the model is not merged
    assert cfg["monitor"] == {**base["monitor"], "interval": 5}
    assert (cfg["run_dir"], cfg["quiet"], cfg["workload"]) == (str(tmp_path / "r"), True, "resnet")


# -- paired-step overhead, from synthetic per-rank step times ---------------------------------


# Per rank, per variant: wall and CPU seconds of 5 timed steps (one per block).
_RANK_TIMES = [
    {"plain": {"wall": [1.0, 2.0, 2.0, 4.0, 1.0], "cpu": [1.0] * 5},
     "monitor": {"wall": [3.0, 2.0, 1.0, 4.0, 3.0], "cpu": [3.0] * 5}},
    {"plain": {"wall": [2.0, 1.0, 2.0, 2.0, 1.0], "cpu": [2.0] * 5},
     "monitor": {"wall": [1.0, 4.0, 2.0, 4.0, 2.0], "cpu": [4.0] * 5}},
]


def _fake_run_on_workers(calls: list[tuple[Any, ...]]) -> Any:
    def run_on_workers(entry: Any, world_size: int, *args: Any) -> dict[int, Any]:
        calls.append((entry, world_size, *args))
        return {r: {"times": t, "parameters": 1234} for r, t in enumerate(_RANK_TIMES[:world_size])}
    return run_on_workers


def test_overhead_measure_compares_summed_paired_steps(tmp_path: pathlib.Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []
    monkeypatch.setattr(overhead, "run_on_workers", _fake_run_on_workers(calls))
    base = TrainConfig(workload="resnet", world_size=2, batch_size=8, steps=5).to_dict()
    costs = overhead.measure(tmp_path, base, ["monitor"], steps=5, world_size=2, warmup=3)
    (_, world_size, configs, steps, warmup), = calls
    assert (world_size, steps, warmup) == (2, 5, 3)
    assert list(configs) == ["plain", "monitor"]  # plain DDP added, first
    assert configs["plain"]["monitor"]["enabled"] is False and configs["monitor"]["monitor"]["enabled"] is True
    # A step's wall time is the slowest rank's: plain [2, 2, 2, 4, 1], monitor [3, 4, 2, 4, 3];
    # its CPU time the mean over ranks: plain 1.5, monitor 3.5 every step.
    assert costs["plain"] == {"wall_ms": 2000.0, "cpu_ms": 1500.0, "parameters": 1234}  # medians
    monitor = costs["monitor"]
    assert monitor["wall"] == 16 / 11  # sums, not a mean of per-step ratios (1.7 here)
    assert monitor["wall_blocks"] == [1.5, 2.0, 1.0, 1.0, 3.0]
    assert monitor["wall_median_extra_ms"] == 1000.0  # median of [1, 2, 0, 0, 2] s
    assert monitor["cpu"] == pytest.approx(7 / 3, rel=1e-15)
    assert monitor["cpu_blocks"] == pytest.approx([7 / 3] * 5, rel=1e-15)
    # Naming plain among the variants changes nothing: it is the reference, not a variant.
    assert overhead.measure(tmp_path, base, ["plain", "monitor"], steps=5, world_size=2, warmup=3) == costs


@pytest.mark.parametrize("names", [["plain"], ["plain", "monitor"], ["plain", "monitor", "guard", "dyn"]])
def test_overhead_round_order_puts_every_variant_in_every_position_equally_often(names: list[str]) -> None:
    orders = [overhead._round_order(names, i) for i in range(3 * len(names))]
    assert orders[0] == names  # the first round in the given order
    assert all(sorted(o) == sorted(names) for o in orders)  # each variant once per round
    for start in range(len(names)):  # any len(names) consecutive rounds: each position once
        window = orders[start: start + len(names)]
        for position in range(len(names)):
            assert sorted(o[position] for o in window) == sorted(names)
    # rotated by one each round, so deterministic: the same round, the same order
    assert all(o[1:] + o[:1] == nxt for o, nxt in zip(orders, orders[1:]))
    assert [overhead._round_order(names, i) for i in range(3 * len(names))] == orders


def test_overhead_worker_steps_the_variants_in_the_rotating_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker itself (trainers and the process group faked): each round steps every
    trainer once, in _round_order's order, warm-up rounds included; only the timed
    steps are recorded. The trainers are gone before the group is taken down: left to
    outlive it, a rank aborted now and then ('Resource deadlock avoided', a clean-clone
    run's scaling and overhead tests)."""
    stepped: list[str] = []
    alive: weakref.WeakSet[Any] = weakref.WeakSet()
    at_teardown: list[int] = []

    class FakeTrainer:
        def __init__(self, name: str) -> None:
            alive.add(self)
            self.name, self.device = name, torch.device("cpu")
            self.model = torch.nn.Linear(2, 3)
            self.protector = type("Protector", (), {"close": lambda _: None})()

        def prime(self) -> None:
            pass

        def train_step(self) -> None:
            stepped.append(self.name)

    @contextlib.contextmanager
    def group(cfg: dict[str, Any]) -> Iterator[None]:
        yield
        at_teardown.append(len(alive))

    monkeypatch.setattr(overhead, "worker_group", group)
    monkeypatch.setattr(overhead, "new_trainer", lambda cfg: FakeTrainer(cfg["name"]))
    monkeypatch.setattr(dist, "barrier", lambda: None)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    names = ["plain", "monitor", "guard"]
    out = overhead._paired_worker({n: {"name": n} for n in names}, 4, 2)
    assert stepped == [n for i in range(6) for n in overhead._round_order(names, i)]
    assert stepped[:6] == ["plain", "monitor", "guard", "monitor", "guard", "plain"]
    assert {n: (len(t["wall"]), len(t["cpu"])) for n, t in out["times"].items()} == {n: (4, 4) for n in names}
    assert out["parameters"] == 9
    # Gone before the group: a DDP model's reducer holds it (paft.launch.take_group_down).
    assert at_teardown == [0]


def test_overhead_block_range_is_the_lowest_to_the_highest_block() -> None:
    assert overhead.block_range([1.025, 0.98, 1.1, 1.0]) == "-2.0 to +10.0"


def test_overhead_table_states_the_measured_costs(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(overhead, "run_on_workers", _fake_run_on_workers([]))
    out = tmp_path / "overhead"
    out.mkdir()
    results = overhead.run(out, steps=5, warmup=0, world_size=2, batch_size=8, variants=["monitor"],
                           workload="resnet")
    assert json.loads((out / "results.json").read_text())["costs"] == results["costs"]
    md = (out / "results.md").read_text()
    # overhead %, range over blocks, median step overhead % (1000 ms over plain's 2000 ms median
    # step), throughput = 1 / the time ratio, CPU overhead %, its range.
    assert "| monitor | 45.45 | +0.0 to +200.0 | 50 | 0.6875 | 133.3 | +133.3 to +133.3 |" in md
    assert "plain DDP: 2000.0 ms per step (wall, slowest rank), 1500.0 ms CPU" in md
    assert "(0.00 M parameters)" in md and "5 paired steps per variant after 0 untimed" in md
    assert capsys.readouterr().out.endswith(md.split("\n", 2)[2])  # the console's note and table, a line between


@pytest.mark.parametrize("period,said", [
    (20, "sync period 20 (PAFT-Dyn starts at H 20, within [5, 400], and adapts it);"),
    (2, "sync period 2 (PAFT-Dyn starts at H 5, within [5, 400], and adapts it);"),  # held to h_min
])
def test_overhead_note_says_the_period_paft_dyn_starts_at(period: int, said: str, tmp_path: pathlib.Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    def measure(runs_dir: pathlib.Path, base: dict[str, Any], variants: list[str], **_: Any) -> dict[str, Any]:
        same = {"wall": 1.0, "wall_blocks": [1.0] * 5, "wall_median_extra_ms": 0.0, "cpu": 1.0, "cpu_blocks": [1.0] * 5}
        return {"plain": {"wall_ms": 1.0, "cpu_ms": 1.0, "parameters": 1}, **{v: same for v in variants}}

    monkeypatch.setattr(overhead, "measure", measure)
    results = overhead.run(tmp_path, steps=5, warmup=0, world_size=2, batch_size=8, variants=["dyn", "sync"],
                           workload="resnet", period=period)
    assert said in results["note"]
    # Without a PAFT-Dyn variant the period is the one every variant runs at.
    results = overhead.run(tmp_path, steps=5, warmup=0, world_size=2, batch_size=8, variants=["sync"],
                           workload="resnet", period=period)
    assert f"sync period {period};" in results["note"]


# -- the matrix's rows, from synthetic run summaries -------------------------------------------


def test_matrix_fault_settings_are_the_documented_grid() -> None:
    every = tuple(matrix.SCENARIOS)
    agg = "bitflip:site=aggregation,rate={},bits={},ranks=1"
    assert matrix.fault_settings(False) == {
        **{f"agg-{b}-{r}": (agg.format(r, b), every)
           for b in ("exponent", "mantissa") for r in ("0.001", "0.01", "0.1")},
        "local-exponent-0.02": ("bitflip:site=local-grad,rate=0.02,bits=exponent,ranks=1", matrix.GUARD_SCENARIOS),
    }
    assert matrix.fault_settings(True) == {
        "agg-exponent-0.1": (agg.format("0.1", "exponent"), every),
        "local-exponent-0.1": ("bitflip:site=local-grad,rate=0.1,bits=exponent,ranks=1", matrix.GUARD_SCENARIOS),
    }


def test_matrix_rows_compare_each_run_with_its_neighbouring_references(tmp_path: pathlib.Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    runs = matrix.plan(tmp_path, ["resnet"], True, 6, 2)
    # --quick: R, agg x (unprotected, averager, paft-sync), R, agg x (paft-dyn, guard, dyn+guard), R,
    # local x (unprotected, guard, dyn+guard), R; the references at 10, 20, 40, 80 steps/s.
    assert [r.labels["scenario"] for r in runs].count(matrix.REFERENCE) == 4
    ref_rates = iter([10.0, 20.0, 40.0, 80.0])
    special = {
        "resnet/agg-exponent-0.1/unprotected": {"steps_per_s": 12.0},  # next to 10 and 20
        "resnet/agg-exponent-0.1/guard": {  # next to 20 and 40
            "steps_per_s": 24.0, "final_val_loss": 2.2, "final_val_loss_max": 3.0, "max_replica_rel_diff_run": 0.25,
            "max_replica_rel_diff": 0.125, "replicas_distinct": 2, "syncs": 4, "sync_bytes": 3 * 2**20,
            "detections": 5, "recomputes": 6, "skipped_batches": 1, "final_val_acc": 0.25},
        "resnet/local-exponent-0.1/unprotected": {"steps_per_s": 15.0},
        "resnet/local-exponent-0.1/dyn+guard": {"steps_per_s": 30.0},  # next to 40 and 80
    }
    for r in runs:
        rate = next(ref_rates) if r.labels["scenario"] == matrix.REFERENCE else 30.0
        r.summary = _matrix_summary(**{"steps_per_s": rate, **special.get(r.name, {})})
    monkeypatch.setattr(matrix, "_plots", lambda out, *_: [out / "resnet.png"])
    results = matrix.summarize(tmp_path, runs, ["resnet"], 6, 2)
    assert json.loads((tmp_path / "results.json").read_text())["rows"] == results["rows"]
    # Every run's config beside its numbers: what a reader checks a surprising cell against.
    assert [(r["name"], r["config"]) for r in results["runs"]] == [(r.name, r.config) for r in runs]
    rows = {(r["setting"], r["scenario"]): r for r in results["rows"]}
    guard = rows[("agg-exponent-0.1", "guard")]
    assert guard["gap_pct"] == pytest.approx(10.0) and guard["gap_worst_pct"] == 20.0  # worst vs the ref's worst
    assert (guard["max_divergence"], guard["end_divergence"], guard["sync_mb"]) == (0.25, 0.125, 3.0)
    assert (guard["faults"], guard["detections"], guard["recomputes"], guard["skipped"]) == (3, 5, 6, 1)
    assert guard["throughput_ratio"] == 0.8 and guard["throughput_vs_unprotected"] == 2.0
    assert rows[("agg-exponent-0.1", "unprotected")]["throughput_ratio"] == 0.8
    assert rows[("local-exponent-0.1", "dyn+guard")]["throughput_ratio"] == 0.5
    assert rows[("local-exponent-0.1", "dyn+guard")]["throughput_vs_unprotected"] == 2.0
    ref = rows[("none", matrix.REFERENCE)]
    assert (ref["throughput_ratio"], ref["throughput_vs_unprotected"], ref["gap_pct"]) == (1.0, None, 0.0)
    md = (tmp_path / "results.md").read_text()
    # The columns in the header's order: val loss, gap %, worst gap %, max div, end div, replicas,
    # faults, syncs, sync MiB (sync_bytes / 2**20: 3 * 2**20 reads 3), detect, recomp, thru / ref, thru / unprot.
    assert "| syncs | sync MiB | detect |" in md
    assert "| resnet | agg-exponent-0.1 | guard | 2.2 | 10 | 20 | 0.25 | 0.125 | 2 | 3 | 4 | 3 | 5 | 6 | 0.8 | 2 |" \
        in md
    assert "| resnet | none | fault-free | 2 | 0 | 0 | 0 | 0 | 1 | 3 | 0 | 0 | 0 | 0 | 1 | n/a |" in md
    assert "| agg-exponent-0.1 | guard | 0.25 |" in md  # the accuracy table
    assert "\n![resnet](resnet.png)\n" in md
    assert "No fault fired" not in md
    # A setting none of whose runs drew a fault is said so; one run without a fault is not.
    for r in runs:
        if r.labels["setting"] in ("none", "local-exponent-0.1") or r.name == "resnet/agg-exponent-0.1/guard":
            r.summary["faults_injected"] = 0  # the fault-free references' setting, "none", draws none by design
    matrix.summarize(tmp_path, runs, ["resnet"], 6, 2)
    assert ("\n**No fault fired** in local-exponent-0.1 (resnet): 6 steps drew none, so those rows compare "
            "fault-free runs; run more --steps.\n") in (tmp_path / "results.md").read_text()


def _matrix_summary(**overrides: Any) -> dict[str, Any]:
    """A run's summary as the trainer returns it, for the matrix's tables."""
    return {"final_val_loss": 2.0, "final_val_loss_max": 2.5, "max_replica_rel_diff_run": 0.0,
            "max_replica_rel_diff": 0.0, "replicas_distinct": 1, "faults_injected": 3, "syncs": 0, "sync_bytes": 0,
            "detections": 0, "recomputes": 0, "skipped_batches": 0, "final_val_acc": 0.5, "steps_per_s": 30.0,
            **overrides}


# (protect mode, guard, monitor) per scenario: the references and the unprotected runs are
# plain DDP, the averager and PAFT-Sync run without the monitor's collective.
MATRIX_DEFENSES = {
    matrix.REFERENCE: ("none", False, False), "unprotected": ("none", False, False),
    "averager": ("averager", False, False), "paft-sync": ("sync", False, False), "paft-dyn": ("dyn", False, True),
    "guard": ("none", True, True), "dyn+guard": ("dyn", True, True),
}


@pytest.mark.parametrize("quick", [True, False])
def test_matrix_plan_gives_every_run_one_base_config_with_its_defense_and_faults(tmp_path: pathlib.Path,
                                                                                 quick: bool) -> None:
    runs = matrix.plan(tmp_path, ["gpt", "resnet"], quick, 10, 3, device="cpu")
    settings = matrix.fault_settings(quick)
    assert set(MATRIX_DEFENSES) == {matrix.REFERENCE, *matrix.SCENARIOS}
    for workload in ("gpt", "resnet"):
        group = [r for r in runs if r.group == workload]
        cells = sorted((r.labels["setting"], r.labels["scenario"]) for r in group
                       if r.labels["scenario"] != matrix.REFERENCE)
        assert cells == sorted((setting, scenario) for setting, (_, scenarios) in settings.items()
                               for scenario in scenarios)
        # One folder per run (the references too), under the workload's.
        dirs = [pathlib.Path(r.config["run_dir"]) for r in group]
        assert len(set(dirs)) == len(dirs) and all(d.is_relative_to(tmp_path / "runs" / workload) for d in dirs)
        bases = []
        for r in group:
            c, scenario = r.config, r.labels["scenario"]
            assert (c["protect"]["mode"], c["guard"]["enabled"], c["monitor"]["enabled"]) == \
                MATRIX_DEFENSES[scenario], r.name
            spec = [] if scenario == matrix.REFERENCE else [settings[r.labels["setting"]][0]]
            assert c["inject"] == spec and r.labels.get("spec") == (spec[0] if spec else None), r.name
            base = json.loads(json.dumps(c))
            for key in ("run_dir", "inject"):
                del base[key]
            for section, key in (("protect", "mode"), ("guard", "enabled"), ("monitor", "enabled")):
                del base[section][key]
            bases.append(base)
        # Same seed, data order, model and schedule everywhere: the runs differ only in the above.
        assert all(b == bases[0] for b in bases)
        assert bases[0]["model"] == matrix.BENCH_MODELS[workload]
        assert (bases[0]["steps"], bases[0]["world_size"], bases[0]["batch_size"], bases[0]["device"]) == \
            (10, 3, 24, "cpu")
        assert (bases[0]["eval_every"], bases[0]["eval_batches"], bases[0]["warmup_steps"]) == (2, 4, 2)
        assert bases[0]["checkpoint_every"] == 0 and bases[0]["protect"]["sync_period"] == (10 if quick else 20)


@pytest.mark.parametrize("quick,steps", [(True, 40), (False, 150)])
def test_matrix_run_compares_each_workload_with_its_own_references(tmp_path: pathlib.Path,
                                                                  monkeypatch: pytest.MonkeyPatch,
                                                                  quick: bool, steps: int) -> None:
    loss = {"gpt": 4.0, "resnet": 2.0}

    def run_all(runs: Sequence[Run], world_size: int) -> None:
        assert world_size == 2
        for r in runs:  # a gap of 10% for every faulty run against its own workload's references
            faulty = r.labels["scenario"] != matrix.REFERENCE
            r.summary = _matrix_summary(final_val_loss=loss[r.group] * (1.1 if faulty else 1.0),
                                        final_val_loss_max=loss[r.group])
            if r.group == "gpt":  # a language model reports no accuracy
                del r.summary["final_val_acc"]

    monkeypatch.setattr(matrix, "run_all", run_all)
    monkeypatch.setattr(matrix, "_plots", lambda *_: [])
    results = matrix.run(tmp_path, quick=quick, workloads=["gpt", "resnet"], world_size=2)
    runs = results["runs"]
    assert results["steps"] == steps and {r["config"]["steps"] for r in runs} == {steps}
    assert f"{len(runs)} runs, {steps} steps each, 2 ranks" in (tmp_path / "results.md").read_text()
    cells = sum(len(scenarios) for _, scenarios in matrix.fault_settings(quick).values())
    for workload in ("gpt", "resnet"):
        rows = [r for r in results["rows"] if r["workload"] == workload]
        assert len(rows) == cells + 1
        assert [r["gap_pct"] for r in rows] == pytest.approx(
            [0.0 if r["scenario"] == matrix.REFERENCE else 10.0 for r in rows])
        assert all(r["gap_worst_pct"] == 0.0 for r in rows)
        assert all(("final_val_acc" in r) == (workload == "resnet") for r in rows)
    acc_table = (tmp_path / "results.md").read_text().split("resnet validation accuracy:")[1]
    assert acc_table.count("| 0.5 |") == cells + 1  # resnet's rows only


def test_matrix_plots_draw_each_setting_beside_the_reference(tmp_path: pathlib.Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from matplotlib.figure import Figure

    runs = matrix.plan(tmp_path, ["resnet"], True, 6, 2)
    losses = [8.0, 4.0, 2.0, 1.0, 0.5, 0.25, 0.125]
    for r in runs:
        run_dir = pathlib.Path(r.config["run_dir"])
        for rank in range(2):
            _jsonl(run_dir / "metrics" / f"rank{rank}.jsonl",
                   [{"step": t, "local_loss": v * (1 + rank)} for t, v in enumerate(losses)])
        _jsonl(run_dir / "evals.jsonl", [{"step": 2, "replica_rel_diff": 0.5}, {"step": 4, "replica_rel_diff": "inf"}])
        # Every run records a period here; only the syncing defenses' is drawn.
        _jsonl(run_dir / "events.jsonl", [{"step": 0, "event": "guard"}, {"step": 3, "event": "sync", "period": 7}])
    figures: list[Figure] = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *_, **__: figures.append(fig))  # the end-to-end test renders
    assert matrix._plots(tmp_path, runs, ["resnet"]) == [tmp_path / "resnet.png"]
    (fig,) = figures
    settings = sorted(matrix.fault_settings(True))
    assert len(fig.axes) == 3 * len(settings)  # loss, divergence and H rows; a column per fault setting
    for col, setting in enumerate(settings):
        loss_ax, div_ax, h_ax = fig.axes[col], fig.axes[len(settings) + col], fig.axes[2 * len(settings) + col]
        scenarios = [matrix.REFERENCE, *matrix.fault_settings(True)[setting][1]]
        assert [line.get_label() for line in loss_ax.get_lines()] == scenarios
        mean = [1.5 * v for v in losses]  # the ranks' mean, smoothed over the last 5 points
        assert list(loss_ax.get_lines()[0].get_ydata()) == pytest.approx(trailing_mean(mean, 5))
        assert list(loss_ax.get_lines()[0].get_ydata()) != pytest.approx(mean)
        for line in div_ax.get_lines():
            assert list(line.get_xdata()) == [2, 4] and line.get_ydata()[0] == 0.5 and math.isnan(line.get_ydata()[1])
        assert [line.get_label() for line in h_ax.get_lines()] == [
            s for s in scenarios if s in ("paft-sync", "paft-dyn", "dyn+guard")]
        # One sync each: a step line of one point, drawn only by its marker (the legend named a blank).
        assert all(line.get_marker() == "o" and list(line.get_xdata()) == [3] for line in h_ax.get_lines())


# -- desync and detection analyses on synthetic run directories ----------------------------


def _jsonl(path: pathlib.Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _consistency(run_dir: pathlib.Path, cv: list[float], loss: list[float]) -> None:
    _jsonl(run_dir / "consistency.jsonl", [
        {"step": t, "loss": loss[t], "consistency/loss_cv": cv[t], "consistency/loss_std": cv[t] * loss[t],
         "consistency/gnorm_cv": 0.1, "consistency/grad_cos_mean": 0.5, "consistency/grad_cos_min": 0.25 - (t % 5) / 64}
        for t in range(len(cv))])


def test_desync_plan_changes_only_what_each_setting_names(tmp_path: pathlib.Path) -> None:
    runs = desync.plan(tmp_path, steps=10, world_size=2, seed=7)
    assert [r.labels["setting"] for r in runs] == list(desync.SETTINGS)
    changed = {r.labels["setting"]: {k: r.config[k] for k in ("desync_shuffle", "desync_seed", "seed")} for r in runs}
    assert changed == {"S1": {"desync_shuffle": False, "desync_seed": False, "seed": 7},
                       "S2": {"desync_shuffle": True, "desync_seed": False, "seed": 7},
                       "S3": {"desync_shuffle": True, "desync_seed": True, "seed": 7},
                       "S1r": {"desync_shuffle": False, "desync_seed": False, "seed": 8}}
    # Everything else is the one base: same schedule, batch, monitor, and dropout on (so that seeds matter).
    rest = [{k: v for k, v in r.config.items() if k not in ("desync_shuffle", "desync_seed", "seed", "run_dir")}
            for r in runs]
    assert all(c == rest[0] for c in rest)
    assert rest[0]["dropout"] == desync.DROPOUT > 0 and rest[0]["inject"] == [] and rest[0]["monitor"]["enabled"]
    assert rest[0]["batch_size"] == 2 * desync.PER_RANK_BATCH  # the global batch: PER_RANK_BATCH per rank
    assert [r.config["run_dir"] for r in runs] == [str(tmp_path / "runs" / k) for k in desync.SETTINGS]


def test_desync_analyze_statistics_and_paired_comparison(tmp_path: pathlib.Path) -> None:
    steps = 8
    loss = [4.0 - 0.25 * t for t in range(steps)]
    noise = [0.0, 0.5, -0.5, 0.25, -0.25, 0.5, -0.5, 0.0]
    runs = []
    for key, cvs in {"S1": [1.0 + n for n in noise], "S2": [1.0 + n for n in noise],
                     "S3": [3.0 + n + (0.25 if t % 2 else -0.25) for t, n in enumerate(noise)]}.items():
        run_dir = tmp_path / key
        _consistency(run_dir, cvs, loss)
        runs.append(Run(key, {"run_dir": str(run_dir)}, labels={"setting": key},
                        summary={"final_val_loss": 2.0, "steps_per_s": 1.0}))
    result = desync.analyze(runs, warmup=2)
    s1 = result["stats"]["S1"]
    assert s1["loss_cv_mean"] == 1.0 and s1["loss_cv_max"] == 1.5
    assert s1["grad_cos_min_min"] == 0.25 - 4 / 64 and s1["grad_cos_min_max"] == 0.25
    assert s1["loss_diff_std"] == 0.0  # a straight line after the warm-up
    same = result["comparisons"]["S2"]["loss_cv"]
    assert (same["diff"], same["z"]) == (0.0, 0.0)  # identical: no difference, and no noise either
    higher = result["comparisons"]["S3"]["loss_cv"]
    assert higher["diff"] == 2.0 and higher["z"] > desync.Z_NOISE
    assert "no difference beyond noise" in desync._verdict("loss_cv", same, 1.0)
    assert "higher than S1" in desync._verdict("loss_cv", higher, 1.0)
    # A null control (S1 again, another seed) that moves as much says it is chance.
    null = {"diff": 1.5, "se": 1.0, "z": 1.5}
    assert "not beyond run-to-run noise" in desync._verdict("loss_cv", higher, 1.0, null)
    assert "not beyond" not in desync._verdict("loss_cv", higher, 1.0, {"diff": 0.5, "se": 1.0, "z": 0.5})
    # The threshold is |z| = Z_NOISE, either sign; the word follows the difference's sign.
    assert "no difference beyond noise (-40.0% vs S1, z = -2.9)" in desync._verdict(
        "loss_cv", {"diff": -1.0, "se": 1 / 2.9, "z": -2.9}, 2.5)
    assert desync._verdict("loss_cv", {"diff": -1.0, "se": 1 / 3, "z": -3.0}, 2.5) == (
        "loss_cv: lower than S1 by -40.0% (z = -3.0)")
    # Relative to |S1's mean|: a cosine that rises from -0.5 reads as higher, +20%.
    assert desync._verdict("grad_cos_mean", {"diff": 0.1, "se": 0.01, "z": 10.0}, -0.5) == (
        "grad_cos_mean: higher than S1 by +20.0% (z = +10.0)")


def test_desync_null_note_says_whether_the_null_control_fired() -> None:
    quiet = {name: {"diff": 0.1, "se": 0.1, "z": 1.0} for name in (*desync.METRICS, "loss")}
    assert desync._null_note({"S2": quiet}) == ""
    assert "stays within |z| < 3" in desync._null_note({"S1r": quiet})
    fired = {**quiet, "gnorm_cv": {"diff": 1.0, "se": 0.25, "z": -4.0}, "loss": {"diff": 1.0, "se": 0.25, "z": 4.0}}
    assert "beyond |z| = 3 in gnorm_cv, loss:" in desync._null_note({"S1r": fired})


def test_desync_a_difference_without_a_standard_error_is_not_read_as_none() -> None:
    # --steps 1: one paired difference, no standard error, so z is undefined.
    comp = desync._paired([1.0], [1.5])
    assert comp["diff"] == 0.5 and math.isnan(comp["z"])
    assert desync._verdict("loss_cv", comp, 1.0) == (
        "loss_cv: +50.0% vs S1, too few steps to tell it from noise (z undefined)")
    note = desync._null_note({"S1r": {name: comp for name in (*desync.METRICS, "loss")}})
    assert note == ("- The null control S1r (synchronized, only the seed differs) cannot be tested against |z| = 3 "
                    "in loss_cv, gnorm_cv, grad_cos_mean, loss: too few steps for a standard error; run more --steps.")
    # Many steps, the same difference at each: no noise to weigh it against, so beyond any (not "too few steps").
    constant = desync._paired([1.0] * 40, [2.0] * 40)
    assert (constant["se"], constant["z"]) == (0.0, math.inf)
    assert desync._verdict("loss_cv", constant, 1.0) == "loss_cv: higher than S1 by +100.0% (z = +inf)"
    assert desync._paired([1.0] * 40, [1.0] * 40)["z"] == 0.0  # no difference at all
    note = desync._null_note({"S1r": {name: constant for name in (*desync.METRICS, "loss")}})
    assert "also differs from S1 beyond |z| = 3 in loss_cv, gnorm_cv, grad_cos_mean, loss" in note
    # No step where both are finite: nothing to compare, and no call for more steps.
    void = desync._paired([math.nan] * 40, [1.0] * 40)
    assert desync._verdict("loss_cv", void, 1.0) == (
        "loss_cv: no step where both runs have a finite value, nothing to compare")
    assert "too few steps" not in desync._null_note({"S1r": {name: void for name in (*desync.METRICS, "loss")}})


def test_desync_standard_error_is_over_block_means() -> None:
    # 10 steps: blocks of 2 (at least 5 blocks), means [2, 2, 3, 2, 3]: se = stdev / sqrt(5).
    mean, se, block = desync._mean_se([1.0, 3.0, 2.0, 2.0, 5.0, 1.0, 0.0, 4.0, 3.0, 3.0, math.nan])
    assert mean == 2.4 and se == pytest.approx(math.sqrt(0.3 / 5), rel=1e-12) and block == 2
    assert desync._mean_se([1.0, 2.0]) == (1.5, pytest.approx(0.5), 1)  # blocks of one step
    # 11 steps: the same 5 blocks of 2; the incomplete last block enters the mean, not the error.
    mean, se, block = desync._mean_se([1.0, 3.0, 2.0, 2.0, 5.0, 1.0, 0.0, 4.0, 3.0, 3.0, 100.0])
    assert mean == 124 / 11 and se == pytest.approx(math.sqrt(0.3 / 5), rel=1e-12) and block == 2
    mean, se, block = desync._mean_se([1.0, math.inf])
    assert mean == 1.0 and math.isnan(se) and block == 1
    assert desync._mean_se([math.nan])[2] == 0  # no value: no block


def test_desync_note_names_the_blocks_a_series_with_non_finite_values_took(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The note gave the block size of --steps values (2 at 10 steps) where a series with a
    non-finite value left out had 9, and blocks of 1."""

    def run_all(runs: list[Run], world_size: int) -> None:
        for r in runs:
            cv = [1.0 + t % 3 for t in range(10)]
            if r.labels["setting"] == "S3":
                cv[4] = math.nan
            _consistency(pathlib.Path(r.config["run_dir"]), cv, [4.0 - t / 8 for t in range(10)])
            r.summary = {"final_val_loss": 2.0, "steps_per_s": 1.0}

    monkeypatch.setattr(desync, "run_all", run_all)
    monkeypatch.setattr(desync, "_plots", lambda out, _: [])
    results = desync.run(tmp_path / "desync", steps=10, world_size=2)
    assert ("(± standard error from means of blocks of 2 or 1 values (the smaller in a series with non-finite "
            "values left out))") in results["note"]
    assert results["comparisons"]["S3"]["loss_cv"]["block"] == 1 and results["comparisons"]["S2"]["loss"]["block"] == 2


def test_desync_loss_roughness_is_after_the_warmup_and_skips_non_finite_steps(tmp_path: pathlib.Path) -> None:
    # Step-to-step differences of the finite losses from the warm-up on: [4, 3, 3, 1] -> [-1, 0, -2],
    # population std; a non-finite step is left out, of the loss as of the monitor's metrics.
    _consistency(tmp_path / "S1", [math.nan, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0], [9.0, 1.0, 4.0, 3.0, math.nan, 3.0, 1.0])
    run = Run("S1", {"run_dir": str(tmp_path / "S1")}, labels={"setting": "S1"},
              summary={"final_val_loss": 2.0, "steps_per_s": 1.0})
    s1 = desync.analyze([run], warmup=2)["stats"]["S1"]
    assert s1["loss_diff_std"] == pytest.approx(math.sqrt(2 / 3))
    assert (s1["loss_cv_mean"], s1["loss_cv_max"], s1["loss_cv_min"]) == (7 / 6, 2.0, 1.0)


def test_desync_reading_compares_each_setting_with_s1_and_quotes_the_null_control(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    offsets = {"S1": 0.0, "S2": 0.5, "S3": 1.0, "S1r": 0.25}  # global loss and final val loss above S1's
    # loss_cv: S2 and the null control S1r both clearly above S1 (|z| >> 3), by about as much.
    cv_offsets = {"S1": 0.0, "S2": 0.5, "S3": 0.0, "S1r": 0.5}

    def run_all(runs: list[Run], world_size: int) -> None:
        for r in runs:
            key = r.labels["setting"]
            cv = [1.0 + cv_offsets[key] + (t % 3) / 100 * (key != "S1") for t in range(10)]
            _consistency(pathlib.Path(r.config["run_dir"]), cv, [4.0 - t / 8 + offsets[key] for t in range(10)])
            r.summary = {"final_val_loss": 2.0 + offsets[key], "steps_per_s": 1.0 + offsets[key]}

    monkeypatch.setattr(desync, "run_all", run_all)
    monkeypatch.setattr(desync, "_plots", lambda out, _: [out / "loss.png"])
    out = tmp_path / "desync"
    results = desync.run(out, steps=10, world_size=2)
    md = (out / "results.md").read_text()
    assert results["reading"] == [line for line in md.splitlines() if line.startswith("- ")]
    # One table row per setting in SETTINGS' order, each column its own statistic.
    rows = [line for line in md.splitlines() if line.startswith("| S")]
    assert [line.split(" ")[1] for line in rows] == list(desync.SETTINGS)
    assert rows[0] == "| S1 synchronized | 1 ± 0 | 1 | 3.438 | 4 | 0.1 ± 0 | 0.1 | 0.5 ± 0 | 0.1875 | 2 | 0 |"
    assert set(results["comparisons"]) == {"S2", "S3", "S1r"} and len(results["reading"]) == 4
    assert results["warmup"] == 2 and "after the 2-step warm-up" in md  # TrainConfig's warm-up of the runs
    # 10 steps, every value finite: blocks of 2, as _mean_se takes them (the note said 10-step blocks,
    # whatever the steps).
    assert "± standard error from 2-step block means" in md
    assert "![loss](loss.png)" in md
    s2 = next(line for line in results["reading"] if line.startswith("- S2 "))
    assert "; grad_cos_mean: no difference beyond noise" in s2
    assert s2.startswith("- S2 (desync shuffle) vs S1: loss_cv: higher than S1 by ")
    assert "but the null control differs by +50.9%: not beyond run-to-run noise; gnorm_cv" in s2
    assert [r["steps_per_s"] for r in results["rows"]] == [1.0, 1.5, 2.0, 1.25]
    # The same offset at every step: no noise to weigh it against (z was NaN, read as "cannot say").
    assert "global loss: +0.5000 per step vs S1 on average (z = +inf), null control +0.2500" in s2
    assert s2.endswith("; final val loss +0.5000 (null control +0.2500).")
    s1r = next(line for line in results["reading"] if line.startswith("- S1r "))
    assert s1r.endswith("; final val loss +0.2500.")  # itself the null control: none quoted


def _evals(run_dir: pathlib.Path, losses: list[float], divs: list[float]) -> None:
    _jsonl(run_dir / "evals.jsonl", [
        {"step": s, "val_loss": v, "val_loss_per_rank": [v, v], "replica_rel_diff": d}
        for s, (v, d) in enumerate(zip(losses, divs))])


def test_detection_assess_harm(tmp_path: pathlib.Path) -> None:
    steps = 14
    ref, bad = tmp_path / "ref", tmp_path / "unguarded"
    _evals(ref, [2.0] * (steps + 1), [0.0] * (steps + 1))
    # fault 1 (harmless), 3: the loss rises 10% two updates later, 6: the replicas split
    # (and keep drifting, which is no new harm), 11: the model goes non-finite, 13: after the collapse.
    losses = [2.0, 2.0, 2.001, 2.001, 2.001, 2.2, 2.2, 2.2, 2.2, 2.2, 2.2, 2.2, "nan", "nan", "nan"]
    divs = [0.0] * 7 + [1e-3, 2e-3, 2.9e-3, 3.7e-3, 4.4e-3, "inf", "inf", "inf"]
    _evals(bad, losses, divs)  # type: ignore[arg-type]
    _jsonl(bad / "faults.jsonl", [{"step": t, "attempt": 0} for t in (1, 3, 6, 11, 13)]
           + [{"step": 3, "attempt": 1}])
    harm = detection.assess_harm(bad, ref, steps)
    assert [p["harm"] for p in harm["per_fault"]] == [None, "loss", "split", "nonfinite", "collapsed"]
    assert (harm["faults"], harm["assessed"], harm["harmful"], harm["collapsed"]) == (5, 4, 3, 1)
    assert harm["by_reason"] == {"nonfinite": 1, "loss": 1, "split": 1}
    # The same test at fault-free steps 0, 2, 4, 5, 8..10 (7 is right after the split, whose jump
    # is no drift to judge it by; 12 is after the collapse): it fires at step 4 only, whose update
    # the loss rise also follows; the drift after the split is no new harm.
    assert harm["background"] == {"assessed": 7, "fired": 1}
    # Replicas that diverge to inf have collapsed even where every replica's loss stays finite.
    split = tmp_path / "split"
    _evals(split, [2.0] * 5, [0.0, 0.0, math.inf, math.inf, math.inf])
    _jsonl(split / "faults.jsonl", [{"step": t, "attempt": 0} for t in (1, 3)])
    assert [p["harm"] for p in detection.assess_harm(split, ref, 4)["per_fault"]] == ["nonfinite", "collapsed"]


def test_detection_a_fault_right_after_a_split_is_not_judged_by_that_splits_drift(tmp_path: pathlib.Path) -> None:
    # Measured (aggregation, float32 bit 26, faults at steps 4 and 5 of the detection table's runs):
    # step 5's flip alone split the replicas by 1.63e-4, above DIV_HARM. Right after step 4's, it
    # added 0.04e-4 beyond the "drift" div(5) - div(4), which is step 4's own jump, and was
    # counted harmless: a split drifts at about its jump's size for a few steps, so step 5's own
    # split cannot be told from it. Not assessed, as a fault after a collapse is not.
    ref, bad = tmp_path / "ref", tmp_path / "unguarded"
    _evals(ref, [2.0] * 10, [0.0] * 10)
    _evals(bad, [2.0] * 10, [0.0] * 5 + [1.82e-4, 3.67e-4, 5.38e-4, 6.87e-4, 8.18e-4])
    _jsonl(bad / "faults.jsonl", [{"step": t, "attempt": 0} for t in (4, 5)])
    harm = detection.assess_harm(bad, ref, 9)
    assert [p["harm"] for p in harm["per_fault"]] == ["split", "after_split"]
    assert (harm["faults"], harm["assessed"], harm["harmful"], harm["after_split"]) == (2, 1, 1, 1)
    # Fault-free step 6 right after step 5's fault is left out of the background alike (7 and 8 are judged).
    assert harm["background"] == {"assessed": 6, "fired": 0}
    assert detection.harmful_missed(harm["per_fault"], []) == 1  # step 4's only
    # Where even the drift added back leaves the split below DIV_HARM (bit 25: step 5's flip alone
    # split by 0.11e-4), the fault is judged harmless.
    _evals(bad, [2.0] * 10, [0.0] * 5 + [1.07e-4, 1.95e-4, 2.69e-4, 3.32e-4, 3.87e-4])
    assert [p["harm"] for p in detection.assess_harm(bad, ref, 9)["per_fault"]] == ["split", None]


def test_detection_harm_reads_the_worst_replica(tmp_path: pathlib.Path) -> None:
    ref, bad = tmp_path / "ref", tmp_path / "unguarded"
    _evals(ref, [2.0] * 7, [0.0] * 7)
    # Per rank: fault 1 raises one replica's loss 3% (the mean only 1.5%); fault 3 makes one
    # replica's loss NaN (the other stays finite); at fault-free step 2 the replicas split.
    per_rank = [[2.0, 2.0], [2.0, 2.0], [2.0, 2.06], [2.0, 2.06], [2.06, math.nan], [2.06, math.nan], [2.06, math.nan]]
    divs = [0.0, 0.0, 0.0, 1e-3, 1e-3, 1e-3, 1e-3]
    _jsonl(bad / "evals.jsonl", [{"step": s, "val_loss": sum(v) / 2, "val_loss_per_rank": v, "replica_rel_diff": d}
                                 for s, (v, d) in enumerate(zip(per_rank, divs))])
    _jsonl(bad / "faults.jsonl", [{"step": t, "attempt": 0} for t in (1, 3)])
    harm = detection.assess_harm(bad, ref, 6)
    assert [p["harm"] for p in harm["per_fault"]] == ["loss", "nonfinite"]
    # Steps 0 and 2 assessed (4 and 5 follow the NaN); the split after step 2 fires the test too.
    assert harm["background"] == {"assessed": 2, "fired": 1}


def test_detection_assess_detection(tmp_path: pathlib.Path) -> None:
    run_dir = tmp_path / "guarded"
    # Step 12's fault fired only on a recompute: no fault of the schedule, so its detection stays a FP.
    _jsonl(run_dir / "faults.jsonl", [{"step": t, "attempt": 0} for t in (2, 9, 15)] + [{"step": 12, "attempt": 1}])
    _jsonl(run_dir / "events.jsonl", [
        {"step": 2, "event": "guard", "attempt": 0, "action": "recompute", "detector": "grad_mismatch"},
        {"step": 2, "event": "guard", "attempt": 1, "action": "proceed", "detector": "grad_mismatch"},
        {"step": 4, "event": "guard", "attempt": 0, "action": "recompute", "detector": "loss_spike"},  # late
        {"step": 5, "event": "sync"},
        {"step": 12, "event": "guard", "attempt": 0, "action": "recompute", "detector": "grad_spike"},  # FP
        {"step": 15, "event": "guard", "attempt": 0, "action": "proceed", "detector": "update_ratio"},
        {"step": 16, "event": "alert", "detector": "loss_cv"},
    ])
    det = detection.assess_detection(run_dir)
    assert (det["faults"], det["detected"], det["late"], det["false_positives"]) == (3, 2, 1, 1)
    assert det["false_positive_steps"] == [12]
    assert det["detectors"] == {"grad_mismatch": 1, "update_ratio": 1}
    assert det["detected_fault_steps"] == [2, 15]


def test_detection_harmful_missed_matches_faults_by_step() -> None:
    per_fault = [{"step": 2, "harm": "loss"}, {"step": 9, "harm": None}, {"step": 15, "harm": "collapsed"}]
    # The harmful fault was caught and a harmless one missed: nothing harmful was missed.
    assert detection.harmful_missed(per_fault, [2]) == 0
    assert detection.harmful_missed(per_fault, [9, 15]) == 1
    assert detection.harmful_missed([{"step": 4, "harm": "split"}, {"step": 6, "harm": "nonfinite"}], []) == 2


def test_detection_bits_and_specs() -> None:
    assert detection.parse_bits(None) == [*range(32), "sign", "exponent", "mantissa"]
    assert detection.parse_bits(["17", 3, "sign", 3]) == [17, 3, "sign"]
    for bad in (["32"], ["-1"], ["lsb"], []):
        with pytest.raises(ValueError, match="bits"):
            detection.parse_bits(bad)
    assert detection.fault_spec("local-grad", 17, 0.1) == "bitflip:site=local-grad,rate=0.1,bits=17,ranks=1,count=1"


def test_detection_bit_labels_name_the_float32_field() -> None:
    assert [detection.bit_label(b) for b in (0, 22, 23, 30, 31)] == [
        "0 (mantissa)", "22 (mantissa)", "23 (exponent)", "30 (exponent)", "31 (sign)"]
    assert detection.bit_label("sign") == "sign (class)"
    assert detection.bit_label("exponent") == "exponent (random bit)"


def test_detection_plan_pairs_guarded_and_unguarded_runs_of_one_base(tmp_path: pathlib.Path) -> None:
    runs = detection.plan(tmp_path, steps=8, rate=0.5, world_size=2, bits=[30, "sign"], sites=detection.SITES,
                          seed=5)
    ref, cells = runs[0], runs[1:]
    assert ref.name == detection.REFERENCE and ref.config["inject"] == [] and not ref.config["guard"]["enabled"]
    assert [(r.labels["site"], r.labels["bits"], r.labels["guard"]) for r in cells] == [
        (site, b, g) for site in detection.SITES for b in (30, "sign") for g in (True, False)]
    for r in cells:
        assert r.config["inject"] == [detection.fault_spec(r.labels["site"], r.labels["bits"], 0.5)]
        assert r.config["guard"]["enabled"] == r.labels["guard"]
    # Apart from faults and guard, every run is the reference: the same seed and fault schedule,
    # and an evaluation after every step (the harm test reads each step's validation loss).
    same = [{k: v for k, v in r.config.items() if k not in ("inject", "guard", "run_dir")} for r in runs]
    assert all(c == same[0] for c in same) and (same[0]["eval_every"], same[0]["seed"]) == (1, 5)


def test_detection_rejects_unknown_sites_and_too_few_overhead_steps(tmp_path: pathlib.Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def run_all(runs: list[Run], world_size: int) -> None:
        raise AssertionError("bad input must be rejected before any run starts")

    monkeypatch.setattr(detection, "run_all", run_all)
    with pytest.raises(ValueError, match="sites: must be among"):
        detection.run(tmp_path / "a", sites=["aggregation", "weights"])
    with pytest.raises(ValueError, match=f"overhead_steps: must be >= {overhead.BLOCKS}"):
        detection.run(tmp_path / "b", overhead_steps=overhead.BLOCKS - 1)
    assert list(tmp_path.iterdir()) == []


def test_detection_table_and_results_agree_on_shares_and_counts(tmp_path: pathlib.Path,
                                                                 monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    # Every cell the same: faults at steps 1 (raises the loss), 4 (makes the model non-finite)
    # and 5 (after the collapse); the guard catches step 1, step 3 late, step 0 falsely. Sites
    # in ``silent`` draw no fault at all.
    silent: set[str] = set()

    def run_all(runs: list[Run], world_size: int) -> None:
        for r in runs:
            run_dir = pathlib.Path(r.config["run_dir"])
            if r.name == detection.REFERENCE:
                _evals(run_dir, [2.0] * 7, [0.0] * 7)
                r.summary = {"final_val_loss": 2.0, "steps_per_s": 1.0}
                continue
            faults = () if r.labels["site"] in silent else (1, 4, 5)
            _jsonl(run_dir / "faults.jsonl", [{"step": t, "attempt": 0} for t in faults])
            if r.labels["guard"]:
                _jsonl(run_dir / "events.jsonl", [
                    {"step": t, "event": "guard", "attempt": 0, "action": "recompute", "detector": "grad_mismatch"}
                    for t in (0, 1, 3)])
                r.summary = {"final_val_loss": 2.0, "faults_injected": len(faults), "recomputes": 2,
                             "skipped_batches": 0,
                             "replicas_distinct": 1}
            else:
                _evals(run_dir, [2.0, 2.0, 2.2, 2.2, 2.2, "nan", "nan"], [0.0] * 5 + ["inf", "inf"])  # type: ignore[list-item]
                r.summary = {"final_val_loss": 2.5 if r.labels["bits"] == 30 else math.nan,
                             "faults_injected": len(faults), "replicas_distinct": 2,
                             "max_replica_rel_diff": 0.5}

    def measure(runs_dir: pathlib.Path, base: dict[str, Any], variants: Sequence[str], *, steps: int,
                world_size: int) -> dict[str, Any]:
        assert tuple(variants) == detection.OVERHEAD_VARIANTS and steps == 5
        assert base["steps"] == base["eval_every"] == overhead.WARMUP + 5  # no evaluation inside the timed steps
        _jsonl(runs_dir / "guard" / "events.jsonl", [{"step": 40, "event": "guard", "detector": "loss_spike"}])
        return {"plain": {"wall_ms": 2.0, "cpu_ms": 1.0, "parameters": 5},
                **{v: {"wall": w, "wall_blocks": [1.25, w], "cpu": 1.25, "cpu_blocks": [1.5, 1.0]}
                   for v, w in (("monitor", 1.5), ("guard", 1.75))}}

    monkeypatch.setattr(detection, "run_all", run_all)
    monkeypatch.setattr(overhead, "measure", measure)
    monkeypatch.setattr(detection, "_plot", lambda out, *_: out / "detection.png")
    out = tmp_path / "detection"
    results = detection.run(out, steps=6, rate=0.5, bits=["mantissa", 30], overhead_steps=5)
    written = json.loads((out / "results.json").read_text())["rows"]
    # results.json spells the infinite gap as records do ("inf"); otherwise it holds the returned rows.
    assert written == [{**r, "gap_unguarded_pct": "inf"} if r["bits"] == "mantissa" else r for r in results["rows"]]
    assert len(results["rows"]) == 4
    for row in results["rows"]:
        assert (row["faults"], row["harm_assessed"], row["harmful"], row["collapsed"]) == (3, 2, 2, 1)
        assert row["harmful_share"] == 1.0  # over the assessed faults, not all 3
        assert (row["faults_guarded"], row["detected"], row["late"], row["false_positives"]) == (3, 1, 1, 1)
        assert row["detected_share"] == 1 / 3  # over the injected faults
        assert row["harmful_missed"] == 1  # step 4's
        # A run that ends non-finite is infinitely far from the fault-free loss.
        assert (row["gap_guard_pct"], row["gap_unguarded_pct"]) == (0.0, 25.0 if row["bits"] == 30 else math.inf)
        assert row["background"] == {"assessed": 3, "fired": 0}  # steps 0, 2, 3
    md = (out / "results.md").read_text()
    cell = "| 3 | 2/2 (+1 after NaN) | 1/3 | 1 (+1 late) | 2 | 0 | 25 |"
    assert f"| 30 (exponent) {cell}{cell[1:]}" in md
    assert md.index("| mantissa (random bit) |") < md.index("| 30 (exponent) |")  # the order asked for
    assert "No fault fired" not in md
    assert md.endswith("\n![detection](detection.png)\n\n")  # the plot's link in results.md, not on the console
    said = capsys.readouterr().out
    assert "| 30 (exponent) |" in said and "![detection]" not in said
    assert ("- local-grad: over the single-bit rows, 2/2 faults harmful, 1/3 detected; harmful but missed: 30; "
            "false positives in these runs: 2 (+2 late); harm test background (fired at fault-free steps of the "
            "unguarded runs): 0/6.") in md
    assert "| monitor | 50 | +25.0 to +50.0 | 25 | +0.0 to +50.0 |" in md
    assert "| guard | 75 | +25.0 to +75.0 | 25 | +0.0 to +50.0 |" in md
    assert f"False positives in {overhead.WARMUP + 5} fault-free guarded steps: 1." in md
    assert results["overhead"]["false_positives_fault_free"] == 1
    # A site without faults is no reason for the warning; no fault anywhere is.
    for silent_sites, warned in (({"local-grad"}, False), (set(detection.SITES), True)):
        silent.clear()
        silent.update(silent_sites)
        detection.run(tmp_path / str(warned), steps=6, rate=0.5, bits=[30], overhead_steps=5)
        assert ("**No fault fired**" in (tmp_path / str(warned) / "results.md").read_text()) == warned


# -- (b), (c) real runs through the CLI ---------------------------------------------------


def test_matrix_quick_end_to_end(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "matrix"
    code = main(["bench", "matrix", "--quick", "--workloads", "resnet", "--steps", "6", "--world-size", "2",
                 "--out", str(out)])
    assert code == 0
    md = (out / "results.md").read_text()
    cells = [(setting, scenario) for setting, (_, scenarios) in matrix.fault_settings(True).items()
             for scenario in scenarios]
    for setting, scenario in [("none", matrix.REFERENCE), *cells]:
        assert f"| resnet | {setting} | {scenario} |" in md
    results = json.loads((out / "results.json").read_text())
    assert sorted((r["setting"], r["scenario"]) for r in results["rows"]) == sorted(
        [("none", matrix.REFERENCE), *cells])
    for r in results["rows"]:
        assert math.isfinite(r["final_val_loss"]) and r["throughput_ratio"] > 0
    for setting in {r["setting"] for r in results["rows"]}:  # every defense faces the same faults
        assert len({r["faults"] for r in results["rows"] if r["setting"] == setting}) == 1, setting
    # One column of plots per fault setting (6 x 10 inches at 90 dpi each), the reference drawn in each.
    png_size = struct.unpack(">II", (out / "resnet.png").read_bytes()[16:24])  # the IHDR's width and height
    assert png_size == (540 * len(matrix.fault_settings(True)), 900)
    # Throughput is over plain DDP: the reference runs without the monitor's hook and collective.
    reference = json.loads((out / "runs" / "resnet" / f"{matrix.REFERENCE}-0" / "config.json").read_text())
    assert reference["monitor"]["enabled"] is False and reference["protect"]["mode"] == "none"
    assert_no_stale_keys("matrix", results)


def test_overhead_tiny_end_to_end(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "overhead"
    code = main(["bench", "overhead", "--steps", "5", "--warmup", "2", "--world-size", "2", "--batch-size", "8",
                 "--variants", "plain,monitor", "--workload", "resnet", "--out", str(out)])
    assert code == 0
    assert "| monitor |" in (out / "results.md").read_text()
    results = json.loads((out / "results.json").read_text())
    costs = results["costs"]
    assert set(costs) == {"plain", "monitor"}
    assert costs["plain"]["wall_ms"] > 0 and costs["plain"]["cpu_ms"] > 0
    monitor = costs["monitor"]
    assert monitor["wall"] > 0 and monitor["cpu"] > 0
    assert len(monitor["wall_blocks"]) == len(monitor["cpu_blocks"]) == overhead.BLOCKS
    assert math.isfinite(monitor["wall_median_extra_ms"])
    assert "median step overhead %" in (out / "results.md").read_text()
    # Both trainers ran every step (2 untimed + 5 timed) in the same workers, each in its own run directory.
    for name in ("plain", "monitor"):
        steps = [r["step"] for r in read_jsonl(out / "runs" / name / "metrics" / "rank0.jsonl")]
        assert steps == list(range(7))
    assert "global batch 8" in results["note"]


# -- (d) bad input: exit 2, nothing written ---------------------------------------------------


def test_an_uncreatable_out_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "desync", "--out", "/proc/paft-cannot-be-here"])
    assert exc.value.code == 2
    assert "--out: cannot create /proc/paft-cannot-be-here" in capsys.readouterr().err


@pytest.mark.parametrize("argv,needle", [
    (["matrix", "--steps", "0"], "--steps"),
    (["overhead", "--steps", "0"], "--steps"),
    (["overhead", "--steps", "4"], "--steps"),
    (["scaling", "--steps", "4"], "--steps: must be >= 5"),
    (["overhead", "--warmup", "-1"], "--warmup"),
    (["overhead", "--period", "0"], "--period: must be >= 1"),
    (["overhead", "--period", str(2**53 + 1)], "--period: must be in [1, 2**53]"),  # was a worker's traceback
    (["overhead", "--batch-size", "6"], "--batch-size"),
    (["desync", "--steps", "0"], "--steps"),
    (["detection", "--steps", "0"], "--steps"),
    (["detection", "--rate", "0"], "--rate"),
    (["detection", "--world-size", "0"], "--world-size"),
    (["matrix", "--workloads", "bert"], "--workloads"),
    (["overhead", "--variants", "plain,turbo"], "--variants"),
    (["overhead", "--variants", ""], "--variants: unknown ['']"),  # not "every variant"
    (["overhead", "--variants", "plain"], "--variants: plain alone measures nothing"),  # an empty table
    (["overhead", "--workload", "bert"], "--workload"),
    (["overhead", "--model", "n_layers=2"], "--model: unknown key 'n_layers'"),
    # paft train's message pointed to its --dropout, which paft bench overhead has not.
    (["overhead", "--model", "dropout=0.1"], "--model: dropout is not a model size: paft bench overhead trains "
     "without dropout"),
    (["overhead", "--variant", "plain"], "unrecognized arguments: --variant plain"),  # no prefixes
    (["scaling", "--world-size", "2"], "paft bench scaling: error: unrecognized arguments: --world-size 2"),
    (["detection", "--world-size", "1"], "--world-size: must be >= 2 for detection"),
    (["matrix", "--world-size", "1"], "--world-size: must be >= 2 for matrix"),
    (["desync", "--world-size", "0"], "--world-size: must be >= 2 for desync"),  # the bound that holds, not >= 1
    (["scaling", "--world-sizes", "1,2"], "--world-sizes: must all be in [2, 64]"),
    (["scaling", "--world-sizes", "2,4,2"], "--world-sizes: 2 listed more than once"),
    (["scaling", "--world-sizes", "2,128"], "--world-sizes: must all be in [2, 64], got 2,128"),
    (["scaling", "--world-sizes", "2,four"], "--world-sizes: expected comma-separated integers, got '2,four'"),
    (["scaling", "--world-sizes", "2,3"], "--world-sizes: 3 does not split the default global batch of 64 evenly"),
    (["matrix", "--workloads", "gpt,gpt"], "--workloads: gpt listed more than once"),
    (["overhead", "--variants", "monitor,guard,monitor"], "--variants: monitor listed more than once"),
    (["desync", "--out", "o/" + "x" * 300], "--out: o/xxx"),
    (["matrix", "--world-size", "99999999999999999999"], "--world-size: must be <= 64"),
    (["overhead", "--batch-size", "100000", "--world-size", "2"], "--batch-size: 100000 is more than"),
])
def test_bad_input_exits_2_and_writes_nothing(argv: list[str], needle: str, tmp_path: pathlib.Path,
                                              monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["bench", argv[0], "--out", "out", *argv[1:]])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("benchmark,world_size,gpus", [("matrix", ["--world-size", "4"], 1),
                                                        ("overhead", ["--world-size", "4"], 1),
                                                        ("desync", ["--world-size", "4"], 1),
                                                        ("detection", ["--world-size", "2"], 1),
                                                        ("scaling", ["--world-sizes", "2,4"], 1),
                                                        ("scaling", ["--world-sizes", "4,2"], 2)])  # the largest
def test_more_workers_than_gpus_exits_2_and_writes_nothing(
    benchmark: str, world_size: list[str], gpus: int, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    # The device count is the machine's; pretend to fewer GPUs so that the check runs here.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(SystemExit) as exc:
        main(["bench", benchmark, "--out", "out", *world_size])
    assert exc.value.code == 2
    assert f"NCCL needs one GPU per worker and {gpus} {'is' if gpus == 1 else 'are'} visible" in \
        capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("benchmark", ["matrix", "overhead", "desync", "detection"])
def test_existing_out_without_overwrite_exits_2_and_keeps_it(benchmark: str, tmp_path: pathlib.Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / ".paft-bench").write_text("")  # an earlier benchmark's output
    (out / "keep.txt").write_text("earlier results")
    with pytest.raises(SystemExit) as exc:
        main(["bench", benchmark, "--steps", "5", "--out", str(out)])
    assert exc.value.code == 2
    assert f"--out: {out} already exists; pass --overwrite" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.rglob("*")) == [".paft-bench", "keep.txt", "out"]
    assert (out / "keep.txt").read_text() == "earlier results"


def test_overwrite_with_bad_option_keeps_existing_out(tmp_path: pathlib.Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / ".paft-bench").write_text("paft bench matrix\n")  # an earlier benchmark's: --overwrite may replace it
    (out / "results.json").write_text("earlier results")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "matrix", "--workloads", "bert", "--overwrite", "--out", str(out)])
    assert exc.value.code == 2 and "--workloads" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert (out / "results.json").read_text() == "earlier results"


def test_overwrite_replaces_an_interrupted_benchmark(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    # The marker is written before any run: a benchmark stopped midway is still ours.
    from paft.bench import desync

    def interrupted(out: pathlib.Path, **_: object) -> None:
        (out / "runs").mkdir()
        raise KeyboardInterrupt

    monkeypatch.setattr(desync, "run", interrupted)
    out = tmp_path / "out"
    assert main(["bench", "desync", "--out", str(out)]) == 130  # Ctrl-C: the shell's code, no traceback
    # Not "the runs finished so far": overhead's runs step in lockstep and none finishes early.
    assert capsys.readouterr().err.endswith(f"; {out} keeps what was written\n")
    monkeypatch.setattr(desync, "run", lambda out, **_: None)
    assert main(["bench", "desync", "--out", str(out), "--overwrite"]) == 0
    assert sorted(p.name for p in out.iterdir()) == [".lock", ".paft-bench"]  # the lock a benchmark holds


def test_results_the_disk_cannot_hold_are_said_in_a_line_and_overwrite_puts_the_old_back(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # A full disk at results.md raised OSError's traceback, after results.json had been
    # written: a JSON without its table, and with --overwrite the old results deleted.
    out = tmp_path / "out"
    monkeypatch.setattr(desync, "run", lambda out, **_: runner.write_outputs(out, "t", {"a": 1}, "table"))
    assert main(["bench", "desync", "--out", str(out)]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    real_fsync, calls = os.fsync, []

    def full_at_the_second_file(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", full_at_the_second_file)
    monkeypatch.setattr(desync, "run", lambda out, **_: runner.write_outputs(out, "t", {"a": 2}, "other"))
    assert main(["bench", "desync", "--out", str(out), "--overwrite"]) == 1
    assert f"paft bench: cannot write {out / 'results.md'}: No space left on device" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_an_existing_empty_out_is_used(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The folder was locked twice by one benchmark (before and after creating it), and the
    # second lock refused it as "in use by another paft bench".
    from paft.bench import desync

    monkeypatch.setattr(desync, "run", lambda out, **_: None)
    out = tmp_path / "out"
    out.mkdir()
    assert main(["bench", "desync", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [".lock", ".paft-bench"]


def test_overwrite_keeps_the_old_results_until_the_new_benchmark_finishes(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from paft.bench import desync

    def interrupted(out: pathlib.Path, **_: object) -> None:
        (out / "runs").mkdir()
        raise KeyboardInterrupt

    out = tmp_path / "out"
    out.mkdir()
    (out / ".paft-bench").write_text("paft bench desync\n")
    (out / "results.json").write_text("old results")
    monkeypatch.setattr(desync, "run", interrupted)
    assert main(["bench", "desync", "--out", str(out), "--overwrite"]) == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # nothing left aside
    assert sorted(p.name for p in out.iterdir()) == [".lock", ".paft-bench", "results.json"]
    assert (out / "results.json").read_text() == "old results"


def test_overwrite_with_no_earlier_out_says_the_stopped_benchmarks_folder_stays(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # With nothing to set aside, nothing is put back: the line left the kept folder unsaid.
    from paft.bench import desync

    def interrupted(out: pathlib.Path, **_: object) -> None:
        (out / "runs").mkdir()
        raise KeyboardInterrupt

    monkeypatch.setattr(desync, "run", interrupted)
    out = tmp_path / "out"
    assert main(["bench", "desync", "--out", str(out), "--overwrite"]) == 130
    assert capsys.readouterr().err.endswith(f"; {out} keeps what was written\n")
    assert sorted(p.name for p in out.iterdir()) == [".lock", ".paft-bench", "runs"]


@pytest.mark.parametrize("argv,expected", [
    (["matrix", "--quick", "--workloads", "resnet,gpt", "--steps", "7", "--world-size", "3", "--device", "cpu"],
     {"quick": True, "workloads": ["resnet", "gpt"], "steps": 7, "world_size": 3, "device": "cpu"}),
    (["matrix"], {"quick": False, "workloads": ["gpt", "llama", "resnet"], "steps": None, "world_size": 4,
                  "device": "auto"}),
    (["scaling", "--world-sizes", "4,2", "--steps", "6", "--device", "cpu"],
     {"world_sizes": (4, 2), "steps": 6, "device": "cpu"}),
    (["scaling"], {"world_sizes": (2, 4), "steps": 40, "device": "auto"}),
])
def test_matrix_and_scaling_get_the_options_as_given(argv: list[str], expected: dict[str, Any],
                                                     tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    got: dict[str, Any] = {}

    def run(out: pathlib.Path, **kwargs: Any) -> None:
        got.update(kwargs, out=out)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the defaults' 4 workers, on a 1-GPU machine too

    monkeypatch.setattr(matrix if argv[0] == "matrix" else scaling, "run", run)
    assert main(["bench", *argv, "--out", str(tmp_path / "out")]) == 0
    assert got == {**expected, "out": tmp_path / "out"}


def test_out_that_is_a_file_exits_2(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "out"
    out.write_text("not a folder")
    with pytest.raises(SystemExit) as exc:
        main(["bench", "desync", "--out", str(out)])
    assert exc.value.code == 2


# -- (e) the desync and detection benchmarks end to end -------------------------------


def test_desync_tiny_end_to_end(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "desync"
    results = desync.run(out, steps=6, world_size=2)
    md = (out / "results.md").read_text()
    for key, (description, _) in desync.SETTINGS.items():
        assert f"| {key} {description} |" in md
    assert [r["setting"] for r in json.loads((out / "results.json").read_text())["rows"]] == list(desync.SETTINGS)
    assert set(results["comparisons"]) == {"S2", "S3", "S1r"}
    assert_no_stale_keys("desync", results)
    for name in ("loss.png", "dispersion.png", "cosine.png"):
        assert (out / name).stat().st_size > 0
    # Nothing here injects faults: every setting ends with one replica.
    assert all(r["replicas_distinct"] == 1 for r in results["runs"])

    # What each setting changes, read off every rank's first local loss (same weights):
    # S2 reshuffles rank 1's data (rank 0 keeps the shared order), S3 also redraws
    # rank 1's dropout, S1r starts from other weights on every rank.
    def first_losses(key: str) -> list[float]:
        return [read_jsonl(out / "runs" / key / "metrics" / f"rank{r}.jsonl")[0]["local_loss"] for r in range(2)]

    s1, s2, s3, s1r = (first_losses(k) for k in ("S1", "S2", "S3", "S1r"))
    assert s2[0] == s1[0] and s2[1] != s1[1]
    assert s3[0] == s2[0] and s3[1] != s2[1]
    assert s1r[0] != s1[0] and s1r[1] != s1[1]


def test_detection_tiny_end_to_end(tmp_path: pathlib.Path) -> None:
    out = tmp_path / "detection"
    results = detection.run(out, steps=8, rate=0.5, world_size=2, bits=[30, "mantissa"], overhead_steps=5)
    md = (out / "results.md").read_text()
    for b in (30, "mantissa"):
        assert f"| {detection.bit_label(b)} |" in md
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert sorted((r["site"], str(r["bits"])) for r in rows) == sorted(
        (s, str(b)) for s in detection.SITES for b in (30, "mantissa"))
    for r in rows:
        assert r["faults"] == r["faults_guarded"] > 0  # same schedule with and without the guard
        assert r["detected"] <= r["faults_guarded"] and r["harmful"] <= r["harm_assessed"]
    agg30 = next(r for r in rows if r["site"] == "aggregation" and r["bits"] == 30)
    assert agg30["detected"] == agg30["faults_guarded"]  # replicas receive different bytes: always caught
    assert agg30["gap_guard_pct"] == 0.0  # every fault recomputed: the fault-free trajectory, bit for bit
    assert set(results["overhead"]["costs"]) == {"plain", "monitor", "guard"}
    assert results["overhead"]["false_positives_fault_free"] == 0
    assert (out / "detection.png").stat().st_size > 0
    assert_no_stale_keys("detection", results)


def test_scaling_cost_model_matches_the_protocol() -> None:
    from paft.bench.scaling import model

    c = model(4, 0.8e6)
    assert c["control_row_B"] == 8 * (9 + 256) == 2120
    assert c["control_received_B"] == 2120 * 3  # the other ranks' rows
    assert c["grad_allreduce_B"] == 2 * 3 / 4 * 0.8e6 * 4  # ring all-reduce of fp32 gradients
    assert c["sync_noop_row_B"] == 24 and c["sync_noop_received_B"] == 72  # fingerprints + structure hash
    assert model(2, 0.8e6)["sync_noop_row_B"] == 32  # + the reference's tag
    assert c["sync_majority_copy_B"] == 0.8e6 * 12  # fp32 weights + Adam's two moments
    big = model(1024, 7e9)
    assert big["sync_median_received_B"] == 7e9 * 12 * 1023
    assert big["sync_median_s"] == pytest.approx(7e9 * 12 * 1023 / 50e9)  # every replica's state in, 50 GB/s
    assert 1.6 < big["sync_majority_copy_s"] < 1.8  # 84 GB at 400 Gb/s
    assert big["control_vs_gradient_allreduce"] < 1e-4


def test_scaling_states_the_sketch_dimension_its_runs_used(tmp_path: pathlib.Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Its control rows and calculated jobs took k from a copy of the default (and its
    text said "k = 256" whatever the runs did): runs with k = 64 must read 64."""
    base = scaling._base

    def small(world_size: int, steps: int, device: str) -> dict[str, Any]:
        cfg = base(world_size, steps, device)
        return {**cfg, "model": {"n_layer": 1, "n_head": 2, "n_embd": 32, "block_size": 32},
                "monitor": {**cfg["monitor"], "sketch_dim": 64}}

    monkeypatch.setattr(scaling, "_base", small)
    out = tmp_path / "scaling"
    results = scaling.run(out, world_sizes=(2,), steps=5)
    assert results["sketch_dim"] == results["measured"]["2"]["sketch_dim"] == 64
    assert results["measured"]["2"]["control_row_B"] == 8 * (HEADER + 64)
    assert all(c["control_row_B"] == 8 * (HEADER + 64) for c in results["calculated"].values())
    md = (out / "results.md").read_text()
    assert "| 2 | 64 | 584 / 584 |" in md and "k = 64, as in the runs" in md and "k = 256" not in md


def test_scaling_measured_rows_state_the_paired_costs_and_median_syncs(tmp_path: pathlib.Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def measure(runs_dir: pathlib.Path, base: dict[str, Any], variants: Sequence[str], *, steps: int,
                world_size: int) -> dict[str, Any]:
        assert list(variants) == ["monitor"] and (steps, world_size) == (5, 4)
        # Its runs take the untimed steps first, then the timed ones, on the --device asked for.
        assert (base["steps"], base["world_size"], base["device"]) == (overhead.WARMUP + 5, 4, "cpu")
        (runs_dir / "monitor").mkdir(parents=True)
        (runs_dir / "monitor" / "config.json").write_text(json.dumps({"monitor": {"sketch_dim": 64}}))
        return {"plain": {"wall_ms": 4.0, "cpu_ms": 3.0, "parameters": 7},
                "monitor": {"wall": 1.25, "wall_blocks": [1.25] * 5, "cpu": 1.5, "cpu_blocks": [1.5] * 5}}

    syncs = {"sync-noop": [("noop", 24, 0.001), ("noop", 48, 0.009), ("noop", 24, 0.002)],
             # An even count: the mean of the two middle ones was a float that printed as 9.722e+06.
             "sync-repair": [("majority-copy", b, 0.01) for b in (9721840, 9721856, 9721848, 9721900)]}
    configs = {}

    def run_all(runs: list[Run], world_size: int) -> None:
        assert world_size == 4
        for r in runs:
            configs[r.labels["variant"]] = r.config
            # A guard's repair is no sync of the period's: left out of the sync table.
            repair = {"step": 1, "event": "repair", "mode": "majority-copy", "bytes_sent": 10**9, "seconds": 9.0}
            _jsonl(pathlib.Path(r.config["run_dir"]) / "events.jsonl", [{"step": 0, "event": "guard"}, repair] + [
                {"step": 5 * i, "event": "sync", "mode": m, "bytes_sent": b, "seconds": sec}
                for i, (m, b, sec) in enumerate(syncs[r.labels["variant"]])])

    monkeypatch.setattr(overhead, "measure", measure)
    monkeypatch.setattr(scaling, "run_all", run_all)
    out = tmp_path / "scaling"
    out.mkdir()
    results = scaling.run(out, world_sizes=(4,), steps=5, device="cpu")
    # PAFT-Sync alone (no monitor), synchronous, at least two syncs in 5 steps; the repair run
    # flips rank 1's mantissas every step, the no-op run none.
    assert sorted(configs) == ["sync-noop", "sync-repair"]
    for variant, c in configs.items():
        assert c["run_dir"] == str(out / "runs" / f"ws4-{variant}")
        assert (c["steps"], c["world_size"], c["device"], c["monitor"]["enabled"]) == (5, 4, "cpu", False)
        assert (c["eval_every"], c["eval_batches"], c["warmup_steps"], c["checkpoint_every"]) == (5, 1, 1, 0)
        assert (c["protect"]["mode"], c["protect"]["sync_period"], c["protect"]["overlap"]) == ("sync", 2, False)
    assert configs["sync-noop"]["inject"] == []
    assert configs["sync-repair"]["inject"] == ["bitflip:rate=1,bits=mantissa,ranks=1"]
    m = results["measured"]["4"]
    assert (m["monitor_step_time_ratio"], m["monitor_cpu_ratio"], m["plain_step_ms"]) == (1.25, 1.5, 4.0)
    assert m["syncs"] == {"noop": {"count": 3, "bytes_sent_rank0": 24, "seconds": 0.002},
                          "majority-copy": {"count": 4, "bytes_sent_rank0": 9721848, "seconds": 0.01}}
    assert type(m["syncs"]["majority-copy"]["bytes_sent_rank0"]) is int
    md = (out / "results.md").read_text()
    # Both costs are ratios to plain DDP, the CPU one too (its header once read "CPU per step", as if ms).
    assert "| monitored / plain DDP step time | monitored / plain DDP CPU per step | plain DDP step (ms) |" in md
    assert "| 4 | 64 | 584 / 1752 | 1.25 | 1.5 | 4 |" in md
    assert "| 4 | majority-copy | 4 | 9721848 | 10 |\n| 4 | noop | 3 | 24 | 2 |" in md  # the modes in order
    # The jobs calculated with the runs' k = 64: 8 * (9 + 64) = 584 B per rank's row.
    assert set(results["calculated"]) == {"4x800000", "64x1.3e+09", "1024x7e+09"}
    # 584 * 1023 B in, over 2 * 1023/1024 * 7e9 * 4 B of gradients; 84 GB of state at 50 GB/s, 1023 times.
    assert "| 1024 | 7e+09 | 0.597 MB | 1.07e-05 | 24 B / 24.6 KB | 84 GB (1.68 s) | 8.59e+04 GB (1718.6 s) |" in md
