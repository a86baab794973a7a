"""Tests of :func:`paft.rundata.load_run` on small run directories written by hand (no
training: ``report_test`` covers the directories a real run writes)."""

from __future__ import annotations

import json
import pathlib
from typing import Any

from paft.rundata import load_run


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
    run = load_run(tmp_path)  # a user's stray copies are no ranks of the run
    assert list(run.metrics) == [0, 1] and run.world_size == 2  # the ranks recorded
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 1, "world_size": 3}))
    assert load_run(tmp_path).world_size == 3  # the summary's: a rank may have recorded nothing
