"""`data.paths` in Megatron-LM's --data-path form, and `data.split` as megatron-core cuts it."""
from __future__ import annotations

from megatron_kappa.config import ConfigError


def parse_blend(paths: list, key: str = "data.paths") -> tuple[list[str], list[float] | None]:
    """[a, b] or [0.7, a, 0.3, b] (Megatron-LM's --data-path form) → prefixes, weights; `key` names
    the config key in errors."""
    if not paths:
        return [], None
    if all(isinstance(p, str) for p in paths):
        return [str(p) for p in paths], None
    if len(paths) % 2 or not all(isinstance(w, (int, float)) and isinstance(p, str)
                                 for w, p in zip(paths[::2], paths[1::2])):
        raise ConfigError(f"config: {key}: expected [prefix, ...] or [weight, prefix, ...]")
    weights = [float(w) for w in paths[::2]]
    if any(not w >= 0 for w in weights) or not sum(weights) > 0:  # NaN fails both
        raise ConfigError(f"config: {key}: expected non-negative weights, not all 0, got {weights}")
    return [str(p) for p in paths[1::2]], weights


def split_ranges(split: str, n: int) -> list[tuple[int, int] | None]:
    """megatron-core's [train, valid, test] sequence ranges for `split` ("99,1,0") over n
    sequences: bookends of the normalised weights, each end rounded."""
    try:
        weights = [float(w) for w in split.split(",")]
    except ValueError:
        raise ConfigError(f"config: data.split: expected three numbers like '99,1,0', got {split!r}") from None
    weights += [0.0] * (3 - len(weights))
    if len(weights) != 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"config: data.split: expected three non-negative numbers like '99,1,0', got {split!r}")
    total, edges = sum(weights), [0.0]
    for w in weights:
        edges.append(edges[-1] + w / total)
    return [None if hi <= lo else (int(round(lo * n)), int(round(hi * n))) for lo, hi in zip(edges, edges[1:])]
