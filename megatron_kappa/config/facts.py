"""What the schema knows about each key beside its default and help text, kept on the key itself
(the dataclass field's metadata) so that a key is read in one place:

  range     the allowed range of a numeric key (a null, where allowed, is not checked): read by
            the range check (config/ranges.py) and shown in docs/config.md
  allowed   what a constrained non-numeric key accepts, in words (docs/config.md; the rule itself
            is in config/checks.py)
  state     the key shapes the parameters, their names or dtypes, or the optimizer's groups: a
            resumed run may not change it (checkpoint/resume.py; tests/test_resume_check.py
            changes every key and checks this list against the model)
  derived   the trainer derives or records the key itself (a resume does not compare it)

A section can carry `state` or `derived` for all of its keys (`section`). Torch-free, like the
schema.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import field

POSITIVE, NON_NEGATIVE, FRACTION, OPEN_FRACTION, PROBABILITY, BEYOND_ONE, AT_LEAST_ONE, OPEN_UNIT = (
    "> 0", ">= 0", "[0, 1)", "(0, 1]", "[0, 1]", "> 1", ">= 1", "(0, 1)")
WORDS = {POSITIVE: "must be positive", NON_NEGATIVE: "must not be negative", FRACTION: "must be in [0, 1)",
         OPEN_FRACTION: "must be in (0, 1]", PROBABILITY: "must be in [0, 1]", BEYOND_ONE: "must be > 1",
         AT_LEAST_ONE: "must be at least 1", OPEN_UNIT: "must be in (0, 1)"}
TESTS = {POSITIVE: lambda v: v > 0, NON_NEGATIVE: lambda v: v >= 0, FRACTION: lambda v: 0 <= v < 1,
         OPEN_FRACTION: lambda v: 0 < v <= 1, PROBABILITY: lambda v: 0 <= v <= 1, BEYOND_ONE: lambda v: v > 1,
         AT_LEAST_ONE: lambda v: v >= 1, OPEN_UNIT: lambda v: 0 < v < 1}


def key(default, help: str, *, range: str | None = None, allowed: str | None = None, state: bool = False,
        derived: bool = False, **kw):
    """A schema key: its default, help text and facts (module doc)."""
    if range is not None and range not in TESTS:
        raise ValueError(f"unknown range {range!r}: expected one of {list(TESTS)}")
    meta = {"help": help, "range": range, "allowed": allowed, "state": state, "derived": derived}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def section(cls, *, state: bool = False, derived: bool = False):
    """A schema section (a nested dataclass) whose keys all share `state` or `derived`."""
    return field(default_factory=cls, metadata={"state": state, "derived": derived})


def keys(cls, prefix: str = "") -> typing.Iterator[tuple[str, type, dict]]:
    """(dotted name, type hint, metadata) of every leaf key and every section of the schema
    class `cls`, sections before their keys."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name, hint = f"{prefix}{f.name}", hints[f.name]
        yield name, hint, dict(f.metadata)
        if dataclasses.is_dataclass(hint):
            yield from keys(hint, name + ".")


def marked(cls, fact: str) -> tuple[str, ...]:
    """The dotted names (sections or keys) that carry `fact` (state or derived); a section's name
    covers its keys."""
    return tuple(name for name, _, meta in keys(cls) if meta.get(fact))


def ranges(cls) -> dict[str, str]:
    """{dotted key: range} of every key with a range."""
    return {name: meta["range"] for name, _, meta in keys(cls) if meta.get("range")}
