"""The run configuration: YAML validated against one dataclass schema.

  schema.py     every section, key, default and help text (docs/config.md is generated from it)
  loading.py    YAML files with `extends:`, `--set key=value` overrides, type checks
  checks.py     cross-field checks that need nothing but the config
  reference.py  docs/config.md (`python -m megatron_kappa.config --markdown`)

Checks that need files, the world size or installed packages are in megatron_kappa.preflight.
"""
from megatron_kappa.config.checks import validate
from megatron_kappa.config.loading import load_config, parse_overrides, read_yaml
from megatron_kappa.config.reference import markdown_reference
from megatron_kappa.config.schema import (CheckpointConfig, Config, ConfigError, DataConfig,
                                          EvalConfig, KappaConfig, LogConfig, ModelConfig,
                                          MoEConfig, MuonConfig, ParallelConfig, RunConfig,
                                          SoftMoEConfig, TrainConfig, ZeroConfig, to_dict)

__all__ = ["CheckpointConfig", "Config", "ConfigError", "DataConfig", "EvalConfig", "KappaConfig",
           "LogConfig", "ModelConfig", "MoEConfig", "MuonConfig", "ParallelConfig", "RunConfig",
           "SoftMoEConfig", "TrainConfig", "ZeroConfig", "load_config", "markdown_reference",
           "parse_overrides", "read_yaml", "to_dict", "validate"]
