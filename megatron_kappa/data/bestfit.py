"""`data.packing: bestfit`: the authors' BOS-aligned best-fit packing (14c9b04
nanochat/dataloader.py:4-13, 80-106) over Megatron indexed shards, as a megatron-core dataset.

Each row holds seq_length + 1 tokens and starts at a document's BOS. Documents wait in a buffer of
`data.packing_buffer` (1000); whenever it holds fewer, the next 128 of the stream join it at the
end (the authors' tokenizer batches). A row is filled by taking, again and again, the largest
buffered document that fits the room left (the earliest of equal lengths); when none fits, the
shortest (the earliest of equal lengths) is cropped to the room left and the rest of it is
discarded. About 35 % of the tokens taken are cropped at 2048 (the authors' figure).

How it maps onto the project (the rest is the authors' algorithm as written):
- A document is as data prep stored it minus its trailing EOD: BOS + its tokens, the authors'
  `tokenizer.encode(text, prepend=bos)`. A document that does not start with BOS is refused.
- The stream: the split's documents, each epoch in a new order drawn from one numpy
  RandomState(data.seed, or train.seed) (`rng.permutation`), epochs back to back; the buffer
  carries over an epoch's end as the authors' endless reader does. (The authors read a corpus
  shuffled once on disk; megatron's GPTDataset likewise shuffles documents with the seed.)
- Rows are kept in packing order (the authors do not shuffle rows) and packed once, for the
  whole run, into an index cached beside megatron's (`data.cache_dir`): rank 0 builds it, the
  others read it (megatron's dataset builder orders that). Row i is then a pure function of the
  seed, the split and i, so data-parallel ranks read their own rows by sample number and a
  resumed run reads what the interrupted one would have. A longer run's rows start with a shorter
  one's: packing is sequential. (The authors pack one stream per data-parallel rank.)
- Every piece of a row is a prefix of a document, so a row is stored as (document, length) pairs.
"""
from __future__ import annotations

import bisect
import itertools
import os
from array import array
from collections import deque
from dataclasses import dataclass

import numpy as np
import torch
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig
from megatron.core.datasets.megatron_dataset import MegatronDataset

from megatron_kappa.config import ConfigError

REFILL = 128  # documents added to the buffer at a time: 14c9b04's tokenizer_batch_size (dataloader.py:82)


@dataclass
class BestFitConfig(GPTDatasetConfig):
    packing_buffer: int = 1000
    """documents the best fit chooses among (14c9b04's buffer_size, dataloader.py:84)"""


def document_stream(indices: np.ndarray, seed: int, epochs: int | None = None, block: int = 1 << 16):
    """The split's document ids as the packer reads them, in blocks: each epoch a permutation
    drawn from one RandomState(seed), for `epochs` epochs (None: without end)."""
    if not len(indices):
        return
    rng = np.random.RandomState(seed)
    for _ in itertools.count() if epochs is None else range(epochs):
        order = rng.permutation(indices)
        for start in range(0, len(order), block):
            yield order[start:start + block]


def pack(stream, capacity: int, rows: int | None, buffer_size: int = 1000,
         refill: int = REFILL) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Best-fit rows of `capacity` tokens from the (document, length ≥ 1) pairs of `stream`,
    `rows` of them or, with None, as many as the stream completes. Returns (row_start, piece_doc,
    piece_len, taken): row r is the first piece_len[j] tokens of document piece_doc[j] for j in
    row_start[r]:row_start[r + 1]; `taken` counts the tokens of those documents, whole.

    The authors' scan of a Python list is O(buffer) per piece; here the buffer is a queue per
    length (arrival order breaks ties, as their list order does) and a sorted list of the lengths
    held, so a piece costs a bisection."""
    queues: dict[int, deque] = {}
    held_lengths: list[int] = []  # sorted, one entry per length with a non-empty queue
    held = 0
    pairs = iter(stream)
    row_start, docs, takes = array("q", [0]), array("i"), array("i")
    taken = taken_by_rows = 0
    while rows is None or len(row_start) - 1 < rows:
        pos = 0
        while pos < capacity:
            while held < buffer_size:
                batch = list(itertools.islice(pairs, refill))
                if not batch:  # a finite stream has run out: the row stays unfinished, dropped
                    del docs[row_start[-1]:], takes[row_start[-1]:]
                    return _arrays(row_start, docs, takes, taken_by_rows)
                for d, n in batch:
                    queue = queues.get(n)
                    if queue is None:
                        queue = queues[n] = deque()
                        bisect.insort(held_lengths, n)
                    queue.append(d)
                held += len(batch)
            room = capacity - pos
            i = bisect.bisect_right(held_lengths, room) - 1
            if i < 0:  # nothing fits: crop the shortest to the room left
                i = 0
            n = held_lengths[i]
            queue = queues[n]
            docs.append(queue.popleft())
            takes.append(min(n, room))
            taken += n
            pos += takes[-1]
            held -= 1
            if not queue:
                del queues[n], held_lengths[i]
        row_start.append(len(docs))
        taken_by_rows = taken
    return _arrays(row_start, docs, takes, taken_by_rows)


def _arrays(row_start, docs, takes, taken):
    return (np.frombuffer(row_start, dtype=np.int64), np.frombuffer(docs, dtype=np.int32),
            np.frombuffer(takes, dtype=np.int32), taken)


class BestFitDataset(MegatronDataset):
    """megatron-core's dataset interface (the builder's blends and splits work as for
    GPTDataset, whose low-level IndexedDataset it reads) over best-fit rows (module doc)."""

    def __init__(self, indexed_dataset, dataset_path, indexed_indices, num_samples, index_split,
                 config: BestFitConfig):
        super().__init__(indexed_dataset, dataset_path, indexed_indices, num_samples, index_split, config)
        self.capacity = config.sequence_length + 1
        self.row_start, self.piece_doc, self.piece_len, self.taken = self._build_or_load()

    numel_low_level_dataset = staticmethod(GPTDataset.numel_low_level_dataset)
    build_low_level_dataset = staticmethod(GPTDataset.build_low_level_dataset)

    @staticmethod
    def _key_config_attributes() -> list[str]:
        return [*MegatronDataset._key_config_attributes(), "packing_buffer"]

    def with_lengths(self, blocks):
        """(document, length) pairs for blocks of document ids: each document's length without
        its trailing EOD, read from its first and last token (only the documents the packer
        reaches: a corpus far larger than the run is not read through). ConfigError for a
        document that does not start with BOS (a row must)."""
        tok = self.config.tokenizer
        if getattr(tok, "bos", None) is None:
            raise ConfigError("config: data.packing: bestfit needs data.tokenizer (its BOS and EOD ids)")
        index = self.dataset.index
        tokens = np.memmap(self.dataset.path_prefix + ".bin", dtype=index.dtype, mode="r")
        for ids in blocks:
            lengths = index.sequence_lengths[ids].astype(np.int64)
            starts = index.sequence_pointers[ids] // index.dtype_size
            bad = np.flatnonzero(lengths == 0)
            if not len(bad):
                bad = np.flatnonzero(tokens[starts] != tok.bos)
            if len(bad):
                d, first = int(ids[bad[0]]), (int(tokens[starts[bad[0]]]) if lengths[bad[0]] else "nothing")
                raise ConfigError(f"config: data.packing: bestfit needs documents that start with BOS ({tok.bos}); "
                                  f"document {d} of {self.dataset.path_prefix} starts with {first}; use "
                                  "data.packing: concat")
            lengths -= tokens[starts + lengths - 1] == tok.eod
            yield from zip(ids.tolist(), lengths.tolist())

    def _build_or_load(self):
        cache = self.config.path_to_cache
        base = os.path.join(cache, f"{self.unique_description_hash}-{type(self).__name__}-{self.index_split.name}") \
            if cache else None
        names = ("row_start", "piece_doc", "piece_len", "taken")
        if base and all(os.path.isfile(f"{base}-{n}.npy") for n in names):
            row_start, piece_doc, piece_len, taken = (np.load(f"{base}-{n}.npy", mmap_mode="r") for n in names)
            return row_start, piece_doc, piece_len, int(taken)
        epochs = None if self.num_samples is not None else 1  # None samples: one epoch's rows
        stream = self.with_lengths(document_stream(self.indices, self.config.random_seed, epochs))
        arrays = pack(stream, self.capacity, self.num_samples, self.config.packing_buffer)
        if base:
            os.makedirs(cache, exist_ok=True)
            with open(f"{base}-description.txt", "w") as f:
                f.write(self.unique_description)
            for n, a in zip(names, arrays):  # a reader never sees half a file, nor two ranks' writes mixed
                tmp = f"{base}-{n}.{os.getpid()}.tmp.npy"
                np.save(tmp, np.asarray(a))
                os.replace(tmp, f"{base}-{n}.npy")
        return arrays

    def __len__(self) -> int:
        return len(self.row_start) - 1

    def row(self, idx: int) -> np.ndarray:
        """Row `idx`'s seq_length + 1 tokens."""
        lo, hi = self.row_start[idx], self.row_start[idx + 1]
        return np.concatenate([self.dataset.get(int(d), 0, int(n))
                               for d, n in zip(self.piece_doc[lo:hi], self.piece_len[lo:hi])])

    def __getitem__(self, idx: int) -> dict:
        text = torch.from_numpy(self.row(idx).astype(np.int64))
        n = self.capacity - 1
        return {"tokens": text[:-1], "labels": text[1:], "loss_mask": torch.ones(n),
                "position_ids": torch.arange(n)}

    def token_counts(self) -> tuple[int, int, int]:
        """(documents, tokens of those documents, tokens cropped) over all rows."""
        return len(self.piece_doc), self.taken, self.taken - len(self) * self.capacity


def cropped_report(dataset) -> str | None:
    """'N rows from D documents, X % of their tokens cropped' over the best-fit datasets inside
    `dataset` (a blend's parts summed); None for a dataset that is not best-fit."""
    parts = getattr(dataset, "datasets", [dataset])
    parts = [p for p in parts if isinstance(p, BestFitDataset)]
    if not parts:
        return None
    docs, taken, cropped = (sum(c) for c in zip(*(p.token_counts() for p in parts)))
    rows = sum(len(p) for p in parts)
    return f"{rows:,} rows from {docs:,} documents, {100 * cropped / max(taken, 1):.1f} % of their tokens cropped"
