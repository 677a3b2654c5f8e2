"""Megatron indexed binary shards (`<prefix>.bin` + `<prefix>.idx`), written without megatron-core.

The index format (megatron-core's, one sequence per document) is read and written by
megatron_kappa.data.indexed, the project's one .idx reader.
Shards are written under `<name>.tmp` names and renamed only when complete, so a file with a final
name is either finished or (if the run died before recording it) deleted on resume.
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path

import numpy as np

from megatron_kappa.data.indexed import CODES, index_bytes, read_index

DTYPE_CODES = {dtype: CODES[dtype] for dtype in (np.dtype(np.uint16), np.dtype(np.int32))}  # written here


def choose_dtype(vocab_size: int, requested: str = "auto") -> np.dtype:
    """uint16 when every id fits (megatron-core's own rule: vocab < 65500), else int32."""
    from megatron_kappa.data_prep import DataPrepError
    if requested == "auto":
        return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)
    dtype = np.dtype(requested)
    if dtype not in DTYPE_CODES:
        raise DataPrepError(f"--dtype {requested}: expected auto, uint16 or int32")
    if vocab_size - 1 > np.iinfo(dtype).max:
        raise DataPrepError(f"tokenizer vocabulary {vocab_size} does not fit --dtype {requested} "
                            f"(largest id {np.iinfo(dtype).max}); use --dtype int32 or auto")
    return dtype


def read_lengths(idx_path: str | Path) -> tuple[np.dtype, np.ndarray]:
    """Token dtype and per-document lengths of an .idx file written by `index_bytes`."""
    index = read_index(idx_path)
    return index.dtype, index.lengths


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def _naming(path: Path):
    """A buffered write's OSError names no file (a full disk mid-shard said only "[Errno 28] No
    space left on device"): it gets the shard's, for the one-line error."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            e.filename = str(path)
        raise


class ShardWriter:
    """Streams documents into `<prefix>.bin.tmp`; `close()` writes the index and renames both."""

    def __init__(self, prefix: Path, dtype: np.dtype):
        self.prefix = Path(prefix)
        self.dtype = dtype
        self.lengths: list[int] = []
        self.tokens = 0
        self._bin = open(self._tmp(".bin"), "wb", buffering=8 << 20)

    def _tmp(self, ext: str) -> Path:
        return self.prefix.with_name(self.prefix.name + ext + ".tmp")

    def add(self, doc: np.ndarray) -> None:
        with _naming(self._tmp(".bin")):
            self._bin.write(memoryview(doc))
        self.lengths.append(len(doc))
        self.tokens += len(doc)

    def add_many(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Consecutive documents already laid out back to back (lengths sum to len(tokens))."""
        with _naming(self._tmp(".bin")):
            self._bin.write(memoryview(tokens))
        self.lengths.extend(lengths.tolist())
        self.tokens += len(tokens)

    @property
    def documents(self) -> int:
        return len(self.lengths)

    def close(self) -> dict:
        """Finish the shard under its final name; returns its manifest entry."""
        with _naming(self._tmp(".bin")):
            self._bin.flush()
            os.fsync(self._bin.fileno())
            self._bin.close()
        with _naming(self._tmp(".idx")):
            _write_synced(self._tmp(".idx"), index_bytes(np.array(self.lengths), self.dtype))
        os.replace(self._tmp(".bin"), self.prefix.with_name(self.prefix.name + ".bin"))
        os.replace(self._tmp(".idx"), self.prefix.with_name(self.prefix.name + ".idx"))
        return {"prefix": self.prefix.name, "documents": self.documents, "tokens": self.tokens,
                "bin_bytes": self.tokens * self.dtype.itemsize}

    def abort(self) -> None:
        """Drop an unfinished shard (a mid-stream error): nothing with a final name is touched."""
        self._bin.close()
        for ext in (".bin", ".idx"):
            self._tmp(ext).unlink(missing_ok=True)


def merge(pieces: list[Path], out_dir: Path, name: str, dtype: np.dtype,
          shard_tokens: int) -> list[dict]:
    """Concatenate small shards (in order) into `<name>_00000`, ... of about shard_tokens each."""
    entries, writer = [], None
    for piece in pieces:
        _, lengths = read_lengths(piece.with_suffix(".idx"))
        data = np.fromfile(piece.with_suffix(".bin"), dtype=dtype)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        for i in range(len(lengths)):
            if writer is None:
                writer = ShardWriter(out_dir / f"{name}_{len(entries):05d}", dtype)
            writer.add(data[offsets[i]:offsets[i + 1]])
            if writer.tokens >= shard_tokens:
                entries.append(writer.close())
                writer = None
    if writer is not None:
        entries.append(writer.close())
    return entries
