"""The CountSketch against the documented sketch, coordinate by coordinate, and the
sketched cosine against the exact one."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from paft.consistency import pairwise_cosine
from paft.norms import total_norm
from paft.sketch import CountSketch
from paft.workloads import build_workload


def sketch_of(flat: torch.Tensor, sketcher: CountSketch, bucket: int = 0,
              shapes: list[torch.Size] | None = None) -> torch.Tensor:
    out = torch.zeros(sketcher.dim, dtype=torch.float64)
    sketcher.add_(out, bucket, flat, (lambda: shapes) if shapes else None)
    return out


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(pairwise_cosine(torch.stack([a.double(), b.double()]))[0][0, 1])


def test_a_rebuilt_bucket_layout_replaces_its_signs() -> None:
    # DDP's first backward pass all-reduces one bucket of the whole model, then rebuilds
    # smaller ones: the first layout's signs were kept beside the new ones (twice the
    # gradient's size). A layout seen again draws the same signs.
    sketcher = CountSketch(8)
    first = sketcher.signs(0, torch.zeros(1000)).clone()
    sketcher.signs(0, torch.zeros(400))
    sketcher.signs(1, torch.zeros(600))
    assert sum(signs.numel() for _, signs in sketcher._signs.values()) == 1000
    assert torch.equal(sketcher.signs(0, torch.zeros(1000)), first)


def test_a_16_bit_buckets_signs_are_16_bit_and_sketch_as_float32_ones_did() -> None:
    # Stored in the widened dtype, a bfloat16 gradient's signs took twice its size.
    flat = torch.randn(5000, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    sketcher = CountSketch(64)
    out = torch.zeros(64, dtype=torch.float64)
    sq = sketcher.add_(out, 0, flat)
    ((_, _, dtype), signs) = sketcher._signs[0]
    assert dtype == signs.dtype == torch.bfloat16
    signs32 = signs.float()
    by_hand = torch.zeros(64, dtype=torch.float64)
    reference = CountSketch(64)
    reference._signs[0] = ((flat.numel(), flat.device, torch.float32), signs32)
    assert torch.equal(reference.add_(by_hand, 0, flat.float()), sq) and torch.equal(by_hand, out)


@pytest.mark.parametrize("target", [0.0, 0.5, 0.9, 0.99])
def test_sketch_cosine_error_is_within_the_documented_bound(target: float) -> None:
    """Documented: standard error of the sketched cosine ~ (1 - cos^2) / sqrt(k)."""
    k, n = 256, 50_000
    sketcher = CountSketch(k)
    gen = torch.Generator().manual_seed(1)
    errors = []
    for _ in range(40):
        a = torch.randn(n, generator=gen)
        b = target * a + math.sqrt(1 - target**2) * torch.randn(n, generator=gen)
        errors.append(cos(sketch_of(a, sketcher), sketch_of(b, sketcher)) - cos(a, b))
    se = (1 - target**2) / math.sqrt(k)
    errs = torch.tensor(errors)
    assert errs.abs().max() <= 4 * se + 1e-3
    assert errs.abs().mean() <= 1.5 * se + 1e-4
    assert abs(float(errs.mean())) <= 3 * se / math.sqrt(len(errors)) + 1e-3  # no bias to speak of


def test_sketch_cosine_is_unbiased_for_vectors_with_a_shared_mean() -> None:
    # a = 1 + x, b = 1 + y: cos(a, b) = 0.5. Without random signs each slot sums ~195
    # values around 1 and the sketched cosine reads ~0.99; the zero-mean cases above
    # could not tell a signed sketch from an unsigned one.
    k, n = 256, 50_000
    sketcher = CountSketch(k)
    gen = torch.Generator().manual_seed(2)
    errors = []
    for _ in range(20):
        a, b = 1 + torch.randn(n, generator=gen), 1 + torch.randn(n, generator=gen)
        errors.append(cos(sketch_of(a, sketcher), sketch_of(b, sketcher)) - cos(a, b))
    se = (1 - 0.5**2) / math.sqrt(k)
    assert max(abs(e) for e in errors) <= 4 * se and abs(sum(errors) / len(errors)) <= 3 * se / math.sqrt(20) + 1e-3


def real_gradient(seed: int) -> torch.Tensor:
    wl = build_workload("gpt", seed=0, model_args={"n_layer": 1, "n_embd": 32, "n_head": 2, "block_size": 32})
    idx = torch.randperm(len(wl.train), generator=torch.Generator().manual_seed(seed))[:8]
    wl.loss(wl.model, *wl.train.get(idx)).backward()
    return torch.cat([p.grad.flatten() for p in wl.model.parameters()])


def test_sketch_cosine_on_real_gradients() -> None:
    grads = [real_gradient(s) for s in range(4)]
    sketcher = CountSketch(256)
    exact = pairwise_cosine(torch.stack(grads).double())[0]
    approx = pairwise_cosine(torch.stack([sketch_of(g, sketcher) for g in grads]))[0]
    err = np.abs(exact - approx)
    bound = 4 * (1 - exact**2) / math.sqrt(256) + 1e-3
    assert bool((err <= bound).all()), (exact, approx)


@pytest.mark.parametrize("width", [768, 771])
def test_sketch_cosine_on_structured_gradients(width: int) -> None:
    """A weight matrix whose rows are a multiple of k long (768 = 3 x 256) and one
    outlier input feature: with slot ``i mod k`` its whole column fell into one slot
    and the sketched cosine was off by up to 17 standard errors, its sign flipped. The
    same with rows a multiple of the prime stride (771 = 3 x 257): 10-16 errors, until
    the stride was chosen to divide no row length of the bucket's parameters."""
    k = 256
    sketcher = CountSketch(k)
    torch.manual_seed(0)
    lin, head = nn.Linear(width, 512, bias=False), torch.randn(512, 10)
    assert sketcher.stride(0, 512 * width, lambda: [lin.weight.shape]) == (257 if width == 768 else 263)

    def grad(seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(16, width, generator=gen)
        x[:, 5] *= 30.0  # one outlier feature, as in transformer hidden states
        lin.weight.grad = None
        F.cross_entropy(lin(x) @ head, torch.randint(0, 10, (16,), generator=gen)).backward()
        return lin.weight.grad.flatten().clone()

    for trial in range(10):
        a, b = grad(2 * trial), grad(2 * trial + 1)
        exact = cos(a, b)
        shapes = [lin.weight.shape]
        sketched = cos(sketch_of(a, sketcher, shapes=shapes), sketch_of(b, sketcher, shapes=shapes))
        assert abs(sketched - exact) <= 4 * (1 - exact**2) / math.sqrt(k)


def test_sketch_is_linear_and_rank_independent() -> None:
    """Same signs on every rank (depends only on seed/bucket/length): S(a + b) = S(a) + S(b)."""
    a, b = torch.randn(1000, dtype=torch.float64), torch.randn(1000, dtype=torch.float64)
    s1, s2 = CountSketch(64), CountSketch(64)
    assert torch.allclose(sketch_of(a + b, s1), sketch_of(a, s2) + sketch_of(b, s2), rtol=0, atol=1e-12)
    assert not torch.equal(sketch_of(a, s1, bucket=0), sketch_of(a, s1, bucket=1))


def reference_sketch(flat: torch.Tensor, sketcher: CountSketch, bucket: int, p: int) -> torch.Tensor:
    """The sketch as documented, one coordinate at a time: coordinate i times its sign
    into slot ``i mod p``, a slot j past ``dim`` onto ``j mod dim``."""
    out = torch.zeros(sketcher.dim, dtype=torch.float64)
    for i, v in enumerate((flat.double() * sketcher.signs(bucket, flat.double())).tolist()):
        out[i % p % sketcher.dim] += v
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sketch_is_the_documented_count_sketch(dtype: torch.dtype) -> None:
    """Coordinate by coordinate, bit for bit (integer values: every order sums them
    exactly, a half-precision gradient's too once widened to float32, not in its own
    dtype): whole rows of p, the tail past them (alone below p), the slots past dim
    folded. Dropping the tail or the fold had kept every statistical test passing. One
    sketcher for every length, as a re-bucketed model has: the signs are cached per
    length. A stride past 2 * dim (k = 8 with rows of 11 and 13 in one bucket: p = 17)
    wraps the slots twice; the fold raised a shape error in the hook."""
    sketcher = CountSketch(8)
    gen = torch.Generator().manual_seed(4)
    for n, shapes, p in [(5, None, 11), (11, None, 11), (12, None, 11), (37, None, 11), (1000, None, 11),
                         (38, [torch.Size([3, 11]), torch.Size([5])], 13),
                         (60, [torch.Size([2, 11]), torch.Size([2, 13]), torch.Size([12])], 17)]:
        for bucket in (0, 1):
            flat = torch.randint(-120, 121, (n,), generator=gen).to(dtype)  # exact in bfloat16
            out = torch.zeros(8, dtype=torch.float64)
            sq = sketcher.add_(out, bucket, flat, (lambda s=shapes: s) if shapes else None)
            assert sketcher.stride(bucket, n) == p
            assert torch.equal(out, reference_sketch(flat, sketcher, bucket, p)), (n, bucket)
            assert float(sq) == float(flat.double().square().sum())


def test_sketch_stride_is_the_least_prime_from_dim_that_divides_no_trailing_size() -> None:
    """p >= dim prime (25 and 27 are not); past every product of a parameter's trailing
    dimensions, however many it must step over, but not a parameter's own size (a 1-D
    parameter's elements are consecutive: its own slots); chosen once per bucket layout."""
    sketcher = CountSketch(8)
    assert sketcher.stride(0, 100) == 11 and CountSketch(24).stride(0, 100) == 29
    assert sketcher.stride(1, 57, lambda: [torch.Size([4, 11]), torch.Size([13])]) == 13
    assert sketcher.stride(2, 104, lambda: [torch.Size([2, 11]), torch.Size([2, 2, 13])]) == 17
    asked: list[int] = []

    def shapes() -> list[torch.Size]:
        asked.append(1)
        return [torch.Size([2, 11])]

    assert sketcher.stride(3, 22, shapes) == sketcher.stride(3, 22, shapes) == 13 and len(asked) == 1
    assert sketcher.stride(3, 10, lambda: [torch.Size([10])]) == 11  # re-bucketed: another layout
    # A parameter with a zero-size dimension (nn.Linear(0, 3): weight [3, 0]) has a trailing
    # product of 0, which every p divides: skipped, not stepped past forever.
    assert sketcher.stride(4, 11, lambda: [torch.Size([3, 0]), torch.Size([11])]) == 11


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sketch_returns_the_exact_squared_norm(dtype: torch.dtype) -> None:
    """The norm comes off the signed copy: bitwise the dot of the gradient with itself."""
    flat = torch.randn(1000, generator=torch.Generator().manual_seed(3)).to(dtype)
    sq = CountSketch(64).add_(torch.zeros(64, dtype=torch.float64), 0, flat)
    wide = flat.float()
    assert float(sq) == float(torch.dot(wide, wide))
    flat[17] = 3e19 if dtype == torch.float32 else 1e30  # finite, but its square overflows the dtype
    assert float(CountSketch(64).add_(torch.zeros(64, dtype=torch.float64), 0, flat)) == pytest.approx(
        float(torch.dot(flat.double(), flat.double())), rel=1e-6)
    assert float(total_norm([flat])) == pytest.approx(float(flat.double().norm()), rel=1e-6)
    flat[17] = float("inf")
    assert not math.isfinite(CountSketch(64).add_(torch.zeros(64, dtype=torch.float64), 0, flat))
    assert not math.isfinite(total_norm([flat]))


def test_a_finite_gradient_whose_slot_sum_overflows_float32_sketches_finite() -> None:
    """Forty entries near float32's max (a flipped exponent bit) in one slot: their sum
    overflowed float32, the sketch read inf, and the rank's cosines NaN while its gradient
    and norm were finite. The slot is summed again in float64 there. With both signs
    apart in the slot (the first 20 rows huge and positive, the last 20 negative), the
    partial sums overflow either way and meet as NaN, not inf."""
    sketcher = CountSketch(8)
    p = sketcher.stride(0, 1000)
    rows = 1000 // p
    one_sign = torch.arange(40) * p
    both_signs = torch.cat([torch.arange(20), torch.arange(rows - 20, rows)]) * p + 1
    for at, values in ((one_sign, [3e38] * 40), (both_signs, [2e38] + [3e38] * 19 + [-3e38] * 20)):
        flat = torch.randn(1000, generator=torch.Generator().manual_seed(5)) * 1e-3
        flat[at] = torch.tensor(values) * sketcher.signs(0, flat)[at]  # these values once signed
        out = torch.zeros(8, dtype=torch.float64)
        sketcher.add_(out, 0, flat)
        assert torch.isfinite(out).all()
        assert torch.allclose(out, reference_sketch(flat.double(), sketcher, 0, p), rtol=1e-6)
