"""Tests for paft.faults and paft.faultspec: kinds on real tensors, the spec grammar, the schedule, the injector.

Everything here is pure (no process group): the whole file runs in seconds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paft.faults import (
    RECORD_VALUES,
    FaultInjector,
    FaultRecord,
    FaultSchedule,
    apply_fault,
    select_indices,
)
from paft.faultspec import (
    BIT_CLASSES,
    KINDS,
    SITES,
    FaultSpec,
    FaultSpecError,
    bit_range,
    parse_specs,
)

DTYPES = {torch.float32: (torch.int32, 32), torch.bfloat16: (torch.int16, 16),
          torch.float16: (torch.int16, 16), torch.float64: (torch.int64, 64)}
CLASS_RANGES = {
    torch.float32: {"sign": (31, 31), "exponent": (23, 30), "mantissa": (0, 22), "any": (0, 31)},
    torch.bfloat16: {"sign": (15, 15), "exponent": (7, 14), "mantissa": (0, 6), "any": (0, 15)},
    torch.float16: {"sign": (15, 15), "exponent": (10, 14), "mantissa": (0, 9), "any": (0, 15)},
    torch.float64: {"sign": (63, 63), "exponent": (52, 62), "mantissa": (0, 51), "any": (0, 63)},
}


def gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def flipped_bits(before: torch.Tensor, after: torch.Tensor) -> dict[int, int]:
    """{flat index: xor of the integer views} for every element whose bits differ."""
    int_dtype, width = DTYPES[before.dtype]
    x = before.reshape(-1).view(int_dtype).long() ^ after.reshape(-1).view(int_dtype).long()
    # Undo sign extension of the int view in Python: 1 << 64 overflows an int64 tensor.
    return {i: int(x[i]) & ((1 << width) - 1) for i in x.nonzero().flatten().tolist()}


def sample(dtype: torch.dtype, n: int = 64, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=gen(seed)).to(dtype)


# --------------------------------------------------------------------------- bitflip


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_bitflip_every_class_and_bit_flips_exactly_that_bit_of_exactly_those_elements(dtype):
    width = DTYPES[dtype][1]
    choices: list[int | str] = list(BIT_CLASSES) + list(range(width))
    for seed, bits in enumerate(choices):
        t = sample(dtype, seed=seed)
        before = t.clone()
        spec = FaultSpec("bitflip", steps=0, bits=bits, count=5)
        applied = apply_fault(spec, t, gen(seed))
        assert applied is not None and applied.num_elements == 5
        assert len(set(applied.indices)) == 5
        lo, hi = CLASS_RANGES[dtype][bits] if isinstance(bits, str) else (bits, bits)
        xor = flipped_bits(before, t)
        # Exactly the chosen elements changed, each by exactly its chosen bit.
        assert sorted(xor) == applied.indices
        for i, b in zip(applied.indices, applied.bits):
            assert lo <= b <= hi
            assert xor[i] == 1 << b


@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("cls", ["sign", "exponent", "mantissa"])
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**63 - 1))
def test_bitflip_class_touches_only_its_bits(dtype, cls, seed):
    t = sample(dtype, n=256, seed=seed % 1000)
    before = t.clone()
    apply_fault(FaultSpec("bitflip", steps=0, bits=cls, fraction=0.25), t, gen(seed))
    lo, hi = CLASS_RANGES[dtype][cls]
    class_mask = sum(1 << b for b in range(lo, hi + 1))
    xor = flipped_bits(before, t)
    assert len(xor) == 64
    for v in xor.values():
        assert v & ~class_mask == 0 and bin(v).count("1") == 1


def test_bit_ranges_match_the_formats():
    # Every class of every dtype, against the IEEE 754 / bfloat16 layouts written out above.
    assert {d: {c: bit_range(d, c) for c in BIT_CLASSES} for d in CLASS_RANGES} == CLASS_RANGES
    assert bit_range(torch.float16, 15) == (15, 15)
    with pytest.raises(ValueError, match="bit 16"):
        bit_range(torch.float16, 16)
    # A sign flip is exactly negation; an exponent-LSB flip of 1.0 halves it.
    for dtype in DTYPES:
        t = torch.tensor([1.5], dtype=dtype)
        apply_fault(FaultSpec("bitflip", steps=0, bits=bit_range(dtype, "sign")[0]), t, gen(0))
        assert torch.equal(t, torch.tensor([-1.5], dtype=dtype))
        t = torch.tensor([1.0], dtype=dtype)
        apply_fault(FaultSpec("bitflip", steps=0, bits=bit_range(dtype, "exponent")[0]), t,
                    gen(0))
        assert torch.equal(t, torch.tensor([0.5], dtype=dtype))


def test_bitflip_float64_sign_and_noncontiguous_tensor():
    t = torch.tensor([2.0], dtype=torch.float64)
    apply_fault(FaultSpec("bitflip", steps=0, bits=63), t, gen(0))
    assert t.item() == -2.0
    base = torch.randn(6, 5, generator=gen(1))
    view = base.t()  # non-contiguous: corrupted through a copy, written back
    before = base.clone()
    applied = apply_fault(FaultSpec("bitflip", steps=0, count=3, bits="sign"), view, gen(2))
    changed = (base != before).nonzero().tolist()
    assert len(changed) == 3
    flat_view_idx = sorted(c * 6 + r for r, c in changed)  # index into view.reshape(-1)
    assert flat_view_idx == applied.indices
    assert torch.equal(base.abs(), before.abs())


def test_bitflip_bit_out_of_range_for_dtype_names_bits():
    spec = FaultSpec("bitflip", steps=0, bits=20)
    spec.check_dtype(torch.float32)
    with pytest.raises(FaultSpecError, match="'bits'") as e:
        spec.check_dtype(torch.bfloat16)
    assert e.value.field == "bits"
    with pytest.raises(FaultSpecError):
        apply_fault(spec, torch.zeros(4, dtype=torch.float16), gen(0))


def test_bitflip_on_leaf_parameter_works_in_place():
    p = torch.nn.Parameter(torch.ones(8))
    apply_fault(FaultSpec("bitflip", steps=0, bits="sign"), p, gen(0))
    assert (p.detach() == -1).sum().item() == 1


# --------------------------------------------------------------------------- selection


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 20000), count=st.integers(1, 3000), seed=st.integers(0, 2**32))
def test_count_selects_distinct_sorted_indices(n, count, seed):
    idx = select_indices(n, gen(seed), count=count)
    assert idx.numel() == min(n, count)
    assert idx.unique().numel() == idx.numel()
    assert torch.equal(idx, idx.sort().values)
    assert 0 <= int(idx.min()) and int(idx.max()) < n


@pytest.mark.parametrize("n,fraction,k", [(100, 0.1, 10), (10, 0.05, 1), (7, 1.0, 7),
                                          (1000, 0.0125, 13), (5, 0.5, 3), (20000, 0.5, 10000),
                                          (1000, 0.0001, 1)])  # rounds to 0: still one
def test_fraction_selects_rounded_count(n, fraction, k):
    idx = select_indices(n, gen(3), fraction=fraction)
    assert idx.numel() == k and idx.unique().numel() == k


def test_selection_is_uniform():
    # Each of 20 slots picked count=5 times over 2000 draws: expected 500 each.
    hits = torch.zeros(20)
    for s in range(2000):
        hits[select_indices(20, gen(s), count=5)] += 1
    n, p = 2000, 5 / 20
    assert (hits - n * p).abs().max() <= 5 * math.sqrt(n * p * (1 - p))


# --------------------------------------------------------------------------- other kinds


def _apply(kind: str, t: torch.Tensor, seed: int = 0, **kw):
    before = t.clone()
    spec = FaultSpec(kind, steps=0, **kw)
    applied = apply_fault(spec, t, gen(seed))
    # Selection is the generator's first draw, so it can be replayed in full
    # (the Applied record keeps only the first few indices).
    idx = select_indices(t.numel(), gen(seed), count=spec.count, fraction=spec.fraction)
    assert idx[: len(applied.indices)].tolist() == applied.indices
    untouched = torch.ones(t.numel(), dtype=torch.bool)
    untouched[idx] = False
    assert torch.equal(t[untouched], before[untouched])
    return before, applied, idx


def test_scale_zero_nan_inf():
    t = sample(torch.float32, 100)
    before, a, idx = _apply("scale", t, count=4, factor=-8.0)
    assert a.num_elements == 4 and torch.equal(t[idx], before[idx] * -8.0)
    t = sample(torch.bfloat16, 100)
    before, a, idx = _apply("zero", t, fraction=0.3)
    assert a.num_elements == 30 and (t[idx] == 0).all() and (t != 0).sum() == 70
    t = sample(torch.float16, 100)
    _, a, idx = _apply("nan", t, count=3)
    assert torch.isnan(t).sum() == 3 and torch.isnan(t[idx]).all()
    t = sample(torch.float32, 100)
    _, a, idx = _apply("inf", t, count=2)
    assert torch.isposinf(t[idx]).all() and torch.isinf(t).sum() == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("factor", [1e39, -1e300, 1e-46])
def test_scale_by_a_factor_beyond_float32s_range_is_the_product_rounded_once(dtype: torch.dtype,
                                                                             factor: float) -> None:
    """A zero stays zero (not NaN, as 0 * inf made it), and a product the dtype holds is
    kept (a factor rounded to float32 first became inf, or 0)."""
    t = torch.tensor([0.0, -0.0, 1e-20, -3e-30, 1e30, 1.0]).to(dtype)
    expected = (t.double() * factor).to(dtype)
    apply_fault(FaultSpec("scale", steps=0, fraction=1.0, factor=factor), t, gen(0))
    assert torch.equal(int_bits(t), int_bits(expected))
    assert not t.isnan().any()


def test_random_within_range():
    t = sample(torch.float32, 1000) * 3
    r = t.abs().max().item()
    before, a, idx = _apply("random", t, fraction=0.5)
    vals = t[idx]
    assert (vals.abs() <= r).all() and not torch.equal(vals, before[idx])
    assert vals.min() < -r / 2 and vals.max() > r / 2  # spread over the range
    t = sample(torch.bfloat16, 1000)
    _, a, idx = _apply("random", t, fraction=0.5, value=0.25)
    assert (t[idx].abs() <= 0.25).all()


def test_noise_is_relative():
    t = torch.linspace(-100, 100, 20001, dtype=torch.float64)  # includes 0.0
    before, a, idx = _apply("noise", t, fraction=1.0, sigma=0.1)
    rel = (t - before) / before.abs()
    nz = before != 0
    assert torch.equal(t[~nz], before[~nz])  # zero stays zero
    assert abs(rel[nz].mean().item()) < 0.01 and abs(rel[nz].std().item() - 0.1) < 0.005


@pytest.mark.parametrize("dtype,sigma", [(torch.float32, 1e39), (torch.bfloat16, 1e39), (torch.float16, 1e39),
                                         (torch.float32, 2e38), (torch.float64, 1.7e308)], ids=str)
def test_noise_past_the_dtypes_range_keeps_zeros_and_is_inf_only_past_it(dtype: torch.dtype, sigma: float) -> None:
    """``z * sigma`` computed in float32 was inf once past its range (a sigma of 1e39, or
    2e38 drawn a z of 2), and in float64 for float64 tensors past its own: a zero became
    NaN (inf * 0) and a tiny value inf, where x + z * sigma * |x| is far inside the range."""
    tiny = {torch.float16: 2.0 ** -24, torch.float64: 1e-300}.get(dtype, 1e-30)
    t = torch.tensor([0.0, -0.0, tiny, -tiny, 2.0] * 40, dtype=dtype)
    before, _, idx = _apply("noise", t, fraction=1.0, sigma=sigma)
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    z = torch.randn(len(idx), generator=_after_selection(t.numel()), dtype=cdt).double()
    assert z.abs().max() * sigma > torch.finfo(cdt).max  # the draws overflow z * sigma in the plain sum
    for i, zi in zip(idx.tolist(), z.tolist()):
        x = float(before[i])
        exact = Fraction(x) + Fraction(zi) * Fraction(sigma) * abs(Fraction(x))
        try:
            nearest = float(exact)
        except OverflowError:  # past float64's range: past the dtype's
            nearest = math.inf if exact > 0 else -math.inf
        want = torch.tensor(nearest, dtype=torch.float64).to(dtype).item()
        assert t[i].item() == pytest.approx(want, rel=2 * torch.finfo(dtype).eps), (i, x, zi)
    assert torch.equal(t[before == 0], before[before == 0])  # no NaN: a zero stays zero
    assert not torch.isnan(t).any()


def _after_selection(n: int, seed: int = 0) -> torch.Generator:
    """:func:`gen` with :func:`_apply`'s selection of all ``n`` elements drawn: the noise's draws come next."""
    g = gen(seed)
    select_indices(n, g, fraction=1.0)
    return g


def int_bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s integer view: equal only when bit-identical (NaN payloads, -0.0 vs 0.0)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("kw", [{"kind": "noise", "sigma": 0.3}, {"kind": "random"},
                                {"kind": "random", "value": 0.25}, {"kind": "scale", "factor": 1.37},
                                {"kind": "zero"}, {"kind": "bitflip"}],
                         ids=lambda kw: ",".join(f"{v}" for v in kw.values()))
def test_values_are_the_documented_function_of_the_generators_draws(dtype: torch.dtype, kw: dict) -> None:
    """Bit for bit as ``apply_fault`` documents: the selection first, then N(0, 1) noise
    in float32 (float64 for float64) scaled by ``|x|``, or the factor applied in float64,
    or ``U[-r, r)`` with ``r`` the
    largest finite magnitude in the whole tensor (not only the hit elements), or one
    bit per element drawn uniformly from the class (``any``: all of them)."""
    n, count = 100, 10
    g = gen(5)
    idx = select_indices(n, g, count=count)  # replays the selection, then the value draws
    t = sample(dtype, n)
    spare = [i for i in range(n) if i not in idx.tolist()]
    t[spare[0]], t[spare[1]] = 50.0, float("inf")  # the range comes from an element not hit
    expected = t.clone()
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    x = t[idx].to(cdt)
    if kw["kind"] == "noise":
        z = torch.randn(count, generator=g, dtype=cdt)
        expected[idx] = (x + z * kw["sigma"] * x.abs()).to(dtype)
    elif kw["kind"] == "random":
        r = kw.get("value", 50.0)
        u = torch.rand(count, generator=g, dtype=torch.float64)
        expected[idx] = (u * (2 * r) - r).to(dtype)
    elif kw["kind"] == "scale":
        expected[idx] = (t[idx].double() * kw["factor"]).to(dtype)
    elif kw["kind"] == "bitflip":
        lo, hi = CLASS_RANGES[dtype]["any"]
        width = DTYPES[dtype][1]
        for i, b in zip(idx.tolist(), torch.randint(lo, hi + 1, (count,), generator=g).tolist()):
            word = int(int_bits(expected)[i]) ^ (1 << b)  # a Python int: wrap it into the signed view
            int_bits(expected)[i] = word - (1 << width) if word >= 1 << (width - 1) else word
    else:
        expected[idx] = torch.zeros(count, dtype=dtype)  # +0.0: a cleared word, not -0.0
    apply_fault(FaultSpec(steps=0, count=count, **kw), t, gen(5))
    assert torch.equal(int_bits(t), int_bits(expected))


def test_random_without_a_finite_value_to_scale_by_writes_zeros() -> None:
    t = torch.tensor([float("nan"), float("inf"), float("-inf"), float("nan")])
    apply_fault(FaultSpec("random", steps=0, fraction=1.0), t, gen(0))
    assert torch.equal(int_bits(t), int_bits(torch.zeros(4)))


@pytest.mark.parametrize("kind", ["bitflip", "scale", "stale"])
def test_a_record_keeps_the_first_values_and_stale_names_the_elements_whose_bits_changed(kind: str) -> None:
    t = sample(torch.float32, 64)
    prev = t.clone()
    prev[::2] += 1
    # Equal as numbers but not as bits (0.0 / -0.0), and equal bits but not as numbers (NaN).
    t[0] = prev[0] = float("nan")
    t[1], prev[1] = 0.0, -0.0
    before = t.clone()
    applied = apply_fault(FaultSpec(kind, steps=0, count=None if kind == "stale" else 20), t, gen(0), prev)
    assert applied is not None
    assert len(applied.indices) == len(applied.before) == len(applied.after) == RECORD_VALUES
    if kind == "stale":
        assert applied.num_elements == 64 and applied.bits is None  # the whole tensor is replaced
        assert applied.indices == [1, 2, 4, 6, 8, 10, 12, 14]
        assert torch.equal(int_bits(t), int_bits(prev))
    else:
        assert applied.num_elements == 20
        assert (len(applied.bits) == RECORD_VALUES) if kind == "bitflip" else applied.bits is None
    for recorded, source in ((applied.before, before), (applied.after, t)):  # exactly, NaN included
        torch.testing.assert_close(torch.tensor(recorded, dtype=torch.float64), source[applied.indices].double(),
                                   rtol=0, atol=0, equal_nan=True)


def test_empty_tensor_and_stale_without_previous_do_nothing():
    assert apply_fault(FaultSpec("nan", steps=0), torch.empty(0), gen(0)) is None
    t = torch.ones(3)
    assert apply_fault(FaultSpec("stale", steps=0), t, gen(0)) is None
    assert apply_fault(FaultSpec("stale", steps=0), t, gen(0), previous=torch.ones(4)) is None
    assert apply_fault(FaultSpec("stale", steps=0), t, gen(0),
                       previous=torch.zeros(3, dtype=torch.float64)) is None
    assert torch.equal(t, torch.ones(3))


@pytest.mark.parametrize("kind", ["zero", "bitflip"])
def test_only_floating_point_tensors_are_corrupted(kind: str) -> None:
    t = torch.arange(4)
    with pytest.raises(ValueError, match="floating-point tensors, got torch.int64"):
        apply_fault(FaultSpec(kind, steps=0), t, gen(0))
    assert torch.equal(t, torch.arange(4))


def test_same_generator_same_corruption():
    a, b = sample(torch.float32), sample(torch.float32)
    spec = FaultSpec("bitflip", steps=0, count=4)
    apply_fault(spec, a, gen(7))
    apply_fault(spec, b, gen(7))
    assert torch.equal(a.view(torch.int32), b.view(torch.int32))


# --------------------------------------------------------------------------- schedule


def fired(sched: FaultSchedule, steps, rank=0, site="aggregation", attempt=0) -> list[int]:
    return [s for s in steps if sched.events(s, rank, site, attempt)]


def test_schedule_is_deterministic_and_random_access():
    specs = ["bitflip:rate=0.1,ranks=0+1", "scale:rate=0.2,burst=3", "zero:rate=0.05,site=params"]
    keys = [(s, r, site) for s in range(300) for r in range(4) for site in SITES]
    a = FaultSchedule(specs, seed=11, world_size=4)
    forward = {k: a.events(*k) for k in keys}
    b = FaultSchedule(specs, seed=11, world_size=4)
    shuffled = list(keys)
    random.Random(0).shuffle(shuffled)
    assert {k: b.events(*k) for k in shuffled} == forward
    assert any(forward.values())
    c = FaultSchedule(specs, seed=12, world_size=4)
    assert {k: c.events(*k) for k in keys} != forward
    ev = next(e for v in forward.values() for e in v)
    assert a.generator(ev, 3).initial_seed() == b.generator(ev, 3).initial_seed()
    assert a.generator(ev, 3).initial_seed() != a.generator(ev, 4).initial_seed()


def test_schedule_decisions_are_pinned_for_a_seed() -> None:
    """Ranks are separate processes (and a rerun is a new one): every decision must come
    from the coordinates alone, never from a per-process salted hash() or from call
    order, which a test in one process cannot see by comparing two schedules. Pinned
    values catch both; a deliberate change of the stream bumps "paft-faults/v1"."""
    s = FaultSchedule(["nan:rate=0.3", "zero:site=params,rate=0.5,ranks=0+2",
                       "bitflip:rate=0.2,ranks=1+2,burst=2"], seed=7, world_size=3)
    got = []
    for step in range(10):
        for rank in range(3):
            for site in ("aggregation", "params"):
                for ev in s.events(step, rank, site):
                    tgt = s.bucket_for(ev, 4) if site == "aggregation" else s.tensor_for(ev, ["a", "b"], [3, 5])
                    got.append((step, rank, ev.spec_index, ev.burst_start, tgt,
                                s.generator(ev, tgt).initial_seed() % 1000))
    assert got == [
        (1, 0, 1, 1, "b", 43), (1, 1, 2, 1, 1, 169), (1, 2, 2, 1, 1, 346), (1, 2, 1, 1, "a", 663),
        (2, 1, 2, 1, 1, 649), (2, 2, 2, 1, 3, 217), (2, 2, 1, 2, "a", 919), (3, 0, 0, 3, 3, 592),
        (3, 0, 1, 3, "b", 218), (3, 2, 1, 3, "a", 559), (4, 0, 1, 4, "a", 871), (4, 1, 0, 4, 1, 747),
        (4, 2, 2, 4, 3, 139), (5, 0, 1, 5, "b", 420), (5, 2, 2, 4, 3, 389), (5, 2, 1, 5, "a", 213),
        (6, 0, 1, 6, "b", 492), (7, 0, 0, 7, 2, 744), (7, 2, 2, 7, 2, 465), (8, 2, 2, 7, 2, 929),
        (9, 1, 2, 9, 1, 846), (9, 2, 1, 9, "b", 385)]


@pytest.mark.parametrize("p", [0.0, 0.01, 0.2, 0.7, 1.0])  # rate=0 never fires, rate=1 always
def test_empirical_rate_matches_binomial(p):
    n = 10000
    sched = FaultSchedule([f"nan:rate={p},ranks=1"], seed=5, world_size=2)
    k = len(fired(sched, range(n), rank=1))
    assert abs(k - n * p) <= 5 * math.sqrt(n * p * (1 - p))
    assert fired(sched, range(n), rank=0) == []


def test_ranks_random_one_rank_per_event_consistently():
    world = 4
    sched = FaultSchedule(["nan:rate=1", "zero:rate=0.3"], seed=3, world_size=world)
    per_rank = {0: [0] * world, 1: [0] * world}
    starts = 0
    for step in range(2000):
        for i in (0, 1):
            hit = [r for r in range(world) if any(
                e.spec_index == i for e in sched.events(step, r, "aggregation"))]
            assert len(hit) <= 1
            if i == 0:
                assert hit == [sched.random_rank(0, step)]
            for r in hit:
                per_rank[i][r] += 1
            starts += i == 1 and bool(hit)
    n = 2000
    for c in per_rank[0]:  # uniform over ranks
        assert abs(c - n / world) <= 5 * math.sqrt(n * 0.25 * 0.75)
    assert abs(starts - n * 0.3) <= 5 * math.sqrt(n * 0.3 * 0.7)


def test_listed_ranks_draw_independently():
    sched = FaultSchedule(["nan:rate=0.5,ranks=0+2"], seed=1, world_size=3)
    f0, f2 = set(fired(sched, range(400), 0)), set(fired(sched, range(400), 2))
    assert f0 != f2 and f0 & f2 and fired(sched, range(400), 1) == []


def test_steps_ranges_start_stop():
    sched = FaultSchedule(["nan:steps=5+10-12,ranks=0"], seed=0, world_size=1)
    assert fired(sched, range(30)) == [5, 10, 11, 12]
    assert [s for s in range(30) if sched.starts(0, s, 0)] == [5, 10, 11, 12]
    sched = FaultSchedule(["nan:rate=1,start=7,stop=10,ranks=0"], seed=0, world_size=1)
    assert fired(sched, range(30)) == [7, 8, 9]
    sched = FaultSchedule(["nan:steps=0-100,rate=0.5,stop=50,ranks=0"], seed=0, world_size=1)
    got = fired(sched, range(200))
    assert got and max(got) < 50 and len(got) < 50  # rate thins the listed steps


def test_burst_repeats_on_the_same_rank():
    sched = FaultSchedule(["nan:steps=10+20,burst=3,ranks=1"], seed=0, world_size=2)
    assert fired(sched, range(40), rank=1) == [10, 11, 12, 20, 21, 22]
    ev = sched.events(12, 1, "aggregation")[0]
    assert ev.burst_start == 10
    sched = FaultSchedule(["nan:rate=0.02,burst=4"], seed=9, world_size=4)
    for step in range(500):
        if sched.starts(0, step, r := sched.random_rank(0, step)):
            for later in range(step, step + 4):
                assert sched.events(later, r, "aggregation")
    # Window decides starts only; a burst started before stop runs to its end.
    sched = FaultSchedule(["nan:steps=9,burst=3,stop=10,ranks=0"], seed=0, world_size=1)
    assert fired(sched, range(20)) == [9, 10, 11]


@pytest.mark.parametrize("text", [
    "nan:rate=0.05,burst=7,ranks=0", "nan:steps=3-9+40+100-120,rate=0.5,burst=30,ranks=0",
    "nan:steps=5+50,burst=1000000,ranks=0", "nan:rate=0.3,burst=4,start=20,stop=60,ranks=0",
    "nan:steps=0-200,rate=0.02,burst=25,start=10,ranks=0"])
def test_burst_start_is_the_latest_start_within_the_burst(text):
    # Against the definition, walked back step by step: the listed ranges are skipped
    # through, not walked (a burst of a million steps from step 5 is found at once).
    sched = FaultSchedule([text], seed=3, world_size=1)
    burst = sched.specs[0].burst
    for step in [*range(260), 10**5]:
        # (the million-step burst can only start at its listed steps, 50 and 5)
        walk = range(step, max(-1, step - burst), -1) if burst < 10**4 else [s for s in (50, 5) if s <= step]
        expect = next((s for s in walk if sched.starts(0, s, 0)), None)
        assert sched.burst_start(0, step, 0) == expect, step


def test_random_value_beyond_the_dtype_is_refused():
    spec = FaultSpec.parse("random:rate=1,value=1e6")
    spec.check_dtype(torch.float32)
    with pytest.raises(FaultSpecError, match="'value' must be <= 65504 for float16") as e:
        spec.check_dtype(torch.float16)
    assert e.value.field == "value"


def test_persistent_vs_transient_on_recompute():
    specs = ["nan:steps=4,ranks=0", "zero:steps=4,ranks=0,persistent=true"]
    sched = FaultSchedule(specs, seed=0, world_size=1)
    assert [e.spec.kind for e in sched.events(4, 0, "aggregation", attempt=0)] == ["nan", "zero"]
    assert [e.spec.kind for e in sched.events(4, 0, "aggregation", attempt=1)] == ["zero"]
    assert [e.spec.kind for e in sched.events(4, 0, "aggregation", attempt=2)] == ["zero"]


def test_sites_are_separate():
    sched = FaultSchedule(["nan:steps=1,site=local-grad,ranks=0"], seed=0, world_size=1)
    assert sched.events(1, 0, "local-grad") and not sched.events(1, 0, "aggregation")
    with pytest.raises(ValueError, match="site"):
        sched.events(1, 0, "bogus")


def test_tensor_for_weighs_by_elements_and_never_picks_an_empty_tensor() -> None:
    sched = FaultSchedule(["nan:rate=1,site=params"], seed=0, world_size=1)
    picks = [sched.tensor_for(sched.events(step, 0, "params")[0], ["a", "b", "c"], [0, 1, 1])
             for step in range(100)]
    assert set(picks) == {"b", "c"}


_SCHED = FaultSchedule(["nan:steps=0,ranks=0"], seed=0, world_size=2)
_EVENT = _SCHED.events(0, 0, "aggregation")[0]


@pytest.mark.parametrize("call, match", [
    (lambda: FaultSchedule([], seed=1.5, world_size=1), "seed must be an int"),
    (lambda: FaultSchedule([], seed=0, world_size=0), "world_size must be an int >= 1"),
    (lambda: _SCHED.events(0, 2, "aggregation"), r"rank must be in \[0, 2\)"),
    (lambda: _SCHED.events(0, 0, "aggregation", attempt=-1), "step and attempt must be >= 0"),
    (lambda: _SCHED.bucket_for(_EVENT, 0), "num_buckets must be >= 1"),
    (lambda: _SCHED.tensor_for(_EVENT, ["a"], [0]), "no elements"),
    (lambda: FaultInjector(_SCHED, rank=2), r"rank must be in \[0, 2\)"),
    (lambda: FaultInjector(_SCHED, rank=0).inject_bucket("aggregation", 0, 2, 2, torch.ones(2)),
     r"bucket_index 2 not in \[0, 2\)"),
], ids=["seed", "world_size", "events rank", "attempt", "num_buckets", "no elements", "injector rank",
        "bucket_index"])
def test_bad_arguments_are_refused(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call()


def test_schedule_checks_ranks_against_world_size():
    with pytest.raises(FaultSpecError) as e:
        FaultSchedule(["zero:rate=1", "nan:ranks=4+0,rate=1"], seed=0, world_size=4)
    # The spec is named by its index and its (canonical) text: a run may list several.
    assert str(e.value) == "fault 1 'nan:rate=1,ranks=0+4': field 'ranks' names rank 4 but world_size is 4"
    assert e.value.field == "ranks"


def test_a_bad_spec_is_named_as_the_caller_knows_it():
    """A schedule built in Python said "--inject", an option its user never typed."""
    bad = "bitflip:rate=2"
    for kwargs, label in (({}, "FaultSchedule(): specs"), ({"option": "--inject"}, "--inject")):
        with pytest.raises(FaultSpecError) as e:
            FaultSchedule([bad], seed=0, world_size=1, **kwargs)
        assert str(e.value) == f"{label} '{bad}': field 'rate' must be in [0, 1], got 2"
    with pytest.raises(FaultSpecError, match=r"^fault spec 'bitflip:rate=2': field 'rate'"):
        parse_specs([bad])
    with pytest.raises(FaultSpecError, match=r"^--inject 'bitflip:rate=2': field 'rate'"):
        parse_specs([bad], option="--inject")


# --------------------------------------------------------------------------- spec text


@st.composite
def specs(draw) -> FaultSpec:
    kind = draw(st.sampled_from(KINDS))
    kw: dict = {"site": draw(st.sampled_from(SITES))}
    finite = st.floats(allow_nan=False, allow_infinity=False)
    rate = draw(st.none() | st.floats(0, 1))
    steps = draw(st.none() | st.lists(
        st.integers(0, 50) | st.tuples(st.integers(0, 50), st.integers(0, 10)).map(
            lambda t: (t[0], t[0] + t[1])), min_size=1, max_size=5))
    if rate is None and steps is None:
        rate = 0.5
    kw.update(rate=rate, steps=steps)
    kw["ranks"] = draw(st.just("random") | st.sets(st.integers(0, 7), min_size=1).map(tuple))
    if kind != "stale":
        which = draw(st.sampled_from(["none", "count", "fraction"]))
        if which == "count":
            kw["count"] = draw(st.integers(1, 10**6))
        elif which == "fraction":
            kw["fraction"] = draw(st.floats(0, 1, exclude_min=True))
    if kind == "bitflip":
        kw["bits"] = draw(st.sampled_from(BIT_CLASSES) | st.integers(0, 63))
    if kind == "scale":
        kw["factor"] = draw(finite.filter(lambda f: f != 1))
    if kind == "noise":
        kw["sigma"] = draw(st.floats(0, 1e6, exclude_min=True))
    if kind == "random":
        kw["value"] = draw(st.none() | st.floats(1e-30, 1e30))
    kw["burst"] = draw(st.integers(1, 100))
    kw["persistent"] = draw(st.booleans())
    kw["start"] = draw(st.integers(0, 100))
    kw["stop"] = draw(st.none() | st.integers(101, 10**6))
    return FaultSpec(kind, **kw)


@settings(max_examples=300, deadline=None)
@given(spec=specs())
def test_parse_to_text_round_trip(spec):
    text = spec.to_text()
    assert FaultSpec.parse(text) == spec
    assert repr(FaultSpec.parse(text)) == repr(spec)  # == takes -0.0 for 0.0; the bits differ
    assert FaultSpec.parse(text).to_text() == text


def test_parse_examples_and_defaults():
    s = FaultSpec.parse("bitflip:site=aggregation,rate=0.01,bits=exponent,ranks=1")
    assert s == FaultSpec("bitflip", rate=0.01, bits="exponent", ranks=(1,))
    assert s.to_text() == "bitflip:rate=0.01,ranks=1,bits=exponent"
    s = FaultSpec.parse(" Scale : steps = 5+10-12 , factor=-1e4, ranks=2+0 ")
    assert s.steps == ((5, 5), (10, 12)) and s.factor == -1e4 and s.ranks == (0, 2)
    d = FaultSpec.parse("noise:rate=1")
    assert (d.site, d.ranks, d.count, d.fraction, d.sigma, d.burst, d.persistent, d.start,
            d.stop) == ("aggregation", "random", None, None, 0.1, 1, False, 0, None)
    assert FaultSpec.parse("scale:rate=1").factor == 1e3
    assert FaultSpec("nan", steps=range(3, 6)).steps == ((3, 5),)
    assert [s.kind for s in parse_specs(["nan:rate=1", "zero:steps=1"])] == ["nan", "zero"]


def test_parse_ignores_case_and_a_trailing_comma() -> None:
    spec = FaultSpec("bitflip", site="params", rate=1, bits="sign", persistent=True)
    parsed = FaultSpec.parse("BitFlip:Site=Params,RATE=1,Ranks=Random,Bits=Sign,Persistent=TRUE,")
    assert repr(parsed) == repr(spec)  # not only ==: the int rate is stored as the float 1.0 parse gives


@pytest.mark.parametrize("steps, merged", [
    ("5+6+7", ((5, 7),)),  # adjacent steps: one range
    ("1-10+2-3", ((1, 10),)),  # a range inside another
    ([9, 2, (4, 5)], ((2, 2), (4, 5), (9, 9))),  # sorted
])
def test_steps_are_sorted_merged_ranges(steps: str | list, merged: tuple) -> None:
    spec = FaultSpec.parse(f"nan:steps={steps}") if isinstance(steps, str) else FaultSpec("nan", steps=steps)
    assert spec.steps == merged


@pytest.mark.parametrize("spec, text", [
    (FaultSpec("scale", steps=[5, (10, 12)], factor=-1e4, persistent=True),
     "scale:steps=5+10-12,factor=-10000,persistent=true"),
    (FaultSpec("scale", rate=0.5, factor=1e300), "scale:rate=0.5,factor=1e+300"),  # no 301 digits
    (FaultSpec("scale", rate=0.5, factor=-0.0), "scale:rate=0.5,factor=-0.0"),  # its sign kept
])
def test_to_text_writes_values_as_a_user_would(spec: FaultSpec, text: str) -> None:
    assert spec.to_text() == text


@pytest.mark.parametrize("text, after, first", [
    ("nan:rate=0.5", 0, 0),
    ("nan:rate=0.5,start=10", 3, 10),
    ("nan:steps=0-10,start=4", 0, 4),
    ("nan:steps=5+20", 5, 5),  # a range ending at the first candidate step
    ("nan:steps=5+20", 6, 20),
    ("nan:rate=0.5,burst=3", 10, 10),  # a burst from step 8 fires at 10: never before `after`
    ("nan:steps=5,burst=3", 7, 7),  # the burst from 5 still runs at 7...
    ("nan:steps=5,burst=3", 8, None),  # ...but has ended by 8
    ("nan:rate=0.5,stop=4", 4, None),  # stop is exclusive
    ("nan:steps=3,rate=0", 0, None),
])
def test_first_firing(text: str, after: int, first: int | None) -> None:
    assert FaultSpec.parse(text).first_firing(after=after) == first


@pytest.mark.parametrize("text, dtype, takes", [
    ("random:rate=1,value=65504", torch.float16, True),  # float16's largest finite value
    ("bitflip:rate=1,bits=15", torch.bfloat16, True),
    ("bitflip:rate=1,bits=16", torch.bfloat16, False),
    ("bitflip:rate=1", torch.int32, False),
])
def test_takes_says_whether_check_dtype_accepts(text: str, dtype: torch.dtype, takes: bool) -> None:
    spec = FaultSpec.parse(text)
    assert spec.takes(dtype) == takes
    if not takes:
        with pytest.raises(FaultSpecError, match="'bits'"):
            spec.check_dtype(dtype)


def test_bitflip_refusal_names_the_dtype_as_a_user_writes_it() -> None:
    # The message listed "float32, ..." but then the raw "torch.float8_e4m3fn".
    with pytest.raises(FaultSpecError) as err:
        FaultSpec.parse("bitflip:rate=1").check_dtype(torch.float8_e4m3fn)
    assert str(err.value).endswith("bitflip supports dtypes float32, bfloat16, float16, float64, not float8_e4m3fn")


BAD = [
    ("bitflip:rate=2", "rate", "field 'rate' must be in [0, 1], got 2"),
    ("bitflip:rate=-0.1", "rate", None),
    ("bitflip:rate=abc", "rate", None),
    ("bitflip:rate=nan", "rate", None),
    ("bitflip", "rate", None),
    ("bitflip:site=params", "rate", None),
    ("bitflp:rate=1", "kind", "valid kinds: bitflip, scale"),
    ("", "kind", None),
    ("bitflip:rat=1", "rat", "valid keys: site, rate"),
    ("bitflip:rate=1,=5", "kind", "unknown key ''"),  # no key to name: the spec's head
    ("bitflip:rate", "rate", "needs a value (key=value)"),
    ("bitflip:rate=", "rate", "needs a value (key=value)"),  # not "must be a number, got "
    ("bitflip:rate=0.1,rate=0.2", "rate", "twice"),
    ("bitflip:rate=1,site=memory", "site", None),
    ("bitflip:steps=x", "steps", None),
    ("bitflip:steps=5-3", "steps", "got 5-3"),  # as the user typed it
    ("bitflip:steps=-1", "steps", None),
    ("bitflip:steps=1++2", "steps", None),
    ("bitflip:rate=1,ranks=x", "ranks", None),
    ("bitflip:rate=1,ranks=1+1", "ranks", None),
    ("bitflip:rate=1,ranks=-1", "ranks", None),
    ("bitflip:rate=1,count=0", "count", None),
    ("bitflip:rate=1,count=1.5", "count", "must be an integer"),
    ("bitflip:rate=abc", "rate", "must be a number"),
    ("bitflip:rate=1,fraction=0", "fraction", None),
    ("bitflip:rate=1,fraction=1.5", "fraction", None),
    ("bitflip:rate=1,count=2,fraction=0.5", "fraction", None),
    ("bitflip:rate=1,bits=64", "bits", None),
    ("bitflip:rate=1,bits=exp", "bits", None),
    ("scale:rate=1,bits=3", "bits", "only to kind 'bitflip'"),
    ("bitflip:rate=1,factor=2", "factor", None),
    ("scale:rate=1,factor=inf", "factor", None),
    ("noise:rate=1,sigma=-1", "sigma", None),
    ("noise:rate=1,sigma=0", "sigma", "unchanged"),  # recorded and counted, corrupting nothing
    ("scale:rate=1,factor=1", "factor", "unchanged"),
    ("random:rate=1,value=0", "value", None),
    ("zero:rate=1,value=1", "value", None),
    ("zero:rate=1,value=0", "value", "only to kind 'random'"),  # the kind first, then the value
    ("nan:rate=1,bits=any", "bits", "only to kind 'bitflip'"),  # even bitflip's default
    ("random:rate=1,value=inf", "value", "must be a finite number > 0"),
    ("stale:rate=1,count=2", "count", None),
    ("stale:rate=1,fraction=0.5", "fraction", None),
    ("nan:rate=1,burst=0", "burst", None),
    ("nan:rate=1,persistent=yes", "persistent", None),
    ("nan:rate=1,start=-1", "start", None),
    ("nan:rate=1,start=5,stop=5", "stop", None),
    # plain ASCII numbers only: int() and float() would take these
    ("bitflip:rate=1,count=1_000", "count", "must be an integer"),
    ("bitflip:rate=1,count=+3", "count", "must be an integer"),
    ("bitflip:rate=+0.5", "rate", "must be a number"),
    ("bitflip:steps=\u0663", "steps", None),  # an Arabic-Indic 3
    ("bitflip:rate=\u0661", "rate", "must be a number"),
    ("bitflip:steps=1,bits=0_1", "bits", None),
]


@pytest.mark.parametrize("text,field,fragment", BAD)
def test_malformed_spec_names_the_field(text, field, fragment):
    with pytest.raises(FaultSpecError) as e:
        FaultSpec.parse(text)
    assert isinstance(e.value, ValueError)
    assert e.value.field == field
    msg = str(e.value)
    assert msg.startswith(f"fault spec '{text}': ")
    if field != "kind":
        assert f"'{field}'" in msg
    if fragment:
        assert fragment in msg


@pytest.mark.parametrize("kwargs,field", [
    ({"steps": [True]}, "steps"), ({"steps": [(1, 2, 3)]}, "steps"), ({"steps": "5"}, "steps"),
    ({"steps": b"5"}, "steps"),  # bytes iterate as ints: b"5" would have been step 53
    ({"steps": 5.0}, "steps"), ({"steps": 5, "ranks": 5.0}, "ranks"), ({"steps": 5, "ranks": b"1"}, "ranks"),
    ({"steps": range(0, 10, 2)}, "steps"), ({"steps": -1}, "steps"), ({"steps": [(5, 3)]}, "steps"),
    ({"steps": []}, "steps"), ({"rate": True}, "rate"), ({"steps": 1, "ranks": ()}, "ranks"),
    ({"rate": 1, "fraction": True}, "fraction"),
    ({"kind": "noise", "rate": 1, "sigma": True}, "sigma"), ({"kind": "random", "rate": 1, "value": True}, "value"),
    ({"rate": 1, "factor": 2.0}, "factor"), ({"rate": 1, "persistent": 1}, "persistent"),
    ({"rate": 1, "start": 1.5}, "start"),
])
def test_direct_construction_names_the_field_of_a_bad_value(kwargs: dict, field: str) -> None:
    with pytest.raises(FaultSpecError, match=f"field '{field}'"):
        FaultSpec(**{"kind": "nan", **kwargs})


@pytest.mark.parametrize("text,kwargs", [
    ("zero:rate=1,sigma=0", {"sigma": 0}), ("nan:rate=1,factor=1", {"factor": 1}),
    ("zero:rate=1,value=0", {"value": 0}), ("scale:rate=1,bits=99", {"bits": 99}),
    ("zero:rate=1,sigma=inf", {"sigma": math.inf}),
])
def test_direct_construction_names_a_knob_on_the_wrong_kind_as_parse_does(text: str, kwargs: dict) -> None:
    """A knob of another kind is named as such first, its value after: built directly,
    ``FaultSpec("zero", rate=1, sigma=0)`` said "must be > 0" where parse() said it
    applies only to noise."""
    with pytest.raises(FaultSpecError) as parsed:
        FaultSpec.parse(text)
    with pytest.raises(FaultSpecError) as built:
        FaultSpec(text.partition(":")[0], rate=1, **kwargs)
    assert str(parsed.value) == f"fault spec '{text}': {built.value}"
    assert "applies only to kind" in str(built.value) and built.value.field == parsed.value.field


def test_direct_construction_validates_too():
    with pytest.raises(FaultSpecError, match="field 'count'"):
        FaultSpec("nan", rate=1, count=0)
    with pytest.raises(FaultSpecError, match="unknown fault kind"):
        FaultSpec("boom", rate=1)


# --------------------------------------------------------------------------- injector


def buckets(n: int = 5, size: int = 50, seed: int = 0) -> list[torch.Tensor]:
    return [torch.randn(size, generator=gen(seed + i)) for i in range(n)]


def test_injector_without_specs_is_disabled_and_never_touches_tensors():
    inj = FaultInjector(FaultSchedule([], seed=0, world_size=2), rank=1)
    assert not inj.enabled and not inj.has_site("aggregation")
    bs = buckets()
    ref = [b.clone() for b in bs]
    for step in range(20):
        for i, b in enumerate(bs):
            assert inj.inject_bucket("aggregation", step, i, len(bs), b) == []
            assert inj.inject_bucket("local-grad", step, i, len(bs), b, attempt=1) == []
        assert inj.inject_tensors("params", step, {str(i): b for i, b in enumerate(bs)}) == []
    for b, r in zip(bs, ref):
        assert torch.equal(b.view(torch.int32), r.view(torch.int32))


def test_firing_event_changes_only_the_chosen_bucket():
    sched = FaultSchedule(["bitflip:rate=1,ranks=0,count=3"], seed=4, world_size=2)
    inj = FaultInjector(sched, rank=0)
    other = FaultInjector(sched, rank=1)
    assert inj.enabled and inj.has_site("aggregation") and not inj.has_site("params")
    chosen_seen = set()
    for step in range(30):
        bs = buckets(seed=step)
        ref = [b.clone() for b in bs]
        records = []
        for i, b in enumerate(bs):
            records += inj.inject_bucket("aggregation", step, i, len(bs), b)
            assert other.inject_bucket("aggregation", step, i, len(bs), b.clone()) == []
        changed = [i for i, (b, r) in enumerate(zip(bs, ref)) if not torch.equal(b, r)]
        (ev,) = sched.events(step, 0, "aggregation")
        assert changed == [sched.bucket_for(ev, len(bs))]
        (rec,) = records
        assert rec.target == changed[0] and rec.step == step and rec.rank == 0
        assert rec.num_elements == 3 and len(flipped_bits(ref[changed[0]], bs[changed[0]])) == 3
        chosen_seen.add(changed[0])
    assert len(chosen_seen) > 1  # the bucket choice varies across steps


def test_numpy_numbers_make_the_spec_and_schedule_that_python_numbers_make() -> None:
    # Specs built in a sweep script take numpy's numbers: np.int64(3) was refused as
    # "must be an integer >= 1, got 3". They are kept as Python numbers, whose
    # arithmetic in the schedule's hashing never wraps.
    plain = FaultSpec("scale", steps=[(10, 12), 20], ranks=(1, 0), count=3, factor=2.0, burst=2, start=5, stop=30,
                      rate=0.5)
    numpy = FaultSpec("scale", steps=[tuple(np.arange(10, 13)[[0, -1]]), np.int64(20)],
                      ranks=(np.int64(1), np.int32(0)), count=np.int64(3), factor=np.float32(2.0),
                      burst=np.int16(2), start=np.int64(5), stop=np.uint8(30), rate=np.float32(0.5))
    assert numpy == plain and numpy.to_text() == plain.to_text()
    assert all(type(v) in (int, float, str, bool, tuple, type(None)) for v in dataclasses.astuple(numpy))
    assert type(numpy.steps[0][0]) is int and type(numpy.ranks[0]) is int
    flips = FaultSpec("bitflip", rate=1.0, bits=np.int64(30), fraction=np.float64(0.5))
    assert flips.bits == 30 and type(flips.bits) is int
    ours, theirs = FaultSchedule([plain], seed=np.int64(7), world_size=np.int64(2)), FaultSchedule([plain], 7, 2)
    assert [ours.events(t, r, "aggregation") for t in range(31) for r in (0, 1)] == [
        theirs.events(t, r, "aggregation") for t in range(31) for r in (0, 1)]
    with pytest.raises(FaultSpecError, match="field 'count' must be an integer >= 1, got True"):
        FaultSpec("bitflip", rate=1.0, count=np.bool_(True))


def test_a_steps_events_are_drawn_once_per_site_when_the_sites_alternate(monkeypatch: pytest.MonkeyPatch) -> None:
    # The comm hook asks for local-grad events before a bucket's all-reduce and for
    # aggregation events after it, bucket by bucket: with one cached entry the two sites
    # evicted each other's and every call drew the events again (0.6 s a step with long
    # bursts).
    sched = FaultSchedule(["scale:site=local-grad,rate=0.5,burst=50", "scale:site=aggregation,rate=0.5,burst=50"],
                          seed=1, world_size=2)
    inj = FaultInjector(sched, rank=0)
    drawn: list[tuple[int, str]] = []
    events = sched.events

    def counted(step: int, rank: int, site: str, attempt: int = 0) -> list[Any]:
        drawn.append((step, site))
        return events(step, rank, site, attempt)

    monkeypatch.setattr(sched, "events", counted)
    for step in range(2):
        for i, b in enumerate(buckets(n=3, seed=step)):
            inj.inject_bucket("local-grad", step, i, 3, b)
            inj.inject_bucket("aggregation", step, i, 3, b)
    assert drawn == [(0, "local-grad"), (0, "aggregation"), (1, "local-grad"), (1, "aggregation")]


def test_persistent_recompute_fires_again_elsewhere():
    sched = FaultSchedule(["bitflip:steps=2,ranks=0,persistent=true,count=4",
                           "nan:steps=2,ranks=0"], seed=8, world_size=1)
    inj = FaultInjector(sched, rank=0)
    b0, b1 = buckets(1)[0], buckets(1)[0]
    r0 = inj.inject_bucket("aggregation", 2, 0, 1, b0, attempt=0)
    r1 = inj.inject_bucket("aggregation", 2, 0, 1, b1, attempt=1)
    assert [r.kind for r in r0] == ["bitflip", "nan"] and [r.kind for r in r1] == ["bitflip"]
    assert r1[0].attempt == 1 and r1[0].num_elements == 4
    # Hardware faults do not reproduce bit-for-bit: another draw of elements/bits.
    assert (r0[0].indices, r0[0].bits) != (r1[0].indices, r1[0].bits)
    clean = buckets(1)[0]
    assert len(flipped_bits(clean, b1)) == 4
    # ...and the same draw again for the same attempt (reproducible from the seed).
    b2 = buckets(1)[0]
    (r2,) = inj.inject_bucket("aggregation", 2, 0, 1, b2, attempt=1)
    assert torch.equal(b1, b2) and r2.indices == r1[0].indices


def test_elements_differ_across_ranks_and_steps_and_repeat_with_the_seed() -> None:
    """Two ranks hit in the same step draw their own elements: the all-reduced bucket is
    the same on every rank, and the same elements flipped the same way would leave the
    replicas agreeing (invisible to a cross-replica check). Steps draw anew too: a fault
    at every step would otherwise strike one element for the whole run."""
    def run() -> dict[tuple[int, int], tuple[list[int], list[int] | None]]:
        sched = FaultSchedule(["bitflip:rate=1,ranks=0+1,count=3"], seed=4, world_size=2)
        out = {}
        for rank in (0, 1):
            inj = FaultInjector(sched, rank=rank)
            for step in range(8):
                (rec,) = inj.inject_bucket("aggregation", step, 0, 1, torch.ones(1000))
                out[step, rank] = (rec.indices, rec.bits)
        return out

    draws = run()
    assert len({tuple(idx) for idx, _ in draws.values()}) == len(draws)  # 16 distinct draws
    assert run() == draws  # the same spec and seed: the same faults


@pytest.mark.parametrize("site", ["aggregation", "params"])
def test_persistent_recompute_hits_the_same_bucket_or_tensor(site: str) -> None:
    """Faulty hardware strikes the same memory again: a recompute of a step is hit in
    the bucket or tensor its first attempt was (at other elements)."""
    sched = FaultSchedule([f"zero:site={site},rate=1,ranks=0,persistent=true"], seed=2, world_size=1)
    inj = FaultInjector(sched, rank=0)

    def targets(step: int, attempt: int) -> list[int | str]:
        if site == "aggregation":
            return [r.target for i, b in enumerate(buckets(8)) for r in inj.inject_bucket(site, step, i, 8, b, attempt)]
        named = {str(i): b for i, b in enumerate(buckets(8))}
        return [r.target for r in inj.inject_tensors(site, step, named, attempt)]

    first = [targets(step, 0) for step in range(12)]
    assert len({t for (t,) in first}) > 1  # the choice varies with the step...
    for attempt in (1, 2):  # ...but not with the attempt
        assert [targets(step, attempt) for step in range(12)] == first


def test_stale_returns_previous_steps_bucket():
    spec = "stale:site=local-grad,steps=1+3,ranks=0,persistent=true"
    inj = FaultInjector(FaultSchedule([spec], seed=0, world_size=1), rank=0)
    vals = {s: torch.full((4,), float(s)) for s in range(5)}
    seen = {}
    for step in range(5):
        t = vals[step].clone()
        seen[step] = (t, inj.inject_bucket("local-grad", step, 0, 1, t))
        if step == 3:
            # A recompute of step 3 still sees step 2, not its own first attempt.
            t = torch.full((4,), 33.0)
            (rec,) = inj.inject_bucket("local-grad", 3, 0, 1, t, attempt=1)
            assert torch.equal(t, vals[2]) and rec.attempt == 1
    assert torch.equal(seen[0][0], vals[0]) and seen[0][1] == []
    assert torch.equal(seen[1][0], vals[0]) and seen[1][1][0].num_elements == 4
    assert seen[1][1][0].before == [1.0] * 4 and seen[1][1][0].after == [0.0] * 4
    assert torch.equal(seen[2][0], vals[2])  # not firing: untouched
    assert torch.equal(seen[3][0], vals[2])
    assert torch.equal(seen[4][0], vals[4])
    # Memory holds the clean (pre-injection) value: stale at step 2 brings back 6.0,
    # what step 1 received, not the stale 5.0 written into it.
    inj2 = FaultInjector(FaultSchedule(["stale:steps=1+2,ranks=0"], seed=0, world_size=1), 0)
    for step, v in enumerate([5.0, 6.0, 7.0]):
        t = torch.full((4,), v)
        inj2.inject_bucket("aggregation", step, 0, 1, t)
    assert torch.equal(t, torch.full((4,), 6.0))


def test_stale_at_rest_remembers_steps_where_nothing_fires() -> None:
    """The only spec is stale at step 3: step 2, where no event fires, must still be
    remembered for it to replay."""
    inj = FaultInjector(FaultSchedule(["stale:site=params,steps=3,ranks=0"], seed=0, world_size=1), rank=0)
    for step in range(3):
        assert inj.inject_tensors("params", step, {"w": torch.full((4,), float(step))}) == []
    t = torch.full((4,), 3.0)
    (rec,) = inj.inject_tensors("params", 3, {"w": t})
    assert torch.equal(t, torch.full((4,), 2.0)) and rec.before == [3.0] * 4


def test_stale_values_go_into_the_injector_state_and_come_back() -> None:
    """A resume at step 3 (a new injector) replays step 2's value there, as the
    uninterrupted injector does, from :meth:`FaultInjector.state_dict`; a state without
    it (a checkpoint of an older version) leaves the step-3 fault nothing to replay."""
    specs = ["stale:site=params,steps=3,ranks=0", "stale:site=aggregation,steps=3,ranks=0"]

    def injector() -> FaultInjector:
        return FaultInjector(FaultSchedule(specs, seed=0, world_size=1), rank=0)

    def step(inj: FaultInjector, t: int) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
        w, grad = torch.full((4,), float(t)), torch.full((2,), -float(t))
        return w, grad, [*inj.inject_tensors("params", t, {"w": w}), *inj.inject_bucket("aggregation", t, 0, 1, grad)]

    straight = injector()
    for t in range(3):
        step(straight, t)
    state = straight.state_dict()
    # The latest step's values alone, one per target.
    assert [(e["site"], e["target"], e["step"], e["value"].tolist()) for e in state] == [
        ("params", "w", 2, [2.0] * 4), ("aggregation", 0, 2, [-2.0] * 2)]
    resumed = injector()
    resumed.load_state_dict(state)
    w, grad, records = step(resumed, 3)
    assert [r.to_json() for r in records] == [r.to_json() for r in step(straight, 3)[2]]
    assert w.tolist() == [2.0] * 4 and grad.tolist() == [-2.0] * 2 and len(records) == 2
    older = injector()
    older.load_state_dict([])
    assert step(older, 3)[2] == []
    # Kept only where a stale spec of the loading injector can hit its rank.
    other = FaultInjector(FaultSchedule(["stale:site=params,steps=3,ranks=1"], seed=0, world_size=2), rank=0)
    other.load_state_dict(state)
    assert other.state_dict() == []
    with pytest.raises(ValueError, match="not a kept value: site 'params', target 'w', step -1"):
        resumed.load_state_dict([{**state[0], "step": -1}])


def test_stale_at_first_step_records_nothing():
    inj = FaultInjector(FaultSchedule(["stale:steps=0"], seed=0, world_size=1), rank=0)
    t = torch.ones(3)
    assert inj.inject_bucket("aggregation", 0, 0, 1, t) == [] and torch.equal(t, torch.ones(3))


def test_stale_memory_only_when_needed():
    inj = FaultInjector(FaultSchedule(["nan:rate=0.5"], seed=0, world_size=2), rank=0)
    for step in range(5):
        inj.inject_bucket("aggregation", step, 0, 1, torch.ones(3))
    assert inj._memory == {}
    inj = FaultInjector(FaultSchedule(["stale:rate=0.5,ranks=1"], seed=0, world_size=2), rank=0)
    inj.inject_bucket("aggregation", 0, 0, 1, torch.ones(3))
    assert inj._memory == {}
    # A spec that can never fire: no copy of every target kept, no site to walk.
    inj = FaultInjector(FaultSchedule(["stale:site=params,rate=0", "stale:rate=0,burst=5"], seed=0, world_size=1),
                        rank=0)
    assert not inj.has_site("params") and not inj.has_site("aggregation")
    inj.inject_bucket("aggregation", 0, 0, 1, torch.ones(3))
    inj.inject_tensors("params", 0, {"param/w": torch.ones(3)})
    assert inj._memory == {}


def test_a_spec_that_can_never_fire_is_answered_without_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    # rate=0 with a long burst hashed every step of the burst's window, at every step.
    sched = FaultSchedule(["nan:rate=0,burst=1000", "nan:steps=2,stop=1,burst=1000"], seed=0, world_size=1)
    hashes = []
    monkeypatch.setattr(sched, "_hash", lambda *key: hashes.append(key) or 0)
    assert sched.events(999, 0, "aggregation") == [] and hashes == []
    assert not sched.can_fire(0) and not sched.can_fire(1) and sched.sites == frozenset()


def test_inject_tensors_corrupts_one_named_tensor_in_place():
    sched = FaultSchedule(["scale:site=params,rate=1,ranks=0,factor=2",
                           "stale:site=params,steps=3,ranks=0"],
                          seed=2, world_size=1)
    inj = FaultInjector(sched, rank=0)
    sched_opt = FaultSchedule(["zero:rate=1,site=optimizer-state"], seed=2, world_size=1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    picks = []
    refs = []
    for step in range(40):
        named = dict(model.named_parameters())
        refs.append({n: p.detach().clone() for n, p in named.items()})
        recs = inj.inject_tensors("params", step, named)
        changed = [n for n, p in named.items() if not torch.equal(p, refs[step][n])]
        scale = [r for r in recs if r.kind == "scale"]
        assert len(scale) == 1 and scale[0].target in changed
        if step != 3:
            assert changed == [scale[0].target]
        else:  # stale: the tensor it picks holds its value from before step 2's scaling again
            (stale,) = [r for r in recs if r.kind == "stale"]
            assert torch.equal(named[stale.target], refs[2][stale.target])
        picks.append(scale[0].target)
    # A recompute fires only persistent specs, at rest too.
    assert inj.inject_tensors("params", 39, dict(model.named_parameters()), attempt=1) == []
    # Weighted by numel: the 32-element weight is picked most often, all get picked.
    assert max(set(picks), key=picks.count) == "0.weight" and len(set(picks)) >= 3
    inj2 = FaultInjector(sched_opt, rank=0)
    state = {"exp_avg": torch.ones(5), "step": torch.tensor(3)}  # int entry is skipped
    (rec,) = inj2.inject_tensors("optimizer-state", 0, state)
    assert rec.target == "exp_avg" and (state["exp_avg"] == 0).sum() == 1
    assert state["step"].item() == 3


def test_inject_tensors_picks_among_eligible_tensors_by_sorted_name() -> None:
    """Only floating, non-empty tensors whose dtype the spec takes, weighted by their
    elements; the dict's order does not matter."""
    sched = FaultSchedule(["bitflip:site=params,rate=1,bits=40,ranks=0"], seed=1, world_size=1)

    def named(order: list[str]) -> dict[str, torch.Tensor]:
        pool = {"a": torch.ones(3000), "b": torch.ones(1000, dtype=torch.float64),
                "c": torch.ones(3000, dtype=torch.float64), "d": torch.arange(3),
                "e": torch.empty(0, dtype=torch.float64)}
        return {n: pool[n] for n in order}

    picks = {}
    for order in (["a", "b", "c", "d", "e"], ["e", "d", "c", "b", "a"]):
        inj = FaultInjector(sched, rank=0)
        picks[order[0]] = [inj.inject_tensors("params", step, named(order))[0].target for step in range(40)]
    assert picks["a"] == picks["e"]
    # "a" (float32) cannot take bit 40; "c" holds 3/4 of the float64 elements.
    assert set(picks["a"]) == {"b", "c"} and picks["a"].count("c") > 2 * picks["a"].count("b")
    # Nothing eligible (an integer counter, an empty tensor): nothing to do.
    zero = FaultSchedule(["zero:site=params,rate=1,ranks=0"], seed=1, world_size=1)
    assert FaultInjector(zero, rank=0).inject_tensors("params", 0, named(["d", "e"])) == []


@pytest.mark.parametrize("site", ["aggregation", "params"])
def test_elements_are_drawn_from_the_generator_of_the_event_and_its_target(site: str) -> None:
    sched = FaultSchedule([f"zero:site={site},rate=1,count=3,ranks=0"], seed=6, world_size=1)
    inj = FaultInjector(sched, rank=0)
    for step in range(10):
        (ev,) = sched.events(step, 0, site)
        if site == "aggregation":
            bs = buckets(4, seed=step)
            recs = [r for i, b in enumerate(bs) for r in inj.inject_bucket(site, step, i, 4, b)]
        else:
            recs = inj.inject_tensors(site, step, {str(i): b for i, b in enumerate(buckets(4, seed=step))})
        (rec,) = recs
        assert rec.indices == select_indices(50, sched.generator(ev, rec.target), count=3).tolist()


def test_a_records_fields_name_its_spec_burst_and_bit() -> None:
    specs = ["nan:steps=0,ranks=0", "bitflip:steps=3,ranks=0,count=3,bits=30,burst=4",  # as to_text writes them
             "bitflip:steps=5,ranks=0,bits=sign", "bitflip:steps=5,ranks=0,count=2,bits=sign"]
    inj = FaultInjector(FaultSchedule(specs, seed=0, world_size=1), rank=0)
    recs = inj.inject_bucket("aggregation", 5, 0, 1, torch.ones(10))
    assert [(r.spec_index, r.spec, r.burst_start, r.step) for r in recs] == [
        (1, specs[1], 3, 5), (2, specs[2], 5, 5), (3, specs[3], 5, 5)]
    # One bit named: the spec's bit, or the one element's; a class over several elements names none.
    assert [r.bit for r in recs] == [30, 31, None]
    assert recs[0].bits == [30] * 3 and recs[1].bits == [31] and recs[2].bits == [31] * 2


def test_events_asked_for_one_site_are_not_served_for_another() -> None:
    """The comm hook asks for local-grad, then aggregation events of the same step."""
    sched = FaultSchedule(["nan:site=local-grad,steps=0,ranks=0", "zero:steps=0,ranks=0"], seed=0, world_size=1)
    inj = FaultInjector(sched, rank=0)
    assert [r.kind for r in inj.inject_bucket("local-grad", 0, 0, 1, torch.ones(4))] == ["nan"]
    assert [r.kind for r in inj.inject_bucket("aggregation", 0, 0, 1, torch.ones(4))] == ["zero"]


def test_inject_rejects_wrong_site_kind():
    inj = FaultInjector(FaultSchedule(["nan:rate=1,site=params",
                                       "nan:rate=1,site=aggregation"], seed=0, world_size=1), 0)
    with pytest.raises(ValueError, match="inject_bucket"):
        inj.inject_bucket("params", 0, 0, 1, torch.ones(2))
    with pytest.raises(ValueError, match="inject_tensors"):
        inj.inject_tensors("aggregation", 0, {"a": torch.ones(2)})
    with pytest.raises(ValueError, match="bucket_index"):
        inj.inject_bucket("aggregation", 0, 3, 2, torch.ones(2))


def test_record_to_json_is_strict_json():
    inj = FaultInjector(FaultSchedule(["nan:steps=0,ranks=0,count=2",
                                       "bitflip:steps=0,ranks=0,bits=30"], seed=0, world_size=1),
                        rank=0)
    recs = inj.inject_bucket("aggregation", 0, 0, 1, torch.ones(10))
    assert [r.kind for r in recs] == ["nan", "bitflip"]
    assert recs[1].bit == 30 and recs[0].bit is None
    for r in recs:
        line = json.dumps(r.to_json(), allow_nan=False)
        d = json.loads(line)
        assert set(d) >= {"step", "rank", "site", "target", "kind", "bit", "num_elements",
                          "indices", "before", "after", "attempt"}
    assert json.loads(json.dumps(recs[0].to_json()))["after"] == ["nan", "nan"]
    assert isinstance(recs[0], FaultRecord)
