"""What :func:`paft.protect` checks before it changes anything.

Misuse is refused up front with the fix named -- arguments of the wrong type, an
optimizer paft cannot protect, fault specs the model's dtypes cannot take, a second
protector on one model -- and on every rank alike: :func:`preflight` ends in one
gather of whether each rank accepted its arguments and a digest of each setting
every rank must share. So a setting that differs between ranks, or
an argument refused on some ranks only, raises on every rank instead of leaving the
others waiting in a later collective (or silently mixing state).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import sys
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from paft.amp import OptimizerStep
from paft.collectives import gather_rows
from paft.comm import CommHook, paft_comm_hook, registered_comm_hooks
from paft.config import GuardConfig, MonitorConfig, ProtectConfig
from paft.faultspec import BUCKET_SITES, FaultSpec, FaultSpecError
from paft.fingerprint import repr_digest
from paft.optimizers import OptimizerChain, chained, check_disjoint
from paft.records import RunRecorder

__all__ = ["ProtectSettings", "check_added_groups", "ddp_of", "mark_protected", "preflight", "wants_comm_hook"]


@dataclasses.dataclass(frozen=True)
class ProtectSettings:
    """:func:`paft.protect`'s keyword arguments, its defaults filled in: what
    :func:`preflight` checks (as the user passed them: a wrong type is refused there)
    and the :class:`~paft.protect.Protector` is built from."""

    monitor: MonitorConfig
    protect: ProtectConfig
    guard: GuardConfig
    inject: Sequence[str | FaultSpec]
    seed: int
    grad_clip: float
    recorder: RunRecorder | None
    comm_hook: CommHook | None
    comm_state: Any
    scaler: torch.amp.GradScaler | None


def preflight(model: Any, optimizer: Any, settings: ProtectSettings) -> tuple[list[FaultSpec], OptimizerStep]:
    """Check :func:`paft.protect`'s arguments; a collective over the model's process
    group. Returns the parsed fault specs and the optimizer step (with the loss scaler;
    its ``optimizer`` is a list's :class:`~paft.optimizers.OptimizerChain`). Raises
    ``TypeError`` / ``ValueError`` / ``RuntimeError`` on every rank."""
    if not isinstance(model, DistributedDataParallel):  # no process group to tell the others through
        inner = _compiled_module(model)
        got = type(model).__name__ if inner is None else f"torch.compile of a {type(inner).__name__}"
        raise TypeError(f"protect() needs a DistributedDataParallel model, got {got}; wrap the model in "
                        "DistributedDataParallel(model), compiled or not: DistributedDataParallel(torch.compile("
                        "model)) and torch.compile(DistributedDataParallel(model)) are both taken")
    refusal: Exception | None = None
    try:
        # A list is chained here, inside the agreement: a list refused on one rank only
        # must raise on every rank, not leave the others waiting in the gather below.
        if isinstance(optimizer, (list, tuple)):
            optimizer = OptimizerChain(optimizer)
        _check_arguments(model, optimizer, settings)
        _check_comm_hook(settings.comm_hook, settings.comm_state)
        _check_recorder(model, settings.recorder)
        _check_cuda_device(str(dist.get_backend(model.process_group)), model, dist.get_world_size(model.process_group))
        specs = [s if isinstance(s, FaultSpec) else FaultSpec.parse(s, option="protect(): inject")
                 for s in settings.inject]
        _check_specs(specs, list(model.parameters()), dist.get_world_size(model.process_group))
        # DDP takes one comm hook, and keeps it for good: a rank whose model has one
        # already must refuse here, with the others. An earlier protector's hook goes on
        # injecting and capturing for a protector that wants none: refused too.
        hooks = registered_comm_hooks(model)
        hooked = wants_comm_hook(settings.monitor, specs, settings.comm_hook)
        if hooks and (hooked or any(hook is paft_comm_hook for hook, _ in hooks)):
            raise RuntimeError("protect(): this DDP model already has a comm hook (from register_comm_hook, or "
                               "an earlier protector's: DDP keeps it); pass yours to protect() as comm_hook=, "
                               "or wrap the module in a new DDP model")
        if hooked:
            _check_sparse(model)
        stepper = OptimizerStep(optimizer, settings.scaler)
        agreed: dict[str, Any] | None = {
            "the monitor config": settings.monitor, "the protect config": settings.protect,
            "the guard config": settings.guard, "grad_clip": settings.grad_clip, "seed": settings.seed,
            "inject": [s.to_text() for s in specs], **_model_and_optimizer(model, optimizer),
            "the loss scaler": stepper.state(),
            "the comm hook": _hook_identity(settings.comm_hook, settings.comm_state),
        }
    except (TypeError, ValueError, RuntimeError) as err:
        refusal, agreed = err, None
    _check_ranks_agree(model, agreed, refusal)
    # After the agreement, so every rank reaches the same answer.
    if stepper.scaler is not None:
        held = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if any(p.requires_grad and id(p) not in held for p in model.parameters()):
            # scaler.unscale_ unscales the optimizer's parameters only: the others'
            # gradients would stay scaled in the norms, the guard and clipping.
            # Freezing them now is no way out: DDP, built already, would wait for their
            # gradients, and a parameter that joins the optimizer later never joins DDP's.
            raise ValueError("protect(): with scaler=, the optimizer must hold every parameter that requires a "
                             "gradient, from protect() on; one to train later (progressive unfreezing) goes in now, "
                             "in a param group with lr=0 whose lr you raise then (a group added after protect() "
                             "cannot hold it); one never trained: requires_grad_(False) before "
                             "DistributedDataParallel wraps the model")
    return specs, stepper


def ddp_of(model: Any) -> Any:
    """The DDP model ``torch.compile(ddp)`` wraps, else ``model`` itself. The compiled
    wrapper runs the same DDP module (dynamo's DDPOptimizer splits its graph at the
    bucket boundaries, and DDP's reducer still calls the comm hook for every bucket), so
    paft protects that module while the closure calls the wrapper."""
    inner = _compiled_module(model)
    return inner if isinstance(inner, DistributedDataParallel) else model


def _compiled_module(model: Any) -> Any:
    """The module a ``torch.compile`` wrapper compiles, or None for anything else. Looked
    up, not imported (as ZeroRedundancyOptimizer below): importing torch._dynamo costs
    seconds, and a model can only be compiled if the user's program imported it."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is None or not isinstance(model, eval_frame.OptimizedModule):
        return None
    return model._orig_mod


def wants_comm_hook(monitor: MonitorConfig, specs: Sequence[FaultSpec], comm_hook: Any) -> bool:
    """Whether the protector registers paft's comm hook: unmonitored, fault-free and
    without a hook of the user's it has nothing to do in one, and leaves DDP's built-in
    reducer alone (plain DDP)."""
    return monitor.enabled or bool(specs) or comm_hook is not None


def mark_protected(model: DistributedDataParallel, protector: Any) -> None:
    """Record ``protector`` as ``model``'s: :func:`preflight` refuses another while it lives."""
    _PROTECTED[model] = weakref.ref(protector)


# DDP model -> its live Protector: a second one on the same model would share its comm
# hook (or, unmonitored, run beside it unseen), so protect() refuses it.
_PROTECTED: weakref.WeakKeyDictionary[DistributedDataParallel, weakref.ref[Any]] = weakref.WeakKeyDictionary()


def _is_zero_redundancy(optimizer: Any) -> bool:
    # Looked up, not imported: importing torch.distributed.optim costs about a second in
    # every command that imports paft (paft --help, paft report, the launcher), and an
    # optimizer can only be one if the user's program imported it.
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer)


def _check_arguments(model: DistributedDataParallel, optimizer: Any, settings: ProtectSettings) -> None:
    """Misuse that would otherwise fail deep inside a later step, or not at all."""
    monitor, protect, guard, grad_clip = settings.monitor, settings.protect, settings.guard, settings.grad_clip
    earlier = _PROTECTED.get(model)
    if earlier is not None and earlier() is not None:
        raise RuntimeError("protect(): this DDP model is already protected by a live Protector; keep using "
                           "that one (its state_dict() carries over), or wrap the module in a new DDP model")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError("protect() needs a torch.optim.Optimizer, or a list of them over disjoint parameters, "
                        f"got {type(optimizer).__name__}")
    for one in chained(optimizer):
        if _is_zero_redundancy(one):
            # Its state lives sharded in optimizer.optim.state: paft could neither fingerprint
            # nor sync it, and a rolled-back step would keep the state it advanced.
            raise TypeError("protect(): ZeroRedundancyOptimizer is not supported (each rank holds only its shard "
                            "of the optimizer state, which replicas cannot be compared or repaired from); "
                            "pass the optimizer it wraps")
        closure = inspect.signature(one.step).parameters.get("closure")
        if closure is not None and closure.default is inspect.Parameter.empty:
            raise TypeError(f"protect(): {type(one).__name__}.step() needs a closure (it re-evaluates the loss); "
                            "paft runs the closure once per step and calls optimizer.step() without one")
    for name, cfg, cls in (("monitor", monitor, MonitorConfig), ("protect", protect, ProtectConfig),
                           ("guard", guard, GuardConfig)):
        if not isinstance(cfg, cls):
            raise TypeError(f"protect(): {name}= must be a {cls.__name__}, got {type(cfg).__name__}")
        dataclasses.replace(cfg)  # re-runs the checks: a field may have been changed since
    if isinstance(settings.inject, (str, FaultSpec)):
        raise TypeError("protect(): inject= must be a list of fault specs, e.g. ['bitflip:steps=5,ranks=1']")
    if isinstance(grad_clip, bool) or not isinstance(grad_clip, (int, float)) or not 0 <= grad_clip < math.inf:
        raise ValueError(f"protect(): grad_clip must be a finite number >= 0 (0: no clipping), got {grad_clip!r}")
    foreign = _foreign_params(model, optimizer.param_groups)
    if foreign:
        raise ValueError(f"protect(): the optimizer holds {foreign} parameter(s) that are not the model's; "
                         "build it from ddp_model.parameters() (or a subset of them)")
    if guard.enabled and not monitor.enabled:
        raise ValueError("protect(): the guard needs the per-step monitor (MonitorConfig.enabled)")
    world_size = dist.get_world_size(model.process_group)
    if protect.mode in ("sync", "dyn") and protect.sync_mode == "broadcast" and not (
            0 <= protect.broadcast_src < world_size):
        raise ValueError(f"protect(): ProtectConfig.broadcast_src must be a rank in [0, {world_size}), "
                         f"got {protect.broadcast_src}")


def _check_recorder(model: DistributedDataParallel, recorder: Any) -> None:
    """The recorder's rank 0 writes the run folder and speaks: made with the global rank
    where DDP runs over a sub-group (a hybrid layout's replica group without global
    rank 0), the group would write no consistency.jsonl or events.jsonl and say nothing.
    A folder holding an earlier run's records (a script run again into it) is refused:
    the report would read the two runs as one."""
    if recorder is None:
        return
    if not isinstance(recorder, RunRecorder):  # a folder's path: taken, then an AttributeError at the first step
        raise TypeError("protect(): recorder= must be a paft.records.RunRecorder(run_dir, rank), got "
                        f"{type(recorder).__name__}; make one: RunRecorder(run_dir, dist.get_rank(ddp.process_group))")
    me = dist.get_rank(model.process_group)
    if recorder.rank != me:
        raise ValueError(f"protect(): the recorder's rank is {recorder.rank}, but this is rank {me} of DDP's "
                         "process group; a recorder takes the rank in that group (its rank 0 writes the run "
                         "folder): RunRecorder(run_dir, dist.get_rank(ddp.process_group))")
    if recorder.earlier_records:
        shown = ", ".join(recorder.earlier_records[:3]) + (", ..." if len(recorder.earlier_records) > 3 else "")
        raise ValueError(f"protect(): the recorder's folder {recorder.run_dir} holds an earlier run's records "
                         f"({shown}), which this run's would be mixed with; give another folder, or "
                         "RunRecorder(..., append=True) to go on with them (a resumed run)")


def _check_cuda_device(backend: str, model: Any, world_size: int, current: Callable[[], int] | None = None) -> None:
    """Under NCCL paft's own collectives run on the current CUDA device, as NCCL wants
    (one GPU per rank): a model on another GPU (``model.to(local_rank)`` without
    ``torch.cuda.set_device``) would put every rank's collectives on cuda:0, and NCCL
    refuses two ranks on one GPU deep inside the first one. ``current``: the current
    device's index (``torch.cuda.current_device``, asked only for a CUDA model)."""
    if "nccl" not in backend.lower() or world_size == 1:  # one rank: no GPU to share
        return
    device = _cuda_device_of(model)
    if device is None:
        return
    index = (current or torch.cuda.current_device)()
    if device.index != index:
        raise ValueError(f"protect(): the model is on {device}, but this process's current CUDA device is "
                         f"cuda:{index}, where NCCL runs paft's collectives; call "
                         f"torch.cuda.set_device({device.index}) before init_process_group (one GPU per rank)")


def _cuda_device_of(model: Any) -> torch.device | None:
    """The GPU ``model``'s parameters are on (the first CUDA one's), ``None`` for a model on the CPU."""
    return next((p.device for p in model.parameters() if p.is_cuda), None)


def _foreign_params(model: DistributedDataParallel, groups: Sequence[dict[str, Any]]) -> int:
    """How many of ``groups``' parameters are not ``model``'s: paft fingerprints and syncs
    the model's parameters, so an optimizer stepping others would let them part unseen."""
    own = {id(p) for p in model.parameters()}
    return sum(1 for g in groups for p in g["params"] if id(p) not in own)


def check_added_groups(model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> None:
    """The param groups added by ``optimizer.add_param_group()`` (progressive unfreezing)
    must hold the model's parameters only, as the optimizer's first groups must: checked
    by :meth:`paft.protect.Protector.step` when the number of groups grows. Every group
    is checked, not the last ones: a group added to one optimizer of an
    :class:`~paft.optimizers.OptimizerChain` lands among the chain's groups, before the
    next optimizer's (the first groups passed the preflight, so what is foreign is new).
    A chain's optimizers must still hold disjoint parameters (one added to a second
    optimizer would be stepped twice). Their optimizer state joins the fingerprints and
    syncs by itself (:func:`paft.state.state_tensors` lists every group's)."""
    foreign = _foreign_params(model, optimizer.param_groups)
    if foreign:
        raise ValueError(f"optimizer.add_param_group() after protect(): the new group(s) hold {foreign} "
                         "parameter(s) that are not the model's, which paft can neither fingerprint nor sync; "
                         "add only parameters of ddp_model.parameters()")
    check_disjoint(chained(optimizer), "optimizer.add_param_group() after protect()")


def _check_sparse(model: DistributedDataParallel) -> None:
    """Sparse gradients (``nn.Embedding(sparse=True)``) reach a comm hook as sparse
    tensors, which paft's captures and faults cannot read: refused up front, not as a
    shape error inside the first backward pass."""
    sparse = [(name, m) for name, m in model.module.named_modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]
    if sparse:
        name, module = sparse[0]
        # The root module has no name of its own: the model itself is the embedding.
        what = f"module {name!r}" if name else f"the model (an {type(module).__name__} with sparse=True)"
        raise ValueError(f"protect(): {what} makes sparse gradients, which paft's "
                         "comm hook cannot read; build it with sparse=False, or pass MonitorConfig(enabled=False) "
                         "and no inject= or comm_hook= (then DDP's own reducer runs)")


def _check_comm_hook(comm_hook: Any, comm_state: Any) -> None:
    """Checked here, since DDP only ever sees paft's hook: a bad one of the user's would
    fail at the first backward pass, with paft's hook registered for good by then."""
    if comm_hook is None:
        if comm_state is not None:
            raise ValueError("protect(): comm_state= is the state of comm_hook=, which is not given")
        return
    if not callable(comm_hook):
        raise TypeError(f"protect(): comm_hook= must be a function (state, bucket) -> future, got "
                        f"{type(comm_hook).__name__}")
    try:
        inspect.signature(comm_hook).bind(comm_state, None)
    except TypeError:
        raise TypeError("protect(): comm_hook= must take two arguments, (state, bucket), as "
                        "DistributedDataParallel.register_comm_hook's hooks do") from None
    except ValueError:  # no signature to read (a builtin): DDP's own check would not see it either
        pass


def _hook_identity(comm_hook: Any, comm_state: Any) -> list[Any]:
    """What names a comm hook alike on every rank: its function's module and qualified
    name (a ``functools.partial``'s function, and its keyword names) and its state's type.
    Never a repr, which holds an address. Ranks with different hooks would send buckets
    of different sizes, or different collectives, in their first backward pass."""
    func, keywords = comm_hook, []
    if isinstance(comm_hook, functools.partial):
        func, keywords = comm_hook.func, sorted(comm_hook.keywords)
    name = None if func is None else getattr(func, "__qualname__", type(func).__qualname__)
    module = getattr(func, "__module__", None)
    return [module, name, keywords, None if comm_state is None else type(comm_state).__qualname__]


def _check_specs(specs: Sequence[FaultSpec], params: Sequence[torch.nn.Parameter], world_size: int) -> None:
    """Fault specs that name a rank beyond the group, or that the model's dtypes cannot
    take. Checked before the hook is registered: inside a step, a bit beyond the width
    would fail in one rank's hook callback and leave the others waiting. A gradient
    bucket can hold the dtype of any parameter DDP reduces (those that require a
    gradient: a frozen bfloat16 base model beside a float32 adapter leaves bucket
    faults float32's bits); faults at rest pick, among the tensors, those they can
    corrupt, so there one dtype is enough."""
    def floating(tensors: Sequence[torch.nn.Parameter]) -> list[torch.dtype]:
        return sorted({p.dtype for p in tensors if p.is_floating_point()}, key=str)

    dtypes, trained = floating(params), floating([p for p in params if p.requires_grad])
    for spec in specs:
        try:  # here, not only in the fault schedule: its message has no protect() prefix
            spec.check_ranks(world_size)
        except FaultSpecError as err:
            raise FaultSpecError(f"protect(): inject {spec.to_text()!r}: {err.reason}", err.field) from None
        errors = []
        for dtype in trained if spec.site in BUCKET_SITES else dtypes:
            try:
                spec.check_dtype(dtype)
            except ValueError as err:
                errors.append(err)
        if errors and (spec.site in BUCKET_SITES or len(errors) == len(dtypes)):
            raise ValueError(f"protect(): inject {spec.to_text()!r}: {errors[0]}")


def _model_and_optimizer(model: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What of the model and optimizer the ranks must agree on (see :data:`_AGREED`).
    The parameter order: optimizer state is synced by it, so ranks that list parameters
    differently would mix layers' state."""
    index = {id(p): i for i, p in enumerate(model.parameters())}
    return {
        "the optimizer's type": [type(one).__qualname__ for one in chained(optimizer)],
        "the optimizer's hyperparameters": [  # plain values: an object's repr may hold its address
            {k: _exact(v) for k, v in g.items()
             if k != "params" and isinstance(v, (int, float, str, tuple, type(None), torch.Tensor))}
            for g in optimizer.param_groups],
        "the optimizer's parameter order": [[index[id(p)] for p in g["params"]] for g in optimizer.param_groups],
        "the model's parameter shapes": [(tuple(p.shape), str(p.dtype), p.requires_grad) for p in model.parameters()],
    }


def _exact(value: Any) -> Any:
    """A hyperparameter whose repr tells every value apart: a tensor (a tensor ``lr`` or
    ``betas``, as torch takes them) by its values, which its repr rounds to 4 digits;
    a tuple element-wise."""
    if isinstance(value, torch.Tensor):
        return value.detach().tolist()
    if isinstance(value, tuple):
        return tuple(_exact(v) for v in value)
    return value


_AGREED = ("the monitor config", "the protect config", "the guard config", "grad_clip", "seed", "inject",
           "the optimizer's type", "the optimizer's hyperparameters", "the optimizer's parameter order",
           "the model's parameter shapes", "the loss scaler", "the comm hook")
"""What every rank must pass to protect() alike."""


def _check_ranks_agree(model: Any, parts: dict[str, Any] | None, refusal: Exception | None) -> None:
    """One gather over ``model``'s process group, once at construction, of whether each
    rank accepted its arguments and a 64-bit digest of each setting of :data:`_AGREED`:
    a setting that differs between ranks would deadlock a later collective or silently
    mix state, and an argument refused on some ranks only must raise on all, not leave
    the others waiting in the next collective.

    Under NCCL the gather runs on the model's GPU, where DDP runs its own collectives,
    not on the current device: a model off it is refused (:func:`_check_cuda_device`),
    and that refusal travels through this gather. On the current device, cuda:0 on
    every rank that never called ``torch.cuda.set_device``, NCCL failed it ("duplicate
    GPU") on every rank, and the refusal naming the fix was never said."""
    group = model.process_group
    device = _cuda_device_of(model) if "nccl" in str(dist.get_backend(group)).lower() else None
    digests = [0] * len(_AGREED) if parts is None else [repr_digest(parts[n]) for n in _AGREED]
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        table = gather_rows(torch.tensor([int(refusal is not None), *digests], dtype=torch.int64), group).cpu()
    refused = [r for r, flag in enumerate(table[:, 0].tolist()) if flag]
    if refusal is not None:
        raise refusal
    if refused:
        raise ValueError(f"protect(): rank(s) {refused} refused their arguments (the error is raised there); "
                         "every rank must call protect() with the same, valid settings")
    differ = [n for j, n in enumerate(_AGREED, 1) if bool((table[:, j] != table[0, j]).any())]
    if differ:
        raise ValueError(f"protect(): ranks disagree on {', '.join(differ)}; every rank must call protect() "
                         "with the same settings, model and optimizer (parameter order included)")
