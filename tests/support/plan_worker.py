"""Builds the model of every layout in a plan on the meta device, on every rank of a torchrun
world, and writes each rank's parameter counts by kind (rank 0 writes OUT):

    torchrun --nproc_per_node 8 tests/support/plan_worker.py PLAN.json OUT.json

PLAN: a list of {"name", "overrides"}; each is configs/tiny.yaml with those overrides. A case with
"rows": true is also built for real and runs one forward and backward of a micro-batch: each rank
then reports the rows its routed experts received in each MoE layer (what megatron's dispatcher
delivered) and the messages it sent on the dispatcher's groups."""
import json
import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from megatron_kappa.config import load_config
from megatron_kappa.model.build import build_model
from megatron_kappa.parallel import groups
from megatron_kappa.parallel.launch_env import exit_process


def kind(name: str) -> str:
    """The planner's kind of a parameter (plan.KINDS), by its name."""
    if "word_embeddings" in name:
        return "embedding"
    if name.startswith("output_layer"):
        return "output"
    if "layernorm" in name or "final_norm" in name or name.endswith(("resid_lambda", "x0_lambda", "enorm.weight",
                                                                      "hnorm.weight")):
        return "norm"
    if name.endswith("eh_proj.weight"):  # model.mtp's projection: the planner counts it with the attention matrices
        return "attention"
    if name.endswith("self_attention.value_embedding"):
        return "value_embedding"
    if ".self_attention." in name:
        return "attention"
    if ".mlp.router." in name:
        return "router"
    if ".mlp.experts." in name:
        return "kappa" if "kappa_" in name else "experts"
    if ".mlp.shared_experts." in name:
        return "shared_experts"
    if ".mlp." in name:
        return "dense_mlp"
    raise ValueError(f"no kind for {name}")


COLLECTIVES = ("all_to_all_single", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
               "reduce_scatter", "all_reduce", "_all_gather_base", "_reduce_scatter_base")


def dispatch_census(cfg) -> dict:
    """One forward and backward of a micro-batch (the same tokens on every rank): the rows each
    MoE layer's experts received on this rank (read at the experts' input: what megatron's
    dispatcher delivered), and the messages this rank sent on the dispatcher's groups (EP, expert
    TP, and the two together): each collective call on a group of n ranks counts n - 1."""
    from megatron.core.tensor_parallel import layers, mappings
    torch.manual_seed(5)
    model = build_model(cfg, device="cpu")
    rows = []
    for name, module in model.named_modules():
        if name.endswith(".mlp.experts"):
            module.register_forward_pre_hook(lambda _, args: rows.append(int(args[0].shape[0])))
    groups_of_dispatcher = {ps.get_expert_model_parallel_group(), ps.get_expert_tensor_parallel_group(),
                            ps.get_expert_tensor_and_model_parallel_group()}
    tensor_group = ps.get_tensor_model_parallel_group()
    messages = [0]
    tensor_messages = [0]
    originals = {}

    def counted(fn):
        def call(*args, group=None, **kwargs):
            if group in groups_of_dispatcher:
                messages[0] += dist.get_world_size(group) - 1
            elif group is tensor_group:
                tensor_messages[0] += dist.get_world_size(group) - 1
            return fn(*args, group=group, **kwargs)
        return call
    for name in COLLECTIVES:
        originals[(dist, name)] = getattr(dist, name)
        setattr(dist, name, counted(getattr(dist, name)))
    for owner in (mappings, layers):  # bound at megatron's import
        for name in ("dist_all_gather_func", "dist_reduce_scatter_func"):
            originals[(owner, name)] = getattr(owner, name)
            setattr(owner, name, counted(getattr(owner, name)))
    try:
        tokens = torch.randint(cfg.model.vocab_size, (cfg.train.micro_batch, cfg.model.seq_length),
                               generator=torch.Generator().manual_seed(0))
        labels = torch.roll(tokens, -1, dims=1)
        model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None, labels=labels).sum().backward()
    finally:
        for (owner, name), fn in originals.items():
            setattr(owner, name, fn)
    return {"rows": rows, "messages": messages[0], "tensor_messages": tensor_messages[0]}


def main(plan_path, out_path):
    dist.init_process_group("gloo")
    results = {}
    for case in json.load(open(plan_path)):
        cfg = load_config("configs/tiny.yaml", case["overrides"])
        groups.init_distributed(cfg.parallel, cfg.train.seed, cfg.model.moe.num_experts, device="cpu")
        counts = {}
        for name, p in build_model(cfg, meta=True).named_parameters():
            counts[kind(name)] = counts.get(kind(name), 0) + p.numel()
        mine = {"stage": ps.get_pipeline_model_parallel_rank(), "counts": counts}
        if case.get("rows"):
            mine.update(dispatch_census(cfg))
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        results[case["name"]] = every
    if dist.get_rank() == 0:
        json.dump(results, open(out_path, "w"))
    groups.teardown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
    exit_process(0)
