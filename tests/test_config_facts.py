"""Per-key facts live on the schema's fields (megatron_kappa.config.facts) and are what the range
check, the resume check and docs/config.md read: no second table beside the schema."""
import dataclasses

import pytest

from megatron_kappa.checkpoint import resume
from megatron_kappa.config import ConfigError, facts, load_config, ranges
from megatron_kappa.config.schema import Config


def test_the_checks_read_the_schema_fields():
    fields = {name: meta for name, _, meta in facts.keys(Config)}
    assert fields["train.lr_wsd_decay_fraction"]["range"] == facts.OPEN_FRACTION
    assert ranges.RANGES["train.lr_wsd_decay_fraction"] == facts.OPEN_FRACTION
    assert fields["model.hidden_size"]["state"] and "model.hidden_size" in resume.SHAPES_STATE
    assert fields["model.mla"]["state"] and "model.mla" in resume.SHAPES_STATE  # a whole section
    assert fields["parallel"]["derived"] and "parallel" in resume.IGNORED
    assert not fields["train.lr"]["state"] and not fields["train.lr"]["derived"]
    # every key or section named by a fact exists in the schema
    assert set(resume.SHAPES_STATE) | set(resume.IGNORED) | set(ranges.RANGES) <= set(fields)


def test_a_range_set_on_a_field_is_enforced_and_documented(monkeypatch):
    """Negative control: a range moved on the field moves the check and the reference with it."""
    from megatron_kappa.config import reference, schema
    load_config("configs/tiny.yaml", ["train.warmup=0"])
    field = next(f for f in dataclasses.fields(schema.TrainConfig) if f.name == "warmup")
    meta = {**field.metadata, "range": facts.POSITIVE}
    monkeypatch.setattr(field, "metadata", meta)
    monkeypatch.setattr(ranges, "RANGES", facts.ranges(Config))
    with pytest.raises(ConfigError, match="train.warmup.*must be positive"):
        load_config("configs/tiny.yaml", ["train.warmup=0"])
    assert any(line.startswith("| `train.warmup` |") and "integer > 0 |" in line
               for line in reference.markdown_reference().splitlines())


def test_unknown_range_kind_is_refused():
    with pytest.raises(ValueError, match="unknown range"):
        facts.key(1, "help", range="> 2")
