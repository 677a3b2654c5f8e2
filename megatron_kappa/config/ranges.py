"""The range check of every numeric config key, each key's range read from its schema field
(megatron_kappa.config.facts): run when a config is validated (before the cross-field checks of
megatron_kappa.config.checks) and shown in the generated docs/config.md. Every number is also
finite (megatron_kappa.config.loading). A null, where a key allows one, is not checked here.
tests/test_reliability.py checks that every numeric schema key has a range, and that each range
refuses a value just outside it.
"""
from __future__ import annotations

import dataclasses
import typing

from megatron_kappa.config import facts

# the range kinds, their words and tests, re-exported for the tests
from megatron_kappa.config.facts import (  # noqa: F401
    AT_LEAST_ONE,
    BEYOND_ONE,
    FRACTION,
    NON_NEGATIVE,
    OPEN_FRACTION,
    POSITIVE,
    PROBABILITY,
    TESTS,
    WORDS,
)
from megatron_kappa.config.schema import Config, flat_keys

# {dotted key: range}, read from the schema's fields (facts.key(range=...))
RANGES = facts.ranges(Config)
# What the other constrained keys accept (shown in docs/config.md; checked in config/checks.py).
OTHER = {name: meta["allowed"] for name, _, meta in facts.keys(Config) if meta.get("allowed")}


def numeric_keys(cls, prefix: str = ""):
    """(dotted key, int or float) of every numeric leaf of the schema."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from numeric_keys(kind, f"{prefix}{f.name}.")
            continue
        args = [a for a in typing.get_args(kind) if a is not type(None)] or [kind]
        if typing.get_origin(kind) is not typing.Literal and args[0] in (int, float):
            yield f"{prefix}{f.name}", args[0]


def check(cfg, need):
    """Every numeric value inside its range (`need(ok, key, message)`, as config.checks)."""
    for key, value in flat_keys(dataclasses.asdict(cfg)).items():
        spec = RANGES.get(key)
        if spec is not None and value is not None and not isinstance(value, bool):
            need(TESTS[spec](value), key, f"{WORDS[spec]}, got {value}")
