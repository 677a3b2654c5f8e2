"""The memory planner's activation estimate against what a forward pass keeps on a GPU.

    python bench/activation_memory.py [--config configs/moe8.yaml] [--micro-batch 4] [--set k=v ...] [--json F]

For each recompute mode (none, selective, full): the model of the config (one process, EP 1) is
built on CUDA, one forward pass runs, and the memory allocated after it, less the memory before
it, is what autograd keeps for backward (the activations). The planner's `activation_bytes` for
the same shapes is printed beside it, with their ratio. Needs CUDA (the CPU has no allocator
statistics); exits 0 with a message elsewhere.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from megatron_kappa.entry import start

start()  # first: the known library notices filtered before the imports below can print (megatron_kappa/entry.py)

import torch  # noqa: E402

from megatron_kappa import plan as planner  # noqa: E402
from megatron_kappa.config import load_config  # noqa: E402
from megatron_kappa.model.build import build_model  # noqa: E402
from megatron_kappa.parallel.groups import init_distributed  # noqa: E402


def kept_by_forward(cfg, device, micro_batch: int) -> int:
    torch.manual_seed(0)
    model = build_model(cfg, device)
    seq, vocab = cfg.model.seq_length, cfg.model.vocab_size
    tokens = torch.randint(0, vocab, (micro_batch, seq), device=device)
    position = torch.arange(seq, device=device).expand(micro_batch, -1)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    loss = model(tokens, position, None, labels=tokens).float().mean()
    torch.cuda.synchronize(device)
    kept = torch.cuda.memory_allocated(device) - before
    loss.backward()
    del model, loss
    torch.cuda.empty_cache()
    return kept


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/moe8.yaml")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args(argv)
    rows = []
    if not torch.cuda.is_available():
        print("activation memory: needs CUDA (no allocator statistics on the CPU); nothing measured")
        if args.json:
            Path(args.json).write_text(json.dumps({"skipped": "needs CUDA"}))
        return 0
    base = ["data.mock=true", "parallel.ep=1", "parallel.tp=1", f"train.micro_batch={args.micro_batch}", *args.set]
    device = init_distributed(load_config(args.config, base).parallel, 0)
    print(f"{args.config} {' '.join(args.set)} | micro-batch {args.micro_batch} | {torch.cuda.get_device_name(device)}")
    print(f"{'recompute':<10} {'measured GiB':>13} {'planner GiB':>12} {'planner/measured':>17}")
    for mode in ("none", "selective", "full"):
        cfg = load_config(args.config, base + [f"model.recompute={mode}"])
        measured = kept_by_forward(cfg, device, args.micro_batch)
        layout = planner.layout_of(cfg.parallel, 1)
        estimate = planner.activation_bytes(cfg, layout, 0, mode, args.micro_batch)
        print(f"{mode:<10} {measured / planner.GIB:>13.3f} {estimate / planner.GIB:>12.3f} "
              f"{estimate / max(measured, 1):>17.3f}")
        rows.append({"recompute": mode, "measured_bytes": measured, "planner_bytes": estimate,
                     "planner_over_measured": estimate / max(measured, 1)})
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
