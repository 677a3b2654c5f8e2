"""What the evaluation command lines (eval/core.py, eval/loss.py) share: join the
launcher's process group, load a checkpoint, split the work over data-parallel ranks, write the
result on rank 0, and leave the group so that every rank exits cleanly."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

from megatron_kappa.config import ConfigError


def is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


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


def run_on_checkpoint(args, evaluate, prepare=lambda: None, errors=()) -> int:
    """The CLIs' frame: join the launcher's group, `prepare()` cheap inputs (so bad ones fail
    before the model loads), find the checkpoint (`args.checkpoint`, `args.step`: args.run_dir
    and args.step become the run and the step read), load it, `evaluate(prepared, logits_fn, tokenizer,
    max_seq_len)`; one-line errors with exit status 2."""
    ours = not dist.is_initialized()  # else a group someone else made (a test, a caller): theirs to end
    finished = False
    try:
        from megatron_kappa.parallel.launch_env import export_environment
        export_environment()  # RANK & co. from torchrun/deepspeed, or from Slurm under srun
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # a launcher's group: join it before work
            from megatron_kappa.parallel.groups import init_process_group, pick_device
            init_process_group(pick_device())
        json_path = getattr(args, "json", None)
        if json_path:  # checked now, not after the whole evaluation ran
            from megatron_kappa.paths import output_file_problem
            problem = output_file_problem(json_path)
            if problem:
                raise ConfigError(f"--json: {problem}")
        prepared = prepare()
        # which checkpoint: a step asked for is read or refused, never replaced by another
        from megatron_kappa.checkpoint.listing import locate
        args.run_dir, args.step = locate(args.checkpoint, getattr(args, "step", None))
        from megatron_kappa.evaluation.loading import load_for_eval  # the model side, needed only here
        evaluate(prepared, *load_for_eval(args.run_dir, args.step))  # the model is dropped when this returns
        finished = True
    except (FileNotFoundError, ConfigError, *errors) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if ours and dist.is_initialized():  # also the world of one that loading made
            from megatron_kappa.parallel.groups import teardown
            teardown(peers_alive=finished)
    return 0
