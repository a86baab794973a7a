"""Tests for paft.divergence: the finiteness judgement (pure), and distances between
replicas measured across real gloo ranks."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from paft.divergence import all_finite, measure_divergence, nonfinite_patterns, rel_distance, sound_replicas
from paft.testing import run_workers

nan, inf = math.nan, math.inf


@pytest.mark.parametrize("sq, ref_sq, rel", [
    (1.0, 4.0, 0.5),
    (0.0, 0.0, 0.0),  # nothing to measure, and no distance
    (1.0, 0.0, inf),
    (nan, 1.0, inf),
    (1.0, inf, inf),
])
def test_rel_distance(sq: float, ref_sq: float, rel: float) -> None:
    assert rel_distance(sq, ref_sq) == rel


def test_huge_finite_values_of_every_float_dtype_are_finite():
    # The extremes were compared in float32: a finite float64 1e300 (a flipped float64
    # exponent bit) read as inf, which made its replica "non-finite" in every mode.
    huge = [torch.tensor([1e300, -1e300], dtype=torch.float64), torch.tensor([65504.0], dtype=torch.float16),
            torch.tensor([3e38], dtype=torch.bfloat16), torch.tensor([-3.4e38])]
    assert all_finite(huge)
    for dtype in (torch.float64, torch.float16, torch.bfloat16, torch.float32):
        for bad in (math.inf, -math.inf, math.nan):
            assert not all_finite([*huge, torch.tensor([0.0, bad], dtype=dtype)]), (dtype, bad)
    assert all_finite([torch.tensor([2**62]), torch.zeros(0)])  # integers and empty tensors are not read


def test_nonfinite_patterns_tell_the_kind_and_the_place() -> None:
    assert nonfinite_patterns([torch.ones(2), torch.zeros(3)]) == [0, 0, 0, 0]
    out = nonfinite_patterns([torch.ones(2), *(torch.tensor(t) for t in ([nan, 1.0], [1.0, nan], [inf, 1.0],
                                                                        [-inf, 1.0]))])
    assert out[0::2] == [0, 1, 1, 1, 1] and out[1] == 0
    assert len(set(out[3::2])) == 4  # NaN here or there, +inf, -inf: four patterns
    assert nonfinite_patterns([torch.tensor([nan, 1.0, -inf, inf])])[0] == 3  # a count, not a yes/no
    # The count decides the fewest rule: two ranks, no majority, a mask's -inf on both
    # and one more on rank 1; rank 0's pattern is the shared state.
    rows = [nonfinite_patterns([torch.tensor(t)]) for t in ([-inf, 1.0, 2.0], [-inf, -inf, 2.0])]
    assert sound_replicas(rows, [True]) == [[True], [False]]


@pytest.mark.parametrize("rows, lenient, sound", [
    # parameters: NaN/Inf even on every rank alike is corruption
    ([[1, 7], [1, 7], [1, 7]], [False], [[False]] * 3),
    # buffers: a strict majority's pattern is state
    ([[1, 7], [1, 7], [2, 9]], [True], [[True], [True], [False]]),
    # no majority: the fewest NaN/Inf, if one pattern holds the fewest
    ([[1, 7], [1, 7], [2, 9], [2, 9]], [True], [[True], [True], [False], [False]]),
    ([[1, 7], [1, 8]], [True], [[False], [False]]),
    # per tensor: rank 2's parameter is not sound, its buffer (like everyone's) is
    ([[0, 0, 1, 7], [0, 0, 1, 7], [1, 5, 1, 7]], [False, True], [[True, True], [True, True], [False, True]]),
])
def test_sound_replicas(rows: list[list[int]], lenient: list[bool], sound: list[list[bool]]) -> None:
    assert sound_replicas(rows, lenient) == sound


def _w_float64(rank: int, ws: int) -> dict:
    torch.manual_seed(0)
    model = nn.Linear(7, 5).double()
    with torch.no_grad():
        model.weight.fill_(0.1)  # 0.1 + 0.1 + 0.1 rounds: (3 * 0.1) / 3 != 0.1 in float64
    same = measure_divergence(model, per_tensor=True)
    with torch.no_grad():
        if rank == 1:
            model.bias[0] += 1.0
    moved = measure_divergence(model, per_tensor=True)
    with torch.no_grad():
        model.bias.fill_(0.2)
        if rank == ws - 1:
            model.weight[0, 0] = math.nan  # left out of the mean: the others are still alike
    nan_rank = measure_divergence(model)
    return {"same": same, "moved": moved, "nan_rank": nan_rank}


def test_identical_float64_replicas_are_at_distance_zero() -> None:
    """Three bitwise identical float64 replicas measured ~1e-16 from their rounded mean,
    and the monitor listed tensors that did not move among those that moved most."""
    res = run_workers(_w_float64, 3)
    for r in res:
        same = r["same"]
        assert same.per_rank == [0.0] * 3 and same.state_per_rank == [0.0] * 3
        assert all(rel == 0.0 for _, rel, _ in same.per_tensor)
        moved = r["moved"]
        assert moved.per_rank[1] > 0 and moved.per_tensor[0][0] == "param/bias"
        assert dict((n, rel) for n, rel, _ in moved.per_tensor)["param/weight"] == 0.0
        assert r["nan_rank"].per_rank[:2] == [0.0, 0.0] and math.isinf(r["nan_rank"].per_rank[2])


def test_identical_float64_replicas_beside_a_nan_one_are_at_distance_zero() -> None:
    """Four ranks, the last with a NaN: the three voters' mean of 0.1 rounds away from
    0.1 (with three ranks the two voters' mean is exact), so only their digests, compared
    among the voters alone, keep them at 0."""
    for r in run_workers(_w_float64, 4):
        nan_rank = r["nan_rank"]
        assert nan_rank.per_rank[:3] == [0.0] * 3 and math.isinf(nan_rank.per_rank[3])
        assert nan_rank.finite == [True, True, True, False]


def _w_by_hand(rank: int, ws: int) -> dict:
    # float32 (no bitwise shortcut): weight (3, 4), (3, 4), (3, 7), mean (3, 5); a buffer
    # (-inf, 1), (-inf, 1), (-inf, 4), mean (-inf, 2), whose -inf (a mask's) they share.
    model = nn.Linear(2, 1, bias=False)
    model.register_buffer("mask", torch.tensor([-inf, 4.0 if rank == 2 else 1.0]))
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[3.0, 7.0 if rank == 2 else 4.0]]))
    plain = measure_divergence(model, per_tensor=True)
    no_buffers = measure_divergence(model, buffers=False)
    one_per_bucket = measure_divergence(model, per_tensor=True, bucket_mb=1e-6)  # a cap of 1 element
    # optimizer state: a momentum (0, 1), (0, 1), (0, 4), mean (0, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.state[model.weight]["momentum_buffer"] = torch.tensor([[0.0, 4.0 if rank == 2 else 1.0]])
    optim = measure_divergence(model, opt)
    opt.state[model.weight]["momentum_buffer"][0, 0] = -inf  # on every rank alike: still corruption
    optim_inf = measure_divergence(model, opt)
    if rank == 2:
        model.mask[1] = nan  # NaN of its own in a buffer: out of the buffer's mean, not the weight's
    return {"plain": plain, "no_buffers": no_buffers, "one_per_bucket": one_per_bucket, "optim": optim,
            "optim_inf": optim_inf, "nan_buffer": measure_divergence(model)}


def test_distances_by_hand() -> None:
    """Weight distances 1, 1, 2 over a mean of norm sqrt(34); the buffer's 1, 1, 2 over
    sqrt(4), the shared -inf agreement; the state both (1 + 1 = 2 ...) over sqrt(38)."""
    sqrt = math.sqrt
    for r in run_workers(_w_by_hand, 3):
        plain = r["plain"]
        assert plain.per_rank == [sqrt(1 / 34), sqrt(1 / 34), sqrt(4 / 34)] and plain.max == sqrt(4 / 34)
        assert plain.state_per_rank == [sqrt(2 / 38), sqrt(2 / 38), sqrt(8 / 38)]
        assert plain.state_max == sqrt(8 / 38) and plain.finite == [True] * 3
        assert plain.per_tensor == [("buffer/mask", 1.0, [2]), ("param/weight", sqrt(4 / 34), [2])]
        assert r["no_buffers"].state_per_rank == plain.per_rank
        assert r["one_per_bucket"] == plain
        optim = r["optim"]  # the state adds the momentum's 1, 1, 4 over 4
        assert optim.per_rank == plain.per_rank and optim.finite == [True] * 3
        assert optim.state_per_rank == [sqrt(3 / 42), sqrt(3 / 42), sqrt(12 / 42)]
        optim_inf = r["optim_inf"]  # the parameters are still measured
        assert optim_inf.per_rank == plain.per_rank and optim_inf.finite == [False] * 3
        assert optim_inf.state_per_rank == [inf] * 3
        nan_buffer = r["nan_buffer"]  # buffer mean (-inf, 1) of ranks 0 and 1, norm 1
        assert nan_buffer.per_rank == plain.per_rank and nan_buffer.finite == [True, True, False]
        assert nan_buffer.state_per_rank == [sqrt(1 / 35), sqrt(1 / 35), inf]


def _w_two_ranks(rank: int, ws: int) -> list:
    # float64 weights (0.1, 1) and (0.3, 1), mean (0.2, 1): 0.2 - 0.1 and 0.3 - 0.2 differ
    # in their last bit. Then a NaN on every rank alike.
    model = nn.Linear(2, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[0.3 if rank else 0.1, 1.0]], dtype=torch.float64))
    apart = measure_divergence(model, per_tensor=True)
    with torch.no_grad():
        model.weight[0, 1] = nan
    return [apart, measure_divergence(model, per_tensor=True)]


def test_every_rank_tied_farthest_is_named() -> None:
    """Two replicas are equally far from their mean, and so is every replica when all
    are NaN: per_tensor named rank 0 alone, and the state-split alert and paft report
    said "on rank 0" for a fault on rank 1."""
    for apart, every_nan in run_workers(_w_two_ranks, 2):
        ((name, rel, ranks),) = apart.per_tensor
        assert (name, ranks) == ("param/weight", [0, 1]) and rel == pytest.approx(0.1 / math.sqrt(1.04), rel=1e-12)
        assert every_nan.per_tensor == [("param/weight", inf, [0, 1])]


def _w_extremes(rank: int, ws: int) -> list:
    # test_distances_by_hand's weights (3, 4), (3, 4), (3, 7) in float64, times 2**660
    # (squares past the float64 range: a flipped exponent bit), -2**-700 (squares below
    # it), 2**1021 (their sum over the ranks past it) and -2**-1070 (subnormal): powers
    # of two, so the distances are the same numbers, bit for bit. A mask's -inf beside
    # them (alike, and 0 elsewhere: no distance) sets no scale.
    out = []
    for factor in (2.0**660, -(2.0**-700), 2.0**1021, -(2.0**-1070)):
        model = nn.Linear(2, 1, bias=False).double()
        model.register_buffer("mask", torch.tensor([-inf, 0.0], dtype=torch.float64))
        with torch.no_grad():
            model.weight.copy_(torch.tensor([[3.0, 7.0 if rank == 2 else 4.0]], dtype=torch.float64) * factor)
        out.append(measure_divergence(model, per_tensor=True))
    # Rank 2's NaN leaves it out, its 2**600 with it: ranks 0 and 1, (3, 4) and (3, 6)
    # times 2**-700, keep their scale, so their distances to (3, 5) do not underflow.
    model = nn.Linear(2, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(torch.tensor([[nan, 2.0**600] if rank == 2 else [3.0, 4.0 + 2 * rank]],
                                        dtype=torch.float64) * (1.0 if rank == 2 else 2.0**-700))
    return out + [measure_divergence(model)]


def test_distances_of_float64_extremes() -> None:
    """A replica at 1e199 squared past the float64 range: every rank, the two good ones
    too, reported inf, and per_tensor named rank 0 the worst; replicas at 1e-211 squared
    to 0 and read as identical."""
    sqrt = math.sqrt
    for r in run_workers(_w_extremes, 3):
        for report in r[:4]:
            assert report.per_rank == [sqrt(1 / 34), sqrt(1 / 34), sqrt(4 / 34)] and report.finite == [True] * 3
            assert report.per_tensor == [("param/weight", sqrt(4 / 34), [2]), ("buffer/mask", 0.0, [0, 1, 2])]
        assert r[4].per_rank == [sqrt(1 / 34), sqrt(1 / 34), inf] and r[4].finite == [True, True, False]


def _w_structure(rank: int, ws: int) -> str:
    model = nn.Linear(2, 1, bias=rank != 1)  # rank 1 has no bias
    try:
        measure_divergence(model)
    except RuntimeError as e:
        return str(e)
    return "measured"


def test_states_that_differ_in_structure_raise_on_every_rank() -> None:
    assert all("differ in structure" in msg for msg in run_workers(_w_structure, 3))
