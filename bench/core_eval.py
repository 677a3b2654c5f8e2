"""Throughput of the batched CORE scorer vs one forward pass per choice, same model and tasks, one run.

    OMP_NUM_THREADS=1 python bench/core_eval.py [--items 48] [--device cpu|cuda] [--dim 128]

The tasks are made up on the fly in the bundle format (4-choice multiple choice with 5 shots,
2-option schema, language modeling with 5 shots) so the prompt lengths resemble CORE's; the model is
a small random causal transformer (megatron_kappa/bench/toy.py, the tests' stand-in model). Both evaluators run
megatron_kappa.core_eval with
the same scoring code: batch_size=1 is the one-forward-per-choice baseline. Prints markdown rows
for docs/benchmarks.md and whether both made the same decisions.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

from megatron_kappa.entry import start

start()  # first: the known library notices filtered before the imports below can print (megatron_kappa/entry.py)

import torch  # noqa: E402

from megatron_kappa.bench.toy import ByteTokenizer, TinyCausalLM  # noqa: E402
from megatron_kappa.evaluation import core as core_eval  # noqa: E402

WORDS = ("the a of river stone light quick green small city over under paper seven bright cold "
         "music garden window engine forest yellow silent market winter letter animal").split()


def sentence(rng, lo, hi):
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def make_bundle(root: Path, items: int, seed=0) -> Path:
    rng = random.Random(seed)
    tasks = {
        "hellaswag": ("multiple_choice", 5, " ", lambda: {
            "query": sentence(rng, 12, 24), "choices": [sentence(rng, 4, 10) for _ in range(4)],
                                                          "gold": rng.randrange(4)}),
        "winogrande": ("schema", 0, " ", lambda: {
            "context_options": [sentence(rng, 8, 14) for _ in range(2)], "continuation": sentence(rng, 3, 6),
            "gold": rng.randrange(2)}),
        "squad": ("language_modeling", 5, "\nAnswer: ", lambda: {
            "context": sentence(rng, 15, 30), "continuation": sentence(rng, 1, 3)}),
    }
    lines = ["icl_tasks:"]
    for label, (kind, shots, delim, make) in tasks.items():
        (root / "eval_data").mkdir(parents=True, exist_ok=True)
        (root / "eval_data" / f"{label}.jsonl").write_text("".join(json.dumps(make()) + "\n" for _ in range(items)))
        lines += [f"- label: {label}", f"  dataset_uri: {label}.jsonl", f"  num_fewshot: [{shots}]",
                  f"  icl_task_type: {kind}", f"  continuation_delimiter: {json.dumps(delim)}"]
    (root / "core.yaml").write_text("\n".join(lines) + "\n")
    return root


def timed(model, tok, bundle, max_seq_len, batch_size, device):
    start = time.perf_counter()
    out = [core_eval.evaluate_task(model, tok, t, max_seq_len, batch_size=batch_size, device=device)
           for t in bundle.tasks]
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=48, help="items per task")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--max-seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, nargs="+", default=[4, 32], help="batched evaluator sizes to time")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    tok = ByteTokenizer()
    model = TinyCausalLM(dim=args.dim, layers=args.layers, max_seq_len=args.max_seq_len).to(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        bundle = core_eval.load_bundle(make_bundle(Path(tmp), args.items))
    n_items = sum(len(t.examples) for t in bundle.tasks)
    for size in (1, *args.batch_size):  # warm-up: first calls pay for allocations and kernel choice
        core_eval.evaluate_task(model, tok, bundle.tasks[0], args.max_seq_len, 8, size, device=args.device)
    t_one, one = timed(model, tok, bundle, args.max_seq_len, 1, args.device)
    name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} thread(s)"
    print(f"items: {n_items} ({args.items} per task, 3 tasks)  model: dim {args.dim}, {args.layers} layers, "
          f"context {args.max_seq_len}  device: {name}")
    print(f"one forward per choice: {n_items / t_one:8.1f} items/s  ({t_one:.2f} s)")
    rows = []
    for size in args.batch_size:
        t_batch, batched = timed(model, tok, bundle, args.max_seq_len, size, args.device)
        differ = sum(a != b for x, y in zip(one, batched) for a, b in zip(x["correct"], y["correct"]))
        print(f"batched, batch {size:<3}:      {n_items / t_batch:8.1f} items/s  ({t_batch:.2f} s)  "
              f"speed-up {t_one / t_batch:.2f}x  items decided differently: {differ} of {n_items}")
        rows.append(f"| {name} | dim {args.dim}, {args.layers} layers, ctx {args.max_seq_len} | {n_items} | "
                    f"{n_items / t_one:.1f} | {size} | {n_items / t_batch:.1f} | {t_one / t_batch:.2f}x | {differ} |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
