"""Worker metrics against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paft.comm import BucketCapture
from paft.consistency import (
    COL_AGG_HI,
    COL_AGG_LO,
    COL_FAULTS,
    COL_FLAGS,
    COL_STATE_HI,
    COL_STATE_LO,
    FLAG_AGG_NONFINITE,
    FLAG_LOCAL_NONFINITE,
    FLAG_LOSS_NONFINITE,
    FLAG_STATE_CHECKED,
    HEADER,
    ControlVector,
    ControlView,
    checksum_keys,
    dispersion,
    pairwise_cosine,
    worker_metrics,
)
from paft.fingerprint import digest, digest_tensor, join_int64
from paft.sketch import CountSketch


def view_of(losses: list[float], norms: list[float], sketches: torch.Tensor | None = None,
            agg_fps: list[int] | None = None, state_fps: list[int] | None = None) -> ControlView:
    k = 0 if sketches is None else sketches.shape[1]
    rows = []
    for r, (loss, norm) in enumerate(zip(losses, norms)):
        rows.append(ControlVector(
            loss=loss, local_sq=norm**2, agg_norm=1.0, agg_checksum=(agg_fps or [7] * len(losses))[r],
            state_fingerprint=None if state_fps is None else state_fps[r], flags=0, faults=0,
            sketch=None if sketches is None else sketches[r],
        ).pack(k))
    return ControlView(torch.stack(rows))


def test_the_control_view_reads_back_what_each_rank_packed() -> None:
    fps = [-(2**63), 2**63 - 1]  # a state fingerprint is any signed int64
    rows = [ControlVector(loss=float(1 + r), local_sq=float(9 + 7 * r), agg_norm=0.5 * r, agg_checksum=r,
                          state_fingerprint=fps[r], flags=[FLAG_LOSS_NONFINITE | FLAG_AGG_NONFINITE, 0][r],
                          faults=3 * r, sketch=torch.tensor([r, -1.0], dtype=torch.float64)).pack(2)
            for r in range(2)]
    view = ControlView(torch.stack(rows))
    assert view.losses.tolist() == [1.0, 2.0] and view.local_norms.tolist() == [3.0, 4.0]
    assert view.agg_norms.tolist() == [0.0, 0.5] and view.faults == [0, 3]
    assert view.sketches.tolist() == [[0.0, -1.0], [1.0, -1.0]]
    assert view.state_fingerprints() == fps
    assert view.flags == [FLAG_LOSS_NONFINITE | FLAG_AGG_NONFINITE | FLAG_STATE_CHECKED, FLAG_STATE_CHECKED]
    assert view.ranks_with(FLAG_AGG_NONFINITE) == [0] and view.ranks_with(FLAG_LOCAL_NONFINITE) == []


def test_header_bits_are_the_packed_header_bitwise_with_the_checksum_split_hi_lo() -> None:
    """The guard and the rerun read the header's bits by column: every column (NaN and
    -0.0 as they are, the fault count last), the checksum as split_int64's (hi, lo)."""
    checksums = [-(2**63) + 5, 2**40 + 3]
    rows = torch.stack([ControlVector(loss=math.nan if r else -0.0, local_sq=4.0, agg_norm=2.0,
                                      agg_checksum=checksums[r], state_fingerprint=None,
                                      flags=FLAG_LOCAL_NONFINITE, faults=r + 1, sketch=None).pack(0)
                        for r in range(2)])
    view = ControlView(rows)
    assert view.header_bits() == rows.view(torch.int64).tolist()
    assert [join_int64(*view.matrix[r, [COL_AGG_HI, COL_AGG_LO]]) for r in range(2)] == checksums


def test_state_fingerprints_only_when_every_rank_took_one() -> None:
    assert view_of([1.0, 1.0], [1.0, 1.0]).state_fingerprints() is None
    mixed = [ControlVector(1.0, 1.0, 1.0, 0, fp, 0, 0, None).pack(0) for fp in (5, None)]
    assert ControlView(torch.stack(mixed)).state_fingerprints() is None
    # 0 is a fingerprint like any other: the state was checked
    assert view_of([1.0, 1.0], [1.0, 1.0], state_fps=[0, 0]).state_fingerprints() == [0, 0]


@pytest.mark.parametrize("column, value", [(COL_STATE_LO, 0.5), (COL_STATE_HI, math.nan), (COL_FLAGS, math.nan),
                                           (COL_FLAGS, 8.5), (COL_FAULTS, math.inf), (COL_FAULTS, 1.5)])
def test_a_control_row_the_collective_corrupted_is_read_not_raised_on(column: int, value: float) -> None:
    # SDC in the control collective itself: a state fingerprint's half that is no longer
    # an integer raised ValueError in join_int64 on every rank, a NaN flag in int().
    view = view_of([1.0] * 3, [1.0] * 3, state_fps=[5, 5, 5])
    view.matrix[2, column] = value
    metrics = worker_metrics(view)
    if column in (COL_STATE_HI, COL_STATE_LO):  # that rank's state stands apart, as corrupted
        assert metrics["replicas/state_distinct"] == 2 and metrics["replicas/state_minority_ranks"] == [2]
        assert view.state_fingerprints()[:2] == [5, 5]
    elif column == COL_FLAGS:  # every non-finite flag: the rank's row is not to be trusted
        assert view.ranks_with(FLAG_AGG_NONFINITE) == [2] and view.ranks_with(FLAG_LOSS_NONFINITE) == [2]
        assert view.state_fingerprints() is None  # no rank-2 claim of a state check
    else:
        assert view.faults == [0, 0, 0]


def test_corrupted_state_halves_stand_apart_from_every_fingerprint_and_from_each_other() -> None:
    view = view_of([1.0] * 4, [1.0] * 4, state_fps=[5] * 4)
    view.matrix[2, COL_STATE_LO], view.matrix[3, COL_STATE_LO] = 0.5, 0.25
    keys = view.state_fingerprints()
    assert keys[:2] == [5, 5] and keys[2] != keys[3]
    assert not any(-(2**63) <= k < 2**63 for k in keys[2:])  # no int64 fingerprint equals them
    assert worker_metrics(view)["replicas/state_distinct"] == 3


def test_checksum_keys_compare_both_halves_bitwise() -> None:
    def row(hi: int, lo: int) -> list[int]:
        bits = [0] * HEADER
        bits[3:5] = hi, lo  # COL_AGG_HI, COL_AGG_LO
        return bits

    keys = checksum_keys([row(1, 0), row(0, 1 << 32), row(0, 0), row(0, -1)])
    assert len(set(keys)) == 4
    # checksums that differ in their high half only are different replicas
    assert worker_metrics(view_of([1.0] * 2, [1.0] * 2, agg_fps=[1 << 32, 0]))["replicas/grad_distinct"] == 2


def test_dispersion_matches_hand_computation() -> None:
    view = view_of([1.0, 2.0, 3.0, 6.0], [2.0, 2.0, 4.0, 4.0])
    m = worker_metrics(view)
    # losses: mean 3, population variance (4 + 1 + 0 + 9) / 4 = 3.5
    assert m["consistency/loss_mean"] == view.global_loss == 3.0
    assert m["consistency/loss_std"] == pytest.approx(math.sqrt(3.5), rel=1e-12)
    assert m["consistency/loss_cv"] == pytest.approx(math.sqrt(3.5) / 3.0, rel=1e-12)
    assert m["consistency/loss_range"] == 5.0
    # grad norms: mean 3, std 1, cv 1/3, range 2
    assert m["consistency/gnorm_mean"] == pytest.approx(3.0, rel=1e-12)
    assert m["consistency/gnorm_std"] == pytest.approx(1.0, rel=1e-12)
    assert m["consistency/gnorm_cv"] == pytest.approx(1 / 3, rel=1e-12)
    assert m["consistency/gnorm_range"] == pytest.approx(2.0, rel=1e-12)
    assert m["replicas/grad_distinct"] == 1 and m["replicas/grad_minority_ranks"] == []


@pytest.mark.parametrize("values, cv", [
    ([-1.0, -3.0], 0.5),  # std over |mean|: a negative mean gives no negative cv
    ([-1.0, 1.0], math.inf),  # spread about a zero mean
    ([0.0, 0.0], 0.0),
])
def test_coefficient_of_variation(values: list[float], cv: float) -> None:
    assert dispersion(np.array(values))["cv"] == cv


def test_non_finite_ranks_are_those_with_a_non_finite_loss_or_norm() -> None:
    m = worker_metrics(view_of([1.0, math.nan, 1.0, math.inf], [1.0, 1.0, math.inf, 1.0]))
    assert m["consistency/nonfinite_ranks"] == [1, 2, 3]
    assert worker_metrics(view_of([1.0, 2.0], [1.0, 2.0]))["consistency/nonfinite_ranks"] == []


def test_cosine_metrics_from_the_sketches_and_only_with_two_ranks_and_a_sketch() -> None:
    m = worker_metrics(view_of([1.0] * 2, [1.0] * 2, sketches=torch.tensor([[1.0, 0.0], [1.0, 1.0]])))
    assert m["consistency/grad_cos_min"] == m["consistency/grad_cos_mean"] == pytest.approx(1 / math.sqrt(2))
    for view in (view_of([1.0] * 2, [1.0] * 2), view_of([1.0], [1.0], sketches=torch.ones(1, 2))):
        assert not [key for key in worker_metrics(view) if "cos" in key]


def test_cosine_metrics_with_one_finite_gradient() -> None:
    """No pair of finite gradients: no pairwise cosine; the finite one is its own mean."""
    g = torch.tensor([[math.nan, 1.0], [1.0, 0.0]], dtype=torch.float64)
    m = worker_metrics(view_of([1.0] * 2, [1.0] * 2), grads=g)
    assert math.isnan(m["consistency/grad_cos_mean"]) and math.isnan(m["consistency/grad_cos_min"])
    assert m["consistency/cos_to_mean_min"] == 1.0


def test_gradients_that_cancel_are_orthogonal_to_their_zero_mean() -> None:
    _, to_mean = pairwise_cosine(np.array([[1.0, 2.0], [-1.0, -2.0]]))
    assert to_mean.tolist() == [0.0, 0.0]


def test_cosine_matches_hand_computation() -> None:
    g = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    m = worker_metrics(view_of([1.0] * 3, [1.0] * 3), grads=g)
    # pairs: (e1, e2) = 0, (e1, e1+e2) = (e2, e1+e2) = 1/sqrt(2)
    assert m["consistency/grad_cos_min"] == pytest.approx(0.0, abs=1e-15)
    assert m["consistency/grad_cos_mean"] == pytest.approx(2 / 3 / math.sqrt(2), rel=1e-12)
    # mean gradient (2/3, 2/3): cos to it = 1/sqrt(2), 1/sqrt(2), 1
    assert m["consistency/cos_to_mean"] == pytest.approx([1 / math.sqrt(2), 1 / math.sqrt(2), 1.0], rel=1e-12)


def test_a_non_finite_gradient_leaves_the_healthy_pairs_their_cosine() -> None:
    g = torch.tensor([[1.0, 0.0], [math.nan, 1.0], [1.0, 1.0]], dtype=torch.float64)
    m = worker_metrics(view_of([1.0] * 3, [1.0] * 3), grads=g)
    assert m["consistency/grad_cos_min"] == m["consistency/grad_cos_mean"] == pytest.approx(1 / math.sqrt(2))
    # the mean of the finite ranks is (1, 1/2)
    to_mean = m["consistency/cos_to_mean"]
    assert math.isnan(to_mean[1]) and to_mean[0] == pytest.approx(2 / math.sqrt(5))
    assert m["consistency/cos_to_mean_min"] == pytest.approx(2 / math.sqrt(5))


@settings(max_examples=60, deadline=None)
@given(ranks=st.integers(2, 6), dim=st.integers(1, 12), bad=st.sets(st.integers(0, 5)), seed=st.integers(0, 2**16),
       zero=st.booleans())
def test_pairwise_cosine_matches_the_definition(ranks: int, dim: int, bad: set[int], seed: int, zero: bool) -> None:
    """The Gram-matrix shortcut against the definition, row by row, non-finite rows and
    an all-zero row (cosine 0 with everything) included."""
    v = np.random.default_rng(seed).standard_normal((ranks, dim))
    if zero:
        v[ranks - 1] = 0.0
    bad = {r for r in bad if r < ranks}
    for r in bad:
        v[r, r % dim] = math.nan if r % 2 else math.inf
    cos, to_mean = pairwise_cosine(v)
    healthy = [r for r in range(ranks) if r not in bad]
    mean = v[healthy].mean(0) if healthy else None
    for i in range(ranks):
        if i in bad:
            assert math.isnan(to_mean[i]) and np.isnan(cos[i]).all() and np.isnan(cos[:, i]).all()
            continue
        assert to_mean[i] == pytest.approx(v[i] @ mean / norm(v[i]) / norm(mean), abs=1e-12)
        for j in healthy:
            assert cos[i, j] == pytest.approx(v[i] @ v[j] / norm(v[i]) / norm(v[j]), abs=1e-12)


def norm(x: np.ndarray) -> float:
    return max(float(np.linalg.norm(x)), 1e-300)


def test_two_ranks_and_replica_groups() -> None:
    m = worker_metrics(view_of([2.0, 4.0], [1.0, 1.0], agg_fps=[5, 9], state_fps=[1, 1]))
    assert m["consistency/loss_std"] == 1.0 and m["consistency/loss_cv"] == pytest.approx(1 / 3)
    assert m["replicas/grad_distinct"] == 2 and m["replicas/grad_groups"] == [[0], [1]]
    assert m["replicas/grad_minority_ranks"] == []  # no majority: neither rank is named
    assert m["replicas/state_distinct"] == 1 and "replicas/state_groups" not in m
    m = worker_metrics(view_of([1.0] * 3, [1.0] * 3, agg_fps=[5, 9, 5], state_fps=[1, 1, 2]))
    assert m["replicas/grad_minority_ranks"] == [1] and m["replicas/grad_groups"] == [[0, 2], [1]]
    assert m["replicas/state_minority_ranks"] == [2] and m["replicas/state_groups"] == [[0, 1], [2]]
    m = worker_metrics(view_of([1.0] * 4, [1.0] * 4, agg_fps=[5, 5, 9, 9]))
    assert m["replicas/grad_minority_ranks"] == []  # an even split: no side is the majority


def test_cosines_of_float64_extremes() -> None:
    """Rows of 1e200 overflowed the Gram matrix (NaN, silently dropped from the mean and
    minimum), rows of 1e-200 underflowed it (cosine 0 for identical rows)."""
    cos, to_mean = pairwise_cosine(np.array([[1e-200, 0.0], [1e-200, 0.0]]))
    assert cos[0, 1] == 1.0 and list(to_mean) == [1.0, 1.0]
    cos, _ = pairwise_cosine(np.array([[1e200, 0.0], [1e200, 1e200]]))
    assert cos[0, 1] == pytest.approx(math.sqrt(0.5))
    # the scale comes from the largest magnitude, negative rows included
    cos, _ = pairwise_cosine(np.array([[-1e200, 0.0], [-1e200, -1e200]]))
    assert cos[0, 1] == pytest.approx(math.sqrt(0.5))
    # and from the finite rows only: a NaN or Inf row beside them leaves their scaling alone
    cos, to_mean = pairwise_cosine(np.array([[1e200, 0.0], [1e200, 1e200], [math.nan, 0.0]]))
    assert cos[0, 1] == pytest.approx(math.sqrt(0.5))
    assert to_mean[:2] == pytest.approx([1 / math.sqrt(1.25), 1.5 / math.sqrt(2.5)])  # mean (1, 0.5) * 1e200
    cos, to_mean = pairwise_cosine(np.array([[1e-200, 0.0], [1e-200, 0.0], [math.inf, 0.0]]))
    assert cos[0, 1] == 1.0 and list(to_mean[:2]) == [1.0, 1.0]


_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", _DEVICES)
def test_capture_totals_match_the_host_arithmetic(device: str) -> None:
    """The device-side sums read back in one transfer equal the same sums done on the host,
    the checksum combination wrapping mod 2**64 into the signed int64 range."""
    gen = torch.Generator().manual_seed(5)
    buckets = [torch.randn(n, generator=gen).to(device) for n in (1000, 37, 513)]
    cap, sketcher = BucketCapture(sketch_dim=64), CountSketch(64)
    sq_host, combined = 0.0, 0
    for i, flat in enumerate(buckets):
        cap.add_local(sketcher.add_(cap.sketch_on(flat.device), i, flat))  # type: ignore[arg-type]
        cap.add_aggregated(i, digest_tensor(flat))
        sq_host += float(torch.dot(flat, flat))
        combined = (combined + digest(flat.cpu()) * (2 * i + 1)) & ((1 << 64) - 1)
    local_sq, checksum, sketch = cap.totals()
    # bitwise on the CPU; a CUDA dot may sum in another order
    assert local_sq == (sq_host if device == "cpu" else pytest.approx(sq_host, rel=1e-12))
    assert checksum == (combined - (1 << 64) if combined >= 1 << 63 else combined)
    assert sketch is not None and torch.equal(sketch, cap.sketch.cpu())  # type: ignore[union-attr]
    assert BucketCapture().totals() == (0.0, 0, None)
    # between metric steps only the checksum is captured; the same value comes back
    only_checksum = BucketCapture()
    only_checksum.agg_terms = cap.agg_terms
    assert only_checksum.totals() == (0.0, checksum, None)
    # the local parts alone: checksum 0, not the sketch's last word read as one
    only_local = BucketCapture(sketch_dim=64, sketch=cap.sketch, local_sq=cap.local_sq)
    assert only_local.totals()[:2] == (local_sq, 0) and torch.equal(only_local.totals()[2], sketch)


def test_one_rank_has_no_spread_even_when_its_value_is_not_finite() -> None:
    from paft.consistency import dispersion

    for value in (math.inf, -math.inf, math.nan, 2.0):
        d = dispersion(np.array([value]))
        assert (d["std"], d["cv"], d["range"]) == (0.0, 0.0, 0.0), value  # a NaN here fired the loss_cv alert


@pytest.mark.parametrize("row, ranks", [
    # Unclipped, rounding took these cosines (pairwise; to the mean) to 1.0000000000000002.
    ([0.9470809631292422, -0.7037352358069926, -1.2654214710460525, -0.6232744625373522, 0.0413259793472436,
      -2.3250307746388343, -0.21879166393254573], 3),
    ([-0.6617025720390349, -0.43643524714322124], 4),
])
def test_cosines_of_identical_gradients_never_pass_one(row: list[float], ranks: int) -> None:
    m = worker_metrics(view_of([1.0] * ranks, [1.0] * ranks), grads=torch.tensor([row] * ranks, dtype=torch.float64))
    cosines = [m["consistency/grad_cos_min"], m["consistency/grad_cos_mean"], *m["consistency/cos_to_mean"]]
    assert all(1 - 1e-15 < c <= 1.0 for c in cosines), cosines


def _control_rows(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.distributed as dist

    from paft.consistency import start_control

    def vec(r: int) -> torch.Tensor:  # NaN, -0.0, a fingerprint's bits: every row its own
        v = torch.arange(12, dtype=torch.float64) + 100 * r
        v[1], v[2], v[3] = math.nan, -0.0, float(2**32 - 1 - r)
        return v

    got = torch.from_numpy(start_control(vec(rank)).wait().matrix.copy())
    dist.barrier()
    return got, torch.stack([vec(r) for r in range(world_size)])


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_control_collective_gives_every_rank_every_row_bitwise(world_size: int) -> None:
    from paft.testing import run_workers

    for got, want in run_workers(_control_rows, world_size):
        assert torch.equal(got.view(torch.int64), want.view(torch.int64))
