"""``paft``: the command-line front end (train, report, bench).

Every subcommand validates its input before doing any work: a bad option, config
file or run directory is refused with a message naming it and exit code 2, and
nothing is written.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from paft import __version__
from paft.bench import add_bench_parser, run_bench
from paft.exitcodes import EXIT_USAGE, TERMINATING_SIGNALS, interrupted_codes, signal_exit_code
from paft.options import OptionParser, add_train_options, config_or_exit, train_epilog

__all__ = ["main", "run", "build_parser"]


_TRAIN_EXAMPLES = """\
examples:
  paft train                                    # gpt, 4 workers, 40-70 s on 2 cores
  paft train --workload resnet --world-size 2 --steps 100
  paft train --inject bitflip:rate=0.05,bits=exponent,ranks=1 --protect dyn
  paft train --inject bitflip:site=local-grad,rate=0.02,bits=exponent --guard
  paft train --run-dir runs/a --resume --steps 400
"""


def build_parser(prog: str = "paft") -> argparse.ArgumentParser:
    """``prog``: how the command was run (``python -m paft``), which its messages name,
    and the commands they give to copy."""
    parser = OptionParser(
        prog=prog,
        description="Fault-tolerant data-parallel training: inject silent data corruption, "
        "diagnose worker inconsistency, re-synchronize replicas (PAFT-Sync/Dyn), guard updates.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    train = sub.add_parser(
        "train",
        help="train on N local workers (DDP, gloo on CPU / NCCL on GPU)",
        description="Train one workload on N local workers launched through torch's elastic launcher, "
        "writing a run directory (config.json, metrics/, consistency.jsonl unless --no-monitor, evals.jsonl, "
        "checkpoints/, "
        "summary.json; faults.jsonl and events.jsonl once there is something to record; tb/ with --tensorboard).",
        epilog=train_epilog() + "\n" + _TRAIN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_train_options(train)
    report = sub.add_parser(
        "report",
        help="plots and a text summary of a run directory",
        description="Write PNG plots (loss per rank, dispersion, cosine, replica divergence; faults, syncs, "
        "guard events and alerts marked, each replica split labelled with its minority ranks) and report.md for "
        "RUN_DIR, and print the summary.",
        epilog=f"exit codes: 0 done, {EXIT_USAGE} not a readable run directory, a bad --out-dir, or a report the disk "
        "cannot hold (nothing written: an earlier report stays as it was), "
        f"{interrupted_codes()}",
    )
    report.add_argument("run_dir", metavar="RUN_DIR",
                        help="a run directory written by paft train, or a library run's RunRecorder folder")
    report.add_argument("--out-dir", metavar="DIR", help="where to write the plots [default: RUN_DIR/report]")
    add_bench_parser(sub)
    return parser


def _train(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from paft.launch import launch
    from paft.machine import MachineError
    from paft.rundir import RunDirError
    from paft.signals import interrupted

    cfg, resumed_with = config_or_exit(parser, args, warn=True)
    try:
        code = launch(cfg, resumed_with, parser.prog)
    except (RunDirError, MachineError) as err:
        parser.error(str(err))
    except (KeyboardInterrupt, SignalException) as err:  # before or after the workers ran
        return interrupted(err, prog=parser.prog)
    return code


def _report(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from paft.records import console
    from paft.report import build_report
    from paft.rundata import ReportError

    try:
        result = build_report(args.run_dir, args.out_dir)
    except ReportError as err:
        parser.error(str(err))
    console(result.text)  # `paft report RUN | head`: the files are written; the reader has had enough
    return 0


def _subcommand(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of ``parser``'s subcommand ``name`` (argparse keeps it only in the
    subcommands' action, which it does not expose)."""
    return next(a.choices[name] for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def main(argv: Sequence[str] | None = None, prog: str = "paft") -> int:
    parser = build_parser(prog)
    args, extra = parser.parse_known_args(argv)
    subparser = _subcommand(parser, args.command)
    if args.command == "bench":
        subparser = _subcommand(subparser, args.benchmark)
    if extra:  # said by the subcommand, whose --help lists what it takes (parse_args would say "paft")
        words = list(sys.argv[1:] if argv is None else argv)
        given_to_paft = words[: words.index(args.command)] if args.command in words else []
        said_by = parser if any(e in given_to_paft for e in extra) else subparser  # paft --bogus report
        said_by.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "train":
        return _train(args, subparser)
    if args.command == "report":
        return _report(args, subparser)
    if args.command == "bench":
        return run_bench(args, subparser)
    raise AssertionError(args.command)


def run(prog: str = "paft") -> None:
    """The ``paft`` console script (``prog``: :func:`build_parser`'s): :func:`main`, then exit with its code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from paft.records import quiet_stdout
    from paft.signals import ignore_further_signals, interrupted, unwind_on_termination

    unwind_on_termination()
    try:
        code = main(prog=prog)
    except (KeyboardInterrupt, SignalException) as err:  # outside what train and bench catch (parsing, report)
        code = interrupted(err, prog=prog)
    except BrokenPipeError:  # the console went away (`| head`) while a command printed
        quiet_stdout()
        code = 1
    if code in [signal_exit_code(sig) for sig in (signal.SIGINT, *TERMINATING_SIGNALS)]:
        ignore_further_signals()
    sys.exit(code)


if __name__ == "__main__":
    run()
