"""Tokens/s of data_prep/fineweb_edu.py against a Megatron-LM `preprocess_data.py`-style baseline
and against raw SentencePiece throughput (the ceiling), same input, tokenizer and worker count.

    OMP_NUM_THREADS=1 .venv/bin/python bench/data_prep.py --workers 2 --repeat 4 --rounds 5

Input: the bundled sample (data_prep/sample) repeated --repeat times, as parquet (row groups of
1024, like the FineWeb-Edu re-pack) and as jsonl (the baseline only reads jsonl).
- ceiling: `sp.encode(all_texts, num_threads=W)` on texts already in memory; nothing read/written.
- baseline: what preprocess_data.py does with --partitions 1 --append-eod: the main process reads
  jsonl lines into `multiprocessing.Pool(W).imap(encode, lines, 32)`; each worker json.loads the
  line and tokenizes that one document; the main process adds each to megatron-core's
  IndexedDatasetBuilder and finalizes it.
- ours: the full tool (spawned workers, filters off, default 0.1% validation split, manifest).
Methods are interleaved round by round; tokens/s use each method's best round (the one least
disturbed when the machine is shared), the median is shown too, and so are CPU seconds (this
process + reaped workers) per million tokens, which depend less on other load. Every method's token total is checked
against the ceiling's.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import resource
import shutil
import statistics
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import sentencepiece as spm

REPO = Path(__file__).resolve().parents[1]


class MegatronStyleEncoder:
    """Megatron-LM tools/preprocess_data.py's Encoder (text key, --append-eod), minus NLTK."""

    def __init__(self, model_file: str):
        self.model_file = model_file

    def initializer(self):
        MegatronStyleEncoder.sp = spm.SentencePieceProcessor(model_file=self.model_file)

    def encode(self, json_line):
        data = json.loads(json_line)
        doc_ids = MegatronStyleEncoder.sp.encode_as_ids(data["text"])
        lens = [len(doc_ids)]
        if doc_ids:
            doc_ids.append(MegatronStyleEncoder.sp.eos_id())
            lens[-1] += 1
        return {"text": doc_ids}, {"text": lens}, len(json_line)


def baseline(jsonl: Path, model: Path, workers: int, out: Path) -> int:
    from megatron.core.datasets import indexed_dataset
    encoder = MegatronStyleEncoder(str(model))
    vocab = spm.SentencePieceProcessor(model_file=str(model)).get_piece_size()
    builder = indexed_dataset.IndexedDatasetBuilder(
        str(out) + ".bin", dtype=indexed_dataset.DType.optimal_dtype(vocab))
    tokens = 0
    with open(jsonl, encoding="utf-8") as fin, mp.Pool(workers, initializer=encoder.initializer) as pool:
        for doc, lens, _ in pool.imap(encoder.encode, fin, 32):
            builder.add_document(doc["text"], lens["text"])
            tokens += len(doc["text"])
    builder.finalize(str(out) + ".idx")
    return tokens


def ours(inp: Path, model: Path, workers: int, out: Path) -> int:
    from megatron_kappa.data_prep.fineweb_edu import run
    m = run(["--input", str(inp), "--output", str(out), "--tokenizer", str(model),
             "--workers", str(workers), "--quiet", "--overwrite"])
    return m["totals"]["train"]["tokens"] + m["totals"]["valid"]["tokens"]


def ceiling(texts: list[str], model: Path, workers: int) -> int:
    sp = spm.SentencePieceProcessor(model_file=str(model))
    ids = sp.encode(texts, num_threads=workers)
    return sum(map(len, ids)) + len(ids)  # + one EOD per document, as the shards hold


def make_inputs(work: Path, repeat: int) -> tuple[Path, Path, list[str]]:
    table = pa.concat_tables([pq.read_table(p) for p in sorted((REPO / "data_prep/sample").glob("*.parquet"))])
    table = pa.concat_tables([table] * repeat)
    parquet, jsonl = work / "bench.parquet", work / "bench.jsonl"
    pq.write_table(table, parquet, row_group_size=1024, compression="zstd")
    with open(jsonl, "w", encoding="utf-8") as f:
        for row in table.to_pylist():
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return parquet, jsonl, table["text"].to_pylist()


def cpu_seconds() -> float:
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=4, help="copies of the bundled sample")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--vocab-size", type=int, default=32768)
    ap.add_argument("--tokenizer", help="an existing .model (default: train one on the sample)")
    ap.add_argument("--work", default="/tmp/data_prep_bench")
    args = ap.parse_args(argv)
    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    parquet, jsonl, texts = make_inputs(work, args.repeat)
    # imported here, before the timings: imports are not part of either tool's time
    import megatron.core.datasets.indexed_dataset  # noqa: F401

    import megatron_kappa.data_prep.fineweb_edu  # noqa: F401
    model = Path(args.tokenizer) if args.tokenizer else work / "tok.model"
    if not args.tokenizer:
        from megatron_kappa.tokenizer import train_tokenizer
        t = time.perf_counter()
        train_tokenizer(texts[: len(texts) // args.repeat], model, args.vocab_size, num_threads=args.workers)
        print(f"tokenizer: {args.vocab_size} pieces trained in {time.perf_counter() - t:.1f} s", flush=True)
    methods = {
        "ceiling (sp.encode batch, in memory)": lambda: ceiling(texts, model, args.workers),
        "baseline (preprocess_data.py style, jsonl)": lambda: baseline(jsonl, model, args.workers, work / "base"),
        "data_prep (parquet)": lambda: ours(parquet, model, args.workers, work / "ours_pq"),
        "data_prep (jsonl)": lambda: ours(jsonl, model, args.workers, work / "ours_js"),
    }
    times: dict[str, list[float]] = {k: [] for k in methods}
    cpu: dict[str, list[float]] = {k: [] for k in methods}
    tokens: dict[str, int] = {}
    load = os.getloadavg()[0]
    for r in range(args.rounds):
        for name, fn in methods.items():
            c, t = cpu_seconds(), time.perf_counter()
            tokens[name] = fn()
            times[name].append(time.perf_counter() - t)
            cpu[name].append(cpu_seconds() - c)
            print(f"round {r}: {name}: {times[name][-1]:.2f} s wall, {cpu[name][-1]:.2f} s CPU",
                  flush=True)
    assert len(set(tokens.values())) == 1, f"token totals differ: {tokens}"
    n = next(iter(tokens.values()))
    rate = {k: n / min(v) for k, v in times.items()}  # best round: the least disturbed by others
    ceil, base = rate[next(iter(methods))], rate["baseline (preprocess_data.py style, jsonl)"]
    print(f"\n{len(texts):,} documents, {sum(map(len, texts)) / 1e6:.1f} M characters, {n:,} tokens; "
          f"workers {args.workers}; {args.rounds} rounds; {os.cpu_count()} CPUs "
          f"({platform.processor() or platform.machine()}); "
          f"load average (1 min) before: {load:.2f}, after: {os.getloadavg()[0]:.2f}")
    print("| method | best wall s | tokens/s (best) | vs baseline | vs ceiling | median wall s | "
          "CPU s per M tokens (median) |\n|---|---|---|---|---|---|---|")
    for k in methods:
        print(f"| {k} | {min(times[k]):.2f} | {rate[k]:,.0f} | {rate[k] / base:.2f}x | "
              f"{rate[k] / ceil:.0%} | {statistics.median(times[k]):.2f} | "
              f"{statistics.median(cpu[k]) / n * 1e6:.2f} |")
    print(json.dumps({"tokens": n, "wall_s": times, "cpu_s": cpu, "tokens_per_s": rate}, indent=1))


if __name__ == "__main__":
    from megatron_kappa.entry import start
    start()  # first: the known library notices filtered (megatron_kappa/entry.py)
    main()
