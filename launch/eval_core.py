"""CORE evaluation of a trained checkpoint (docs/core_eval.md).

    python eval/core.py --checkpoint runs/sandwich28 --bundle eval_bundle.zip [--max-per-task N] [--json out.json]
    torchrun --nproc_per_node 8 eval/core.py ...   (or `deepspeed eval/core.py ...`: items split over ranks)

--bundle takes a folder, a .zip or a URL (downloaded once into --cache-dir). The per-task table goes
to stdout; a malformed bundle prints `error: <file>:<line>: ...` and exits with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from megatron_kappa.config import ConfigError
from megatron_kappa.evaluation import core as core_eval


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="CORE (DCLM in-context-learning tasks, centered) of a checkpoint")
    p.add_argument("--checkpoint", required=True, help="run or checkpoint folder to evaluate")
    p.add_argument("--bundle", required=True,
                   help=f"bundle folder, .zip or URL (nanochat's: {core_eval.NANOCHAT_BUNDLE_URL})")
    p.add_argument("--max-per-task", type=int, default=None,
                   help="evaluate the first N items of each task after the seeded shuffle (default: all)")
    p.add_argument("--baselines", choices=sorted(core_eval.BASELINE_TABLES), default="v1",
                   help="random-baseline table for centering (default v1, as nanochat's bundle)")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--batch-size", type=int, default=32, help="most sequences per forward pass")
    p.add_argument("--max-batch-tokens", type=int, default=16384, help="most padded tokens per forward pass")
    p.add_argument("--cache-dir", help="where a bundle given as a URL is downloaded (default ~/.cache/megatron_kappa)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    return p.parse_args(argv)


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def get_bundle(args):
    """Load the bundle; a URL is downloaded by rank 0 alone so ranks do not race on the cache file."""
    if "://" in args.bundle:
        if is_rank0():
            core_eval.fetch_bundle(args.bundle, args.cache_dir)
        if dist.is_initialized():
            dist.barrier()
    return core_eval.load_bundle(args.bundle, args.cache_dir)


def data_parallel_layout():
    """(rank, world) to split items over: Megatron's data-parallel group when the loader set up
    model parallelism (tensor/expert peers must score the same batches), else every process."""
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        return ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def write_json(path, result):
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=2) + "\n")


def run(args, logits_fn, tokenizer, max_seq_len, bundle=None) -> dict:
    """Everything after the model is loaded: evaluate, print the table, write --json (rank 0)."""
    bundle = bundle if bundle is not None else get_bundle(args)
    dp_rank, dp_world = data_parallel_layout()
    result = core_eval.evaluate_core(
        logits_fn, tokenizer, bundle, max_seq_len, max_per_task=args.max_per_task,
        baselines=args.baselines, batch_size=args.batch_size, max_batch_tokens=args.max_batch_tokens,
        progress=not args.no_progress, dp_rank=dp_rank, dp_world=dp_world)
    result.update(checkpoint=args.checkpoint, bundle=bundle.source, max_per_task=args.max_per_task)
    if is_rank0():
        print(core_eval.format_table(result), flush=True)
        if args.json:
            write_json(args.json, result)
    return result


def run_on_checkpoint(args, evaluate, prepare=lambda: None, errors=()) -> int:
    """The CLIs' frame: join the launcher's group, `prepare()` cheap inputs (so bad ones fail
    before the model loads), load the checkpoint, `evaluate(prepared, logits_fn, tokenizer,
    max_seq_len)`; one-line errors with exit status 2."""
    created = False
    try:
        from megatron_kappa.parallel.launch_env import export_environment
        export_environment()  # RANK & co. from torchrun/deepspeed, or from Slurm under srun
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a launcher's group: join it before work
            from megatron_kappa.parallel.groups import init_process_group, pick_device
            created = init_process_group(pick_device())
        prepared = prepare()
        from megatron_kappa.evaluation.loading import load_for_eval  # the model side, needed only here
        evaluate(prepared, *load_for_eval(args.checkpoint))
    except (FileNotFoundError, ConfigError, *errors) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if created:  # a group someone else made (a test session, a caller) is theirs to end
            dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_on_checkpoint(
        args, lambda bundle, *model: run(args, *model, bundle), prepare=lambda: get_bundle(args),
        errors=(core_eval.BundleError,))


if __name__ == "__main__":
    sys.exit(main())
