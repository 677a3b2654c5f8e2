"""How many times a run reads its training documents.

The tokens of the split's documents in the shards against the tokens the run's samples draw from
them: a corpus smaller than the token budget repeats its documents, which the trainer says in one
line at start (train/loop.py)."""
from __future__ import annotations

import numpy as np

from megatron_kappa.data.bestfit import BestFitDataset


def passes(dataset) -> float:
    """The largest number of passes over its documents that any part of `dataset` (a blend's
    parts, or one dataset) makes: the tokens its samples read over the tokens its split's
    documents hold. Concatenated rows read seq_length tokens a sample (megatron's GPTDataset
    counts its epochs the same way); best-fit rows read whole documents, their cropped tokens
    included. 0 for a dataset without an indexed dataset underneath."""
    worst = 0.0
    for part in getattr(dataset, "datasets", [dataset]):
        indexed, indices = getattr(part, "dataset", None), getattr(part, "indices", None)
        if indexed is None or indices is None or not hasattr(indexed, "sequence_lengths"):
            continue
        held = int(np.sum(indexed.sequence_lengths[indices]))
        if isinstance(part, BestFitDataset):
            read = part.token_counts()[1]
        else:
            samples = part.num_samples if part.num_samples is not None else len(part)
            read = samples * part.config.sequence_length + 1
        worst = max(worst, read / max(held, 1))
    return worst
