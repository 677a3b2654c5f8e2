"""One optimizer step of configs/tiny.yaml per plan entry, on every rank, with the gradients that
reach the update compared to an independent float64 reference (tests/test_grad_accum.py):

    deepspeed --num_gpus 2 tests/support/grad_accum_worker.py PLAN.json OUT.json

PLAN: a list of entries, each a list of config overrides or {"overrides": [...], "merge_fix": false}.

The reference: a tensor hook on every parameter records each backward's gradient as autograd
hands it over (bf16 under precision bf16), summed here in float64 over the micro-batches and
all-reduced in float64 over the parameter's data-parallel group (the expert-data-parallel one for
experts), divided by the dense data-parallel size (DeepSpeed's and megatron's averaging). What the
update sees: the fp32 partition gradient the AdamW groups step with (ZeRO's `_optimizer_step`),
and the whole gradient each Muon/Aurora call receives (the patched `muon_update`). OUT gets, per
entry, the largest relative error ‖got − ref‖ / ‖ref‖ over the parameters, and the dtypes seen.
"""
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import torch.distributed as dist

from megatron_kappa.config import load_config
from megatron_kappa.parallel import engine
from megatron_kappa.parallel.launch_env import exit_process
from megatron_kappa.train import loop


def case(overrides, merge_fix=True):
    """One entry: its overrides; `merge_fix` False runs it without grad_precision's item 4 (the
    upstream merge that drops AdamW gradients under ZeRO-2 beside Muon groups: a control)."""
    import functools

    from deepspeed.runtime.zero.muon import original_muon
    from megatron.core import parallel_state as ps

    from megatron_kappa.optim import muon
    from megatron_kappa.parallel import grad_precision
    local, worst, dtypes, muon_grads = {}, [0.0], set(), []
    original = engine.initialize

    def reference(model, name, p):
        group = ps.get_expert_data_parallel_group() if not getattr(p, "allreduce", True) \
            else ps.get_data_parallel_group()
        ref = local.get(name, torch.zeros(p.shape, dtype=torch.float64))
        dist.all_reduce(ref, group=group)
        return ref / ps.get_data_parallel_world_size()

    def record(got, ref, name=""):
        err = ((got.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        if err > 1e-3 and os.environ.get("GRAD_ACCUM_DEBUG"):
            print("DEBUG", dist.get_rank(), name, err, got.double().norm().item(), ref.norm().item(), flush=True)
        worst[0] = max(worst[0], err)

    def started(model, groups_, settings, grad_accum, build):
        names = {id(p): n for n, p in model.named_parameters()}
        for n, p in model.named_parameters():
            p.register_hook(lambda g, n=n: local.__setitem__(n, local.get(n, 0) + g.detach().double()) or g)
        eng, zero = original(model, groups_, settings, grad_accum, build)
        update = original_muon.muon_update

        def spy(grad, momentum, *a, **k):
            muon_grads.append(grad.detach().clone())
            dtypes.add(("muon", str(grad.dtype), str(momentum.dtype)))
            return update(grad, momentum, *a, **k)
        if any(g.get("use_muon") for g in groups_):
            muon.install(spy)
        step = zero._optimizer_step

        refs = {}

        def optimizer_step(group_no):
            if not refs:  # every rank reduces every parameter once, in the model's order
                refs.update({n: reference(model, n, p) for n, p in model.named_parameters()})
            params = [p for p in zero.params_in_partition[group_no]]
            if zero.optimizer.param_groups[group_no].get("use_muon"):
                # ZeRO called the update for each Muon group's partition parameters, in order
                for p, got in zip(params, muon_grads[:len(params)]):
                    record(got, refs[names[id(p)]], names[id(p)])
                del muon_grads[:len(params)]
            else:
                flat = zero.single_partition_of_fp32_groups[group_no].grad
                dtypes.add(("adamw", str(flat.dtype)))
                for p in params:
                    lp, hp = p._hp_mapping.lp_fragment_address, p._hp_mapping.hp_fragment_address
                    ref = refs[names[id(p)]].view(-1).narrow(0, lp.start, lp.numel)
                    record(flat.narrow(0, hp.start, hp.numel), ref, names[id(p)])
            return step(group_no)
        zero._optimizer_step = optimizer_step
        return eng, zero
    engine.initialize = started
    keep_fp32 = grad_precision.keep_fp32
    grad_precision.keep_fp32 = functools.partial(keep_fp32, merge_fix=merge_fix)
    try:
        loop.run(load_config("configs/tiny.yaml", overrides), log=lambda *a, **k: None)
    finally:
        engine.initialize = original
        grad_precision.keep_fp32 = keep_fp32
        muon.uninstall()
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (worst[0], sorted(dtypes)))
    return {"worst": max(w for w, _ in every), "dtypes": sorted({d for _, ds in every for d in ds})}


def main(plan_path, out_path):
    from megatron_kappa.parallel import groups
    results = [case(**entry) if isinstance(entry, dict) else case(entry)
               for entry in json.loads(Path(plan_path).read_text())]
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    # as launch/pretrain.py ends: a barrier, then every group's threads joined before the exit (a
    # rank that left first took the store with it: the other aborted, "terminate called ...")
    groups.teardown()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    main(*args)
    exit_process(0)
