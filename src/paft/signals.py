"""How a paft command stops on a signal: Ctrl-C, SIGTERM, SIGHUP and SIGQUIT all unwind
through the command's clean-up (a run directory is never stranded halfway), steps that
must not stop halfway hold them (:class:`SignalHold`), and the command ends with the
shell's exit code for the signal, said in one line.

:mod:`paft.startup` covers the command's first second, while ``import paft`` imports
torch; :func:`unwind_on_termination` takes over from it once the command's handlers are
in place.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any

from torch.distributed.elastic.multiprocessing.api import SignalException

from paft.exitcodes import TERMINATING_SIGNALS, signal_exit_code
from paft.startup import interrupted_line, unwind_on_interrupt

__all__ = [
    "SignalHold",
    "ignore_further_signals",
    "interrupted",
    "on_termination_signal",
    "signal_of",
    "unwind_on_termination",
]


def on_termination_signal(signum: int, _frame: Any) -> None:
    """SIGTERM (a scheduler's, ``kill``), SIGHUP and SIGQUIT unwind like Ctrl-C, so the clean-up in
    :func:`paft.claim.claim_run_dir` runs: without it, a run killed while starting lost the run that
    ``--overwrite`` had moved aside, and left a directory holding only config.json.
    (torch's elastic launcher installs its own handler while the workers run, which
    raises the same exception.)"""
    raise SignalException(f"Process {os.getpid()} got signal: {signum}", sigval=signal.Signals(signum))


def unwind_on_termination() -> None:
    """Install :func:`on_termination_signal` for SIGTERM, SIGHUP (a closed terminal or ssh session)
    and SIGQUIT: their default action killed the process before its clean-up ran. Ctrl-C,
    which ended the command at once while it started (:mod:`paft.startup`), unwinds too."""
    unwind_on_interrupt()
    for sig in TERMINATING_SIGNALS:
        signal.signal(sig, on_termination_signal)


def ignore_further_signals() -> None:
    """After an interrupt: one signal is enough, a second one (a key held, a group
    signalled twice) would only interrupt torch's exit handlers, with tracebacks."""
    for sig in (signal.SIGINT, *TERMINATING_SIGNALS):
        signal.signal(sig, signal.SIG_IGN)


class SignalHold:
    """From construction until :meth:`release` (or the end of a ``with`` block), Ctrl-C
    and the terminating signals are only noted; then their handlers come back, and the
    first noted signal is acted on as its handler would have (a ``KeyboardInterrupt``
    or a ``SignalException`` raised there). For steps that must not stop halfway.
    A ``with`` block drops the noted signal when the block raised, or when it runs
    while an exception already unwinds (clean-up in a ``finally``): one interruption
    is enough. Outside the main thread, where handlers cannot be set, it holds nothing.

    Example::

        with SignalHold():
            os.replace(new, old)  # a Ctrl-C meanwhile raises KeyboardInterrupt after it
    """

    def __init__(self) -> None:
        self.came: list[int] = []
        self._unwinding = sys.exc_info()[1] is not None
        self._before: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, *TERMINATING_SIGNALS):
                self._before[sig] = signal.signal(sig, lambda signum, _frame: self.came.append(signum))

    def __enter__(self) -> SignalHold:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any) -> None:
        self.release(act=exc is None and not self._unwinding)

    def release(self, act: bool = True) -> None:
        """Restore the handlers; with ``act``, act on the first signal that came."""
        before, self._before = self._before, {}
        for sig, handler in before.items():
            signal.signal(sig, handler)
        if not (act and self.came and self.came[0] in before):
            return
        sig, handler = self.came[0], before[self.came[0]]
        if callable(handler):
            handler(sig, None)
        elif handler == signal.SIG_DFL:
            os.kill(os.getpid(), sig)


def signal_of(err: BaseException) -> signal.Signals:
    """The signal an interruption (a ``KeyboardInterrupt``: Ctrl-C; a ``SignalException``)
    came from."""
    return signal.Signals(err.sigval) if isinstance(err, SignalException) else signal.SIGINT


def interrupted(err: BaseException, hint: str = "", prog: str = "paft train", say: bool = True) -> int:
    """Say (unless ``say`` is false) that the run was interrupted, and by what; the exit
    code the shell uses for that signal (the --help texts list them: :func:`paft.exitcodes.interrupted_codes`)."""
    sig = signal_of(err)
    what = "Ctrl-C" if sig == signal.SIGINT else sig.name
    if say:
        print(interrupted_line(prog, what, hint), file=sys.stderr)
    return signal_exit_code(sig)
