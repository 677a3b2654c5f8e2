"""Continue a prompt with a trained model: greedy by default, or sampled.

    python eval/generate.py --checkpoint runs/sandwich28 --prompt "The capital of France is"
    python eval/generate.py --checkpoint runs/sandwich28 --prompt "Once" --temperature 0.8 --top-p 0.95
    python eval/generate.py --checkpoint runs/sandwich28 --step 2000 --prompt "..."   (an earlier checkpoint)
    python eval/generate.py --checkpoint runs/sandwich28 --weights full.pt --prompt "..."   (consolidated)

One process: a checkpoint in any training layout is consolidated for it. A key/value cache keeps
each new token one forward of one position (megatron_kappa/evaluation/generation.py).
"""
from __future__ import annotations

import argparse
import sys

from megatron_kappa.cli_types import add_checkpoint_arguments, non_negative_float, positive_int
from megatron_kappa.parallel.launch_env import run_command


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="continue a prompt with a trained model")
    add_checkpoint_arguments(p)  # a checkpoint of any training layout
    p.add_argument("--weights", help="a consolidated state dict (launch/consolidate.py) to use instead of the "
                                     "run's checkpoints; the run directory gives the config and tokenizer")
    p.add_argument("--prompt", required=True, action="append", help="text to continue (repeat for several)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64)
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=float, default=1.0, help="sample among the smallest set reaching probability p")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write prompts, token ids and texts to this JSON file")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from megatron_kappa.evaluation.generation import Sampling
    sampling = Sampling(args.temperature, args.top_k, args.top_p, args.seed)
    try:
        sampling.check()  # before the model loads
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    import os
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        print("error: eval/generate.py runs as one process (any training layout is consolidated for it)",
              file=sys.stderr)
        return 2
    from megatron_kappa.config import ConfigError
    from megatron_kappa.evaluation.cli import write_json
    from megatron_kappa.evaluation.generation import generate
    from megatron_kappa.evaluation.loading import load_model
    from megatron_kappa.parallel.groups import teardown
    from megatron_kappa.tokenizer import Tokenizer
    if args.json:  # checked now, not after every prompt was continued
        from megatron_kappa.paths import output_file_problem
        problem = output_file_problem(args.json)
        if problem:
            print(f"error: --json: {problem}", file=sys.stderr)
            return 2
    try:
        if args.weights is None:  # which checkpoint: a step asked for is read or refused, never replaced
            from megatron_kappa.checkpoint.listing import locate
            args.run_dir, args.step = locate(args.checkpoint, args.step)
        model, cfg = load_model(args.run_dir or args.checkpoint, args.weights, args.step)
        if not cfg.data.tokenizer:
            raise ConfigError(f"--checkpoint: {args.checkpoint}/config.yaml: data.tokenizer is not set")
        tokenizer = Tokenizer(cfg.data.tokenizer)
    except (ConfigError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    prompts = [([tokenizer.bos] if cfg.data.bos else []) + tokenizer.encode(text) for text in args.prompt]
    for text, prompt in zip(args.prompt, prompts):  # all checked before any is continued
        if not prompt:  # generation's ValueError traceback, it was
            print(f"error: --prompt: {text!r} has no tokens, and this model's documents start without a BOS token "
                  "(data.bos false) to continue from: give some text", file=sys.stderr)
            teardown(peers_alive=True)
            return 2
        if len(prompt) >= cfg.model.seq_length:  # no room for a new token: it used to return none, silently
            print(f"error: --prompt: {text[:40]!r}{'…' if len(text) > 40 else ''} is {len(prompt)} tokens; the "
                  f"model's context (model.seq_length) is {cfg.model.seq_length}: shorten it", file=sys.stderr)
            teardown(peers_alive=True)
            return 2
    results = []
    try:
        for text, prompt in zip(args.prompt, prompts):
            ids = generate(model, prompt, args.max_new_tokens, cfg.model.vocab_size, sampling, stop=tokenizer.eod,
                           max_length=cfg.model.seq_length)
            continuation = tokenizer.decode([t for t in ids if t != tokenizer.eod])
            print(f"{text}\033[1m{continuation}\033[0m" if sys.stdout.isatty() else text + continuation, flush=True)
            results.append({"prompt": text, "prompt_ids": prompt, "ids": ids, "text": continuation})
    finally:
        model = None  # dropped before the process group is left
        teardown(peers_alive=True)
    if args.json:
        write_json(args.json, {"checkpoint": str(args.run_dir or args.checkpoint), "step": args.step,
                               "weights": args.weights, "sampling": vars(sampling), "results": results})
    return 0


# what Ctrl-C leaves, said in one line (megatron_kappa/cli/commands.py)
INTERRUPTED = 'the continuations printed above are complete; --json is written only at the end'

if __name__ == "__main__":
    run_command(main, INTERRUPTED)
