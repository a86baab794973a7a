"""The exit codes of paft's commands (``paft train``, ``paft bench``, ``python -m
paft.train``), in one place for the code that returns them and the ``--help`` text that
lists them. A command stopped by a signal exits with the shell's code for it (128 + the
signal's number: :func:`paft.signals.interrupted`)."""

from __future__ import annotations

__all__ = ["EXIT_PERSISTENT_FAULT", "EXIT_USAGE", "EXIT_WORKER_FAILED"]

EXIT_WORKER_FAILED = 1
"""A worker failed (a benchmark's run too): its traceback is printed."""
EXIT_USAGE = 2
"""Bad input, refused before training (argparse's own code for usage errors)."""
EXIT_PERSISTENT_FAULT = 3
"""The guard found a persistently faulty rank and ``--on-persistent stop`` was asked."""
