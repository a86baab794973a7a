"""Tests of :func:`paft.rundata.load_run` on small run directories written by hand (no
training: ``report_test`` covers the directories a real run writes)."""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import pytest

from paft.rundata import ReportError, load_run, mean_local_loss


def _write(path: pathlib.Path, records: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_a_re_done_step_is_read_as_its_last_record_in_step_order(tmp_path: pathlib.Path) -> None:
    # A resumed run re-does the steps after its checkpoint: the records of the leg that
    # was cut off come first in the file, the re-done ones after them.
    (tmp_path / "config.json").write_text(json.dumps({"world_size": 1, "steps": 3}))
    _write(tmp_path / "metrics" / "rank0.jsonl",
           [{"step": s, "local_loss": loss} for s, loss in ((0, 4.0), (1, 3.9), (2, 3.8), (1, 3.5), (2, 3.4))])
    _write(tmp_path / "consistency.jsonl",
           [{"step": s, "consistency/loss_cv": cv} for s, cv in ((0, 0.1), (2, 0.2), (1, 0.3), (2, 0.4))])
    _write(tmp_path / "evals.jsonl", [{"step": 2, "val_loss": 3.9}, {"step": 0, "val_loss": 4.1},
                                      {"step": 2, "val_loss": 3.7}])
    run = load_run(tmp_path)
    assert [(r["step"], r["local_loss"]) for r in run.metrics[0]] == [(0, 4.0), (1, 3.5), (2, 3.4)]
    assert [(r["step"], r["consistency/loss_cv"]) for r in run.consistency] == [(0, 0.1), (1, 0.3), (2, 0.4)]
    assert [(r["step"], r["val_loss"]) for r in run.evals] == [(0, 4.1), (2, 3.7)]
    assert run.last_step == 2


def test_only_rank_files_are_metrics_and_the_world_size_falls_back(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text("{}")  # a library user's config may not say its world size
    for name in ("rank0.jsonl", "rank1.jsonl", "rank1 (copy).jsonl", "rank_old.jsonl"):
        _write(tmp_path / "metrics" / name, [{"step": 0, "local_loss": 1.0}])
    _write(tmp_path / "metrics" / "rank2.jsonl", [])  # a rank that had not finished a step: no rank of the records
    run = load_run(tmp_path)  # a user's stray copies are no ranks of the run
    assert list(run.metrics) == [0, 1] and run.world_size == 2  # the ranks recorded
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 1, "world_size": 3}))
    assert load_run(tmp_path).world_size == 3  # the summary's: a rank may have recorded nothing
    (tmp_path / "summary.json").unlink()  # a run still running: its config says
    (tmp_path / "config.json").write_text(json.dumps({"world_size": 4}))
    assert load_run(tmp_path).world_size == 4


def test_a_run_given_as_dot_is_named_by_its_directory(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "config.json").write_text("{}")
    _write(tmp_path / "metrics" / "rank0.jsonl", [{"step": 0, "local_loss": 1.0}])
    monkeypatch.chdir(tmp_path)
    assert load_run(".").name == tmp_path.name


def test_word_fields_stay_words_and_other_fields_are_numbers(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    # "hit_fraction" ends like the word field "action" but is no such field: a number.
    _write(tmp_path / "metrics" / "rank0.jsonl", [{"step": 0, "local_loss": "NaN", "faults/hit_fraction": 0.25}])
    _write(tmp_path / "faults.jsonl", [{"step": 0, "rank": 0, "site": "grad", "kind": "nan"}])
    run = load_run(tmp_path)
    assert run.faults[0]["kind"] == "nan"  # the fault kind, not a float NaN
    assert run.metrics[0][0]["faults/hit_fraction"] == 0.25 and math.isnan(run.metrics[0][0]["local_loss"])
    _write(tmp_path / "metrics" / "rank0.jsonl", [{"step": True, "local_loss": 1.0}])  # JSON's true is no step
    with pytest.raises(ReportError, match="rank0.jsonl: record 1: step must be an integer >= 0, got True"):
        load_run(tmp_path)


@pytest.mark.parametrize("key", ["steps", "world_size", "steps_per_s", "wall_s", "replicas_distinct",
                                 "max_replica_rel_diff", "faults_injected", "syncs", "detections", "recomputes",
                                 "skipped_batches", "initial_loss", "final_val_loss"])
def test_every_summary_number_the_report_computes_with_is_checked(tmp_path: pathlib.Path, key: str) -> None:
    (tmp_path / "config.json").write_text("{}")
    _write(tmp_path / "metrics" / "rank0.jsonl", [{"step": 0, "local_loss": 1.0}])
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 1, key: "x"} if key != "steps" else {key: "x"}))
    with pytest.raises(ReportError, match=f"summary.json: {key} must be a number, got 'x'"):
        load_run(tmp_path)


def test_the_mean_loss_of_losses_whose_sum_passes_float64s_range_is_finite() -> None:
    metrics = {r: [{"step": 0, "local_loss": 1e308}, {"step": 1, "local_loss": 2.0 * r}] for r in range(3)}
    assert mean_local_loss(metrics) == ([0, 1], [1e308, 2.0])


@pytest.mark.parametrize("name", ["summary.json", "events.jsonl", "evals.jsonl"])
def test_a_folder_in_a_record_files_place_is_named_not_read_as_missing(tmp_path: pathlib.Path, name: str) -> None:
    # Missing means nothing to show for that layer; something there that cannot be read is
    # damage, named (a folder read as missing left its layer out without a word).
    (tmp_path / "config.json").write_text("{}")
    _write(tmp_path / "metrics" / "rank0.jsonl", [{"step": 0, "local_loss": 1.0}])
    (tmp_path / name).mkdir()
    with pytest.raises(ReportError, match=f"{name}: cannot read"):
        load_run(tmp_path)


def test_a_library_folder_reads_each_ranks_loss_from_its_consistency_records(tmp_path: pathlib.Path) -> None:
    # What a RunRecorder writes: no config.json, an empty metrics/ folder; the monitor's
    # records hold every rank's loss (a replica check's record between its metric steps too).
    (tmp_path / "metrics").mkdir()
    _write(tmp_path / "consistency.jsonl", [
        {"step": 0, "loss": 2.0, "local_losses": [1.0, 3.0], "consistency/loss_cv": 0.5},
        {"step": 2, "loss": "NaN", "local_losses": [2.5, "NaN"], "replicas/grad_distinct": 2},
        {"step": 0, "loss": 1.5, "local_losses": [1.0, 2.0]},  # re-done: the last record wins
        {"step": 4, "loss": 1.0, "local_losses": [0.5, 1.5]},
    ])
    run = load_run(tmp_path)
    assert run.library and run.config == {} and run.summary is None and run.world_size == 2
    # As text: NaN equals nothing, itself included.
    assert {r: str([(m["step"], m["local_loss"], m["loss"]) for m in ms]) for r, ms in run.metrics.items()} == {
        0: "[(0, 1.0, 1.5), (2, 2.5, nan), (4, 0.5, 1.0)]",
        1: "[(0, 2.0, 1.5), (2, nan, nan), (4, 1.5, 1.0)]",
    }
    assert run.last_step == 4 and str(mean_local_loss(run.metrics)) == "([0, 2, 4], [1.5, nan, 1.0])"
    # A config.json makes it paft train's folder, whose losses are its metrics files'.
    (tmp_path / "config.json").write_text("{}")
    _write(tmp_path / "metrics" / "rank0.jsonl", [{"step": 0, "local_loss": 9.0}])
    run = load_run(tmp_path)
    assert not run.library and run.metrics == {0: [{"step": 0, "local_loss": 9.0}]}


def test_a_library_folders_losses_of_the_wrong_kind_are_named(tmp_path: pathlib.Path) -> None:
    _write(tmp_path / "consistency.jsonl", [{"step": 0, "loss": 1.0, "local_losses": 1.0}])
    with pytest.raises(ReportError, match="consistency.jsonl: record 1: local_losses must be a list, got 1.0"):
        load_run(tmp_path)
