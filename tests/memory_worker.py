"""Trains one step of each case in a plan and records what every rank holds after it: the bytes
of the model's parameters and of every other live tensor, by storage (rank 0 writes OUT):

    deepspeed --num_gpus N tests/memory_worker.py PLAN.json OUT.json   (or torchrun)

PLAN: a list of {"name", "overrides"} (configs/tiny.yaml). The count after the first optimizer
step holds the weights, DeepSpeed's gradient buffers and partitions, the fp32 master copy, the
optimizer moments and the buckets; the activations are gone by then."""
import gc
import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_kappa.config import load_config
from megatron_kappa.parallel import groups
from megatron_kappa.train import loop


def live_tensors() -> dict:
    """data_ptr → one live tensor (not on the meta device) of every storage in use."""
    out = {}
    for obj in gc.get_objects():
        try:
            if not isinstance(obj, torch.Tensor) or obj.is_meta:
                continue
            ptr = obj.untyped_storage().data_ptr()
        except (RuntimeError, ReferenceError):
            continue
        if ptr and (ptr not in out or obj.untyped_storage().nbytes() > out[ptr].untyped_storage().nbytes()):
            out[ptr] = obj
    return out


def live_storages() -> dict:
    """data_ptr → bytes of every storage a live tensor holds."""
    return {ptr: t.untyped_storage().nbytes() for ptr, t in live_tensors().items()}


def census(model, exclude: set) -> dict:
    """Bytes of the model's parameters, and of every other live storage not in `exclude`."""
    storages = {ptr: n for ptr, n in live_storages().items() if ptr not in exclude}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights = sum(storages.pop(ptr, 0) for ptr in params)
    return {"weights": weights, "other": sum(storages.values())}


def main(plan_path, out_path):
    results = {}
    original = loop.train_step
    for case in json.load(open(plan_path)):
        counts = {}
        gc.collect()
        # what an earlier case left behind is not this case's; holding it keeps its addresses from
        # being reused by this case's storages (exclusion is by address)
        kept_alive = live_tensors()
        earlier = set(kept_alive)

        def step_and_count(engine, model, *a, **k):
            """The first step, counted three times: as ZeRO's step begins (gradients reduced),
            as it hands the fp32 partitions and their gradients to the torch optimizer, and after
            the step (the moments allocated, the gradients freed)."""
            if not counts:
                step = engine.optimizer.step

                def counted_step(*sa, **sk):
                    gc.collect()
                    counts["at_step"] = census(model, earlier)
                    counts["stage"] = ps.get_pipeline_model_parallel_rank()
                    return step(*sa, **sk)
                engine.optimizer.step = counted_step
                inner = engine.optimizer.optimizer  # the torch optimizer ZeRO steps on its fp32 partitions
                inner_step = inner.step

                def counted_inner_step(*sa, **sk):
                    if "in_step" not in counts:
                        gc.collect()
                        counts["in_step"] = census(model, earlier)
                    return inner_step(*sa, **sk)
                inner.step = counted_inner_step
            out = original(engine, model, *a, **k)
            if "after_step" not in counts:
                engine.optimizer.step, inner.step = step, inner_step
                gc.collect()
                counts["after_step"] = census(model, earlier)
            return out
        loop.train_step = step_and_count
        loop.run(load_config("configs/tiny.yaml", case["overrides"]), log=lambda *a, **k: None)
        del kept_alive
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, counts)
        results[case["name"]] = every
    loop.train_step = original
    if dist.get_rank() == 0:
        json.dump(results, open(out_path, "w"))
    groups.teardown()


if __name__ == "__main__":
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")][:2])
