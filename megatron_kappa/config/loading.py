"""Reading a config: YAML (with `extends:`), `--set key=value` overrides, type checks.

Unknown keys, wrong types and bad values are one-line `ConfigError`s naming the key. Overrides use
the Megatron/Hydra-ish form `--set a.b=1 c.d=[1,2]` (values parsed as YAML). A config file may
start from another one with `extends: other.yaml` (a path relative to the file): the other file's
values are the base, this file's values are merged over them key by key, then the overrides.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import types
import typing
from pathlib import Path
from typing import Literal

import yaml

from megatron_kappa.attention_kinds import RETIRED, recorded
from megatron_kappa.config import presets
from megatron_kappa.config.checks import validate
from megatron_kappa.config.schema import Config, ConfigError


def _check(value, kind, key: str):
    """Return `value` as type `kind`, or raise a one-line ConfigError naming `key`."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(kind)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _check(value, inner, key)
    if origin is Literal:
        # by type too: 1 == True, and a Literal of true/false takes no 1
        if not any(value == a and type(value) is type(a) for a in typing.get_args(kind)):
            raise ConfigError(f"config: {key}: expected one of {list(typing.get_args(kind))}, got {value!r}")
        return value
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise ConfigError(f"config: {key}: expected a mapping, got {value!r}")
        return _build(kind, value, key + ".")
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"config: {key}: expected true/false, got {value!r}")
        return value
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"config: {key}: expected an integer, got {value!r}")
        return value
    if kind is float:
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"config: {key}: expected a number, got {value!r}")
        if not math.isfinite(value):  # nan and inf pass every range check and train nothing
            raise ConfigError(f"config: {key}: expected a finite number, got {value!r}")
        return float(value)
    if kind is str:
        if not isinstance(value, str):
            raise ConfigError(f"config: {key}: expected a string, got {value!r}")
        return value
    if kind is list:
        if not isinstance(value, list):
            raise ConfigError(f"config: {key}: expected a list, got {value!r}")
        return value
    raise TypeError(f"schema type {kind} of {key} not handled")


_HINTS: dict = {}  # schema class → its type hints (typing.get_type_hints is most of a config's reading time)


def _build(cls, data: dict, prefix: str = ""):
    hints = _HINTS.get(cls) or _HINTS.setdefault(cls, typing.get_type_hints(cls))
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=1)  # a typo's likely key, as git and Hydra say
            hint = f"did you mean '{prefix}{near[0]}'? " if near else ""
            raise ConfigError(f"config: unknown key '{prefix}{key}' ({hint}expected one of: "
                              f"{', '.join(sorted(names))})")
    values = {k: _check(v, hints[k], prefix + k) for k, v in data.items()}
    return cls(**values)


def _merge(base: dict, key: str, value):
    parts = key.split(".")
    node = base
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"config: --set {key}: '{part}' is not a section")
    node[parts[-1]] = value


def parse_overrides(items: list[str]) -> list[tuple[str, object]]:
    pairs = []
    for item in items:
        if "=" not in item:
            raise ConfigError(f"config: --set {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else None
        except yaml.YAMLError as e:
            raise ConfigError(f"config: --set {item!r}: the value is not valid YAML "
                              f"({str(e).splitlines()[0]})") from None
        pairs.append((key.strip(), value))
    return pairs


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_yaml(path: str | Path, _seen: tuple = ()) -> dict:
    """A config file's mapping, with its `extends:` chain resolved (not yet validated)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config: {path}: is a folder, not a YAML config file")
    if not path.is_file():
        raise ConfigError(f"config: {path}: no such file")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config: {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config: {path}: not a text file (not UTF-8 at byte {e.start}); expected a YAML "
                          "config") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path}: expected a mapping at the top level")
    base = data.pop("extends", None)
    if base is None:
        return data
    if not isinstance(base, str):
        raise ConfigError(f"config: {path}: extends: expected a file name, got {base!r}")
    base_path = (path.parent / base).resolve()
    if base_path in _seen:
        raise ConfigError(f"config: {path}: extends: {base} is already in the chain (a cycle)")
    return _deep_merge(read_yaml(base_path, _seen + (path.resolve(),)), data)


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> Config:
    """Read a YAML config (or the defaults), apply `key=value` overrides, validate."""
    data = read_yaml(path) if path is not None else {}
    for key, value in parse_overrides(list(overrides)):
        _merge(data, key, value)
    return from_mapping(data)


def _refuse_retired(data: dict):
    """A key the config no longer has, named with what to write instead (before the generic
    unknown-key error, which could not say it)."""
    for dotted, instead in RETIRED.items():
        node = data
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                break
            node = node[part]
        else:
            raise ConfigError(f"config: {dotted}: no longer a key: {instead}")


def from_mapping(data: dict) -> Config:
    """A config from its merged mapping (a YAML file's, or to_dict's of another config), read and
    validated as load_config reads a file: unknown keys, types, presets, the cross-field checks."""
    _refuse_retired(data)
    cfg = _build(Config, presets.apply(data))  # model.block's preset, model.aspect_ratio's width
    validate(cfg)
    return cfg


def load_recorded(path: str | Path) -> Config:
    """A run's config.yaml as the trainer recorded it: one recorded before a key was retired reads
    in today's keys (attention_kinds.recorded), so older runs still export and evaluate."""
    return from_mapping(recorded(read_yaml(path)))


def load_config_for_cli(path: str | Path | None, overrides: list[str] = ()) -> Config | None:
    """load_config for a command line: a bad config prints `error: <one line>` on stderr and gives
    None (the command exits with status 2)."""
    try:
        return load_config(path, overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
