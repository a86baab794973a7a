"""`paft train` front end: bad input is refused before any worker starts; a real run works."""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
from typing import Any

import pytest
import torch

import paft
from paft.cli import main
from paft.config import ProtectConfig, TrainConfig
from paft.records import read_jsonl
from paft.workloads import GPT, Llama, ResNet


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--steps", "0"], "--steps"),
        (["--steps", "-5"], "--steps"),
        (["--world-size", "0"], "--world-size"),
        (["--workload", "bert"], "--workload"),
        (["--optimizer", "lion"], "--optimizer"),
        (["--batch-size", "10", "--world-size", "4"], "--batch-size"),
        (["--lr", "0"], "--lr"),
        (["--lr", "1e39"], "--lr: must be > 0 and <= 3.40282e+38 (float32), got 1e+39"),
        (["--config", "missing.toml"], "missing.toml"),
        (["--inject", "bitflip:rate=2"], "rate"),
        (["--inject", "bitflip:rate=0.1,ranks=7"], "ranks"),
        (["--inject", "melt:rate=0.1"], "melt"),
        (["--protect", "sometimes"], "--protect"),
        (["--h-min", "10", "--h-max", "5"], "--h-max"),
        (["--broadcast-src", "-1"], "--broadcast-src: must be a rank >= 0, got -1"),
        (["--resume"], "--resume"),
        (["--config", " "], "--config: must not be empty"),  # not a file named " "
        (["--model", "n_layers=2"], "--model: unknown key 'n_layers' for the gpt model (did you mean 'n_layer'?)"),
        (["--model", "n_head=3"], "--model: n_embd (128) must be divisible by n_head (3)"),
        (["--workload", "resnet", "--model", "n_layer=2"],
         "--model: unknown key 'n_layer' for the resnet model; valid: "),
        (["--workload", "resnet", "--world-size", "2", "--batch-size", "100000"],
         "--batch-size: 100000 is more than the resnet training set holds (8000 items)"),
        (["--model", "block_size=100000"],
         "--batch-size: 64 is more than the gpt training set holds (10 windows of --model "
         "block_size=100000)"),
        (["--inject", "bitflip:steps=1,bits=40"],
         "--inject 'bitflip:steps=1,bits=40': field 'bits' must be < 32"),
        # No prefix matching: --out is not --outlier-threshold, --step not --steps.
        (["--out", "elsewhere"], "unrecognized arguments: --out elsewhere"),
        (["--step", "5"], "unrecognized arguments: --step 5"),
        (["--seed", "99999999999999999999"], "--seed: must be in [0, 2**32)"),
        (["--model", "bias=maybe"], "--model: bias must be true or false, got 'maybe'"),
        (["--model", "=5"], "argument --model: expected KEY=VALUE, got '=5'"),
        # Not Python (literal_eval raises SyntaxError): a text the model's check names.
        (["--model", "n_layer=2 3"], "--model: n_layer must be an integer, got '2 3'"),
        (["--model", "dropout=0.3"],
         "--model: dropout is set with --dropout (e.g. --dropout 0.1), not --model"),
        (["--model", "dropout=0.3", "--dropout", "0"], "--model: dropout is set with --dropout"),
        (["--workload", "llama", "--model", "norm_eps=inf"],
         "--model: norm_eps must be a finite number, got inf"),
        (["--workload", "resnet", "--model", "num_classes=5"],
         "--model: num_classes must be >= 10"),
        (["--workload", "resnet", "--model", "in_channels=3"], "--model: in_channels must be 1"),
        (["--model", "n_embd=1048576", "--model", "n_head=1"], "--model: the gpt model would need about"),
        # Sizes of hundreds of digits overflowed a float (in the GiB figure; llama's SwiGLU
        # width divided as floats): an OverflowError traceback, exit 1.
        (["--model", "n_layer=" + "9" * 400], "--model: the gpt model would need about"),
        (["--workload", "llama", "--model", "n_embd=" + "8" * 400], "--model: the llama model would need about"),
        (["--workload", "resnet", "--model", "width=" + "9" * 400], "--model: the resnet model would need about"),
        (["--world-size", "1000", "--batch-size", "1000"], "--world-size 1000: 1000 worker processes on this"),
        (["--sketch-dim", "99999999"], "--sketch-dim: must be in [8, 65536]"),
        (["--guard", "--guard-window", "99999999999"], "--guard-window: must be in [5, 1000000]"),
        (["--weight-decay", "inf"], "--weight-decay: must be a finite number >= 0"),
        (["--run-dir", ""], "--run-dir: must not be empty"),
        (["--run-dir", "r/" + "x" * 300], "is longer than the file system allows"),
        (["--run-dir", "r/" + "x" * 300, "--resume"], "is longer than the file system allows"),
        (["--model", "n_layer=2.5"], "--model: n_layer must be an integer, got 2.5"),
        (["--model", "block_size=2000000"],
         "--model: block_size 2000000 must be below 111540, the characters of the validation "
         "split"),
        # It said "needs 150001 tokens, got 111540", as if the 1.1 M-character corpus were short.
        (["--model", "block_size=150000", "--world-size", "1", "--batch-size", "1"],
         "--model: block_size 150000 must be below 111540, the characters of the validation "
         "split"),
        (["--alert-cos-min", "5"], "--alert-cos-min: must be in [-1, 1], got 5.0"),
        (["--alert-loss-cv", "nan"], "--alert-loss-cv: must be >= 0, got nan"),
        (["--guard", "--spike-threshold", "inf"],
         "--spike-threshold: must be a finite number > 0, got inf"),
        (["--guard", "--outlier-threshold", "inf"],
         "--outlier-threshold: must be a finite number > 0, got inf"),
        # Said by paft train, whose --help lists its options (it said "paft", whose help does not).
        (["--steps", "3", "--bogus"],
         "paft train: error: unrecognized arguments: --bogus\n(options: paft train --help)"),
    ],
)
def test_bad_input_exits_2_and_writes_nothing(
    argv: list[str], needle: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--run-dir", "out", *argv])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("workload,model", [
    ("gpt", ["n_layer=100000", "n_embd=65536"]),
    ("llama", ["n_layer=100000", "n_embd=65536"]),
    ("resnet", ["depth=600002", "width=4096"]),
])
def test_oversized_model_is_refused_without_building_it(
    workload: str, model: list[str], tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The memory check counted the parameters of a model it built (on the meta device):
    100000 layers took minutes to refuse. It counts from the config now."""
    monkeypatch.chdir(tmp_path)

    def built(self: object, cfg: object) -> None:
        pytest.fail(f"the check built the {type(self).__name__} it refuses")

    for cls in (GPT, Llama, ResNet):
        monkeypatch.setattr(cls, "__init__", built)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--run-dir", "out", "--workload", workload, *(w for m in model for w in ("--model", m))])
    assert exc.value.code == 2
    assert f"--model: the {workload} model would need about" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "name,text,needle",
    [
        ("bad.toml", "steps = [", "--config: bad.toml is not valid TOML: "),
        ("bad.txt", "steps: 3", "--config: bad.txt is not valid TOML (read as TOML: not .yaml, .yml or .json)"),
        ("unknown.toml", "stepz = 3", "stepz"),
        ("negated.toml", "no-monitor = true", "unknown option 'no-monitor' (write monitor = false)"),
        ("double.toml", "no-overlap = false", "unknown option 'no-overlap' (write overlap = true)"),
        ("typed.toml", 'steps = "many"', "steps"),
        ("bad.yaml", "steps: 0", "bad.yaml: steps: must be >= 1, got 0"),
        ("upper.YML", "steps: 0", "upper.YML: steps: must be >= 1, got 0"),  # read as YAML too
        # not a switch: no "write ..."
        ("nonbool.toml", "no-steps = 3", "unknown option 'no-steps' (did you mean 'steps'?)\n(options"),
        # A near miss, or a field as a run's config.json names it, is named as the option meant.
        ("near.toml", "world-siz = 2", "near.toml: unknown option 'world-siz' (did you mean 'world-size'?)\n"),
        ("field.toml", "window = 6", "field.toml: unknown option 'window' (did you mean 'guard-window'?)\n"),
        ("field.yaml", "max_reruns_per_step: 3", "unknown option 'max_reruns_per_step' (did you mean 'max-reruns'?)"),
        ("dotted.json", '{"protect.target": 0.1}', "unknown option 'protect.target' (did you mean 'dyn-target'?)"),
        ("enabled.toml", "enabled = true", "unknown option 'enabled' (did you mean 'monitor' or 'guard'?)"),
        ("far.toml", "colour = 2", "unknown option 'colour'\n(options"),
        ("ints.toml", "inject = [1]", "--config: ints.toml: inject: expected a string or a list of strings"),
        ("model.toml", "model = 3", "--config: model.toml: model: expected a table/mapping of model fields"),
        ("yes.toml", 'guard = "yes"', "--config: yes.toml: guard: expected true or false, got 'yes'"),
        ("int.toml", "guard = 1", "--config: int.toml: guard: expected true or false, got 1"),
        ("bool.toml", "lr = true", "--config: bool.toml: lr: expected float, got True"),  # not taken for 1.0
        ("off.yaml", "cosine: off\n", "off.yaml: cosine: expected str, got False; quote it"),
        ("twice.yaml", "steps: 3\nsteps: 4\n", "key 'steps' is given twice"),
        # One line, placed as TOML's errors are: PyYAML's own message spans five.
        ("flow.yaml", "steps: [3\n", "--config: flow.yaml is not valid YAML: while parsing a flow sequence: "
         "expected ',' or ']', but got '<stream end>' (at line 2, column 1)\n(options"),
        ("twice.json", '{"steps": 3, "steps": 4}', "key 'steps' is given twice"),
        ("spellings.toml", "world-size = 2\nworld_size = 4\n", "option 'world-size' is given twice"),
        ("floats.yaml", "lr: 3e-3\nsteps: 0\n", "floats.yaml: steps: must be >= 1"),  # 3e-3 read as a float
        ("latin1.toml", "# caf\xe9\nsteps = 3\n", "--config: latin1.toml is not UTF-8 text"),
        ("seed.toml", "seed = 99999999999999999999", "seed.toml: seed: must be in [0, 2**32)"),
        ("huge.json", '{"lr": 1' + "0" * 400 + "}",
         "--config: huge.json: lr: expected a number, got an integer too large for a float"),
        # Not mappings, though false-ish: they were read as an empty file, a default run.
        *((f"falsy{i}.yaml", text, f"--config: falsy{i}.yaml must hold a mapping")
          for i, text in enumerate(("[]\n", "0\n", "false\n", '""\n'))),
    ],
)
def test_bad_config_file_exits_2(
    name: str, text: str, needle: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / name).write_text(text, encoding="latin-1")  # ASCII but for the one non-UTF-8 case
    with pytest.raises(SystemExit) as exc:
        main(["train", "--run-dir", "out", "--config", name])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name,needle", [
    ("summary.json", "holds no config.json of paft's, so it is not a paft run; pick another --run-dir"),
    ("config.json", "stopped before its first checkpoint; pass --overwrite"),  # nothing to resume
    ("checkpoints/latest", "already exists; pass --resume to continue it or --overwrite to replace it"),
])
def test_existing_run_dir_is_never_overwritten(
    name: str, needle: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "out").mkdir()
    text = json.dumps(TrainConfig().to_dict())  # a run's own config.json (a user's is no run: see below)
    if name == "checkpoints/latest":  # a run with a checkpoint
        (tmp_path / "out" / "config.json").write_text(text)
        (tmp_path / "out" / "checkpoints").mkdir()
    (tmp_path / "out" / name).write_text(text)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--run-dir", "out"])
    assert exc.value.code == 2
    assert needle in capsys.readouterr().err
    assert (tmp_path / "out" / name).read_text() == text


def test_config_paths_empty_or_with_a_tilde(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """--config "$CFG" with CFG unset started a default run; --config=~/c.toml (no shell
    expands it there) was not found."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "c.toml").write_text("steps = 0\n")
    for argv, needle in ((["--config", ""], "--config: must not be empty"),
                         (["--config=~/c.toml"], "--config: ~/c.toml: steps: must be >= 1, got 0")):
        with pytest.raises(SystemExit) as exc:
            main(["train", "--run-dir", "out", *argv])
        assert exc.value.code == 2 and needle in capsys.readouterr().err
        assert not (tmp_path / "out").exists()
    # A file's empty run-dir is the file's, not a --run-dir typed (which would win over it).
    (tmp_path / "c.toml").write_text('run-dir = " "\n')
    with pytest.raises(SystemExit) as exc:
        main(["train", "--config", "c.toml"])
    assert exc.value.code == 2 and "error: --config: c.toml: run-dir: must not be empty" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml"]


def test_resume_needs_a_run_dir(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--resume"])
    assert exc.value.code == 2
    assert "--resume: needs --run-dir" in capsys.readouterr().err


def test_overwrite_deletes_only_paft_output(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))  # "~" no shell expanded (--run-dir=~/x, a config file's value)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    # Names any project may hold: a user's own config.json and results.json are no
    # marks of paft's output (paft's config.json is recognised by its keys).
    (tmp_path / "mine" / "config.json").write_text('{"lr": 3}')
    (tmp_path / "mine" / "results.json").write_text('{"my": "experiment"}')
    (tmp_path / "theirs").mkdir()  # keys no paft option has: not a hand-edited run's config.json
    (tmp_path / "theirs" / "config.json").write_text('{"name": "my project"}')
    (tmp_path / "afile").write_text("")
    os.symlink("nowhere", tmp_path / "dangling")
    for argv, needle in [
        (["train", "--run-dir", "mine", "--overwrite"], "--overwrite: mine holds no config.json of paft's"),
        # The folder a run's files land in: "new/../mine" is mine (it used to be taken for a
        # new folder, and new/ was left behind).
        (["train", "--run-dir", "new/../mine"],
         f"--run-dir: {tmp_path / 'mine'} holds no config.json of paft's, so it is not a paft run; pick another"),
        (["train", "--run-dir", "~/mine"], f"--run-dir: {tmp_path / 'mine'} holds no config.json of paft's"),
        (["bench", "overhead", "--out", ""], "--out: must not be empty"),
        # nothing to resume, said as it is (a file was told to pass --overwrite, which refused it)
        (["train", "--run-dir", "afile", "--resume"], "--resume: afile is not a directory, let alone a run's"),
        (["train", "--run-dir", "mine", "--resume"], "--resume: mine holds no paft run"),
        (["train", "--run-dir", "theirs", "--resume"], "--resume: theirs holds no paft run"),
        (["train", "--run-dir", "nothere", "--resume"], "--resume: nothere does not exist"),
        (["train", "--run-dir", "dangling"], "--run-dir: dangling is a symbolic link to nothing (nowhere)"),
        # under one: it was taken for a new folder, and its creation blamed "another paft train"
        (["train", "--run-dir", "dangling/run"], "--run-dir: cannot create dangling/run: dangling is a symbolic "
                                                 "link to nothing"),
        (["bench", "overhead", "--out", "dangling/b"], "--out: cannot create dangling/b: dangling is a symbolic"),
        # Not told to pass --resume or --overwrite, which would both be refused.
        (["train", "--run-dir", "mine"], "--run-dir: mine holds no config.json of paft's"),
        (["bench", "overhead", "--out", "mine"], "--out: mine holds no .paft-bench of paft's, so it is not paft's "
                                                 "output; pick another"),
        (["bench", "overhead", "--out", "mine", "--overwrite"], "--overwrite: mine holds no .paft-bench of paft's"),
        (["train", "--run-dir", "afile/run"], "--run-dir: cannot create afile/run: afile is not a directory"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2
        assert needle in capsys.readouterr().err
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["config.json", "notes.txt", "results.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "dangling", "mine", "theirs"]


def test_paft_report_of_no_run_exits_2_and_writes_nothing(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "config.json").write_text('{"lr": 3}')
    for argv, needle in [(["report", "mine"], "paft report: error: mine: not a paft run directory (its config.json "
                                              "is not paft's)"),
                         (["report", "nothere"], "paft report: error: nothere: does not exist (expected a paft run")]:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and needle in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["config.json", "mine"]


def test_missing_gpus_exit_2_before_anything_is_written(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The device count is the machine's; pretend to one GPU so that the check runs here.
    import torch

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--run-dir", "out", "--world-size", "2", "--batch-size", "8"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "--world-size 2" in err and "1 is visible" in err and "--device cpu" in err
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--run-dir", "out", "--device", "cuda"])
    assert exc.value.code == 2
    assert "--device cuda: no CUDA device" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("no_tensorboard")
def test_tensorboard_without_its_package_exits_2_before_anything_is_written(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--tensorboard", "--run-dir", "r"])
    assert exc.value.code == 2
    assert ("paft train: error: --tensorboard: needs the tensorboard package, which is not installed: "
            "pip install 'paft[tensorboard]'\n") in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_help_documents_every_option(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    from paft.options import OPTIONS

    for flag in ["--config", *(f"--{opt.flag}" for opt in OPTIONS)]:  # an entry of its own, not only the usage
        assert re.search(rf"^  {flag}[ ,\n]", out, re.MULTILINE), flag
    # Each entry as one line: the switches' defaults said as on/off, an empty default as
    # what it means, and no RST markup from the field docstrings.
    entries = {m[1]: " ".join(m[2].split()) for m in re.finditer(r"^  (--[a-z-]+)(.*?)(?=^  -|^\S|\Z)", out,
                                                                    re.MULTILINE | re.DOTALL)}
    assert entries["--guard"].endswith("[default: off]") and entries["--monitor"].endswith("[default: on]")
    assert entries["--run-dir"].endswith("[default: auto]")
    assert entries["--steps"] == "STEPS Optimizer steps to train. [default: 200]"  # the field's docstring
    assert "``" not in out
    assert not re.search(r":[a-z]+:`", out)  # an RST role such as :func:`...` read as it stands
    # The epilog: the --inject grammar from the faultspec docstring, and the exit codes.
    assert "fault specs (--inject, repeatable):\n\n    KIND:key=value,key=value," in out
    assert "exit codes: 0 done, 1 a worker failed, 2 bad input" in out


def test_resume_help_names_every_option_a_resume_cannot_change() -> None:
    # It left out PAFT-Dyn's --sync-period, which a resume refuses to change all the same.
    import argparse

    from paft.options import add_train_options
    from paft.rundir import FIXED_ON_RESUME

    parser = argparse.ArgumentParser()
    add_train_options(parser)
    resume = next(action.help or "" for action in parser._actions if action.dest == "resume")
    assert [flag for _, flag in FIXED_ON_RESUME if flag not in resume] == []


def test_python_dash_m_paft_is_the_paft_command(tmp_path: pathlib.Path) -> None:
    """``python -m paft``, where the console script is not on PATH: the same command, its
    name in the usage and its exit code for bad input."""
    proc = subprocess.run([sys.executable, "-m", "paft", "train", "--steps", "0"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    # Named as it was run, so that the commands it gives to copy run here too.
    assert proc.stderr == ("python -m paft train: error: --steps: must be >= 1, got 0\n"
                           "(options: python -m paft train --help)\n")
    assert not any(tmp_path.iterdir())


def test_version_names_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    """``paft --version``: what a bug report needs, before any subcommand."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"paft {paft.__version__}\n"
    assert paft.__version__ == importlib.metadata.version("paft")  # pyproject's, as installed


def test_paft_train_end_to_end_with_config_file(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real console script: elastic launch of 2 workers, config file + CLI override;
    then resumes that cannot continue this run are refused and change nothing."""
    (tmp_path / "run.toml").write_text(
        'workload = "gpt"\nworld-size = 2\nsteps = 40\nbatch-size = 16\nlog-every = 10\n'
        'eval-batches = 4\n[model]\nn_layer = 1\nn_embd = 32\nn_head = 2\nblock_size = 32\n'
    )
    paft = pathlib.Path(sys.executable).with_name("paft")
    proc = subprocess.run(
        [str(paft), "train", "--config", "run.toml", "--run-dir", "r", "--lr", "1e-2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr
    assert "steps/s" in proc.stdout and "ETA" in proc.stdout and "final_val_loss" in proc.stdout
    summary = json.loads((tmp_path / "r" / "summary.json").read_text())
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["lr"] == 1e-2 and config["steps"] == 40 and config["model"]["n_layer"] == 1
    assert summary["steps"] == 40 and summary["world_size"] == 2
    assert summary["final_val_loss"] < summary["initial_val_loss"] * 0.9
    assert summary["replicas_distinct"] == 1

    monkeypatch.chdir(tmp_path)
    before = {p: p.read_bytes() for p in (tmp_path / "r").rglob("*") if p.is_file()}
    for extra, needle in [
        ([], "--resume: r has trained 40 steps already (--steps 40); pass --steps above 40"),
        (["--steps", "50", "--world-size", "4"], "--resume: cannot change --world-size (2 in r, 4 asked)"),
        # Not "--batch-size: 16 cannot be split evenly across --world-size 3": the world size is the change.
        (["--steps", "50", "--world-size", "3"], "--resume: cannot change --world-size (2 in r, 3 asked)"),
        (["--steps", "50", "--optimizer", "sgd"], "--resume: cannot change --optimizer ('adamw' in r, 'sgd' asked)"),
        (["--steps", "50", "--model", "n_embd=64"], "--resume: cannot change --model"),
        # The checkpoint's RNG state would undo the per-rank seeding.
        (["--steps", "50", "--desync-seed"], "--resume: cannot change --desync-seed (False in r, True asked)"),
    ]:
        with pytest.raises(SystemExit) as exc:
            main(["train", "--run-dir", "r", "--resume", *extra])
        assert exc.value.code == 2
        assert needle in capsys.readouterr().err
    # The saved options are read from the folder the run uses (they were skipped for a
    # path through a missing folder, and the defaults compared instead).
    with pytest.raises(SystemExit):
        main(["train", "--run-dir", "nosuch/../r", "--resume", "--steps", "50", "--world-size", "4"])
    assert f"--resume: cannot change --world-size (2 in {tmp_path / 'r'}, 4 asked)" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in (tmp_path / "r").rglob("*") if p.is_file()} == before

    # A damaged run directory: a clear error naming the file, and config.json untouched.
    ckpts = tmp_path / "r" / "checkpoints"
    damage = [
        (ckpts / "latest", b"foo", "r/checkpoints/latest names 'foo', not a checkpoint folder"),
        (ckpts / "latest", b"\xff\xfe", "--resume: cannot read r/checkpoints/latest"),
        (tmp_path / "r" / "config.json", b"[]", "--resume: r/config.json must hold a mapping"),
        (tmp_path / "r" / "config.json", b'{"guard": {"window": "big"}}',
         "r/config.json: guard.window (--guard-window): expected int"),
        (tmp_path / "r" / "evals.jsonl", b'{"step": 0}\n{"st\n{"step": 40}\n', "r/evals.jsonl: line 2 is not JSON"),
        # A hand-edited config.json: the checkpoint holds the options it was trained with
        # (an edited seed went on silently, an edited optimizer failed in a worker).
        (tmp_path / "r" / "config.json", json.dumps({**config, "seed": 5}).encode(),
         "--resume: cannot change --seed (0 in its checkpoint step0000040, 5 asked: r/config.json was edited since)"),
        (tmp_path / "r" / "config.json", json.dumps({**config, "optimizer": "sgd"}).encode(),
         "--resume: cannot change --optimizer ('adamw' in its checkpoint step0000040, 'sgd' asked: "
         "r/config.json was edited since)"),
    ]
    for path, data, needle in damage:
        path.write_bytes(data)
        with pytest.raises(SystemExit) as exc:
            main(["train", "--run-dir", "r", "--resume", "--steps", "50"])
        assert exc.value.code == 2 and needle in capsys.readouterr().err
        path.write_bytes(before[path])
    def flipped(data: bytes) -> bytes:  # bytes inside the tensors' data: still a valid zip
        mid = len(data) // 2
        return data[:mid] + bytes(b ^ 0x5A for b in data[mid : mid + 64]) + data[mid + 64 :]

    for damaged in (lambda data: data[:100], flipped):  # every checkpoint of one rank damaged
        for rank_file in ckpts.glob("step*/rank1.pt"):
            rank_file.write_bytes(damaged(before[rank_file]))
        with pytest.raises(SystemExit) as exc:
            main(["train", "--run-dir", "r", "--resume", "--steps", "50", "--lr", "0.5"])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "has an intact file for every rank (step0000040: rank(s) [1] missing or damaged)" in err
    for rank_file in ckpts.glob("step*/rank*.pt"):  # rank 1 intact again, rank 0 another torch file
        if rank_file.name == "rank1.pt":
            rank_file.write_bytes(before[rank_file])
        else:
            torch.save({"hello": 1}, rank_file)
    with pytest.raises(SystemExit) as exc:
        main(["train", "--run-dir", "r", "--resume", "--steps", "50"])
    assert exc.value.code == 2
    assert "(step0000040: rank(s) [0] missing or damaged)" in capsys.readouterr().err
    assert (tmp_path / "r" / "config.json").read_bytes() == before[tmp_path / "r" / "config.json"]


def test_under_torchrun_the_world_size_is_torchruns(tmp_path: pathlib.Path) -> None:
    """``python -m paft.train`` takes the world size from torchrun, and refuses a
    --world-size that differs from the processes torchrun started (exit 2 on every rank)."""
    (tmp_path / "tiny.toml").write_text(
        "steps = 3\nbatch-size = 8\neval-batches = 1\n[model]\nn_layer = 1\nn_embd = 16\nn_head = 2\nblock_size = 16\n"
    )
    torchrun = [str(pathlib.Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2",
                "-m", "paft.train", "--config", "tiny.toml", "--quiet"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    ok = subprocess.run([*torchrun, "--run-dir", "r", "--spike-threshold", "3"], cwd=tmp_path, capture_output=True,
                        text=True, timeout=300, env=env)
    assert ok.returncode == 0, ok.stderr
    # paft train's warnings, said once (by rank 0): the torchrun form printed none.
    assert ok.stderr.count("python -m paft.train: warning: --spike-threshold has no effect without --guard") == 1
    assert json.loads((tmp_path / "r" / "config.json").read_text())["world_size"] == 2
    assert json.loads((tmp_path / "r" / "summary.json").read_text())["world_size"] == 2
    assert "final_val_loss" in ok.stdout  # --quiet silences progress, not the summary, as paft train
    assert "python -m paft.train: gpt" not in ok.stdout  # nor the plan
    bare = {k: v for k, v in env.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    partial = ({}, {"WORLD_SIZE": "4"}, {"RANK": "0", "WORLD_SIZE": "1"},
               {"RANK": "0", "WORLD_SIZE": "two", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"})
    for extra in partial:  # stale, partial or garbled variables
        alone = subprocess.run([sys.executable, "-m", "paft.train", "--run-dir", "r3", "--world-size", "2"],
                               cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**bare, **extra})
        assert alone.returncode == 2 and "run it under torchrun" in alone.stderr, (extra, alone.stderr)
        assert "Traceback" not in alone.stderr
    assert not (tmp_path / "r3").exists()
    for asked in ("4", "3"):  # 3 does not split the batch: the mismatch is still what is said
        bad = subprocess.run([*torchrun, "--run-dir", "r2", "--world-size", asked], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300, env=env)
        assert bad.returncode != 0
        assert f"--world-size {asked}: torchrun started 2 processes; pass --world-size 2 or leave it out" in bad.stderr
        assert not (tmp_path / "r2").exists()
    # The run directory is claimed as paft train claims it: not while another run holds it.
    from paft.claim import hold_dir_lock

    before = sorted(p.name for p in (tmp_path / "r").iterdir())
    with hold_dir_lock(tmp_path / "r"):
        busy = subprocess.run([*torchrun, "--run-dir", "r", "--overwrite"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300, env=env)
    assert busy.returncode != 0 and "--run-dir: r is in use by another paft train" in busy.stderr
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == before
    # Stopped before its first checkpoint (SIGTERM, as a scheduler or a failing peer
    # sends it; SIGHUP, a closed terminal, which torchrun passes on; or Ctrl-C, to the
    # whole process group), an --overwrite under torchrun puts the old run back, as
    # paft train does.
    for sig, ctrl_c in ((signal.SIGTERM, False), (signal.SIGHUP, False), (signal.SIGINT, True)):
        proc = subprocess.Popen([*torchrun, "--run-dir", "r", "--overwrite", "--steps", "100000",
                                 "--checkpoint-every", "100000", "--eval-every", "100000"], cwd=tmp_path,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=ctrl_c)
        for _ in range(600):  # training has started once the old run is set aside and the new one logs
            if list(tmp_path.glob("r.replaced-*")) and (tmp_path / "r" / "metrics" / "rank0.jsonl").is_file():
                break
            time.sleep(0.2)
        if ctrl_c:
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)
        err = proc.communicate(timeout=120)[1]
        assert "the output it was to replace is back in r" in err, (sig, err[-2000:])
        assert sorted(p.name for p in (tmp_path / "r").iterdir()) == before
        assert not list(tmp_path.glob("r.replaced-*"))
    if not torch.cuda.is_available():  # refused up front on every rank, as paft train refuses it
        cuda = subprocess.run([*torchrun, "--run-dir", "r3", "--device", "cuda"], cwd=tmp_path,
                              capture_output=True, text=True, timeout=300, env=env)
        assert cuda.returncode != 0 and "--device cuda: " in cuda.stderr and "]: Traceback" not in cuda.stderr
        assert not (tmp_path / "r3").exists()


def test_under_torchrun_a_world_size_mismatch_says_where_the_size_came_from(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from paft.options import parse_train_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "two.toml").write_text("world-size = 2\n")
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.json").write_text(json.dumps(TrainConfig(world_size=2).to_dict()))
    for argv, needle in [
        (["--config", "two.toml"],
         "--world-size 2 (in two.toml): torchrun started 3 processes; pass --world-size 3 or leave it out"),
        # a run's config.json always has one: only the command line's goes over it
        (["--config", "r/config.json"], "--world-size 2 (in r/config.json): torchrun started 3 processes; "
         "pass --world-size 3 on the command line, over the file's\n"),
        # typed over the file's: the command line's, not the file's
        (["--config", "two.toml", "--world-size", "4"], "error: --world-size 4: torchrun started 3 processes"),
        # fixed at the first run: passing --world-size 3 would be refused too
        *[(["--run-dir", "r", "--resume", "--steps", "500", *also],
           "--resume: r was trained on 2 ranks and torchrun started 3 processes; "
           "start it with --nproc-per-node 2")
          # also where the size is given again (a run's config.json as --config has it):
          # "pass --world-size 3 or leave it out" sent to the refusal above
          for also in ([], ["--config", "two.toml"], ["--world-size", "2"])],
    ]:
        with pytest.raises(SystemExit):
            parse_train_config(argv, launched=3)
        assert needle in capsys.readouterr().err
    assert parse_train_config(["--batch-size", "6"], launched=3)[0].world_size == 3  # none asked: torchrun's


def _failing(step: int, steps: int = 4) -> list[str]:
    """A tiny run whose replicas all turn NaN at ``step`` (each in its own place): PAFT-Dyn
    repairs the split at once, and its mean sync stops the workers with an error there,
    before that step is recorded."""
    return ["--steps", str(steps), "--world-size", "2", "--batch-size", "4", "--eval-batches", "1",
            "--model", "n_layer=1", "--model", "n_embd=16", "--model", "n_head=2", "--model", "block_size=16",
            "--inject", f"nan:site=params,steps={step},ranks=0+1", "--protect", "dyn", "--sync-mode", "mean",
            "--no-overlap", "--monitor-interval", "1", "--fingerprint-every", "1", "--quiet"]


def test_a_run_that_fails_before_a_step_leaves_nothing_and_overwrite_restores_the_old_run(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    failing = _failing(0)
    monkeypatch.chdir(tmp_path)
    assert main(["train", *failing, "--run-dir", "r"]) == 1
    assert "the run stopped before a step; r was removed" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
    # The parents it created go too; an empty folder of the user's is emptied, not removed.
    assert main(["train", *failing, "--run-dir", "nest/a/b"]) == 1
    (tmp_path / "empty").mkdir()
    assert main(["train", *failing, "--run-dir", "empty"]) == 1
    assert "what it wrote in empty was removed" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and not any((tmp_path / "empty").iterdir())
    # "new/../empty/r" creates new/ and r, not empty/ (which existed): the user's folder stays.
    assert main(["train", *failing, "--run-dir", "new/../empty/r"]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"] and not any((tmp_path / "empty").iterdir())
    (tmp_path / "empty").rmdir()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "config.json").write_text(json.dumps(TrainConfig().to_dict()))
    (tmp_path / "old" / "summary.json").write_text("old run")
    # Trained steps but no checkpoint: not worth the run it was to replace.
    assert main(["train", *_failing(2), "--run-dir", "old", "--overwrite"]) == 1
    assert "the output it was to replace is back in old" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old"]
    assert (tmp_path / "old" / "summary.json").read_text() == "old run"


def test_paft_train_says_what_it_will_do_before_its_workers_start(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The workers take seconds to come up; before, nothing was said until step 0's evaluation.
    monkeypatch.chdir(tmp_path)
    run = ["--steps", "2", "--world-size", "2", "--batch-size", "4", "--eval-batches", "1", "--model", "n_layer=1",
           "--model", "n_embd=16", "--model", "n_head=2", "--model", "block_size=16", "--run-dir", "r"]
    assert main(["train", *run, "--protect", "sync", "--sync-period", "1", "--no-overlap", "--guard",
                 "--on-persistent", "stop", "--inject", "nan:site=params,steps=9", "--monitor-interval", "0",
                 "--device", "cpu"]) == 0
    assert capsys.readouterr().out.splitlines()[:4] == [
        "paft train: gpt (4,608 parameters), 2 workers (cpu, gloo), 2 steps of global batch 4, adamw lr 0.003, seed 0",
        "  monitor: no metrics, aggregated-gradient checksum every step, state fingerprint every 10 steps",
        "  protect: PAFT-Sync every step (robust, blocking); guard: on, stops on a persistent fault; "
        "inject: nan:site=params,steps=9",
        "  run dir: r"]
    assert main(["train", *run, "--resume", "--steps", "3", "--quiet"]) == 0
    assert capsys.readouterr().out.startswith("summary (r/summary.json)")  # --quiet: the result only


def test_a_run_that_fails_after_some_steps_keeps_its_records(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # They may be what explains the failure; before, the whole directory was removed.
    monkeypatch.chdir(tmp_path)
    assert main(["train", *_failing(2), "--run-dir", "r"]) == 1
    assert "its records stay in r (paft report r); --resume cannot continue it" in capsys.readouterr().err
    assert [r["step"] for r in read_jsonl(tmp_path / "r" / "metrics" / "rank0.jsonl")] == [0, 1]
    assert [f["step"] for f in read_jsonl(tmp_path / "r" / "faults.jsonl")] == [2, 2]
    # Why it stopped stays with the run, not only on the console.
    failed = [e for e in read_jsonl(tmp_path / "r" / "events.jsonl") if e["event"] == "failed"]
    assert len(failed) == 1 and failed[0]["step"] == 2 and failed[0]["rank"] in (0, 1)
    assert failed[0]["cause"].startswith("failed: RuntimeError: ReplicaSync(mode='mean'): no replica is finite")
    assert failed[0]["traceback"].startswith("Traceback (most recent call last)")
    assert main(["report", "r"]) == 0 and (tmp_path / "r" / "report" / "loss.png").is_file()
    assert (f"note: the run failed at step 2: rank {failed[0]['rank']} {failed[0]['cause']} (its traceback is in "
            "events.jsonl)\n") in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["train", *_failing(2), "--run-dir", "r"])
    assert "r holds a run that stopped before its first checkpoint; pass --overwrite" in capsys.readouterr().err


def test_a_resume_commits_its_options_with_its_first_checkpoint(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A plain --resume later took the options of an attempt that never got anywhere.
    monkeypatch.chdir(tmp_path)
    assert main(["train", *_failing(100), "--run-dir", "r"]) == 0
    before = (tmp_path / "r" / "config.json").read_bytes()
    assert main(["train", *_failing(4, steps=8), "--run-dir", "r", "--resume"]) == 1
    err = capsys.readouterr().err
    # Both ranks fail on the same agreed decision: the launcher names the first it saw.
    assert re.search(r"paft train: rank [01] failed: RuntimeError: ReplicaSync\(mode='mean'\): no replica is finite "
                     r"\(NaN/Inf on all 2 ranks\); nothing to average from -- restore a checkpoint; r keeps its "
                     r"checkpoints \(--resume --steps 8 --inject nan:site=params,steps=4,ranks=0\+1 continues from "
                     r"the last\)", err)  # the changed --inject too: config.json has the saved one back
    assert err.count("Traceback (most recent call last)") == 1  # the failed rank's, once
    assert "stopped before a checkpoint: r/config.json keeps the options of its last one" in err
    assert (tmp_path / "r" / "config.json").read_bytes() == before  # --steps 4: a plain --resume is refused
    # Checkpoints at steps 5 and 6 trained with --steps 8: a later --resume goes on with it.
    assert main(["train", *_failing(6, steps=8), "--run-dir", "r", "--resume", "--checkpoint-every", "1"]) == 1
    assert (tmp_path / "r" / "checkpoints" / "latest").read_text().strip() == "step0000006"
    assert json.loads((tmp_path / "r" / "config.json").read_text())["steps"] == 8
    # Falling back from a damaged step 6 to step 5, it writes a new step0000006: the
    # same name in checkpoints/latest, a checkpoint trained with --steps 10.
    damaged = tmp_path / "r" / "checkpoints" / "step0000006" / "rank1.pt"
    damaged.write_bytes(damaged.read_bytes()[:100])
    assert main(["train", *_failing(6, steps=10), "--run-dir", "r", "--resume", "--checkpoint-every", "1"]) == 1
    assert (tmp_path / "r" / "checkpoints" / "latest").read_text().strip() == "step0000006"
    assert json.loads((tmp_path / "r" / "config.json").read_text())["steps"] == 10
    # Each leg's failure stays recorded: a resume cut it away with the steps it re-does.
    events = read_jsonl(tmp_path / "r" / "events.jsonl")
    assert [e["step"] for e in events if e["event"] == "failed"] == [4, 6, 6]


@pytest.mark.parametrize("spec,needle", [
    ("bitflip:steps=100", "cannot fire before step 100, past --steps 3"),
    ("bitflip:rate=0.1,start=10", "cannot fire before step 10, past --steps 3"),
    ("bitflip:steps=5,start=10", "can never fire"),
    ("bitflip:rate=0.5,start=1,stop=2", None),  # step 1 is in the run: no warning
    ("bitflip:rate=0.5,site=optimizer-state", "never fires: --optimizer sgd keeps no state"),
    ("bitflip:steps=0,site=optimizer-state,optimizer=adamw", "optimizer state exists only from step 1 on"),
    ("bitflip:steps=0-1,site=optimizer-state,optimizer=adamw", None),
    ("bitflip:steps=0,burst=3,site=optimizer-state,optimizer=adamw", None),  # the burst fires on steps 1 and 2
    ("bitflip:steps=0,burst=3,start=4", "can never fire"),
    # A stale fault replays the step before: step 0 has none, and optimizer state none at step 1.
    ("stale:steps=0", "can never fire (rate 0, or its steps, start and stop leave no step, and a stale fault "
                      "needs the step before's value)"),
    ("stale:steps=0-1", None),
    ("stale:steps=1,site=optimizer-state,optimizer=adamw",
     "optimizer state exists only from step 1 on and a stale fault needs the step before's value"),
    ("stale:steps=1-2,site=optimizer-state,optimizer=adamw", None),
    ("bitflip:steps=3", "cannot fire before step 3, past --steps 3"),  # steps 0-2 run: the edge
    ("bitflip:steps=100,site=optimizer-state", "never fires: --optimizer sgd keeps no state"),  # said once
])
def test_a_fault_that_cannot_fire_is_warned_about(spec: str, needle: str | None) -> None:
    from paft.options import idle_faults

    spec, _, optimizer = spec.partition(",optimizer=")
    warnings = idle_faults(TrainConfig(steps=3, inject=[spec], optimizer=optimizer or "sgd"))
    assert [needle in w for w in warnings] == [True] if needle else warnings == []


@pytest.mark.parametrize("spec,start,warned", [
    ("stale:steps=4", 4, True),  # the resume's first step has no step before's value
    ("stale:steps=4+9", 4, True),  # step 9 is past --steps 9
    ("stale:steps=4-5", 4, False),
    ("stale:steps=4,burst=2", 4, False),  # its burst goes on at step 5
    ("stale:steps=4", 3, False),
    ("stale:steps=4,site=optimizer-state", 4, True),
    ("stale:rate=0.5", 4, False),
    ("bitflip:steps=4", 4, False),  # only a stale fault needs the step before
    ("stale:steps=2", 4, False),  # it had its chance in the run's first leg
])
def test_a_stale_fault_a_resume_leaves_no_step_for_is_warned_about(spec: str, start: int, warned: bool) -> None:
    from paft.options import idle_faults

    # The run resumed had no stale spec: its checkpoint holds no step before's value.
    warnings = idle_faults(TrainConfig(steps=9, world_size=2, inject=[spec], optimizer="adamw"), start)
    assert warnings == ([f"--inject {spec!r} cannot fire in this resumed run on rank(s) [0, 1]: its only step left "
                         f"is step {start}, the resume's first, and the checkpoint holds no step before's value for "
                         "a stale fault there (it holds one only where a stale spec of the run it resumes could "
                         "hit)"] if warned else [])


@pytest.mark.parametrize("resumed,lacking", [
    (["stale:steps=4"], None),  # the run resumed had it: its checkpoint holds the step before's values
    (["stale:steps=1-2"], None),  # one that could fire in the run resumed, on every rank
    (["stale:steps=2,ranks=0"], [1]),  # a random rank: rank 0's file holds them, rank 1's not
    (["bitflip:steps=4", "stale:site=params,steps=4"], [0, 1]),  # another kind, another site
    (["stale:rate=0"], [0, 1]),  # one that could never fire kept nothing
])
def test_a_stale_fault_at_the_resumed_step_fires_where_the_checkpoint_holds_its_value(
        resumed: list[str], lacking: list[int] | None) -> None:
    from paft.options import idle_faults

    warnings = idle_faults(TrainConfig(steps=9, world_size=2, inject=["stale:steps=4"]), 4, resumed)
    assert [w.split(": its only")[0] for w in warnings] == (
        [f"--inject 'stale:steps=4' cannot fire in this resumed run on rank(s) {lacking}"] if lacking else [])


def test_paft_train_warns_of_a_stale_fault_at_the_step_it_resumes_from(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The README says paft train warns when a stale spec can fire nowhere but where it
    cannot: the first step after a resume too, which went on without a word."""
    import paft.launch

    monkeypatch.setattr(paft.launch, "launch", lambda cfg, *_: 0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r" / "checkpoints").mkdir(parents=True)
    (tmp_path / "r" / "config.json").write_text(json.dumps(TrainConfig(steps=6, run_dir="r").to_dict()))
    (tmp_path / "r" / "checkpoints" / "latest").write_text("step0000006")
    assert main(["train", "--run-dir", "r", "--resume", "--steps", "9", "--inject", "stale:steps=6"]) == 0
    assert capsys.readouterr().err.splitlines()[0] == (
        "paft train: warning: --inject 'stale:steps=6' cannot fire in this resumed run on rank(s) [0, 1, 2, 3]: its "
        "only step left is step 6, the resume's first, and the checkpoint holds no step before's value for a stale "
        "fault there (it holds one only where a stale spec of the run it resumes could hit)")
    assert main(["train", "--run-dir", "r", "--resume", "--steps", "9", "--inject", "stale:steps=6-7"]) == 0
    assert "cannot fire" not in capsys.readouterr().err
    # The run resumed had the spec (config.json's --inject): its checkpoint holds the step before's values.
    (tmp_path / "r" / "config.json").write_text(json.dumps(TrainConfig(steps=6, run_dir="r",
                                                                       inject=["stale:steps=6"]).to_dict()))
    assert main(["train", "--run-dir", "r", "--resume", "--steps", "9"]) == 0
    assert "cannot fire" not in capsys.readouterr().err


def test_paft_train_prints_its_warnings_then_runs(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    import paft.launch

    ran: list[TrainConfig] = []
    monkeypatch.setattr(paft.launch, "launch", lambda cfg, *_: ran.append(cfg) or 0)
    assert main(["train", "--steps", "3", "--inject", "bitflip:steps=100", "--spike-threshold", "3"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "paft train: warning: --inject 'bitflip:steps=100' cannot fire before step 100, past --steps 3",
        "paft train: warning: --spike-threshold has no effect without --guard",
    ]
    assert len(ran) == 1  # a warning, not a refusal
    from paft.options import parse_train_config

    for warn in (False, True):  # under torchrun, one rank of several says them
        parse_train_config(["--spike-threshold", "3"], prog="python -m paft.train", warn=warn)
        said = "python -m paft.train: warning: --spike-threshold has no effect without --guard\n" if warn else ""
        assert capsys.readouterr().err == said


def test_a_resume_names_the_saved_options_it_changes(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A resume keeps the run's saved options and takes those given again: a changed
    --lr, --inject or --no-monitor went on without a word."""
    import paft.launch

    monkeypatch.setattr(paft.launch, "launch", lambda cfg, *_: 0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r").mkdir()
    saved = TrainConfig(steps=6, lr=3e-3, quiet=True, inject=["bitflip:steps=1"], run_dir="r").to_dict()
    (tmp_path / "r" / "config.json").write_text(json.dumps(saved))
    assert main(["train", "--run-dir", "r", "--resume", "--steps", "9"]) == 0
    assert capsys.readouterr().err == ""  # --steps is how a run trains on
    with pytest.raises(SystemExit):  # no change but refused
        main(["train", "--run-dir", "r", "--resume", "--steps", "9", "--seed", "5"])
    assert "changes the run's saved options" not in capsys.readouterr().err
    (tmp_path / "c.toml").write_text('inject = ["nan:steps=7", "bitflip:steps=8"]\n')
    argv = ["train", "--run-dir", "r", "--resume", "--steps", "9", "--lr", "0.001", "--no-monitor", "--no-quiet",
            "--config", "c.toml"]
    assert main(argv) == 0
    assert capsys.readouterr().err == (
        "paft train: warning: --resume changes the run's saved options: --lr 0.001 (was 0.003), --inject "
        "nan:steps=7 --inject bitflip:steps=8 (was bitflip:steps=1), --no-quiet (was --quiet), "
        "--no-monitor (was --monitor)\n")  # one --inject per spec, as the command line takes them
    (tmp_path / "c.toml").write_text("inject = []\n")
    assert main(["train", "--run-dir", "r", "--resume", "--steps", "9", "--config", "c.toml"]) == 0
    assert capsys.readouterr().err == ("paft train: warning: --resume changes the run's saved options: no --inject "
                                       "(was bitflip:steps=1)\n")  # not "--inject none", which no parser takes
    assert main(["train", "--run-dir", "r", "--lr", "0.001"]) == 0  # not a resume: nothing saved to change
    assert capsys.readouterr().err == ""
    # PAFT-Sync's period takes effect; PAFT-Dyn's first one is refused (by check_run_dir),
    # not said to change.
    for mode, said in (("sync", "paft train: warning: --resume changes the run's saved options: --sync-period 7 "
                                "(was 50)\n"), ("dyn", "")):
        saved = TrainConfig(steps=6, quiet=True, run_dir="r", protect=ProtectConfig(mode=mode)).to_dict()
        (tmp_path / "r" / "config.json").write_text(json.dumps(saved))
        assert main(["train", "--run-dir", "r", "--resume", "--steps", "9", "--sync-period", "7"]) == 0
        assert capsys.readouterr().err == said


@pytest.mark.parametrize("argv,expect", [
    (["--spike-threshold", "3"], ["--spike-threshold has no effect without --guard"]),
    (["--guard", "--spike-threshold", "3"], []),
    (["--broadcast-src", "1"],
     ["--broadcast-src has no effect without --sync-mode broadcast and --protect sync or dyn"]),
    (["--protect", "sync", "--sync-mode", "broadcast", "--broadcast-src", "1"], []),
    (["--sync-mode", "broadcast", "--broadcast-src", "1"],
     ["--sync-mode has no effect without --protect sync or dyn",
      "--broadcast-src has no effect without --sync-mode broadcast and --protect sync or dyn"]),
    (["--no-monitor", "--fingerprint-every", "5"], ["--fingerprint-every has no effect with --no-monitor"]),
    (["--workload", "resnet", "--world-size", "2", "--dropout", "0.1"],
     ["--dropout has no effect on the resnet workload"]),
    (["--protect", "sync", "--h-min", "3"], ["--h-min has no effect without --protect dyn"]),
    (["--no-monitor", "--cosine", "off"], ["--cosine has no effect with --no-monitor"]),
    (["--protect", "averager", "--sync-period", "5", "--sync-mode", "mean"],
     ["--sync-mode has no effect without --protect sync or dyn"]),
    (["--warmup-steps", "50", "--steps", "5"],
     ["--warmup-steps 50 is not below --steps 5: the learning rate never reaches --lr and never decays"]),
    (["--steps", "5"], []),  # the default warm-up (20) is not a slip of the user's
    (["--monitor-interval", "0", "--cosine", "exact", "--alert-loss-cv", "1"],
     ["--cosine has no effect with --monitor-interval 0 (no worker metrics)",
      "--alert-loss-cv has no effect with --monitor-interval 0 (no worker metrics)"]),
    (["--monitor-interval", "0", "--sketch-dim", "64"],
     ["--sketch-dim has no effect with --monitor-interval 0 (no worker metrics)"]),
    (["--cosine", "off", "--sketch-dim", "64"], ["--sketch-dim has no effect without --cosine sketch"]),
    (["--world-size", "1", "--alert-loss-cv", "0.1", "--alert-cos-min", "0.5"],
     ["--alert-loss-cv has no effect with one rank (--world-size 1: no other rank to compare with)",
      "--alert-cos-min has no effect with one rank (--world-size 1: no other rank to compare with)"]),
    (["--world-size", "1", "--cosine", "exact"],
     ["--cosine has no effect with one rank (--world-size 1: no other rank to compare with)"]),
    (["--cosine", "off", "--alert-cos-min", "0.5"],
     ["--alert-cos-min has no effect with --cosine off (no cosine is computed)"]),
    (["--guard", "--guard-warmup", "300", "--steps", "200"],
     ["--guard-warmup 300 is not below --steps 200: the spike and rank-outlier detectors never arm (only gross "
      "jumps fire)"]),
    (["--guard", "--guard-warmup", "30"], []),
    (["--guard", "--guard-warmup", "200", "--steps", "200"],
     ["--guard-warmup 200 is not below --steps 200: the spike and rank-outlier detectors never arm (only gross "
      "jumps fire)"]),
    (["--warmup-steps", "5", "--steps", "5"],  # its step 4 trains at 5/5 of --lr
     ["--warmup-steps 5 is not below --steps 5: the learning rate reaches --lr only at the last step and "
      "never decays"]),
    (["--guard-warmup", "300", "--steps", "200"], ["--guard-warmup has no effect without --guard"]),  # said once
    (["--sync-period", "5"], ["--sync-period has no effect with --protect none"]),
    (["--protect", "sync", "--h-max", "500"], ["--h-max has no effect without --protect dyn"]),
    (["--protect", "dyn", "--sync-mode", "broadcast", "--broadcast-src", "1"], []),
    (["--cosine", "exact", "--sketch-dim", "64"], ["--sketch-dim has no effect without --cosine sketch"]),
    (["--no-overlap"], ["--no-overlap has no effect without --protect sync or dyn"]),  # as typed
    (["--protect", "dyn", "--no-monitor"],
     ["--protect dyn with --no-monitor has no fingerprint trigger: replicas that split stay split until the "
      "next scheduled sync (the period still adapts at each sync)"]),
])
def test_options_that_change_nothing_are_named(argv: list[str], expect: list[str]) -> None:
    from paft.options import OptionParser, add_train_options, config_from_namespace, ignored_options

    parser = OptionParser()
    add_train_options(parser)
    ns = parser.parse_args(argv)
    assert ignored_options(ns, config_from_namespace(ns)[0]) == expect


def test_config_file_and_command_line_values_combine(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from paft.options import parse_train_config

    monkeypatch.chdir(tmp_path)
    pathlib.Path("empty.yaml").write_text("# nothing set yet\n")
    assert parse_train_config(["--config", "empty.yaml"]) == parse_train_config([])
    pathlib.Path("run.toml").write_text('inject = "bitflip:steps=1"\n[model]\nn_layer = 1\n')
    # --model fields add to the file's; spelled as a shell user may (spaces, a config file's FALSE)
    cfg, _ = parse_train_config(["--config", "run.toml", "--model", "n_embd = 64", "--model", "bias=FALSE"])
    assert cfg.inject == ["bitflip:steps=1"]  # one spec as a string: a list of one
    assert cfg.model == {"n_layer": 1, "n_embd": 64, "bias": False}


def test_a_config_file_may_start_with_a_byte_order_mark(tmp_path: pathlib.Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows editors (Notepad) may start a UTF-8 file with a byte order mark: a TOML
    file was refused as "Invalid statement (at line 1, column 1)", a JSON one with
    Python's advice to "decode using utf-8-sig"."""
    from paft.options import parse_train_config

    monkeypatch.chdir(tmp_path)
    for name, text in (("c.toml", "steps = 3\n"), ("c.json", '{"steps": 3}'), ("c.yaml", "steps: 3\n")):
        pathlib.Path(name).write_text("\ufeff" + text, encoding="utf-8")
        assert parse_train_config(["--config", name])[0].steps == 3


def test_a_resume_starts_from_the_runs_config_json(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The options a run was started with come back on --resume (from the command line
    or a config file); its --overwrite does not, and a damaged config.json is named."""
    from paft.options import parse_train_config

    monkeypatch.chdir(tmp_path)
    pathlib.Path("r").mkdir()
    first = TrainConfig(world_size=2, batch_size=8, steps=10, optimizer="sgd", run_dir="r", overwrite=True)
    pathlib.Path("r/config.json").write_text(json.dumps(first.to_dict()))
    pathlib.Path("resume.toml").write_text("resume = true\n")
    pathlib.Path("r.toml").write_text('run-dir = "r"\nresume = true\n')
    pathlib.Path("ws3.toml").write_text("world-size = 3\n")
    for argv in (["--run-dir", "r", "--resume"], ["--run-dir", "r", "--config", "resume.toml"], ["--config", "r.toml"]):
        cfg, _ = parse_train_config(["--steps", "20", *argv])
        assert (cfg.optimizer, cfg.world_size, cfg.steps, cfg.resume, cfg.overwrite) == ("sgd", 2, 20, True, False)
    for saved, argv, needle in [
        (first.to_dict(), ["--world-size", "4"],
         "error: --resume: cannot change --world-size (2 in r, 4 asked); start a new run"),
        # Said so before the config's checks, which would blame the batch it cannot split.
        (first.to_dict(), ["--config", "ws3.toml"],
         "error: --resume: cannot change --world-size (2 in r, 3 asked); start a new run"),
        # Not "r/config.json: model (--model): unknown key 'n_layer' for the resnet model",
        # which blamed the saved file for the workload typed over it.
        ({**first.to_dict(), "model": {"n_layer": 1}}, ["--workload", "resnet"],
         "error: --resume: cannot change --workload ('gpt' in r, 'resnet' asked); start a new run"),
        # Not "--batch-size: 7 cannot be split evenly across --world-size 2", fixed to be refused again.
        (first.to_dict(), ["--batch-size", "7"], "error: --resume: cannot change --batch-size (8 in r, 7 asked)"),
        ({"guard": 3}, [], f"error: --resume: {pathlib.Path('r', 'config.json')}: 'guard' must be a mapping, got 3"),
        ({"guard": None}, [], "'guard' must be a mapping, got None"),
        ({**first.to_dict(), "bogus": 1, "guard": {"windw": 5}}, [],
         f"error: --resume: {pathlib.Path('r', 'config.json')}: unknown option(s) 'bogus', 'guard.windw' (from "
         "another paft version, or edited by hand)"),
    ]:
        pathlib.Path("r/config.json").write_text(json.dumps(saved))
        with pytest.raises(SystemExit) as exc:
            parse_train_config(["--run-dir", "r", "--resume", "--steps", "20", *argv])
        assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_a_config_with_infinite_values_comes_back_from_config_json() -> None:
    """config.json stores inf as "inf" (records.jsonable); a --resume rebuilds the config from it."""
    import math

    from paft.config import GuardConfig, MonitorConfig, TrainConfig
    from paft.records import jsonable

    cfg = TrainConfig(monitor=MonitorConfig(alert_loss_cv=math.inf), guard=GuardConfig(update_ratio=math.inf))
    assert TrainConfig.from_dict(json.loads(json.dumps(jsonable(cfg.to_dict())))) == cfg
    with pytest.raises(ValueError, match=r"^unknown option\(s\) 'monitor.every' \(from another paft version"):
        TrainConfig.from_dict({**cfg.to_dict(), "monitor": {"every": 1}})


def test_model_fields_take_numbers_of_any_kind() -> None:
    import numpy as np

    from paft.workloads import model_config

    c = model_config("llama", {"norm_eps": "1e-5", "rope_theta": np.int64(10000), "dropout": np.float64(0.1),
                               "n_layer": np.int32(2)})
    assert (c.norm_eps, c.rope_theta, c.dropout, c.n_layer) == (1e-5, 10000.0, 0.1, 2)
    assert type(c.rope_theta) is float and type(c.n_layer) is int
    with pytest.raises(ValueError, match="rope_theta must be a finite number"):
        model_config("llama", {"rope_theta": 10**400})


def test_config_fields_keep_their_types_from_python() -> None:
    from paft.config import GuardConfig, MonitorConfig, ProtectConfig

    with pytest.raises(ValueError, match=r"^GuardConfig.enabled \(--guard\): expected bool, got 'no'$"):
        GuardConfig(enabled="no")  # type: ignore[arg-type]  # it used to switch the guard on
    with pytest.raises(ValueError, match=r"^MonitorConfig.interval \(--monitor-interval\): expected int, got 2.5$"):
        MonitorConfig(interval=2.5)  # type: ignore[arg-type]
    assert ProtectConfig(target=1).target == 1  # an int where a float is asked is fine


def test_values_read_from_a_file_are_blamed_on_that_file(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A bad value in a --config file (or a hand-edited config.json) named only the
    command-line option, as if the user had typed it."""
    monkeypatch.chdir(tmp_path)
    pathlib.Path("neg.toml").write_text("lr = -1.0\n")
    pathlib.Path("hmax.toml").write_text("h-max = 3\n")
    pathlib.Path("guard.toml").write_text("guard = true\n")
    pathlib.Path("ws3.toml").write_text("world-size = 3\n")
    pathlib.Path("over.toml").write_text("overwrite = true\n")
    for argv, needle in ((["--config", "neg.toml"], "error: --config: neg.toml: lr: must be > 0 and <= 3.40282e+38 "
                                                   "(float32), got -1.0"),
                         (["--config", "hmax.toml"], "error: --config: hmax.toml: h-max: must be >= --h-min = 5, "
                                                     "got 3\n"),
                         (["--h-min", "500"],
                          "--h-max: must be >= --h-min = 500, got 400 (--h-max is at its default)"),
                         (["--config", "hmax.toml", "--h-min", "40"], "error: --h-max: must be >= --h-min"),
                         # typed: the option
                         (["--config", "neg.toml", "--lr", "-2"],
                          "error: --lr: must be > 0 and <= 3.40282e+38 (float32), got -2"),
                         # --no-monitor, typed, is the option "monitor": not the file's doing
                         (["--config", "guard.toml", "--no-monitor"],
                          "error: --guard: needs the per-step monitor; drop --no-monitor"),
                         (["--grad-clip", "inf"], "--grad-clip: must be a finite number >= 0"),
                         # Checks across options say which of them a file set.
                         (["--config", "hmax.toml", "--h-min", "40"], "(--h-max is set in hmax.toml)"),
                         (["--config", "ws3.toml"], "across --world-size 3 (--world-size is set in ws3.toml)"),
                         (["--config", "over.toml", "--resume"], "(--overwrite is set in over.toml)")):
        with pytest.raises(SystemExit) as exc:
            main(["train", "--run-dir", "r", *argv])
        assert exc.value.code == 2 and needle in capsys.readouterr().err
        assert not pathlib.Path("r").exists()


def test_paft_train_exits_with_the_runs_code_or_the_signals(monkeypatch: pytest.MonkeyPatch,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    import paft.launch

    for outcome, code in ((3, 3), (KeyboardInterrupt(), 130), (SignalException("", signal.SIGTERM), 143)):
        def launch(cfg: TrainConfig, *_: object, outcome: int | BaseException = outcome) -> int:
            if isinstance(outcome, BaseException):
                raise outcome
            return outcome

        monkeypatch.setattr(paft.launch, "launch", launch)
        assert main(["train", "--steps", "3"]) == code  # 3: the guard stopped the run (--on-persistent stop)
    assert capsys.readouterr().err == "\npaft train: interrupted (Ctrl-C)\n\npaft train: interrupted (SIGTERM)\n"


def test_the_paft_command_exits_1_when_its_console_goes_and_holds_signals_after_an_interruption(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import paft.cli
    import paft.records
    import paft.signals

    did: list[str] = []
    monkeypatch.setattr(paft.signals, "unwind_on_termination", lambda: None)  # the test process's handlers stay
    monkeypatch.setattr(paft.signals, "ignore_further_signals", lambda: did.append("ignore signals"))
    monkeypatch.setattr(paft.records, "quiet_stdout", lambda: did.append("quiet"))
    for outcome, code, done in ((BrokenPipeError(), 1, ["quiet"]), (130, 130, ["ignore signals"]),
                                (143, 143, ["ignore signals"]), (1, 1, [])):
        def command(*, prog: str, outcome: int | BaseException = outcome) -> int:
            if isinstance(outcome, BaseException):
                raise outcome  # `paft ... | head`: the reader has gone
            return outcome

        monkeypatch.setattr(paft.cli, "main", command)
        with pytest.raises(SystemExit) as exc:
            paft.cli.run()
        assert (exc.value.code, did) == (code, done)
        did.clear()


def test_an_interrupted_run_with_a_checkpoint_says_how_to_continue(tmp_path: pathlib.Path) -> None:
    """paft train's line and rank 0's under torchrun (which had none) name the command."""
    from paft.launch import resume_hint

    run = tmp_path / "my run"
    assert resume_hint(TrainConfig(run_dir=str(run)), "paft train") == ""  # nothing to continue from
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step0000010")
    assert resume_hint(TrainConfig(run_dir=str(run)), "paft train") == (
        f"; to continue from the last checkpoint: paft train --run-dir '{run}' --resume")
    assert resume_hint(TrainConfig(run_dir=str(run)), "torchrun ... -m paft.train") == (
        f"; to continue from the last checkpoint: torchrun ... -m paft.train --run-dir '{run}' --resume")
    # A resume names its --steps and the options it changed (paft.resume_options.resume_args).
    resumed = TrainConfig(run_dir=str(run), resume=True, steps=90)
    assert resume_hint(resumed, "torchrun ... -m paft.train", ["--lr", "0.001", "--inject", "nan:steps=7"]) == (
        f"; to continue from the last checkpoint: torchrun ... -m paft.train --run-dir '{run}' --resume --steps 90 "
        "--lr 0.001 --inject nan:steps=7")
    assert resume_hint(TrainConfig(), "paft train") == ""


def _interrupted_workers(*_: object) -> object:
    """A stand-in for ``paft.launch.local_workers`` whose workers are stopped by Ctrl-C."""
    def run(*_: object) -> None:
        raise KeyboardInterrupt
    return run


def test_an_interrupted_resume_says_to_continue_with_its_steps(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A resume to a larger --steps, interrupted before its next checkpoint, puts back the
    config.json of the last one (--steps 60): the plain --resume its line named was
    refused as "has trained 60 steps already"."""
    import paft.launch

    monkeypatch.setattr(paft.launch, "local_workers", _interrupted_workers)
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step0000060")
    cfg = TrainConfig(world_size=2, steps=200, run_dir=str(tmp_path), resume=True, quiet=True)
    assert paft.launch._run_workers(cfg, ()) == 130
    assert capsys.readouterr().err.endswith(f"--run-dir {tmp_path} --resume --steps 200\n")


def test_python_dash_m_paft_says_to_continue_with_python_dash_m_paft(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Run as ``python -m paft`` (no ``paft`` on PATH), an interrupted run's line named
    ``paft train ...`` to continue it: a command not found where it was started."""
    import paft.launch

    def checkpointed_then_interrupted(*_: object) -> None:
        (tmp_path / "r" / "checkpoints").mkdir()
        (tmp_path / "r" / "checkpoints" / "latest").write_text("step0000004")
        raise KeyboardInterrupt

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(paft.launch, "check_machine", lambda cfg: None)
    monkeypatch.setattr(paft.launch, "local_workers", lambda *_: checkpointed_then_interrupted)
    assert main(["train", "--run-dir", "r", "--world-size", "2", "--quiet"], prog="python -m paft") == 130
    assert capsys.readouterr().err.endswith(
        "python -m paft train: interrupted (Ctrl-C); to continue from the last checkpoint: "
        "python -m paft train --run-dir r --resume\n")


@pytest.mark.parametrize("inject", ['["nan:steps=7", "bitflip:steps=8"]', "[]"])
def test_an_interrupted_resume_says_to_continue_with_every_option_it_changed(
    inject: str, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stopped before its next checkpoint, a resume puts back the config.json of the last
    one; its line named --steps alone, and the command copied from it went on with the
    saved --lr, monitor and faults. An --inject emptied, which only a config file says,
    is named by that file."""
    import shlex

    import paft.launch
    from paft.options import parse_train_config

    monkeypatch.chdir(tmp_path)
    (tmp_path / "r" / "checkpoints").mkdir(parents=True)
    (tmp_path / "r" / "checkpoints" / "latest").write_text("step0000006")
    saved = json.dumps(TrainConfig(steps=6, lr=3e-3, quiet=True, inject=["bitflip:steps=1"], run_dir="r").to_dict())
    (tmp_path / "r" / "config.json").write_text(saved)
    monkeypatch.setattr(paft.launch, "check_machine", lambda cfg: None)
    monkeypatch.setattr(paft.launch, "check_run_dir", lambda cfg: None)  # the checkpoint is a stand-in
    monkeypatch.setattr(paft.launch, "local_workers", _interrupted_workers)
    (tmp_path / "c.toml").write_text(f"inject = {inject}\n")
    argv = ["--run-dir", "r", "--resume", "--steps", "9", "--lr", "0.001", "--no-monitor", "--config", "c.toml"]
    asked, _ = parse_train_config(argv)
    assert main(["train", *argv]) == 130
    err = capsys.readouterr().err
    assert "stopped before a checkpoint: r/config.json keeps the options of its last one" in err
    assert (tmp_path / "r" / "config.json").read_text() == saved
    hint = re.search(r"to continue from the last checkpoint: paft train (.*)\n", err)
    assert hint is not None
    faults = "--config c.toml" if inject == "[]" else "--inject nan:steps=7 --inject bitflip:steps=8"
    assert hint[1] == f"--run-dir r --resume --steps 9 --lr 0.001 {faults} --no-monitor"
    assert parse_train_config(shlex.split(hint[1]))[0] == asked  # goes on as the interrupted resume


def test_a_resume_reads_the_runs_config_json_once(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The options to resume with and the ones the resume changes came from two reads of
    config.json: one file, read and checked twice."""
    import paft.launch

    monkeypatch.setattr(paft.launch, "launch", lambda cfg, *_: 0)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "config.json").write_text(json.dumps(TrainConfig(steps=6, lr=3e-3, run_dir="r").to_dict()))
    reads: list[pathlib.Path] = []
    read_text = pathlib.Path.read_text

    def counted(path: pathlib.Path, *args: Any, **kwargs: Any) -> str:
        reads.append(path)
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", counted)
    assert main(["train", "--run-dir", "r", "--resume", "--steps", "9", "--lr", "0.001"]) == 0
    assert [p for p in reads if p.name == "config.json"] == [pathlib.Path("r", "config.json")]


def test_a_run_dir_in_use_is_refused(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """Two paft train processes in one run directory interleaved their records: a
    --resume or --overwrite while another run holds the directory is refused."""
    from paft.claim import hold_dir_lock

    monkeypatch.chdir(tmp_path)
    run = pathlib.Path("r")
    run.mkdir()
    (run / "config.json").write_text(json.dumps(TrainConfig().to_dict()))
    before = sorted(p.name for p in run.iterdir())
    with hold_dir_lock(run):  # as the launcher of a run in progress holds it
        with pytest.raises(SystemExit) as exc:
            main(["train", "--run-dir", "r", "--overwrite", "--steps", "1"])
        assert exc.value.code == 2
        assert "--run-dir: r is in use by another paft train" in capsys.readouterr().err
        # Without --resume or --overwrite: not "a run that stopped" (no checkpoint yet).
        with pytest.raises(SystemExit):
            main(["train", "--run-dir", "r", "--steps", "1"])
        assert "--run-dir: r is in use by another paft train (a run in progress)" in capsys.readouterr().err
    assert run.is_dir() and sorted(p.name for p in run.iterdir()) == sorted([*before, ".lock"])
    assert not list(tmp_path.glob("r.replaced-*"))


def test_a_resume_into_a_run_dir_in_use_is_refused(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A --resume that every other check accepts (a run with a checkpoint, and more
    --steps) is refused too while a run holds the directory: exit 2, nothing written."""
    import torch

    from paft import launch as launcher
    from paft.claim import hold_dir_lock
    from paft.rundir import _CHECKPOINT_KEYS

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launcher, "_run_workers", lambda cfg, *_: pytest.fail("the resume must not start"))
    cfg = TrainConfig(world_size=2, steps=12, batch_size=16, run_dir="r")
    step = pathlib.Path("r/checkpoints/step0000012")
    step.mkdir(parents=True)
    for rank in range(2):
        torch.save({**dict.fromkeys(_CHECKPOINT_KEYS), "config": cfg.to_dict()}, step / f"rank{rank}.pt")
    pathlib.Path("r/checkpoints/latest").write_text("step0000012\n")
    pathlib.Path("r/config.json").write_text(json.dumps(cfg.to_dict()))
    before = {p: p.read_bytes() for p in pathlib.Path("r").rglob("*") if p.is_file()}
    with hold_dir_lock(pathlib.Path("r")):
        with pytest.raises(SystemExit) as exc:
            main(["train", "--run-dir", "r", "--resume", "--steps", "20"])
        assert exc.value.code == 2
        assert "--run-dir: r is in use by another paft train" in capsys.readouterr().err
    after = {p: p.read_bytes() for p in pathlib.Path("r").rglob("*") if p.is_file() and p.name != ".lock"}
    assert after == before


def test_a_resume_into_a_run_in_progress_before_its_first_checkpoint_says_in_use(
        tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Before its first checkpoint a run in progress has no checkpoints/latest: a --resume
    of it said "no checkpoint to resume ... pass --overwrite", advice that is refused as
    "in use" in turn. It is refused as in use, as a plain start or --overwrite is."""
    from paft.claim import hold_dir_lock

    monkeypatch.chdir(tmp_path)
    run = pathlib.Path("r")
    run.mkdir()
    (run / "config.json").write_text(json.dumps(TrainConfig().to_dict()))
    with hold_dir_lock(run):
        with pytest.raises(SystemExit) as exc:
            main(["train", "--run-dir", "r", "--resume", "--steps", "1"])
        assert exc.value.code == 2
        assert "--run-dir: r is in use by another paft train (a run in progress)" in capsys.readouterr().err
    # Once it is out, the same --resume is told what there is to resume: nothing.
    with pytest.raises(SystemExit):
        main(["train", "--run-dir", "r", "--resume", "--steps", "1"])
    assert "--resume: no checkpoint to resume in r" in capsys.readouterr().err


def test_a_bench_folder_in_use_is_refused(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """Two benchmarks into one --out mixed their runs' records (steps 0..4 twice in one
    metrics file), and the second's --overwrite moved the first's folder aside under it."""
    from paft.claim import hold_dir_lock

    monkeypatch.chdir(tmp_path)
    out = pathlib.Path("b")
    out.mkdir()
    (out / ".paft-bench").write_text("paft bench scaling\n")
    with hold_dir_lock(out, "--out", "paft bench"):  # as a benchmark in progress holds it
        with pytest.raises(SystemExit) as exc:
            main(["bench", "scaling", "--world-sizes", "2", "--steps", "5", "--out", "b", "--overwrite"])
        assert exc.value.code == 2
        assert "--out: b is in use by another paft bench" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == [".lock", ".paft-bench"]
    assert not list(tmp_path.glob("b.replaced-*"))


def test_a_new_run_into_an_existing_empty_folder_holds_one_lock(tmp_path: pathlib.Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher locked an existing folder, then locked it again as a new run's: flock
    locks belong to each open file, so it refused itself and removed the folder."""
    from paft import launch as launcher
    from paft.claim import hold_dir_lock
    from paft.rundir import RunDirError

    monkeypatch.chdir(tmp_path)
    pathlib.Path("d").mkdir()

    def workers(cfg: TrainConfig, *_: object) -> int:
        with pytest.raises(RunDirError, match="in use"), hold_dir_lock(pathlib.Path("d")):
            pass  # held by the launcher while the workers run
        return 0

    monkeypatch.setattr(launcher, "_run_workers", workers)
    assert launcher.launch(TrainConfig(run_dir="d", steps=1)) == 0
    assert pathlib.Path("d/config.json").is_file()


def test_overwrite_of_an_empty_folder_leaves_it_empty_when_the_run_stops(tmp_path: pathlib.Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """--overwrite set an empty folder aside with the lock just taken in it and moved it
    back so: paft then refused the folder ("already exists", and --overwrite "not paft's")."""
    from paft import launch as launcher

    monkeypatch.chdir(tmp_path)
    pathlib.Path("empty").mkdir()
    monkeypatch.setattr(launcher, "_run_workers", lambda cfg, *_: 1)  # stops before its first step
    assert launcher.launch(TrainConfig(run_dir="empty", steps=1, overwrite=True)) == 1
    assert list(pathlib.Path("empty").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]  # nothing set aside either


def test_a_folder_holding_only_a_lock_counts_as_empty(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher killed outright between taking a new folder and writing config.json
    leaves its lock alone there: the folder was refused as "not a paft run", for good, and
    had to be deleted by hand. While a run holds that lock, it is in use."""
    from paft import launch as launcher
    from paft.claim import hold_dir_lock
    from paft.records import LOCK_FILE, output_dir_problem
    from paft.rundir import RunDirError, check_run_dir

    monkeypatch.chdir(tmp_path)
    pathlib.Path("d").mkdir()
    (pathlib.Path("d") / LOCK_FILE).touch()
    with hold_dir_lock(pathlib.Path("d")), pytest.raises(RunDirError, match="in use"):
        check_run_dir(TrainConfig(run_dir="d", steps=1))
    monkeypatch.setattr(launcher, "_run_workers", lambda cfg, *_: 0)
    assert launcher.launch(TrainConfig(run_dir="d", steps=1)) == 0
    assert pathlib.Path("d/config.json").is_file()
    # A benchmark's --out too (it holds a lock of the same name).
    pathlib.Path("b").mkdir()
    (pathlib.Path("b") / LOCK_FILE).touch()
    assert output_dir_problem(pathlib.Path("b"), "--out", {".paft-bench": pathlib.Path.is_file}, False) is None


def test_an_unknown_argument_is_said_by_the_command_it_was_given_to(capsys: pytest.CaptureFixture[str]) -> None:
    for argv, said in ((["--bogus", "report", "x"], "paft: error: unrecognized arguments: --bogus\n(options: paft "
                                                    "--help)"),
                       (["report", "x", "--bogus"], "paft report: error: unrecognized arguments: --bogus\n(options: "
                                                    "paft report --help)"),
                       (["bench", "overhead", "--bogus"], "paft bench overhead: error: unrecognized arguments: "
                                                          "--bogus\n(options: paft bench overhead --help)")):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2 and said in capsys.readouterr().err


def test_a_usage_error_is_one_line_and_a_pointer_to_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["train", "--steps", "0"])
    assert exc.value.code == 2
    assert capsys.readouterr().err == ("paft train: error: --steps: must be >= 1, got 0\n"
                                       "(options: paft train --help)\n")
