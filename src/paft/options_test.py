"""A run's ``config.json`` as a ``--config`` file: it reruns the run's settings elsewhere; and a
``--config`` file in the command that continues an interrupted resume."""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any

import pytest

from paft.cli import main
from paft.config import GuardConfig, MonitorConfig, ProtectConfig, TrainConfig
from paft.options import parse_train_config
from paft.rundir import write_config

# Non-default values in every section; the folder options too, which a new run leaves.
RUNS = [
    TrainConfig(workload="llama", world_size=2, steps=7, batch_size=8, optimizer="muon", lr=1e-3, weight_decay=0.1,
                warmup_steps=2, min_lr_ratio=0.5, grad_clip=0.0, seed=9, eval_every=3, eval_batches=2, log_every=1,
                checkpoint_every=0, run_dir="a", overwrite=True, device="cpu", model={"n_layer": 1, "n_embd": 32},
                dropout=0.1, desync_shuffle=True, desync_seed=True, inject=["nan:steps=3", "bitflip:steps=4,ranks=1"],
                tensorboard=True, quiet=True,
                monitor=MonitorConfig(interval=2, cosine="exact", sketch_dim=16, fingerprint_every=1,
                                      alert_loss_cv=math.inf, alert_cos_min=0.5),
                protect=ProtectConfig(mode="dyn", sync_period=5, sync_mode="broadcast", broadcast_src=1,
                                      overlap=False, h_min=2, h_max=9, target=0.01),
                guard=GuardConfig(enabled=True, spike_threshold=4.0, window=6, warmup=1, update_ratio=math.inf,
                                  outlier_threshold=3.0, max_reruns_per_step=3, max_reruns_per_run=7,
                                  shift_after=0, on_persistent="stop")),
    TrainConfig(workload="resnet", world_size=1, batch_size=4, run_dir="a", resume=True, inject=[],
                monitor=MonitorConfig(enabled=False, cosine="off"), protect=ProtectConfig(mode="averager"),
                guard=GuardConfig(window=1000, update_ratio=0.0)),
    TrainConfig(run_dir="a", monitor=MonitorConfig(interval=0), protect=ProtectConfig(mode="sync", sync_mode="mean"),
                guard=GuardConfig(enabled=True, on_persistent="repair", max_reruns_per_run=1)),
]


@pytest.mark.parametrize("run", RUNS)
def test_a_runs_config_json_gives_its_config_back(run: TrainConfig, tmp_path: pathlib.Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """``paft train --config a/config.json --run-dir b`` trains as run a did, in b: the
    file was refused ("guard: expected true or false"), its options had to be retyped."""
    monkeypatch.chdir(tmp_path)
    pathlib.Path("a").mkdir()
    write_config(run)  # as paft train writes it (inf as "inf")
    rerun, _ = parse_train_config(["--config", "a/config.json", "--run-dir", "b"])
    assert rerun == dataclasses.replace(run, run_dir="b", resume=False, overwrite=False)
    # Without --run-dir: a folder of its own (runs/<workload>-...), not run a's.
    assert parse_train_config(["--config", "a/config.json"])[0].run_dir == ""
    # The command line still wins.
    cfg, _ = parse_train_config(["--config", "a/config.json", "--seed", "3", "--no-quiet", "--max-reruns-total", "2"])
    assert (cfg.seed, cfg.quiet, cfg.guard.max_reruns_per_run) == (3, False, 2)


def _run(**changes: Any) -> dict[str, Any]:
    """A run's config.json, with ``changes`` (``guard__window``: a section's field)."""
    data = TrainConfig().to_dict()
    for key, value in changes.items():
        section, _, name = key.rpartition("__")
        (data[section] if section else data)[name] = value
    return data


@pytest.mark.parametrize("data,needle", [
    (_run(guard__window="big"), "--config: c.json: guard.window (--guard-window): expected int, got 'big'"),
    (_run(guard__window=2), "--config: c.json: guard.window (--guard-window): must be in [5, 1000000], got 2"),
    (_run(lr=0), "--config: c.json: lr (--lr): must be > 0"),
    (_run(protect__mode="often"), "--config: c.json: protect.mode (--protect): must be one of "),
    (_run(guard__max_reruns_per_run=0),
     "--config: c.json: guard.max_reruns_per_run (--max-reruns-total): must be >= 1, got 0"),
    (_run(guard__windw=5, bogus=1),
     "--config: c.json: unknown option(s) 'bogus', 'guard.windw' (from another paft version, or edited by hand); "
     "read as a run's config.json (its 'monitor' is a table), whose keys are TrainConfig's fields"),
    # A flat file's option beside a table: a slip that mixes the two shapes.
    ({"world-size": 2, "guard": {"enabled": True}}, "unknown option(s) 'world-size' "),
    ({"monitor": {"interval": 2}, "guard": True}, "--config: c.json: 'guard' must be a mapping, got True"),
])
def test_a_bad_runs_config_json_names_the_file_and_field(data: dict[str, Any], needle: str, tmp_path: pathlib.Path,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    pathlib.Path("c.json").write_text(json.dumps(data))
    with pytest.raises(SystemExit) as exc:
        main(["train", "--config", "c.json", "--run-dir", "out"])
    assert exc.value.code == 2 and needle in capsys.readouterr().err
    assert not pathlib.Path("out").exists()


def test_a_table_in_toml_or_yaml_is_no_runs_config(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """paft writes config.json as JSON; a TOML or YAML file keeps the option names, and
    a table for an on/off option is refused as such."""
    monkeypatch.chdir(tmp_path)
    pathlib.Path("c.toml").write_text("[guard]\nwindow = 6\n")
    with pytest.raises(SystemExit) as exc:
        main(["train", "--config", "c.toml"])
    assert exc.value.code == 2 and "--config: c.toml: guard: expected true or false" in capsys.readouterr().err


def test_a_resumes_hint_that_names_its_config_file_types_its_options_over_it_again(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An --inject emptied by c.toml is continued with --config c.toml, which also brought
    back the file's values that the command line had replaced with the saved ones: the
    continuation trained at the file's --lr 0.5, and was refused for its --model."""
    monkeypatch.chdir(tmp_path)
    pathlib.Path("r").mkdir()
    write_config(TrainConfig(steps=6, lr=3e-3, model={"n_layer": 2}, inject=["bitflip:steps=1"], run_dir="r"))
    pathlib.Path("c.toml").write_text('inject = []\nlr = 0.5\nmodel = {n_layer = 3}\n')
    argv = ["--run-dir", "r", "--resume", "--steps", "9", "--lr", "0.003", "--config", "c.toml",
            "--model", "n_layer=2"]
    asked, words = parse_train_config(argv)
    assert words == ["--config", "c.toml", "--lr", "0.003", "--model", "n_layer=2"]
    assert parse_train_config(["--run-dir", "r", "--resume", "--steps", "9", *words])[0] == asked
