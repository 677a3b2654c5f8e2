"""Worker side: read a unit, filter it, encode it in one batched call, split train/valid.

Runs in pool processes (spawned: they import this module, not the CLI script). The result is a few
numpy arrays, so sending it back costs a memcpy, not per-token pickling.
"""
from __future__ import annotations

import hashlib
from itertools import chain

import numpy as np

from megatron_kappa.data_prep import DataPrepError
from megatron_kappa.data_prep.sources import KEPT, Selection, read_unit

_W: dict = {}


def split_key(seed: int) -> bytes:
    return f"data_prep-split-{seed}".encode()


def valid_flags(texts: list[str], key: bytes, fraction: float) -> np.ndarray:
    """Held-out documents: keyed hash of the text below `fraction`. Depends on nothing but the
    text and seed, so it is the same for any worker count or unit size, and exact duplicates
    always land in the same split."""
    if fraction <= 0:
        return np.zeros(len(texts), dtype=bool)
    limit = int(fraction * 2**64)
    return np.array([int.from_bytes(hashlib.blake2b(t.encode("utf-8"), digest_size=8, key=key)
                                    .digest(), "little") < limit for t in texts], dtype=bool)


def init(tokenizer_file: str, selection: Selection, dtype: str, seed: int, valid_fraction: float,
         bos: bool = True):
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's: it stops the pool
    from megatron_kappa.tokenizer import Tokenizer
    _W.update(tok=Tokenizer(tokenizer_file), selection=selection, dtype=np.dtype(dtype),
              key=split_key(seed), fraction=valid_fraction, bos=bos)


def encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Flat tokens and per-document lengths: each document is BOS (when `bos`, as nanochat's
    training data and its CORE prompts start), its tokens, then EOD; lengths count both."""
    tok = _W["tok"]
    ids = tok.encode_batch(texts, num_threads=1)
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=int(lengths.sum()))
    tokens = np.insert(flat, np.cumsum(lengths), tok.eod)
    if _W.get("bos", True):
        starts = np.concatenate([[0], np.cumsum(lengths + 1)[:-1]]) if len(ids) else np.zeros(0, np.int64)
        tokens = np.insert(tokens, starts, tok.bos)
        lengths = lengths + 1
    return tokens.astype(_W["dtype"]), lengths + 1


def process(unit: tuple) -> dict:
    """One unit → kept rows, their tokens and split flags, and every row's filter status."""
    sel: Selection = _W["selection"]
    columns = sel.columns()
    batch = unit[1] if unit[0] == "hub" else read_unit(unit, columns)
    status = np.array(sel.status(batch), dtype=np.int8)
    kept = np.flatnonzero(status == KEPT)
    texts = [batch[sel.text][i] for i in kept]
    bad = next((t for t in texts if not isinstance(t, str)), None)
    if bad is not None:
        where = unit[1] if unit[0] != "hub" else "hub dataset"
        raise DataPrepError(f"{where}: column {sel.text!r} holds a {type(bad).__name__}, expected text")
    tokens, lengths = encode(texts)
    return {"status": status, "rows": kept.astype(np.int64), "tokens": tokens, "lengths": lengths,
            "valid": valid_flags(texts, _W["key"], _W["fraction"])}
