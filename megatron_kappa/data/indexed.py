"""Megatron indexed shards (`<prefix>.bin` + `<prefix>.idx`): the index format, read and written
only here (data_prep writes shards with `index_bytes`; the preflight checks them with `read_index`).

The layout is megatron.core.datasets.indexed_dataset's (tests check byte equality against its
IndexedDatasetBuilder): .idx = magic, <Q version 1, <B dtype code, <Q sequence count, <Q document
count, int32 lengths, int64 byte pointers, int64 document indices 0..n. This project writes one
sequence per document.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8
# megatron-core's DType codes (indexed_dataset.DType) → token dtypes
DTYPES = {1: np.dtype(np.uint8), 2: np.dtype(np.int8), 3: np.dtype(np.int16), 4: np.dtype(np.int32),
          5: np.dtype(np.int64), 6: np.dtype(np.float64), 7: np.dtype(np.float32), 8: np.dtype(np.uint16)}
CODES = {dtype: code for code, dtype in DTYPES.items()}


@dataclass(frozen=True)
class Index:
    dtype: np.dtype          # token dtype of the .bin
    lengths: np.ndarray      # tokens per sequence (int64)
    bin_bytes: int           # the size the .bin must have: last pointer + last length

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())


def read_index(idx_path: str | Path) -> Index:
    """The index of a shard; ValueError (a short reason) for a file that is not a whole .idx."""
    with open(idx_path, "rb") as f:
        if f.read(len(MAGIC)) != MAGIC:
            raise ValueError("not a Megatron index file (bad magic)")
        header = f.read(HEADER_BYTES - len(MAGIC))
        if len(header) < HEADER_BYTES - len(MAGIC):
            raise ValueError("truncated header")
        _version, code, n_seq, _n_doc = struct.unpack("<QBQQ", header)
        if code not in DTYPES:
            raise ValueError(f"unknown token dtype code {code}")
        lengths_raw, pointers_raw = f.read(4 * n_seq), f.read(8 * n_seq)
    if len(lengths_raw) < 4 * n_seq or len(pointers_raw) < 8 * n_seq:
        raise ValueError(f"truncated: says {n_seq} sequences but is shorter")
    dtype = DTYPES[code]
    lengths = np.frombuffer(lengths_raw, dtype="<i4").astype(np.int64)
    last_pointer = struct.unpack("<q", pointers_raw[-8:])[0] if n_seq else 0
    return Index(dtype, lengths, last_pointer + (int(lengths[-1]) * dtype.itemsize if n_seq else 0))


def index_bytes(lengths: np.ndarray, dtype: np.dtype) -> bytes:
    """The whole .idx file for documents of these token lengths, one sequence each."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    pointers = np.zeros(n, dtype=np.int64)
    np.cumsum(lengths[:-1] * dtype.itemsize, out=pointers[1:])
    head = MAGIC + struct.pack("<Q", 1) + struct.pack("<B", CODES[dtype])
    head += struct.pack("<Q", n) + struct.pack("<Q", n + 1)
    return b"".join([head, lengths.astype(np.int32).tobytes(), pointers.tobytes(),
                     np.arange(n + 1, dtype=np.int64).tobytes()])


def largest_token_id(prefix: str) -> tuple[int, str]:
    """(the largest token id shard `prefix` can hold, how that is known): the tokenizer vocabulary
    − 1 that the data prep manifest.json beside it records, when it lists the shard (the prep wrote
    ids below it); else the largest id in the .bin, read in one pass."""
    import json
    import os
    folder, name = os.path.split(prefix)
    manifest = os.path.join(folder, "manifest.json")
    if os.path.isfile(manifest):
        try:
            with open(manifest) as f:
                m = json.load(f)
            listed = [p for names in m.get("prefixes", {}).values() for p in names]
            vocab = m.get("tokenizer", {}).get("vocab_size")
            if name in listed and isinstance(vocab, int):
                return vocab - 1, f"its tokenizer's vocabulary per {manifest}"
        except (OSError, ValueError, AttributeError):
            pass  # an unreadable manifest: read the tokens themselves
    index = read_index(prefix + ".idx")
    tokens = np.memmap(prefix + ".bin", dtype=index.dtype, mode="r", shape=(index.bin_bytes // index.dtype.itemsize,))
    chunk = 1 << 26
    top = max((int(tokens[i:i + chunk].max()) for i in range(0, len(tokens), chunk)), default=-1)
    return top, "read from its .bin"
