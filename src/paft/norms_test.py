"""Norms stay finite on finite values and otherwise are torch's own, bit for bit (single process)."""

from __future__ import annotations

import math

import pytest
import torch

from paft import norms
from paft.norms import judged_norm, norm_of, squared_norm, squared_norm_as_float, total_norm, wide_dtype, widened

HUGE = torch.full((4,), 1e20)  # a flipped exponent bit: finite, but its square overflows float32


@pytest.mark.parametrize(("dtype", "wide"), [
    (torch.float16, torch.float32), (torch.bfloat16, torch.float32),
    (torch.float32, torch.float32), (torch.float64, torch.float64),
])
def test_only_16_bit_floats_are_widened(dtype: torch.dtype, wide: torch.dtype) -> None:
    x = torch.arange(5, dtype=dtype)
    assert wide_dtype(dtype) == wide and widened(x).dtype == wide
    assert torch.equal(widened(x), x.to(wide))
    assert (widened(x) is x) == (dtype == wide)  # no copy when it already is


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_squared_norm_is_one_dot_in_the_wide_dtype(dtype: torch.dtype) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0)).to(dtype) * 300  # float16's squares overflow
    wide = x.to(wide_dtype(dtype))
    assert torch.equal(squared_norm(x), torch.dot(wide, wide))


def test_squared_norm_is_redone_in_float64_only_where_float32_overflowed() -> None:
    assert squared_norm(HUGE).item() == float(HUGE.double().norm()) ** 2
    assert math.isinf(squared_norm(torch.tensor([1.0, math.inf])))
    assert math.isnan(squared_norm(torch.tensor([1.0, math.nan])))


def test_sq_norm_accumulates_in_float64_and_is_inf_past_its_range() -> None:
    assert squared_norm_as_float(HUGE) == float(torch.linalg.vector_norm(HUGE, dtype=torch.float64).square())
    assert squared_norm_as_float(torch.tensor([3.0, 4.0])) == 25.0
    assert squared_norm_as_float(torch.full((2,), 1e200, dtype=torch.float64)) == math.inf  # a Python ** 2 raises there


def test_total_norm_is_torchs_unless_squares_overflowed() -> None:
    g = torch.Generator().manual_seed(1)
    tensors = [torch.randn(300, generator=g), torch.randn(7, generator=g).double(), torch.randn(5, generator=g).half()]
    assert torch.equal(total_norm(tensors), torch.nn.utils.get_total_norm(tensors))
    # Overflowed squares: the float64 norm of every tensor, in the norm's own dtype.
    both = [HUGE, 0.75 * HUGE]
    assert total_norm(both).dtype == torch.float32
    assert torch.equal(total_norm(both), torch.tensor(2.5e20))
    mixed = [HUGE, torch.full((1,), 1.5e20, dtype=torch.float64)]  # float64 alongside: still redone
    assert total_norm(mixed).dtype == torch.float64
    assert float(total_norm(mixed)) == pytest.approx(math.hypot(*[float(v) for t in mixed for v in t]), rel=1e-12)
    assert math.isnan(total_norm([HUGE, torch.tensor([math.nan])]))


def test_judged_norm_reads_a_norm_past_its_dtype_as_the_float64_one() -> None:
    big = [torch.full((100,), 10000.0, dtype=torch.float16)]  # norm 1e5 > float16's 65504
    norm = total_norm(big)
    assert math.isinf(norm)  # as clipping keeps it
    assert judged_norm(norm, big) == 1e5 == norm_of(big)
    small = [torch.full((3,), 0.1)]
    assert judged_norm(total_norm(small), small) == float(total_norm(small)) == norm_of(small)  # float32's rounding
    assert norm_of([]) == 0.0



@pytest.mark.parametrize("value", [1e160, 1e200, 1e300])
def test_float64_values_past_the_range_of_their_squares_are_judged_finite(value: float) -> None:
    # A flipped float64 exponent bit makes entries this large; their squares overflow
    # float64, and the norm read as inf called a finite gradient or update non-finite.
    x = [torch.full((2,), value, dtype=torch.float64), torch.tensor([0.5 * value], dtype=torch.float64)]
    assert math.isinf(torch.nn.utils.get_total_norm(x))  # torch's own
    assert norm_of(x) == pytest.approx(1.5 * value, rel=1e-15)  # sqrt(1 + 1 + 0.25)
    assert float(total_norm(x)) == pytest.approx(1.5 * value, rel=1e-15)  # what clipping scales by
    assert math.isinf(norm_of([*x, torch.tensor([math.inf], dtype=torch.float64)]))
    assert math.isnan(norm_of([*x, torch.tensor([math.nan], dtype=torch.float64)]))


def test_a_float64_norm_past_float64s_range_is_inf() -> None:
    x = [torch.full((4,), 1e308, dtype=torch.float64)]  # norm 2e308
    assert math.isinf(norm_of(x)) and math.isinf(total_norm(x))


def test_an_empty_or_zero_tensor_beside_overflowed_squares_counts_nothing() -> None:
    # A parameter of no elements (its gradient too): torch's inf norm, the scaling's
    # peak, has no value for it and raised a RuntimeError out of total_norm.
    x = [torch.empty(0), HUGE, torch.empty(0, 3, dtype=torch.float64), torch.zeros(2)]  # zeros: no 0/0 either
    twice = 2 * float(HUGE[0])  # float32's 1e20, four of them
    assert torch.equal(total_norm(x), torch.tensor(twice, dtype=torch.float64))
    assert judged_norm(torch.tensor(math.inf), x) == norm_of(x) == twice


@pytest.mark.parametrize("entry", [math.inf, -math.inf])
def test_an_infinite_entry_is_inf_without_the_scaled_pass(entry: float, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every loss-scaler overflow holds inf: the scaled float64 pass (a copy and a host
    # read per tensor) ran twice there, 140 ms for 200 gradients, to find inf again.
    def scaled(tensors: object) -> torch.Tensor:
        raise AssertionError("the scaled pass ran")

    tensors = [torch.ones(3), torch.tensor([1.0, entry]), torch.zeros(0), torch.ones(2, dtype=torch.complex64)]
    monkeypatch.setattr(norms, "_scaled_norm", scaled)
    norm = total_norm(tensors)
    assert math.isinf(norm) and judged_norm(norm, tensors) == math.inf and norm_of(tensors) == math.inf
    with pytest.raises(AssertionError, match="the scaled pass ran"):  # finite entries that overflow still take it
        norm_of([torch.full((2,), 3e38)])
    assert norm_of([torch.tensor([1 + 1j, complex(entry, 0)], dtype=torch.complex64)]) == math.inf  # aminmax: real only


def test_a_complex_tensor_past_its_squares_range_keeps_its_imaginary_parts() -> None:
    # A complex parameter's gradient entry of 3e20 + 4e20j (a flipped exponent bit): the
    # float64 pass cast it to its real part, a norm of 3e20 (clipping scaled by that), and
    # an entry of 1e20j counted as 0. A lazy conjugate is read as its values too.
    z = torch.tensor([3e20 + 4e20j, 0j], dtype=torch.complex64)
    for t in (z, z.conj()):
        assert float(total_norm([t])) == pytest.approx(5e20, rel=1e-6)
        assert norm_of([t, torch.tensor([1e20j])]) == pytest.approx(math.hypot(5e20, 1e20), rel=1e-6)
