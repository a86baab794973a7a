"""The options a ``--resume`` changes from its run's saved ones, said twice: in the
warning before the run starts (``--lr 0.001 (was 0.003)``), and as the command-line
words of the line that says how to continue the run when it stops.

Options are named by their long option without dashes and hold the values
:mod:`paft.options` reads from a config file: ``--inject``'s specs a list, ``--model``'s
fields a list of (key, value) pairs.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any, NamedTuple

from paft.rundir import FIXED_ON_RESUME

__all__ = ["ResumeChange", "resume_changes", "resume_args", "changes_said"]


class ResumeChange(NamedTuple):
    """An option a ``--resume`` changes from its run's saved one (option name, values)."""

    flag: str
    now: Any
    was: Any


def resume_changes(now: dict[str, Any], saved: dict[str, Any]) -> list[ResumeChange]:
    """With ``--resume``, the options whose values ``now`` (the checked config's) change
    from ``saved``, the run's saved ones (its ``config.json``: the last checkpoint's),
    which a resume takes (the rest it keeps). Not ``--steps``, the way to train on, nor
    the options a resume cannot change (refused: ``FIXED_ON_RESUME`` in :mod:`paft.rundir`;
    ``--sync-period`` only under ``--protect dyn``, where it is the first period)."""
    kept = {"steps", "run-dir", *(flag.removeprefix("--") for _, flag in FIXED_ON_RESUME)}
    if now.get("protect") != "dyn":
        kept.discard("sync-period")
    return [ResumeChange(flag, now[flag], saved[flag])
            for flag in now if flag in saved and flag not in kept and now[flag] != saved[flag]]


def resume_args(changes: Sequence[ResumeChange], config_file: str | None, given: dict[str, Any]) -> list[str]:
    """``changes`` as command-line words, for the line that says how to continue a
    resume: stopped before its next checkpoint, it puts back the ``config.json`` of the
    last one, so a plain ``--resume`` would go on with the saved options. An emptied
    ``--inject`` is what only a config file says: that file (``config_file``), and again
    the options typed over its values (``given``: the command line's), which it would
    bring back otherwise (--lr 0.003, the saved value, over the file's 0.5)."""
    words: list[str] = []
    named_file = False
    for flag, now, _ in changes:
        if now == []:
            assert config_file is not None, "only a config file empties a list"
            words += ["--config", config_file]
            named_file = True
        else:
            words += _words(flag, now)
    if named_file:
        said = {"run-dir", "resume", "steps", *(change.flag for change in changes)}  # the hint's own, or above
        words += [w for flag, value in given.items() if flag not in said for w in _words(flag, value)]
    return words


def changes_said(changes: Sequence[ResumeChange]) -> str:
    """``changes`` for the warning, each as the command line gives it, then the saved
    value: ``--lr 0.001 (was 0.003), --no-monitor (was --monitor)``."""
    return ", ".join(f"{_said(flag, now)} (was {_said(flag, was, named=False)})" for flag, now, was in changes)


def _words(flag: str, value: Any) -> list[str]:
    """Option ``flag`` with ``value`` as command-line words."""
    if isinstance(value, bool):
        return [f"--{'' if value else 'no-'}{flag}"]
    if isinstance(value, list):  # --inject's specs, --model's (key, value) pairs: one option each
        return [w for item in value
                for w in (f"--{flag}", f"{item[0]}={item[1]!r}" if isinstance(item, tuple) else item)]
    return [f"--{flag}", str(value)]


def _said(flag: str, value: Any, named: bool = True) -> str:
    """``value`` as the command line gives it; unless ``named``, a value that is one
    word after its option is shown alone (``0.003``, not ``--lr 0.003``)."""
    if value == []:  # --inject emptied (from a --config file: the command line cannot)
        return f"no --{flag}" if named else "none"
    words = _words(flag, value)
    return shlex.join(words[1:] if not named and len(words) == 2 else words)
