"""Checks of a run's inputs that need no heavy imports, so a bad path fails in the first second,
before torch.distributed, megatron-core or DeepSpeed are even imported."""
from __future__ import annotations

import os

from megatron_kappa.config import Config, ConfigError

_IDX_MAGIC = b"MMIDIDX\x00\x00"


def parse_blend(paths: list) -> tuple[list[str], list[float] | None]:
    """[a, b] or [0.7, a, 0.3, b] (Megatron-LM's --data-path form) → prefixes, weights."""
    if not paths:
        return [], None
    if all(isinstance(p, str) for p in paths):
        return [str(p) for p in paths], None
    if len(paths) % 2 or not all(isinstance(w, (int, float)) and isinstance(p, str)
                                 for w, p in zip(paths[::2], paths[1::2])):
        raise ConfigError("config: data.paths: expected [prefix, ...] or [weight, prefix, ...]")
    return [str(p) for p in paths[1::2]], [float(w) for w in paths[::2]]


def check_data(cfg: Config):
    """Fail in the first seconds (before any process group) on missing or corrupt inputs."""
    if cfg.train.init_weights and not os.path.isfile(cfg.train.init_weights):
        raise ConfigError(f"config: train.init_weights: {cfg.train.init_weights}: no such file")
    if cfg.data.mock:
        return
    prefixes, _ = parse_blend(cfg.data.paths)
    if not prefixes:
        raise ConfigError("config: data.paths: empty (give shard prefixes, or set data.mock: true)")
    for key, group in (("data.paths", prefixes), ("data.valid_paths", parse_blend(cfg.data.valid_paths)[0])):
        for prefix in group:
            for ext in (".bin", ".idx"):
                if not os.path.isfile(prefix + ext):
                    raise ConfigError(f"config: {key}: {prefix}{ext}: no such file")
            with open(prefix + ".idx", "rb") as f:
                if f.read(len(_IDX_MAGIC)) != _IDX_MAGIC:
                    raise ConfigError(f"config: {key}: {prefix}.idx: not a Megatron index file (bad magic)")
            if os.path.getsize(prefix + ".bin") == 0:
                raise ConfigError(f"config: {key}: {prefix}.bin: empty file")
    if cfg.data.tokenizer and not os.path.isfile(cfg.data.tokenizer):
        raise ConfigError(f"config: data.tokenizer: {cfg.data.tokenizer}: no such file")


