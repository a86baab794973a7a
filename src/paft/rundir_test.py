"""Tests of the run directory's checks (single process): fake run directories, a
``config.json`` and checkpoint files holding just the keys a checkpoint needs."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import zipfile
from typing import Any

import pytest
import torch

from paft.config import GuardConfig, ProtectConfig, TrainConfig
from paft.records import _RUN_CONFIG_KEYS
from paft.rundir import (
    _CHECKPOINT_KEYS,
    RunDirError,
    check_run_dir,
    checkpoint_candidates,
    default_run_dir,
    load_checkpoint_file,
    prepare_run_dir,
    records_size,
    remove_checkpoint_temporaries,
    write_config,
)
from paft.workloads import model_config

N_LAYER = model_config("gpt", {}).n_layer


def _config(run_dir: pathlib.Path, **overrides: Any) -> TrainConfig:
    return TrainConfig(**{"world_size": 2, "steps": 12, "batch_size": 16, "run_dir": str(run_dir), **overrides})


def _fake_run(cfg: TrainConfig, steps: tuple[int, ...] = (6, 12), held: TrainConfig | None = None,
              options: bool = True, scheduled: bool = False) -> pathlib.Path:
    """The run directory a run of ``cfg`` leaves: config.json and, for each of ``steps``,
    every rank's checkpoint, holding ``held``'s options (``cfg``'s by default; none
    without ``options``, as before checkpoints held them), and ``latest`` naming the last.
    With ``scheduled`` each checkpoint's protector holds a sync scheduler whose period is
    its step."""
    path = prepare_run_dir(cfg)
    state = {**dict.fromkeys(_CHECKPOINT_KEYS), **({"config": (held or cfg).to_dict()} if options else {})}
    for step in steps:
        (path / "checkpoints" / f"step{step:07d}").mkdir(parents=True)
        protector = {"scheduler": {"period": step}} if scheduled else None
        for rank in range(cfg.world_size):
            torch.save({**state, "protector": protector}, path / "checkpoints" / f"step{step:07d}" / f"rank{rank}.pt")
    (path / "checkpoints" / "latest").write_text(f"step{steps[-1]:07d}\n")
    return path


def _resume(cfg: TrainConfig, **changes: Any) -> TrainConfig:
    return dataclasses.replace(cfg, resume=True, **changes)


@pytest.mark.parametrize("before,changes", [
    ({}, {"steps": 20}),
    ({}, {"model": {"n_layer": N_LAYER}}),  # the default, spelled out
    ({}, {"protect": ProtectConfig(sync_mode="mean")}),  # no sync, so no sync mode, takes effect
    ({"protect": ProtectConfig(mode="sync")}, {"protect": ProtectConfig(mode="sync", sync_period=7)}),
], ids=["steps", "model-default", "sync-mode-unused", "sync-period-of-sync"])
def test_a_resume_that_changes_nothing_fixed_is_accepted(tmp_path: pathlib.Path, before: dict[str, Any],
                                                         changes: dict[str, Any]) -> None:
    cfg = _config(tmp_path / "r", **before)
    _fake_run(cfg)
    check_run_dir(_resume(cfg, **changes))


def test_a_resume_returns_the_schedule_of_the_checkpoint_it_continues_from(tmp_path: pathlib.Path) -> None:
    """paft train's plan says the period PAFT-Dyn goes on with (it said the configured
    first H): the saved scheduler's, of the checkpoint the workers will load, the older
    one where a rank's file of the latest is damaged."""
    cfg = _config(tmp_path / "r", protect=ProtectConfig(mode="dyn"))
    path = _fake_run(cfg, scheduled=True)
    assert check_run_dir(_resume(cfg, steps=20)) == (12, {"period": 12})
    rank_file = path / "checkpoints" / "step0000012" / "rank1.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:100])
    assert check_run_dir(_resume(cfg, steps=20)) == (6, {"period": 6})
    plain = _config(tmp_path / "plain")
    _fake_run(plain)
    assert check_run_dir(_resume(plain, steps=20)) == (12, None)  # no protector: no schedule
    assert check_run_dir(_config(tmp_path / "new")) is None


@pytest.mark.usefixtures("no_tensorboard")
def test_a_run_with_tensorboard_resumes_without_it_where_it_is_not_installed(tmp_path: pathlib.Path) -> None:
    # Refused: "cannot read config.json: ... needs the tensorboard package", though the
    # resume itself asked --no-tensorboard (config.json and the checkpoint say --tensorboard).
    cfg = _config(tmp_path / "r", tensorboard=True)
    _fake_run(cfg)
    check_run_dir(_resume(cfg, tensorboard=False, steps=20))


@pytest.mark.parametrize("held", ["config.json", "checkpoint"])
@pytest.mark.parametrize("before,changes,said", [
    ({}, {"seed": 1}, "--seed (0 in"),
    ({}, {"desync_shuffle": True}, "--desync-shuffle (False in"),
    ({}, {"desync_seed": True}, "--desync-seed (False in"),
    ({}, {"guard": GuardConfig(enabled=True)}, "--guard (False in"),
    ({}, {"model": {"n_embd": 64}}, "--model ({'n_embd': 128} in"),  # only the fields that differ
    ({"protect": ProtectConfig(mode="dyn")}, {"protect": ProtectConfig(mode="dyn", sync_mode="mean")},
     "--sync-mode ('robust' in"),
    # PAFT-Dyn's first period: the resumed scheduler went on from its saved one, and the
    # report drew config.json's new one from step 0.
    ({"protect": ProtectConfig(mode="dyn")}, {"protect": ProtectConfig(mode="dyn", sync_period=7)},
     "--sync-period (50 in"),
])
def test_a_resume_that_changes_a_fixed_option_is_refused(tmp_path: pathlib.Path, before: dict[str, Any],
                                                         changes: dict[str, Any], said: str, held: str) -> None:
    # Checked against config.json (all that checkpoints written before they held their
    # options have), and against the checkpoint's own options (config.json edited).
    cfg = _config(tmp_path / "r", **before)
    if held == "config.json":
        _fake_run(cfg, options=False)
        where = str(tmp_path / "r")
    else:
        _fake_run(dataclasses.replace(cfg, **changes), held=cfg)
        where = "its checkpoint step0000012"
    with pytest.raises(RunDirError, match=re.escape(f"--resume: cannot change {said} {where}, ")):
        check_run_dir(_resume(cfg, **changes))


@pytest.mark.parametrize("saved,error", [
    ({"steps": 0}, "TrainConfig.steps (--steps): must be >= 1, got 0"),  # the resume's own --steps 20 passed
    ({"monitor": 3}, "'int' object is not iterable"),
    ([1], "'list' object has no attribute 'get'"),
])
def test_a_resume_names_a_config_json_that_no_longer_reads_as_options(tmp_path: pathlib.Path, saved: Any,
                                                                       error: str) -> None:
    # A RunDirError (exit code 2), not the ValueError, TypeError or AttributeError that
    # rebuilding the options raised: `paft train` catches only RunDirError here.
    cfg = _config(tmp_path / "r")
    path = _fake_run(cfg)
    (path / "config.json").write_text(json.dumps({**cfg.to_dict(), **saved} if isinstance(saved, dict) else saved))
    with pytest.raises(RunDirError, match=re.escape(f"--resume: cannot read {path / 'config.json'}: {error}")):
        check_run_dir(_resume(cfg, steps=20))


def test_a_resume_names_a_checkpoint_whose_options_do_not_read(tmp_path: pathlib.Path) -> None:
    cfg = _config(tmp_path / "r")
    rank0 = _fake_run(cfg, steps=(12,)) / "checkpoints" / "step0000012" / "rank0.pt"
    torch.save({**dict.fromkeys(_CHECKPOINT_KEYS), "config": {**cfg.to_dict(), "monitor": 3}}, rank0)
    with pytest.raises(RunDirError, match=re.escape(f"--resume: {rank0} holds unreadable options: 'int' object is not "
                                                    "iterable")):
        check_run_dir(_resume(cfg, steps=20))


@pytest.mark.parametrize("steps,summary,refused", [
    (12, {"steps": 12}, True),  # the run ended
    (12, None, False),  # stopped before summary.json: the resume writes it
    (12, {"steps": 12.0}, False),  # not a step count: as if unreadable
    (10, None, True),
    (13, {"steps": 12}, False),
])
def test_a_resume_must_train_on_or_finish_the_summary(tmp_path: pathlib.Path, steps: int,
                                                      summary: dict[str, Any] | None, refused: bool) -> None:
    cfg = _config(tmp_path / "r")
    path = _fake_run(cfg)
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    resume = _resume(cfg, steps=steps)
    if refused:
        with pytest.raises(RunDirError, match=f"has trained 12 steps already \\(--steps {steps}\\)"):
            check_run_dir(resume)
    else:
        check_run_dir(resume)


def test_a_resume_falls_back_to_the_newest_checkpoint_intact_on_every_rank(tmp_path: pathlib.Path) -> None:
    cfg = _config(tmp_path / "r", world_size=4)
    root = _fake_run(cfg, steps=(4, 8, 12)) / "checkpoints"
    resume = _resume(cfg, steps=20)
    for step, rank in ((12, 3), (8, 1)):  # a write cut short; a file lost
        rank_file = root / f"step{step:07d}" / f"rank{rank}.pt"
        if step == 12:
            rank_file.write_bytes(rank_file.read_bytes()[:100])
        else:
            rank_file.unlink()
        check_run_dir(resume)  # step 8 or 4 then
    (root / "step0000004" / "rank3.pt").write_text("not a checkpoint")
    with pytest.raises(RunDirError, match=re.escape(f"no checkpoint in {root} has an intact file for every rank "
                                                    "(step0000012: rank(s) [3] missing or damaged)")):
        check_run_dir(resume)


def test_a_default_run_dir_is_named_by_workload_time_and_process() -> None:
    # The process id keeps runs started in the same second apart.
    assert re.fullmatch(rf"runs/gpt-\d{{8}}-\d{{6}}-{os.getpid()}", default_run_dir("gpt"))


@pytest.mark.parametrize("config,said", [
    (dict.fromkeys(_RUN_CONFIG_KEYS), "stopped before its first checkpoint"),  # the keys every run's has had
    (dict.fromkeys(_RUN_CONFIG_KEYS - {"guard"}), "holds no config.json of paft's"),
    ([1], "holds no config.json of paft's"),
])
def test_a_run_is_told_from_a_users_folder_by_its_config_keys(tmp_path: pathlib.Path, config: Any, said: str) -> None:
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.json").write_text(json.dumps(config))
    with pytest.raises(RunDirError, match=said):
        check_run_dir(_config(tmp_path / "r"))


def test_a_run_dir_that_links_to_an_empty_folder_is_used(tmp_path: pathlib.Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "r").symlink_to("real")
    check_run_dir(_config(tmp_path / "r"))


def test_a_run_dir_that_links_to_a_run_says_what_works(tmp_path: pathlib.Path) -> None:
    real = _fake_run(_config(tmp_path / "real"))
    (tmp_path / "r").symlink_to("real")
    with pytest.raises(RunDirError) as err:  # it advised --overwrite, which refuses a link
        check_run_dir(_config(tmp_path / "r"))
    assert str(err.value) == (f"--run-dir: {tmp_path / 'r'} is a symbolic link to a paft run; pass --resume to "
                              f"continue it, or give the real directory ({real.resolve()}) with --overwrite to "
                              "replace it")
    check_run_dir(_resume(_config(tmp_path / "r"), steps=20))  # what it says works
    check_run_dir(_config(real, overwrite=True))


def test_only_checkpoint_temporaries_and_the_folders_they_leave_empty_are_removed(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "checkpoints"
    names = ["step0000002/.rank0.pt.abcd_123", "step0000002/.rank0.pt.abcd_123.bak", "step0000004/.rank1.pt.x1y2z3w4",
             ".latest.abcdefgh", ".latest.abcdefgh~", "step0000004/rank0.pt"]
    for name in names:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("")
    (root / "step0000006").mkdir()
    remove_checkpoint_temporaries(tmp_path)
    assert sorted(str(p.relative_to(root)) for p in root.rglob("*")) == [
        ".latest.abcdefgh~", "step0000002", "step0000002/.rank0.pt.abcd_123.bak", "step0000004",
        "step0000004/rank0.pt"]


@pytest.mark.parametrize("log", ["events.jsonl", "faults.jsonl", "metrics/rank1.jsonl"])
def test_a_resume_refuses_a_damaged_log(tmp_path: pathlib.Path, log: str) -> None:
    cfg = _config(tmp_path / "r")
    path = _fake_run(cfg)
    (path / log).parent.mkdir(exist_ok=True)
    (path / log).write_text('{"step": 0}\nnot json\n')
    with pytest.raises(RunDirError, match=re.escape(f"--resume: {path / log}: line 2 is not JSON")):
        check_run_dir(_resume(cfg, steps=20))


@pytest.mark.parametrize("make,said", [
    ({}, "does not exist"),
    ({"r": ""}, "is not a directory"),
    ({"r/config.json": "{}"}, "holds no paft run"),
    ({"r/config.json": "run", "r/checkpoints/step0000006/rank0.pt": ""}, "checkpoints/latest is missing"),
    ({"r/config.json": "run", "r/checkpoints/latest": "best"}, "names 'best', not a checkpoint folder"),
    ({"r/config.json": "run", "r/checkpoints/latest": "b" * 1000}, f"names {'b' * 40!r}, not a checkpoint folder"),
    ({"r/config.json": "run", "r/checkpoints/latest": "step\u00e9"}, "latest: 'ascii' codec can't decode byte"),
])
def test_a_resume_with_nothing_to_resume_says_why(tmp_path: pathlib.Path, make: dict[str, str], said: str) -> None:
    cfg = _config(tmp_path / "r")
    for name, text in make.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(json.dumps(cfg.to_dict()) if text == "run" else text)
    with pytest.raises(RunDirError, match=re.escape(said)):
        check_run_dir(_resume(cfg))


def test_resume_candidates_are_latest_then_older_checkpoints_newest_first(tmp_path: pathlib.Path) -> None:
    for name in ("step0000004", "step0000008", "step0000012", "step0000016", "step_old", "stepping"):
        (tmp_path / name).mkdir()
    (tmp_path / "latest").write_text("step0000012\n")
    assert checkpoint_candidates(tmp_path) == ["step0000012", "step0000008", "step0000004"]


def test_records_size_is_rank_0s_metrics(tmp_path: pathlib.Path) -> None:
    assert records_size(tmp_path) == 0
    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "rank0.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "metrics" / "rank1.jsonl").write_text("")
    assert records_size(tmp_path) == len('{"step": 0}\n')


def _central_directory_damaged(path: pathlib.Path) -> None:
    data = path.read_bytes()  # the end record, all zipfile.is_zipfile looks at, stays
    path.write_bytes(data.replace(b"PK\x01\x02", b"XX\x01\x02", 1))


@pytest.mark.parametrize("write,said", [
    (lambda path: path.write_text("not a zip"), "is not a torch checkpoint (truncated or overwritten)"),
    (lambda path: torch.save({"step": 1}, path), "is a torch file but not a paft checkpoint"),
    (lambda path: (torch.save(dict.fromkeys(_CHECKPOINT_KEYS), path), _central_directory_damaged(path)),
     "Bad magic number for central directory"),
])
def test_a_file_that_is_no_paft_checkpoint_is_refused(tmp_path: pathlib.Path, write: Any, said: str) -> None:
    write(tmp_path / "rank0.pt")
    with pytest.raises(ValueError, match=re.escape(said)):
        load_checkpoint_file(tmp_path / "rank0.pt")


def _directory_entry_damaged(path: pathlib.Path, name: str, field: int, value: int) -> None:
    """Set byte ``field`` of the zip directory's entry of record ``name`` (a flipped bit there)."""
    data = bytearray(path.read_bytes())
    at = data.index(b"PK\x01\x02")
    while not data[at + 46:at + 46 + int.from_bytes(data[at + 28:at + 30], "little")].endswith(name.encode()):
        at = data.index(b"PK\x01\x02", at + 4)
    data[at + field] = value
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("mmap", [False, True])
@pytest.mark.parametrize("field,value,said", [
    # The MS-DOS folder bit of the entry's attributes: zipfile's testzip passed it, and
    # torch's reader loaded the tensor as uninitialized memory, silently.
    (38, 0x10, "marks rank0/data/0 as a folder"),
    # The zip version needed: NotImplementedError, a traceback from paft train --resume.
    (6, 0xFF, "NotImplementedError: zip file version"),
    # The encrypted flag: RuntimeError, a traceback too (the bytes read whole: damage all the same).
    (8, 0x01, "RuntimeError"),
])
def test_a_damaged_zip_directory_entry_is_refused(tmp_path: pathlib.Path, mmap: bool, field: int, value: int,
                                                  said: str) -> None:
    path = tmp_path / "rank0.pt"
    torch.save({**dict.fromkeys(_CHECKPOINT_KEYS), "model": {"w": torch.arange(256, dtype=torch.float32)}}, path)
    _directory_entry_damaged(path, "/data/0", field, value)
    with pytest.raises(ValueError, match=re.escape(said)):
        load_checkpoint_file(path, mmap=mmap)


def test_a_zip_readers_own_value_error_names_the_file(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # zipfile raises ValueErrors of its own (UnicodeDecodeError of a name with the UTF-8 flag
    # flipped on): said without the file, which of a rank's checkpoints was damaged was unsaid.
    path = tmp_path / "rank0.pt"
    torch.save(dict.fromkeys(_CHECKPOINT_KEYS), path)

    def undecodable(self: zipfile.ZipFile) -> None:
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    monkeypatch.setattr(zipfile.ZipFile, "testzip", undecodable)
    with pytest.raises(ValueError, match=re.escape(f"{path}: UnicodeDecodeError: 'utf-8' codec")):
        load_checkpoint_file(path)


@pytest.mark.parametrize("overwrite", [False, True])
def test_prepare_run_dir_replaces_the_old_run_only_with_overwrite(tmp_path: pathlib.Path, overwrite: bool) -> None:
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "summary.json").write_text("old")
    cfg = _config(tmp_path / "r", overwrite=overwrite)
    prepare_run_dir(cfg)
    kept = [] if overwrite else ["summary.json"]
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["config.json", *kept]
    assert TrainConfig.from_dict(json.loads((tmp_path / "r" / "config.json").read_text())) == cfg


def test_a_run_dir_the_file_system_refuses_is_a_run_dir_error(tmp_path: pathlib.Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(RunDirError, match="--run-dir: cannot write .*file"):
        write_config(_config(tmp_path / "file"))

    def denied(path: pathlib.Path) -> bool:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(pathlib.Path, "is_dir", denied)
    with pytest.raises(RunDirError, match=re.escape(f"--run-dir: cannot use {tmp_path / 'r'}: Permission denied")):
        check_run_dir(_config(tmp_path / "r"))


@pytest.mark.parametrize("resume", [False, True])
def test_a_run_dir_with_a_nul_character_is_refused(tmp_path: pathlib.Path, resume: bool) -> None:
    # A config file's string can hold one: mkdir (or, resuming, the lock probe) raised
    # ValueError after the checks had passed it, a traceback instead of exit code 2.
    with pytest.raises(RunDirError, match=r"^--run-dir: '.*/r\\x00' holds a NUL character, which no file name can$"):
        check_run_dir(_config(tmp_path / "r\0", resume=resume))
