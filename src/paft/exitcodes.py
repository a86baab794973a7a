"""The exit codes of paft's commands (``paft train``, ``paft report``, ``paft bench``,
``python -m paft.train``), in one place for the code that returns them and the ``--help``
text that lists them. A command stopped by a signal exits with the shell's code for it
(:func:`signal_exit_code`). stdlib only: :mod:`paft.startup` uses it before torch is imported."""

from __future__ import annotations

import signal

__all__ = ["EXIT_INTERRUPTED", "EXIT_PERSISTENT_FAULT", "EXIT_USAGE", "EXIT_WORKER_FAILED", "TERMINATING_SIGNALS",
           "interrupted_codes", "signal_exit_code"]

TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
"""The signals besides Ctrl-C's SIGINT that the commands unwind on (:mod:`paft.signals`):
what torch's elastic launcher itself turns into an unwind."""


def signal_exit_code(sig: int) -> int:
    """The shell's exit code for a process stopped by signal ``sig``: 128 + its number."""
    return 128 + int(sig)


EXIT_WORKER_FAILED = 1
"""A worker failed (a benchmark's run too): its traceback is printed."""
EXIT_USAGE = 2
"""Bad input, refused before training (argparse's own code for usage errors)."""
EXIT_PERSISTENT_FAULT = 3
"""The guard found a persistently faulty rank and ``--on-persistent stop`` was asked."""
EXIT_INTERRUPTED = signal_exit_code(signal.SIGINT)
"""Interrupted by Ctrl-C; the other signals paft handles give their own codes
(:func:`interrupted_codes`)."""


def interrupted_codes(resume: bool = False) -> str:
    """The ``--help`` epilogs' entry on the exit codes of a command stopped by a signal;
    with ``resume``, a training command's, which says that ``--resume`` continues it."""
    others = ", ".join(f"{signal_exit_code(sig)} for {sig.name}" for sig in TERMINATING_SIGNALS)
    if resume:
        return f"{EXIT_INTERRUPTED} interrupted (Ctrl-C; {others}; continue with --resume)"
    return f"{EXIT_INTERRUPTED} interrupted ({others})"
