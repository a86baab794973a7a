"""``paft bench``: side-by-side experiments, measured in one session on this machine.

Subcommands (each writes ``results.json`` and ``results.md`` into ``--out``; matrix,
desync and detection also plots):

- ``matrix``: the PAFT evaluation matrix (:mod:`paft.bench.matrix`);
- ``overhead``: cost of each defense without faults (:mod:`paft.bench.overhead`);
- ``desync``: the silent-inconsistency study (:mod:`paft.bench.desync`);
- ``detection``: the guard's detection table per bit (:mod:`paft.bench.detection`);
- ``scaling``: control and sync bytes/time at 2 and 4 ranks, and the cost model (:mod:`paft.bench.scaling`).

Example::

    paft bench matrix --quick
    paft bench overhead --steps 300 --out bench/overhead
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import pathlib
import sys
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from paft.bench.overhead import BLOCKS, VARIANTS, WARMUP
from paft.config import DEVICES, ProtectConfig, error_option
from paft.exitcodes import EXIT_USAGE, EXIT_WORKER_FAILED, interrupted_codes
from paft.options import parse_model_arg
from paft.records import BENCH_MARKER
from paft.rundir import default_run_dir
from paft.workloads import WORKLOADS

__all__ = ["add_bench_parser", "run_bench"]


_EXIT_CODES = (f"exit codes: 0 done, {EXIT_WORKER_FAILED} a run failed (its traceback above) or the disk is full, "
               f"{EXIT_USAGE} bad input (nothing written), {interrupted_codes()}")
# A results file the disk cannot hold: said in a line, not a traceback.
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def add_bench_parser(sub: Any) -> argparse.ArgumentParser:
    bench = sub.add_parser(
        "bench",
        help="side-by-side experiments (matrix, overhead, desync, detection, scaling)",
        description="Run a benchmark: all its runs share one worker group on this machine, same seeds and "
        "data order; throughput is compared from alternating runs (overhead, and the guard's cost in detection "
        "and the monitor's in scaling: from paired steps).",
        epilog=_EXIT_CODES,
    )
    kinds = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")

    def common(p: argparse.ArgumentParser) -> None:
        p.epilog = _EXIT_CODES
        p.add_argument("--out", metavar="DIR", help="output folder [default: bench/<benchmark>-<timestamp>-<pid>]")
        p.add_argument("--overwrite", action="store_true", help="replace an existing --out folder")
        p.add_argument("--device", choices=DEVICES, default="auto",
                       help="auto: CUDA (NCCL, one GPU per worker) if available, else CPU (gloo) "
                       "[default: %(default)s]")

    def world_size(p: argparse.ArgumentParser, default: int) -> None:
        p.add_argument("--world-size", type=int, default=default, metavar="WORLD-SIZE",
                       help="workers [default: %(default)s]")

    matrix = kinds.add_parser("matrix", help="fault-free / unprotected / averager / PAFT-Sync / PAFT-Dyn / guard, "
                              "per workload and fault setting",
                              description="The PAFT evaluation matrix: every defense beside plain DDP under the same "
                              "injected faults (all-reduce and local-gradient bit flips on rank 1), per workload; "
                              "validation-loss gap, replicas, syncs, detections and throughput, with plots.")
    common(matrix)
    matrix.add_argument("--quick", action="store_true",
                        help="one aggregation and one local-gradient fault setting, fewer steps (under 5 minutes)")
    matrix.add_argument("--workloads", default="gpt,llama,resnet", help="comma-separated [default: %(default)s]")
    matrix.add_argument("--steps", type=int, help="steps per run [default: 40 with --quick, else 150]")
    world_size(matrix, 4)

    overhead = kinds.add_parser("overhead", help="cost per step of each defense without faults, ratio to plain DDP",
                                description="Every variant trains in the same worker processes, one step each in "
                                "turn (paired steps), so machine drift cancels out of the ratios.")
    common(overhead)
    overhead.add_argument("--steps", type=int, default=200,
                          help="timed steps per variant, at least 5 [default: %(default)s]")
    overhead.add_argument("--warmup", type=int, default=WARMUP,
                          help="untimed steps first (DDP set-up, the guard's warm-up) [default: %(default)s]")
    overhead.add_argument("--period", type=int, default=20,
                          help=f"sync period H (PAFT-Dyn's first, held to its bounds [{ProtectConfig.h_min}, "
                          f"{ProtectConfig.h_max}]; it adapts it) [default: %(default)s]")
    overhead.add_argument("--workload", default="gpt", metavar="WORKLOAD",
                          help=f"one of {', '.join(WORKLOADS)} [default: %(default)s]")
    world_size(overhead, 4)
    overhead.add_argument("--batch-size", type=int, default=64, metavar="BATCH-SIZE",
                          help="global batch size; the monitor's cost per step is fixed, so its share falls as "
                          "the work per rank grows [default: %(default)s, as paft train]")
    overhead.add_argument("--model", metavar="KEY=VALUE", action="append", type=parse_model_arg,
                          help="model size override, as paft train's (e.g. --model n_layer=12); repeatable")
    overhead.add_argument("--variants", help=f"comma-separated subset of {','.join(VARIANTS)} [default: all]; "
                          "plain DDP, the reference, always runs")

    desync = kinds.add_parser("desync", help="loss/gradient dispersion under desynchronized shuffling and seeds",
                              description="The silent-inconsistency study: the worker metrics (loss and "
                              "gradient-norm dispersion, gradient cosine) of three settings (synchronized; "
                              "desynchronized shuffling; desynchronized shuffling and seeds), with plots.")
    common(desync)
    desync.add_argument("--steps", type=int, default=150, help="steps per setting [default: %(default)s]")
    world_size(desync, 4)

    detection = kinds.add_parser("detection", help="the guard's detection table per float32 bit and site",
                                 description="For each float32 bit and bit class, at the aggregation and "
                                 "local-gradient sites: the share of injected faults that were harmful, the share "
                                 "the guard detected, and false positives (in the faulty runs and fault-free "
                                 "ones); and the guard's overhead without faults.")
    common(detection)
    detection.add_argument("--steps", type=int, default=40,
                           help="steps per fault run [default: %(default)s]; the guard's overhead without "
                           "faults is measured over its own 30 untimed + 200 paired steps (about 10 minutes "
                           "in all on 2 cores)")
    detection.add_argument("--rate", type=float, default=0.1, help="fault rate per step [default: %(default)s]")
    world_size(detection, 2)

    scaling = kinds.add_parser("scaling", help="control-collective and sync bytes/time at several world sizes",
                               description="What grows with the world size: the per-step control collective's "
                               "bytes and time, a sync's bytes and time, and the monitor's paired-step cost, "
                               "measured at each world size beside the cost model.")
    common(scaling)
    scaling.add_argument("--world-sizes", type=_world_sizes, default="2,4", metavar="WORLD-SIZES",
                         help="comma-separated [default: %(default)s]")
    scaling.add_argument("--steps", type=int, default=40,
                         help="steps per sync run, and timed paired steps of the monitor against plain DDP, at "
                         f"least {BLOCKS} [default: %(default)s]")
    return bench


def _world_sizes(text: str) -> tuple[int, ...]:
    """``--world-sizes``: comma-separated integers (bounds are checked with the other options)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


MAX_LOCAL_WORLD_SIZE = 64


def _out_dir(args: argparse.Namespace, parser: argparse.ArgumentParser) -> pathlib.Path:
    from paft.records import is_file, output_dir_problem

    if args.out is not None and not args.out.strip():
        parser.error("--out: must not be empty (leave it out for bench/<benchmark>-<time>-<pid>)")
    out = pathlib.Path(args.out or default_run_dir(args.benchmark, root="bench")).expanduser()
    # Only the marker: "results.json" is a name anyone's folder may hold.
    problem = output_dir_problem(out, "--out", {BENCH_MARKER: is_file}, args.overwrite)
    if problem:
        parser.error(problem)
    return out


def _refuse_repeats(parser: argparse.ArgumentParser, option: str, names: Sequence[Any]) -> None:
    twice = sorted({n for n in names if list(names).count(n) > 1})
    if twice:
        parser.error(f"{option}: {', '.join(map(str, twice))} listed more than once")


def _validate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Every check before anything is deleted or started."""

    # Across-rank comparisons: one worker has nothing to compare (and no rank 1 to fault).
    # Checked first, so that --world-size 0 is told the bound that holds here.
    if args.benchmark in ("matrix", "desync", "detection") and args.world_size < 2:
        parser.error(f"--world-size: must be >= 2 for {args.benchmark}, got {args.world_size}")
    for name in ("steps", "world_size", "period", "batch_size"):
        value = getattr(args, name, None)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1, got {value}")
    # One local process per rank: more than this is a typo on any one machine.
    if args.benchmark != "scaling" and args.world_size > MAX_LOCAL_WORLD_SIZE:
        parser.error(f"--world-size: must be <= {MAX_LOCAL_WORLD_SIZE} (one process per rank on this machine), "
                     f"got {args.world_size}")
    check = _BENCHMARKS[args.benchmark].check
    if check is not None:
        check(args, parser)
    _check_machine(args, parser)


def _check_block_steps(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.steps < BLOCKS:
        parser.error(
            f"--steps: must be >= {BLOCKS} (the ratios are also reported per block), got {args.steps}"
        )


def _check_overhead(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    _check_block_steps(args, parser)
    if args.warmup < 0:
        parser.error(f"--warmup: must be >= 0, got {args.warmup}")
    # The runs' own config bounds it: checked here, or a period beyond them was a
    # traceback after --out was written.
    try:
        ProtectConfig(sync_period=args.period)
    except ValueError as err:
        said = error_option(str(err))
        parser.error(f"--period: {said[1] if said else err}")
    if args.batch_size % args.world_size:
        parser.error(f"--batch-size: {args.batch_size} cannot be split evenly across --world-size {args.world_size}")
    if args.variants is not None:  # "" is a typo, not "all"
        unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
        if unknown:
            parser.error(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
        if args.variants == "plain":
            parser.error("--variants: plain alone measures nothing: plain DDP is the reference the variants are "
                         "measured against (it always runs); name a variant")
        _refuse_repeats(parser, "--variants", args.variants.split(","))
    if args.workload not in WORKLOADS:
        parser.error(f"--workload: unknown {args.workload!r}; choose from {list(WORKLOADS)}")
    # Said here: the config's own check names paft train's --dropout, which this command has not.
    if any(key == "dropout" for key, _ in args.model or []):
        parser.error("--model: dropout is not a model size: paft bench overhead trains without dropout")


def _check_matrix(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    names = args.workloads.split(",")
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        parser.error(f"--workloads: unknown {unknown}; choose from {list(WORKLOADS)}")
    _refuse_repeats(parser, "--workloads", names)


def _check_detection(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if not 0 < args.rate <= 1:
        parser.error(f"--rate: must be in (0, 1], got {args.rate}")


def _check_scaling(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from paft.config import TrainConfig

    _check_block_steps(args, parser)
    sizes = args.world_sizes
    if any(x < 2 or x > MAX_LOCAL_WORLD_SIZE for x in sizes):
        parser.error(f"--world-sizes: must all be in [2, {MAX_LOCAL_WORLD_SIZE}], got {','.join(map(str, sizes))}")
    _refuse_repeats(parser, "--world-sizes", sizes)
    batch = TrainConfig.batch_size  # the scaling runs train the default global batch
    uneven = [x for x in sizes if batch % x]
    if uneven:
        parser.error(f"--world-sizes: {uneven[0]} does not split the default global batch of {batch} evenly; "
                     f"use divisors of {batch}")


def _check_machine(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The machine (and, for overhead, the model and batch) checked as paft train checks them."""
    from paft.config import TrainConfig
    from paft.machine import MachineError, check_machine

    world_size = max(args.world_sizes) if args.benchmark == "scaling" else args.world_size
    try:
        if args.benchmark == "overhead":
            cfg = TrainConfig(workload=args.workload, world_size=world_size, batch_size=args.batch_size,
                              device=args.device, model=dict(args.model or []))
        else:
            cfg = TrainConfig(world_size=world_size, batch_size=world_size, device=args.device)
        check_machine(cfg)
    except (ValueError, MachineError) as err:
        parser.error(str(err))


def _run_overhead(out: pathlib.Path, args: argparse.Namespace) -> None:
    from paft.bench import overhead

    overhead.run(out, steps=args.steps, warmup=args.warmup, period=args.period, workload=args.workload,
                 world_size=args.world_size, batch_size=args.batch_size, device=args.device,
                 model=dict(args.model or []),
                 variants=args.variants.split(",") if args.variants is not None else None)


def _run_matrix(out: pathlib.Path, args: argparse.Namespace) -> None:
    from paft.bench import matrix

    matrix.run(out, quick=args.quick, workloads=args.workloads.split(","), steps=args.steps,
               world_size=args.world_size, device=args.device)


def _run_desync(out: pathlib.Path, args: argparse.Namespace) -> None:
    from paft.bench import desync

    desync.run(out, steps=args.steps, world_size=args.world_size, device=args.device)


def _run_detection(out: pathlib.Path, args: argparse.Namespace) -> None:
    from paft.bench import detection

    detection.run(out, steps=args.steps, rate=args.rate, world_size=args.world_size, device=args.device)


def _run_scaling(out: pathlib.Path, args: argparse.Namespace) -> None:
    from paft.bench import scaling

    scaling.run(out, world_sizes=args.world_sizes, steps=args.steps, device=args.device)


class _Benchmark(NamedTuple):
    run: Callable[[pathlib.Path, argparse.Namespace], None]
    check: Callable[[argparse.Namespace, argparse.ArgumentParser], None] | None = None
    """Its own options' checks, after the ones all benchmarks share (parser.error on the first bad one)."""


_BENCHMARKS: dict[str, _Benchmark] = {
    "matrix": _Benchmark(_run_matrix, _check_matrix),
    "overhead": _Benchmark(_run_overhead, _check_overhead),
    "desync": _Benchmark(_run_desync),
    "detection": _Benchmark(_run_detection, _check_detection),
    "scaling": _Benchmark(_run_scaling, _check_scaling),
}


def run_bench(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Validate, then run the benchmark into ``--out``. With ``--overwrite`` the old
    results wait beside it (``<out>.replaced-<id>``) until the new benchmark finishes,
    and come back if it does not."""
    import shutil

    from paft.claim import hold_dir_lock, set_aside, settle
    from paft.rundir import RunDirError
    from paft.signals import SignalHold

    _validate(args, parser)
    out = _out_dir(args, parser)
    with contextlib.ExitStack() as locks:
        hold = SignalHold()  # a signal between the set-aside and the try below would strand the old results
        try:
            if args.overwrite and out.is_dir():  # a benchmark still writing there keeps it (records would mix)
                locks.enter_context(hold_dir_lock(out, "--out", "paft bench"))
            replaced = set_aside(out) if args.overwrite else None
        except RunDirError as err:
            hold.release()
            parser.error(str(err))
        except BaseException:
            hold.release()
            raise
        code = EXIT_WORKER_FAILED
        try:
            hold.release()  # a signal held since the set-aside unwinds from here, through the settling below
            code = _run_into(out, args, parser, locks, puts_back=replaced is not None)
            return code
        finally:
            if replaced is not None:
                with SignalHold():  # deleting or moving back must not stop halfway
                    if code != 0:
                        shutil.rmtree(out, ignore_errors=True)
                    settle(replaced, out, keep_new=code == 0, prog="paft bench")


def _kept(out: pathlib.Path, puts_back: bool) -> str:
    """What a stopped benchmark's line adds: its folder keeps what was written (runs stepped
    in lockstep, as overhead's, finish none early), unless ``--overwrite`` puts an old one
    back (``puts_back``; where there was none to set aside, the new folder stays too)."""
    return "" if puts_back else f"; {out} keeps what was written"


def _run_into(out: pathlib.Path, args: argparse.Namespace, parser: argparse.ArgumentParser,
              locks: contextlib.ExitStack, *, puts_back: bool) -> int:
    from paft.claim import hold_dir_lock
    from paft.rundir import RunDirError

    # Written first, so that an interrupted benchmark's folder is still known as ours.
    try:
        out.mkdir(parents=True, exist_ok=True)
        locks.enter_context(hold_dir_lock(out, "--out", "paft bench"))
        (out / BENCH_MARKER).write_text(f"paft bench {args.benchmark}\n")
    except RunDirError as err:
        parser.error(str(err))
    except OSError as err:
        parser.error(f"--out: cannot create {out}: {err.strerror or err}")
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from paft.records import console
    from paft.signals import interrupted
    from paft.workers import WorkerFailed

    try:
        _BENCHMARKS[args.benchmark].run(out, args)
    except WorkerFailed as err:
        print(err.describe("paft bench") + _kept(out, puts_back), file=sys.stderr)
        return EXIT_WORKER_FAILED
    except (KeyboardInterrupt, SignalException) as err:
        return interrupted(err, _kept(out, puts_back), "paft bench")
    except OSError as err:
        if err.errno not in _DISK_FULL:  # anything else is a bug to see in full
            raise
        print(f"paft bench: cannot write {err.filename or out}: {err.strerror}{_kept(out, puts_back)}",
              file=sys.stderr)
        return EXIT_WORKER_FAILED
    plots = ", plots" if args.benchmark in ("matrix", "desync", "detection") else ""
    console(f"\nresults in {out}/ (results.md, results.json{plots})")
    return 0
