"""Tests for paft.fingerprint: exactness, the single-word guarantee, the digest,
the float64 carrying of fingerprints, and settings digests."""

from __future__ import annotations

import doctest
import math
import os
import subprocess
import sys
import time
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paft import fingerprint as F
from paft.fingerprint import (
    digest,
    fingerprint,
    fingerprint_and_digests,
    join_int64,
    repr_digest,
    split_int64,
)

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# (sign, exponent, mantissa) bit ranges of each dtype's integer view.
_BIT_CLASSES = {
    torch.float32: {"sign": (31, 31), "exponent": (23, 30), "mantissa": (0, 22)},
    torch.float64: {"sign": (63, 63), "exponent": (52, 62), "mantissa": (0, 51)},
    torch.bfloat16: {"sign": (15, 15), "exponent": (7, 14), "mantissa": (0, 6)},
    torch.float16: {"sign": (15, 15), "exponent": (10, 14), "mantissa": (0, 9)},
    torch.int64: {"sign": (63, 63), "high": (32, 62), "low": (0, 31)},
}


def flip_bit(t: torch.Tensor, index: int, bit: int) -> None:
    """Flip ``bit`` of element ``index`` (flat) of ``t`` in place, bitwise."""
    width = 8 * t.element_size()
    mask = -(1 << (width - 1)) if bit == width - 1 else 1 << bit
    t.view(_INT_VIEW[t.element_size()]).view(-1)[index] ^= mask


def _random(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-(2**62), 2**62, (n,), generator=g, dtype=dtype)


# ---------------------------------------------------------------------------
# Reference: the documented formula in plain Python integers
# ---------------------------------------------------------------------------


def _wrap32(x: int) -> int:
    x &= (1 << 32) - 1
    return x - (1 << 32) if x >= 1 << 31 else x


def _ref_digest(t: torch.Tensor) -> int:
    raw = bytes(t.detach().resolve_conj().contiguous().reshape(-1).view(torch.uint8).tolist())
    full = len(raw) // F._ROW_BYTES
    rows_in_place = full - 1 + full % 2 if full >= F._BIG_ROWS else 0  # odd: see _plan_for
    raw += b"\0" * (-len(raw) % F._ROW_BYTES)
    lanes = [int.from_bytes(raw[q : q + 4], "little", signed=True) for q in range(0, len(raw), 4)]
    x = [lanes[r * F._B : (r + 1) * F._B] for r in range(len(lanes) // F._B)]
    wr = F._row_weights(len(x) + 1).tolist()
    wc, wp = F._COL_W[: F._B].tolist(), F._COL_W[F._B :].tolist()
    d = sum((1 + 2 * wr[r]) * _wrap32(sum(row)) for r, row in enumerate(x))
    d += 2 * sum(wc[c] * _wrap32(sum(row[c] for row in x[:rows_in_place])) for c in range(F._B))
    d += 2 * sum(wp[c] * v for row in x[rows_in_place:] for c, v in enumerate(row))
    return d & F._M64


def _ref_fingerprint(tensors: list[torch.Tensor]) -> int:
    h = 0
    for i, t in enumerate(tensors):
        key = F._mix64(F._meta_hash(t.dtype, tuple(t.shape)) + i * F._GAMMA)
        h += F._mix64(key ^ _ref_digest(t))
    return F._to_signed(F._mix64((h & F._M64) ^ F._mix64(F._SEED + len(tensors))))


def test_weights_are_the_splitmix64_stream() -> None:
    for seed, w in ((F._ROW_SEED, F._row_weights(300)), (F._COL_SEED, F._COL_W)):
        expect = [F._to_signed(F._mix64(seed + (j + 1) * F._GAMMA)) for j in range(w.numel())]
        assert w.tolist() == expect


def test_matches_reference_formula() -> None:
    base = torch.randn(20000)
    tensors = [
        torch.randn(10000),  # in-place rows + ragged end
        torch.randn(128 * 16),  # exactly 16 rows
        torch.randn(3, 5).t(),  # non-contiguous
        base[::2],  # strided 1-D: reshape(-1) returns it as it is
        torch.randn(4, 5)[:, 1],  # a column
        torch.randint(0, 255, (9000,), dtype=torch.uint8)[::2],  # strided bytes, in-place rows
        torch.ones(1).expand(1000),  # stride 0
        base[1:9001],  # storage offset not 8-byte aligned
        base.to(torch.bfloat16)[1:9001],  # nor 4-byte aligned
        torch.tensor(2.5),  # 0-dim, 4 bytes
        torch.zeros(0),  # empty
        torch.randint(-(2**63), 2**63 - 1, (4097,), dtype=torch.int64),  # wraps mod 2**64
        torch.full((6000,), -1, dtype=torch.int64),
        torch.randn(777).to(torch.bfloat16),
        torch.rand(11) > 0.5,  # bool
        torch.randint(0, 255, (13,), dtype=torch.uint8),
        torch.randn(9, dtype=torch.complex64).conj(),  # lazy conj resolved
        torch.randn(5000, dtype=torch.float64),
    ]
    assert fingerprint(tensors) == _ref_fingerprint(tensors)
    for t in tensors:
        assert fingerprint([t]) == _ref_fingerprint([t])
    assert fingerprint([]) == _ref_fingerprint([])


def test_identical_state_identical_fingerprint_and_int64_range() -> None:
    tensors = [torch.randn(n) for n in (1, 100, 70000, 3_000_000)]  # the last large enough to split across threads
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        fp, dg = fingerprint(tensors), digest(tensors[-1])
        for n in (2, 4, 7):  # integer sums: no order dependence (the default here is 2: compare with 1)
            torch.set_num_threads(n)
            assert (fingerprint(tensors), digest(tensors[-1])) == (fp, dg), n
    finally:
        torch.set_num_threads(threads)
    assert fp == fingerprint([t.clone() for t in tensors])
    assert fp == fingerprint(iter(tensors))  # any iterable
    assert torch.tensor(fp, dtype=torch.int64).item() == fp
    assert -(2**63) <= fp < 2**63


@st.composite
def _flip_case(draw: st.DrawFn) -> tuple[torch.dtype, int, int, int, int, str]:
    dtype = draw(st.sampled_from(list(_BIT_CLASSES)))
    n = draw(st.sampled_from([1, 3, 64, 129, 4097, 20001]))
    index = draw(st.integers(0, n - 1))
    cls = draw(st.sampled_from(sorted(_BIT_CLASSES[dtype])))
    lo, hi = _BIT_CLASSES[dtype][cls]
    bit = draw(st.integers(lo, hi))
    seed = draw(st.integers(0, 2**31 - 1))
    return dtype, n, index, bit, seed, cls


@settings(max_examples=300, deadline=None)
@given(_flip_case(), st.integers(0, 2))
def test_single_bit_flip_always_changes(case: tuple, position: int) -> None:
    dtype, n, index, bit, seed, _cls = case
    tensors = [torch.randn(100), torch.randn(5000), torch.randn(3)]
    target = _random(n, dtype, seed)
    tensors.insert(position, target)
    before = fingerprint(tensors)
    flip_bit(target, index, bit)
    assert fingerprint(tensors) != before
    flip_bit(target, index, bit)
    assert fingerprint(tensors) == before


@pytest.mark.parametrize("dtype", list(_BIT_CLASSES))
def test_every_bit_of_an_element_and_0dim(dtype: torch.dtype) -> None:
    for t in (_random(37, dtype, 1), _random(1, dtype, 2).reshape(())):
        before = fingerprint([t])
        seen = {before}
        for bit in range(8 * t.element_size()):
            flip_bit(t, t.numel() - 1, bit)
            seen.add(fingerprint([t]))
            flip_bit(t, t.numel() - 1, bit)
        assert len(seen) == 8 * t.element_size() + 1
        assert fingerprint([t]) == before


def test_nan_payloads_and_signed_zero_are_bits() -> None:
    nan = torch.tensor([float("nan")] * 4)
    other = nan.clone()
    flip_bit(other, 2, 0)  # a different quiet-NaN payload: still NaN
    assert torch.isnan(other).all()
    assert fingerprint([nan]) != fingerprint([other])
    assert fingerprint([nan]) == fingerprint([nan.clone()])
    assert fingerprint([torch.tensor([0.0])]) != fingerprint([torch.tensor([-0.0])])


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from([torch.float32, torch.bfloat16, torch.float64, torch.int64]),
    st.sampled_from([2, 50, 1000, 9000]),
    st.data(),
)
def test_swap_of_two_elements_changes(dtype: torch.dtype, n: int, data: st.DataObject) -> None:
    t = _random(n, dtype, data.draw(st.integers(0, 2**31 - 1)))
    i = data.draw(st.integers(0, n - 1))
    j = data.draw(st.integers(0, n - 1).filter(lambda j: j != i))
    ints = t.view(_INT_VIEW[t.element_size()])
    if ints[i] == ints[j]:  # bitwise equal values: the swap is no change at all
        return
    before = fingerprint([t])
    t[i], t[j] = t[j].clone(), t[i].clone()
    assert fingerprint([t]) != before


@settings(max_examples=200, deadline=None)
@given(_flip_case(), st.integers(0, 3))
def test_digest_is_the_fingerprints_digest_and_sees_every_flip(case: tuple, offset: int) -> None:
    dtype, n, index, bit, seed, _cls = case
    base = _random(n + offset, dtype, seed)
    t = base[offset:]  # also views that do not start on an aligned boundary
    before = digest(t)
    assert before & F._M64 == _ref_digest(t) and -(2**63) <= before < 2**63
    flip_bit(t, index, bit)
    assert digest(t) != before


def test_the_fingerprints_per_tensor_digests_are_each_tensors_digest() -> None:
    # Batched across a state (big tensors in place with ragged ends packed, small ones
    # packed together, views, several dtypes), each digest is the tensor's own alone,
    # so the digests ranks exchange name the tensor two states differ in.
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(9000, generator=gen)
    state = [torch.randn(40, 128, generator=gen), base[3:4100], torch.randn(7, generator=gen),
             torch.arange(5, dtype=torch.int64), torch.randn(64, 3, generator=gen).t(), torch.zeros(()),
             torch.randn(1030, dtype=torch.float64, generator=gen), torch.empty(0)]
    fp, digests = fingerprint_and_digests(state)
    assert fp == fingerprint(state) and digests == [digest(t) for t in state]
    flip_bit(state[1], 4096, 30)  # its ragged end, packed with the small tensors
    _, after = fingerprint_and_digests(state)
    assert [i for i, (a, b) in enumerate(zip(digests, after)) if a != b] == [1]


def test_digest_sees_what_a_word_sum_misses() -> None:
    """Two flips of one bit cancel in a plain sum of words (the first checksum): the
    sign bits of two float64s, or of two odd-indexed float32s, change a 64-bit word
    by 2**63 each. Ranks whose aggregated gradients were hit at different elements
    by the same bit also had equal word sums, so the wrong rank was blamed."""
    for a in (torch.randn(5000), torch.randn(5000, dtype=torch.float64), torch.randn(7)):
        b = a.clone()
        b[[1, 3]] = -b[[1, 3]]
        assert digest(a) != digest(b) and fingerprint([a]) != fingerprint([b])
        c, e = a.clone(), a.clone()  # the same flip, at two different elements
        flip_bit(c, 1, 30 if a.dtype == torch.float32 else 62)
        flip_bit(e, 5, 30 if a.dtype == torch.float32 else 62)
        assert digest(c) != digest(e)
    # Row and column sums that wrap in 32 bits (in place and packed), as documented.
    for wrap in (torch.full((8 * 128,), 2**31 - 1, dtype=torch.int32), torch.tensor([2**31 - 1, 1], dtype=torch.int32)):
        assert digest(wrap) & F._M64 == _ref_digest(wrap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows", [F._BIG_ROWS, F._BIG_ROWS + 1, 64])
def test_the_same_bit_flipped_in_every_element_changes(dtype: torch.dtype, rows: int) -> None:
    """Every sign bit flipped (``bitflip:bits=sign,fraction=1``, ``scale:factor=-1,fraction=1``:
    the tensor negated), or another high bit in every element: a row of 128 lanes holds
    an even count of each, so its 32-bit row sum wrapped back to what it was, and so did
    every column sum of a tensor of an even number of rows -- the digest and fingerprint
    of ``-x`` were those of ``x`` for most weight matrices. Values of one sign, or all
    alike (Adam's ``exp_avg_sq``, zeros), also move every column sum alike."""
    n = rows * F._ROW_BYTES // dtype.itemsize
    width = 8 * dtype.itemsize
    for x in (_random(n, dtype, rows), _random(n, dtype, rows).abs() + 1, torch.zeros(n, dtype=dtype)):
        for bit in (width - 1, width - 2, width - 7):
            y = x.clone()
            y.view(_INT_VIEW[dtype.itemsize]).bitwise_xor_(-(1 << bit) if bit == width - 1 else 1 << bit)
            assert digest(y) != digest(x) and fingerprint([y]) != fingerprint([x]), bit
        assert digest(-x) != digest(x) and fingerprint([-x]) != fingerprint([x])


def test_every_bit_of_a_non_contiguous_bool_tensor_is_read() -> None:
    """A bool's byte is read as it is in memory: a copy of a non-contiguous bool tensor
    (transposed, strided, channels_last) wrote every non-zero byte as 1, so a flip of
    bits 1-7 of a True element went unseen there, and was seen in a contiguous one."""
    base = torch.arange(4 * 3 * 50) % 3 == 0
    for view in (lambda b: b.view(40, 15).t(), lambda b: b[::2],
                 lambda b: b.view(2, 3, 10, 10).contiguous(memory_format=torch.channels_last)):
        t = view(base.clone())
        before, idx = fingerprint([t]), t.nonzero()[0].tolist()  # a True element
        for bit in range(8):
            t.view(torch.uint8)[tuple(idx)] ^= 1 << bit
            assert fingerprint([t]) != before and digest(t) != digest(view(base.clone())), bit
            t.view(torch.uint8)[tuple(idx)] ^= 1 << bit


def test_a_one_element_view_with_any_stride_is_read_as_its_value() -> None:
    """torch calls a one-element tensor contiguous whatever its stride, and view() then
    refused its bytes: fingerprint and digest raised TypeError on ``x[::5]`` of a
    5-element ``x``, a one-element expand, or the imaginary part of a one-element
    complex tensor."""
    for odd in (torch.randn(5)[::5], torch.tensor(5.0).expand(1), torch.randn(4, 4)[::4, ::4],
                torch.randn(1, dtype=torch.complex64).conj().imag):
        same = odd.clone(memory_format=torch.contiguous_format)
        assert fingerprint([odd]) == fingerprint([same]) and digest(odd) == digest(same)


def test_a_lazily_negated_tensor_is_read_as_its_value() -> None:
    lazy = torch.tensor(1 + 2j, dtype=torch.complex64).conj().imag  # -2.0: a negative bit on a view
    assert lazy.is_neg() and fingerprint([lazy]) == fingerprint([torch.tensor(-2.0)])


def test_the_layout_checked_every_step_stays_cached_among_many_others() -> None:
    """Plans and keys are evicted least recently used first: the state's layout, checked
    between layouts never seen before (gradient buckets, other states), is never rebuilt. Evicted
    first in, first out, it was rebuilt once per ``_MAX_PLANS`` new layouts."""
    state = [torch.randn(3000), torch.zeros(7)]
    caches = (F._plan_for, F._keys)
    for cache in caches:
        cache.cache_clear()
    fingerprint(state)
    for n in range(F._MAX_PLANS + 10):
        fingerprint([torch.zeros(1000 + n)])  # a layout not seen before
        fingerprint(state)
    # Built once for the state, once for each new layout; the state's found every time after.
    assert [(c.cache_info().misses, c.cache_info().hits) for c in caches] == [(1 + F._MAX_PLANS + 10,
                                                                                F._MAX_PLANS + 10)] * 2


def test_order_dtype_and_shape_are_part_of_the_fingerprint() -> None:
    a, b = torch.randn(8), torch.randn(8)
    assert fingerprint([a, b]) != fingerprint([b, a])
    assert fingerprint([a]) != fingerprint([a.view(torch.int32)])  # same bytes
    assert fingerprint([a]) != fingerprint([a.view(2, 4)])
    assert fingerprint([a.view(2, 4)]) != fingerprint([a.view(4, 2)])
    assert fingerprint([a]) != fingerprint([a, torch.zeros(0)])
    assert fingerprint([torch.tensor(1.0)]) != fingerprint([torch.tensor([1.0])])


def test_bad_input_is_rejected() -> None:
    with pytest.raises(TypeError, match="item 1"):
        fingerprint([torch.zeros(2), [1.0, 2.0]])  # type: ignore[list-item]
    with pytest.raises(TypeError, match="layout"):
        fingerprint([torch.eye(3).to_sparse()])
    with pytest.raises(ValueError, match="tensor 1 is on the meta device"):
        fingerprint([torch.zeros(2), torch.zeros(2, device="meta")])
    with warnings.catch_warnings():  # torch deprecates making quantized tensors; users may still have them
        warnings.simplefilter("ignore", UserWarning)
        quantized = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    with pytest.raises(TypeError, match="tensor 0 is quantized"):  # it used to crash the process
        fingerprint([quantized])
    with pytest.raises(TypeError, match=r"pass a list of tensors, e.g. fingerprint\(\[t\]\)"):
        fingerprint(torch.zeros(3))


def test_docstring_example_runs() -> None:
    result = doctest.testmod(F)
    assert result.attempted >= 3 and result.failed == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_under_deterministic_algorithms() -> None:
    tensors = [torch.randn(70_001), torch.randn(3, 5).t(), torch.tensor(7, dtype=torch.int64)]
    tensors.append(torch.randn(9000).to(torch.bfloat16))
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert fingerprint([t.cuda() for t in tensors]) == fingerprint(tensors)
        # Mixed devices, as Adam keeps them (``step`` on the CPU beside CUDA weights).
        assert fingerprint([t.cuda() if i % 2 else t for i, t in enumerate(tensors)]) == fingerprint(tensors)
    finally:
        torch.use_deterministic_algorithms(was)


def test_speed_budget() -> None:
    """3M float32 in 50 tensors on one thread: a few ms (bound generous for busy CI)."""
    tensors = [torch.randn(60_000) for _ in range(50)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        fingerprint(tensors)
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            fingerprint(tensors)
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    assert min(times) < 0.05, f"fingerprint of 3M floats took {min(times) * 1e3:.1f} ms"


# ---------------------------------------------------------------------------
# Carrying through float64, settings digests
# ---------------------------------------------------------------------------


@settings(max_examples=500, deadline=None)
@given(st.integers(-(2**63), 2**63 - 1))
def test_split_join_round_trip(fp: int) -> None:
    hi, lo = split_int64(fp)
    assert join_int64(hi, lo) == fp
    for half in (hi, lo):
        assert 0 <= half < 2**32 and half == math.floor(half)
    # Through a float64 tensor, as the control collective carries it.
    vec = torch.tensor([0.5, hi, lo, -3.0], dtype=torch.float64)
    assert join_int64(vec[1].item(), vec[2].item()) == fp


@pytest.mark.parametrize("fp", [0, 1, -1, 2**63 - 1, -(2**63), 2**32, 2**32 - 1, -(2**32)])
def test_split_join_extremes(fp: int) -> None:
    assert join_int64(*split_int64(fp)) == fp


def test_split_join_reject_bad_values() -> None:
    with pytest.raises(ValueError, match="fp"):
        split_int64(2**63)
    with pytest.raises(ValueError, match="fp"):
        split_int64(-(2**63) - 1)
    with pytest.raises(TypeError, match="fp"):
        split_int64(True)
    with pytest.raises(TypeError, match="fp"):
        split_int64(1.0)  # type: ignore[arg-type]
    for hi, lo, name in ((2.0**32, 0.0, "hi"), (0.0, 0.5, "lo"), (-1.0, 0.0, "hi"),
                         (0.0, float("nan"), "lo"), (float("inf"), 0.0, "hi")):
        with pytest.raises(ValueError, match=name):
            join_int64(hi, lo)


def test_repr_digest_is_the_same_in_another_process() -> None:
    # hash() of a str is salted per process; the digest ranks compare must not be.
    value = (("optim/0/exp_avg", "torch.float32", (4, 3)), {"lr": 0.1})
    code = f"from paft.fingerprint import repr_digest; print(repr_digest({value!r}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": "random"})
    assert int(out.stdout) == repr_digest(value)
    assert repr_digest(value) != repr_digest((value[0], {"lr": 0.2}))


def test_repr_digest_is_a_signed_int64_of_the_repr() -> None:
    assert all(-(2**63) <= repr_digest(v) < 2**63 for v in range(16))  # as the ranks exchange it, an int64
    assert repr_digest(1) != repr_digest("1")  # alike by str(), not by repr()
