from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import torch
from torch import nn

from paft.optimizers import OptimizerChain, chained
from paft.state import state_tensors


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 1))


def _split(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """Muon for the hidden matrices, AdamW for the rest."""
    hidden = [model[0].weight, model[2].weight]
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    return (torch.optim.Muon(hidden, lr=2e-2, adjust_lr_fn="match_rms_adamw"),
            torch.optim.AdamW(rest, lr=1e-2, weight_decay=0.1))


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> list[torch.Tensor]:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_chain_steps_as_its_optimizers_stepped_one_after_the_other() -> None:
    alone, chain_model = _model(), _model()
    muon, adamw = _split(alone)

    class Both(torch.optim.Optimizer):  # the two stepped by hand, as a user's loop would
        def __init__(self) -> None:
            super().__init__(list(alone.parameters()), {})

        def step(self, closure: Any = None) -> None:
            muon.step()
            adamw.step()

        def zero_grad(self, set_to_none: bool = True) -> None:
            muon.zero_grad(set_to_none)
            adamw.zero_grad(set_to_none)

    expected = _train(alone, Both(), range(5))
    assert _equal(_train(chain_model, OptimizerChain(_split(chain_model)), range(5)), expected)
    assert not _equal(expected, [p.detach() for p in _model().parameters()])  # it trained


def test_param_groups_and_state_are_the_chained_optimizers_own() -> None:
    model = _model()
    muon, adamw = _split(model)
    chain = OptimizerChain([muon, adamw])
    assert all(a is b for a, b in zip(chain.param_groups, muon.param_groups + adamw.param_groups))
    assert len(chain.param_groups) == 2 and chained(chain) == [muon, adamw] and chained(muon) == [muon]
    _train(model, chain, range(1))
    assert len(chain.state) == len(muon.state) + len(adamw.state) == 8
    assert set(map(id, chain.state)) == {id(p) for p in model.parameters()}
    w, b = model[0].weight, model[0].bias
    assert chain.state[w] is muon.state[w] and chain.state[b] is adamw.state[b]
    assert w in chain.state and b in chain.state and torch.zeros(1) not in chain.state
    # Iterated in chain order, as param_groups are.
    assert [id(p) for p in chain.state] == [id(p) for p in [*muon.state, *adamw.state]]
    # A state tensor set through the chain lands in the owner, and so does a removal.
    chain.state[b]["exp_avg"] = torch.full_like(b, 3.0)
    assert torch.equal(adamw.state[b]["exp_avg"], torch.full_like(b, 3.0))
    entry = chain.state.pop(w)
    assert w not in muon.state and chain.state.get(w) is None and w not in chain.state
    assert len(chain.state) == 7
    chain.state[w] = entry
    assert muon.state[w] is entry


def test_pop_and_setdefault_are_a_dicts() -> None:
    model = _model()
    muon, adamw = _split(model)
    chain = OptimizerChain([muon, adamw])
    b, w = model[2].bias, model[0].weight
    assert chain.state.pop(b, None) is None and b not in adamw.state  # no empty entry made and returned
    with pytest.raises(KeyError):
        chain.state.pop(b)
    entry = {"x": torch.ones(1)}
    assert chain.state.setdefault(b, entry) is entry and adamw.state[b] is entry
    assert chain.state.setdefault(b, {"y": 1}) is entry  # kept
    assert chain.state.pop(b) is entry and b not in adamw.state  # from its owner, the second optimizer
    with pytest.raises(KeyError):
        del chain.state[b]  # nothing left to delete
    # A parameter moved between the chained optimizers: its entry goes to its new owner.
    muon.param_groups[0]["params"].remove(w)
    adamw.param_groups[0]["params"].append(w)
    chain.state[w] = {"z": 2}
    assert adamw.state[w] == {"z": 2} and w not in muon.state


def test_parameters_swapped_in_place_between_chained_optimizers_take_their_entries_along() -> None:
    # The owners were cached by each group's (id, length), which a swap or replacement
    # in place leaves as it was: an entry went to the parameter's old owner, a parameter
    # no optimizer held any more got one, and its replacement none.
    model = _model()
    muon, adamw = _split(model)
    chain = OptimizerChain([muon, adamw])
    hidden, bias = model[2].weight, model[0].bias
    assert chain.state[hidden] is muon.state[hidden]  # the owners are looked up
    muon.param_groups[0]["params"][1], adamw.param_groups[0]["params"][0] = bias, hidden
    chain.state[bias], chain.state[hidden] = {"x": 1}, {"y": 2}
    assert muon.state[bias] == {"x": 1} and adamw.state[hidden] == {"y": 2}
    assert bias not in adamw.state and muon.state.get(hidden) == {}  # the entry the lookup above made
    fresh = torch.zeros(8, 8, requires_grad=True)
    adamw.param_groups[0]["params"][0] = fresh
    chain.state[fresh] = {"z": 3}
    assert adamw.state[fresh] == {"z": 3}
    with pytest.raises(KeyError, match="no chained optimizer holds"):
        chain.state[hidden] = {}
    muon.param_groups[0]["params"].pop()  # the bias, the group's last
    with pytest.raises(KeyError, match="no chained optimizer holds"):
        chain.state[bias] = {}
    # A whole group moved to the other optimizer: its parameters' entries go there.
    muon.param_groups.append(adamw.param_groups.pop())
    chain.state[fresh] = {"w": 4}
    assert muon.state[fresh] == {"w": 4} and adamw.state.get(fresh) == {"z": 3}


def test_reading_a_missing_entry_creates_it_in_its_owner_and_get_never_does() -> None:
    model = _model()
    muon, adamw = _split(model)
    chain = OptimizerChain([muon, adamw])
    b = model[2].bias
    assert chain.state.get(b, "none") == "none" and b not in adamw.state
    assert chain.state[b] == {} and b in adamw.state and b not in muon.state
    with pytest.raises(KeyError, match=r"shape \(3,\) that no chained optimizer holds"):
        chain.state[torch.zeros(3)]


def test_a_group_added_to_a_chained_optimizer_is_seen_at_once() -> None:
    model = _model()
    frozen = model[4]
    hidden = [model[0].weight, model[2].weight]
    muon = torch.optim.Muon(hidden, lr=2e-2)
    adamw = torch.optim.AdamW([p for p in model.parameters()
                               if all(p is not h for h in hidden) and all(p is not f for f in frozen.parameters())])
    chain = OptimizerChain([muon, adamw])
    adamw.add_param_group({"params": list(frozen.parameters()), "lr": 1e-4})  # unfrozen later
    assert chain.param_groups[-1]["lr"] == 1e-4 and len(chain.param_groups) == 3
    _train(model, chain, range(1))
    assert chain.state[frozen.weight] is adamw.state[frozen.weight]
    # A group swapped for another of the same size (the frozen layer frozen again, a new
    # one trained): the chain follows the new parameters, not the old group's.
    old = adamw.param_groups.pop()  # held: its id is not reused for the new group
    extra = [torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)]
    adamw.add_param_group({"params": extra})
    assert chain.state[extra[0]] is adamw.state[extra[0]] and len(old["params"]) == len(extra)
    with pytest.raises(KeyError, match="no chained optimizer holds"):
        chain.state[frozen.weight]
    with pytest.raises(TypeError, match=r"add the group to one of the chained optimizers"):
        chain.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
    with pytest.raises(AttributeError, match=r"OptimizerChain.state is a view"):
        chain.state = {}
    with pytest.raises(AttributeError, match=r"OptimizerChain.param_groups is a view"):
        chain.param_groups = []


def test_state_tensors_list_every_chained_optimizers_state_in_parameter_order() -> None:
    model = _model()
    muon, adamw = _split(model)
    chain = OptimizerChain([muon, adamw])
    _train(model, chain, range(2))
    names = [n for n, _ in state_tensors(model, chain) if n.startswith("optim/")]
    # Groups in chain order: Muon's two matrices (params 0, 1), then AdamW's six (2..7).
    assert names == ["optim/0/momentum_buffer", "optim/1/momentum_buffer"] + [
        f"optim/{i}/{k}" for i in range(2, 8) for k in ("exp_avg", "exp_avg_sq", "step")]


def test_a_checkpoint_round_trip_continues_the_same_trajectory() -> None:
    model = _model()
    chain = OptimizerChain(_split(model))
    _train(model, chain, range(3))
    saved = copy.deepcopy((model.state_dict(), chain.state_dict()))
    assert [sorted(s) for s in saved[1]["optimizers"]] == [["param_groups", "state"]] * 2
    expected = _train(model, chain, range(3, 6))

    restored = _model()
    again = OptimizerChain(_split(restored))
    restored.load_state_dict(saved[0])
    again.load_state_dict(saved[1])
    assert _equal(_train(restored, again, range(3, 6)), expected)
    with pytest.raises(ValueError, match=r"expected the state of 2 optimizers \(a chain's state_dict\(\)\), got 1"):
        again.load_state_dict({"optimizers": saved[1]["optimizers"][:1]})
    with pytest.raises(ValueError, match=r"expected the state of 2 optimizers .*got no"):
        again.load_state_dict(saved[1]["optimizers"][0])


def test_a_closure_steps_and_zero_grad_keeps_the_gradients_as_asked() -> None:
    alone, model = _model(), _model()
    expected = _train(alone, OptimizerChain(_split(alone)), range(1))
    chain = OptimizerChain(_split(model))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g)

    def closure() -> torch.Tensor:  # run inside step(), whose own torch.no_grad it lifts
        chain.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    loss = chain.step(closure)
    assert isinstance(loss, torch.Tensor) and _equal([p.detach() for p in model.parameters()], expected)
    chain.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_a_scheduler_and_a_step_hook_on_the_chain_reach_every_optimizer() -> None:
    model = _model()
    muon, adamw = _split(model)
    chain = OptimizerChain([muon, adamw])
    calls: list[int] = []
    chain.register_step_post_hook(lambda *_: calls.append(1))
    scheduler = torch.optim.lr_scheduler.LambdaLR(chain, lambda t: 0.5 ** t)
    for _ in range(2):
        _train(model, chain, range(1))
        scheduler.step()
    assert calls == [1, 1]  # once per chain step, not once per chained optimizer
    assert muon.param_groups[0]["lr"] == 2e-2 * 0.25 and adamw.param_groups[0]["lr"] == 1e-2 * 0.25


def test_a_loss_scaler_unscales_and_steps_every_chained_optimizer() -> None:
    plain, scaled = _model(), _model()
    expected = _train(plain, OptimizerChain(_split(plain)), range(3))
    chain = OptimizerChain(_split(scaled))
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g)
        chain.zero_grad()
        scaler.scale(nn.functional.mse_loss(scaled(x), y)).backward()
        scaler.step(chain)
        scaler.update()
    # A power-of-two scale unscales exactly: the unscaled run, bit for bit.
    assert _equal([p.detach() for p in scaled.parameters()], expected)


@pytest.mark.parametrize("optimizers, error, match", [
    ([], ValueError, r"needs at least one optimizer"),
    (["sgd"], TypeError, r"optimizer 0 must be a torch.optim.Optimizer that is not itself a chain, got str"),
    (["chain"], TypeError, r"optimizer 0 must be .* got a chain"),
    (["adamw", "adamw"], ValueError, r"optimizer 1 \(AdamW\) is listed twice"),
    (["adamw", "sgd over all"], ValueError, r"a parameter of shape \(8, 6\) is held by optimizer 0 \(AdamW\) "
                                            r"and optimizer 1 \(SGD\); each parameter needs exactly one optimizer"),
])
def test_a_chain_is_refused_what_it_cannot_step_as_one(optimizers: list[str], error: type[Exception],
                                                        match: str) -> None:
    model = _model()
    adamw = torch.optim.AdamW(model.parameters())
    made = {"sgd": "sgd", "adamw": adamw, "chain": OptimizerChain([adamw]),
            "sgd over all": torch.optim.SGD(model.parameters(), lr=0.1)}
    with pytest.raises(error, match=match):
        OptimizerChain([made[name] for name in optimizers])


def test_a_copied_or_pickled_chain_chains_the_copies() -> None:
    model = _model()
    chain = OptimizerChain(_split(model))
    _train(model, chain, range(2))
    for copied in (copy.deepcopy(chain), pickle.loads(pickle.dumps(chain))):
        assert isinstance(copied, OptimizerChain) and repr(copied) == "OptimizerChain(Muon, AdamW)"
        assert all(a is not b for a, b in zip(copied.optimizers, chain.optimizers))
        assert all(a is b for a, b in zip(copied.param_groups, [g for o in copied.optimizers for g in o.param_groups]))
        assert len(copied.state) == 8 and all(
            torch.equal(x["exp_avg"], y["exp_avg"]) for x, y in zip(copied.optimizers[1].state.values(),
                                                                    chain.optimizers[1].state.values()))


@pytest.mark.parametrize("hook", ["register_state_dict_pre_hook", "register_state_dict_post_hook",
                                  "register_load_state_dict_pre_hook", "register_load_state_dict_post_hook"])
def test_a_state_dict_hook_on_the_chain_is_refused_where_it_would_never_run(hook: str) -> None:
    chain = OptimizerChain(_split(_model()))
    with pytest.raises(TypeError, match=r"register state-dict hooks on the chained optimizers"):
        getattr(chain, hook)(lambda *_: None)


def test_the_repr_names_the_chained_optimizers() -> None:
    assert repr(OptimizerChain(_split(_model()))) == "OptimizerChain(Muon, AdamW)"
