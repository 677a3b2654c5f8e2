"""Bytes per token: the project's SentencePiece BPE against a byte-level BPE with a GPT-4-style
pre-split (how the authors' nanochat tokenizer is built: rustbpe on GPT-4's split pattern), both
trained here on the same documents of the bundled sample at the same vocabulary, measured on held-out
documents. What the tokenizer difference changes (docs/recipe.md, "What still differs").

    .venv/bin/python bench/tokenizer_bytes.py [--vocab 2048 8192] [--train-docs 3000]

The byte-level BPE trainer below is a minimal one written for this comparison (merges by pair
count over the pre-split chunks, ties broken by the smaller pair); the split pattern is GPT-4's
with Python's `re` classes ([^\\W\\d_] for a letter, \\d for a number).
"""
from __future__ import annotations

import argparse
import re
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

L, N = r"[^\W\d_]", r"\d"  # \p{L}, \p{N}
GPT4_SPLIT = re.compile(
    rf"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|(?:[^\r\n\w]|_)?{L}+|{N}{{1,3}}| ?(?:[^\s\w]|_)+[\r\n]*"""
    rf"""|\s*[\r\n]|\s+(?!\S)|\s+""")


def texts(limit: int | None = None) -> list[str]:
    import pyarrow.parquet as pq
    out = []
    for path in sorted((ROOT / "data_prep/sample").glob("*.parquet")):
        out += pq.read_table(path, columns=["text"]).column("text").to_pylist()
    return out[:limit]


def train_bpe(docs: list[str], vocab: int) -> list[tuple[int, int]]:
    """Byte-level BPE merges (vocab − 256 of them) over GPT-4-split chunks."""
    chunks = Counter(c.encode("utf-8") for d in docs for c in GPT4_SPLIT.findall(d))
    words = [list(w) for w in chunks]
    counts = list(chunks.values())
    pairs, where = Counter(), defaultdict(set)
    for i, w in enumerate(words):
        for a, b in zip(w, w[1:]):
            pairs[a, b] += counts[i]
            where[a, b].add(i)
    merges = []
    for new in range(256, vocab):
        if not pairs:
            break
        best = max(pairs, key=lambda p: (pairs[p], -p[0], -p[1]))
        merges.append(best)
        for i in list(where.pop(best, ())):
            w, c = words[i], counts[i]
            for a, b in zip(w, w[1:]):
                pairs[a, b] -= c
                if pairs[a, b] <= 0:
                    del pairs[a, b]
            merged, j = [], 0
            while j < len(w):
                if j + 1 < len(w) and (w[j], w[j + 1]) == best:
                    merged.append(new)
                    j += 2
                else:
                    merged.append(w[j])
                    j += 1
            words[i] = merged
            for a, b in zip(merged, merged[1:]):
                pairs[a, b] += c
                where[a, b].add(i)
    return merges


def bpe_tokens(docs: list[str], merges: list[tuple[int, int]]) -> int:
    rank = {pair: 256 + i for i, pair in enumerate(merges)}
    total, cache = 0, {}
    for d in docs:
        for chunk in GPT4_SPLIT.findall(d):
            if chunk not in cache:
                w = list(chunk.encode("utf-8"))
                while len(w) > 1:
                    best = min(zip(w, w[1:]), key=lambda p: rank.get(p, 1 << 30))
                    if best not in rank:
                        break
                    merged, j = [], 0
                    while j < len(w):
                        if j + 1 < len(w) and (w[j], w[j + 1]) == best:
                            merged.append(rank[best])
                            j += 2
                        else:
                            merged.append(w[j])
                            j += 1
                    w = merged
                cache[chunk] = len(w)
            total += cache[chunk]
    return total


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, nargs="+", default=[2048, 8192])
    parser.add_argument("--train-docs", type=int, default=3000)
    parser.add_argument("--valid-docs", type=int, default=500)
    args = parser.parse_args(argv)
    from megatron_kappa.tokenizer import Tokenizer, train_tokenizer
    docs = texts()
    train, valid = docs[:args.train_docs], docs[-args.valid_docs:]
    valid_bytes = sum(len(d.encode("utf-8")) for d in valid)
    print(f"train {len(train)} documents, held-out {len(valid)} documents ({valid_bytes:,} bytes)")
    print(f"{'vocab':>6}  {'SentencePiece B/token':>22}  {'GPT-4-split BPE B/token':>24}  {'ratio':>6}")
    for vocab in args.vocab:
        with tempfile.TemporaryDirectory() as tmp:
            sp = Tokenizer(train_tokenizer(train, Path(tmp) / "sp.model", vocab))
            sp_tokens = sum(len(sp.encode(d)) for d in valid)
        bpe = bpe_tokens(valid, train_bpe(train, vocab))
        sp_bpt, bpe_bpt = valid_bytes / sp_tokens, valid_bytes / bpe
        print(f"{vocab:>6}  {sp_bpt:>22.3f}  {bpe_bpt:>24.3f}  {sp_bpt / bpe_bpt:>6.3f}")


if __name__ == "__main__":
    from megatron_kappa.entry import start
    start()  # first: the known library notices filtered (megatron_kappa/entry.py)
    main()
