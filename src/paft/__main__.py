"""``python -m paft``: the ``paft`` command, for an environment without its console script."""

from paft.cli import run

# Named so: a line saying how to go on (--resume) gives a command that runs where ``paft`` is not on PATH.
run(prog="python -m paft")
