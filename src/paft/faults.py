"""Silent-data-corruption (SDC) injection: fault kinds, schedule, injector.

paft tests and evaluates its defenses by corrupting numbers where real clusters do:
in the all-reduced gradient (``aggregation``), in a rank's gradient before the
all-reduce (``local-grad``), and in parameters or optimizer state at rest
(``params``, ``optimizer-state``). This module holds everything about *what* a fault
does and *when* it fires, and nothing about process groups, so every decision is a
pure function that tests check in microseconds:

- **kinds** (:func:`apply_fault`): in-place tensor edits, with elements chosen by a
  seeded :class:`torch.Generator` (``stale`` instead replays the previous value of
  the whole tensor: :func:`_replay_stale`);
- :class:`~paft.faultspec.FaultSpec` (its own module, :mod:`paft.faultspec`): one
  fault, with the text grammar of ``--inject``;
- :class:`FaultSchedule`: a counter-based, random-access function of
  ``(seed, spec index, step, rank)``: the answer for step ``t`` never depends on which
  steps were asked before, so a resumed or recomputed run sees the same faults
  (except ``stale`` on a run's first step, which has no previous values to replay; on
  optimizer state, which the first update creates, the second; after a resume the
  injector's :meth:`~FaultInjector.state_dict`, part of the protector's checkpoint,
  brings back the values the first resumed step replays, where a ``stale`` spec of the
  run that saved it could hit the rank and site: not for a spec a resume adds, nor
  from a checkpoint of an older version);
- :class:`FaultInjector`: what the DDP comm hook (bucket sites) and the protector
  (at-rest sites, before a step) call; it returns :class:`FaultRecord` values for
  ``faults.jsonl``.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from paft.faultspec import (
    BUCKET_SITES,
    FLOAT_LAYOUT,
    SITES,
    TENSOR_SITES,
    FaultSpec,
    FaultSpecError,
    bit_range,
    is_int,
    stale_sites,
)
from paft.fingerprint import repr_digest
from paft.records import jsonable

__all__ = [
    "RECORD_VALUES",
    "select_indices",
    "flip_bits_",
    "Applied",
    "apply_fault",
    "FaultEvent",
    "FaultSchedule",
    "FaultRecord",
    "FaultInjector",
]

RECORD_VALUES = 8
"""How many indices / before / after values a :class:`FaultRecord` keeps."""


# --------------------------------------------------------------------------- kinds



def _num_selected(numel: int, count: int | None, fraction: float | None) -> int:
    if numel <= 0:
        return 0
    if fraction is not None:
        return min(numel, max(1, math.floor(fraction * numel + 0.5)))
    return min(numel, 1 if count is None else count)


def select_indices(
    numel: int, generator: torch.Generator, *, count: int | None = None,
    fraction: float | None = None,
) -> Tensor:
    """Sorted flat indices (CPU int64) of ``count`` (default 1) or ``fraction`` of
    ``numel`` elements, uniformly without replacement."""
    k = _num_selected(numel, count, fraction)
    if k == 0:
        return torch.empty(0, dtype=torch.int64)
    if k <= 4096 and 4 * k <= numel:
        # Few of many (the usual SDC case, even in 100M-element buckets): draw and drop
        # repeats, which is uniform over k-subsets and costs O(k), not O(numel).
        chosen: list[int] = []
        seen: set[int] = set()
        while len(chosen) < k:
            for v in torch.randint(numel, (2 * (k - len(chosen)) + 4,),
                                   generator=generator).tolist():
                if v not in seen:
                    seen.add(v)
                    chosen.append(v)
                    if len(chosen) == k:
                        break
        idx = torch.tensor(chosen, dtype=torch.int64)
    else:
        idx = torch.randperm(numel, generator=generator)[:k]
    return idx.sort().values


def _masks(bits: Tensor, width: int, int_dtype: torch.dtype) -> Tensor:
    """``1 << bit`` per element as the signed integer type (the sign bit wraps)."""
    if width == 64:
        shifted = torch.ones_like(bits) << bits.clamp(max=62)
        return torch.where(bits == 63, torch.full_like(bits, -(2**63)), shifted)
    m = torch.ones_like(bits) << bits
    return torch.where(m >= 2 ** (width - 1), m - 2**width, m).to(int_dtype)


def flip_bits_(flat: Tensor, indices: Tensor, bits: Tensor) -> None:
    """XOR bit ``bits[i]`` of element ``indices[i]`` of the 1-D tensor ``flat``, on its
    integer view (so NaN payloads and signed zeros are exact)."""
    int_dtype, width = FLOAT_LAYOUT[flat.dtype][:2]
    iv = flat.view(int_dtype)
    idx = indices.to(flat.device)
    iv[idx] = iv[idx] ^ _masks(bits, width, int_dtype).to(flat.device)


@dataclass(frozen=True)
class Applied:
    """What :func:`apply_fault` did (first :data:`RECORD_VALUES` of each list)."""

    num_elements: int
    """Elements the fault was applied to (for ``stale``: the whole tensor)."""
    indices: list[int]
    """Flat indices hit (for ``stale``: those whose bits changed), ascending."""
    before: list[float]
    after: list[float]
    bits: list[int] | None = None
    """``bitflip``: the bit flipped at each of ``indices``."""


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


_NOISE_SHIFT = 2.0 ** 64
"""A power of two (exact to scale by) that keeps ``z * sigma`` inside float64's range,
whatever finite ``sigma`` a spec holds."""


def _noisy(x: Tensor, z: Tensor, sigma: float, dtype: torch.dtype) -> Tensor:
    """``x + z * sigma * |x|`` in ``x``'s dtype, rounded to ``dtype``; redone where that
    arithmetic overflowed for a finite ``x``: a ``sigma`` past float32's range (1e39) was
    inf there, which turned a zero into NaN and a 1e-30 into inf, not 1e9 (``z * sigma``
    past float64's does the same to a float64 tensor). Redone in float64, scaled down by
    :data:`_NOISE_SHIFT` and back up, so that only a value past the range is inf; the
    values the plain sum got right keep its bits."""
    noisy = x + z * sigma * x.abs()
    x64, z64 = x.double(), z.double()
    redone = (x64 / _NOISE_SHIFT + (z64 / _NOISE_SHIFT * sigma) * x64.abs()) * _NOISE_SHIFT
    overflowed = torch.isfinite(x) & ~torch.isfinite(noisy)
    return torch.where(overflowed, redone.to(dtype), noisy.to(dtype))


def apply_fault(
    spec: FaultSpec, tensor: Tensor, generator: torch.Generator,
    previous: Tensor | None = None,
) -> Applied | None:
    """Corrupt ``tensor`` in place as ``spec`` says; ``None`` if there was nothing to do
    (empty tensor, or ``stale`` with no usable ``previous`` value).

    Randomness (which elements, which bits, noise, random values) comes only from
    ``generator`` (a CPU generator) and is moved to the tensor's device, so the same
    generator state gives the same corruption on CPU and GPU. Kinds:
    ``bitflip`` flips one bit per element (see :attr:`FaultSpec.bits`); ``scale``
    multiplies by ``factor``, in float64 (then rounded to the dtype); ``noise`` adds
    ``z * sigma * |x|``, ``z ~ N(0, 1)``, computed in float32 (float64 for float64
    tensors; redone where that overflowed, so a zero stays zero whatever the sigma);
    ``zero``; ``nan``; ``inf`` (+inf); ``random`` draws ``U[-r, r)`` (rounded to the
    dtype); ``stale`` copies ``previous`` (same shape and dtype) over the whole tensor.
    """
    if not tensor.is_floating_point():
        raise ValueError(f"can only corrupt floating-point tensors, got {tensor.dtype}")
    if spec.kind == "bitflip":
        spec.check_dtype(tensor.dtype)
    n = tensor.numel()
    if n == 0:
        return None
    if spec.kind == "stale":
        return _replay_stale(tensor, previous)
    indices = select_indices(n, generator, count=spec.count, fraction=spec.fraction)
    k = indices.numel()
    contiguous = tensor.is_contiguous()
    with torch.no_grad():
        # Non-contiguous tensors: corrupt a contiguous copy, then write it back.
        work = tensor.view(-1) if contiguous else tensor.contiguous().view(-1)
        idx = indices.to(tensor.device)
        head = idx[:RECORD_VALUES]
        before = work[head].double().tolist()
        bits_list: list[int] | None = None
        cdt = _compute_dtype(tensor.dtype)
        if spec.kind == "bitflip":
            lo, hi = bit_range(tensor.dtype, spec.bits)
            bits = torch.randint(lo, hi + 1, (k,), generator=generator, dtype=torch.int64)
            flip_bits_(work, indices, bits)
            bits_list = bits[:RECORD_VALUES].tolist()
        elif spec.kind == "scale":
            # In float64 whatever the dtype: in float32 a factor past its range (1e39) became
            # inf, which turned a zero into NaN and a 1e-20 into inf, and one below it (1e-46)
            # became 0, which zeroed a 1e30 instead of making it 1e-16.
            work[idx] = (work[idx].double() * spec.factor).to(tensor.dtype)
        elif spec.kind == "noise":
            z = torch.randn(k, generator=generator, dtype=cdt).to(tensor.device)
            x = work[idx].to(cdt)
            work[idx] = _noisy(x, z, spec.sigma, tensor.dtype)
        elif spec.kind == "zero":
            work[idx] = 0
        elif spec.kind == "nan":
            work[idx] = float("nan")
        elif spec.kind == "inf":
            work[idx] = float("inf")
        elif spec.kind == "random":
            if spec.value is not None:
                r = spec.value
            else:
                a = work.abs()
                a = a[torch.isfinite(a)]
                r = float(a.max()) if a.numel() else 0.0
            u = torch.rand(k, generator=generator, dtype=torch.float64)
            work[idx] = (u * (2 * r) - r).to(device=tensor.device, dtype=tensor.dtype)
        else:  # pragma: no cover - KINDS is closed and validated
            raise AssertionError(spec.kind)
        after = work[head].double().tolist()
        if not contiguous:
            tensor.copy_(work.view(tensor.shape))
    return Applied(k, head.tolist(), before, after, bits_list)


def _replay_stale(tensor: Tensor, previous: Tensor | None) -> Applied | None:
    """The ``stale`` kind: copy ``previous`` over the whole non-empty ``tensor``,
    recording the elements whose bits changed; ``None`` without a ``previous`` of the
    same shape and dtype."""
    if previous is None or previous.shape != tensor.shape or previous.dtype != tensor.dtype:
        return None
    with torch.no_grad():
        prev = previous.to(tensor.device)
        diff = (tensor.reshape(-1).view(_int_view(tensor.dtype))
                != prev.reshape(-1).view(_int_view(tensor.dtype))).nonzero().flatten()
        idx = diff[:RECORD_VALUES]
        before = tensor.reshape(-1)[idx].double().tolist()
        tensor.copy_(prev)
        after = tensor.reshape(-1)[idx].double().tolist()
    return Applied(tensor.numel(), idx.tolist(), before, after)


def _int_view(dtype: torch.dtype) -> torch.dtype:
    return {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        torch.empty(0, dtype=dtype).element_size()
    ]


# --------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class FaultEvent:
    """A spec firing at one (step, rank, site)."""

    spec_index: int
    spec: FaultSpec
    step: int
    rank: int
    site: str
    attempt: int
    burst_start: int
    """The step at which this event's burst started (== ``step`` without bursts)."""


class FaultSchedule:
    """When and where each spec fires: a pure function of (seed, spec index, step, rank).

    Every decision hashes its coordinates (blake2b, counter-based), so queries are
    random-access: asking about step 1000 first, or after a resume, gives the same
    answer as walking steps 0..1000. Specs are identified by their index in ``specs``.
    A spec given as text is parsed here; its errors name it by ``option``, as the
    caller's users know it (the command line passes ``--inject``).
    """

    def __init__(self, specs: Sequence[FaultSpec | str], seed: int, world_size: int, *,
                 option: str = "FaultSchedule(): specs") -> None:
        if not is_int(seed):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if not is_int(world_size) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        self.specs: tuple[FaultSpec, ...] = tuple(
            FaultSpec.parse(s, option=option) if isinstance(s, str) else s for s in specs
        )
        self.seed = int(seed)  # a numpy integer's arithmetic would wrap in the hashing
        self.world_size = int(world_size)
        for i, s in enumerate(self.specs):
            try:
                s.check_ranks(world_size)
            except FaultSpecError as err:
                raise FaultSpecError(f"fault {i} '{s.to_text()}': {err.reason}", err.field) from None
        # Specs that can fire at no step (rate 0, or steps/start/stop leaving none): asked
        # about a step, one with a long burst hashed every step of its window for nothing.
        self._never = frozenset(i for i, s in enumerate(self.specs) if s.first_firing() is None)
        # For bisect on the candidate steps.
        self._step_lows = [None if s.steps is None else [lo for lo, _ in s.steps]
                           for s in self.specs]

    def __repr__(self) -> str:
        specs = [s.to_text() for s in self.specs]
        return f"FaultSchedule({specs}, seed={self.seed}, world_size={self.world_size})"

    @property
    def sites(self) -> frozenset[str]:
        """The sites of the specs that can fire."""
        return frozenset(s.site for i, s in enumerate(self.specs) if self.can_fire(i))

    # The one source of randomness: a 64-bit hash of the coordinates.
    def _hash(self, *key: Any) -> int:
        return repr_digest(("paft-faults/v1", self.seed, *key)) % 2**64  # unsigned

    def _uniform(self, *key: Any) -> float:
        return (self._hash(*key) >> 11) * 2.0**-53

    def _candidate(self, i: int, step: int) -> bool:
        s = self.specs[i]
        if step < s.start or (s.stop is not None and step >= s.stop):
            return False
        lows = self._step_lows[i]
        if lows is None:
            return True
        j = bisect.bisect_right(lows, step) - 1
        return j >= 0 and step <= s.steps[j][1]  # type: ignore[index]

    def can_fire(self, spec_index: int) -> bool:
        """Whether spec ``spec_index`` fires at any step (on some rank)."""
        return spec_index not in self._never

    def random_rank(self, spec_index: int, step: int) -> int:
        """The rank a ``ranks='random'`` event starting at ``step`` lands on."""
        return self._hash("rank", spec_index, step) % self.world_size

    def starts(self, spec_index: int, step: int, rank: int) -> bool:
        """Whether an event of spec ``spec_index`` starts at ``step`` on ``rank``."""
        s = self.specs[spec_index]
        if step < 0 or not self._candidate(spec_index, step):
            return False
        p = 1.0 if s.rate is None else s.rate
        if s.ranks == "random":
            # One draw per (spec, step), keyed by no rank: every rank computes the same.
            if p < 1.0 and self._uniform("fire", spec_index, step, -1) >= p:
                return False
            return self.random_rank(spec_index, step) == rank
        if rank not in s.ranks:
            return False
        return p >= 1.0 or self._uniform("fire", spec_index, step, rank) < p

    def burst_start(self, spec_index: int, step: int, rank: int) -> int | None:
        """The start step of the (latest) burst of spec ``spec_index`` covering
        ``step`` on ``rank``, or None if it does not fire there."""
        for lo, hi in self._start_ranges(spec_index, step):
            for s in range(hi, lo - 1, -1):
                if self.starts(spec_index, s, rank):
                    return s
        return None

    def _start_ranges(self, i: int, step: int) -> list[tuple[int, int]]:
        """The steps where a burst covering ``step`` may have started, as ranges, latest
        first: only listed steps (``steps=``), so a long burst from one listed step (a
        fault stuck on for the rest of the run) is found without walking back step by
        step through the whole burst. Without ``steps=``, or inside a listed range, every
        step of the burst's window is a candidate: a query costs up to ``burst`` hashes
        (0.3 s at burst=100000); none for a spec that can never fire (``rate=0``)."""
        if not self.can_fire(i):
            return []
        s = self.specs[i]
        first = max(0, step - s.burst + 1, s.start)
        if first > step:
            return []
        lows = self._step_lows[i]
        if lows is None:
            return [(first, step)]
        ranges = []
        for j in range(bisect.bisect_right(lows, step) - 1, -1, -1):
            lo, hi = s.steps[j]  # type: ignore[index]
            if hi < first:
                break
            ranges.append((max(lo, first), min(hi, step)))
        return ranges

    def events(self, step: int, rank: int, site: str, attempt: int = 0) -> list[FaultEvent]:
        """The events firing at (step, rank, site), in spec order. ``attempt > 0`` is a
        recompute of ``step``: only persistent specs fire again."""
        if site not in SITES:
            raise ValueError(f"site must be one of {', '.join(SITES)}, got {site!r}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        if step < 0 or attempt < 0:
            raise ValueError(f"step and attempt must be >= 0, got {step}, {attempt}")
        out: list[FaultEvent] = []
        for i, s in enumerate(self.specs):
            if s.site != site or (attempt > 0 and not s.persistent):
                continue
            start = self.burst_start(i, step, rank)
            if start is not None:
                out.append(FaultEvent(i, s, step, rank, site, attempt, start))
        return out

    def generator(self, event: FaultEvent, target: int | str) -> torch.Generator:
        """A CPU generator for element selection, seeded from (seed, spec, step, rank,
        target, attempt). A persistent fault fires again on a recompute, but on other
        elements: faulty hardware does not reproduce the same bits the way a bad
        input does, which is what lets the guard tell the two apart."""
        g = torch.Generator()
        g.manual_seed(self._hash("gen", event.spec_index, event.step, event.rank, target,
                                 event.attempt) & (2**63 - 1))
        return g

    def bucket_for(self, event: FaultEvent, num_buckets: int) -> int:
        """The one bucket (of ``num_buckets``) the event hits at its step."""
        if num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
        return self._hash("bucket", event.spec_index, event.step, event.rank) % num_buckets

    def tensor_for(self, event: FaultEvent, names: Sequence[str], numels: Sequence[int]) -> str:
        """The one tensor the event hits, drawn with probability proportional to its
        number of elements (a random element is hit: across tensors of one width, a random bit of
        memory) among ``names``."""
        total = sum(numels)
        if total <= 0:
            raise ValueError("no elements to choose from")
        x = self._hash("tensor", event.spec_index, event.step, event.rank) % total
        for name, n in zip(names, numels):
            if x < n:
                return name
            x -= n
        raise AssertionError("unreachable")  # pragma: no cover


# --------------------------------------------------------------------------- injector


@dataclass
class FaultRecord:
    """One injected fault, as a line of ``faults.jsonl``."""

    step: int
    rank: int
    site: str
    target: int | str
    """Bucket index (bucket sites) or tensor name (params / optimizer-state)."""
    kind: str
    bit: int | None
    """Bitflip: the bit flipped when the spec names one bit or one element was hit;
    otherwise None (see ``bits``)."""
    num_elements: int
    indices: list[int]
    before: list[float]
    after: list[float]
    attempt: int
    spec_index: int = 0
    spec: str = ""
    bits: list[int] | None = None
    """Bitflip: the bit flipped at each of ``indices``."""
    burst_start: int = 0

    def to_json(self) -> dict[str, Any]:
        """A dict that ``json.dumps(..., allow_nan=False)`` accepts."""
        return jsonable(dataclasses.asdict(self))


class FaultInjector:
    """Applies a :class:`FaultSchedule` on one rank.

    Without specs it is disabled and every call returns ``[]`` at once without reading
    the tensor. ``stale`` needs the previous value of each target: the injector keeps
    two pre-injection copies per (site, target), the previous step's and this step's
    (a recompute of this step replays the previous one again), only for sites where a
    ``stale`` spec can hit this rank (:func:`~paft.faultspec.stale_sites`), so other configurations pay
    nothing; at rest, that is twice the parameters or optimizer state. A checkpoint
    keeps the latest of them (:meth:`state_dict`), so that a resumed run's first step
    replays what the uninterrupted run's does.
    """

    def __init__(self, schedule: FaultSchedule, rank: int) -> None:
        if not 0 <= rank < schedule.world_size:
            raise ValueError(f"rank must be in [0, {schedule.world_size}), got {rank}")
        self.schedule = schedule
        self.rank = rank
        # Only specs that can fire: one that never does (rate=0) cost every step a walk
        # of the state at rest and, for stale, a copy of every target kept for nothing.
        self._sites = schedule.sites
        self._stale_sites = stale_sites(schedule.specs, rank)
        # (site, target) -> [(step, value)], at most one entry with step < current.
        self._memory: dict[tuple[str, int | str], list[tuple[int, Tensor]]] = {}
        # Per site, the last (step, attempt) asked and its events, as ONE value: the comm
        # hook asks for local-grad events on the autograd thread and for aggregation events
        # on gloo's callback thread, and a key and a list written apart could pair one
        # attempt's key with another's events between the two writes. One entry per site,
        # so that the two sites' alternating calls do not evict each other's.
        self._cache: dict[str, tuple[tuple[int, int], list[FaultEvent]]] = {}

    @property
    def enabled(self) -> bool:
        """False when there are no specs: callers may skip the injector entirely."""
        return bool(self.schedule.specs)

    def has_site(self, site: str) -> bool:
        """Whether any spec that can fire targets ``site`` (on any rank: same answer everywhere)."""
        return site in self._sites

    def _events(self, site: str, step: int, attempt: int) -> list[FaultEvent]:
        # Called once per bucket: compute a step's events once.
        cached = self._cache.get(site)
        if cached is not None and cached[0] == (step, attempt):
            return cached[1]
        events = self.schedule.events(step, self.rank, site, attempt)
        self._cache[site] = ((step, attempt), events)
        return events

    def _remember(self, site: str, target: int | str, step: int, tensor: Tensor) -> Tensor | None:
        """Store ``tensor``'s (pre-injection) value for ``step``; return the value of
        the most recent earlier step. A recompute of ``step`` replaces its entry and
        still sees the earlier step. Going back further (a rollback) drops the
        "future" entries; the step before the rollback target is then unknown, and a
        ``stale`` fault there does nothing."""
        entries = [e for e in self._memory.get((site, target), []) if e[0] < step][-1:]
        previous = entries[0][1] if entries else None
        self._memory[(site, target)] = entries + [(step, tensor.detach().clone())]
        return previous

    def state_dict(self) -> list[dict[str, Any]]:
        """The kept copies a resumed run's ``stale`` faults replay: per (site, target), the
        latest step's pre-injection value, as ``{"site", "target", "step", "value"}``
        entries; empty where no ``stale`` spec can hit this rank. Between steps every
        kept step is a past one, and the latest is the one the next step replays."""
        return [{"site": site, "target": target, "step": entries[-1][0], "value": entries[-1][1]}
                for (site, target), entries in self._memory.items() if entries]

    def load_state_dict(self, state: Sequence[Mapping[str, Any]]) -> None:
        """Replace the kept copies with :meth:`state_dict` output (a checkpoint's; an
        empty one where it held none). Entries of a site where no ``stale`` spec of this
        injector can hit this rank are dropped: a resume that removed the spec keeps no
        copies for nothing. Checked before anything changes (``ValueError``)."""
        memory: dict[tuple[str, int | str], list[tuple[int, Tensor]]] = {}
        for entry in state:
            site, target, step, value = (entry.get(k) for k in ("site", "target", "step", "value"))
            if (site not in SITES or isinstance(target, bool) or not isinstance(target, (int, str))
                    or isinstance(step, bool) or not isinstance(step, int) or step < 0
                    or not isinstance(value, Tensor)):
                raise ValueError(f"FaultInjector.load_state_dict(): not a kept value: site {site!r}, target "
                                 f"{target!r}, step {step!r}, value of type {type(value).__name__}")
            if site in self._stale_sites:
                memory[(site, target)] = [(step, value)]
        self._memory = memory

    def _record(self, ev: FaultEvent, target: int | str, applied: Applied) -> FaultRecord:
        bits = applied.bits
        bit = bits[0] if bits and ev.spec.kind == "bitflip" and (
            is_int(ev.spec.bits) or applied.num_elements == 1) else None
        return FaultRecord(
            step=ev.step, rank=ev.rank, site=ev.site, target=target, kind=ev.spec.kind,
            bit=bit, num_elements=applied.num_elements, indices=applied.indices,
            before=applied.before, after=applied.after, attempt=ev.attempt,
            spec_index=ev.spec_index, spec=ev.spec.to_text(), bits=bits,
            burst_start=ev.burst_start,
        )

    def inject_bucket(
        self, site: str, step: int, bucket_index: int, num_buckets: int, tensor: Tensor,
        attempt: int = 0,
    ) -> list[FaultRecord]:
        """Corrupt a gradient bucket in place if an event hits it; return the records.

        Each firing event hits exactly one bucket per step, ``schedule.bucket_for``,
        so ``num_buckets`` must be the same in every call of a step (and on every
        rank, for reproducibility); other buckets are left untouched.
        """
        if not self.enabled or site not in self._sites:
            return []
        if site not in BUCKET_SITES:
            raise ValueError(f"inject_bucket site must be one of {BUCKET_SITES}, got {site!r}")
        if not 0 <= bucket_index < num_buckets:
            raise ValueError(f"bucket_index {bucket_index} not in [0, {num_buckets})")
        previous = None
        if site in self._stale_sites:
            previous = self._remember(site, bucket_index, step, tensor)
        records = []
        for ev in self._events(site, step, attempt):
            if self.schedule.bucket_for(ev, num_buckets) != bucket_index:
                continue
            applied = apply_fault(ev.spec, tensor, self.schedule.generator(ev, bucket_index),
                                  previous)
            if applied is not None:
                records.append(self._record(ev, bucket_index, applied))
        return records

    def inject_tensors(
        self, site: str, step: int, named: Mapping[str, Tensor], attempt: int = 0,
    ) -> list[FaultRecord]:
        """Corrupt tensors at rest (params / optimizer-state) in place; return records.

        Each event picks ONE tensor among the floating-point, non-empty ``named``
        tensors (taken in sorted name order) whose dtype its spec can corrupt (``bits=40``
        skips Adam's float32 ``step`` beside float64 weights), with probability
        proportional to its number of elements; non-float entries (e.g. integer step
        counters) are skipped.
        """
        if not self.enabled or site not in self._sites:
            return []
        if site not in TENSOR_SITES:
            raise ValueError(f"inject_tensors site must be one of {TENSOR_SITES}, got {site!r}")
        names = sorted(n for n, t in named.items() if t.is_floating_point() and t.numel() > 0)
        previous: dict[str, Tensor | None] = {}
        if site in self._stale_sites:
            previous = {n: self._remember(site, n, step, named[n]) for n in names}
        events = self.schedule.events(step, self.rank, site, attempt)
        if not events or not names:
            return []
        numels = [named[n].numel() for n in names]
        records = []
        for ev in events:
            fits = [i for i, n in enumerate(names) if ev.spec.takes(named[n].dtype)]
            if not fits:
                continue
            name = self.schedule.tensor_for(ev, [names[i] for i in fits], [numels[i] for i in fits])
            applied = apply_fault(ev.spec, named[name], self.schedule.generator(ev, name),
                                  previous.get(name))
            if applied is not None:
                records.append(self._record(ev, name, applied))
        return records
