"""``python -m paft``: the ``paft`` command, for an environment without its console script."""

from paft.cli import run

run()
