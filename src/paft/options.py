"""Command-line options for a training run, mapped onto :class:`TrainConfig`.

The option table (:data:`paft.option_table.OPTIONS`) ties each field of the config tree
to a ``--long-option`` (named as :func:`paft.config.long_option` says, the name the
config's errors use); the help text is the field's own docstring, so the two never drift
apart. Values come, lowest precedence first, from the dataclass defaults, a ``--config``
file (TOML, YAML or JSON, keys spelled like the long options: ``world-size = 4``), and the
command line. A run's ``config.json`` (:meth:`TrainConfig.to_dict`'s shape: the fields,
with the tables ``monitor``, ``protect`` and ``guard``) is a ``--config`` file too, read
through the same table: it reruns that run's settings in another folder. The files are
read by :mod:`paft.config_files`; this module merges them with the command line.
``paft train`` builds its config with :func:`config_or_exit` (its parser is a
subcommand's), ``python -m paft.train`` (under torchrun) with
:func:`parse_train_config`, which wraps it.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import pathlib
import re
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple, NoReturn

from paft.config import TrainConfig, as_options, error_option
from paft.config_files import ConfigFileError, field_named, option_values, read_config_file, saved_values
from paft.exitcodes import EXIT_PERSISTENT_FAULT, EXIT_USAGE, EXIT_WORKER_FAILED, interrupted_codes
from paft.faultspec import parse_specs, stale_sites
from paft.option_table import BY_FLAG, OPTIONS, SECTION_TYPES, Option
from paft.records import is_file
from paft.resume_options import ResumeChange, changes_said, resume_args, resume_changes
from paft.rundir import FIXED_ON_RESUME, fixed_on_resume_error, latest_step, resolve_run_dir
from paft.workloads import DROPOUT_WORKLOADS

__all__ = ["OPTIONS", "ConfigFileError", "OptionParser", "add_train_options", "parse_train_config",
           "config_or_exit", "config_from_namespace", "parse_model_arg", "ignored_options", "idle_faults",
           "train_warnings", "train_epilog"]


_GROUP_TITLES = {
    None: "run",
    "monitor": "diagnostics",
    "protect": "PAFT-Sync / PAFT-Dyn",
    "guard": "guard (harmful-update detection and recompute)",
}


@functools.cache
def _field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each dataclass field (the help text of its option)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _default(opt: Option) -> Any:
    for f in dataclasses.fields(SECTION_TYPES[opt.section]):
        if f.name == opt.name:
            if f.default is not dataclasses.MISSING:
                return f.default
            assert f.default_factory is not dataclasses.MISSING, f"{opt.name}: every config field has a default"
            return f.default_factory()
    raise KeyError(opt.name)


def parse_model_arg(text: str) -> tuple[str, Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    if raw.strip().lower() in ("true", "false"):  # as a config file writes them
        return key.strip(), raw.strip().lower() == "true"
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    return key.strip(), value


def add_train_options(parser: argparse.ArgumentParser) -> None:
    """Add every training option (grouped, help from the field docstrings) to ``parser``."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="TOML, YAML or JSON file (by suffix) whose keys mirror the long options (e.g. world-size = 2), "
        "or a run's config.json (its settings, without its --run-dir, --resume and --overwrite); "
        "options given on the command line win",
    )
    groups: dict[str | None, argparse._ArgumentGroup] = {}
    for opt in OPTIONS:
        group = groups.get(opt.section)
        if group is None:
            group = groups[opt.section] = parser.add_argument_group(_GROUP_TITLES[opt.section])
        # The docstrings name their option for readers of the code; --help needs neither that nor RST.
        doc = re.sub(r"\s*\(``--[a-z-]+``(?:, ([^)]*))?\)", lambda m: f" ({m[1]})" if m[1] else "",
                     _field_docs(SECTION_TYPES[opt.section]).get(opt.name, ""))
        doc = re.sub(r":[a-z]+:`~?([^`]*)`", r"\1", doc).replace("``", "")  # :func:`x` -> x
        default = _default(opt)
        kwargs: dict[str, Any] = {"dest": opt.flag, "default": argparse.SUPPRESS}
        if opt.kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            help_text = f"{doc} [default: {'on' if default else 'off'}]"
        elif opt.kind == "list":
            kwargs.update(action="append", metavar=opt.metavar)
            help_text = doc
        elif opt.kind == "model":
            kwargs.update(action="append", metavar=opt.metavar, type=parse_model_arg)
            help_text = doc
        else:
            kwargs.update(type=opt.kind, choices=opt.choices, metavar=opt.metavar)
            shown = default if default != "" else "auto"
            help_text = f"{doc} [default: {shown}]"
        kwargs["help"] = help_text.replace("%", "%%")
        group.add_argument(f"--{opt.flag}", **kwargs)




class _Source(NamedTuple):
    """The file an option's value came from, as an error names it: ``--config: c.toml``."""

    option: str  # "--config" or "--resume"
    path: str
    fields: bool  # in config.json's shape: it names an option by its field (guard.window)

    def __str__(self) -> str:
        return f"{self.option}: {self.path}"

    def names(self, flag: str) -> str:
        """How this file names option ``flag``: ``guard-window``, or ``guard.window (--guard-window)``."""
        return field_named(BY_FLAG[flag]) if self.fields else flag


def _merged(layers: Sequence[tuple[dict[str, Any], _Source | None]]) -> tuple[dict[str, Any], dict[str, _Source]]:
    """The options' values from ``layers`` of values and where they were read (lowest
    precedence first; a later value replaces, except that ``--model`` fields add to the
    ones before), and the file each value came from (none: the command line, torchrun)."""
    values: dict[str, Any] = {}
    source: dict[str, _Source] = {}
    for layer, where in layers:
        for key, value in layer.items():
            if BY_FLAG[key].kind == "model" and key in values:
                value = list({**dict(values[key]), **dict(value)}.items())
            values[key] = value
            if where is None:
                source.pop(key, None)
            else:
                source[key] = where
    return values, source


# The options a resume keeps (FIXED_ON_RESUME) that compare as they are given; --model,
# --sync-mode and --sync-period compare as they take effect (check_run_dir does it).
_KEPT_AS_SAVED = tuple(flag.removeprefix("--") for _, flag in FIXED_ON_RESUME
                       if flag not in ("--model", "--sync-mode", "--sync-period"))


def _given(ns: argparse.Namespace) -> dict[str, Any]:
    """The options typed on the command line (``ns``'s: the others are left out of it)."""
    return {k: v for k, v in vars(ns).items() if k in BY_FLAG}


def config_from_namespace(ns: argparse.Namespace,
                          launched: int | None = None) -> tuple[TrainConfig, list[ResumeChange]]:
    """Build (and so validate) the config, and say what a ``--resume`` changes from its
    run's saved options (:func:`paft.resume_options.resume_changes`; the run's
    ``config.json`` is read once).

    Precedence, lowest first: defaults, ``launched``, the resumed run's ``config.json``
    (with ``--resume``), the ``--config`` file, the command line. A resumed run
    therefore keeps its settings; options given again (e.g. ``--steps``) change them.
    ``launched``: the processes torchrun started, the world size unless another is
    asked, which is refused before anything else (the per-rank batch and the fault
    ranks derive from it, so other checks would blame them).
    """
    given = _given(ns)
    config_file = getattr(ns, "config", None)
    from_file, run_config = read_config_file(config_file) if config_file is not None else ({}, False)
    resume = given.get("resume", from_file.get("resume", False))
    run_dir = given.get("run-dir", from_file.get("run-dir", ""))
    if ("run-dir" in given or "run-dir" in from_file) and not str(run_dir).strip():
        named = "--run-dir" if "run-dir" in given else f"--config: {config_file}: run-dir"
        raise ValueError(f"{named}: must not be empty (leave it out for runs/<workload>-<time>-<pid>)")
    # The folder a --resume continues: "~" expanded, ".." resolved (as launch() does).
    folder = resolve_run_dir(run_dir) if resume and run_dir else ""
    saved_file = pathlib.Path(folder, "config.json")
    saved = saved_values(folder) if folder and is_file(saved_file) else {}  # the run's saved options
    for flag in _KEPT_AS_SAVED:
        # Said before the config is built, whose checks would blame what these constrain
        # instead: what the world size splits (--batch-size, an --inject rank), the saved
        # --model fields another workload has none of.
        asked = given.get(flag, from_file.get(flag, saved.get(flag)))
        if flag in saved and asked != saved[flag]:
            raise fixed_on_resume_error(f"--{flag}", saved[flag], asked, folder)
    values, source = _merged([({"world-size": launched} if launched is not None else {}, None),
                              (saved, _Source("--resume", str(saved_file), fields=True)),
                              (from_file, _Source("--config", str(config_file), fields=run_config)),
                              (given, None)])
    if launched is not None and values["world-size"] != launched:
        asked, where = values["world-size"], source.get("world-size")
        # Fixed at the first run, wherever else it is also given (a run's config.json has it).
        if "world-size" in saved:
            raise ValueError(f"--resume: {folder} was trained on {asked} ranks and torchrun "
                             f"started {launched} processes; start it with --nproc-per-node {asked}")
        # A run's config.json always has a world size: only the command line's goes over it.
        fix = "on the command line, over the file's" if where and where.fields else "or leave it out"
        raise ValueError(f"--world-size {asked}{f' (in {where.path})' if where else ''}: torchrun started {launched} "
                         f"processes; pass --world-size {launched} {fix}")
    kwargs: dict[str | None, dict[str, Any]] = {s: {} for s in SECTION_TYPES}
    for key, value in values.items():
        opt = BY_FLAG[key]
        kwargs[opt.section][opt.name] = dict(value) if opt.kind == "model" else value
    top = kwargs.pop(None)
    try:
        sections = {name: SECTION_TYPES[name](**kw) for name, kw in kwargs.items()}
        cfg = TrainConfig(**top, **sections)  # type: ignore[arg-type]
    except ValueError as err:
        raise _blamed(err, source, given, values) from None
    if not saved:  # not a resume, or of a run without config.json (refused later)
        return cfg, []
    return cfg, resume_changes(option_values(cfg.to_dict(), "--resume"), saved)  # cfg is checked: never raises


def _blamed(err: ValueError, source: dict[str, _Source], given: dict[str, Any], values: dict[str, Any]) -> ValueError:
    """``err``, a check of the config built from ``values``, saying where the options it
    names got their values: ``source``'s files, the command line (``given``), the defaults.

    Checks name the field and its option ("TrainConfig.lr (--lr): must be > 0"); a
    value read from a file is that file's, named the way its type errors are
    ("neg.toml: lr: ..."). A check across options ("... (--h-max): must be >=
    ProtectConfig.h_min (--h-min) ...") blames the file only when no option it names
    was typed."""
    about = error_option(str(err))
    # (--no-monitor is typed for the option "monitor")
    named = {m[2:].removeprefix("no-") for m in re.findall(r"--[a-z][\w-]*", str(err))}
    if about is not None and source.get(about[0]) and not named & given.keys():
        return ConfigFileError(f"{source[about[0]]}: {source[about[0]].names(about[0])}: {about[1]}")
    # Else say where the options it names that were not typed come from: a file, or
    # (next to one that was typed: --h-min 500 against --h-max's 400) the default.
    notes = [f"--{n} is set in {source[n].path}" for n in sorted(named) if n in source and n not in given]
    if named & given.keys():
        notes += [f"--{n} is at its default" for n in sorted(named) if n in BY_FLAG and n not in values]
    return ValueError(f"{err} ({'; '.join(notes)})") if notes else err


def idle_faults(cfg: TrainConfig, start: int = 0, resumed: Sequence[str] = ()) -> list[str]:
    """A warning for each fault spec that cannot fire within --steps: most likely a
    typo; not an error, since a later --resume with more steps may reach it. ``start``:
    the step a resumed run starts at, and ``resumed`` the ``--inject`` of the run it
    resumes: its checkpoint holds the step before's values a stale fault at ``start``
    replays only at the sites and ranks a stale spec of that run could hit."""
    held = [stale_sites(parse_specs(resumed, option="--inject"), rank) for rank in range(cfg.world_size)]
    out = []
    for text, spec in zip(cfg.inject, parse_specs(cfg.inject, option="--inject")):
        if spec.site == "optimizer-state" and cfg.optimizer == "sgd":
            out.append(f"--inject {text!r} never fires: --optimizer sgd keeps no state (momentum, adam and "
                       "adamw do)")
            continue
        # Optimizer state is created by the first optimizer.step(): nothing to hit at step 0;
        # a stale fault replays the step before, which the first step it can hit lacks.
        why = [*(["optimizer state exists only from step 1 on"] if spec.site == "optimizer-state" else []),
               *(["a stale fault needs the step before's value"] if spec.kind == "stale" else [])]
        first = spec.first_firing(after=len(why))
        if first is None:
            late = f", and {' and '.join(why)}" if why else ""
            out.append(f"--inject {text!r} can never fire (rate 0, or its steps, start and stop leave no "
                       f"step{late})")
        elif first >= cfg.steps:
            out.append(f"--inject {text!r} cannot fire before step {first}, past --steps {cfg.steps}")
        elif spec.kind == "stale" and start and spec.first_firing(after=start) == start:
            # Where the checkpoint holds no step before's value (a stale spec added by the
            # resume), a stale spec whose steps left are the resume's first alone went on
            # without a word, and without its fault.
            lacking = [r for r in range(cfg.world_size) if spec.may_hit_rank(r) and spec.site not in held[r]]
            later = spec.first_firing(after=start + 1)
            if lacking and (later is None or later >= cfg.steps):
                out.append(f"--inject {text!r} cannot fire in this resumed run on rank(s) {lacking}: its only step "
                           f"left is step {start}, the resume's first, and the checkpoint holds no step before's "
                           "value for a stale fault there (it holds one only where a stale spec of the run it "
                           "resumes could hit)")
    return out


def ignored_options(ns: argparse.Namespace, cfg: TrainConfig) -> list[str]:
    """A warning for each option given on the command line that ``cfg`` makes
    ineffective (a guard threshold without --guard, a warm-up as long as the run, ...):
    most likely a slip; and for ``--protect dyn`` without the monitor (from any
    source), which loses its trigger."""
    mode = cfg.protect.mode
    # The worker metrics (and so the cosine and their alerts) need metric steps.
    # One rank has none to compare with: its loss CV is 0 and no cosine is computed.
    metrics = cfg.monitor.enabled and cfg.monitor.interval > 0 and cfg.world_size > 1
    no_metrics = ("with --no-monitor" if not cfg.monitor.enabled else
                  "with --monitor-interval 0 (no worker metrics)" if cfg.monitor.interval == 0 else
                  "with one rank (--world-size 1: no other rank to compare with)")
    needs: dict[str, tuple[bool, str]] = {
        "broadcast-src": (mode in ("sync", "dyn") and cfg.protect.sync_mode == "broadcast",
                          "without --sync-mode broadcast and --protect sync or dyn"),
        **{flag: (metrics, no_metrics) for flag in ("cosine", "alert-loss-cv")},
        "alert-cos-min": (metrics and cfg.monitor.cosine != "off",
                          no_metrics if not metrics else "with --cosine off (no cosine is computed)"),
        "sketch-dim": (metrics and cfg.monitor.cosine == "sketch",
                       no_metrics if not metrics else "without --cosine sketch"),
        "dropout": (cfg.workload in DROPOUT_WORKLOADS, f"on the {cfg.workload} workload"),
        **{flag: (mode == "dyn", "without --protect dyn") for flag in ("h-min", "h-max", "dyn-target")},
        **{flag: (mode in ("sync", "dyn"), "without --protect sync or dyn") for flag in ("sync-mode", "overlap")},
        "sync-period": (mode != "none", "with --protect none"),
    }
    out = []
    if "warmup-steps" in vars(ns) and cfg.warmup_steps >= cfg.steps:
        # Warm-up step s trains at (s + 1) / warmup_steps of --lr: a warm-up as long as the
        # run reaches --lr at its last step.
        peak = "reaches --lr only at the last step" if cfg.warmup_steps == cfg.steps else "never reaches --lr"
        out.append(f"--warmup-steps {cfg.warmup_steps} is not below --steps {cfg.steps}: the learning rate "
                   f"{peak} and never decays")
    if "guard-warmup" in vars(ns) and cfg.guard.enabled and cfg.guard.warmup >= cfg.steps:
        out.append(f"--guard-warmup {cfg.guard.warmup} is not below --steps {cfg.steps}: the spike and "
                   "rank-outlier detectors never arm (only gross jumps fire)")
    if mode == "dyn" and not cfg.monitor.enabled:
        out.append("--protect dyn with --no-monitor has no fingerprint trigger: replicas that split stay "
                   "split until the next scheduled sync (the period still adapts at each sync)")
    for flag in vars(ns):
        opt = BY_FLAG.get(flag)
        if opt is None or opt.name in ("enabled", "mode"):  # the switches themselves
            continue
        if flag in needs:
            effective, why = needs[flag]
        elif opt.section == "guard":
            effective, why = cfg.guard.enabled, "without --guard"
        elif opt.section == "monitor":
            effective, why = cfg.monitor.enabled, "with --no-monitor"
        else:
            continue
        if not effective:
            typed = f"no-{flag}" if opt.kind is bool and not getattr(ns, flag) else flag
            out.append(f"--{typed} has no effect {why}")
    return out


class OptionParser(argparse.ArgumentParser):
    """An ArgumentParser without prefix matching, inherited by every subcommand's parser
    (``add_subparsers`` builds them with the parent's class). With it, ``paft train
    --out DIR`` would silently mean ``--outlier-threshold DIR`` and fail on its value.
    A usage error prints the one line that says what is wrong and where to read more,
    not the 35-line usage block above it, naming config fields by their options alone
    (:func:`paft.config.as_options`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {as_options(message)}\n(options: {self.prog} --help)\n")


def train_warnings(ns: argparse.Namespace, cfg: TrainConfig, changes: Sequence[ResumeChange]) -> list[str]:
    """What a training command warns about before it starts: :func:`idle_faults`,
    :func:`ignored_options` and the options a ``--resume`` changes (``changes``, from
    :func:`config_from_namespace`): ``--lr 0.001 (was 0.003)``."""
    changed = [f"--resume changes the run's saved options: {changes_said(changes)}"] if changes else []
    start = latest_step(pathlib.Path(resolve_run_dir(cfg.run_dir))) if cfg.resume else 0
    # The --inject of the run resumed (config.json's: the last checkpoint's) decides what its checkpoint holds.
    resumed = next((change.was for change in changes if change.flag == "inject"), cfg.inject)
    return [*idle_faults(cfg, start, resumed), *ignored_options(ns, cfg), *changed]


def train_epilog() -> str:
    """The --help epilog of a training command: the ``--inject`` grammar (from the
    faultspec module's docstring: one source) and the exit codes."""
    from paft import faultspec

    grammar = (faultspec.__doc__ or "").split("Grammar (one ``--inject`` value)::", 1)[-1]
    codes = (f"0 done, {EXIT_WORKER_FAILED} a worker failed, {EXIT_USAGE} bad input (nothing written), "
             f"{EXIT_PERSISTENT_FAULT} persistent faulty rank (--on-persistent stop)")
    return f"""\
fault specs (--inject, repeatable):
{grammar.rstrip()}

exit codes: {codes},
            {interrupted_codes(resume=True)}
"""


def parse_train_config(
    argv: Sequence[str] | None = None,
    prog: str = "paft train",
    launched: int | None = None,
    warn: bool = False,
) -> tuple[TrainConfig, list[str]]:
    """Parse ``argv`` into a validated :class:`TrainConfig` and the options a
    ``--resume`` changes, as command-line words (:func:`paft.resume_options.resume_args`);
    bad input exits with code 2. ``launched``: see :func:`config_from_namespace`;
    ``warn``: print :func:`train_warnings` to stderr (one rank of several does)."""
    parser = OptionParser(prog=prog, epilog=train_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    add_train_options(parser)
    return config_or_exit(parser, parser.parse_args(argv), launched, warn=warn)


def config_or_exit(parser: argparse.ArgumentParser, ns: argparse.Namespace, launched: int | None = None, *,
                   warn: bool) -> tuple[TrainConfig, list[str]]:
    """The validated :class:`TrainConfig` of ``ns``, the options ``parser`` parsed (it
    has :func:`add_train_options`), and the options a ``--resume`` changes, as
    command-line words (:func:`paft.resume_options.resume_args`); bad input is
    ``parser``'s error (exit code 2). ``launched``: see :func:`config_from_namespace`;
    ``warn``: print :func:`train_warnings` to stderr, as ``parser.prog`` (``paft train:
    warning: ...``)."""
    try:
        cfg, changes = config_from_namespace(ns, launched)
    except ValueError as err:
        parser.error(str(err))
    if warn:
        for warning in train_warnings(ns, cfg, changes):
            print(f"{parser.prog}: warning: {warning}", file=sys.stderr)
    return cfg, resume_args(changes, ns.config, _given(ns))

