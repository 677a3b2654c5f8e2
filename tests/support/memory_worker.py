"""Trains one step of each case in a plan and records what every rank holds after it: the bytes
of the model's parameters and of every other live tensor, by storage (rank 0 writes OUT):

    deepspeed --num_gpus N tests/support/memory_worker.py PLAN.json OUT.json   (or torchrun)

PLAN: a list of {"name", "overrides"} (configs/tiny.yaml). Each case's first step is counted as
its gradients reach DeepSpeed, as ZeRO's step begins, inside the torch optimizer's step and after
it (count_first_step); by the time gradients reach DeepSpeed the activations are gone."""
import gc
import json
import shutil
import sys
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_kappa.config import load_config
from megatron_kappa.parallel import groups
from megatron_kappa.parallel.launch_env import exit_process
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


def census(model, exclude: set, zero=None) -> dict:
    """Bytes of the model's parameters, of every other live storage not in `exclude`, and of the
    gradient storages among those (`zero`'s: gradient_storages). A gradient that only autograd
    holds has no Python object for the garbage collector to find: those come from the
    parameters' .grad."""
    grads = gradient_storages(zero, model) if zero is not None else {}
    storages = {ptr: n for ptr, n in (live_storages() | grads).items() if ptr not in exclude}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights = sum(storages.pop(ptr, 0) for ptr in params)
    out = {"weights": weights, "other": sum(storages.values())}
    if zero is not None:
        out["gradients"] = sum(storages.get(ptr, 0) for ptr in grads)
    return out


def settled_census(model, exclude: set, zero, still: float = 0.5, seconds: float = 10.0) -> dict:
    """census() once what other threads let go of is gone: the smallest count over samples every
    0.1 s, until it has not changed for `still` seconds (at most `seconds`). This thread is in
    DeepSpeed's step and holds it there, so nothing DeepSpeed holds can go in the meantime; what
    does go was held by another thread, such as a finished gloo collective's tensor that its worker
    thread had not yet released. (Once, in CI under load, 15.6 MB more than the master copy was
    counted at the step: the whole model's size in bf16. Three runs beside two busy cores did not
    show it again; this wait is the guard, not a proven cause.)"""
    deadline, best, since = time.monotonic() + seconds, None, time.monotonic()
    while True:
        gc.collect()
        now = census(model, exclude, zero)
        if best is None or now["other"] < best["other"]:
            best, since = now, time.monotonic()
        if time.monotonic() - since >= still or time.monotonic() > deadline:
            return best
        time.sleep(0.1)


def reduce_buckets(zero) -> list:
    """DeepSpeed's reduce bucket buffers (allocated at a backward pass's first gradient hook)."""
    return [b for bucket in zero.ipg_buckets.values() for b in bucket.buffer]


def gradient_storages(zero, model) -> dict:
    """data_ptr → bytes of every storage that holds gradients: the parameters' .grad, ZeRO-1's fp32
    accumulators under fp32 accumulation (`grad_accum`), DeepSpeed's reduce bucket, its gradient
    partition (`grads_in_partition`, or by the step the views of it that `averaged_gradients`
    lists: under fp32 accumulation, views of an fp32 partition) and the fp32 gradients of its fp32
    partitions."""
    tensors = [p.grad for p in model.parameters()] + [getattr(p, "grad_accum", None) for p in model.parameters()]
    tensors += reduce_buckets(zero)
    tensors += [zero.grads_in_partition]
    tensors += [t for grads in zero.averaged_gradients.values() if grads is not None for t in grads]
    tensors += [p.grad for p in zero.single_partition_of_fp32_groups]
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}


def deepspeed_edges(zero) -> int:
    """Elements of DeepSpeed's gradient partition past this rank's share: the partition holds
    whole tensors, so the tensors across its edges come in full (the share excludes the last
    rank's padding). The partition is one buffer; by the step only the views of it that
    `averaged_gradients` lists keep it."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() // t.element_size()
                for grads in zero.averaged_gradients.values() if grads is not None for t in grads}
    share = sum(int(size) - int(pad) for size, pad in zip(zero.partition_size, zero.groups_padding))
    return sum(storages.values()) - share


def count_first_step(engine, model, earlier: set, counts: dict):
    """Wraps DeepSpeed's ZeRO optimizer so that its first step is counted:
      backward    as the last gradient of a backward pass reaches DeepSpeed's hook (the larger
                  count over the micro-batches), with the reduce bucket's bytes;
      at_step     as ZeRO's step begins (gradients reduced into the partitions), with the
                  partitions' edges and each group's partition size;
      in_step     the largest count as the torch optimizer steps each group's fp32 partition;
      freeing     the largest count as ZeRO's step frees a group's gradients (after it made the
                  group's fp32 gradient, before it lets go of the partition it came from);
    and returns a function that undoes the wrapping."""
    zero = engine.optimizer
    originals = {}

    def wrap(owner, name, before):
        original = originals[(owner, name)] = getattr(owner, name)

        def counted(*a, **k):
            before()
            return original(*a, **k)
        setattr(owner, name, counted)

    hooks = sum(p.requires_grad for group in zero.bit16_groups for p in group)
    fired = [0]

    def backward(*_):
        """Before DeepSpeed takes the last gradient of a backward pass: every gradient made."""
        fired[0] += 1
        if fired[0] % hooks == 0:
            gc.collect()
            now = census(model, earlier, zero)
            if now["gradients"] > counts.get("backward", {"gradients": -1})["gradients"]:
                counts["backward"] = now
                counts["bucket"] = sum(b.untyped_storage().nbytes() for b in reduce_buckets(zero))
                counts["_bucket_storages"] = {b.untyped_storage().data_ptr(): b.untyped_storage().nbytes()
                                              for b in reduce_buckets(zero)}

    def at_step():
        counts["at_step"] = settled_census(model, earlier, zero)
        # a reduce bucket still held (ZeRO-1 under fp32 accumulation: the accumulators point into
        # it until the step ends); a bucket is new each backward, so it is known by its size
        counts["bucket_at_step"] = sum(n for n in gradient_storages(zero, model).values() if n == counts.get("bucket"))
        counts["edges"] = deepspeed_edges(zero)
        counts["groups"] = [int(size) for size in zero.partition_size]
        counts["muon_groups"] = [bool(g.get("use_muon")) for g in zero.optimizer.param_groups]
        counts["stage"] = ps.get_pipeline_model_parallel_rank()

    def freeing(*_):
        if "at_step" not in counts:  # ZeRO's step only
            return
        gc.collect()
        now = census(model, earlier, zero)
        if now["gradients"] > counts.get("freeing", {"gradients": -1})["gradients"]:
            counts["freeing"] = now

    def in_step():
        gc.collect()
        now = census(model, earlier, zero)
        if now["gradients"] > counts.get("in_step", {"gradients": -1})["gradients"]:
            counts["in_step"] = now
    wrap(zero, "process_gradients", backward)  # DeepSpeed's hook on each parameter's gradient
    wrap(zero, "step", at_step)
    wrap(zero.optimizer, "step", in_step)  # the torch optimizer, called once per group
    wrap(zero, "free_grad_in_param_list", freeing)

    def undo():
        for (owner, name), original in originals.items():
            setattr(owner, name, original)
    return undo


def settle(buckets: dict, seconds: float = 30.0):
    """Wait (a bounded time) until DeepSpeed's reduce bucket, released after backward, is gone: on
    the CPU a gloo collective still in flight on another thread may hold it a while after
    DeepSpeed lets go (seen once under load: 1 GB counted after the step). One that outlives the
    wait is counted, and the test fails as it should."""
    deadline = time.monotonic() + seconds
    while True:
        gc.collect()
        alive = live_storages()
        if not any(alive.get(ptr) == nbytes for ptr, nbytes in buckets.items()) or time.monotonic() > deadline:
            return
        time.sleep(0.1)


def main(plan_path, out_path):
    # The census walks every object the collector tracks, and gc.collect() does too: with torch,
    # megatron-core and DeepSpeed imported, about 0.3 s each, 40 times a case. What the imports made
    # is frozen out of both (it holds no tensor a case makes, and the census excludes what was
    # there before a case anyway): the suite's slowest fixture ran 2× faster.
    gc.collect()
    gc.freeze()
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
            undo = count_first_step(engine, model, earlier, counts) if not counts else None
            out = original(engine, model, *a, **k)
            if undo is not None:
                undo()
                settle(counts.pop("_bucket_storages", {}))
                counts["after_step"] = census(model, earlier)  # the moments made, the gradients freed
            return out
        loop.train_step = step_and_count
        cfg = load_config("configs/tiny.yaml", case["overrides"])
        loop.run(cfg, log=lambda *a, **k: None)
        del kept_alive
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, counts)
        results[case["name"]] = every
        if dist.get_rank() == 0:  # its checkpoint is not read: the cases' checkpoints held 2-3 GB of disk at once
            shutil.rmtree(cfg.run.dir, ignore_errors=True)
    loop.train_step = original
    if dist.get_rank() == 0:
        json.dump(results, open(out_path, "w"))
    groups.teardown()


if __name__ == "__main__":
    main(*[a for a in sys.argv[1:] if not a.startswith("--local_rank")][:2])
    exit_process(0)
