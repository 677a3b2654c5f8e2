"""κ's α orthogonalised as one [E, F] matrix across its expert-parallel shards, as 14c9b04 steps it.

At 14c9b04 (no expert parallelism) α (`kappa_scale`, [E, F] per MoE layer) is one matrix of the
MoE block's Aurora groups (model.kappa.alpha_optimizer matrix). Here a rank holds the shard
[E/EP, F/ETP]: rows = its local experts (EP rank r holds experts r·E/EP on), columns = its expert-TP
slice of the gate units (sharded like fc1's gate half, megatron_kappa.model.experts), and ZeRO hands
the update function that shard's reduced gradient and momentum. Orthogonalising the shard alone
is a different optimizer (Aurora normalises by the block's own norms; ≈ 16-40 % away in direction
at EP 2-4, docs/optimizer.md).

`WholeAlpha` is the block spec muon.matrix_blocks gives α when it is sharded (ZeRO passes it to
the update function as `muon_num_heads`; matrix.as_blocks takes anything with `.apply(X, orth)`).
Its `apply` all-gathers the shard's momentum direction V over the expert-TP group (columns), then
over the EP group (rows) — α is tiny, E·F values a layer — orthogonalises the whole [E, F] with the
same function one process uses (so also its step scale, which depends on the shape), and keeps
this rank's block. Every rank of the group orthogonalises the same bytes with the same kernels, so
the ranks' blocks come from one matrix, bit for bit. The momentum stays per shard: it is
elementwise, so the gathered V is exactly one process's, and checkpoints keep their layout.

A collective inside ZeRO's per-parameter loop: every rank of α's EP × ETP group must reach α's
update at the same point. α's group peers hold equally shaped parameters in the same order, in the
same optimizer groups, at the same (expert-)data-parallel rank, so ZeRO-1/2 partitions them alike
and calls the update for the same α at the same point (DeepSpeed 0.19.8
`_get_flat_partition_unpadded`: every rank whose partition holds part of α gets its whole gradient
and calls it; with ZeRO-Offload every rank of the group calls it for every matrix). Nothing else in
that loop communicates. tests/test_sharded_alpha.py runs EP2 and TP2 (ETP 2), ZeRO-1 and -2,
against one process.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps


def _sizes() -> tuple[int, int]:
    """(EP, expert TP) of this process; (1, 1) without megatron's parallel state (a meta listing)."""
    if not ps.model_parallel_is_initialized():
        return 1, 1
    return (ps.get_expert_model_parallel_world_size() or 1, ps.get_expert_tensor_parallel_world_size() or 1)


def blocks():
    """α's block spec for muon.matrix_blocks: None (the shard is the whole matrix) at EP = ETP = 1,
    else WholeAlpha."""
    ep, etp = _sizes()
    return None if ep == etp == 1 else WholeAlpha(ep, etp)


def _all_gather(x: torch.Tensor, group, size: int, dim: int) -> torch.Tensor:
    if size == 1:
        return x
    pieces = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(pieces, x.contiguous(), group=group)  # in group-rank order = megatron's rank
    return torch.cat(pieces, dim=dim)


@dataclass(frozen=True)
class WholeAlpha:
    """α's [E/EP, F/ETP] shard as this rank's block of the whole [E, F] (the sizes when the groups
    were formed; the groups themselves are megatron's, read at each step)."""
    ep: int
    etp: int

    def apply(self, X: torch.Tensor, orth) -> torch.Tensor:
        if X.dim() != 2:
            raise ValueError(f"κ's α shard must be [E/EP, F/ETP], got {tuple(X.shape)}")
        if _sizes() != (self.ep, self.etp):
            raise RuntimeError(f"κ's α: the optimizer was built for EP {self.ep} × ETP {self.etp}, "
                               f"megatron's groups are now {_sizes()}")
        rows, cols = X.shape
        full = _all_gather(X, ps.get_expert_tensor_parallel_group(), self.etp, dim=1)
        full = _all_gather(full, ps.get_expert_model_parallel_group(), self.ep, dim=0)
        r = ps.get_expert_model_parallel_rank() * rows
        c = ps.get_expert_tensor_parallel_rank() * cols
        return orth(full)[r:r + rows, c:c + cols].contiguous()
