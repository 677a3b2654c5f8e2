"""Trainings with QK-Clip in one two-process launch (tests/test_qk_clip.py):

    deepspeed --num_gpus 2 tests/support/qk_clip_worker.py PLAN.json

PLAN is a list of {"overrides": [...], "local_max": false}: a `megatron_kappa.train.run` of
configs/tiny.yaml each; "local_max" is the negative control: each rank clips from its own
micro-batches' maxima (a group of one process) instead of the data-parallel MAX.
"""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist

from megatron_kappa.config import load_config
from megatron_kappa.optim import qk_clip
from megatron_kappa.parallel import groups
from megatron_kappa.parallel.launch_env import exit_process
from megatron_kappa.train import loop


def main(plan_path):
    plan = json.loads(Path(plan_path).read_text())
    clip = qk_clip.clip
    for case in plan:
        if case.get("local_max"):
            def local(model, group=None, clip=clip):
                if not hasattr(local, "alone"):  # every rank makes every one-rank group, in order
                    alone = [dist.new_group([r]) for r in range(dist.get_world_size())]
                    local.alone = alone[dist.get_rank()]
                return clip(model, group=local.alone)
            qk_clip.clip = local
        loop.run(load_config("configs/tiny.yaml", case["overrides"]), log=lambda *a, **k: None)
        qk_clip.clip = clip
    groups.teardown()


if __name__ == "__main__":
    main([a for a in sys.argv[1:] if not a.startswith("--local_rank")][0])
    exit_process(0)
