"""Tests of the run directory's record helpers (single process)."""

from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from paft.config import TrainConfig
from paft.records import (
    BENCH_MARKER,
    REPORT_MARKER,
    RunRecorder,
    atomic_write_bytes,
    atomic_write_json,
    from_jsonable,
    from_jsonable_float,
    is_file,
    jsonable,
    max_or_nan,
    output_dir_problem,
    path_name_problem,
    read_jsonl,
    sort_faults,
    truncate_jsonl,
)

floats = st.floats(allow_nan=True, allow_infinity=True)
values = st.recursive(floats | st.integers() | st.text(alphabet="abc"),
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text("xyz"), inner, max_size=3))


def _same(a: object, b: object) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@given(values)
def test_from_jsonable_inverts_jsonable_through_json(value: object) -> None:
    assert _same(from_jsonable(json.loads(json.dumps(jsonable(value)))), value)


def test_jsonable_is_strict_json_with_string_keys() -> None:
    # Python's json writes Infinity and NaN, which other readers refuse; and sort_keys
    # fails on keys of mixed types.
    value = jsonable({1: math.inf, "a": (1.5, -math.inf, {"b": math.nan})})
    assert value == {"1": "inf", "a": [1.5, "-inf", {"b": "nan"}]}
    json.dumps(value, allow_nan=False, sort_keys=True)


@pytest.mark.parametrize("text", ["Inf", "INF", "-Inf", "NaN"])
def test_from_jsonable_float_reads_any_case(text: str) -> None:
    value = from_jsonable_float(text)
    assert isinstance(value, float) and str(value) == text.lower()


def test_max_or_nan_takes_a_nan_wherever_it_is() -> None:
    assert math.isnan(max_or_nan([1.0, math.nan, 3.0]))  # max() gives 3.0
    assert math.isnan(max_or_nan([math.nan, 1.0]))
    assert max_or_nan([1.0, math.inf, 3.0]) == math.inf
    assert max_or_nan(iter([2.0, 5.0])) == 5.0


def _tags(tb: pathlib.Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    return sorted(acc.Tags()["scalars"])


def _scalars(tb: pathlib.Path, key: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb))
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(key)]


@pytest.mark.usefixtures("no_tensorboard")
def test_a_recorder_with_tensorboard_refuses_at_once_without_its_package(tmp_path: pathlib.Path) -> None:
    # A library user's recorder (or a trainer started without paft train's checks) was
    # refused by a bare ImportError at rank 0's first scalar, while the other ranks went on.
    # The message names the call, not the command line's --tensorboard it never passed.
    for rank in (0, 1):
        with pytest.raises(ModuleNotFoundError, match=r"^RunRecorder\(tensorboard=True\): needs the tensorboard "
                                                      r"package, which is not installed: pip install "
                                                      r"'paft\[tensorboard\]'$"):
            RunRecorder(tmp_path / "r", rank, tensorboard=True)
    assert not (tmp_path / "r").exists()  # refused before it wrote anything
    RunRecorder(None, 0, tensorboard=True)  # nothing is recorded, so nothing needs the package
    RunRecorder(tmp_path / "r", 0)


def test_a_resume_hides_the_interrupted_legs_tensorboard_scalars(tmp_path: pathlib.Path) -> None:
    # As the trainer logs: training scalars at the steps done, the consistency record
    # of 0-based step t (which the resume's truncation drops from t = 4 on) at t + 1.
    first = RunRecorder(tmp_path, 0, tensorboard=True, quiet=True)
    for done in range(1, 10):  # checkpointed after 4 steps, interrupted after 9
        first.consistency({"step": done - 1, "consistency/loss_cv": float(done)})
        first.scalars(done, {"train/loss": float(done)})
    first.close()
    resumed = RunRecorder(tmp_path, 0, tensorboard=True, quiet=True)
    resumed.resumed_at(4)
    for done in range(5, 8):  # the resumed leg re-does steps 5.. (other values here, to tell them apart)
        resumed.consistency({"step": done - 1, "consistency/loss_cv": 100.0 + done})
        resumed.scalars(done, {"train/loss": 100.0 + done})
    resumed.close()
    expect = [(1, 1), (2, 2), (3, 3), (4, 4), (5, 105), (6, 106), (7, 107)]
    assert _tags(tmp_path / "tb") == ["consistency/loss_cv", "train/loss"]  # not the record's step
    assert _scalars(tmp_path / "tb", "train/loss") == expect
    assert _scalars(tmp_path / "tb", "consistency/loss_cv") == expect


def test_a_resumed_legs_event_file_sorts_after_the_interrupted_legs(tmp_path: pathlib.Path) -> None:
    # TensorBoard reads event files in name order: start second, host, pid. An interrupted
    # leg started in this very second by a process whose host and pid sort after ours:
    # the resumed leg's file sorted first, and TensorBoard showed steps 5-9 twice.
    first = RunRecorder(tmp_path, 0, tensorboard=True, quiet=True)
    for done in range(1, 10):
        first.scalars(done, {"train/loss": float(done)})
    first.close()
    (written,) = (tmp_path / "tb").iterdir()
    start = written.name.split(".")[3]
    written.rename(written.with_name(f"events.out.tfevents.{start}.zzzz.99999.0"))
    resumed = RunRecorder(tmp_path, 0, tensorboard=True, quiet=True)
    resumed.resumed_at(4)
    for done in range(5, 8):
        resumed.scalars(done, {"train/loss": 100.0 + done})
    resumed.close()
    names = sorted(f.name for f in (tmp_path / "tb").iterdir())
    assert names[0].startswith(f"events.out.tfevents.{start}.zzzz.") and len(names) == 2
    assert _scalars(tmp_path / "tb", "train/loss") == [(1, 1), (2, 2), (3, 3), (4, 4), (5, 105), (6, 106), (7, 107)]


def test_a_console_that_went_away_stops_no_work(tmp_path: pathlib.Path) -> None:
    # `paft train | head -1`: the run had finished, and its summary line made it exit 1.
    (tmp_path / "work.py").write_text(
        "import sys\n"
        "from paft.records import console\n"
        "first = console('x' * 2**20)  # more than a pipe holds: written after the reader is gone\n"
        "second = console('again')  # into /dev/null now\n"
        "sys.stderr.write(f'{first} {second} done')\n"
    )
    proc = subprocess.run(["bash", "-c", f"{sys.executable} work.py | true; exit ${{PIPESTATUS[0]}}"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stderr) == (0, "False True done")


def test_sort_faults_orders_by_step_attempt_rank_and_keeps_each_ranks_order(tmp_path: pathlib.Path) -> None:
    # Two identical runs' ranks append their lines in another interleaving each time.
    lines = {r: [{"step": s, "attempt": a, "rank": r, "site": site, "before": [0.1 * r]}
                 for s, a, site in ((0, 0, "params"), (0, 0, "aggregation"), (0, 1, "aggregation"), (3, 0, "x"))]
             for r in range(3)}
    files = []
    for order in ([0, 1, 2], [2, 0, 1]):
        run = tmp_path / "".join(map(str, order))
        recorders = {r: RunRecorder(run, r) for r in order}
        for i in range(4):
            for r in order:
                recorders[r].faults([lines[r][i]])
        for recorder in recorders.values():
            recorder.close()
        sort_faults(run)
        files.append((run / "faults.jsonl").read_bytes())
    assert files[0] == files[1]
    got = read_jsonl(tmp_path / "012" / "faults.jsonl")
    assert [(f["step"], f["attempt"], f["rank"], f["site"]) for f in got] == [
        (0, 0, r, site) for r in range(3) for site in ("params", "aggregation")
    ] + [(0, 1, r, "aggregation") for r in range(3)] + [(3, 0, r, "x") for r in range(3)]
    # A damaged file is left for --resume to name, a missing one not made.
    damaged = b'{"step": 2, "rank": 0}\nnot json\n{"step": 1, "rank": 0}\n'
    (tmp_path / "012" / "faults.jsonl").write_bytes(damaged)
    sort_faults(tmp_path / "012")
    assert (tmp_path / "012" / "faults.jsonl").read_bytes() == damaged
    sort_faults(tmp_path / "none")
    assert not (tmp_path / "none").exists()
    # A bare NaN token (valid to Python's json, not to JSON) is rewritten as paft writes it.
    (tmp_path / "012" / "faults.jsonl").write_text('{"step": 2, "after": [NaN]}\n{"step": 1, "after": [1.5]}\n')
    sort_faults(tmp_path / "012")
    rewritten = (tmp_path / "012" / "faults.jsonl").read_text()
    assert rewritten == '{"after": [1.5], "step": 1}\n{"after": ["nan"], "step": 2}\n'


LIMIT = os.pathconf(".", "PC_NAME_MAX")


@pytest.mark.parametrize("parts,too_long", [
    (["a" * LIMIT], False),
    (["a" * (LIMIT + 1)], True),
    (["\u00e9" * (LIMIT // 2 + 1)], True),  # fewer characters than bytes
    (["a" * (LIMIT + 1), "run"], True),  # a parent's name
])
def test_a_name_longer_than_the_file_system_allows_is_refused(parts: list[str], too_long: bool) -> None:
    problem = path_name_problem(pathlib.Path("out", *parts), "--out")
    assert (problem is not None and "is longer than the file system allows" in problem) == too_long


def test_an_output_folder_the_file_system_cannot_look_at_is_refused(tmp_path: pathlib.Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def denied(path: pathlib.Path) -> bool:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(pathlib.Path, "exists", denied)
    problem = output_dir_problem(tmp_path / "out", "--out", {}, overwrite=False)
    assert problem == f"--out: cannot use {tmp_path / 'out'}: Permission denied"


def _ours(path: pathlib.Path) -> bool:
    return path.is_file()


@pytest.mark.parametrize("make,overwrite,problem", [
    ({"a/.paft-bench": ""}, True, None),  # either marker marks paft's folder
    ({"a/.paft-bench": "", "a/x": ""}, False, "--out: {a} already exists; pass --overwrite to replace it"),
    ({"a/x": ""}, True, "--overwrite: {a} holds no config.json or .paft-bench of paft's, so it is not paft's "
                        "output; refusing to delete it"),
    ({"a": ""}, False, "--out: {a} exists and is not a directory"),
    ({"real/config.json": "", "a": "->real"}, True, "--overwrite: {a} is a symbolic link; give the real "
                                                    "directory to replace"),
    # It advised --overwrite, which then refused the link.
    ({"real/config.json": "", "a": "->real"}, False, "--out: {a} already exists, as a symbolic link to {real}; "
                                                     "give that real directory with --overwrite to replace it"),
    ({"a": "->real"}, False, "--out: {a} is a symbolic link to nothing (real)"),
    ({"real/": None, "a": "->real"}, False, None),
])
def test_output_dir_problem(tmp_path: pathlib.Path, make: dict[str, str | None], overwrite: bool,
                            problem: str | None) -> None:
    for name, text in make.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            path.mkdir()
        elif text.startswith("->"):
            path.symlink_to(text[2:])
        else:
            path.write_text(text)
    markers = {"config.json": _ours, ".paft-bench": _ours}
    got = output_dir_problem(tmp_path / "a", "--out", markers, overwrite)
    assert got == (problem and problem.format(a=tmp_path / "a", real=(tmp_path / "real").resolve()))


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_folder_of_another_paft_command_is_refused_as_what_it_is(tmp_path: pathlib.Path, overwrite: bool) -> None:
    # A run directory given as paft bench's --out (or paft report's --out-dir) was called
    # "not paft's output".
    run, report = tmp_path / "run", tmp_path / "report"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(TrainConfig().to_dict()))
    report.mkdir()
    (report / REPORT_MARKER).write_text("")
    said, what = ("--overwrite", "refusing to delete it") if overwrite else ("--out", "pick another")
    got = output_dir_problem(run, "--out", {BENCH_MARKER: is_file}, overwrite)
    assert got == (f"{said}: {run} is a paft train run directory (its config.json), not a folder --out writes "
                   f"(it holds no .paft-bench); {what}")
    got = output_dir_problem(report, "--out", {BENCH_MARKER: is_file}, overwrite)
    assert got == (f"{said}: {report} is a paft report folder (its .paft-report), not a folder --out writes "
                   f"(it holds no .paft-bench); {what}")


def test_atomic_writes_make_shared_files_and_leave_no_temporary(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "new" / "summary.json"
    atomic_write_json(path, {"b": math.inf, "a": 1})
    assert path.read_text() == '{\n  "a": 1,\n  "b": "inf"\n}\n'
    umask = os.umask(0o022)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # mkstemp's own mode is 0600
    (tmp_path / "dir").mkdir()
    with pytest.raises(IsADirectoryError):
        atomic_write_bytes(tmp_path / "dir", b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "new"]


def test_an_atomic_write_is_on_disk_before_it_replaces_the_old_file(tmp_path: pathlib.Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # A crash after the rename must not leave a checkpoint's "latest" or summary.json
    # empty: the data is synced while the old file still stands (a mutant without the
    # fsync survived).
    path = tmp_path / "latest"
    path.write_bytes(b"step0000006")
    synced: list[tuple[int, bytes]] = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append((os.fstat(fd).st_size, path.read_bytes())))
    atomic_write_bytes(path, b"step0000012")
    assert synced == [(11, b"step0000006")] and path.read_bytes() == b"step0000012"


def test_read_jsonl_drops_a_partial_last_line_and_names_any_other_damage(tmp_path: pathlib.Path) -> None:
    assert read_jsonl(tmp_path / "missing.jsonl") == []
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 0}\n\n{"step": 1}\n{"step": 2, "lo')  # a writer killed mid-record
    assert read_jsonl(log) == [{"step": 0}, {"step": 1}]
    log.write_text('{"step": 0}\n\n[1]\n{"step": 2}\n')
    with pytest.raises(ValueError, match="log.jsonl: line 3 is not a JSON object"):
        read_jsonl(log)
    log.write_text('{"step": 0}\n{"step": 1, "lo\n')  # a whole line (its newline written): damage, not a cut
    with pytest.raises(ValueError, match="log.jsonl: line 2 is not JSON"):
        read_jsonl(log)
    log.write_text('{"step": 0}\nnot json\n{"step": 2, "lo')  # damage before a cut last line
    with pytest.raises(ValueError, match="log.jsonl: line 2 is not JSON"):
        read_jsonl(log)


def test_is_file_is_false_where_the_file_system_cannot_look(tmp_path: pathlib.Path) -> None:
    assert not is_file(tmp_path / ("a" * (LIMIT + 1)))
    (tmp_path / "f").write_text("")
    assert is_file(tmp_path / "f")


@pytest.mark.parametrize("denied,exists,problem", [
    (os.W_OK, True, "--out: {a} is not writable"),
    (os.W_OK, False, "--out: cannot create {a}: {parent} is not writable"),
    (os.X_OK, False, "--out: cannot create {a}: {parent} is not writable"),  # cannot enter it
])
def test_an_output_folder_paft_cannot_write_is_refused(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                       denied: int, exists: bool, problem: str) -> None:
    # As root every access is allowed: os.access answers as for another user.
    monkeypatch.setattr(os, "access", lambda path, mode: not mode & denied)
    if exists:
        (tmp_path / "a").mkdir()
    got = output_dir_problem(tmp_path / "a", "--out", {}, overwrite=False)
    assert got == problem.format(a=tmp_path / "a", parent=tmp_path)


def test_only_rank_0_writes_the_shared_records(tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    for rank in (1, 0):
        recorder = RunRecorder(tmp_path, rank, tensorboard=True, quiet=rank == 0)
        recorder.say("progress")  # rank 1 never speaks; rank 0 is quiet
        recorder.jsonl("evals.jsonl", {"step": 0})
        recorder.consistency({"step": 0, "consistency/loss_cv": 1.0})
        recorder.event({"step": 0, "kind": "alert"})
        recorder.scalars(1, {"train/loss": 1.0})  # TensorBoard too
        recorder.metrics({"step": 0, "loss": math.inf})
        recorder.faults([{"step": 0, "rank": rank}])
        recorder.close()
        if rank == 1:
            assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [  # no tb/
                "faults.jsonl", "metrics", "metrics/rank1.jsonl"]
    assert capsys.readouterr().out == ""
    assert (tmp_path / "metrics" / "rank1.jsonl").read_text() == '{"loss": "inf", "step": 0}\n'
    assert [r["rank"] for r in read_jsonl(tmp_path / "faults.jsonl")] == [1, 0]
    assert all(len(read_jsonl(tmp_path / name)) == 1 for name in ("evals.jsonl", "consistency.jsonl", "events.jsonl"))


def test_a_resume_keeps_why_the_interrupted_leg_ended(tmp_path: pathlib.Path) -> None:
    # The launcher's "failed" line (and the trainer's "stop") names the step the leg
    # ended at, after its last checkpoint: the resume cut it away with the steps it
    # re-does, and the run no longer said why it had stopped.
    first = RunRecorder(tmp_path, 0, quiet=True)
    for step in (3, 5):
        first.event({"step": step, "event": "guard", "action": "recompute"})
    first.event({"step": 5, "event": "guard", "action": "stop"})  # a library run's stop: the verdict alone
    first.event({"step": 6, "event": "stop", "ranks": [1], "reason": "x"})
    first.event({"step": 6, "event": "failed", "rank": 1, "cause": "failed: ValueError: x", "traceback": None})
    first.event({"step": 7, "event": "interrupted", "signal": "SIGTERM"})  # the launcher's, for a signal
    first.close()
    resumed = RunRecorder(tmp_path, 0, quiet=True, append=True)
    resumed.resumed_at(4)
    resumed.drop_resumed_steps()
    resumed.close()
    assert [(e["step"], e["event"]) for e in read_jsonl(tmp_path / "events.jsonl")] == [
        (3, "guard"), (5, "guard"), (6, "stop"), (6, "failed"), (7, "interrupted")]


def test_truncate_jsonl_drops_the_steps_a_resume_redoes(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "events.jsonl"
    log.write_text("".join(json.dumps(r) + "\n" for r in [{"step": 2}, {"kind": "start"}, {"step": 3}, {"step": 4}]))
    truncate_jsonl(log, 3)
    assert read_jsonl(log) == [{"step": 2}, {"kind": "start"}]
    truncate_jsonl(tmp_path / "none.jsonl", 3)
    assert not (tmp_path / "none.jsonl").exists()
