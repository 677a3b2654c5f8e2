"""The DeepSpeed runs of the optimizer tests (tests/test_optimizers.py, tests/test_sharded_alpha.py):
their shared settings, and the blocks a TP-sharded matrix is orthogonalised in, emulated on the
full tensor."""
import torch

STEPS = 4
COMMON = [f"train.steps={STEPS}", "data.mock=true", "log.interval=1", "checkpoint.interval=100",
          "eval.valid_every=0", "model.seq_length=32", "train.micro_batch=2", "train.global_batch=4",
          "train.grad_clip=0", "model.kappa.freeze_fraction=0.25", "model.kappa.warmup=2",
          "model.moe.aux_loss=1e-2", "log.tensorboard=false", "model.num_query_groups=2",
          "train.warmup=1"]  # the peak learning rate from the first step: differences show sooner


class TPBlocks:
    """On a full tensor, the blocks that TP = t orthogonalises (the documented blockwise choice):
    cut it as megatron shards it ([gate_t; up_t] for a SwiGLU fc1), give each piece the blocks
    muon.matrix_blocks gives that shard, put the pieces back."""

    def __init__(self, name, param, config, t, shard_blocks):
        self.dim, self.t = param.partition_dim, t
        self.glu = name.endswith(("linear_fc1.weight", "experts.fc1_weight"))
        shape = list(param.shape)
        shape[self.dim] //= t
        self.inner = shard_blocks(name, torch.empty(shape, device="meta"), config)

    def _cut(self, X):
        if not self.glu:
            return list(X.chunk(self.t, self.dim))
        gate, up = X.chunk(2, self.dim)
        return [torch.cat(p, self.dim) for p in zip(gate.chunk(self.t, self.dim), up.chunk(self.t, self.dim))]

    def _join(self, pieces):
        if not self.glu:
            return torch.cat(pieces, self.dim)
        halves = [p.chunk(2, self.dim) for p in pieces]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], self.dim)

    def apply(self, X, orth):
        return self._join([orth(p) if self.inner is None else self.inner.apply(p, orth) for p in self._cut(X)])


def tp_emulation(t):
    from megatron_kappa.optim import muon
    shard_blocks = muon.matrix_blocks

    def blocks(name, param, config):
        if not getattr(param, "tensor_model_parallel", False):
            return shard_blocks(name, param, config)
        return TPBlocks(name, param, config, t, shard_blocks)
    return blocks
