"""The first thing a paft command does: a Ctrl-C while it imports torch ends it at once, in one line.

``paft`` and ``python -m paft.train`` spend their first second or two in ``import paft``,
which imports torch, before the command's own handlers (:func:`paft.cli.run`,
:func:`paft.launch.torchrun_main`) are in place; so do the workers ``paft train`` spawns
where there is no fork server, which import the console script again (elsewhere they
are forked from a server that imported torch deaf to Ctrl-C). A Ctrl-C there raised KeyboardInterrupt inside
torch's import, which ended the process with a traceback of torch's files (up to 50
lines, once per process), or, where torch's C++ called back into Python, was taken for
numpy being unavailable (the command carried on) or aborted the process
(``terminate called after throwing an instance of 'pybind11::error_already_set'``).
Nothing needs undoing that early, so :func:`exit_on_interrupt`, called by
``paft/__init__.py`` before anything else, has a Ctrl-C end the command there and then
(exit 130, the line the commands say for it), until
:func:`paft.signals.unwind_on_termination` has it unwind to the command's handlers again.
Only the interpreter's own start-up, its first tens of milliseconds, comes before paft's
first line. A program that only imports paft is left alone. stdlib only (and
:mod:`paft.exitcodes`, which is too): torch is what is being waited for.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

from paft.exitcodes import signal_exit_code

__all__ = ["interrupted_line", "command_name", "exit_on_interrupt", "unwind_on_interrupt"]

# What ``python -m`` runs as a paft command -> the name the command says in its messages.
_MODULES = {"paft": "python -m paft", "paft.cli": "paft", "paft.train": "python -m paft.train"}


def interrupted_line(prog: str, what: str = "Ctrl-C", hint: str = "") -> str:
    """What a command says when a signal stopped it; on a line of its own, not after the
    ``^C`` the terminal echoes."""
    return f"\n{prog}: interrupted ({what}){hint}"


def command_name() -> str | None:
    """The paft command this process runs, as its messages name it, or None when it runs
    another program. Meant for the first ``import paft``: ``sys.argv[0]`` is then the
    console script (``.../bin/paft``), or ``-m`` while Python imports the packages of the
    module it is to run, which ``sys.orig_argv`` names just before the program's own
    arguments (``-m paft.train`` or ``-mpaft.train``)."""
    if os.path.basename(sys.argv[0]) == "paft":
        return "paft"
    if sys.argv[0] == "-m":
        return _MODULES.get(sys.orig_argv[-len(sys.argv)].removeprefix("-m"))
    return None


class _Exit:
    """The SIGINT handler while a command starts: say so (if this process speaks for the
    command) and end the process, without unwinding through torch's half-done import."""

    def __init__(self, prog: str, speaks: bool) -> None:
        self.prog = prog
        self.speaks = speaks

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        if self.speaks:
            print(interrupted_line(self.prog), file=sys.stderr, flush=True)
        os._exit(signal_exit_code(signum))


def exit_on_interrupt() -> None:
    """In a paft command, have Ctrl-C end the process at once, with the line the command
    says for it: by the launcher, not by a worker it spawned, and under torchrun by rank 0
    alone, as the commands' own handlers do. Left as it is where Ctrl-C is ignored (a
    background job)."""
    prog = command_name()
    if prog is None or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return
    # Where there is no fork server (Windows), a worker of paft train or paft bench is
    # spawned by multiprocessing, which runs the console script again in it, with the
    # launcher's sys.argv; its own command line ends in this flag. (Forked workers never
    # get here: their server imported paft as ``python -c``.) torchrun's ranks are
    # started as they are, each with its RANK.
    spawned = "--multiprocessing-fork" in sys.orig_argv
    speaks = not spawned and (prog != _MODULES["paft.train"] or os.environ.get("RANK", "0") == "0")
    signal.signal(signal.SIGINT, _Exit(prog, speaks))


def unwind_on_interrupt() -> None:
    """Once a command's handlers are in place (they clean up): Ctrl-C raises
    KeyboardInterrupt again, as :func:`exit_on_interrupt` found it."""
    if isinstance(signal.getsignal(signal.SIGINT), _Exit):
        signal.signal(signal.SIGINT, signal.default_int_handler)
