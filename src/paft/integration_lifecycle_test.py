"""protect() under setups real users have, beside plain DDP.

Each setup -- bfloat16 parameters, autocast, a channels_last conv model (parameters
with non-standard strides), an evaluation forward between steps -- is run on 3 gloo
ranks for a few steps and checked for: (b) a fault-free monitored run bitwise equal
to plain DDP (parameters and optimizer state); (c) an aggregation fault repaired by
PAFT-Sync / PAFT-Dyn to bitwise identical replicas, the majority's bits; (d) a
transient local-gradient fault recomputed by the guard to the fault-free run's bits.
protect_test.py trains one contiguous float32 MLP; these are the setups it does not
reach.

Then a protector's lifetime: protect() again on a model whose protector lives, or was
dropped (refused, as docs/LIBRARY.md says), the resume on a new DDP model that the
refusal names, and plain DDP after a protector is dropped; and a closure that raises
on one rank (a user's bug), as plain DDP: the others wait for the group's timeout.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import gc
import pathlib
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paft.config import GuardConfig, ProtectConfig
from paft.protect import protect
from paft.protect_test import batch, toy_closure, toy_model
from paft.records import RunRecorder, read_jsonl
from paft.state import state_fingerprint
from paft.testing import run_workers, take_step


def conv_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.Tanh(), nn.Conv2d(8, 4, 3), nn.Tanh(),
                         nn.Flatten(), nn.Linear(4 * 4 * 4, 1))


def conv_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(8, 3, 6, 6, generator=g)
    return x, x[:, 0, :2, :2].sum((1, 2)).unsqueeze(1) * 0.25 + 0.1 * torch.randn(8, 1, generator=g)


def train(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Train the setup ``opts`` names for ``steps`` (plain DDP with ``plain``)."""
    steps, dtype, conv = opts.get("steps", 8), opts.get("dtype", torch.float32), opts.get("model") == "conv"
    fmt = torch.channels_last if opts.get("channels_last") else torch.contiguous_format
    module = (conv_model() if conv else toy_model(batchnorm=opts.get("batchnorm", False))).to(dtype)
    module = module.to(memory_format=fmt)
    model = DistributedDataParallel(module)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    protector = None if opts.get("plain") else protect(
        model, optimizer, protect=ProtectConfig(**opts.get("protect", {})),
        guard=GuardConfig(**opts.get("guard", {})), inject=opts.get("inject", []), seed=3)
    synced, evals_in_flight = [], 0
    for step in range(steps):
        x, y = conv_batch(rank, step) if conv else batch(rank, step)
        x, y = x.to(dtype).contiguous(memory_format=fmt) if conv else x.to(dtype), y.to(dtype)

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            optimizer.zero_grad(set_to_none=True)
            autocast = torch.autocast("cpu", dtype=torch.bfloat16) if opts.get("autocast") else contextlib.nullcontext()
            with autocast:
                out = model(x)
            loss = nn.functional.mse_loss(out.float(), y.float())
            loss.backward()
            return loss

        r = take_step(protector, optimizer, closure)
        if r is not None:
            synced.append(r.synced)
        if opts.get("eval_between"):  # an evaluation pass, as a validation loop makes one
            evals_in_flight += protector is not None and protector.resync.in_flight
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
    in_flight = protector is not None and protector.resync.in_flight
    if protector is not None:
        protector.close()
    return {
        "params": [p.detach().clone() for p in model.module.parameters()],
        "strides": [p.stride() for p in model.module.parameters()],
        "fingerprint": state_fingerprint(model, optimizer, buffers=False),
        "with buffers": state_fingerprint(model, optimizer),
        "synced": synced,
        "in flight at the end": in_flight,
        "evals in flight": evals_in_flight,
        "counters": protector.counters if protector is not None else {},
    }


def equal(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Parameters and optimizer state bit for bit."""
    return a["fingerprint"] == b["fingerprint"] and all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))


OVERLAPPED_DYN = {"mode": "dyn", "sync_period": 2, "h_min": 1}
SETUPS = {
    "bfloat16": {"dtype": torch.bfloat16},
    "autocast": {"autocast": True},
    "channels_last": {"model": "conv", "channels_last": True},
}
# bit 30 of a float32 is its exponent's top bit; a bfloat16's is bit 14
TOP_EXPONENT_BIT = {"bfloat16": 14, "autocast": 30, "channels_last": 30}


@pytest.mark.parametrize("setup", SETUPS)
def test_a_setup_trains_as_plain_ddp_and_its_faults_are_repaired_to_the_fault_free_bits(setup: str) -> None:
    base, bit = SETUPS[setup], TOP_EXPONENT_BIT[setup]
    plain = run_workers(train, 3, {**base, "plain": True})
    monitored = run_workers(train, 3, base)
    for p, m in zip(plain, monitored):  # (b)
        assert equal(p, m)
    assert equal(plain[0], plain[2])
    aggregation = [f"bitflip:steps=3,bits={bit},ranks=1"]
    # Dyn's overlapped syncs at steps 2 and 4, a blocking repair at step 3; PAFT-Sync's
    # overlapped one after every step (their writes into channels_last parameters)
    for protect_cfg in (OVERLAPPED_DYN, {"mode": "sync", "sync_period": 1}):  # (c)
        out = run_workers(train, 3, {**base, "inject": aggregation, "protect": protect_cfg})
        assert out[1]["counters"]["faults_injected"] == 1 and out[0]["counters"]["syncs"] >= 3
        for o in out:  # the majority's bits: ranks 0 and 2 never saw the fault
            assert equal(o, plain[0]), protect_cfg
            assert o["strides"] == plain[0]["strides"]
    local = [f"bitflip:site=local-grad,steps=4,bits={bit},ranks=1"]
    guarded = run_workers(train, 3, {**base, "inject": local, "guard": {"enabled": True, "warmup": 2}})
    assert guarded[0]["counters"]["recomputes"] >= 1
    for g in guarded:  # (d)
        assert equal(g, plain[0])


def test_an_evaluation_forward_while_an_overlapped_sync_is_in_flight_changes_nothing() -> None:
    # BatchNorm: DDP's evaluation forward broadcasts the buffers, a collective of its own
    # beside the sync's in flight
    opts = {"batchnorm": True, "protect": OVERLAPPED_DYN, "inject": ["bitflip:steps=3,bits=30,ranks=1"]}
    evaluated = run_workers(train, 3, {**opts, "eval_between": True})
    assert evaluated[0]["evals in flight"] >= 2
    for e, u in zip(evaluated, run_workers(train, 3, opts)):
        assert equal(e, u) and e["with buffers"] == u["with buffers"]
    assert evaluated[0]["with buffers"] == evaluated[1]["with buffers"] == evaluated[2]["with buffers"]


def _w_lifecycle(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Steps 0-3 protected (an aggregation fault on rank 1 at step 3, which Dyn repairs),
    then, by ``then``: ``steps`` on with that protector; ``reprotect``: close(), drop it and
    protect a new DDP model of the same module from its state_dict(), primed, as
    protect()'s refusal says; ``plain``: drop it, unclosed, and step on without paft."""
    model = DistributedDataParallel(toy_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    protect_cfg = ProtectConfig(**opts.get("protect", OVERLAPPED_DYN))
    inject = [f"bitflip:steps={opts.get('fault_at', 3)},bits=30,ranks=1"]
    protector = protect(model, optimizer, protect=protect_cfg, inject=inject, seed=3)
    out: dict[str, Any] = {}
    for step in range(8):
        if step == 4 and opts["then"] != "steps":
            out["in flight"] = protector.resync.in_flight
            if opts["then"] == "reprotect":  # as a checkpoint does; a dropped one is left as it is
                protector.close()
            out["again, live"] = _protect_again(model, optimizer)
            saved = protector.state_dict() if opts["then"] == "reprotect" else {}
            del protector
            gc.collect()
            out["again, dropped"] = _protect_again(model, optimizer)
            protector = None
            if opts["then"] == "reprotect":
                model = DistributedDataParallel(model.module)
                protector = protect(model, optimizer, protect=protect_cfg, inject=inject, seed=3)
                protector.load_state_dict(saved)
                protector.prime(toy_closure(model, optimizer, rank, step))
        closure = toy_closure(model, optimizer, rank, step)
        if protector is None:
            closure()
            optimizer.step()
        else:
            protector.step(closure)
    if protector is not None:
        protector.close()
    return {**out, "fingerprint": state_fingerprint(model, optimizer, buffers=False)}


def _protect_again(model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> str:
    """What a second protect() of ``model`` raised ("" if nothing)."""
    try:
        protect(model, optimizer)
    except RuntimeError as err:
        return str(err)
    return ""


def _w_plain(rank: int, world_size: int) -> int:
    model = DistributedDataParallel(toy_model())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(8):
        toy_closure(model, optimizer, rank, step)()
        optimizer.step()
    return state_fingerprint(model, optimizer, buffers=False)


def test_a_closed_protector_is_resumed_on_a_new_ddp_model_and_a_dropped_one_leaves_plain_ddp() -> None:
    # 3 ranks: the repair at step 3 takes the majority's bits, so every run below is
    # plain DDP's trajectory bit for bit
    plain = run_workers(_w_plain, 3)
    uninterrupted = run_workers(_w_lifecycle, 3, {"then": "steps"})
    resumed = run_workers(_w_lifecycle, 3, {"then": "reprotect"})
    dropped = run_workers(_w_lifecycle, 3, {"then": "plain"})
    # dropped with PAFT-Sync's overlapped sync of step 3 in flight (the fault at step 2)
    unlanded = run_workers(_w_lifecycle, 3, {"then": "plain", "fault_at": 2, "protect": {"mode": "sync",
                                                                                          "sync_period": 1}})
    assert [o["fingerprint"] for o in uninterrupted] == plain
    assert [o["fingerprint"] for o in resumed] == plain
    # the dropped protector's hook stays with DDP (it keeps it for good): it is the plain
    # mean all-reduce now, and no longer strikes with the protector's fault of its last step
    assert [o["fingerprint"] for o in dropped] == plain
    assert [o["fingerprint"] for o in unlanded] == plain and all(o["in flight"] for o in unlanded)
    for out in resumed + dropped:  # documented in docs/LIBRARY.md, "What is refused"
        assert out["again, live"].startswith("protect(): this DDP model is already protected by a live Protector")
        assert out["again, dropped"].startswith("protect(): this DDP model already has a comm hook (from "
                                                "register_comm_hook, or an earlier protector's: DDP keeps it)")
        assert out["again, dropped"].endswith("or wrap the module in a new DDP model")


def _w_raising_closure(rank: int, world_size: int) -> dict[str, Any]:
    """Rank 1's closure raises at step 2 (a user's bug), with PAFT-Sync's overlapped sync
    of step 1 in flight; DDP's group times out after 5 s."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=5))
    dist.barrier()  # so that no collective before the bug waits for a rank still starting
    model = DistributedDataParallel(toy_model(), process_group=group)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    protector = protect(model, optimizer, protect=ProtectConfig(mode="sync", sync_period=1),
                        guard=GuardConfig(enabled=True))
    for step in range(2):
        protector.step(toy_closure(model, optimizer, rank, step))

    def bug() -> torch.Tensor:
        raise KeyError("the user's bug")

    start = time.monotonic()
    try:
        protector.step(bug if rank == 1 else toy_closure(model, optimizer, rank, 2))
        raised = ""
    except Exception as err:  # whatever it is, it is the observation
        raised = f"{type(err).__name__}: {err}"
    out = {"raised": raised, "waited": time.monotonic() - start, "in flight": protector.resync.in_flight}
    if rank == 1:  # the raising rank alone: the sync in flight was started by every rank
        protector.close()
        out["step after close"] = protector.state_dict()["step"]
    return out


def test_a_closure_that_raises_on_one_rank_raises_there_and_the_others_wait_for_the_groups_timeout() -> None:
    # as with plain DDP: the others' all-reduce of that step never completes (the raising
    # rank's bound says it did not wait for the 5 s timeout, with room for a loaded machine)
    out = run_workers(_w_raising_closure, 2)
    assert out[1]["raised"] == "KeyError: \"the user's bug\"" and out[1]["waited"] < 2.5
    assert out[0]["raised"].startswith("RuntimeError:") and "Timed out" in out[0]["raised"]
    assert out[0]["waited"] >= 5
    # the raising rank's protector is where it was before the step: the sync lands, the step is still 2
    assert out[1]["in flight"] and out[1]["step after close"] == 2


def _w_recorded(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A library run with a recorder, 6 steps with a fault at step 4, into ``root/once``;
    then the same run stopped after step 4, resumed from its checkpoint after step 3
    into the same folder (``root/resumed``); then a new run into a used folder."""
    def run(folder: str, steps: range, state: dict[str, Any] | None = None, append: bool = False) -> dict[str, Any]:
        torch.manual_seed(0)
        model = DistributedDataParallel(toy_model())
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        recorder = RunRecorder(f"{root}/{folder}", rank, quiet=True, append=append)
        protector = protect(model, optimizer, protect=ProtectConfig(mode="sync", sync_period=2),
                            inject=["bitflip:steps=4,ranks=1,bits=30"], recorder=recorder)
        if state is not None:
            model.module.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            protector.load_state_dict(state["protector"])
        protector.prime(toy_closure(model, optimizer, rank, 0))
        saved: dict[str, Any] = {}
        for step in steps:
            protector.step(toy_closure(model, optimizer, rank, step))
            if step == 3:
                protector.close()
                saved = copy.deepcopy({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                                       "protector": protector.state_dict()})
        protector.close()
        recorder.close()
        return saved

    run("once", range(6))
    saved = run("resumed", range(5))  # stopped after step 4: its records of step 4 go with the resume
    run("resumed", range(4, 6), saved, append=True)
    try:
        run("once", range(1))
        refused = ""
    except ValueError as err:
        refused = str(err)
    return {"refused": refused}


def test_a_resumed_library_run_records_as_the_uninterrupted_one_and_a_used_folder_is_refused(
        tmp_path: pathlib.Path) -> None:
    """A script run again into its folder appended a second run's records to the first's,
    which paft report read as one run; a resumed run kept the interrupted leg's records of
    the steps it re-did."""
    out = run_workers(_w_recorded, 2, str(tmp_path))

    def records(folder: str, name: str) -> list[dict[str, Any]]:  # a sync's own timings aside
        return [{k: v for k, v in r.items() if k not in ("seconds", "wall_seconds")}
                for r in read_jsonl(tmp_path / folder / name)]

    for name in ("consistency.jsonl", "events.jsonl", "faults.jsonl"):
        assert records("once", name) == records("resumed", name), name
    assert [r["step"] for r in records("once", "faults.jsonl")] == [4]
    assert [r["step"] for r in records("once", "consistency.jsonl")] == list(range(6))
    assert out[0]["refused"].startswith(f"protect(): the recorder's folder {tmp_path}/once holds an earlier run's "
                                        "records (consistency.jsonl, events.jsonl, faults.jsonl)")
    assert out[1]["refused"].startswith("protect(): the recorder's folder")
    assert not (tmp_path / "once" / "metrics").exists()  # a library run writes no per-rank metrics
