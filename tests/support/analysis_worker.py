"""Multi-process half of tests/test_analysis.py: run under `torchrun --nproc_per_node 4`.

    python -m torch.distributed.run --standalone --nproc_per_node 4 tests/support/analysis_worker.py PLAN OUT

PLAN: a torch file, a list of cases {name, tp, ep, etp, kappa, grouped, negative, weights (full
layout)}. Each case loads the weights into its layout, runs one forward of its data-parallel
share of parity's first global batch, and computes the analysis metrics without sampling; rank 0
writes {name: {"stats": [every rank's dict], "table": the first MoE layer's expert table}} to OUT.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.support

from megatron.core import parallel_state as ps

from megatron_kappa.config import load_config
from megatron_kappa.metrics import paper_analyses as analysis
from megatron_kappa.parallel import (
    groups,
    sharding,
)
from megatron_kappa.parallel.groups import init_distributed
from megatron_kappa.parallel.launch_env import exit_process
from tests.support import analysis_reference as ref
from tests.support import parity


def run_case(case):
    cfg = load_config("configs/tiny.yaml", [
        f"model.seq_length={parity.SEQ}", f"model.kappa.enabled={str(case['kappa']).lower()}",
        f"model.moe.grouped_gemm={str(case.get('grouped', True)).lower()}",
        f"parallel.tp={case['tp']}", f"parallel.ep={case['ep']}", f"parallel.etp={case['etp'] or 'null'}"])
    init_distributed(cfg.parallel, seed=5, num_experts=cfg.model.moe.num_experts)
    model = parity.build(cfg)
    global_name = sharding._global_name
    if case.get("negative") == "bad_expert_map":  # each EP rank gets its neighbour's experts
        ep = ps.get_expert_model_parallel_world_size()
        sharding._global_name = lambda name, rank, nl: global_name(name, (rank + 1) % ep, nl)
    try:
        sharding.load_full_state_dict(model, case["weights"])
    finally:
        sharding._global_name = global_name
    analysis.watch_routers(model)
    tokens = parity.global_batch()[0][:, :-1]
    tokens = tokens.chunk(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()]
    with torch.no_grad():
        model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)
    stats = analysis.analysis_stats(model, cfg.model, torch.device("cpu"), tokens=None, values=None)
    table = analysis.expert_table(ref.moe_layers(model)[0][1])
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, stats)
    return {"stats": every, "table": table}


def main(plan_path, out_path):
    dist.init_process_group("gloo")
    results = {case["name"]: run_case(case) for case in torch.load(plan_path, weights_only=False)}
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    groups.teardown()  # a barrier, then every group's threads joined before the exit


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_process(0)
