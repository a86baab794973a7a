"""What the fork server that ``paft train`` and ``paft bench`` start their workers from
loads before it forks the first one (see :func:`paft.workers.local_workers`; the test
suite's multi-rank workers too, :func:`paft.testing.run_workers`); nothing imports this
module but such a server.

Each worker is forked from the server, so it starts with everything below already
imported instead of paying for it as a spawned worker would: torch, and
torch._dynamo, which DDP's constructor imports (about 3 s of CPU a worker).

The launcher starts the server deaf to Ctrl-C, so that a Ctrl-C during these imports
does not print their traceback (the launcher handles it). The last line gives the
workers the default disposition instead of that inherited one: a worker forked in the
moment before it sets up its own handlers still ends on the Ctrl-C the launcher
forwards to it, where an ignored SIGINT left the launcher waiting 30 s to kill it.
"""

from __future__ import annotations

import signal

import torch  # noqa: F401
import torch._dynamo  # noqa: F401
import torch.distributed  # noqa: F401
import torch.nn.parallel  # noqa: F401

import paft.launch  # noqa: F401  (the workers' entry point, and paft.train with it)

__all__: list[str] = []

signal.signal(signal.SIGINT, signal.SIG_DFL)
