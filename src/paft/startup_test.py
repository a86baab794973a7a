"""A Ctrl-C while a paft command imports torch: one line, the shell's 130, nothing left behind."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from paft.startup import command_name, exit_on_interrupt, unwind_on_interrupt

PAFT = str(pathlib.Path(sys.executable).with_name("paft"))


@pytest.mark.parametrize("argv,orig_argv,name", [
    (["/v/bin/paft", "train"], ["/v/bin/python", "/v/bin/paft", "train"], "paft"),
    (["-m", "--run-dir", "r"], ["python", "-u", "-m", "paft.train", "--run-dir", "r"], "python -m paft.train"),
    (["-m"], ["python", "-mpaft.cli"], "paft"),
    (["-m", "train"], ["python", "-m", "paft", "train"], "python -m paft"),  # __main__.py, as it names itself
    (["-m", "-m", "paft.train"], ["python", "-m", "pytest", "-m", "paft.train"], None),  # its arguments are not it
    (["-m", "src"], ["python", "-m", "pytest", "src"], None),
    (["/home/me/train.py"], ["python", "/home/me/train.py"], None),
    (["/home/me/unpaft"], ["python", "/home/me/unpaft"], None),  # a program whose name only ends like it
    (["-c"], ["python", "-c", "import paft"], None),
])
def test_command_name(monkeypatch: pytest.MonkeyPatch, argv: list[str], orig_argv: list[str], name: str | None) -> None:
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    assert command_name() == name


def _as_command(monkeypatch: pytest.MonkeyPatch, argv: list[str], orig_argv: list[str]) -> None:
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", orig_argv)
    exit_on_interrupt()


class _Exited(Exception):
    pass


def _interrupt(monkeypatch: pytest.MonkeyPatch) -> int:
    """Ctrl-C, with os._exit told to raise: the code the process would have ended with."""
    def fake_exit(code: int) -> None:
        raise _Exited(code)

    monkeypatch.setattr(os, "_exit", fake_exit)
    with pytest.raises(_Exited) as exited:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1)  # the handler runs at the next bytecode; this is never reached
    return exited.value.args[0]


@pytest.mark.usefixtures("sigint")
@pytest.mark.parametrize("argv,orig_argv,env,prog", [
    (["/v/bin/paft", "train"], ["/v/bin/python", "/v/bin/paft", "train"], {}, "paft"),
    # The launcher speaks whatever RANK it finds (a cluster job's environment may set one).
    (["/v/bin/paft", "train"], ["/v/bin/python", "/v/bin/paft", "train"], {"RANK": "1"}, "paft"),
    (["-m"], ["python", "-m", "paft.train"], {}, "python -m paft.train"),  # no torchrun, no RANK: it speaks
])
def test_a_command_ends_at_once_on_ctrl_c_until_its_handlers_take_over(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    argv: list[str], orig_argv: list[str], env: dict[str, str], prog: str,
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _as_command(monkeypatch, argv, orig_argv)
    assert _interrupt(monkeypatch) == 130
    assert capsys.readouterr().err == f"\n{prog}: interrupted (Ctrl-C)\n"
    unwind_on_interrupt()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


@pytest.mark.usefixtures("sigint")
@pytest.mark.parametrize("argv,orig_argv,env", [
    # A worker of paft train: multiprocessing gives it the launcher's sys.argv.
    (["/v/bin/paft", "train"], ["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()",
                                "--multiprocessing-fork"], {}),
    (["-m"], ["python", "-m", "paft.train"], {"RANK": "1"}),  # under torchrun, rank 0 speaks
])
def test_the_processes_that_do_not_speak_for_the_command_end_silently(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    argv: list[str], orig_argv: list[str], env: dict[str, str],
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _as_command(monkeypatch, argv, orig_argv)
    assert _interrupt(monkeypatch) == 130
    assert capsys.readouterr().err == ""


def test_sigint_is_left_alone_outside_a_command_or_where_it_is_ignored(
    monkeypatch: pytest.MonkeyPatch, sigint: None
) -> None:
    _as_command(monkeypatch, ["/home/me/train.py"], ["python", "/home/me/train.py"])
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _as_command(monkeypatch, ["/v/bin/paft", "train"], ["/v/bin/python", "/v/bin/paft", "train"])
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    unwind_on_interrupt()  # not its own handler: left ignored
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def _interrupt_while_importing(command: list[str], cwd: pathlib.Path, delay: float) -> tuple[int, str]:
    """Start ``command`` and send it SIGINT ``delay`` seconds after torch's libraries
    appear in it: past the interpreter's own start-up (which paft cannot reach), inside
    ``import paft``. The code it ended with, and its stderr."""
    env = {k: v for k, v in os.environ.items() if k != "RANK"}
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**env, "PYTHONWARNINGS": "ignore"})
    maps = pathlib.Path(f"/proc/{proc.pid}/maps")
    while "/torch/lib/" not in maps.read_text():
        assert proc.poll() is None, proc.communicate()[1]
        time.sleep(0.005)
    time.sleep(delay)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    return proc.returncode, err


@pytest.mark.usefixtures("sigint")
@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="watches the libraries the process maps")
@pytest.mark.parametrize("command,prog", [
    ([PAFT, "train", "--run-dir", "r", "--world-size", "1"], "paft"),
    ([sys.executable, "-m", "paft.train", "--run-dir", "r"], "python -m paft.train"),
])
def test_ctrl_c_while_a_command_imports_torch_ends_in_one_line(
    tmp_path: pathlib.Path, command: list[str], prog: str
) -> None:
    # torch's import lasts a second or more after its libraries are mapped (4 s on 2 busy cores).
    for delay in (0.0, 0.25, 0.5):
        code, err = _interrupt_while_importing(command, tmp_path, delay)
        assert (code, err) == (130, f"\n{prog}: interrupted (Ctrl-C)\n"), delay
        assert list(tmp_path.iterdir()) == []  # no run directory, nor anything else
