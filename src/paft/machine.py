"""What ``paft train`` (and each rank under torchrun, and ``paft bench``) checks of this
machine before any worker starts: the devices (a GPU per worker), the memory a run's
models and workers need, ``--tensorboard``'s package. A refusal is a :class:`MachineError`
(exit 2), said before anything is written.
"""

from __future__ import annotations

import os

import torch

from paft.config import TrainConfig
from paft.records import require_tensorboard
from paft.workloads import parameter_count

__all__ = [
    "BYTES_PER_PARAMETER",
    "BYTES_PER_PROCESS",
    "EXACT_COSINE_BYTES_PER_RANK",
    "EXACT_COSINE_LOCAL_BYTES",
    "MachineError",
    "check_machine",
    "uses_cuda",
]

BYTES_PER_PARAMETER = 20
"""fp32 weights, gradients, DDP buckets and two optimizer moments (the memory check)."""
BYTES_PER_PROCESS = 256 * 2**20
"""A CPU worker's resident memory before its model (torch alone: ~220 MiB)."""
EXACT_COSINE_LOCAL_BYTES = 16
"""``--cosine exact``, per parameter per worker, on its gradients' device: the comm hook's
float64 copy of each bucket of its own local gradient, and their concatenation, which
is gathered (the memory check)."""
EXACT_COSINE_BYTES_PER_RANK = 24
"""``--cosine exact``, per parameter per worker and per rank in the world, on top of
:data:`EXACT_COSINE_LOCAL_BYTES`, held at once in the machine's memory: every rank's
gradient gathered (float64, 8 bytes; on a GPU its copy moved here) and the cosines'
two float64 working copies (the power-of-two rescale, and the copy that zeroes a
non-finite rank's row); on a GPU only the gathered 8 bytes (the memory check)."""


class MachineError(ValueError):
    """This machine cannot run what was asked: the devices are not there (no GPU, fewer
    GPUs than workers, too little memory), or ``--tensorboard``'s package is missing."""


def uses_cuda(cfg: TrainConfig) -> bool:
    """Whether ``cfg`` trains on GPUs (``--device cuda``, or ``auto`` with CUDA present)."""
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def _gib(nbytes: int) -> str:
    """``nbytes`` in GiB, rounded, in integer arithmetic: a ``--model`` size of hundreds
    of digits overflows a float (a traceback instead of the refusal)."""
    gib = (nbytes + 2**29) // 2**30
    return f"{gib:,}" if gib < 10**15 else f"10^{len(str(gib)) - 1}"  # its order of magnitude


def check_machine(cfg: TrainConfig, local_workers: int | None = None) -> None:
    """Refuse, with :class:`MachineError`, what this machine lacks for ``cfg`` and would
    fail inside the workers: devices, memory, ``--tensorboard``'s package. Writes
    nothing. ``local_workers``: the worker processes on this machine (default: the world
    size, as ``paft train`` starts them all here).

    NCCL runs one rank per GPU: two ranks on one device are refused by NCCL itself
    ("duplicate GPU"), so the check is made here, before any worker starts.
    """
    if cfg.tensorboard:
        try:
            require_tensorboard()
        except ModuleNotFoundError as err:
            raise MachineError(str(err)) from None
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise MachineError("--device cuda: no CUDA device is visible; use --device cpu")
    count = torch.cuda.device_count()
    local = cfg.world_size if local_workers is None else local_workers
    # This machine's workers each take one of its GPUs (torchrun's LOCAL_RANK): under
    # torchrun over several machines the world size is all of theirs, and two nodes of 8
    # GPUs each were refused for a world size of 16.
    if uses_cuda(cfg) and local > count:
        visible = f"NCCL needs one GPU per worker and {count} {'is' if count == 1 else 'are'} visible"
        if local_workers is None:
            raise MachineError(f"--world-size {cfg.world_size}: {visible}; use --world-size {count} "
                               "or --device cpu (gloo)")
        raise MachineError(f"{local} worker processes on this machine: {visible}; start at most {count} here "
                           f"(torchrun --nproc-per-node {count}) or use --device cpu (gloo)")
    # Weights, gradients, DDP's buckets and two optimizer moments: 20 bytes per fp32
    # parameter per worker, before activations; --cosine exact gathers the gradients of
    # every rank on each (a 100 M-parameter model on 4 workers passed, then a worker was
    # killed by the OOM killer). Only sizes far beyond the machine are refused here; the
    # rest is the allocator's to judge.
    exact = cfg.monitor.enabled and cfg.monitor.interval > 0 and cfg.monitor.cosine == "exact"
    params = parameter_count(cfg.workload, cfg.model)
    # NCCL gathers the float64 local copies into the GPU (8 bytes per rank; counted as 4,
    # float32, a run that ran out of GPU memory passed); the cosines' copies are made in
    # this machine's memory (gather_exact_grads moves the gathered ones there).
    per_rank = 8 if uses_cuda(cfg) else EXACT_COSINE_BYTES_PER_RANK
    per_parameter = BYTES_PER_PARAMETER + (EXACT_COSINE_LOCAL_BYTES + per_rank * cfg.world_size if exact else 0)
    need = per_parameter * params
    if uses_cuda(cfg):
        have, where = torch.cuda.get_device_properties(0).total_memory, "each GPU has"
        host = _memory()
        copies = EXACT_COSINE_BYTES_PER_RANK * cfg.world_size * params * local if exact else 0
        if copies > host:
            raise MachineError(
                f"--cosine exact: the {local} workers on this machine would need about {_gib(copies)} GiB of its "
                f"memory for every rank's gradient and their float64 copies ({EXACT_COSINE_BYTES_PER_RANK} bytes "
                f"per parameter per rank per worker) and this machine has {host / 2**30:,.0f} GiB; "
                "make the model smaller or use --cosine sketch"
            )
    else:
        # Every worker on this machine also holds torch itself (a typo such as
        # --world-size 1000 would otherwise start 1000 processes).
        have, where = _memory(), "this machine has"
        if BYTES_PER_PROCESS * local > have:
            raise MachineError(
                f"--world-size {cfg.world_size}: {local} worker processes on this machine would need about "
                f"{BYTES_PER_PROCESS * local / 2**30:,.0f} GiB for torch alone ({BYTES_PER_PROCESS // 2**20} MiB "
                f"each) and {where} {have / 2**30:,.0f} GiB; use fewer workers"
            )
        need = (need + BYTES_PER_PROCESS) * local
    if need > have:
        gathered = (f", and --cosine exact's gathered gradients ({per_parameter - BYTES_PER_PARAMETER} bytes more "
                    f"at {cfg.world_size} ranks)" if exact else "")
        raise MachineError(
            f"--model: the {cfg.workload} model would need about {_gib(need)} GiB for weights, gradients "
            f"and optimizer state ({BYTES_PER_PARAMETER} bytes per parameter per worker){gathered} and {where} "
            f"{have / 2**30:,.0f} GiB; make it smaller{' or use --cosine sketch' if exact else ''}"
        )


def _memory() -> int:
    """This machine's memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
