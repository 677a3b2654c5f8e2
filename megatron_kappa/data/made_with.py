"""Whether shards were made by a given tokenizer: the one check that training, evaluation, export
and the study make before token ids meet a tokenizer (another tokenizer's ids mean other pieces:
a loss, bits per byte or a continuation from them would be wrong with no word)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from megatron_kappa.config import ConfigError, DataConfig
from megatron_kappa.data.blend import parse_blend


def check_made_with(tokenizer: str | Path, prefixes, key: str, who: str):
    """Refuse, in one line, shards whose data prep manifest.json (beside each prefix) records the
    sha256 of another tokenizer file than `tokenizer`. `key` names where the prefixes come from
    (data.paths, --data), `who` how the tokenizer was given (the error's first words). Shards
    without a manifest (made elsewhere) have nothing recorded to compare and pass."""
    digest = None
    for prefix in prefixes:
        manifest = Path(prefix).parent / "manifest.json"
        try:
            made_with = json.loads(manifest.read_text()).get("tokenizer", {}).get("sha256")
        except (OSError, ValueError, AttributeError):
            continue
        if not made_with:
            continue
        digest = digest or hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()
        if made_with != digest:
            raise ConfigError(f"{who}: {tokenizer} is not the tokenizer {key} {prefix} was made with ({manifest} "
                              f"records sha256 {made_with[:12]}…, this file is {digest[:12]}…)")


def check_run_shards(tokenizer: str | Path, data: DataConfig, who: str):
    """check_made_with for a run's own shards (data.paths and data.valid_paths; none for mock
    data): at its start, and when a tool reads the run's tokenizer again (the file may have been
    replaced since, or another one given)."""
    if data.mock:
        return
    for key, paths in (("data.paths", data.paths), ("data.valid_paths", data.valid_paths)):
        check_made_with(tokenizer, parse_blend(paths, key)[0], key, who)
