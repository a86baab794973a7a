"""How paft's costs grow with world size and model size: measured at 2 and 4 ranks, then calculated.

Measured (default gpt, gloo on this machine), per world size in ``--world-sizes``:

- the monitor's cost per step: its step time over plain DDP's from paired steps
  (:func:`paft.bench.overhead.measure`: both trainers in the same workers, taking
  turns step by step), wall time and CPU time;
- PAFT-Sync: bytes and critical-path seconds per sync, by the mode the sync took
  (``noop`` when fingerprints agree, ``majority-copy`` / ``median`` /
  ``median-with-reference`` to repair a faulty rank), from the runs' ``events.jsonl``:
  the median seconds, and the bytes of the median sync (of an even count, the lower of
  the two middle ones: a count one sync sent, printed in full, not a mean of two).

Calculated (:func:`model`) from the protocol, for these world sizes and for larger
jobs, e.g. 1024 ranks and 7B parameters: each rank's row of the per-step control
collective is ``8 * (9 + k)`` bytes and every rank receives the others' (``N - 1``
rows in, as many out: a ring all-gather forwards them, gloo's all-to-all sends them
directly); a no-op sync gathers a 24-byte row per rank (two fingerprints and the
state's structure hash; 32 at world size 2, with the reference's tag); a majority copy
sends one replica's state (parameters + optimizer state) to each minority rank; a
median gathers every replica's state.
"""

from __future__ import annotations

import json
import pathlib
import statistics
from typing import Any

from paft.bench import overhead
from paft.bench.runner import Run, make_config, markdown_table, run_all, write_outputs
from paft.config import MonitorConfig, TrainConfig
from paft.consistency import HEADER
from paft.records import console, read_jsonl

__all__ = ["run", "model"]

_GB = 1e9

_JOBS = ((4, 0.8e6), (64, 1.3e9), (1024, 7e9))
"""(ranks, parameters) of the jobs the cost model is calculated for: the measured
runs' size (default gpt), and two large jobs."""


def _control_bytes(sketch_dim: int) -> int:
    """Each rank's row of the per-step control collective: the header and the sketch, float64."""
    return 8 * (HEADER + sketch_dim)


def _noop_sync_bytes(ranks: int) -> int:
    """Each rank's row in a sync that finds the replicas identical: two state
    fingerprints and the structure hash (int64), and at world size 2 the reference's tag."""
    return 8 * (3 + (ranks == 2))


def model(ranks: int, params: float, *, sketch_dim: int = MonitorConfig.sketch_dim,
          state_bytes_per_param: int = 12, grad_bytes_per_param: int = 4,
          link_gbps: float = 400.0) -> dict[str, float]:
    """Per-step and per-sync bytes for a job of ``ranks`` replicas of ``params`` parameters.

    ``state_bytes_per_param``: fp32 weights + Adam's two moments = 12 bytes.
    Returns bytes and the time at ``link_gbps`` (per-rank link, bandwidth only). A
    gathered row (``*_row_B``) reaches every other rank: each rank receives (and, in a
    ring, forwards) ``ranks - 1`` rows.
    """
    link = link_gbps / 8 * _GB  # bytes/s
    control = _control_bytes(sketch_dim)
    grad_allreduce = 2 * (ranks - 1) / ranks * params * grad_bytes_per_param  # ring all-reduce, per rank
    state = params * state_bytes_per_param
    return {
        "control_row_B": control,
        "control_received_B": control * (ranks - 1),
        "control_vs_gradient_allreduce": control * (ranks - 1) / grad_allreduce,
        "grad_allreduce_B": grad_allreduce,
        "sync_noop_row_B": _noop_sync_bytes(ranks),
        "sync_noop_received_B": _noop_sync_bytes(ranks) * (ranks - 1),
        "sync_majority_copy_B": state,
        "sync_majority_copy_s": state / link,
        "sync_median_received_B": state * (ranks - 1),
        "sync_median_s": state * (ranks - 1) / link,
    }


def _sketch_dim(run_dir: pathlib.Path) -> int:
    """The sketch dimension k of a run's monitor, from the ``config.json`` it wrote."""
    return int(json.loads((run_dir / "config.json").read_text(encoding="utf-8"))["monitor"]["sketch_dim"])


def _base(world_size: int, steps: int, device: str) -> dict[str, Any]:
    return TrainConfig(world_size=world_size, steps=steps, eval_every=steps, eval_batches=1, checkpoint_every=0,
                       warmup_steps=steps // 4, device=device).to_dict()


def run(out: pathlib.Path, *, world_sizes: tuple[int, ...] = (2, 4), steps: int = 40,
        device: str = "auto") -> dict[str, Any]:
    measured: dict[int, dict[str, Any]] = {}
    for ws in world_sizes:
        # One run's steps/s against another's scatters by +-12% here: the monitor's
        # few percent are measured from paired steps instead.
        paired = out / "runs" / f"ws{ws}-paired"
        cost = overhead.measure(paired, _base(ws, overhead.WARMUP + steps, device), ["monitor"], steps=steps,
                                world_size=ws)
        sketch_dim = _sketch_dim(paired / "monitor")
        control = _control_bytes(sketch_dim)  # each rank's row in the monitored run
        base = _base(ws, steps, device)
        period = min(5, steps // 2)  # two syncs or more: --steps may be as few as 5
        variants = {
            "sync-noop": {"monitor": {"enabled": False}, "protect": {"mode": "sync", "sync_period": period,
                                                                     "overlap": False}},
            "sync-repair": {"monitor": {"enabled": False}, "protect": {"mode": "sync", "sync_period": period,
                                                                       "overlap": False},
                            "inject": ["bitflip:rate=1,bits=mantissa,ranks=1"]},
        }
        runs = [Run(f"ws{ws}-{name}", make_config(base, out / "runs" / f"ws{ws}-{name}", **opts),
                    labels={"variant": name}) for name, opts in variants.items()]
        run_all(runs, ws)
        syncs: dict[str, list[dict[str, Any]]] = {}
        for r in runs:
            for e in read_jsonl(pathlib.Path(r.config["run_dir"]) / "events.jsonl"):
                if e.get("event") == "sync":
                    syncs.setdefault(e["mode"], []).append(e)
        measured[ws] = {
            "monitor_step_time_ratio": cost["monitor"]["wall"],
            "monitor_cpu_ratio": cost["monitor"]["cpu"],
            "plain_step_ms": cost["plain"]["wall_ms"],
            "sketch_dim": sketch_dim,
            "control_row_B": control,
            "control_received_B": control * (ws - 1),
            "syncs": {mode: {"count": len(es), "bytes_sent_rank0": statistics.median_low(e["bytes_sent"] for e in es),
                             "seconds": statistics.median(e["seconds"] for e in es)} for mode, es in syncs.items()},
        }
    rows = []
    for ws, m in measured.items():
        for mode, s in sorted(m["syncs"].items()):
            rows.append([ws, mode, s["count"], s["bytes_sent_rank0"], s["seconds"] * 1e3])
    sync_table = markdown_table(["ranks", "sync mode", "syncs", "bytes sent (rank 0, median)", "ms (median)"], rows)
    control_table = markdown_table(
        ["ranks", "sketch k", "control row per rank / received per step (B, calculated)",
         "monitored / plain DDP step time", "monitored / plain DDP CPU per step", "plain DDP step (ms)"],
        [[ws, m["sketch_dim"], f"{m['control_row_B']} / {m['control_received_B']}", m["monitor_step_time_ratio"],
          m["monitor_cpu_ratio"], m["plain_step_ms"]] for ws, m in measured.items()])
    # The large jobs are calculated with the k the runs used (every run's monitor is _base's).
    sketch_dim = measured[world_sizes[-1]]["sketch_dim"]
    calculated = {job: model(*job, sketch_dim=sketch_dim) for job in _JOBS}
    calc_table = markdown_table(
        ["ranks", "params", "control received/step", "control / grad all-reduce bytes", "noop sync row / received",
         "majority copy (at 400 Gb/s)", "median gather (at 400 Gb/s)"],
        [[ranks, f"{params:.3g}", f"{c['control_received_B'] / 1e6:.3g} MB",
          f"{c['control_vs_gradient_allreduce']:.2e}",
          f"{c['sync_noop_row_B']} B / {c['sync_noop_received_B'] / 1e3:.3g} KB",
          f"{c['sync_majority_copy_B'] / _GB:.3g} GB ({c['sync_majority_copy_s']:.2f} s)",
          f"{c['sync_median_received_B'] / _GB:.3g} GB ({c['sync_median_s']:.1f} s)"]
         for (ranks, params), c in calculated.items()])
    md = (f"Measured on this machine (gpt default; the monitor over plain DDP from {steps} paired steps after "
          f"{overhead.WARMUP} untimed, the syncs from {steps}-step runs):\n\n{control_table}\n\n{sync_table}\n\n"
          f"Calculated (fp32 weights + Adam moments = 12 B/param, k = {sketch_dim}, as in the runs):"
          f"\n\n{calc_table}\n")
    results = {"measured": {str(k): v for k, v in measured.items()}, "sketch_dim": sketch_dim,
               "calculated": {f"{r}x{p:g}": c for (r, p), c in calculated.items()}}
    write_outputs(out, "Scaling of paft's costs", results, md)
    console("\n" + md)
    return results
