"""protect() beside other models and inside process groups of the user's: a sweep.

Real training jobs rarely hold one DDP model on the default group: a GAN steps a
generator and a discriminator (two DDP models, two optimizers, two protectors) in
one loop; hybrid layouts run several data-parallel replica groups side by side, each
DDP over a sub-group; and some programs hand DDP a group of their own over the whole
world. Each protector must keep its checks, repairs and records to its own model and
its own group: a collective on another group hangs or mixes two groups' numbers,
and a fault in one replica group must not show in another's records or decisions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from paft.config import GuardConfig, MonitorConfig, ProtectConfig
from paft.protect import protect
from paft.protect_test import same, toy_closure, toy_model
from paft.records import RunRecorder, read_jsonl
from paft.state import state_fingerprint
from paft.testing import run_workers, take_step

AGG_FAULT = "bitflip:steps={step},bits=30,ranks=1"


def _snapshot(model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {"params": [p.detach().clone() for p in model.module.parameters()],
            "optim": [t.clone() for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)],
            "fingerprint": state_fingerprint(model, optimizer, buffers=False)}


def _identical(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Parameters and optimizer state, bit for bit."""
    return same(a, b) and len(a["optim"]) == len(b["optim"]) and all(
        torch.equal(x, y) for x, y in zip(a["optim"], b["optim"]))


# -- two DDP models in one loop: a GAN -------------------------------------------------


def _w_gan(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """A generator (guarded) and a discriminator (PAFT-Dyn), stepped alternately, as
    PyTorch's DCGAN example does: the generator's loss runs through the discriminator's
    DDP, whose backward all-reduces the discriminator's gradients outside its step."""
    torch.manual_seed(0)
    gen = DistributedDataParallel(nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 8)))
    disc = DistributedDataParallel(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1)))
    opt_g = torch.optim.Adam(gen.parameters(), lr=1e-2)
    opt_d = torch.optim.Adam(disc.parameters(), lr=1e-2)
    plain = opts.get("plain", False)
    if not plain:
        pd = protect(disc, opt_d, protect=ProtectConfig(**opts.get("protect_d", {"mode": "dyn"})),
                     inject=opts.get("inject_d", []), seed=3)
        pg = protect(gen, opt_g, guard=GuardConfig(enabled=True, warmup=2), inject=opts.get("inject_g", []), seed=3)
    bce = nn.functional.binary_cross_entropy_with_logits
    syncs, attempts = [], []
    for step in range(opts.get("steps", 8)):
        g = torch.Generator().manual_seed(1000 * step + rank)
        z, real = torch.randn(8, 4, generator=g), torch.randn(8, 8, generator=g) * 0.5 + 1.0

        def d_closure(z: torch.Tensor = z, real: torch.Tensor = real) -> torch.Tensor:
            opt_d.zero_grad(set_to_none=True)
            with torch.no_grad():  # the generator takes no gradient here
                fake = gen(z)
            loss = bce(disc(real), torch.ones(8, 1)) + bce(disc(fake), torch.zeros(8, 1))
            loss.backward()
            return loss

        def g_closure(z: torch.Tensor = z) -> torch.Tensor:
            opt_g.zero_grad(set_to_none=True)
            loss = bce(disc(gen(z)), torch.ones(8, 1))
            loss.backward()
            return loss

        if plain:
            d_closure()
            opt_d.step()
            g_closure()
            opt_g.step()
        else:
            syncs.append(pd.step(d_closure).synced)
            attempts.append(pg.step(g_closure).attempts)
    if not plain:
        pd.close()
        pg.close()
    return {"gen": _snapshot(gen, opt_g), "disc": _snapshot(disc, opt_d), "syncs": syncs, "attempts": attempts,
            "counters": ({"d": pd.counters, "g": pg.counters} if not plain else {})}


@pytest.mark.parametrize("protect_d", [
    {"mode": "dyn"},
    # a sync every other step, in flight on the same group while the generator steps
    {"mode": "sync", "sync_period": 2, "overlap": True},
])
def test_a_gan_with_two_protectors_is_plain_ddp_and_each_repairs_its_own_model(protect_d: dict[str, Any]) -> None:
    plain = run_workers(_w_gan, 3, {"plain": True})
    clean = run_workers(_w_gan, 3, {"protect_d": protect_d})
    for p, c in zip(plain, clean):  # (b): both models, both optimizers, bit for bit
        assert _identical(p["gen"], c["gen"]) and _identical(p["disc"], c["disc"])
    assert clean[0]["attempts"] == [1] * 8
    hit = run_workers(_w_gan, 3, {"protect_d": protect_d, "inject_d": [AGG_FAULT.format(step=3)], "inject_g": [
        AGG_FAULT.format(step=5), "bitflip:site=local-grad,steps=6,bits=30,ranks=1"]})
    # The discriminator's split (step 3): synced in that step, and the replicas agree.
    assert hit[0]["syncs"][3] and all(h["syncs"] == hit[0]["syncs"] for h in hit)
    assert all(_identical(h["disc"], hit[0]["disc"]) for h in hit)
    # The generator's (step 5; a local-grad flip at 6): the guard recomputes each, its
    # model is the fault-free one.
    assert hit[0]["attempts"] == [1] * 5 + [2, 2, 1]
    assert all(_identical(h["gen"], hit[0]["gen"]) for h in hit)
    if protect_d["mode"] == "dyn":  # D repaired within its step: G never saw the split
        assert all(_identical(h["gen"], c["gen"]) for h, c in zip(hit, clean))
    # (A periodic sync leaves D split on rank 1 until it lands: G's gradients through
    # rank 1's D are the fault's, on every rank alike, and G is not the fault-free G.)
    assert hit[1]["counters"]["d"]["faults_injected"] == 1 and hit[1]["counters"]["g"]["faults_injected"] == 2


# -- two replica groups side by side: DDP over sub-groups --------------------------------


def _w_replica_groups(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """Ranks [0, 1] train replica group A, ranks [2, 3] group B (a hybrid layout's
    replicate dimension): each a DDP model over its sub-group, with a protector and a
    recorder whose rank is the rank in that group. Faults go to group A only."""
    groups = {"A": dist.new_group([0, 1]), "B": dist.new_group([2, 3])}  # every rank creates both
    name = "A" if rank < 2 else "B"
    group = groups[name]
    model = DistributedDataParallel(toy_model(), process_group=group)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    recorder = None
    protector = None
    refused = ""
    if not opts.get("plain"):
        if name == "B":  # the global rank, where the rank in DDP's group belongs: B's rank 0 would be silent
            try:
                protect(model, optimizer, recorder=RunRecorder(None, rank, quiet=True))
            except ValueError as err:
                refused = str(err)
        recorder = RunRecorder(Path(opts["run_dir"]) / name, dist.get_rank(group), quiet=True)
        protector = protect(model, optimizer, protect=ProtectConfig(**opts.get("protect", {})),
                            guard=GuardConfig(**opts.get("guard", {})), monitor=MonitorConfig(fingerprint_every=1),
                            inject=opts["inject"] if name == "A" else [], seed=3, recorder=recorder)
    reports = []
    for step in range(8):
        closure = toy_closure(model, optimizer, rank, step)
        r = take_step(protector, optimizer, closure)
        if r is not None:
            reports.append((r.applied, r.attempts, r.synced))
    if protector is not None and recorder is not None:
        protector.close()
        recorder.close()
    return {**_snapshot(model, optimizer), "group": name, "reports": reports, "refused": refused,
            "counters": protector.counters if protector is not None else {}}


@pytest.mark.parametrize(("defense", "fault", "at"), [
    ({"protect": {"mode": "dyn"}}, AGG_FAULT.format(step=3), 3),
    ({"guard": {"enabled": True, "warmup": 2}}, "bitflip:site=local-grad,steps=4,bits=30,ranks=1", 4),
])
def test_replica_groups_keep_their_faults_checks_and_records_to_themselves(
        tmp_path: Path, defense: dict[str, Any], fault: str, at: int) -> None:
    plain = run_workers(_w_replica_groups, 4, {"plain": True})
    clean = run_workers(_w_replica_groups, 4, {**defense, "inject": [], "run_dir": str(tmp_path / "clean")})
    hit = run_workers(_w_replica_groups, 4, {**defense, "inject": [fault], "run_dir": str(tmp_path / "hit")})
    for p, c in zip(plain, clean):
        assert _identical(p, c)  # (b) in each group
    for r in (2, 3):  # refused on both ranks of B (in B's own collective), the fix named
        assert "dist.get_rank(ddp.process_group)" in clean[r]["refused"], clean[r]["refused"]
    assert not same(clean[0], clean[2])  # two groups, two models: each group its own data
    assert _identical(hit[0], hit[1])  # group A repaired: its replicas agree
    if "guard" in defense:  # the recompute gave group A the fault-free step
        assert _identical(hit[0], clean[0]) and hit[0]["reports"][at][1] == 2
    else:
        assert hit[0]["reports"][at][2]  # PAFT-Dyn synced group A in the step of its split
    assert hit[1]["counters"]["faults_injected"] == 1
    # Group B: nothing of A's fault in its model, its decisions or its records.
    for r in (2, 3):
        assert _identical(hit[r], clean[r]) and hit[r]["reports"] == clean[r]["reports"]
        assert hit[r]["counters"] == clean[r]["counters"]
    hit_b, clean_b = tmp_path / "hit" / "B", tmp_path / "clean" / "B"
    for kind in ("consistency", "events", "faults"):
        assert read_jsonl(hit_b / f"{kind}.jsonl") == read_jsonl(clean_b / f"{kind}.jsonl")
    assert read_jsonl(hit_b / "faults.jsonl") == []
    # Group B's rank 0 (global rank 2) wrote B's run folder; A's folder has A's fault, at A's rank 1.
    assert len(read_jsonl(tmp_path / "clean" / "B" / "consistency.jsonl")) == 8
    faults = read_jsonl(tmp_path / "hit" / "A" / "faults.jsonl")
    assert [(f["step"], f["rank"]) for f in faults] == [(at, 1)]
    assert all(len(row["consistency/cos_to_mean"]) == 2 for row in read_jsonl(hit_b / "consistency.jsonl"))


# -- DDP over a group of the user's, over the whole world --------------------------------


def _default_group_calls() -> int:
    """The collectives the default group has run (its sequence number counts them)."""
    return dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()


def _w_own_world_group(rank: int, world_size: int, opts: dict[str, Any]) -> dict[str, Any]:
    """DDP on CPU (``device_ids=None``) over ``dist.new_group(backend="gloo")``, a group
    of all ranks that is not the default group; returns the default group's calls
    while the protector lived (DDP's own are the plain run's)."""
    group = dist.new_group(backend="gloo")
    before = _default_group_calls()
    model = DistributedDataParallel(toy_model(), device_ids=None, process_group=group)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    protector = None
    if not opts.get("plain"):
        protector = protect(model, optimizer, protect=ProtectConfig(**opts.get("protect", {})),
                            guard=GuardConfig(**opts.get("guard", {})), inject=opts.get("inject", []), seed=3)
    reports = []
    for step in range(8):
        closure = toy_closure(model, optimizer, rank, step)
        r = take_step(protector, optimizer, closure)
        if r is not None:
            reports.append((r.attempts, r.synced))
    if protector is not None:
        protector.close()
    return {**_snapshot(model, optimizer), "default_calls": _default_group_calls() - before, "reports": reports}


def test_a_world_group_of_the_users_leaves_the_default_group_unused() -> None:
    world = 3
    plain = run_workers(_w_own_world_group, world, {"plain": True})
    runs = {
        "clean": {"protect": {"mode": "dyn"}, "guard": {"enabled": True, "warmup": 2}},
        "dyn": {"protect": {"mode": "dyn"}, "inject": [AGG_FAULT.format(step=3)]},
        "sync": {"protect": {"mode": "sync", "sync_period": 1, "overlap": True}, "inject": [AGG_FAULT.format(step=3)]},
        "guard": {"guard": {"enabled": True, "warmup": 2},
                  "inject": ["bitflip:site=local-grad,steps=4,bits=30,ranks=1"]},
    }
    out = {name: run_workers(_w_own_world_group, world, opts) for name, opts in runs.items()}
    for name, ranks in out.items():
        assert [r["default_calls"] for r in ranks] == [0] * world, name
        # (b), and (c)/(d): with three ranks the majority's bits repair rank 1 exactly.
        assert all(_identical(r, p) for r, p in zip(ranks, plain)), name
    assert out["dyn"][0]["reports"][3][1] and out["guard"][0]["reports"][4][0] == 2
