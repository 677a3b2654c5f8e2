"""The norms of the layer spec: torch's RMSNorm, usable with sequence parallelism."""
from __future__ import annotations

import torch
from megatron.core.transformer.transformer_config import TransformerConfig


class SPTorchNorm:
    """torch RMSNorm whose weight (if it has one: `gains`) is tagged for the TP gradient all-reduce.

    megatron's WrappedTorchNorm refuses sequence parallelism (which MoE + TP requires); the norm
    itself is the same, only its gradient needs summing over the TP group, which is what the
    `sequence_parallel` tag asks for (megatron_kappa.parallel.grads).
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, gains: bool = True, **_):
        device = "cpu" if config.use_cpu_initialization else torch.cuda.current_device()
        # gains=False (model.norm_gains): parameter-free, as the authors' nanochat block
        norm = torch.nn.RMSNorm(hidden_size, eps=eps, elementwise_affine=gains, dtype=config.params_dtype,
                                device=device)
        # q/k norms see only this rank's heads, sequence-parallel norms only its tokens: both
        # need the sum over TP.
        for p in norm.parameters():
            p.sequence_parallel = config.tensor_model_parallel_size > 1
        return norm
