"""Reading a ``--config`` file (TOML, YAML or JSON, keys spelled like the long options:
``world-size = 4``), a run's ``config.json`` given as one, and the saved ``config.json``
that a ``--resume`` starts from, into option -> value mappings checked as argparse
checks the command line's (:data:`paft.option_table.OPTIONS` names the options).
"""

from __future__ import annotations

import difflib
import json
import pathlib
import sys
from collections.abc import Sequence
from typing import Any

from paft.config import SECTIONS, TrainConfig
from paft.option_table import BY_FLAG, OPTIONS, Option
from paft.records import is_run_config
from paft.rundir import has_checkpoint
from paft.values import fits

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = ["ConfigFileError", "read_config_file", "saved_values", "option_values", "field_named"]


class ConfigFileError(ValueError):
    """A ``--config`` file that cannot be read or holds an unknown or mistyped key."""


def _unique_keys(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """A mapping from ``pairs`` that refuses a key given twice (JSON and YAML parsers
    would silently keep the last one; TOML refuses by itself)."""
    out: dict[Any, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} is given twice")
        out[key] = value
    return out


def _load_yaml(text: str) -> Any:
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            self.flatten_mapping(node)
            return _unique_keys([(self.construct_object(k, deep=deep), self.construct_object(v, deep=deep))
                                 for k, v in node.value])

    try:
        return yaml.load(text, Loader=Loader)  # a SafeLoader subclass: safe
    except yaml.MarkedYAMLError as err:
        # PyYAML's own message spans several lines (the offending source line and a caret);
        # a refusal is one line, with the place as TOML's errors give it.
        mark = err.problem_mark
        where = f" (at line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        context = f"{err.context}: " if err.context else ""
        raise ValueError(f"{context}{err.problem}{where}") from None


def read_config_file(path: str) -> tuple[dict[str, Any], bool]:
    """Option -> value of ``--config`` file ``path``, and whether it is a run's
    ``config.json`` (whose keys are the config's fields: :func:`_run_config_values`)."""
    if not path.strip():  # --config "$CFG" with CFG unset: not "no file"
        raise ConfigFileError("--config: must not be empty (leave it out to use no config file)")
    p = pathlib.Path(path).expanduser()  # --config=~/c.toml reaches us unexpanded
    try:
        # Without a byte order mark (Windows editors write one), which TOML and JSON refuse;
        # dropped after decoding, so that a bad byte's offset is the file's.
        text = p.read_text(encoding="utf-8").removeprefix("\ufeff")
    except OSError as err:
        raise ConfigFileError(f"--config: cannot read {path}: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ConfigFileError(f"--config: {path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    suffix = p.suffix.lower()
    kind = "YAML" if suffix in (".yaml", ".yml") else "JSON" if suffix == ".json" else "TOML"
    try:
        if kind == "YAML":
            data = _load_yaml(text)
            if data is None:  # an empty or comment-only file; [], 0 or false are not mappings
                data = {}
        elif kind == "JSON":
            data = json.loads(text, object_pairs_hook=_unique_keys)
        else:
            data = tomllib.loads(text)
    except Exception as err:
        read_as = "" if suffix == ".toml" or kind != "TOML" else " (read as TOML: not .yaml, .yml or .json)"
        raise ConfigFileError(f"--config: {path} is not valid {kind}{read_as}: {err}") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"--config: {path} must hold a mapping of option names to values")
    # A flat file's monitor, protect and guard are an on/off and a mode, never tables: a
    # table is what TrainConfig.to_dict() writes (also in a config.json trimmed by hand).
    if kind == "JSON" and any(isinstance(data.get(section), dict) for section in SECTIONS):
        return _run_config_values(data, f"--config: {path}"), True
    values: dict[str, Any] = {}
    for raw_key, value in data.items():
        key = str(raw_key).replace("_", "-")
        opt = BY_FLAG.get(key)
        if opt is None:
            raise ConfigFileError(f"--config: {path}: unknown option {raw_key!r}{_unknown_hint(key, value)}")
        if key in values:  # world-size and world_size: which one was meant?
            raise ConfigFileError(f"--config: {path}: option {key!r} is given twice")
        values[key] = _coerce(opt, value, f"--config: {path}: {raw_key}")
    return values, False


def _unknown_hint(key: str, value: Any) -> str:
    """The option a flat file's unknown ``key`` (dashed) most likely meant, as a note
    after the refusal: a negated switch (``no-monitor``) as the file writes it, a field as
    a run's config.json names it (``window``, ``guard.window``: ``guard-window``), or a
    near miss (``world-siz``); "" for none."""
    negated = BY_FLAG.get(key.removeprefix("no-")) if key.startswith("no-") else None
    if negated is not None and negated.kind is bool:
        return f" (write {negated.flag} = {str(not value).lower() if isinstance(value, bool) else 'false'})"
    fields = [opt.flag for opt in OPTIONS
              if key in (opt.name.replace("_", "-"), f"{opt.section}.{opt.name}".replace("_", "-"))]
    meant = fields or difflib.get_close_matches(key, BY_FLAG, n=1)
    return f" (did you mean {' or '.join(map(repr, meant))}?)" if meant else ""


def _coerce(opt: Option, value: Any, where: str) -> Any:
    """Check a config-file value's type; the file is not argparse, so do its job here."""
    if opt.kind == "list":
        value = [value] if isinstance(value, str) else value
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigFileError(f"{where}: expected a string or a list of strings")
        return value
    if opt.kind == "model":
        if not isinstance(value, dict):
            raise ConfigFileError(f"{where}: expected a table/mapping of model fields")
        return list(value.items())
    if opt.kind is bool:
        if not isinstance(value, bool):
            raise ConfigFileError(f"{where}: expected true or false, got {value!r}")
        return value
    if opt.kind is float and isinstance(value, int) and not isinstance(value, bool):
        try:
            value = float(value)
        except OverflowError:
            raise ConfigFileError(f"{where}: expected a number, got an integer too large for a float") from None
    if opt.kind is float and isinstance(value, str):  # YAML 1.1 reads 3e-3 as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if not fits(opt.kind, value):
        # YAML 1.1 reads off/on/no/yes unquoted as false/true ("cosine: off")
        hint = "; quote it" if isinstance(value, bool) and opt.kind is str else ""
        raise ConfigFileError(f"{where}: expected {opt.kind.__name__}, got {value!r}{hint}")
    if opt.choices and value not in opt.choices:
        raise ConfigFileError(f"{where}: must be one of {opt.choices}, got {value!r}")
    return value


def saved_values(run_dir: str) -> dict[str, Any]:
    """Option values of a run's ``config.json`` (the base of a ``--resume``), checked
    like a ``--config`` file's: a hand-edited or damaged file gets a message naming it
    and the field, not a traceback."""
    path = pathlib.Path(run_dir) / "config.json"
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:  # UnicodeDecodeError is a ValueError
        raise ConfigFileError(f"--resume: cannot read {path}: {err}") from None
    if not isinstance(saved, dict):
        raise ConfigFileError(f"--resume: {path} must hold a mapping (a paft run's config), got {type(saved).__name__}")
    try:
        TrainConfig.check_keys(saved)  # the options below are read by name: others would go unseen
    except ValueError as err:
        if not is_run_config(path) and not has_checkpoint(path.parent):  # another program's config.json
            raise ConfigFileError(f"--resume: {run_dir} holds no paft run (no config.json of paft's)") from None
        raise ConfigFileError(f"--resume: {path}: {err}") from None
    return option_values(saved, f"--resume: {path}", leave_out=("resume", "overwrite"))


# What a run's config.json says about that run's own folder, not about how it trains:
# from another run's, --run-dir would write into that run, --resume continue it and
# --overwrite delete it.
_OF_ITS_FOLDER = ("run-dir", "resume", "overwrite")


def _run_config_values(config: dict[str, Any], where: str) -> dict[str, Any]:
    """Option -> value of a run's ``config.json`` given as a ``--config`` file (``where``:
    ``"--config: FILE"``), checked as :func:`saved_values` checks it; without the
    options of that run's folder (``_OF_ITS_FOLDER``), so a new run takes its settings."""
    try:
        TrainConfig.check_keys(config)  # the options below are read by name: others would go unseen
    except ValueError as err:  # also a flat file's keys beside a table: say why they are fields here
        table = next(section for section in SECTIONS if isinstance(config.get(section), dict))
        raise ConfigFileError(f"{where}: {err}; read as a run's config.json (its {table!r} is a table), whose "
                              "keys are TrainConfig's fields") from None
    return option_values(config, where, leave_out=_OF_ITS_FOLDER)


def option_values(config: dict[str, Any], where: str, leave_out: Sequence[str] = ()) -> dict[str, Any]:
    """Option -> value of a config in ``config.json``'s shape, each checked as a
    ``--config`` file's, but the options named in ``leave_out``; an error starts with
    ``where`` (``"--resume: r/config.json"``) and names the field and its option:
    ``guard.window (--guard-window)``."""
    values: dict[str, Any] = {}
    for opt in OPTIONS:
        if opt.flag in leave_out:
            continue
        section = config if opt.section is None else config.get(opt.section, {})
        if not isinstance(section, dict):
            raise ConfigFileError(f"{where}: {opt.section!r} must be a mapping, got {section!r}")
        if opt.name in section:
            values[opt.flag] = _coerce(opt, section[opt.name], f"{where}: {field_named(opt)}")
    return values


def field_named(opt: Option) -> str:
    """``opt``'s field as a run's ``config.json`` names it, and its option: ``guard.window (--guard-window)``."""
    return f"{'' if opt.section is None else opt.section + '.'}{opt.name} (--{opt.flag})"
