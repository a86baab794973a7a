"""The one rule for what a plain option value may be, wherever it comes in.

Values reach the config tree from Python (``MonitorConfig(interval=2)``), from config
files (YAML and JSON, with YAML 1.1's quirks) and from ``--model key=value``; each
entry point converts what it must (a YAML ``3e-3`` read as a string) and words its own
error, but they all judge a value by :func:`fits`. The model configs' sizes must
also be positive ints (:func:`require_positive_ints`).

Example::

    >>> fits(int, 3), fits(int, True), fits(float, 3), fits(bool, 0)
    (True, False, True, False)
"""

from __future__ import annotations

import numbers
from typing import Any

__all__ = ["fits", "require_positive_ints"]


def fits(kind: type, value: Any) -> bool:
    """Whether ``value`` may stand where a ``kind`` (bool, int, float or str) is asked.

    A bool strictly: ``enabled="no"`` or ``1`` must not switch a feature on. Otherwise
    never a bool (YAML reads an unquoted ``no`` as False, which is no count). An int:
    any integer (numpy's too); a float: any real number, integers included (finiteness
    is the caller's to ask); anything else: an instance of ``kind``.
    """
    if kind is bool:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    if kind is int:
        return isinstance(value, numbers.Integral)
    if kind is float:
        return isinstance(value, numbers.Real)
    return isinstance(value, kind)


def require_positive_ints(config: object, fields: tuple[str, ...]) -> None:
    """Raise ``ValueError`` naming the first of ``config``'s ``fields`` that is not a
    positive Python int (a bool is none): the model configs' shared size check."""
    for field in fields:
        value = getattr(config, field)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{field} must be a positive int, got {value!r}")
