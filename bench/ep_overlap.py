"""EP communication overlap on and off: the time of a training step's forward and backward passes
through megatron-core's schedule, over EP ranks.

    torchrun --nproc_per_node 8 bench/ep_overlap.py --config configs/moe8.yaml   # EP8, one GPU each
    torchrun --nproc_per_node 2 bench/ep_overlap.py --config configs/tiny.yaml   # CPU: gloo

One process per GPU, EP = the world size, the config's model in bf16 with the alltoall
dispatcher, built once; three variants of the step, their steps interleaved (megatron_kappa/bench/interleave.py):
  plain     megatron's schedule without the overlap (micro-batch after micro-batch)
  overlap   parallel.overlap_moe_expert_parallel_comm: the combined 1F1B schedule, each all-to-all
            on megatron's communication stream beside the other micro-batch's compute
  delay     overlap + parallel.delay_wgrad_compute (the grouped experts' weight gradients deferred)
The variants share the weights: the flags are read at each step (the schedule reads
`overlap_moe_expert_parallel_comm`, the schedule plan `delay_wgrad_compute`, the grouped experts
their queue). No optimizer step; gradients are zeroed between steps. Rank 0 prints one JSON row:
each variant's median milliseconds and its ratio to plain.

What it can show: on GPUs, how much of the all-to-all the overlap hides. On the CPU (gloo)
collectives are synchronous and nothing runs beside anything, so the ratios there show the
schedule's own cost only. It cannot run on one GPU: megatron-core refuses the overlap with EP 1
(there is no all-to-all to hide), and NCCL does not put two ranks on one GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from megatron_kappa.entry import start

start()  # first: the known library notices filtered before the imports below can print (megatron_kappa/entry.py)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_kappa.bench.interleave import time_interleaved  # noqa: E402
from megatron_kappa.config import load_config  # noqa: E402
from megatron_kappa.model.build import build_model  # noqa: E402
from megatron_kappa.model.deferred_wgrad import WgradQueue  # noqa: E402
from megatron_kappa.model.experts import GroupedExperts  # noqa: E402
from megatron_kappa.parallel import groups  # noqa: E402
from megatron_kappa.parallel.groups import init_distributed  # noqa: E402

VARIANTS = {"plain": (False, False), "overlap": (True, False), "delay": (True, True)}


def set_variant(model, overlap: bool, delay: bool):
    model.config.overlap_moe_expert_parallel_comm = overlap
    model.config.delay_wgrad_compute = delay
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.wgrad_queue = WgradQueue() if delay else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, default=4, help="per step (the overlap pairs neighbours)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", help="also write the row here")
    args = ap.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's; init_distributed makes the group
    cfg = load_config(args.config, [f"parallel.ep={world}", "precision=bf16", "model.moe.dispatcher=alltoall",
                                    "model.moe.grouped_gemm=true", "parallel.overlap_moe_expert_parallel_comm=true",
                                    "parallel.delay_wgrad_compute=true", f"train.micro_batch={args.micro_batch}",
                                    *args.set])
    device = init_distributed(cfg.parallel, cfg.train.seed, cfg.model.moe.num_experts)
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    model = build_model(cfg, device)
    seq, mb = cfg.model.seq_length, args.micro_batch
    gen = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, cfg.model.vocab_size, (args.micro_batches, mb, seq + 1), generator=gen).to(device)
    position = torch.arange(seq, device=device).expand(mb, -1)
    MoEAuxLossAutoScaler.set_loss_scale(torch.full((1,), 1.0 / args.micro_batches, device=device))

    def forward_step(data_iterator, module, return_schedule_plan=False):
        t = next(data_iterator)
        run = module.build_schedule_plan if return_schedule_plan else module
        out = run(t[:, :-1], position, None, labels=t[:, 1:])
        return out, lambda per_token: (per_token.float().mean(), {})

    def step(variant):
        def run():
            set_variant(model, *VARIANTS[variant])
            model.zero_grad(set_to_none=True)
            get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(tokens), model=[model],
                                        num_microbatches=args.micro_batches, seq_length=seq, micro_batch_size=mb,
                                        forward_only=False)
            dist.barrier()  # the step ends when every rank's has
        return run

    steps = {name: step(name) for name in VARIANTS}
    for run in steps.values():  # warm-up: allocator, kernels, megatron's communication stream
        run()
    ms = time_interleaved(steps, args.rounds, device)
    row = {"config": args.config, "set": args.set, "ep": world, "device": str(device),
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "micro_batch": mb, "micro_batches": args.micro_batches, "seq_length": seq,
           **{f"{name}_ms": round(t, 2) for name, t in ms.items()},
           **{f"{name}_vs_plain": round(ms[name] / ms["plain"], 3) for name in VARIANTS if name != "plain"}}
    if dist.get_rank() == 0:
        print(json.dumps(row), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(row, indent=1))
    groups.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
