"""Builds the model of every layout in a plan on the meta device, on every rank of a torchrun
world, and writes each rank's parameter counts by kind (rank 0 writes OUT):

    torchrun --nproc_per_node 8 tests/plan_worker.py PLAN.json OUT.json

PLAN: a list of {"name", "overrides"}; each is configs/tiny.yaml with those overrides. A case with
"rows": true is also built for real and runs one forward of a micro-batch: each rank then reports
the rows its routed experts received in each MoE layer (what megatron's dispatcher delivered)."""
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
    """The planner's kind of a parameter (megatron_kappa.plan.KINDS), by its name."""
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


def routed_rows(cfg) -> list[int]:
    """One forward of a micro-batch (the same tokens on every rank): the rows each MoE layer's
    experts received on this rank, read at the experts' input."""
    torch.manual_seed(5)
    model = build_model(cfg, device="cpu")
    rows = []
    for name, module in model.named_modules():
        if name.endswith(".mlp.experts"):
            module.register_forward_pre_hook(lambda _, args: rows.append(int(args[0].shape[0])))
    tokens = torch.randint(cfg.model.vocab_size, (cfg.train.micro_batch, cfg.model.seq_length),
                           generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    return rows


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
            mine["rows"] = routed_rows(cfg)
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        results[case["name"]] = every
    if dist.get_rank() == 0:
        json.dump(results, open(out_path, "w"))
    groups.teardown()


if __name__ == "__main__":
    main(*sys.argv[1:3])
    exit_process(0)
