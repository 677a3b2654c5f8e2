"""Multi-process half of the parity tests: run under `torchrun --nproc_per_node 4`.

    python -m torch.distributed.run --standalone --nproc_per_node 4 tests/support/parallel_worker.py PLAN OUT

PLAN is a torch file: a list of cases {name, layout kwargs, model kwargs, reference weights,
negative}; rank 0 writes {name: {losses, grads}} to OUT. All cases share the processes (the
imports dominate), re-initialising megatron's parallel state per case.
"""
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.support

from megatron.core import parallel_state as ps

from megatron_kappa.parallel import (
    groups,
    sharding,
)
from megatron_kappa.parallel.groups import init_distributed
from megatron_kappa.parallel.launch_env import exit_process
from megatron_kappa.summary import count
from tests.support import parity


def run_case(case):
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from megatron_kappa.model.attention_kinds import mla
    fixed = mla.SequenceParallelMLA._qkv_down_projection
    if case.get("negative") == "mla_stock_tp":  # megatron's own down-projection path (k_pe's gradient partial)
        mla.SequenceParallelMLA._qkv_down_projection = MLASelfAttention._qkv_down_projection
    try:
        return _run_case(case)
    finally:
        mla.SequenceParallelMLA._qkv_down_projection = fixed


def _run_case(case):
    cfg = parity.make_cfg(**case["model"], **case["layout"])
    init_distributed(cfg.parallel, seed=5, num_experts=cfg.model.moe.num_experts)
    model = parity.build(cfg, dtype=case.get("dtype"))
    global_name = sharding._global_name
    if case.get("negative") == "bad_expert_map":  # load each EP rank with its neighbour's experts
        ep = ps.get_expert_model_parallel_world_size()
        sharding._global_name = lambda name, rank, nl: global_name(name, (rank + 1) % ep, nl)
    try:
        sharding.load_full_state_dict(model, case["weights"])
    finally:
        sharding._global_name = global_name
    # the κ penalty from the loaded weights, before training moves them
    penalty = parity.kappa_penalty(model, cfg) if cfg.model.kappa.enabled and not case.get("negative") else None
    if case.get("negative") == "fp8_sp_grad":  # the SP gather's backward splits instead of reduce-scattering
        from megatron_kappa.model import fp8
        gather = fp8.gather_from_sequence_parallel_region
        fp8.gather_from_sequence_parallel_region = \
            lambda x, tensor_parallel_output_grad=True, group=None: gather(x, False, group)
    if case.get("negative") == "lambda_tp_grad":  # the λ gradients left unsummed over the TP ranks' tokens
        for name, p in model.named_parameters():
            if name.endswith(("resid_lambda", "x0_lambda")):
                p.sequence_parallel = False
    batches = parity.split_for_rank(parity.global_batch(), ps.get_data_parallel_rank(),
                                    ps.get_data_parallel_world_size())
    losses, grads = parity.train(model, cfg, batches,
                                 skip_expert_data_parallel=case.get("negative") == "skip_edp")
    if case.get("negative") == "fp8_sp_grad":
        fp8.gather_from_sequence_parallel_region = gather
    total = count(model, cfg, numel=sharding.global_numel)["total_params"]
    return {"losses": losses, "grads": sharding.gather_full(model, grads), "total_params": total,
            "kappa_penalty": penalty}


def main(plan_path, out_path):
    dist.init_process_group("gloo")
    results = {}
    for case in torch.load(plan_path, weights_only=False):
        results[case["name"]] = run_case(case)
    if dist.get_rank() == 0:
        torch.save(results, out_path)
    groups.teardown()  # a barrier, then every group's threads joined before the exit


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_process(0)
