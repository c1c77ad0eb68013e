"""The main job's configuration: the sections (sections.py) loaded from TOML/YAML plus `--section.key value`.

Every key has a type and a default, so `shardtrain train` runs with no file at all. Values from a
file and from the command line are coerced to the declared type; a key that does not exist is an
error that lists the valid keys and suggests the closest one, because a silently ignored typo
(`--train.stpes 10`) trains the wrong job.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from .sections import Config, ConfigError

SECTIONS: dict[str, type] = dict(typing.get_type_hints(Config))


def _fields(section: str) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(SECTIONS[section])}


def _unknown(name: str, valid: list[str]) -> ConfigError:
    """An unknown key: suggest the closest valid one (by whole key, or by its last part) and list them."""
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    if not close:
        by_leaf = {v.rpartition(".")[2]: v for v in valid}
        close = [by_leaf[m] for m in difflib.get_close_matches(name.rpartition(".")[2], list(by_leaf), n=1, cutoff=0.6)]
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown config key {name!r}{hint} Valid keys: {', '.join(valid)}")


def _resolve_key(dotted: str) -> tuple[str, str, str | None]:
    """'train.steps' -> ('train', 'steps', None); 'model.kwargs.n_layers' -> ('model', 'kwargs', 'n_layers')."""
    section, _, rest = dotted.partition(".")
    if section not in SECTIONS:
        raise _unknown(dotted, [f"{s}.{k}" for s in SECTIONS for k in _fields(s)])
    key, _, item = rest.partition(".")
    fields = _fields(section)
    if key not in fields:
        raise _unknown(dotted, [f"{section}.{k}" for k in fields])
    tp = typing.get_type_hints(SECTIONS[section])[key]
    if item and _table_type(tp) is not None:
        index, _, name = item.partition(".")
        names = list(typing.get_type_hints(_table_type(tp)))
        if not index.isdigit() or not name:
            raise ConfigError(
                f"{dotted!r}: an item of the list {section}.{key} is set as {section}.{key}.N.KEY (N from 0), "
                f"e.g. --{section}.{key}.0.{names[0]}"
            )
        if name not in names:
            raise _unknown(dotted, [f"{section}.{key}.{index}.{n}" for n in names])
    elif item and typing.get_origin(tp) is not dict:
        raise ConfigError(f"{section}.{key} is not a table; {dotted!r} cannot set an item in it")
    return section, key, item or None


def _table_type(tp: Any) -> type | None:
    """The dataclass of a list of tables (e.g. data.sources' SourceConfig), else None."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple and args and dataclasses.is_dataclass(args[0]):
        return args[0]
    return None


def _tables(value: Any, cls: type, key: str) -> tuple:
    """A list of tables (from a file, or YAML text from the command line) as a tuple of `cls`; an unknown key
    in a table is an error with the closest valid one."""
    items = yaml.safe_load(value) if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(t, dict) for t in items):
        raise ConfigError(f"{key}={value!r}: expected a list of tables such as [{{path: a.jsonl, weight: 0.7}}]")
    hints = typing.get_type_hints(cls)
    tables = []
    for i, table in enumerate(items):
        for name in table:
            if name not in hints:
                raise _unknown(f"{key}.{i}.{name}", [f"{key}.{i}.{n}" for n in hints])
        tables.append(cls(**{k: _coerce(v, hints[k], f"{key}.{i}.{k}") for k, v in table.items()}))
    return tuple(tables)


_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Convert `value` (a typed value from a file, or a string from the command line) to type `tp`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, option, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}={value!r}: expected {_type_name(tp)}")
    if _table_type(tp) is not None:
        return _tables(value, _table_type(tp), key)
    if origin is tuple:
        items = [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{key}={value!r}: expected a list of {_type_name(args[0])} (comma-separated)")
        return tuple(_coerce(v, args[0], key) for v in items)
    if origin is dict:
        parsed = yaml.safe_load(value) if isinstance(value, str) else value
        if not isinstance(parsed, dict):
            raise ConfigError(f"{key}={value!r}: expected a table such as {{n_layers: 2}}")
        return dict(parsed)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
    elif tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None and not math.isfinite(number):
            raise ConfigError(f"{key}={value!r} is not a finite number; give a finite value such as 0.001")
        if number is not None:
            return number
    elif tp is str and isinstance(value, str):
        return value
    raise ConfigError(f"{key}={value!r}: expected {_type_name(tp)}")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "none")


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML or YAML file into {section: {key: value}} (values not yet checked)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass the path of a .toml or .yaml file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".toml":
            data = tomllib.loads(path.read_text())
        elif suffix in (".yaml", ".yml", ".json"):
            data = yaml.safe_load(path.read_text()) or {}
        else:
            raise ConfigError(f"config file {str(path)!r}: unknown format {suffix!r}; use .toml, .yaml or .yml")
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(
            f"config file {str(path)!r} is not valid {suffix[1:].upper()}: {exc}".replace("\n", " ")
        ) from exc
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ConfigError(f"config file {str(path)!r}: expected tables [{'], ['.join(SECTIONS)}] of key = value")
    return data


def parse_overrides(tokens: list[str]) -> list[tuple[str, str | None]]:
    """`['--train.steps', '5', '--run.tensorboard']` -> [('train.steps', '5'), ('run.tensorboard', None)].

    A value may also be attached with '='; a key without a value (allowed for booleans) gets None.
    """
    pairs: list[tuple[str, str | None]] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if not token.startswith("--") or token == "--":
            raise ConfigError(f"unexpected argument {token!r}; overrides look like --section.key value")
        key, eq, value = token[2:].partition("=")
        if eq:
            pairs.append((key, value))
            i += 1
        elif i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
            pairs.append((key, tokens[i + 1]))
            i += 2
        else:
            pairs.append((key, None))
            i += 1
    return pairs


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Defaults, then the file at `path` (if any), then `--section.key value` overrides."""
    raw: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    if path is not None:
        for section, table in read_config_file(path).items():
            for key, value in table.items():
                _resolve_key(f"{section}.{key}")
                raw[section][key] = value
    for dotted, value in parse_overrides(list(overrides)):
        section, key, item = _resolve_key(dotted)
        tp = typing.get_type_hints(SECTIONS[section])[key]
        if value is None:
            if tp is not bool:
                raise ConfigError(f"--{dotted} needs a value ({_type_name(tp)})")
            value = "true"
        if item is not None and _table_type(tp) is not None:
            raw[section][key] = _set_item(raw[section].get(key), item, value, f"{section}.{key}")
        elif item is not None:
            table = dict(raw[section].get(key) or {})
            table[item] = yaml.safe_load(value)
            raw[section][key] = table
        else:
            raw[section][key] = value
    sections = {}
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        sections[section] = cls(**{k: _coerce(v, hints[k], f"{section}.{k}") for k, v in raw[section].items()})
    return Config(**sections)


def _set_item(items: Any, item: str, value: str, key: str) -> list[dict]:
    """`--data.sources.1.weight 0.3`: the list of tables with item 1's weight set; N = the list's length adds
    a table."""
    tables = [dict(t) for t in (yaml.safe_load(items) if isinstance(items, str) else items or [])]
    index, _, name = item.partition(".")
    if int(index) > len(tables):
        raise ConfigError(
            f"--{key}.{item}: {key} has {len(tables)} item(s), numbered from 0; set item {len(tables)} to add one"
        )
    if int(index) == len(tables):
        tables.append({})
    tables[int(index)][name] = value
    return tables


def to_dict(config: Config) -> dict[str, dict[str, Any]]:
    """Plain nested dict (tuples as lists), ready for YAML/JSON."""
    return json.loads(json.dumps(dataclasses.asdict(config)))


def save_config(config: Config, path: str | Path) -> None:
    """Write the effective configuration as YAML; `shardtrain train <that file>` reruns the job."""
    Path(path).write_text(yaml.safe_dump(to_dict(config), sort_keys=False))


def describe() -> str:
    """Every key with its default and meaning, for `shardtrain train --help`."""
    lines = []
    for section, cls in SECTIONS.items():
        lines.append(f"[{section}]")
        defaults = dataclasses.asdict(cls())
        for f in dataclasses.fields(cls):
            lines.append(f"  --{section}.{f.name} (default {defaults[f.name]!r}): {f.metadata['help']}")
    return "\n".join(lines)
