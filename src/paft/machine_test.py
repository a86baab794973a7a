"""The checks of this machine made before any worker starts: memory, GPUs, tensorboard."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

import paft.machine
from paft.config import MonitorConfig, TrainConfig
from paft.machine import (
    BYTES_PER_PARAMETER,
    BYTES_PER_PROCESS,
    EXACT_COSINE_BYTES_PER_RANK,
    EXACT_COSINE_LOCAL_BYTES,
    MachineError,
    check_machine,
)
from paft.workloads import parameter_count


def test_the_memory_check_counts_each_worker_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each CPU worker here needs BYTES_PER_PARAMETER per parameter plus BYTES_PER_PROCESS
    # for torch; the machine's memory is what os.sysconf reports, set here to the byte.
    # Mutants that counted one worker's model, or the world size where fewer workers run
    # on this machine (the launcher's local_workers), survived the CLI's far-off cases.
    real = os.sysconf
    per_worker = BYTES_PER_PARAMETER * parameter_count("resnet") + BYTES_PER_PROCESS

    def machine(total: int) -> None:
        sizes = {"SC_PAGE_SIZE": 1, "SC_PHYS_PAGES": total}
        monkeypatch.setattr(os, "sysconf", lambda name: sizes[name] if name in sizes else real(name))

    cfg = TrainConfig(workload="resnet", world_size=3, batch_size=3, device="cpu")
    machine(3 * per_worker)
    check_machine(cfg)  # exactly enough
    machine(3 * per_worker - 1)
    with pytest.raises(MachineError) as err:
        check_machine(cfg)
    # 0.75 GiB, rounded (a mutant that truncated said "about 0 GiB").
    assert str(err.value) == ("--model: the resnet model would need about 1 GiB for weights, gradients and optimizer "
                              "state (20 bytes per parameter per worker) and this machine has 1 GiB; make it smaller")
    check_machine(cfg, local_workers=2)  # the third worker runs elsewhere
    machine(per_worker)
    check_machine(cfg, local_workers=1)
    machine(3 * BYTES_PER_PROCESS)  # torch's share fits, the models do not
    with pytest.raises(MachineError, match="--model: the resnet model would need about"):
        check_machine(cfg)
    machine(3 * BYTES_PER_PROCESS - 1)
    with pytest.raises(MachineError, match="--world-size 3: 3 worker processes on this machine"):
        check_machine(cfg)


def test_the_memory_check_counts_exact_cosines_gathered_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """--cosine exact holds every rank's gradient on each worker: a 100 M-parameter model
    on 4 workers passed the check, then a worker was killed by the OOM killer."""
    real = os.sysconf
    params = parameter_count("resnet")
    exact = ((BYTES_PER_PARAMETER + EXACT_COSINE_LOCAL_BYTES + EXACT_COSINE_BYTES_PER_RANK * 3) * params
             + BYTES_PER_PROCESS)
    sizes = {"SC_PAGE_SIZE": 1, "SC_PHYS_PAGES": 3 * exact}
    monkeypatch.setattr(os, "sysconf", lambda name: sizes[name] if name in sizes else real(name))
    shape = {"workload": "resnet", "world_size": 3, "batch_size": 3, "device": "cpu"}
    cfg = TrainConfig(**shape, monitor=MonitorConfig(cosine="exact"))
    check_machine(cfg)  # exactly enough
    sizes["SC_PHYS_PAGES"] -= 1
    with pytest.raises(MachineError, match=r"\(20 bytes per parameter per worker\), and --cosine exact's gathered "
                       r"gradients \(88 bytes more at 3 ranks\) and this machine has .* or use --cosine sketch$"):
        check_machine(cfg)
    # Nothing gathered: the sketch, or no worker metrics.
    check_machine(TrainConfig(**shape))
    check_machine(TrainConfig(**shape, monitor=MonitorConfig(cosine="exact", interval=0)))
    check_machine(TrainConfig(**shape, monitor=MonitorConfig(enabled=False, cosine="exact")))


def test_on_gpus_exact_cosines_gather_into_the_gpu_and_copy_into_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """NCCL gathers every rank's float64 gradient into the GPU (8 bytes per rank, beside
    the local float64 copies); the cosines' copies are in the machine's memory. The GPU's
    check counted the copies (a 500 M-parameter model on 8 GPUs of 80 GiB was refused,
    needing 26 GiB each), the machine's none; then the gathered ones as float32 and one
    local copy of 4 bytes (36 bytes a parameter where 80 are held)."""
    params, ranks = 500_000_000, 8
    gpu = {"total_memory": (BYTES_PER_PARAMETER + EXACT_COSINE_LOCAL_BYTES + 8 * ranks) * params}
    sizes = {"SC_PAGE_SIZE": 1, "SC_PHYS_PAGES": EXACT_COSINE_BYTES_PER_RANK * ranks * params * ranks}
    real = os.sysconf
    monkeypatch.setattr(os, "sysconf", lambda name: sizes[name] if name in sizes else real(name))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: ranks)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(**gpu))
    monkeypatch.setattr(paft.machine, "parameter_count", lambda workload, model=None: params)
    cfg = TrainConfig(workload="resnet", world_size=ranks, batch_size=ranks, device="cuda",
                      monitor=MonitorConfig(cosine="exact"))
    check_machine(cfg)  # exactly enough, on each GPU and in the machine
    gpu["total_memory"] -= 1
    with pytest.raises(MachineError, match=r"\(80 bytes more at 8 ranks\) and each GPU has"):
        check_machine(cfg)
    gpu["total_memory"] += 1
    sizes["SC_PHYS_PAGES"] -= 1
    with pytest.raises(MachineError, match=r"^--cosine exact: the 8 workers on this machine would need about 715 GiB"):
        check_machine(cfg)


@pytest.mark.usefixtures("no_tensorboard")
def test_the_machine_check_refuses_tensorboard_without_its_package() -> None:
    # paft train and each torchrun worker make it before any worker starts, as the
    # config no longer does.
    check_machine(TrainConfig(device="cpu"))
    with pytest.raises(MachineError) as err:
        check_machine(TrainConfig(device="cpu", tensorboard=True))
    assert str(err.value) == ("--tensorboard: needs the tensorboard package, which is not installed: "
                              "pip install 'paft[tensorboard]'")


def test_the_gpu_check_counts_the_workers_on_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    # Two torchrun nodes of 8 GPUs each: world size 16, 8 workers per machine, each on
    # its LOCAL_RANK's GPU. The check compared the world size with this machine's GPUs
    # and refused every multi-node GPU run (a mutant that kept the world size survived).
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: SimpleNamespace(total_memory=80 * 2**30))
    cfg = TrainConfig(workload="resnet", world_size=16, batch_size=16, device="cuda")
    check_machine(cfg, local_workers=8)
    with pytest.raises(MachineError) as err:
        check_machine(cfg, local_workers=9)
    assert str(err.value) == ("9 worker processes on this machine: NCCL needs one GPU per worker and 8 are visible; "
                              "start at most 8 here (torchrun --nproc-per-node 8) or use --device cpu (gloo)")
    with pytest.raises(MachineError, match="^--world-size 16: NCCL needs one GPU per worker and 8 are visible; "
                                          "use --world-size 8 or"):
        check_machine(cfg)  # paft train starts every worker here
