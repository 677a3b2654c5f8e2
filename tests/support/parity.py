"""Shared by the single-process reference (pytest) and the multi-process workers (torchrun):
the tiny model, a fixed global batch, and a few plain training steps with megatron's reductions."""
import copy
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron_kappa.config import load_config
from megatron_kappa.model.build import build_model
from megatron_kappa.model.routers.sigmoid import update_expert_bias
from megatron_kappa.parallel.grads import install_tensor_parallel_grad_hooks, reduce_data_parallel_grads
from megatron_kappa.parallel.groups import current_device

GLOBAL_BATCH, SEQ, STEPS = 4, 32, 3
# The precision kernels and layouts are compared in. Two kernels (SDPA and megatron's attention,
# grouped and per-expert GEMMs) or two layouts (a GEMM split over TP ranks) sum in different
# orders, and each CPU family's BLAS picks its own blocking: in fp32 their results differ by a few
# 1e-7 relative, and three Adam steps of a top-k MoE turn that into a different routing decision
# for a token whose expert scores are that close (measured: a 1e-6 perturbation of the start
# weights moves this model's third-step loss by 4.5e-5, the gap an AVX-512 Xeon showed). In
# float64 the same orders differ by ~1e-16 relative: no decision of these runs is that close, so
# the comparison checks the mathematics of a layout or kernel and not the CPU it ran on.
REFERENCE_DTYPE = torch.float64
# Bounds for two float64 runs of the same mathematics (losses over STEPS steps; each gradient
# tensor's largest error relative to its largest entry). Each operation's rounding is ~1e-16
# relative (unit roundoff 1.1e-16); measured, SDPA against megatron's attention: 2e-15 to 4e-15
# relative in the gradients, loss gap 0, on AVX-512, AVX2 and the default kernels. 1e-9 leaves six
# orders for the depth of the model and three Adam steps, and is two orders below what a single
# fp32 rounding left in either path would show (6e-8), so the comparison also checks that it ran
# in float64.
LOSS_GAP = GRAD_ERROR = 1e-9


def make_cfg(kappa=True, router="softmax", dispatcher="alltoall", tp=1, ep=1, etp=None, grouped=True,
             overrides=()):
    """`overrides`: further `key=value` settings (e.g. a router's own section)."""
    return load_config("configs/tiny.yaml", [
        f"model.kappa.enabled={str(kappa).lower()}", f"model.moe.router={router}",
        f"model.moe.grouped_gemm={str(grouped).lower()}",
        f"model.moe.dispatcher={dispatcher}", f"model.seq_length={SEQ}",
        f"parallel.tp={tp}", f"parallel.ep={ep}", f"parallel.etp={etp if etp else 'null'}",
        "model.moe.aux_loss=1e-2", "model.moe.z_loss=1e-3", "model.moe.bias_update_rate=1e-2",
        # megatron's loss inside the model (fp32 runs; `build` with REFERENCE_DTYPE swaps in the
        # chunked loss, which computes in float64). tests/test_loss.py compares the chunked loss
        # with megatron's, in one process and over TP2.
        "model.cross_entropy_chunk=0",
        *overrides])


def global_batch():
    gen = torch.Generator().manual_seed(1234)
    return torch.randint(0, 2048, (STEPS, GLOBAL_BATCH, SEQ + 1), generator=gen)


def init_reference_weights(model):
    """Nonzero α, b (so κ ≠ 1 from step 0) and router logits large enough to matter; the nanochat
    block's zero-initialised weights (output projections, value gates, λ_x0) drawn, so that every
    part has a gradient from step 0."""
    gen = torch.Generator().manual_seed(99)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "kappa_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif name.endswith("router.weight"):
                p.mul_(20.0)
            elif name.endswith(("value_gate", "x0_lambda")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif not p.any():  # init nanochat's zero output projections
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def train(model, cfg, micro_batches_per_step, skip_expert_data_parallel=False):
    """STEPS Adam steps; each step's micro-batches are this rank's share of the global batch.

    Returns (global losses per step, local step-0 gradients).
    """
    install_tensor_parallel_grad_hooks(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scale = 1.0 / len(micro_batches_per_step[0])
    position = torch.arange(SEQ)
    losses, grads0 = [], None
    for step, micro_batches in enumerate(micro_batches_per_step):
        opt.zero_grad()
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale))
        total = torch.zeros((), dtype=next(model.parameters()).dtype)
        for tokens in micro_batches:
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            loss = model(inputs, position.expand_as(inputs), None, labels=labels).mean() * scale
            loss.backward()
            total += loss.detach()
        reduce_data_parallel_grads(model, skip_expert_data_parallel=skip_expert_data_parallel)
        if dist.is_initialized() and ps.get_data_parallel_world_size() > 1:
            dist.all_reduce(total, group=ps.get_data_parallel_group())
            total /= ps.get_data_parallel_world_size()
        if step == 0:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        update_expert_bias(model, cfg.model.moe.bias_update_rate)
        losses.append(total.item())
    return losses, grads0


def kappa_penalty(model, cfg) -> dict:
    """The κ L2 penalty as the training loop has it, for l2_reduction mean and sum: its global
    value (recipe.global_kappa_l2) and the α, b gradients of this rank's penalty × l2_scale after
    the data-parallel reduction, gathered to the full layout. "mean_no_shards" is the negative
    control: the mean computed as if the rank held every expert (EP and ETP forgotten).
    Leaves no .grad behind."""
    from megatron_kappa.model.params import is_kappa
    from megatron_kappa.parallel.sharding import gather_full
    from megatron_kappa.train import recipe

    out = {}
    for name, reduction, ep, etp in (("mean", "mean", None, None), ("sum", "sum", None, None),
                                     ("mean_no_shards", "mean", 1, 1)):
        c = copy.deepcopy(cfg)
        c.model.kappa.l2_reduction = reduction
        if ep is not None:
            c.parallel.ep, c.parallel.etp = ep, etp
        local = recipe.kappa_l2(model, c.model.kappa, c.parallel, torch.device("cpu"))
        (local * recipe.l2_scale()).backward()
        reduce_data_parallel_grads(model)
        grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}
        full = gather_full(model, grads)
        out[name] = {"value": recipe.global_kappa_l2(local).item(),
                     "grads": {n: g for n, g in full.items() if is_kappa(n)}}
        for p in model.parameters():
            p.grad = None
    return out


def split_for_rank(batch, dp_rank, dp_size):
    """Each step's global batch cut into dp_size micro-batches; this DP rank's one."""
    return [[step.chunk(dp_size)[dp_rank]] for step in batch]


def split_for_reference(batch, dp_size):
    return [list(step.chunk(dp_size)) for step in batch]


def build(cfg, seed=5, dtype=None):
    """The model of `cfg`; with `dtype` (REFERENCE_DTYPE) an fp32 model's parameters and buffers
    are cast to it (an fp8 or bf16 model keeps its precision)."""
    torch.manual_seed(seed)
    cast = dtype is not None and cfg.precision == "fp32"
    if cast:
        cfg = copy.deepcopy(cfg)
        cfg.model.moe.router_dtype = "params"  # the router's logits not rounded to fp32
        if cfg.model.cross_entropy_chunk == 0:
            # megatron's loss computes in fp32 whatever the logits' dtype (under TP its vocabulary
            # sums then differ by fp32 roundings); the project's chunked loss computes in float64
            cfg.model.cross_entropy_chunk = 4096
    model = build_model(cfg, current_device())
    return model.to(dtype) if cast else model


def run_plan(plan: list, tmp: Path, world: int) -> dict:
    """Every case of `plan` in one launch of tests/support/parallel_worker.py over `world` processes;
    returns each case's results by name."""
    torch.save(plan, tmp / "plan.pt")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}",
         str(root / "tests/support/parallel_worker.py"), str(tmp / "plan.pt"), str(tmp / "out.pt")],
        cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(tmp / "out.pt", weights_only=False)
