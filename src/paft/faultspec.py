"""The ``--inject`` grammar: :class:`FaultSpec`, one fault as data and as text.

A spec says *what* a fault does and *when* it may fire; :mod:`paft.faults` holds the
tensor edits, the schedule and the injector that carry it out.
:meth:`FaultSpec.parse` reads the text form and :meth:`FaultSpec.to_text` writes it
back (``parse(to_text(s)) == s``); every invalid value raises :class:`FaultSpecError`
naming the field.

Grammar (one ``--inject`` value)::

    KIND:key=value,key=value,...        (rate= or steps= is required)

    KIND        bitflip | scale | noise | zero | nan | inf | random | stale
    site=       aggregation (default) | local-grad | params | optimizer-state
                (optimizer state exists from step 1 on: at step 0 such an event
                finds nothing to hit and is not recorded)
    rate=P      per-step probability in [0, 1] that an event starts
    steps=S     steps where an event may start: 10+20+30, 10-20 (inclusive), 5+10-12
                (with rate: each listed step fires with probability P; without: always)
    start=N     first step an event may start (inclusive, default 0)
    stop=N      step from which no event starts (exclusive, default never)
    ranks=R     random (default: ONE uniformly random rank per event) | 1 | 0+2
                (listed ranks draw independently: each fires with probability P)
    count=N     elements hit per event (default 1) ...
    fraction=F  ... or this fraction of the tensor's elements, in (0, 1]
    bits=B      bitflip only: bit index, or sign | exponent | mantissa | any (default)
    factor=X    scale only: multiply by X, not 1 (default 1000)
    sigma=X     noise only: x += N(0, 1) * X * |x|, X > 0 (default 0.1)
    value=X     random only: replace with U[-X, X], X within the dtype's range
                (default X = max |finite x|)
    burst=N     an event that starts at step s on a rank also fires on s+1 .. s+N-1
    persistent= true | false (default): true fires again when a step is recomputed
                (attempt > 0), as faulty hardware would; false is transient.

    e.g.  bitflip:site=aggregation,rate=0.01,bits=exponent,ranks=1
          scale:steps=100,factor=-1e4,ranks=0
          stale:site=local-grad,rate=0.05,burst=3
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeGuard

import torch

from paft.values import fits

__all__ = [
    "KINDS",
    "SITES",
    "BUCKET_SITES",
    "TENSOR_SITES",
    "BIT_CLASSES",
    "FLOAT_LAYOUT",
    "FaultSpecError",
    "FaultSpec",
    "parse_specs",
    "stale_sites",
    "bit_range",
    "is_int",
]

KINDS: tuple[str, ...] = ("bitflip", "scale", "noise", "zero", "nan", "inf", "random", "stale")
BUCKET_SITES: tuple[str, ...] = ("aggregation", "local-grad")
TENSOR_SITES: tuple[str, ...] = ("params", "optimizer-state")
SITES: tuple[str, ...] = BUCKET_SITES + TENSOR_SITES
BIT_CLASSES: tuple[str, ...] = ("sign", "exponent", "mantissa", "any")

# dtype -> (integer view, width, sign bit, (exponent lo, hi), (mantissa lo, hi))
FLOAT_LAYOUT: dict[torch.dtype, tuple[torch.dtype, int, int, tuple[int, int], tuple[int, int]]] = {
    torch.float32: (torch.int32, 32, 31, (23, 30), (0, 22)),
    torch.bfloat16: (torch.int16, 16, 15, (7, 14), (0, 6)),
    torch.float16: (torch.int16, 16, 15, (10, 14), (0, 9)),
    torch.float64: (torch.int64, 64, 63, (52, 62), (0, 51)),
}

Steps = tuple[tuple[int, int], ...]
Ranks = str | tuple[int, ...]


class FaultSpecError(ValueError):
    """A fault spec is invalid; ``field`` names the offending field (or ``kind``)."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(message)
        self.field = field
        self.reason = message


def _fmt(v: Any) -> str:
    """Render a value as a user typed it: 2.0 -> '2', 0.01 -> '0.01' (exact repr)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    negative_zero = isinstance(v, float) and v == 0 and math.copysign(1, v) < 0  # scales to other bits than 0
    if isinstance(v, float) and math.isfinite(v) and v.is_integer() and abs(v) < 1e16 and not negative_zero:
        return str(int(v))
    return repr(v) if isinstance(v, float) else str(v)


def _dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``: the name a user writes."""
    return str(dtype).replace("torch.", "")


def _err(name: str, msg: str, value: Any = dataclasses.MISSING) -> FaultSpecError:
    got = "" if value is dataclasses.MISSING else f", got {_fmt(value)}"
    return FaultSpecError(f"field '{name}' {msg}{got}", name)


def is_int(v: object) -> TypeGuard[int]:
    """An integer (numpy's too) that is not a ``bool``: specs and schedules never take
    ``True`` for 1. Specs keep it as a Python ``int`` (``int(v)``), whose arithmetic
    never wraps."""
    return fits(int, v)


def _is_real(v: object) -> bool:
    """A real number (numpy's too) that is not a ``bool``; kept as a Python ``float``."""
    return fits(float, v)


def _given(value: Any, default: Any) -> bool:
    """Whether a field holds other than its default; a value that cannot be compared
    with it (an array) counts as given."""
    try:
        return bool(value != default)
    except (TypeError, ValueError):
        return True


def _normalize_steps(value: Any) -> Steps:
    """Steps as sorted, merged, inclusive ``(lo, hi)`` ranges.

    Accepts an int, ``range`` objects, ``(lo, hi)`` pairs and ints, in any mix.
    """
    if isinstance(value, (str, bytes)) or not (is_int(value) or isinstance(value, Iterable)):
        raise _err("steps", "must be an int, a range or a sequence of steps and (lo, hi) pairs", value)
    items = [value] if isinstance(value, range) or not isinstance(value, Iterable) else list(value)  # an int: one step
    ranges: list[tuple[int, int]] = []
    for item in items:
        if isinstance(item, range):
            if item.step != 1:
                raise _err("steps", "ranges must have step 1", str(item))
            lo, hi = item.start, item.stop - 1
        elif is_int(item):
            lo = hi = int(item)
        elif isinstance(item, (tuple, list)) and len(item) == 2:
            lo, hi = item
        else:
            raise _err("steps", "must be steps >= 0 or ranges lo-hi with lo <= hi", item)
        if not (is_int(lo) and is_int(hi)) or lo < 0 or hi < lo:
            raise _err("steps", "must be steps >= 0 or ranges lo-hi with lo <= hi", item)
        ranges.append((int(lo), int(hi)))
    if not ranges:
        raise _err("steps", "must list at least one step")
    ranges.sort()
    merged = [ranges[0]]
    for lo, hi in ranges[1:]:
        plo, phi = merged[-1]
        if lo <= phi + 1:
            merged[-1] = (plo, max(phi, hi))
        else:
            merged.append((lo, hi))
    return tuple(merged)


@dataclass(frozen=True)
class FaultSpec:
    """One fault: what it does (``kind`` and its parameters) and when it fires.

    Build it directly or from text with :meth:`parse`; invalid values raise
    :class:`FaultSpecError` naming the field.
    """

    kind: str
    """What the fault does; one of :data:`KINDS`."""
    site: str = "aggregation"
    """Where it strikes: ``aggregation`` (the all-reduced gradient a rank receives),
    ``local-grad`` (a rank's gradient before the all-reduce), ``params`` or
    ``optimizer-state`` (tensors at rest)."""
    rate: float | None = None
    """Probability in [0, 1] that an event starts at a candidate step (independently
    per step; per listed rank, or once per step for ``ranks='random'``). ``None``
    means 1 when ``steps`` is given. At least one of ``rate`` and ``steps`` is needed."""
    steps: Steps | None = None
    """Candidate start steps, as sorted merged inclusive ``(lo, hi)`` ranges (the
    constructor also takes ints, ``range`` objects and pairs). ``None``: every step."""
    ranks: Ranks = "random"
    """``'random'``: each event picks ONE rank uniformly (the same answer on every
    rank); or a sorted tuple of ranks, each of which draws independently."""
    count: int | None = None
    """Number of elements hit per event (>= 1; capped at the tensor's size). Default 1
    when neither ``count`` nor ``fraction`` is given. Not for ``stale``."""
    fraction: float | None = None
    """Fraction in (0, 1] of the tensor's elements hit per event, rounded half up, at
    least 1. Exclusive with ``count``. Not for ``stale``."""
    bits: int | str = "any"
    """``bitflip`` only: the bit index to flip (checked against the tensor's dtype at
    injection, see :meth:`check_dtype`), or a class (``sign``, ``exponent``,
    ``mantissa``, ``any``) from which each element draws one bit uniformly."""
    factor: float = 1e3
    """``scale`` only: the finite factor the chosen elements are multiplied by."""
    sigma: float = 0.1
    """``noise`` only: relative noise, ``x += z * sigma * |x|`` with ``z ~ N(0, 1)``
    per element (so zeros stay zero); > 0."""
    value: float | None = None
    """``random`` only: replace with uniform values in ``[-value, value]``; ``None``
    uses the largest finite ``|x|`` of the whole tensor (0 if none). In a gradient
    bucket under a float16 loss scaler the values are the scaled gradient's: the
    optimizer sees ``value / scale``."""
    burst: int = 1
    """An event that starts at step ``s`` on a rank fires on steps ``s .. s+burst-1``
    there (same rank for ``ranks='random'``). ``start``/``stop``/``steps``/``rate``
    decide starts only; a burst runs to its end."""
    persistent: bool = False
    """True: the event fires again when the step is recomputed (``attempt > 0``), on
    the same rank and bucket or tensor but at elements drawn anew, as faulty hardware
    would. False: transient, attempt 0 only."""
    start: int = 0
    """First step at which an event may start (inclusive)."""
    stop: int | None = None
    """Step from which no event starts (exclusive); ``None``: never stops."""

    def __post_init__(self) -> None:
        set_ = lambda name, v: object.__setattr__(self, name, v)  # noqa: E731 - frozen
        if self.kind not in KINDS:
            raise FaultSpecError(
                f"unknown fault kind '{self.kind}'; valid kinds: {', '.join(KINDS)}", "kind"
            )
        # Kind-specific knobs on the wrong kind are almost always a typo: say so, before
        # their values are checked, as parse() does (sigma=0 on a zero fault was "must be > 0").
        for name, owner in _KIND_FIELDS.items():
            if self.kind != owner and _given(getattr(self, name), _DEFAULTS[name]):
                raise _err(name, f"applies only to kind '{owner}', not '{self.kind}'")
        if self.site not in SITES:
            raise _err("site", f"must be one of {', '.join(SITES)}", self.site)
        if self.rate is not None:
            if not _is_real(self.rate):
                raise _err("rate", "must be a number in [0, 1]", self.rate)
            set_("rate", float(self.rate))
            if not 0.0 <= self.rate <= 1.0:
                raise _err("rate", "must be in [0, 1]", self.rate)
        if self.steps is not None:
            set_("steps", _normalize_steps(self.steps))
        if self.rate is None and self.steps is None:
            raise _err("rate", "or 'steps' must be given (a fault needs to know when to fire)")
        if self.ranks != "random":
            # bytes iterate as ints: b"1" would have named rank 49.
            if (isinstance(self.ranks, (str, bytes, bytearray)) or is_int(self.ranks)
                    or not isinstance(self.ranks, Iterable)):
                raise _err("ranks", "must be 'random' or a tuple of ranks", self.ranks)
            ranks = tuple(self.ranks)
            if not ranks or not all(is_int(r) and r >= 0 for r in ranks):
                raise _err("ranks", "must be 'random' or ranks >= 0", "+".join(map(str, ranks)))
            if len(set(ranks)) != len(ranks):
                raise _err("ranks", "lists a rank twice", "+".join(map(str, ranks)))
            set_("ranks", tuple(sorted(int(r) for r in ranks)))
        if self.count is not None and self.fraction is not None:
            raise _err("fraction", "cannot be combined with 'count'")
        if self.count is not None:
            if not is_int(self.count) or self.count < 1:
                raise _err("count", "must be an integer >= 1", self.count)
            set_("count", int(self.count))
        if self.fraction is not None:
            if not _is_real(self.fraction):
                raise _err("fraction", "must be a number in (0, 1]", self.fraction)
            set_("fraction", float(self.fraction))
            if not 0.0 < self.fraction <= 1.0:
                raise _err("fraction", "must be in (0, 1]", self.fraction)
        if self.kind == "stale" and (self.count is not None or self.fraction is not None):
            name = "count" if self.count is not None else "fraction"
            raise _err(name, "does not apply to kind 'stale' (it replaces the whole tensor)")
        if is_int(self.bits):
            if not 0 <= self.bits < 64:
                raise _err("bits", "must be a bit index in [0, 63] or one of "
                           f"{', '.join(BIT_CLASSES)}", self.bits)
            set_("bits", int(self.bits))
        elif self.bits not in BIT_CLASSES:
            raise _err("bits", f"must be a bit index or one of {', '.join(BIT_CLASSES)}",
                       self.bits)
        for name in ("factor", "sigma"):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v):
                raise _err(name, "must be a finite number", v)
            set_(name, float(v))
        # A fault that leaves every value as it was would still be recorded and counted.
        if self.sigma <= 0:
            raise _err("sigma", "must be > 0 (0 leaves the values unchanged)", self.sigma)
        if self.factor == 1:
            raise _err("factor", "must not be 1 (it leaves the values unchanged)", self.factor)
        if self.value is not None:
            v = self.value
            if not _is_real(v) or not (math.isfinite(v) and v > 0):
                raise _err("value", "must be a finite number > 0", v)
            set_("value", float(v))
        if not is_int(self.burst) or self.burst < 1:
            raise _err("burst", "must be an integer >= 1", self.burst)
        set_("burst", int(self.burst))
        if not isinstance(self.persistent, bool):
            raise _err("persistent", "must be true or false", self.persistent)
        if not is_int(self.start) or self.start < 0:
            raise _err("start", "must be an integer >= 0", self.start)
        set_("start", int(self.start))
        if self.stop is not None:
            if not is_int(self.stop) or self.stop <= self.start:
                raise _err("stop", f"must be an integer > start ({self.start})", self.stop)
            set_("stop", int(self.stop))

    # ------------------------------------------------------------------ text form

    @classmethod
    def parse(cls, text: str, *, option: str = "fault spec") -> FaultSpec:
        """Parse ``KIND[:key=value,...]`` (see the module docstring for the keys).

        Errors are :class:`FaultSpecError` whose message starts with
        ``"{option} '{text}': "`` and names the field, e.g.
        ``fault spec 'bitflip:rate=2': field 'rate' must be in [0, 1], got 2``.
        ``option`` is how the caller's users know the text: the command line passes
        ``--inject``, ``protect()`` its own argument."""
        try:
            return cls._parse(text)
        except FaultSpecError as e:
            raise FaultSpecError(f"{option} '{text}': {e.reason}", e.field) from None

    @classmethod
    def _parse(cls, text: str) -> FaultSpec:
        if not isinstance(text, str):
            raise FaultSpecError(f"expected a string, got {type(text).__name__}", "kind")
        head, _, rest = text.strip().partition(":")
        kind = head.strip().lower()
        if kind not in KINDS:
            raise FaultSpecError(
                f"unknown fault kind '{head.strip()}'; valid kinds: {', '.join(KINDS)}", "kind"
            )
        kwargs: dict[str, Any] = {}
        for item in rest.split(","):
            if not item.strip():
                continue  # tolerate "kind:" and a trailing comma
            key, eq, raw = item.partition("=")
            key, raw = key.strip().lower(), raw.strip()
            if key not in _PARSERS:
                raise FaultSpecError(
                    f"unknown key '{key}'; valid keys: {', '.join(_PARSERS)}", key or "kind"
                )
            if not eq or not raw:
                raise _err(key, "needs a value (key=value)")
            if key in kwargs:
                raise _err(key, "is given twice")
            owner = _KIND_FIELDS.get(key)
            if owner is not None and owner != kind:
                raise _err(key, f"applies only to kind '{owner}', not '{kind}'")
            kwargs[key] = _PARSERS[key](raw)
        return cls(kind=kind, **kwargs)

    def to_text(self) -> str:
        """The canonical text form; ``FaultSpec.parse(s.to_text()) == s``."""
        parts: list[str] = []
        for f in dataclasses.fields(self):
            if f.name == "kind":
                continue
            v = getattr(self, f.name)
            if v == _DEFAULTS[f.name]:
                continue
            if f.name == "steps":
                text = "+".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in v)
            elif f.name == "ranks" and v != "random":
                text = "+".join(map(str, v))
            else:
                text = _fmt(v)
            parts.append(f"{f.name}={text}")
        return self.kind + (":" + ",".join(parts) if parts else "")

    def __str__(self) -> str:
        return self.to_text()

    # ------------------------------------------------------------------ helpers

    def first_firing(self, after: int = 0) -> int | None:
        """The earliest step (from ``after`` on) at which the spec may fire, or ``None``
        if ``steps``, ``start`` and ``stop`` leave no such step (it can never fire there).
        An event that starts up to ``burst - 1`` steps before ``after`` fires at ``after``."""
        start = max(self.start, after - self.burst + 1)
        if self.steps is None:
            first: int | None = start
        else:
            first = next((max(lo, start) for lo, hi in self.steps if hi >= start), None)
        if first is None or (self.stop is not None and first >= self.stop) or self.rate == 0:
            return None
        return max(first, after)

    def check_ranks(self, world_size: int, name: str = "world_size") -> None:
        """Raise :class:`FaultSpecError` (field ``ranks``) if a listed rank is not below
        ``world_size`` (``name``: how the caller's users know it, e.g. ``--world-size``)."""
        if isinstance(self.ranks, tuple) and max(self.ranks) >= world_size:  # not "random"
            raise FaultSpecError(f"field 'ranks' names rank {max(self.ranks)} but {name} is {world_size}", "ranks")

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Raise :class:`FaultSpecError` (field ``bits``, or ``value``) if this spec cannot
        corrupt tensors of ``dtype`` as written; call it before training starts to fail early."""
        if self.kind == "random" and self.value is not None and dtype.is_floating_point:
            top = torch.finfo(dtype).max  # beyond it a "random" value rounds to inf: another fault
            if self.value > top:
                raise _err("value", f"must be <= {top:g} for {_dtype_name(dtype)}", self.value)
        if self.kind != "bitflip":
            return
        if dtype not in FLOAT_LAYOUT:
            supported = ", ".join(_dtype_name(d) for d in FLOAT_LAYOUT)
            raise _err("bits", f"bitflip supports dtypes {supported}, not {_dtype_name(dtype)}")
        width = FLOAT_LAYOUT[dtype][1]
        if is_int(self.bits) and self.bits >= width:
            raise _err("bits", f"must be < {width} for {_dtype_name(dtype)}",
                       self.bits)

    def takes(self, dtype: torch.dtype) -> bool:
        """Whether :meth:`check_dtype` accepts ``dtype``."""
        try:
            self.check_dtype(dtype)
        except FaultSpecError:
            return False
        return True

    def may_hit_rank(self, rank: int) -> bool:
        """Whether an event of this spec can ever fire on ``rank``."""
        return self.ranks == "random" or rank in self.ranks


_KIND_FIELDS = {"bits": "bitflip", "factor": "scale", "sigma": "noise", "value": "random"}
_DEFAULTS = {
    f.name: f.default for f in dataclasses.fields(FaultSpec) if f.name != "kind"
}


_INT = re.compile(r"-?[0-9]+", re.ASCII)
_FLOAT = re.compile(r"-?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|-?(?:inf|infinity|nan)",
                    re.ASCII | re.IGNORECASE)


def _strict(cast: type[int | float], raw: str) -> int | float:
    """``cast(raw)`` for plain ASCII numbers only: Python's int() and float() also take
    ``1_000``, ``+5`` and other scripts' digits, which a fault spec should not."""
    if not (_INT if cast is int else _FLOAT).fullmatch(raw.strip()):
        raise ValueError(raw)
    return cast(raw)


def _parse_number(key: str, cast: type[int | float]) -> Callable[[str], int | float]:
    """A parser of field ``key``'s text as ``cast``, raising a FaultSpecError that names it."""
    what = "an integer" if cast is int else "a number"

    def parse(raw: str) -> int | float:
        try:
            return _strict(cast, raw)
        except ValueError:
            raise _err(key, f"must be {what}", raw) from None

    return parse


def _parse_steps(raw: str) -> Steps:
    out: list[tuple[int, int]] = []
    for tok in raw.split("+"):
        lo, dash, hi = tok.strip().partition("-")
        try:
            a = int(_strict(int, lo))
            b = int(_strict(int, hi)) if dash else a
        except ValueError:
            raise _err("steps", "must look like 10+20+30, 10-20 or 5+10-12", raw) from None
        if a < 0 or b < a:
            raise _err("steps", "ranges lo-hi need 0 <= lo <= hi", raw)
        out.append((a, b))
    return _normalize_steps(out)


def _parse_ranks(raw: str) -> Ranks:
    if raw.lower() == "random":
        return "random"
    try:
        return tuple(int(_strict(int, t)) for t in raw.split("+"))
    except ValueError:
        raise _err("ranks", "must be 'random' or ranks like 1 or 0+2", raw) from None


def _parse_bits(raw: str) -> int | str:
    if raw.lower() in BIT_CLASSES:
        return raw.lower()
    try:
        return int(_strict(int, raw))
    except ValueError:
        raise _err("bits", f"must be a bit index or one of {', '.join(BIT_CLASSES)}",
                   raw) from None


def _parse_persistent(raw: str) -> bool:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    raise _err("persistent", "must be true or false", raw)


def _parse_site(raw: str) -> str:
    return raw.lower()


_PARSERS = {  # in FaultSpec field order, which is also to_text's order
    "site": _parse_site,
    "rate": _parse_number("rate", float),
    "steps": _parse_steps,
    "ranks": _parse_ranks,
    "count": _parse_number("count", int),
    "fraction": _parse_number("fraction", float),
    "bits": _parse_bits,
    "factor": _parse_number("factor", float),
    "sigma": _parse_number("sigma", float),
    "value": _parse_number("value", float),
    "burst": _parse_number("burst", int),
    "persistent": _parse_persistent,
    "start": _parse_number("start", int),
    "stop": _parse_number("stop", int),
}


def parse_specs(texts: Iterable[str], option: str = "fault spec") -> list[FaultSpec]:
    """Parse several specs, in order (the order fixes spec indices); errors name each
    text as :meth:`FaultSpec.parse` does, by ``option``."""
    return [FaultSpec.parse(t, option=option) for t in texts]


def stale_sites(specs: Iterable[FaultSpec], rank: int) -> frozenset[str]:
    """The sites where a ``stale`` spec of ``specs`` that can fire may hit ``rank``: those
    whose previous values a :class:`paft.faults.FaultInjector` of ``rank`` keeps, and
    so a checkpoint of its run holds."""
    return frozenset(s.site for s in specs
                     if s.kind == "stale" and s.may_hit_rank(rank) and s.first_firing() is not None)


def bit_range(dtype: torch.dtype, bits: int | str) -> tuple[int, int]:
    """Inclusive ``(lo, hi)`` bit indices of a class (or a single bit) for ``dtype``."""
    if dtype not in FLOAT_LAYOUT:
        raise ValueError(f"bitflip does not support dtype {dtype}")
    _, width, sign, exponent, mantissa = FLOAT_LAYOUT[dtype]
    if isinstance(bits, str):
        return {"sign": (sign, sign), "exponent": exponent, "mantissa": mantissa,
                "any": (0, width - 1)}[bits]
    if not is_int(bits) or not 0 <= bits < width:
        raise ValueError(f"bit {bits} out of range for {dtype} ({width} bits)")
    return bits, bits
