"""The exit codes of paft's commands (``paft train``, ``paft bench``, ``python -m
paft.train``), in one place for the code that returns them and the ``--help`` text that
lists them. A command stopped by a signal exits with the shell's code for it (128 + the
signal's number: :func:`paft.signals.interrupted`)."""

from __future__ import annotations

import signal

__all__ = ["EXIT_INTERRUPTED", "EXIT_PERSISTENT_FAULT", "EXIT_USAGE", "EXIT_WORKER_FAILED", "interrupted_codes"]

EXIT_WORKER_FAILED = 1
"""A worker failed (a benchmark's run too): its traceback is printed."""
EXIT_USAGE = 2
"""Bad input, refused before training (argparse's own code for usage errors)."""
EXIT_PERSISTENT_FAULT = 3
"""The guard found a persistently faulty rank and ``--on-persistent stop`` was asked."""
EXIT_INTERRUPTED = 128 + signal.SIGINT
"""Interrupted by Ctrl-C; the other signals paft handles give their own codes
(:func:`interrupted_codes`)."""


def interrupted_codes(resume: bool = False) -> str:
    """The ``--help`` epilogs' entry on the exit codes of a command stopped by a signal;
    with ``resume``, a training command's, which says that ``--resume`` continues it."""
    others = ", ".join(f"{128 + sig} for {sig.name}" for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT))
    if resume:
        return f"{EXIT_INTERRUPTED} interrupted (Ctrl-C; {others}; continue with --resume)"
    return f"{EXIT_INTERRUPTED} interrupted ({others})"
