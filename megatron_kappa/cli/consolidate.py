"""Write the full weights of a run's latest checkpoint (or --step's) as one state dict (any training layout).

    python launch/consolidate.py --checkpoint runs/sandwich28 --output full.pt
    python launch/consolidate.py --checkpoint runs/sandwich28 --step 2000 --output full_2000.pt
    python launch/consolidate.py --checkpoint runs/sandwich28/checkpoints/step_2000 --output full_2000.pt

The file loads into any layout with `train.init_weights: full.pt` (or
megatron_kappa.parallel.sharding.load_full_state_dict).
"""
import argparse
import os
import sys

from megatron_kappa.cli_types import add_checkpoint_arguments
from megatron_kappa.config import ConfigError
from megatron_kappa.parallel.launch_env import run_command


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_checkpoint_arguments(ap)
    ap.add_argument("--output", required=True, help="where to write the state dict (.pt); an existing file is "
                                                    "refused unless --force")
    ap.add_argument("--force", action="store_true", help="replace an existing --output file")
    args = ap.parse_args(argv)
    folder = os.path.dirname(os.path.abspath(args.output))
    from megatron_kappa.paths import folder_problem  # a file made and removed there (root, /proc)
    if not os.path.isdir(folder) or folder_problem(folder):  # before reading any checkpoint
        print(f"error: --output: {folder} is not a writable folder", file=sys.stderr)
        return 2
    if os.path.lexists(args.output) and not (args.force and os.path.isfile(args.output)):
        print(f"error: --output: {args.output} exists" + ("" if os.path.isfile(args.output) else " and is not a file")
              + "; choose another path" + (", or --force to replace it" if os.path.isfile(args.output) else ""),
              file=sys.stderr)
        return 2
    import torch

    from megatron_kappa.checkpoint.listing import locate
    from megatron_kappa.evaluation.loading import consolidated_state
    try:  # a step asked for (--step, or a checkpoint folder) is read or refused, never replaced by another
        run_dir, step = locate(args.checkpoint, args.step, need_config=False)
        state = consolidated_state(run_dir, step)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tmp = args.output + ".tmp"
    try:
        torch.save(state, tmp)
        os.replace(tmp, args.output)
    except (OSError, RuntimeError) as e:  # a full disk: torch.save's RuntimeError
        if os.path.exists(tmp):
            os.remove(tmp)
        from megatron_kappa.checkpoint.listing import write_failure
        print(f"error: --output: {args.output}: {write_failure(e, folder)}", file=sys.stderr)
        return 1
    print(f"wrote {args.output}: step {step} of {run_dir}, {len(state)} tensors, "
          f"{sum(t.numel() for t in state.values()):,} values")
    return 0


# what Ctrl-C leaves, said in one line (megatron_kappa/cli/commands.py)
INTERRUPTED = 'the output is written as <output>.tmp and renamed at the end: --output is never half-written'

if __name__ == "__main__":
    run_command(main, INTERRUPTED)
