"""Every signal a command can get unwinds through its clean-up, is held over steps that
must not stop halfway, and ends the command with the shell's code for it."""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest
from torch.distributed.elastic.multiprocessing.api import SignalException

from paft.signals import SignalHold, ignore_further_signals, interrupted, on_termination_signal, unwind_on_termination
from paft.startup import exit_on_interrupt

pytestmark = pytest.mark.usefixtures("sigint")


def test_a_held_signal_is_acted_on_at_release() -> None:
    hold = SignalHold()
    os.kill(os.getpid(), signal.SIGINT)
    assert hold.came == [signal.SIGINT]  # noted, nothing raised
    with pytest.raises(KeyboardInterrupt):
        hold.release()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    # A second release (a with block's end after an explicit one) acts on nothing and
    # leaves alone a handler set since.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    hold.release()
    assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN


def test_outside_the_main_thread_a_hold_holds_nothing() -> None:
    """Handlers can be set in the main thread only: elsewhere a hold is a no-op, not a ValueError."""
    errors: list[BaseException] = []

    def hold() -> None:
        try:
            with SignalHold() as held:
                assert held.came == []
        except BaseException as err:  # a thread's error would only be printed: the main thread asserts on it
            errors.append(err)

    thread = threading.Thread(target=hold)
    thread.start()
    thread.join()
    assert errors == [] and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_unwinding_on_termination_takes_ctrl_c_back_from_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a command's handlers are in place, Ctrl-C unwinds through them again rather
    than ending the process at once, as it did while the command imported torch."""
    monkeypatch.setattr(sys, "argv", ["/v/bin/paft", "train"])
    monkeypatch.setattr(sys, "orig_argv", ["/v/bin/python", "/v/bin/paft", "train"])
    exit_on_interrupt()
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
    try:
        unwind_on_termination()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_a_hold_in_clean_up_drops_a_second_signal() -> None:
    with pytest.raises(ValueError):
        try:
            raise ValueError("the first interruption")
        finally:
            with SignalHold() as hold:
                os.kill(os.getpid(), signal.SIGINT)
            assert hold.came == [signal.SIGINT]  # dropped: the ValueError goes on unwinding


def test_a_hold_whose_block_raised_drops_its_signal() -> None:
    with pytest.raises(OSError), SignalHold():
        os.kill(os.getpid(), signal.SIGINT)
        raise OSError("the block's own error wins")


def test_a_held_signal_is_the_first_that_came(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two signals held: the first is acted on (its exit code is the one said), and one
    whose handler was the default is sent again, so that it still ends the process."""
    before = {sig: signal.signal(sig, on_termination_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        hold = SignalHold()
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGHUP)
        assert hold.came == [signal.SIGTERM, signal.SIGHUP]
        with pytest.raises(SignalException) as exc:
            hold.release()
        assert exc.value.sigval == signal.SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        sent: list[tuple[int, int]] = []
        monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append((pid, sig)))  # not to end the test
        hold = SignalHold()
        signal.raise_signal(signal.SIGTERM)
        hold.release()
        assert sent == [(os.getpid(), signal.SIGTERM)]
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def test_after_an_interrupt_further_signals_are_ignored() -> None:
    """One signal ends the command; a second (a key held, a group signalled twice) would
    only interrupt torch's exit handlers, with tracebacks: all four are ignored from then."""
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    saved = {sig: signal.getsignal(sig) for sig in signals}
    try:
        ignore_further_signals()
        assert {sig: signal.getsignal(sig) for sig in signals} == dict.fromkeys(signals, signal.SIG_IGN)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_sigterm_unwinds_like_ctrl_c_with_its_own_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    before = signal.signal(signal.SIGTERM, on_termination_signal)
    try:
        with pytest.raises(SignalException) as exc:  # an exception: launch()'s clean-up runs
            signal.raise_signal(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert interrupted(exc.value, "; hint") == 143
    assert "paft train: interrupted (SIGTERM); hint" in capsys.readouterr().err
    assert interrupted(KeyboardInterrupt()) == 130
    assert "interrupted (Ctrl-C)" in capsys.readouterr().err
    # SIGHUP (a closed terminal) and SIGQUIT killed the process before its clean-up
    for sig in (signal.SIGHUP, signal.SIGQUIT):
        saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)}
        try:
            for s in saved:  # as a background job gets them: ignored, not by a handler an earlier test left
                signal.signal(s, signal.SIG_IGN)
            unwind_on_termination()
            with pytest.raises(SignalException) as exc:
                signal.raise_signal(sig)
        finally:
            for s, handler in saved.items():
                signal.signal(s, handler)
        assert interrupted(exc.value) == 128 + sig
        assert f"interrupted ({sig.name})" in capsys.readouterr().err
