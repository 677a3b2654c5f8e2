"""Validation loss and bits per byte of a causal LM on held-out token documents.

The documents (Megatron indexed shards, or token lists in memory) are read as one stream the way
training reads them: each document's tokens end with one EOD and documents follow each other. An EOD
is put in front of the stream so the first document's first token is scored with the same context
as every other document start. The stream is cut into consecutive windows of seq_len targets; every
token of every document is a target exactly once (up to max_tokens).

loss is the mean nats per target token. bits per byte divides the nats of text tokens by ln 2 and
by their UTF-8 bytes (tokenizer.token_byte_lengths()); zero-byte tokens (EOD and other control
pieces) are left out of both sums, as nanochat does, because they stand for no text.
"""
from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from megatron_kappa.evaluation.core import device_of


def _documents(data):
    """(total tokens, iterator over documents) for shard prefixes or in-memory token lists."""
    if isinstance(data, (str, Path)):
        data = [data]
    data = list(data)
    if data and all(isinstance(d, (str, Path)) for d in data):
        for prefix in data:
            for ext in (".idx", ".bin"):
                if not Path(f"{prefix}{ext}").is_file():
                    raise FileNotFoundError(f"{prefix}{ext}: missing (expected a Megatron indexed shard prefix)")
        # megatron.core takes seconds to import; only pay for it when reading shards.
        from megatron.core.datasets.indexed_dataset import IndexedDataset
        sets = [IndexedDataset(str(p)) for p in data]
        total = sum(int(ds.sequence_lengths.sum()) for ds in sets)
        return total, (ds[i] for ds in sets for i in range(len(ds)))
    return sum(len(d) for d in data), iter(data)


def _windows(first: int, docs, n_targets: int, seq_len: int):
    """Token windows of the stream [first, *docs]: seq_len + 1 tokens each (the last may be shorter),
    consecutive windows sharing one token, so n_targets targets are each covered once."""
    pending, done = np.array([first], dtype=np.int64), 0
    for doc in docs:
        pending = np.concatenate([pending, np.asarray(doc, dtype=np.int64)])
        k = 0
        while len(pending) - k > seq_len and done < n_targets:
            take = min(seq_len, n_targets - done)
            yield pending[k:k + take + 1]
            done, k = done + take, k + take
        pending = pending[k:]
        if done >= n_targets:
            return
    if done < n_targets and len(pending) > 1:
        yield pending[:min(len(pending) - 1, n_targets - done) + 1]


def _batched(windows, batch_size):
    batch = []
    for w in windows:
        batch.append(w)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


@torch.no_grad()
def validation_loss(logits_fn, data, tokenizer, seq_len: int, max_tokens=None, batch_size=8,
                    dp_rank=None, dp_world=None, device=None, progress=False) -> dict:
    """{"loss", "bits_per_byte", "tokens", "bytes"} of logits_fn on `data`: shard prefixes (str/Path
    or a list of them) or documents as token lists (each ending with its EOD, as stored).

    With torch.distributed, batches are split over dp_rank/dp_world (default: every process) and
    the sums gathered over the default group; all ranks run the same number of forward passes.
    Token windows go to `device`, by default the logits function's (`logits_fn.device`).
    """
    if dp_rank is None:
        on = dist.is_available() and dist.is_initialized()
        dp_rank, dp_world = (dist.get_rank(), dist.get_world_size()) if on else (0, 1)
    total, docs = _documents(data)
    n_targets = total if max_tokens is None else min(total, max_tokens)
    n_batches = math.ceil(math.ceil(n_targets / seq_len) / batch_size)
    byte_len = torch.tensor(tokenizer.token_byte_lengths(), dtype=torch.float64)
    pad = tokenizer.pad if getattr(tokenizer, "pad", None) is not None else tokenizer.eod
    sums = torch.zeros(4, dtype=torch.float64)  # nats, nats of text tokens, bytes, tokens
    passes = 0
    batches = _batched(_windows(tokenizer.eod, docs, n_targets, seq_len), batch_size)
    show = progress and dp_rank == 0
    for b, batch in enumerate(tqdm(batches, total=n_batches, desc="val loss", disable=not show)):
        if b % dp_world != dp_rank:
            continue
        ids = torch.full((len(batch), seq_len), pad, dtype=torch.long)
        targets = torch.full((len(batch), seq_len), -100, dtype=torch.long)
        for i, w in enumerate(batch):
            ids[i, :len(w) - 1] = torch.from_numpy(w[:-1])
            targets[i, :len(w) - 1] = torch.from_numpy(w[1:])
        logits = logits_fn(ids.to(device_of(logits_fn, device)))
        keep = targets >= 0
        nll = F.cross_entropy(logits[keep.to(logits.device)].float(), targets[keep].to(logits.device),
                              reduction="none").double().cpu()
        nbytes = byte_len[targets[keep]]
        sums += torch.stack([nll.sum(), (nll * (nbytes > 0)).sum(), nbytes.sum(), torch.tensor(float(nll.numel()),
                                                                                               dtype=torch.float64)])
        passes += 1
    # Expert parallelism exchanges tokens inside every forward pass: keep the pass count equal.
    for _ in range(math.ceil(n_batches / dp_world) - passes):
        logits_fn(torch.full((1, min(8, seq_len)), pad, dtype=torch.long, device=device_of(logits_fn, device)))
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, (dp_rank, sums.tolist()))
        sums = torch.tensor(list(dict(parts).values()), dtype=torch.float64).sum(0)  # one copy per dp rank
    nats, text_nats, nbytes, tokens = sums.tolist()
    return {
        "loss": nats / tokens if tokens else float("nan"),
        "bits_per_byte": text_nats / math.log(2) / nbytes if nbytes else float("nan"),
        "tokens": int(tokens),
        "bytes": int(nbytes),
    }
