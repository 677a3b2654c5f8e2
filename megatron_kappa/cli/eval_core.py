"""CORE evaluation of a trained checkpoint (docs/core_eval.md).

    python eval/core.py --checkpoint runs/sandwich28 --bundle eval_bundle.zip [--max-per-task N] [--json out.json]
    torchrun --nproc_per_node 8 eval/core.py ...   (or `deepspeed eval/core.py ...`: items split over ranks)

--bundle takes a folder, a .zip or a URL (downloaded once into --cache-dir). The per-task table goes
to stdout; a malformed bundle prints `error: <file>:<line>: ...` and exits with status 2.
"""
from __future__ import annotations

import argparse

import torch.distributed as dist

from megatron_kappa.cli_types import add_checkpoint_arguments, positive_int
from megatron_kappa.evaluation import core as core_eval
from megatron_kappa.evaluation.cli import data_parallel_layout, is_rank0, run_on_checkpoint, write_json
from megatron_kappa.parallel.launch_env import run_command


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="CORE (DCLM in-context-learning tasks, centered) of a checkpoint")
    add_checkpoint_arguments(p)
    p.add_argument("--bundle", required=True,
                   help=f"bundle folder, .zip or URL (nanochat's: {core_eval.NANOCHAT_BUNDLE_URL})")
    p.add_argument("--max-per-task", type=positive_int, default=None,
                   help="evaluate the first N items of each task after the seeded shuffle (default: all)")
    p.add_argument("--baselines", choices=sorted(core_eval.BASELINE_TABLES), default="v1",
                   help="random-baseline table for centering (default v1, as nanochat's bundle)")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--batch-size", type=positive_int, default=32, help="most sequences per forward pass")
    p.add_argument("--max-batch-tokens", type=positive_int, default=16384, help="most padded tokens per forward pass")
    p.add_argument("--cache-dir", help="where a bundle given as a URL is downloaded (default ~/.cache/megatron_kappa)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    return p.parse_args(argv)


def get_bundle(args):
    """Load the bundle; a URL is downloaded by rank 0 alone so ranks do not race on the cache file."""
    if "://" in args.bundle:
        if is_rank0():
            core_eval.fetch_bundle(args.bundle, args.cache_dir)
        if dist.is_initialized():
            dist.barrier()
    return core_eval.load_bundle(args.bundle, args.cache_dir)


def run(args, logits_fn, tokenizer, max_seq_len, bundle=None) -> dict:
    """Everything after the model is loaded: evaluate, print the table, write --json (rank 0)."""
    bundle = bundle if bundle is not None else get_bundle(args)
    dp_rank, dp_world = data_parallel_layout()
    result = core_eval.evaluate_core(
        logits_fn, tokenizer, bundle, max_seq_len, max_per_task=args.max_per_task,
        baselines=args.baselines, batch_size=args.batch_size, max_batch_tokens=args.max_batch_tokens,
        progress=not args.no_progress, dp_rank=dp_rank, dp_world=dp_world)
    result.update(checkpoint=str(args.run_dir or args.checkpoint), step=args.step, bundle=bundle.source,
                  max_per_task=args.max_per_task)
    if is_rank0():
        print(core_eval.format_table(result), flush=True)
        if args.json:
            write_json(args.json, result)
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_on_checkpoint(
        args, lambda bundle, *model: run(args, *model, bundle), prepare=lambda: get_bundle(args),
        errors=(core_eval.BundleError,))


# what Ctrl-C leaves, said in one line (megatron_kappa/cli/commands.py)
INTERRUPTED = 'nothing is written until the evaluation ends; run it again'

if __name__ == "__main__":
    run_command(main, INTERRUPTED)
