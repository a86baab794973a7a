"""Tests for paft.sync: real gloo ranks, real models and optimizers, bitwise checks."""

from __future__ import annotations

import functools
import gc
import json
import math
import time
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paft.divergence import measure_divergence
from paft.fingerprint import fingerprint
from paft.state import state_fingerprint, state_tensors
from paft.sync import ReplicaSync, SyncReport
from paft.testing import NestedStateSGD, run_workers

OPTIMIZERS = ("sgd", "sgd-momentum", "adam", "adamw")

# ----------------------------------------------------------------------------
# Helpers shared by the workers (module level: spawn pickles them by name)
# ----------------------------------------------------------------------------


def _model(kind: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    if kind == "mlp":
        return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))
    return nn.Sequential(  # "bn": a tiny conv net with BatchNorm (float + int buffers)
        nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3)
    )


def _optim(kind: str, params) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if kind == "sgd-momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "adam":
        return torch.optim.Adam(params, lr=1e-2)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _batch(kind: str, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(8, 6, generator=gen) if kind == "mlp" else torch.randn(8, 2, 4, 4, generator=gen)


def _train(model: nn.Module, opt: torch.optim.Optimizer, kind: str, steps: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        model(_batch(kind, gen)).square().mean().backward()
        opt.step()


def _snap(model: nn.Module, opt: torch.optim.Optimizer | None) -> list[tuple[str, torch.Tensor]]:
    return [(n, t.detach().clone()) for n, t in state_tensors(model, opt)]


def _restore(model: nn.Module, opt: torch.optim.Optimizer | None, saved) -> None:
    for (n, t), (n2, s) in zip(state_tensors(model, opt), saved, strict=True):
        assert n == n2
        t.detach().copy_(s)


def _fp(model: nn.Module, opt: torch.optim.Optimizer | None) -> int:
    return fingerprint(t for _, t in state_tensors(model, opt))


def _flip_exponent(t: torch.Tensor, index: int) -> None:
    """Flip the top exponent bit of one float32 element (0.05 -> ~1e37)."""
    with torch.no_grad():
        t.view(-1).view(torch.int32)[index] ^= 1 << 30


def _corrected(synced, stepped, pre) -> list[tuple[str, torch.Tensor]]:
    """What an overlapped sync with a step in its window leaves: the synced state plus
    the step's progress (the buffers, synced at start, as the step left them)."""
    out = []
    for (n, s), (_, w), (_, p) in zip(synced, stepped, pre, strict=True):
        prog = w - p
        out.append((n, w if n.startswith("buffer/") else torch.where(prog == 0, s, s + prog)))
    return out


def _assert_same(a, b) -> None:
    assert [n for n, _ in a] == [n for n, _ in b]
    for (n, x), (_, y) in zip(a, b):
        assert x.dtype == y.dtype and torch.equal(x, y), n


def _assert_replicas_identical(results, key: str = "state", fp: str = "fp") -> None:
    assert len({r[fp] for r in results}) == 1
    for r in results[1:]:
        _assert_same(results[0][key], r[key])


# ----------------------------------------------------------------------------
# Pure logic: the coordinate-wise merges, reports, validation (no processes)
# ----------------------------------------------------------------------------


def test_report_to_json_is_json_ready():
    rep = SyncReport("median", [[0], [1]], [0, 1], 24, 0.01, math.inf, collectives=2)
    d = rep.to_json()
    assert d["divergence"] == "inf" and d["mode"] == "median" and d["seconds"] == 0.01
    assert not {"step", "event", "period"} & d.keys()  # the events log owns those keys
    json.dumps(d, allow_nan=False)


def test_validation_errors_name_the_option():
    m = _model("mlp")
    with pytest.raises(ValueError, match="mode"):
        ReplicaSync(m, None, mode="average")
    with pytest.raises(ValueError, match="bucket_mb"):
        ReplicaSync(m, None, bucket_mb=0)
    with pytest.raises(RuntimeError, match="process group"):
        ReplicaSync(m, None)


# ----------------------------------------------------------------------------
# Every optimizer and mode: bitwise identical replicas after a sync (3 ranks)
# ----------------------------------------------------------------------------


def _w_all_optimizers(rank: int, ws: int) -> dict:
    out: dict = {}
    for opt_kind in OPTIMIZERS:
        for model_kind in ("mlp", "bn"):
            for mode in ("robust", "mean", "broadcast"):
                model = _model(model_kind)
                opt = _optim(opt_kind, model.parameters())
                _train(model, opt, model_kind, steps=3, seed=100 + rank)  # different data per rank
                sync = ReplicaSync(model, opt, mode=mode, src=1)
                before = _fp(model, opt)
                rep = sync.sync()
                out[(opt_kind, model_kind, mode)] = {
                    "state": _snap(model, opt),
                    "fp": _fp(model, opt),
                    "before": before,
                    "mode": rep.mode,
                    "divergence": rep.divergence,
                    "collectives": rep.collectives,
                    "differing": (rep.differing_tensors, rep.differing),
                }
    # DDP-wrapped: DDP makes the parameters equal, the optimizer states still differ.
    model = _model("bn")
    opt = _optim("adam", model.parameters())
    _train(model, opt, "bn", steps=2, seed=7 + rank)
    ddp = DistributedDataParallel(model)
    sync = ReplicaSync(ddp, opt)
    rep = sync.sync()
    out["ddp"] = {"state": _snap(ddp, opt), "fp": _fp(ddp, opt), "mode": rep.mode}
    # overlapped with DDP's own all-reduces queued behind ours on the same group
    if rank == 1:
        _flip_exponent(opt.state[model[0].weight]["exp_avg"], 2)
    sync.start()
    ddp(_batch("bn", torch.Generator().manual_seed(3))).square().mean().backward()
    rep = sync.finish()
    out["ddp_overlap"] = {"state": _snap(ddp, opt), "fp": _fp(ddp, opt), "mode": rep.mode}
    return out


def test_all_optimizers_and_modes_give_bitwise_identical_replicas():
    results = run_workers(_w_all_optimizers, 3)
    for key in results[0]:
        per_rank = [r[key] for r in results]
        _assert_replicas_identical(per_rank)
        if key in ("ddp", "ddp_overlap"):
            assert per_rank[0]["mode"] == {"ddp": "median", "ddp_overlap": "majority-copy"}[key]
            continue
        opt_kind, model_kind, mode = key
        assert len({r["before"] for r in per_rank}) == 3, key  # really perturbed
        expected = {"robust": "median", "mean": "mean", "broadcast": "broadcast"}[mode]
        assert all(r["mode"] == expected for r in per_rank), key
        assert 0 < per_rank[0]["divergence"] < math.inf
        names = [n for n, _ in per_rank[0]["state"]]
        if model_kind == "bn":
            assert "buffer/1.running_mean" in names and "buffer/1.num_batches_tracked" in names
        if opt_kind in ("adam", "adamw"):
            assert any(n.endswith("/step") for n in names) and any(n.endswith("exp_avg_sq") for n in names)
        if (opt_kind, model_kind) == ("adam", "bn"):
            # every parameter, moment and running statistic differs (20, not the equal
            # steps and batch counts); the report names the first 16, each rank apart
            count, named = per_rank[0]["differing"]
            listed = sorted((n for n, _ in per_rank[0]["state"] if not n.endswith(("/step", "num_batches_tracked"))),
                            key=lambda n: n.startswith("buffer/"))  # the buffers' part comes last
            assert count == 20 and len(named) == 16 and list(named) == listed[:16]
            assert all(groups == [[0], [1], [2]] for groups in named.values())
        if opt_kind == "sgd-momentum":
            assert any(n.endswith("momentum_buffer") for n in names)
        # one collective per dtype bucket of each part (the buffers, the rest), not per
        # tensor, + control, finite flags and the divergence max
        parts = [[t.dtype for n, t in per_rank[0]["state"] if n.startswith("buffer/") == b] for b in (True, False)]
        assert per_rank[0]["collectives"] == 1 + 1 + sum(len(set(p)) for p in parts) + 1


# ----------------------------------------------------------------------------
# 3 ranks: bit-flip repair, no-op, NaN in mean mode, overlapped start/finish
# ----------------------------------------------------------------------------


def _w_three(rank: int, ws: int) -> dict:
    out: dict = {}
    # -- robust: one flipped exponent bit on rank 1 -> exact repair from the majority
    model = _model("bn")
    opt = _optim("adam", model.parameters())
    _train(model, opt, "bn", steps=3, seed=0)  # same data: identical replicas
    sync = ReplicaSync(model, opt)
    out["clean"] = _snap(model, opt)
    if rank == 1:
        _flip_exponent(model[0].weight, 5)
        out["flipped_value"] = model[0].weight.view(-1)[5].item()
    rep = sync.sync()
    out["flip"] = {"report": rep, "state": _snap(model, opt), "fp": _fp(model, opt)}
    # -- everything identical now: the no-op path moves only the control exchange
    rep = sync.sync()
    out["noop"] = rep
    # -- flip inside Adam's exp_avg_sq on rank 2
    if rank == 2:
        _flip_exponent(opt.state[model[0].weight]["exp_avg_sq"], 3)
    out["flip_optim"] = sync.sync()
    out["after_flip_optim"] = _snap(model, opt)

    # -- robust, a majority of identical NaN replicas: the finite replica wins
    model = _model("mlp")
    opt = _optim("sgd", model.parameters())
    _train(model, opt, "mlp", steps=1, seed=0)
    with torch.no_grad():
        if rank == 1:
            model[0].weight.add_(1e-3)
        else:
            model[0].bias[2] = math.nan
    out["nan_majority_pre"] = _snap(model, opt)
    rep = ReplicaSync(model, opt).sync()
    out["nan_majority"] = {"report": rep, "state": _snap(model, opt), "fp": _fp(model, opt)}

    # -- mean mode, rank 2 holds a NaN: the mean of ranks 0 and 1, no NaN anywhere
    model = _model("bn")
    opt = _optim("sgd-momentum", model.parameters())
    _train(model, opt, "bn", steps=2, seed=10 + rank)
    if rank == 2:
        with torch.no_grad():
            model[4].weight[0, 0] = math.nan
    out["mean_pre"] = _snap(model, opt)
    rep = ReplicaSync(model, opt, mode="mean").sync()
    out["mean"] = {"report": rep, "state": _snap(model, opt), "fp": _fp(model, opt)}
    # -- mean, float32: ranks 0 and 1 sum past float32's range where rank 2 holds a NaN;
    # the smallest subnormal and the -0.0 they all hold must stay themselves
    lin = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[3e38 + 2e37 * rank, 2.0**-149, 2.0 + rank, -0.0]]))
        if rank == 2:
            lin.weight[0, 0] = math.nan
    out["mean_overflow"] = ReplicaSync(lin, None, mode="mean").sync(), lin.weight.detach().clone()

    # -- a fused optimizer steps in the window without moving a version counter: its
    # step hook still has finish() apply the correction
    model = _model("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    _train(model, opt, "mlp", steps=1, seed=60 + rank)
    pre = _snap(model, opt)
    sync = ReplicaSync(model, opt)
    sync.sync()
    synced = _snap(model, opt)
    _restore(model, opt, pre)
    sync.start()
    _train(model, opt, "mlp", steps=1, seed=30)
    stepped = _snap(model, opt)
    out["fused"] = {"report": sync.finish(), "state": _snap(model, opt), "expected": _corrected(synced, stepped, pre)}

    # -- overlapped, rank 2 holds a NaN and steps in the window (its loss, gradient and
    # update go NaN): its progress is garbage, it takes the majority's state as it is
    model = _model("mlp")
    opt = _optim("sgd", model.parameters())
    sync = ReplicaSync(model, opt)
    out["garbage_pre"] = _snap(model, opt)
    if rank == 2:
        with torch.no_grad():
            model[0].weight[1, 1] = math.nan
    sync.start()
    _train(model, opt, "mlp", steps=1, seed=30)
    out["garbage"] = {"report": sync.finish(), "state": _snap(model, opt)}

    # -- overlapped start/finish == blocking sync (bitwise), for median and mean
    for mode in ("robust", "mean"):
        model = _model("bn")
        opt = _optim("adamw", model.parameters())
        _train(model, opt, "bn", steps=2, seed=20 + rank)
        pre = _snap(model, opt)
        sync = ReplicaSync(model, opt, mode=mode)
        blocking = sync.sync()
        synced = _snap(model, opt)
        _restore(model, opt, pre)
        sync.start()
        assert sync.in_flight
        with torch.no_grad():  # compute that does not touch the state
            model.eval()
            model(_batch("bn", torch.Generator().manual_seed(1)))
            model.train()
        rep = sync.finish()
        assert not sync.in_flight
        out[f"overlap_{mode}"] = {
            "blocking": blocking,
            "report": rep,
            "synced": synced,
            "state": _snap(model, opt),
            "fp": _fp(model, opt),
        }
        # with an optimizer step (and BatchNorm running-stat updates) in between: the
        # correction synced + (w - snapshot) keeps the parameters' and optimizer
        # state's progress; start() synced the buffers, which the forward then updated
        _restore(model, opt, pre)
        sync.start()
        _train(model, opt, "bn", steps=1, seed=30)  # like DDP: the same gradient data
        stepped = _snap(model, opt)
        rep = sync.finish()
        out[f"overlap_step_{mode}"] = {
            "report": rep,
            "state": _snap(model, opt),
            "expected": _corrected(synced, stepped, pre),
            "synced": synced,
            "stepped": stepped,
        }
        # Declared: state_changed=True corrects a change no version counter saw (made
        # through .data); False promises none: a plain copy, no tensor corrected
        _restore(model, opt, pre)
        sync.start()
        for p in model.parameters():
            p.data.add_(0.25)  # every rank alike
        moved = _snap(model, opt)
        rep = sync.finish(state_changed=True)
        out[f"declared_{mode}"] = {"report": rep, "state": _snap(model, opt),
                                   "expected": _corrected(synced, moved, pre)}
        _restore(model, opt, pre)
        sync.start()
        out[f"promised_{mode}"] = {"report": sync.finish(state_changed=False), "state": _snap(model, opt)}

    # -- timing: each part's merge made _MERGE_S slower, a transfer still in flight
    # when it is waited for; start() merges the buffers, finish() the rest
    model = _model("mlp")
    opt = _optim("sgd", model.parameters())
    _train(model, opt, "mlp", steps=1, seed=40 + rank)  # replicas differ: the state is in flight
    sync = ReplicaSync(model, opt)
    merge = sync._finish_part

    def slow_merge(*args: Any, **kwargs: Any) -> Any:
        time.sleep(_MERGE_S)
        return merge(*args, **kwargs)

    sync._finish_part = slow_merge  # type: ignore[method-assign]
    assert sync.start() is None
    time.sleep(_WINDOW_S)  # the caller's next step
    out["timed"] = sync.finish()
    return out


_MERGE_S, _WINDOW_S = 0.05, 0.1


def test_three_ranks_repair_noop_nan_and_overlap():
    res = run_workers(_w_three, 3)
    # one flipped exponent bit: repaired exactly to the majority's bits
    assert abs(res[1]["flipped_value"]) > 1e30
    for r in res:
        rep = r["flip"]["report"]
        assert rep.mode == "majority-copy" and rep.groups == [[0, 2], [1]] and rep.source_ranks == [0]
        _assert_same(r["flip"]["state"], res[0]["clean"])
        _assert_same(r["flip"]["state"], res[2]["clean"])
        assert rep.divergence > 1e20  # rank 1 was ~1e37 away
        # The one tensor that differed is named, with the ranks grouped by its bits.
        assert (rep.differing_tensors, rep.differing) == (1, {"param/0.weight": [[0, 2], [1]]})
    _assert_replicas_identical([r["flip"] for r in res])
    # no-op: only the two fingerprints and the structure hash (24 bytes per rank)
    for r in res:
        rep = r["noop"]
        assert rep.mode == "noop" and rep.bytes_sent == 24 and rep.collectives == 1
        assert rep.divergence == 0.0 and rep.groups == [[0, 1, 2]]
        assert (rep.differing_tensors, rep.differing) == (0, {})
    for r in res:
        assert r["flip_optim"].mode == "majority-copy" and r["flip_optim"].groups == [[0, 1], [2]]
        assert r["flip_optim"].differing == {"optim/0/exp_avg_sq": [[0, 1], [2]]}  # the first parameter's
        _assert_same(r["after_flip_optim"], res[0]["clean"])
    # one rank to repair: the source sends to it point-to-point, rank 2 moves nothing;
    # the buffers agree, so only the parameters and optimizer state move
    state = [t for n, t in res[0]["clean"] if not n.startswith("buffer/")]
    state_bytes = sum(t.numel() * t.element_size() for t in state)
    control = 24 + 24 * len(state)  # fingerprints + structure, then per tensor its NaN/Inf count, places, digest
    assert res[0]["flip"]["report"].bytes_sent == control + state_bytes + 8
    assert res[1]["flip"]["report"].bytes_sent == res[2]["flip"]["report"].bytes_sent == control + 8
    # fingerprints, finite flags, divergence; the pair adds its one send / receive (one bucket)
    assert [r["flip"]["report"].collectives for r in res] == [4, 4, 3]

    # a majority of identical but non-finite replicas is not copied
    _assert_replicas_identical([r["nan_majority"] for r in res])
    _assert_same(res[0]["nan_majority"]["state"], res[1]["nan_majority_pre"])
    rep = res[0]["nan_majority"]["report"]
    assert rep.mode == "finite-copy" and rep.source_ranks == [1] and rep.groups == [[0, 2], [1]]
    assert rep.note == "majority is non-finite; non-finite ranks [0, 2] excluded"

    # mean with a NaN replica: exactly the mean of the finite ones
    _assert_replicas_identical([r["mean"] for r in res])
    for r in res:
        assert r["mean"]["report"].mode == "mean" and r["mean"]["report"].source_ranks == [0, 1]
        assert math.isinf(r["mean"]["report"].divergence)
    for (n, got), (_, a), (_, b), (_, c) in zip(res[0]["mean"]["state"], *(r["mean_pre"] for r in res)):
        if n.startswith("buffer/") and got.is_floating_point():  # rank 2's buffers are finite: they count
            assert torch.allclose(got, (a + b + c) / 3, rtol=1e-6, atol=0), n
        elif got.is_floating_point():
            assert torch.equal(got, (a + b) / 2), n
            assert torch.isfinite(got).all(), n
        else:
            assert torch.equal(got, a), n  # integers copied from the lowest finite rank

    # the sum of the finite pair overflows: each share scaled first, rank 2's NaN left out;
    # the subnormal exact (halved first it would round to 0), 2.5 exact, -0.0 still -0.0
    a, b = torch.tensor([3e38, 3e38 + 2e37])
    for r in res:
        report, w = r["mean_overflow"]
        expected = torch.stack([a * 0.5 + b * 0.5, torch.tensor(2.0**-149), torch.tensor(2.5), torch.tensor(-0.0)])
        assert torch.equal(w.view(torch.int32), expected.view(1, 4).view(torch.int32))  # bits: -0.0 is not +0.0
        assert report.mode == "mean" and report.source_ranks == [0, 1]
        # control 24, finite flags and digest 24, the sum 16, the scaled sum 16; no divergence
        # all-reduce: with rank 2's NaN replica it is inf, which every rank knows
        assert (report.bytes_sent, report.collectives) == (80, 4) and math.isinf(report.divergence)

    for r in res:  # the fused step moved no version counter, yet its progress is kept
        assert r["fused"]["report"].mode == "median" and r["fused"]["report"].delta_tensors > 0
        _assert_same(r["fused"]["state"], r["fused"]["expected"])
    # the NaN rank: the majority's state as it is, without its NaN progress; the majority
    # keeps the step's progress
    _assert_same(res[2]["garbage"]["state"], res[0]["garbage_pre"])
    assert res[2]["garbage"]["report"].mode == "majority-copy" and res[2]["garbage"]["report"].delta_tensors == 0
    assert not torch.equal(dict(res[0]["garbage"]["state"])["param/0.weight"],
                           dict(res[0]["garbage_pre"])["param/0.weight"])

    for mode, expected_mode in (("robust", "median"), ("mean", "mean")):
        o = [r[f"overlap_{mode}"] for r in res]
        _assert_replicas_identical(o)
        for r in o:
            assert r["report"].mode == r["blocking"].mode == expected_mode
            assert r["report"].overlapped and r["report"].delta_tensors == 0  # the buffers were synced at start
            _assert_same(r["state"], r["synced"])  # overlapped == blocking, bitwise
            _assert_same(r["synced"], o[0]["synced"])
        s = [r[f"overlap_step_{mode}"] for r in res]
        for r in s:
            assert r["report"].delta_tensors > 0
            _assert_same(r["state"], r["expected"])  # synced + progress, exactly that
            changed = [n for (n, a), (_, b) in zip(r["state"], r["synced"]) if not torch.equal(a, b)]
            assert "param/0.weight" in changed and "buffer/1.running_mean" in changed
        corrected = len([n for n, _ in res[0][f"overlap_step_{mode}"]["synced"] if not n.startswith("buffer/")])
        for r in res:
            declared, promised = r[f"declared_{mode}"], r[f"promised_{mode}"]
            assert declared["report"].delta_tensors == corrected  # all, changed or not
            _assert_same(declared["state"], declared["expected"])
            assert promised["report"].delta_tensors == 0
            _assert_same(promised["state"], r[f"overlap_{mode}"]["synced"])
        # replicas close (not bitwise: each rank's own progress was kept)
        def params(state):
            return torch.cat([t.reshape(-1) for n, t in state if n.startswith("param/")])

        after = [params(r["state"]) for r in s]
        unsynced = [params(r["stepped"]) for r in s]  # what the same step gives without a sync
        for r in (1, 2):
            left, before = (after[0] - after[r]).norm(), (unsynced[0] - unsynced[r]).norm()
            assert 0 < left <= 0.5 * before

    # seconds: the caller's critical path, start() and finish() with their waits, not the
    # window between them; wall_seconds: from start() to the end of finish(), window included
    for r in res:
        rep = r["timed"]
        assert rep.overlapped and math.isfinite(rep.wall_seconds)
        assert rep.seconds >= 2 * _MERGE_S and rep.wall_seconds - rep.seconds >= _WINDOW_S


# ----------------------------------------------------------------------------
# 4 ranks: 2-2 split -> median; broadcast; buckets; measure_divergence
# ----------------------------------------------------------------------------


def _w_buffers_apart(rank: int, ws: int) -> dict:
    out: dict = {}
    # -- a running variance gone huge on rank 0 (a flipped exponent), then an overlapped
    # sync with the next forward in its window: as blocking, then that forward
    for overlapped in (False, True):
        model = _model("bn")
        opt = _optim("adam", model.parameters())
        _train(model, opt, "bn", steps=1, seed=0)  # parameters alike, buffers too
        model(_batch("bn", torch.Generator().manual_seed(40 + rank)))  # buffers now differ, as under DDP
        if rank == 0:
            with torch.no_grad():
                model[1].running_var[:2] = 1e30
        sync = ReplicaSync(model, opt)
        if overlapped:
            sync.start()
            model(_batch("bn", torch.Generator().manual_seed(50 + rank)))
            rep = sync.finish()
        else:
            rep = sync.sync()
            model(_batch("bn", torch.Generator().manual_seed(50 + rank)))
        out[overlapped] = {"report": rep, "running_var": model[1].running_var.clone(), "state": _snap(model, opt)}
    # -- a parameter flipped on rank 1 while the buffers differ: the parameters and the
    # optimizer state take the majority's bits, the buffers their median
    model = _model("bn")
    opt = _optim("adam", model.parameters())
    _train(model, opt, "bn", steps=1, seed=0)
    model(_batch("bn", torch.Generator().manual_seed(40 + rank)))
    out["clean"] = _snap(model, opt)
    if rank == 1:
        _flip_exponent(model[0].weight, 7)
    out["flip"] = {"report": ReplicaSync(model, opt).sync(), "state": _snap(model, opt), "fp": _fp(model, opt)}
    # -- a NaN on rank 1 and a -1e30 on rank 2, each in one coordinate: every coordinate
    # has a majority of sound values, which the median keeps
    model = _model("mlp")
    opt = _optim("sgd", model.parameters())
    _train(model, opt, "mlp", steps=1, seed=0)
    out["sound"] = _snap(model, opt)
    with torch.no_grad():
        if rank == 1:
            model[0].weight[0, 0] = math.nan
        if rank == 2:
            model[0].weight[1, 1] = -1e30
        if rank == 0:
            model[2].bias[0] += 1.0  # all three differ: no majority, a median
    rep = ReplicaSync(model, opt).sync()
    out["outvoted"] = {"report": rep, "state": _snap(model, opt), "fp": _fp(model, opt)}
    # -- every rank holds a NaN, ranks 0 and 2 at one coordinate, rank 1 at another: no
    # finite replica; where the median is NaN, the coordinate's finite values decide
    model = _model("mlp")
    opt = _optim("sgd", model.parameters())
    _train(model, opt, "mlp", steps=1, seed=0)
    out["all_nan_pre"] = _snap(model, opt)
    with torch.no_grad():
        model[0].weight[0, 1 if rank == 1 else 0] = math.nan
    rep = ReplicaSync(model, opt).sync()
    out["all_nan"] = {"report": rep, "state": _snap(model, opt), "fp": _fp(model, opt)}
    return out


def test_buffers_sync_apart_from_parameters_and_optimizer_state():
    res = run_workers(_w_buffers_apart, 3)
    # Overlapped == blocking then the forward, bitwise: the buffers were synced at start
    # (the additive correction made rank 0's running variance -1e29, DDP then spread it).
    for r in res:
        assert torch.equal(r[True]["running_var"], r[False]["running_var"])
        assert bool((r[True]["running_var"] > 0).all()) and r[True]["running_var"].max() < 10
        assert r[True]["report"].mode == "median" and r[True]["report"].note == "buffers only"
        _assert_same(r[True]["state"], r[False]["state"])
    # Buffers apart do not hide the majority of the parameters and optimizer state.
    _assert_replicas_identical([r["flip"] for r in res])
    for r in res:
        assert r["flip"]["report"].mode == "majority-copy" and r["flip"]["report"].groups == [[0, 2], [1]]
        assert r["flip"]["report"].note == "buffers: median"
    for (n, got), (_, clean) in zip(res[1]["flip"]["state"], res[0]["clean"]):
        if not n.startswith("buffer/"):
            assert torch.equal(got, clean), n
    # One NaN does not cost a replica its vote everywhere: the healthy bits, exactly.
    _assert_replicas_identical([r["outvoted"] for r in res])
    rep = res[0]["outvoted"]["report"]
    assert rep.mode == "median" and rep.note == "non-finite ranks [1] outvoted where non-finite"
    for (n, got), (_, sound) in zip(res[0]["outvoted"]["state"], res[0]["sound"]):
        assert torch.equal(got, sound), n
    # No replica finite: each NaN is outvoted by the one finite value of its coordinate.
    _assert_replicas_identical([r["all_nan"] for r in res])
    rep = res[0]["all_nan"]["report"]
    assert rep.mode == "median" and rep.note == ("majority is non-finite; every rank holds NaN/Inf; "
                                                 "where the median is non-finite, the finite values' median")
    _assert_same(res[0]["all_nan"]["state"], res[0]["all_nan_pre"])


def _w_nested(rank: int, ws: int) -> dict:
    model = _model("mlp")
    opt = NestedStateSGD(model.parameters())
    _train(model, opt, "mlp", steps=3, seed=5)  # the same data: identical replicas
    clean = _snap(model, opt)
    sync = ReplicaSync(model, opt)
    if rank == 1:  # corrupt a tensor nested in a dict of the optimizer state
        _flip_exponent(opt.state[model[0].weight]["stats"]["sq"], 4)
    rep = sync.sync()
    out = {"repair": rep.mode, "groups": rep.groups, "state": _snap(model, opt), "fp": _fp(model, opt),
           "clean": clean}
    if rank == 2:  # a history one entry longer: the flat buffers no longer line up
        opt.state[model[2].bias]["history"].append(torch.zeros(3))
    out["mismatch"] = {}
    for mode, s in (("robust", sync), ("mean", ReplicaSync(model, opt, mode="mean")),
                    ("broadcast", ReplicaSync(model, opt, mode="broadcast"))):
        try:
            s.sync()
            out["mismatch"][mode] = None
        except RuntimeError as e:
            out["mismatch"][mode] = str(e)
    return out


def test_nested_optimizer_state_is_repaired_and_a_structure_mismatch_is_an_error_on_every_rank():
    res = run_workers(_w_nested, 3)
    for r in res:
        assert r["repair"] == "majority-copy" and r["groups"] == [[0, 2], [1]]
        _assert_same(r["state"], r["clean"])  # the nested tensor got the majority's bits back
        # in every mode (README: an error that says so instead of a hang)
        for mode in ("robust", "mean", "broadcast"):
            assert "ranks grouped by structure: [[0, 1], [2]]" in r["mismatch"][mode], mode
    _assert_replicas_identical(res)


def _w_four(rank: int, ws: int) -> dict:
    out: dict = {}
    model = _model("bn")
    opt = _optim("adam", model.parameters())
    _train(model, opt, "bn", steps=2, seed=rank // 2)  # ranks {0,1} and {2,3} agree
    out["split_pre"] = _snap(model, opt)
    rep = ReplicaSync(model, opt, bucket_mb=256 / 2**20).sync()  # buckets cut across tensors
    out["split"] = {"report": rep, "state": _snap(model, opt), "fp": _fp(model, opt)}

    # broadcast from rank 2, with tiny buckets: one collective per bucket
    model = _model("mlp")
    opt = _optim("sgd-momentum", model.parameters())
    _train(model, opt, "mlp", steps=2, seed=rank)
    out["bcast_pre"] = _snap(model, opt)
    rep = ReplicaSync(model, opt, mode="broadcast", src=2, bucket_mb=64 / 2**20).sync()  # 64 bytes
    out["bcast"] = {"report": rep, "state": _snap(model, opt), "fp": _fp(model, opt)}

    # one rank to repair, with tiny buckets: point-to-point, each bucket to its place
    model = _model("mlp")
    opt = _optim("sgd", model.parameters())
    out["p2p_clean"] = _snap(model, opt)
    if rank == 3:
        with torch.no_grad():
            model[0].weight.mul_(2.0)
    rep = ReplicaSync(model, opt, bucket_mb=64 / 2**20).sync()
    out["p2p"] = {"report": rep, "state": _snap(model, opt), "fp": _fp(model, opt)}

    # measure_divergence against a hand computation; then with a NaN replica
    model = _model("mlp")
    opt = _optim("adam", model.parameters())
    _train(model, opt, "mlp", steps=2, seed=rank)
    out["div_state"] = _snap(model, opt)
    out["div"] = measure_divergence(model, opt, per_tensor=True)
    if rank == 3:
        with torch.no_grad():
            model[0].bias[0] = math.inf
    out["div_nan"] = measure_divergence(model)
    return out


def _rel_to_mean(states: list[list[torch.Tensor]]) -> list[float]:
    flat = [torch.cat([t.double().reshape(-1) for t in s]) for s in states]
    mean = torch.stack(flat).mean(0)
    return [float((f - mean).norm() / mean.norm()) for f in flat]


def test_four_ranks_split_broadcast_buckets_and_divergence():
    res = run_workers(_w_four, 4)
    # 2-2 split: no strict majority -> of the two values, the one of smaller magnitude
    _assert_replicas_identical([r["split"] for r in res])
    for r in res:
        rep = r["split"]["report"]
        assert rep.mode == "median" and rep.groups == [[0, 1], [2, 3]] and rep.collectives > 10
        assert 0 < rep.divergence < 1
    for (n, got), (_, x), (_, y) in zip(res[0]["split"]["state"], res[0]["split_pre"], res[2]["split_pre"]):
        lo, hi = torch.minimum(x, y), torch.maximum(x, y)
        assert torch.equal(got, torch.where(hi.abs() < lo.abs(), hi, lo)), n
    # divergence from the gathered buckets: X, X, Y, Y -> ||X - Y|| / ||X + Y|| over params
    x, y = ([t.double().reshape(-1) for n, t in res[i]["split_pre"] if n.startswith("param/")] for i in (0, 2))
    x, y = torch.cat(x), torch.cat(y)
    assert res[0]["split"]["report"].divergence == pytest.approx(float((x - y).norm() / (x + y).norm()), rel=1e-4)

    # broadcast copies the source exactly
    _assert_replicas_identical([r["bcast"] for r in res])
    _assert_same(res[0]["bcast"]["state"], res[2]["bcast_pre"])
    total = sum(t.numel() * t.element_size() for _, t in res[2]["bcast_pre"])
    buckets = sum(math.ceil(t.numel() * t.element_size() / 64) for _, t in res[2]["bcast_pre"])
    for r in res:
        rep = r["bcast"]["report"]
        assert rep.mode == "broadcast" and rep.source_ranks == [2]
        # fingerprints + finite flags + buckets + divergence
        assert 2 + total // 64 + 1 <= rep.collectives <= 2 + buckets + 1
    flags = 24 * len(res[2]["bcast_pre"])  # per tensor its NaN/Inf count, places and digest
    assert res[2]["bcast"]["report"].bytes_sent == 24 + flags + total + 8
    assert res[0]["bcast"]["report"].bytes_sent == 24 + flags + 8

    # a one-rank repair sent in many buckets lands each bucket in its place
    _assert_replicas_identical([r["p2p"] for r in res])
    _assert_same(res[3]["p2p"]["state"], res[0]["p2p_clean"])
    buckets = math.ceil(sum(t.numel() * t.element_size() for _, t in res[0]["p2p_clean"]) / 64)
    assert buckets > 1
    # fingerprints, finite flags, a send / receive per bucket on the pair only, divergence
    assert [r["p2p"]["report"].collectives for r in res] == [3 + buckets, 3, 3, 3 + buckets]

    # measure_divergence == hand computation
    params = [[t for n, t in r["div_state"] if n.startswith("param/")] for r in res]
    floats = [[t for _, t in r["div_state"] if t.is_floating_point()] for r in res]
    want, want_state = _rel_to_mean(params), _rel_to_mean(floats)
    for r in res:
        d = r["div"]
        assert d.per_rank == pytest.approx(want, rel=1e-9) and d.max == pytest.approx(max(want), rel=1e-9)
        assert d.state_per_rank == pytest.approx(want_state, rel=1e-9) and d.finite == [True] * 4
        name, worst, worst_rank = d.per_tensor[0]
        i = [n for n, _ in r["div_state"]].index(name)
        per = _rel_to_mean([[s[i][1]] for s in (x["div_state"] for x in res)])
        assert worst == pytest.approx(max(per), rel=1e-9) and worst_rank == [per.index(max(per))]
        assert [w for _, w, _ in d.per_tensor] == sorted((w for _, w, _ in d.per_tensor), reverse=True)
    want3 = _rel_to_mean(params[:3])
    for r in res:
        d = r["div_nan"]
        assert d.finite == [True, True, True, False] and d.per_tensor is None
        assert d.per_rank[:3] == pytest.approx(want3, rel=1e-9) and math.isinf(d.per_rank[3])


# ----------------------------------------------------------------------------
# 2 ranks: median with the reference; mean with Inf; reference checkpointing
# ----------------------------------------------------------------------------


def _w_two(rank: int, ws: int) -> dict:
    out: dict = {}
    for src in (ws, -1, True):  # a bool is no rank
        with pytest.raises(ValueError, match="src"):
            ReplicaSync(_model("mlp"), None, src=src)
    model = _model("bn")
    opt = _optim("adam", model.parameters())
    _train(model, opt, "bn", steps=2, seed=0)
    sync = ReplicaSync(model, opt)  # robust; identical replicas: the reference is agreed
    _train(model, opt, "bn", steps=1, seed=1)  # the same progress on both
    with torch.no_grad():
        if rank == 0:  # a normal drift everywhere
            gen = torch.Generator().manual_seed(5)
            for p in model.parameters():
                p.add_(1e-3 * torch.randn(p.shape, generator=gen))
        else:  # one flipped exponent
            _flip_exponent(model[4].weight, 7)
            out["flipped"] = model[4].weight.view(-1)[7].item()
    rep = sync.sync()
    out["ref"] = {"report": rep, "state": _snap(model, opt), "fp": _fp(model, opt)}
    out["noop"] = sync.sync()
    # checkpoint: a fresh ReplicaSync loading the state dict agrees with the old one. It
    # is built on replicas moved apart, so only a restored reference makes it agree.
    sd = sync.state_dict()
    assert sd["syncs"] == 2  # the repair and the no-op
    _train(model, opt, "bn", steps=1, seed=50 + rank)
    fresh = ReplicaSync(model, opt)
    fresh.load_state_dict(sd)
    assert fresh.syncs == 2
    got = fresh.state_dict()["reference"]
    assert got.keys() == sd["reference"].keys()
    assert all(torch.equal(got[k], sd["reference"][k]) for k in got)
    out["tags"] = (sync._reference.tag, fresh._reference.tag)
    with pytest.raises(ValueError, match="reference must map tensor names to tensors"):
        fresh.load_state_dict({**sd, "reference": list(sd["reference"].values())})
    fresh.load_state_dict({**sd, "world_size": 3, "reference": {}})  # elastic restart: ignored
    assert all(torch.equal(fresh.state_dict()["reference"][k], got[k]) for k in got)  # kept
    out["tags"] += (fresh._reference.tag,)

    # references that disagree (constructed on differing replicas): zero reference
    model = _model("mlp")
    opt = _optim("sgd", model.parameters())
    _train(model, opt, "mlp", steps=1, seed=rank)
    sync = ReplicaSync(model, opt)
    _train(model, opt, "mlp", steps=1, seed=2)
    out["disagree"] = {"report": sync.sync(), "state": _snap(model, opt), "fp": _fp(model, opt)}
    _train(model, opt, "mlp", steps=1, seed=rank)  # apart again: since that sync the references agree
    out["agree_again"] = {"report": sync.sync(), "state": _snap(model, opt), "fp": _fp(model, opt)}

    # A state check that the parameters and optimizer state agree keeps them as the
    # reference, never the buffers, which under DDP differ between ranks between syncs:
    # built while all agree, the buffers' reference stays the one both ranks hold ...
    model = _model("bn")
    opt = _optim("sgd", model.parameters())
    sync = ReplicaSync(model, opt)
    model(_batch("bn", torch.Generator().manual_seed(60 + rank)))  # each rank its own statistics
    sync.set_reference(state_fingerprint(model, opt, buffers=False))
    model(_batch("bn", torch.Generator().manual_seed(70 + rank)))
    out["checked"] = {"report": sync.sync(), "state": _snap(model, opt), "fp": _fp(model, opt)}
    # ... and built while the buffers differed, the references still disagree after it
    model = _model("bn")
    opt = _optim("sgd", model.parameters())
    model(_batch("bn", torch.Generator().manual_seed(60 + rank)))
    sync = ReplicaSync(model, opt)
    sync.set_reference(state_fingerprint(model, opt, buffers=False))
    model(_batch("bn", torch.Generator().manual_seed(70 + rank)))
    out["checked_apart"] = {"report": sync.sync(), "state": _snap(model, opt), "fp": _fp(model, opt)}

    # mean with Inf on rank 1: the finite replica's values
    model = _model("mlp")
    opt = _optim("sgd-momentum", model.parameters())
    _train(model, opt, "mlp", steps=2, seed=rank)
    out["mean_pre"] = _snap(model, opt)
    if rank == 1:
        with torch.no_grad():
            model[2].bias[1] = -math.inf
    report = ReplicaSync(model, opt, mode="mean").sync()
    out["mean"] = {"report": report, "state": _snap(model, opt), "fp": _fp(model, opt)}
    # finite float16 replicas whose sum overflows (40000 + 40992 > 65504): still finite
    # and a subnormal both ranks hold stays exactly itself (halving it first would round it to 0)
    half = nn.Linear(2, 1, bias=False).half()
    with torch.no_grad():
        half.weight.copy_(torch.tensor([[2.0**-24, 40000.0 + 992.0 * rank]]))
    out["half"] = ReplicaSync(half, None, mode="mean").sync(), half.weight.tolist()
    # no finite replica at all, identical or each its own NaN: a clear error on every
    # rank (no deadlock)
    for where in ((1,), (0, rank)):
        with torch.no_grad():
            (model[2].bias if len(where) == 1 else model[2].weight)[where] = math.nan
        with pytest.raises(RuntimeError, match="no replica is finite"):
            ReplicaSync(model, opt, mode="mean").sync()
    return out


def test_two_ranks_reference_median_mean_and_checkpoint():
    res = run_workers(_w_two, 2)
    assert abs(res[1]["flipped"]) > 1e30
    _assert_replicas_identical([r["ref"] for r in res])
    for r in res:
        rep = r["ref"]["report"]
        assert rep.mode == "median-with-reference" and rep.note == "" and rep.source_ranks == [0, 1]
        assert rep.divergence > 0.99  # relative to the mean of a 1e37 and a normal replica: ~1
        for n, t in r["ref"]["state"]:
            if t.is_floating_point():
                assert torch.isfinite(t).all() and t.abs().max() < 10, n  # the 1e37 never survives
        assert r["noop"].mode == "noop" and r["noop"].bytes_sent == 32  # fingerprints, structure, reference tag
        assert r["tags"][0] != 0 and r["tags"][0] == res[0]["tags"][0]
        assert r["tags"][1] == res[0]["tags"][1] == r["tags"][2]
    _assert_replicas_identical([r["disagree"] for r in res])
    assert res[0]["disagree"]["report"].note == "references disagree; used a zero reference"
    _assert_replicas_identical([r["agree_again"] for r in res])
    assert res[0]["agree_again"]["report"].mode == "median-with-reference"
    assert res[0]["agree_again"]["report"].note == ""  # the sync's tag: the same on both ranks
    for case in ("checked", "checked_apart"):  # a buffer reference of each rank's own would split them
        _assert_replicas_identical([r[case] for r in res])
    assert res[0]["checked"]["report"].note == "buffers only"
    assert res[0]["checked_apart"]["report"].note == "buffers only; references disagree; used a zero reference"

    _assert_replicas_identical([r["mean"] for r in res])
    _assert_same(res[1]["mean"]["state"], res[0]["mean_pre"])
    assert res[0]["mean"]["report"].source_ranks == [0]
    for r in res:
        report, weight = r["half"]
        assert weight == [[2.0**-24, 40512.0]] and report.mode == "mean"  # 40496 in float16
        # float16 is summed in float32 (where 80992 does not overflow: no second sum): the
        # all-reduce hands over 2 float32, 8 bytes, not the 4 of the float16 weight; plus
        # the control (24), the one tensor's flags (24) and the divergence (8)
        assert report.bytes_sent == 24 + 24 + 8 + 8
        assert 0 < report.divergence < 0.02  # 496 / 40496 on either rank


def _w_two_nan_alike(rank: int, ws: int) -> dict:
    torch.manual_seed(0)
    m = nn.Linear(3, 1, bias=False)
    sync = ReplicaSync(m, None)  # robust; the reference: the finite state both agree on
    with torch.no_grad():
        m.weight[0, 0] = math.nan  # both replicas: NaN here
        m.weight[0, 1] = math.nan if rank == 0 else 1.0  # rank 0 only: NaN here
        m.weight[0, 2] = 0.5 + rank
    rep = sync.sync()
    out = {"mode": rep.mode, "bits": m.weight.detach().view(torch.int32).clone(), "ref": sync._reference.tag}
    # the weight resized alike on both ranks (a vocabulary grown): the reference holds
    # nothing of its new shape, so 0 stands in for it and the smaller value wins
    m.weight = nn.Parameter(torch.full((1, 4), 0.25 + 0.5 * rank))
    out["resized"] = sync.sync().mode, m.weight.tolist()
    return out


def test_two_ranks_nan_on_both_replicas_stays_nan() -> None:
    """Both replicas NaN at one coordinate, the reference finite there: the median of
    three counted NaN as +inf and gave both ranks +inf, a value neither held."""
    res = run_workers(_w_two_nan_alike, 2)
    assert [r["mode"] for r in res] == ["median-with-reference"] * 2
    assert torch.equal(res[0]["bits"], res[1]["bits"]) and res[0]["ref"] == res[1]["ref"]  # bitwise
    w = res[0]["bits"].view(torch.float32)[0]
    assert math.isnan(w[0]) and w[1:].tolist() == [1.0, 0.5]  # NaN stays NaN; max(ref, 1.0); the lesser move
    assert [r["resized"] for r in res] == [("median-with-reference", [[0.25] * 4])] * 2


class _Stat(nn.Module):
    """A parameter and a statistic buffer that starts NaN at one coordinate on both ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 1)
        self.register_buffer("stat", torch.tensor([math.nan, 5.0, -1.0]))


def _w_reference_nan(rank: int, ws: int) -> list[float]:
    torch.manual_seed(0)
    m = _Stat()
    sync = ReplicaSync(m, None)  # the reference: NaN at stat[0], as both ranks held it
    with torch.no_grad():
        m.stat.copy_(torch.tensor([1.0 + rank, 5.0, -1.0 - rank]))  # reset, then each rank its own
    rep = sync.sync()
    assert (rep.mode, rep.note) == ("median-with-reference", "buffers only")
    return m.stat.tolist()


def test_two_ranks_a_nan_only_the_reference_holds_is_not_copied_in() -> None:
    """Both replicas finite, so the median skipped its NaN pass, and min/max carried the
    reference's NaN onto both ranks: a NaN neither held. It counts as +inf: the larger."""
    assert run_workers(_w_reference_nan, 2) == [[2.0, 5.0, -1.0]] * 2


class _Flagged(nn.Module):
    """A parameter and a frozen bool one (bool travels as uint8). A parameter, not a
    buffer: start() syncs buffers blocking, so only the state part meets finish()'s
    correction, whose bool rule this exercises."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.flag = nn.Parameter(torch.zeros(2, dtype=torch.bool), requires_grad=False)


def _w_two_edges(rank: int, ws: int) -> dict:
    out: dict = {}
    # broadcast from a source holding NaN: the lowest finite rank is copied instead
    model = _model("mlp", seed=rank)
    if rank == 0:
        with torch.no_grad():
            model[0].weight[0, 0] = math.nan
    rep = ReplicaSync(model, None, mode="broadcast", src=0).sync()
    out["broadcast"] = {"report": rep, "state": _snap(model, None), "fp": _fp(model, None)}
    with torch.no_grad():  # and none finite (each rank its own NaN): a clear error on every rank
        model[0].weight[0, rank] = math.nan
    with pytest.raises(RuntimeError, match="no replica is finite"):
        ReplicaSync(model, None, mode="broadcast").sync()

    # robust, world size 2, rank 1 all NaN: rank 0's replica is copied as it is
    model = _model("mlp")
    opt = _optim("sgd", model.parameters())
    sync = ReplicaSync(model, opt)  # reference: the initial state
    _train(model, opt, "mlp", steps=2, seed=3)  # progress the reference median would undo
    out["healthy"] = _snap(model, opt)
    if rank == 1:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(math.nan)
    rep = sync.sync()
    out["finite_copy"] = {"report": rep, "state": _snap(model, opt), "fp": _fp(model, opt)}

    # an overlapped no-op while the replicas move apart: the next reference is the
    # state agreed at start(), so the following blocking sync still ends identical
    model = _model("mlp")
    opt = _optim("sgd", model.parameters())
    sync = ReplicaSync(model, opt)
    _train(model, opt, "mlp", steps=1, seed=0)  # optimizer state the reference has not seen: packed anew
    sync.sync()
    where = {n: t.data_ptr() for n, t in sync._reference.tensors.items()}
    sync.start()
    _train(model, opt, "mlp", steps=1, seed=rank)  # rank-dependent progress in the window
    done = sync.finish()
    out["noop_mode"] = (done.mode, done.overlapped)  # nothing moved behind the step: not "overlapped"
    # the same tensors as the reference holds: copied into them, not a fresh copy of the state
    out["noop_in_place"] = {n: t.data_ptr() for n, t in sync._reference.tensors.items()} == where
    rep = sync.sync()
    out["after_noop"] = {"report": rep, "state": _snap(model, opt), "fp": _fp(model, opt)}

    # BatchNorm statistics from each rank's own batch, parameters alike: the buffers only
    model = _model("bn")
    opt = _optim("adam", model.parameters())
    _train(model, opt, "bn", steps=1, seed=0)  # the same on both ranks
    sync = ReplicaSync(model, opt)  # the reference: the state both agree on
    ref = [b.clone() for b in model.buffers()]
    sync.sync()  # a no-op keeps the reference anew, the buffers' beside the rest's
    model(_batch("bn", torch.Generator().manual_seed(10 + rank)))  # a forward updates the stats
    before = [gather_buffers(model, r) for r in range(ws)]
    rep = sync.sync()
    out["bn"] = {"report": rep, "state": _snap(model, opt), "fp": _fp(model, opt), "ref": ref, "before": before,
                 "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
                 "buffers": len(list(model.buffers()))}

    # a bool set during an overlapped sync stays a valid bool
    torch.manual_seed(0)
    model = _Flagged()
    with torch.no_grad():
        model.w[0] = 1.0 + rank  # the replicas differ
    model.flag[0] = rank == 0
    sync = ReplicaSync(model, None, mode="broadcast", src=0)
    sync.start()
    if rank == 1:
        model.flag[0] = True  # where the sync carries rank 0's True: synced + (live - snapshot) = 2
    model.flag[1] = True  # set on both in the window, where the sync carries False: the live True
    sync.finish()
    out["flag_bytes"] = model.flag.view(torch.uint8).tolist()
    return out


def test_two_ranks_nan_source_finite_copy_noop_reference_and_bool_overlap():
    res = run_workers(_w_two_edges, 2)
    _assert_replicas_identical([r["broadcast"] for r in res])
    for r in res:
        rep = r["broadcast"]["report"]
        assert rep.mode == "broadcast" and rep.source_ranks == [1]
        assert rep.note == "source rank 0 is non-finite; copied rank 1"
        assert all(torch.isfinite(t).all() for _, t in r["broadcast"]["state"])
    _assert_replicas_identical([r["finite_copy"] for r in res])
    _assert_same(res[1]["finite_copy"]["state"], res[0]["healthy"])  # exactly rank 0's bits
    assert res[1]["finite_copy"]["report"].mode == "finite-copy"
    assert res[1]["finite_copy"]["report"].note == "non-finite ranks [1] excluded"
    assert [r["noop_mode"] for r in res] == [("noop", False), ("noop", False)]
    assert all(r["noop_in_place"] for r in res)
    _assert_replicas_identical([r["after_noop"] for r in res])
    assert res[0]["after_noop"]["report"].mode == "median-with-reference"
    assert res[0]["flag_bytes"] == [1, 1] and res[1]["flag_bytes"] == [1, 1]  # never 2
    _assert_replicas_identical([r["bn"] for r in res])
    for r in res:
        rep = r["bn"]["report"]
        assert rep.mode == "median-with-reference" and rep.note == "buffers only"
        # fingerprints + structure + tag, NaN/Inf count and places per buffer, the buffers (their
        # divergence is not measured: no max to exchange)
        assert rep.bytes_sent == 32 + 24 * r["bn"]["buffers"] + r["bn"]["buffer_bytes"] and rep.divergence == 0.0
        # per coordinate the median of the two replicas and the buffers both last agreed on
        got = [t for n, t in r["bn"]["state"] if n.startswith("buffer/")]
        for g, ref, a, b in zip(got, r["bn"]["ref"], *r["bn"]["before"], strict=True):
            assert torch.equal(g, torch.clamp(ref, torch.minimum(a, b), torch.maximum(a, b)))


# ----------------------------------------------------------------------------
# 16-bit state, aliased state, float64 past float64's squares
# ----------------------------------------------------------------------------


def _one_ulp_apart(rank: int, ws: int, dtype_name: str) -> dict[str, Any]:
    """Each rank moves its own coordinate of a 16-bit model by one ulp (no majority):
    (exact float64 divergence, the sync's) per mode; and, with replicas apart, (what an
    overlapped mean with a step in its window left, what the blocking mean then the
    step leaves) as "overlap"."""
    dtype = getattr(torch, dtype_name)
    out: dict[str, Any] = {}
    torch.manual_seed(rank)
    lin = nn.Linear(16, 4).to(dtype)
    pre = _snap(lin, None)
    sync = ReplicaSync(lin, None, mode="mean")
    sync.sync()
    synced = _snap(lin, None)
    _restore(lin, None, pre)
    sync.start()
    with torch.no_grad():
        for p in lin.parameters():
            p.add_(torch.full_like(p, 0.1 * (rank + 1)))
    stepped = _snap(lin, None)
    sync.finish()
    out["overlap"] = (_snap(lin, None), _corrected(synced, stepped, pre))
    for mode in ("robust", "mean"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8)).to(dtype)
        with torch.no_grad():
            flat = model[0].weight.view(-1)
            flat[rank] = torch.nextafter(flat[rank : rank + 1], torch.tensor([10.0], dtype=dtype))[0]
        exact = measure_divergence(model).max
        out[mode] = (exact, ReplicaSync(model, None, mode=mode).sync().divergence)
    return out


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_sixteen_bit_divergence_matches_the_float64_measure_and_a_mean_corrects_in_their_dtype(dtype: str) -> None:
    # The mean divided in the parameters' dtype moved agreed values by an ulp: a floor
    # of 2.7e-4 (float16) or 2.1e-3 (bfloat16) where the replicas differ by 1e-5, above
    # PAFT-Dyn's target, so H fell to its minimum; the median's centre rounded by ~1.3x.
    res = run_workers(_one_ulp_apart, 3, dtype)
    for mode in ("robust", "mean"):
        exact, reported = res[0][mode]
        assert reported == pytest.approx(exact, rel=1e-3), mode
    # the correction adds the step to the synced 16-bit values, as the step after a
    # blocking sync does (not to the float32 mean, rounded once with the step)
    for r in res:
        _assert_same(*r["overlap"])


class _MasterSGD(torch.optim.Optimizer):
    """SGD through a master copy kept in the state, which for a float32 parameter is
    the parameter itself: optimizer state aliasing a parameter."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                st.setdefault("master", p if p.dtype == torch.float32 else p.detach().float())
                st["master"].add_(p.grad.float(), alpha=-g["lr"])
                if st["master"] is not p:
                    p.copy_(st["master"])


def _unit_step(m: nn.Module, opt: torch.optim.Optimizer) -> None:
    for p in m.parameters():
        p.grad = torch.ones_like(p)  # what DDP hands every rank alike
    opt.step()


def _aliased(rank: int, ws: int, case: str) -> dict[tuple[str, bool], Any]:
    """Rank 2's weight off by +64 (dyadic values: every path is exact); a sync, blocking
    or overlapped with an optimizer step; the parameters after it, per (mode, overlapped),
    and the tensors a blocking sync found differing, per (mode, "differing")."""
    out = {}
    for mode in ("robust", "mean"):
        for overlap in (False, True):
            m = nn.Module()
            m.a = nn.Linear(4, 2)
            with torch.no_grad():
                m.a.weight.copy_(torch.arange(8.0).view(2, 4))
                m.a.bias.copy_(torch.tensor([1.0, 2.0]))
            if case == "two-parameters-one-storage":
                m.b = nn.Linear(4, 2)
                m.b.weight = nn.Parameter(m.a.weight)
                with torch.no_grad():
                    m.b.bias.zero_()
                opt: torch.optim.Optimizer = torch.optim.SGD(m.parameters(), lr=0.25)
            elif case == "a-parameter-over-a-view":  # the same memory, another shape: not left out
                m.flat = nn.Parameter(m.a.weight.detach().view(-1))
                opt = torch.optim.SGD(m.parameters(), lr=0.25)
            elif case == "two-parameters-apart-in-one-storage":  # alike but for their offset: not left out
                base = torch.zeros(16)
                base[8:] = m.a.weight.detach().view(-1)
                m.lo = nn.Parameter(base[:8].view(2, 4))  # the module's own: listed before m.a's
                m.a.weight = nn.Parameter(base[8:].view(2, 4))
                opt = torch.optim.SGD(m.parameters(), lr=0.25)
            else:
                opt = _MasterSGD(m.parameters(), lr=0.25)

            if case == "state-is-the-parameter":
                _unit_step(m, opt)  # creates the state, alike on every rank
            if rank == 2:
                with torch.no_grad():
                    m.a.weight.view(-1)[3] += 64.0
            sync = ReplicaSync(m, opt, mode=mode)
            if overlap:
                sync.start()
                _unit_step(m, opt)
                sync.finish()
            else:
                out[mode, "differing"] = list(sync.sync().differing)
                _unit_step(m, opt)
            out[mode, overlap] = torch.cat([p.detach().flatten() for p in m.parameters()])
    return out


@pytest.mark.parametrize("case", ["two-parameters-one-storage", "a-parameter-over-a-view", "state-is-the-parameter",
                                  "two-parameters-apart-in-one-storage"])
def test_overlapped_correction_of_aliased_tensors_equals_blocking(case: str) -> None:
    # Corrected once per alias, the progress of the step was added twice: robust mode
    # left rank 2 at -61.5 instead of 2.5, and mean mode split the replicas.
    out = run_workers(_aliased, 3, case)
    # each memory once: an exact alias (another Parameter over it, optimizer state that
    # is the parameter) is neither listed nor sent again
    differing = {"a-parameter-over-a-view": ["param/flat", "param/a.weight"]}.get(case, ["param/a.weight"])
    for mode in ("robust", "mean"):
        assert out[0][mode, "differing"] == differing
        for r in range(3):
            assert torch.equal(out[r][mode, True], out[0][mode, False]), (mode, r)


def _nan_in_the_window(rank: int, ws: int, mode: str) -> torch.Tensor:
    torch.manual_seed(0)
    m = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        if rank == ws - 1:
            m.weight.add_(1.0)  # the minority replica: it receives, the others hold the result
        m.weight[0, 2] = -0.0  # agreed, and untouched in the window: its bits, sign included
        m.weight[0, 3] = -3e38 if rank == ws - 1 else 3e38
    sync = ReplicaSync(m, None, mode=mode)
    sync.start()
    with torch.no_grad():
        m.weight[0, 0] = float("nan")  # the step in the window goes NaN, on every rank
        if rank == ws - 1 and mode != "mean":  # (mean: every rank receives 0 there, and moves it apart)
            m.weight[0, 3] += 3e38  # the receiver's own step to 0: synced 3e38 + (0 - -3e38) overflows
    sync.finish()
    return m.weight.detach().clone()


@pytest.mark.parametrize("ws,mode", [(3, "robust"), (2, "broadcast"), (2, "mean")])
def test_a_nan_the_window_made_stays_on_every_rank(ws: int, mode: str) -> None:
    # The ranks holding the result keep their live NaN; the receivers fell back to the
    # synced value where their correction was NaN: the ranks ended disagreeing (in mean
    # mode, where every rank receives, the NaN vanished silently).
    # An untouched -0.0 must keep its sign (synced + (w - snapshot) is +0.0 there):
    # the replicas' fingerprints would differ and the next sync repair again. A
    # correction that overflows takes the synced value, never inf.
    out = run_workers(_nan_in_the_window, ws, mode)
    for w in out:
        assert math.isnan(w[0, 0]) and torch.equal(w[0, 1:].view(torch.int32), out[0][0, 1:].view(torch.int32))
        assert math.copysign(1.0, w[0, 2]) == -1.0 and math.isfinite(w[0, 3]), (mode, out)


def _huge_float64_scalar(rank: int, ws: int) -> dict[str, float]:
    out = {}
    for mode in ("robust", "mean"):
        torch.manual_seed(0)
        m = nn.Module()
        m.lin = nn.Linear(4, 4)
        m.temp = nn.Parameter(torch.tensor([0.05], dtype=torch.float64))
        if rank == 2:
            with torch.no_grad():
                m.temp.view(torch.int64)[0] ^= 1 << 62  # 0.05 -> 9e306: finite, its square is not
        ReplicaSync(m, None, mode=mode).sync()
        out[mode] = float(m.temp)
    return out


def test_a_finite_value_whose_square_overflows_float64_is_synced() -> None:
    # The divergence squared a Python float: OverflowError on one rank, the others hung.
    out = run_workers(_huge_float64_scalar, 3, timeout=120)
    assert all(o["robust"] == 0.05 for o in out)
    assert len({o["mean"] for o in out}) == 1


# ----------------------------------------------------------------------------
# A NaN/Inf every replica holds alike is state: an attention mask's -inf
# ----------------------------------------------------------------------------


class _Masked(nn.Module):
    """A causal mask buffer of -inf above the diagonal, as many transformers register
    it, beside a BatchNorm (whose buffers differ between ranks under DDP)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("mask", torch.full((4, 4), -math.inf).triu(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x)) + self.mask.exp().sum(0)  # exp(-inf) = 0


def _w_mask(rank: int, ws: int) -> dict:
    out: dict = {}
    # The last rank's mask lost a -inf (a flipped bit): with 3 ranks the majority's is put
    # back; with 2, the median with the last agreed buffers (it used to take the copy with
    # fewer NaN/Inf, the damaged one, as the sound one, and spread it).
    model = _masked_model(0)
    sync = ReplicaSync(model, None)  # built while the replicas agree: the 2-rank reference
    if rank == ws - 1:
        with torch.no_grad():
            model.mask[0, 3] = -1.0
    out["lost_inf"] = sync.sync(), model.mask.clone()
    # states that differ in structure cannot be measured: a clear error on every rank
    model = _masked_model(0)
    opt = torch.optim.Adam(model.parameters())
    if rank == 1:
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    try:
        measure_divergence(model, opt)
    except RuntimeError as e:
        out["structure"] = str(e)
    for mode in ("robust", "mean", "broadcast"):
        model = _masked_model(rank)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.randn(8, 4)).sum().backward()  # each rank its own BatchNorm statistics
        opt.step()
        out[f"{mode}_noop"] = ReplicaSync(_masked_model(0), None, mode=mode).sync().mode
        report = ReplicaSync(model, opt, mode=mode).sync()
        out[mode] = {"report": report, "state": _snap(model, opt), "fp": _fp(model, opt)}
    # a NaN of one rank's own, in the mask's finite part, is still corruption
    model = _masked_model(rank)
    with torch.no_grad():
        if rank == 1:
            model.mask[3, 0] = math.nan
    report = ReplicaSync(model, None, mode="mean").sync()
    out["extra_nan"] = {"report": report, "state": _snap(model, None), "fp": _fp(model, None)}
    # the divergence: identical replicas measure 0; a NaN in one rank's BatchNorm
    # statistics makes its state, not its parameters, infinitely far
    model = _masked_model(0)
    out["div_same"] = measure_divergence(model)
    with torch.no_grad():
        if rank == 1:
            model.bn.running_var[0] = math.nan
    out["div_bn_nan"] = measure_divergence(model)
    sync = ReplicaSync(model, None)
    sync.start()
    out["in_flight"] = []
    for call in (sync.state_dict, sync.sync, sync.start, functools.partial(sync.set_reference, 0)):
        try:
            call()
        except RuntimeError as e:
            out["in_flight"].append(str(e))
    sync.finish()
    try:
        sync.finish()
    except RuntimeError as e:
        out["in_flight"].append(str(e))
    # a ReplicaSync dropped takes its optimizer hook with it
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = ReplicaSync(model, opt)
    out["hooks"] = [len(opt._optimizer_step_post_hooks)]
    del sync
    gc.collect()
    out["hooks"].append(len(opt._optimizer_step_post_hooks))
    return out


def _masked_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return _Masked()


@pytest.mark.parametrize("ws", [2, 3])
def test_a_mask_every_replica_holds_is_state_not_corruption(ws: int):
    res = run_workers(_w_mask, ws)
    mask = torch.full((4, 4), -math.inf).triu(1)
    for mode in ("robust", "mean", "broadcast"):
        assert [r[f"{mode}_noop"] for r in res] == ["noop"] * ws  # mean raised "no replica is finite"
        _assert_replicas_identical([r[mode] for r in res])
        state = dict(res[0][mode]["state"])
        assert torch.equal(state["buffer/mask"], mask)
        report = res[0][mode]["report"]
        assert report.mode != "noop" and "non-finite" not in report.note
        assert math.isfinite(report.divergence)  # PAFT-Dyn was pinned at --h-min by an inf here
    report = res[0]["extra_nan"]["report"]
    assert report.mode == "mean" and report.note == "buffers: mean (non-finite ranks [1] excluded)"
    assert math.isinf(report.divergence)  # a NaN of one rank's own in its buffers: infinitely far
    _assert_replicas_identical([r["extra_nan"] for r in res])
    assert torch.equal(dict(res[1]["extra_nan"]["state"])["buffer/mask"], mask)
    for r in res:
        assert (r["div_same"].max, r["div_same"].state_max) == (0.0, 0.0) and r["div_same"].finite == [True] * ws
        d = r["div_bn_nan"]
        assert d.per_rank == [0.0] * ws and d.state_per_rank[0] == 0.0 and math.isinf(d.state_per_rank[1])
        assert d.finite == [r != 1 for r in range(ws)]
        assert "differ in structure" in r["structure"]
        report, got = r["lost_inf"]
        assert torch.equal(got, mask)
        if ws == 3:
            assert report.mode == "majority-copy" and report.source_ranks == [0]
        else:
            assert report.mode == "median-with-reference"
            assert report.note == "buffers only; non-finite ranks [0] outvoted where non-finite"
        # while a sync is in flight every call that would read or move the state is refused
        names = ["state_dict", "sync", "start", "set_reference"]
        assert [m.split("(")[0] for m in r["in_flight"]] == [f"ReplicaSync.{n}" for n in [*names, "finish"]]
        assert all("in flight" in m for m in r["in_flight"])
        assert r["hooks"] == [1, 0]


# ----------------------------------------------------------------------------
# Under DDP the buffers follow DDP's own rule: its source rank's
# ----------------------------------------------------------------------------


def _w_ddp_buffers(rank: int, ws: int) -> dict:
    out: dict = {}
    torch.manual_seed(0)
    ddp = nn.parallel.DistributedDataParallel(_model("bn"))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    sync = ReplicaSync(ddp, opt)
    for case in ("clean", "nan_at_source"):
        torch.manual_seed(rank)  # each rank its own batch: its own BatchNorm statistics
        ddp(torch.randn(4, 2, 4, 4)).sum().backward()
        opt.step()
        if case == "nan_at_source" and rank == 0:
            with torch.no_grad():
                ddp.module[1].running_mean[0] = math.nan
        out[f"{case}_source"] = [b.clone() for b in gather_buffers(ddp, 0)]
        out[f"{case}_rank1"] = gather_buffers(ddp, 1)
        report = sync.sync()
        out[case] = {"report": report, "state": _snap(ddp, opt), "fp": _fp(ddp, opt)}
    # without broadcast_buffers DDP leaves each rank its own buffers: no source to follow
    out["source_without_broadcast"] = ReplicaSync(DistributedDataParallel(_model("bn"), broadcast_buffers=False),
                                                  None)._buffer_src
    return out


def gather_buffers(ddp: nn.Module, src: int) -> list[torch.Tensor]:
    """Rank ``src``'s buffers, on every rank."""
    bufs = [b.detach().clone() for b in ddp.buffers()]
    for b in bufs:
        torch.distributed.broadcast(b, src)
    return bufs


@pytest.mark.parametrize("ws", [2, 3])
def test_under_ddp_a_sync_gives_every_rank_the_buffers_ddp_would(ws: int):
    res = run_workers(_w_ddp_buffers, ws)
    assert [r["source_without_broadcast"] for r in res] == [None] * ws
    _assert_replicas_identical([r["clean"] for r in res])
    report = res[0]["clean"]["report"]
    assert report.note == "buffers only; DDP's buffer source, rank 0", report
    buffers = [t for n, t in res[0]["clean"]["state"] if n.startswith("buffer/")]
    assert all(torch.equal(a, b) for a, b in zip(buffers, res[0]["clean_source"], strict=True))
    # the source's buffers hold a NaN of their own: robust mode's own rule, as without DDP
    _assert_replicas_identical([r["nan_at_source"] for r in res])
    report = res[0]["nan_at_source"]["report"]
    assert report.mode == ("median-with-reference" if ws == 2 else "median") and "non-finite ranks [0]" in report.note
    if ws == 2:  # the sound rank's buffers exactly, as a copy of them gave (a NaN is never state)
        buffers = [t for n, t in res[0]["nan_at_source"]["state"] if n.startswith("buffer/")]
        assert all(torch.equal(a, b) for a, b in zip(buffers, res[0]["nan_at_source_rank1"], strict=True))


def _w_ddp_subgroups(rank: int, ws: int) -> dict:
    """DDP over halves of the world, or over the world with a sync per half."""
    halves = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]
    half = halves[rank // 2]
    out: dict = {}
    for case, ddp_group, sync_group in (("ddp_halves", half, None), ("sync_halves", None, half)):
        torch.manual_seed(0)
        ddp = nn.parallel.DistributedDataParallel(_model("bn"), process_group=ddp_group)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        sync = ReplicaSync(ddp, opt, group=sync_group)
        torch.manual_seed(rank)  # each rank its own batch: its own BatchNorm statistics
        ddp(torch.randn(4, 2, 4, 4)).sum().backward()
        opt.step()
        out[case] = {"source": sync._buffer_src, "report": sync.sync(), "fp": _fp(ddp, opt)}
    # a sync over ranks 1-3 only: its one-rank repair goes point to point between the
    # global ranks of group ranks 0 and 2
    trio = torch.distributed.new_group([1, 2, 3])
    if rank > 0:
        model = _model("mlp")
        opt = _optim("sgd", model.parameters())
        _train(model, opt, "mlp", steps=1, seed=0)
        out["trio_clean"] = _snap(model, opt)
        if rank == 3:
            _flip_exponent(model[0].weight, 2)
        out["trio"] = {"report": ReplicaSync(model, opt, group=trio).sync(), "state": _snap(model, opt),
                       "fp": _fp(model, opt)}
    return out


def test_ddp_buffer_source_is_used_only_where_every_rank_of_the_sync_names_it():
    """DDP over each half names rank 0 on one half and rank 2 on the other: a sync over
    the world has no one source, and its buffers take robust mode's median (as do the
    parameters, which differ between the halves). DDP over the world with a sync per
    half: the half holding rank 0 copies it, the other has no source of its own and
    takes a two-rank sync's median with its reference."""
    res = run_workers(_w_ddp_subgroups, 4, timeout=120)  # a send to the wrong rank hangs
    assert [r["ddp_halves"]["source"] for r in res] == [None] * 4
    assert len({r["ddp_halves"]["fp"] for r in res}) == 1
    assert all(r["ddp_halves"]["report"].note == "buffers: median" for r in res), res[0]
    assert [r["sync_halves"]["source"] for r in res] == [0, 0, None, None]
    assert res[0]["sync_halves"]["report"].note == "buffers only; DDP's buffer source, rank 0"
    assert res[2]["sync_halves"]["report"].mode == "median-with-reference"
    for pair in ((0, 1), (2, 3)):
        assert len({res[r]["sync_halves"]["fp"] for r in pair}) == 1
    _assert_replicas_identical([r["trio"] for r in res[1:]])
    _assert_same(res[3]["trio"]["state"], res[3]["trio_clean"])
    state_bytes = sum(t.numel() * t.element_size() for _, t in res[1]["trio_clean"])
    for r in res[1:]:
        rep = r["trio"]["report"]
        assert rep.mode == "majority-copy" and rep.groups == [[0, 1], [2]] and rep.source_ranks == [0]
    sent = [r["trio"]["report"].bytes_sent - 24 - 24 * len(res[1]["trio_clean"]) - 8 for r in res[1:]]
    assert sent == [state_bytes, 0, 0]  # the source alone sends, to the one rank it repairs


# ----------------------------------------------------------------------------
# A median's gathers: a bucket ahead of the merge, not every replica's state at once
# ----------------------------------------------------------------------------


def _w_gathers_in_flight(rank: int, ws: int) -> dict[str, Any]:
    """Replicas that all differ (no majority: the median), 16 buckets of 4 KB: the most
    all-gathers launched and not yet waited for, blocking and overlapped, and the
    synced state either way."""
    from paft import collectives

    in_flight, most = [0], [0]
    real = collectives._all_gather_single

    class Counted:  # the gather's work, counted out when it is waited for
        def __init__(self, work: Any) -> None:
            self.work = work

        def wait(self, *a: Any) -> Any:
            in_flight[0] -= 1
            return self.work.wait(*a)

    def counted(*args: Any, **kwargs: Any) -> Any:
        in_flight[0] += 1
        most[0] = max(most[0], in_flight[0])
        return Counted(real(*args, **kwargs))

    collectives._all_gather_single = counted
    try:
        out: dict[str, Any] = {}
        for how in ("blocking", "overlapped"):
            torch.manual_seed(0)
            model = nn.Linear(128, 128, bias=False)  # 64 KB
            with torch.no_grad():
                model.weight.add_(rank * 1e-3)
            sync = ReplicaSync(model, None, mode="robust", bucket_mb=4 / 1024)  # no majority: the median
            most[0] = 0
            report = sync.sync() if how == "blocking" else (sync.start(), sync.finish())[1]
            out[how] = (most[0], report.collectives, model.weight.detach().clone())
        return out
    finally:
        collectives._all_gather_single = real


def test_a_blocking_median_gathers_a_bucket_ahead_of_the_merge() -> None:
    # All buckets gathered at once held every replica's whole state (7x a 100 MB state at
    # three ranks); blocking, the gathers run a bucket ahead of the merge. The result is
    # the same bits either way.
    out = run_workers(_w_gathers_in_flight, 3)
    for o in out:
        assert o["blocking"][0] == 2 and o["overlapped"][0] == 16
        assert o["blocking"][1] == o["overlapped"][1]
        assert torch.equal(o["blocking"][2], o["overlapped"][2])
        assert torch.equal(o["blocking"][2], out[0]["blocking"][2])
