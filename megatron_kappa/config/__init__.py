"""The run configuration: YAML validated against one dataclass schema.

Checks that need files, the world size or installed packages are in megatron_kappa.preflight.

Modules:
  __main__.py      `python -m megatron_kappa.config`: a config as the trainer reads it, or
                   docs/config.md
  checks.py        Cross-field checks of a config that need no process group, files or packages
  derived.py       What a config implies before anything is built: the layers' kinds, each pipeline
                   stage's layers, the data-parallel sizes and micro-batches on a world of ranks,
                   the steps and tokens
  facts.py         What the schema knows about each key beside its default and help text, kept on
                   the key itself (the dataclass field's metadata) so that a key is read in one
                   place:
  loading.py       Reading a config: YAML (with `extends:`), `--set key=value` overrides, type
                   checks
  presets.py       Keys that set other keys: `model.block` (a preset of the block keys),
                   `model.aspect_ratio` (the width from the depth) and a null `model.moe.aux_loss`
                   (14c9b04's weight for the arm)
  ranges.py        The range check of every numeric config key, each key's range read from its
                   schema field (megatron_kappa.config.facts): run when a config is validated
                   (before the cross-field checks of megatron_kappa.config.checks) and shown in the
                   generated docs/config.md
  recompute.py     `model.recompute_modules`: megatron's selective-recompute modules that run here,
                   in one table
  reference.py     docs/config.md, generated from the schema (`python -m megatron_kappa.config
                   --markdown`)
  schema.py        The config schema: one dataclass per YAML section, each value with its default
                   and help text
  schema_model.py  The config schema's model sub-sections: model.kappa, model.fp8, model.moe,
                   model.mla, model.mtp
  schema_run.py    The config schema's other sections: data, log (with log.wandb), profile,
                   checkpoint, eval, run
  schema_train.py  The config schema's training sections: parallel, train (with train.muon) and zero
  stage_layout.py  `parallel.layout`: megatron's pipeline_model_parallel_layout string, unrolled and
                   checked
  world.py         Whether a parallel layout fits a world of ranks, and the batch it then splits:
                   the one place the trainer's preflight, its process groups, `python -m
                   megatron_kappa.config --world N` and the planner's search check a world size and
                   a global batch
"""
from megatron_kappa.config.checks import validate
from megatron_kappa.config.loading import load_config, load_config_for_cli, load_recorded, parse_overrides, read_yaml
from megatron_kappa.config.reference import markdown_reference
from megatron_kappa.config.schema import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    EvalConfig,
    KappaConfig,
    LogConfig,
    ModelConfig,
    MoEConfig,
    MuonConfig,
    ParallelConfig,
    ProfileConfig,
    RunConfig,
    SoftMoEConfig,
    TrainConfig,
    WandbConfig,
    ZeroConfig,
    to_dict,
)

__all__ = ["CheckpointConfig", "Config", "ConfigError", "DataConfig", "EvalConfig", "KappaConfig",
           "LogConfig", "ModelConfig", "MoEConfig", "MuonConfig", "ParallelConfig", "ProfileConfig", "RunConfig",
           "SoftMoEConfig", "TrainConfig", "WandbConfig", "ZeroConfig", "load_config", "load_config_for_cli",
           "load_recorded", "markdown_reference", "parse_overrides", "read_yaml", "to_dict", "validate"]
