"""Training data through megatron-core's datasets: GPTDataset over indexed shards (weighted
blends, train/valid split), the authors' best-fit rows (data.packing: bestfit,
megatron_kappa.data.bestfit) or MockGPTDataset, a deterministic batch order that resumes from a
step number alone, and the move of each batch to the device (pinned, non-blocking).

Every input check (files, index magic, truncated shards, empty splits, tokenizer vs vocabulary)
runs earlier, in megatron_kappa.preflight."""
from __future__ import annotations

from functools import partial
from pathlib import Path

import numpy as np
import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

from megatron_kappa.checkpoint.listing import write_failure
from megatron_kappa.config import Config, DataConfig, ModelConfig, TrainConfig
from megatron_kappa.data.bestfit import BestFitConfig, BestFitDataset
from megatron_kappa.data.blend import parse_blend
from megatron_kappa.data.cache import writing_cache


class StubTokenizer:
    """What GPTDataset needs from a tokenizer, for mock data (no tokenizer file)."""

    def __init__(self, vocab_size: int):
        self.vocab_size, self.eod, self.pad = vocab_size, 0, 0
        self.unique_identifiers = {"class": "StubTokenizer", "vocab_size": vocab_size}


def tokenizer_for(data: DataConfig, model: ModelConfig):
    if data.tokenizer:
        from megatron_kappa.tokenizer import Tokenizer
        return Tokenizer(data.tokenizer)
    return StubTokenizer(model.vocab_size)


def data_seed(data: DataConfig, train: TrainConfig) -> int:
    """The document order's seed: data.seed, or train.seed when it is null."""
    return train.seed if data.seed is None else data.seed


def build_datasets(cfg: Config, train_samples: int, valid_samples: int):
    """(train, valid) megatron-core datasets. Rank 0 writes the index caches, the rest read them."""
    tok = tokenizer_for(cfg.data, cfg.model)
    common = dict(random_seed=data_seed(cfg.data, cfg.train), sequence_length=cfg.model.seq_length, tokenizer=tok,
                  reset_position_ids=False, reset_attention_mask=False, eod_mask_loss=False,
                  create_attention_mask=False,
                  path_to_cache=cfg.data.cache_dir or str(Path(cfg.run.dir) / "data_cache"))
    if cfg.data.mock:
        config = GPTDatasetConfig(blend=None, split="98,2,0", **common)
        cls = MockGPTDataset
    else:
        if cfg.data.packing == "bestfit":
            cls, make = BestFitDataset, partial(BestFitConfig, packing_buffer=cfg.data.packing_buffer)
        else:
            cls, make = GPTDataset, GPTDatasetConfig
        if cfg.data.valid_paths:
            config = make(blend_per_split=[parse_blend(cfg.data.paths),
                                           parse_blend(cfg.data.valid_paths, "data.valid_paths"), None],
                          **common)
        else:
            config = make(blend=parse_blend(cfg.data.paths), split=cfg.data.split, **common)
    # the test split is never read; megatron-core asserts that a split of unstated size has no
    # weights, so a weighted blend states 0 for it (README's [0.7, a, 0.3, b] form crashed there)
    blends = [config.blend] if getattr(config, "blend", None) else list(getattr(config, "blend_per_split", None) or [])
    weighted = any(b is not None and b[1] is not None for b in blends)
    with writing_cache(config.path_to_cache, write_failure):  # a full disk: one line naming the folder, no half index
        train, valid, _ = BlendedMegatronDatasetBuilder(
            cls, [train_samples, valid_samples, 0 if weighted else None], lambda: True, config).build()
    return train, valid


def train_first_sample(step: int, micro: int, train: TrainConfig, dp_rank: int, dp_size: int) -> int:
    """Index of the first sample of one DP rank's micro-batch: a pure function of the step, so a
    resumed run reads exactly what the interrupted one would have."""
    return step * train.global_batch + dp_rank * (train.global_batch // dp_size) + micro * train.micro_batch


def batch_at(dataset, first: int, count: int, device: torch.device | str = "cpu") -> dict:
    """`count` consecutive samples (wrapping around) as tokens / labels / loss_mask tensors on
    `device`. For CUDA the host copy is pinned and the copy is asynchronous, so the next batch's
    transfer overlaps the current step's kernels instead of stalling them."""
    samples = [dataset[(first + i) % len(dataset)] for i in range(count)]
    batch = {k: torch.from_numpy(np.stack([np.asarray(s[k]) for s in samples]))
             for k in ("tokens", "labels", "loss_mask")}
    batch["tokens"] = batch["tokens"].long()
    batch["labels"] = batch["labels"].long()
    batch["loss_mask"] = batch["loss_mask"].float()
    return to_device(batch, device)


def to_device(batch: dict, device: torch.device | str) -> dict:
    device = torch.device(device)
    if device.type != "cuda":
        return {k: v.to(device) for k, v in batch.items()}
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
