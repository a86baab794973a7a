"""How far apart replicas are, and which of them hold NaN/Inf of their own.

:func:`measure_divergence` is the on-demand measurement (each rank's relative L2
distance to the mean replica, per tensor if asked); the finiteness judgement
(:func:`nonfinite_patterns`, :func:`sound_replicas`) is shared with
:class:`paft.sync.ReplicaSync`, which must not spread a replica's NaN/Inf, nor take a
NaN/Inf that every replica holds alike (an attention mask's ``-inf``) for corruption.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from paft.collectives import collective_device, gather_rows
from paft.fingerprint import digest, repr_digest
from paft.flat import consecutive_runs, pack, structure_key, transport_view
from paft.state import state_tensors

__all__ = [
    "DivergenceReport",
    "measure_divergence",
    "farthest",
    "all_finite",
    "nonfinite_patterns",
    "sound_replicas",
    "rel_distance",
]


@dataclass
class DivergenceReport:
    """Relative L2 distance of each rank's state to the mean replica (per tensor, of
    the replicas without NaN/Inf of their own); a replica with NaN/Inf of its own
    reports ``inf``. Identical on every rank."""

    max: float
    """Max over ranks of ``||p_r - mean(p)|| / ||mean(p)||`` over the parameters."""
    per_rank: list[float]
    finite: list[bool]
    """Whether each rank's measured state holds no NaN/Inf beyond what every replica
    holds alike (it then counts in the mean of every tensor)."""
    state_max: float
    """The same over every floating tensor measured: parameters, floating buffers and,
    when an optimizer was given, its floating state."""
    state_per_rank: list[float]
    per_tensor: list[tuple[str, float, list[int]]] | None = None
    """With ``per_tensor=True``: ``(name, max over ranks, the ranks at that max)`` for
    every floating tensor, worst first; the ranks as :func:`farthest` names them (every
    rank when all are non-finite)."""


def farthest(distances: list[float]) -> list[int]:
    """The ranks at the largest of ``distances``, all those within a relative 1e-9 of
    it: two replicas are equally far from their mean, but their distances computed in
    float64 may differ in the last bit, and naming the first of them named rank 0 for a
    fault on rank 1."""
    far = max(distances)
    return [r for r, d in enumerate(distances) if d >= far * (1 - 1e-9)]


def rel_distance(sq: float, ref_sq: float) -> float:
    """``sqrt(sq / ref_sq)``, a squared distance against the squared norm it is relative
    to: inf where either is not finite, or where only the reference is 0 (a zero mean
    has no scale to compare a distance with); 0 where both are."""
    if not (math.isfinite(sq) and math.isfinite(ref_sq)):
        return math.inf
    if ref_sq == 0.0:
        return 0.0 if sq == 0.0 else math.inf
    return math.sqrt(sq / ref_sq)


def all_finite(tensors: list[Tensor]) -> bool:
    """Whether no floating tensor holds NaN/Inf: min and max of each (one pass, no
    temporaries), one host sync per device. The extremes are compared in float64,
    which holds every float dtype's range (in float32 a finite 1e300 read as inf)."""
    by_dev: dict[torch.device, list[Tensor]] = {}
    for t in tensors:
        if t.is_floating_point() and t.numel():
            by_dev.setdefault(t.device, []).append(t)
    ok = True
    for ts in by_dev.values():
        ext = torch.stack([v.double() for t in ts for v in torch.aminmax(t)])
        ok = ok and bool(torch.isfinite(ext).all())
    return ok


def nonfinite_patterns(tensors: list[Tensor]) -> list[int]:
    """Per tensor, ``count, pattern``: how many NaN/Inf entries it holds and a digest
    of where it holds which (NaN, +inf, -inf); ``0, 0`` for one without. Only the
    :func:`all_finite` pass when no tensor has any, as usual."""
    if all_finite(tensors):
        return [0, 0] * len(tensors)
    out = []
    for t in tensors:
        bad = ~torch.isfinite(t)
        count = int(bad.sum())
        kind = torch.where(torch.isnan(t), 2.0, torch.sign(t.float())) if count else None
        out += [count, digest(torch.where(bad, kind, 0.0).to(torch.int8)) if kind is not None else 0]
    return out


def sound_replicas(rows: list[list[int]], lenient: list[bool]) -> list[list[bool]]:
    """Per rank and tensor: whether the rank's copy holds no NaN/Inf beyond what the
    replicas share. ``rows[rank]`` is :func:`nonfinite_patterns` of the rank's
    tensors. Only where ``lenient`` (the buffers: a causal mask's ``-inf`` every
    replica holds is state, not corruption) may a sound copy hold any: there the
    shared pattern (count and places) is a strict majority's, or without one that of
    the ranks holding the fewest NaN/Inf when they all hold them at the same places.
    So one rank's extra NaN, each rank's own NaN, or a ``-inf`` one rank of three lost
    is corruption. Parameters and optimizer state have no legitimate NaN/Inf: any,
    even on every rank alike, is."""
    ws = len(rows)
    sound = [[False] * len(lenient) for _ in rows]
    for j, free in enumerate(lenient):
        keys = [(row[2 * j], row[2 * j + 1]) for row in rows]
        shared: tuple[int, int] | None = (0, 0)
        if free:
            top, votes = Counter(keys).most_common(1)[0]
            fewest = {k for k in keys if k[0] == min(c for c, _ in keys)}
            shared = top if 2 * votes > ws else (fewest.pop() if len(fewest) == 1 else None)
        for r, key in enumerate(keys):
            sound[r][j] = key == shared
    return sound


def measure_divergence(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    per_tensor: bool = False,
    group: dist.ProcessGroup | None = None,
    buffers: bool = True,
    bucket_mb: float = 32.0,
) -> DivergenceReport:
    """Collective: relative L2 distance of each rank's parameters (and, in
    ``state_*``, every floating tensor: buffers and, if ``optimizer`` is given, its
    state) to the mean replica, computed in float64. The parameters' mean is over the
    ranks whose parameters hold no NaN/Inf of their own (see :func:`sound_replicas`),
    the rest's over the ranks none of whose tensors do; a coordinate non-finite on them
    all (a mask's ``-inf``) counts as agreement; a rank with NaN/Inf of its own reports
    ``inf``. Bitwise identical float64 copies are at distance 0 (their rounded mean
    is not exactly theirs). ``buffers=False`` leaves the buffers out
    (under DDP, BatchNorm's differ between ranks by design). Ranks whose states differ
    in structure (names, dtypes, shapes) raise ``RuntimeError`` on every rank.

    Moves a float64 copy of the measured state, scaled by a power of two (float64
    extremes neither overflow nor underflow), through all-reduces of at most
    ``bucket_mb`` each, and holds about three such buckets at a time beside the state,
    plus a few numbers per tensor (``per_tensor``) or two per rank."""
    entries = [(n, transport_view(t)) for n, t in state_tensors(model, optimizer, buffers=buffers)]
    entries = [(n, t) for n, t in entries if t.is_floating_point()]
    device = collective_device(group, entries[0][1] if entries else None)
    _require_same_structure(entries, device, group)
    ballot = _ballot(entries, device, group)
    scale = _common_scale(entries, ballot, device, group)
    sq, msq = _squared_distances(entries, ballot, scale, bucket_mb, device, group)
    return _report(entries, sq, msq, ballot.finite, per_tensor, device, group)


@dataclass(frozen=True)
class _Ballot:
    """Whose copy of each measured tensor counts in its mean, the same on every rank."""

    votes: list[list[bool]]
    """``[rank][tensor]``: the rank's copy counts. A rank with NaN/Inf of its own is
    left out: of the parameters where its parameters hold it, of everything where any
    of its tensors does."""
    finite: list[bool]
    """Per rank: none of its tensors holds NaN/Inf of its own."""
    same_bits: list[bool]
    """Per tensor: float64, and every voter holds it bitwise alike."""
    nonfinite_here: list[bool]
    """Per tensor: this rank's copy holds NaN/Inf (a mask's ``-inf`` too)."""
    rank: int
    """This rank in the group."""

    @property
    def mine(self) -> list[bool]:
        return self.votes[self.rank]

    def voters(self, j: int) -> int:
        return sum(row[j] for row in self.votes)


def _require_same_structure(entries: list[tuple[str, Tensor]], device: torch.device,
                            group: dist.ProcessGroup | None) -> None:
    """The structure first (a fixed size everywhere), so that the exchanges after it
    line up; raises ``RuntimeError`` on every rank where it differs."""
    structure = repr_digest(structure_key(entries))
    structures = gather_rows(torch.tensor([structure], dtype=torch.int64, device=device), group)
    if len(set(structures.reshape(-1).tolist())) > 1:
        raise RuntimeError("measure_divergence: the ranks' states differ in structure (tensor names, dtypes or "
                           "shapes), e.g. optimizer state created on some ranks only; they cannot be compared")


def _ballot(entries: list[tuple[str, Tensor]], device: torch.device, group: dist.ProcessGroup | None) -> _Ballot:
    """One gather of every rank's NaN/Inf patterns, and of its float64 tensors' digests:
    their mean over 3 identical copies, (x+x+x)/3, rounds away from x, so identical
    copies are told by their bits, not their distance. A leading 0 keeps the exchange
    non-empty for a model without floating state."""
    n = len(entries)
    wide = [t.dtype == torch.float64 for _, t in entries]
    digests = [digest(t) if w else 0 for (_, t), w in zip(entries, wide)]
    mine = torch.tensor([0, *nonfinite_patterns([t for _, t in entries]), *digests], dtype=torch.int64,
                        device=device)
    gathered = gather_rows(mine, group).tolist()
    patterns = [row[1 : 1 + 2 * n] for row in gathered]
    is_param = [name.startswith("param/") for name, _ in entries]
    sound = sound_replicas(patterns, [name.startswith("buffer/") for name, _ in entries])
    sound_params = [all(ok for ok, p in zip(row, is_param) if p) for row in sound]
    finite = [all(row) for row in sound]
    votes = [[params_ok if p else all_ok for p in is_param] for params_ok, all_ok in zip(sound_params, finite)]
    # Float64 tensors that every voter holds bitwise alike (a NaN rank, left out, aside).
    same_bits = [w and len({row[1 + 2 * n + j] for row, vote in zip(gathered, votes) if vote[j]}) == 1
                 for j, w in enumerate(wide)]
    me = dist.get_rank(group)
    return _Ballot(votes, finite, same_bits, [patterns[me][2 * j] > 0 for j in range(n)], me)


def _common_scale(entries: list[tuple[str, Tensor]], ballot: _Ballot, device: torch.device,
                  group: dist.ProcessGroup | None) -> float:
    """One power-of-two scale for every copy (exact: the ratios are the same bits): a
    float64 replica of 1e200 (a flipped exponent bit) squared to inf and made every
    rank's distance inf, replicas of 1e-200 squared to 0 and read as identical."""
    top = _finite_absmax([(t, bad) for (_, t), vote, bad in zip(entries, ballot.mine, ballot.nonfinite_here)
                          if vote], device)
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    return math.ldexp(1.0, -max(math.frexp(float(top))[1], -1021))  # 2**1021 at most: no overflow


def _squared_distances(entries: list[tuple[str, Tensor]], ballot: _Ballot, scale: float, bucket_mb: float,
                       device: torch.device, group: dist.ProcessGroup | None) -> tuple[list[float], list[float]]:
    """Per tensor, this rank's squared distance to the mean replica (inf where its copy
    does not count) and the mean's squared norm, both of the copies times ``scale``:
    bucket by bucket, each one float64 all-reduce of at most ``bucket_mb``."""
    sq: list[float] = []
    msq: list[float] = []
    for first, end in consecutive_runs([t.numel() for _, t in entries], max(1, int(bucket_mb * 2**20) // 8)):
        bucket = range(first, end)
        spans, at = [], 0
        for j in bucket:
            spans.append((at, at + entries[j][1].numel()))
            at += entries[j][1].numel()
        # pack widens into the float64 buffer as it copies: no float64 copy of each tensor.
        local = pack(torch.empty(at, dtype=torch.float64, device=device), [entries[j][1] for j in bucket])
        local.mul_(scale)
        mean = local.clone()
        for j, (a, b) in zip(bucket, spans):
            if not ballot.mine[j]:
                mean[a:b] = 0.0
        dist.all_reduce(mean, group=group)
        for j, (a, b) in zip(bucket, spans):
            mean[a:b] /= max(ballot.voters(j), 1)
        apart = ~torch.isfinite(mean)  # there every sound copy is non-finite alike: agreement
        local.sub_(mean).masked_fill_(apart, 0.0)  # the distance to the mean
        for j, (a, b) in zip(bucket, spans):
            if ballot.same_bits[j]:  # bitwise identical on every rank: no distance, whatever the rounding
                local[a:b] = 0.0
        mean.masked_fill_(apart, 0.0)
        sums = torch.stack([x[a:b].square().sum() for x in (local, mean) for a, b in spans]).tolist()
        sq += [v if ballot.mine[j] else math.inf for j, v in zip(bucket, sums[: len(bucket)])]
        msq += sums[len(bucket) :]
    return sq, msq


def _report(entries: list[tuple[str, Tensor]], sq: list[float], msq: list[float], finite: list[bool],
            per_tensor: bool, device: torch.device, group: dist.ProcessGroup | None) -> DivergenceReport:
    """Every rank's distances, gathered: two sums per rank (the parameters', the whole
    state's), and its per-tensor ones if asked."""
    is_param = [name.startswith("param/") for name, _ in entries]
    summary = [sum(x for x, p in zip(sq, is_param) if p), sum(sq)]
    gathered = gather_rows(torch.tensor(summary + sq if per_tensor else summary, dtype=torch.float64,
                                        device=device), group).tolist()
    breakdown = None
    if per_tensor:
        breakdown = []
        for j, (name, _) in enumerate(entries):
            rels = [rel_distance(row[2 + j], msq[j]) for row in gathered]
            breakdown.append((name, max(rels), farthest(rels)))
        breakdown.sort(key=lambda x: -x[1])
    param_msq = sum(m for m, p in zip(msq, is_param) if p)
    per_rank = [rel_distance(row[0], param_msq) for row in gathered]
    state_per_rank = [rel_distance(row[1], sum(msq)) for row in gathered]
    return DivergenceReport(
        max=max(per_rank),
        per_rank=per_rank,
        finite=finite,
        state_max=max(state_per_rank),
        state_per_rank=state_per_rank,
        per_tensor=breakdown,
    )


def _finite_absmax(tensors: list[tuple[Tensor, bool]], device: torch.device) -> Tensor:
    """The largest finite magnitude of the ``(tensor, holds NaN/Inf)`` given, as a float64
    ``[1]`` tensor on ``device`` (0 without one), with no host sync: each tensor's
    extremes (one pass, no temporaries); for one with NaN/Inf (a mask's ``-inf``),
    those of a copy with its NaN/Inf as 0."""
    out = torch.zeros(1, dtype=torch.float64, device=device)
    for t, nonfinite in tensors:
        if nonfinite:
            t = torch.where(torch.isfinite(t), t, 0.0)
        if t.numel():
            lo, hi = torch.aminmax(t)
            out = torch.maximum(out, torch.maximum(-lo.double(), hi.double()).to(device))
    return out
