"""Validation loss and bits per byte of a trained checkpoint on held-out Megatron shards.

    python eval/loss.py --checkpoint runs/sandwich28 --data data/val/shard_00000 [more prefixes] [--max-tokens N]
    torchrun --nproc_per_node 8 eval/loss.py ...   (batches split over ranks)

--data takes shard prefixes (PREFIX.bin + PREFIX.idx). See megatron_kappa/evaluation/lm_loss.py for the rules.
"""
from __future__ import annotations

import argparse

from megatron_kappa.cli_types import add_checkpoint_arguments, positive_int
from megatron_kappa.evaluation.cli import data_parallel_layout, is_rank0, run_on_checkpoint, write_json
from megatron_kappa.evaluation.lm_loss import validation_loss
from megatron_kappa.parallel.launch_env import run_command


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="validation loss and bits per byte of a checkpoint")
    add_checkpoint_arguments(p)
    p.add_argument("--data", required=True, nargs="+", help="held-out shard prefixes")
    p.add_argument("--seq-len", type=positive_int, default=None, help="window length (default: the model's context)")
    p.add_argument("--max-tokens", type=positive_int, default=None,
                   help="score at most this many tokens (default: all)")
    p.add_argument("--batch-size", type=positive_int, default=8, help="windows per forward pass")
    p.add_argument("--json", help="also write the result to this JSON file")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def run(args, logits_fn, tokenizer, max_seq_len) -> dict:
    dp_rank, dp_world = data_parallel_layout()
    seq_len = min(args.seq_len or max_seq_len, max_seq_len)
    result = validation_loss(logits_fn, args.data, tokenizer, seq_len, args.max_tokens, args.batch_size,
                             dp_rank, dp_world, progress=not args.no_progress)
    result.update(checkpoint=str(args.run_dir or args.checkpoint), step=args.step, data=args.data, seq_len=seq_len)
    if is_rank0():
        print(f"loss {result['loss']:.4f}  bits/byte {result['bits_per_byte']:.4f}  "
              f"tokens {result['tokens']}  bytes {result['bytes']}", flush=True)
        if args.json:
            write_json(args.json, result)
    return result


def check_data(args):
    """Before the model loads: the shards are whole, their token ids fit the checkpoint's
    vocabulary (shards made with a larger tokenizer would index past it), and their manifest
    names the run's tokenizer."""
    from megatron_kappa.checkpoint.listing import run_of
    from megatron_kappa.config import ConfigError, load_recorded
    from megatron_kappa.preflight import check_shard
    config = run_of(args.checkpoint, args.step)[0] / "config.yaml"
    cfg = load_recorded(config) if config.is_file() else None
    model = cfg.model if cfg is not None else None
    vocab = model.vocab_size if model is not None else None
    if model is not None and args.seq_len is not None and args.seq_len > model.seq_length:  # it was clamped silently
        raise ConfigError(f"--seq-len: {args.seq_len} is longer than the model's context (model.seq_length "
                          f"{model.seq_length} in {config}); give at most that, or leave it out")
    for prefix in args.data:
        check_shard("--data", prefix, vocab)
    if cfg is not None and cfg.data.tokenizer:  # another tokenizer's ids: a wrong loss and bits per byte
        from megatron_kappa.data.made_with import check_made_with
        check_made_with(cfg.data.tokenizer, args.data, "--data", "--data: the run's data.tokenizer")


def main(argv=None) -> int:
    args = parse_args(argv)
    return run_on_checkpoint(args, lambda _, *model: run(args, *model), prepare=lambda: check_data(args))


# what Ctrl-C leaves, said in one line (megatron_kappa/cli/commands.py)
INTERRUPTED = 'nothing is written until the evaluation ends; run it again'

if __name__ == "__main__":
    run_command(main, INTERRUPTED)
