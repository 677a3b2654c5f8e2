"""Whether a run's training documents start with BOS: the question CORE must answer the same way
as training did (a model trained without BOS scores worse with it, and the other way round)."""
from __future__ import annotations

import json
from pathlib import Path

from megatron_kappa.config import ConfigError, DataConfig


def documents_start_with_bos(data: DataConfig) -> bool:
    """`data.bos` when set; else the "bos" of the data prep manifest.json in each data path's
    folder (one without it predates BOS: false); false for mock data or shards without a
    manifest. Paths that disagree are refused."""
    if data.bos is not None:
        return data.bos
    if data.mock:
        return False
    answers = {}
    for prefix in [p for p in [*data.paths, *data.valid_paths] if isinstance(p, str)]:
        manifest = Path(prefix).parent / "manifest.json"
        if manifest.is_file():
            answers[str(manifest)] = bool(json.loads(manifest.read_text()).get("bos", False))
    if len(set(answers.values())) > 1:
        raise ConfigError(f"config: data.bos: the shards disagree ({answers}); set data.bos or use one layout")
    return next(iter(answers.values()), False)
