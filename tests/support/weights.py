"""Full-layout initial weights for runs that are compared across layouts or launchers.

A random init depends on the layout (each rank draws its own shard), so every run of a comparison
starts from one file written here, in one process, through `train.init_weights`.
"""
from pathlib import Path

import torch

from megatron_kappa.config import load_config


def save_init_weights(path: Path, overrides=(), config: str = "configs/tiny.yaml", seed: int = 3,
                      device: str = "cpu") -> Path:
    """The full state dict of `config` + `overrides` built after seeding torch and megatron's RNG
    tracker with `seed`, without megatron's `_extra_state` entries. Needs megatron's parallel state
    of one process (world1). The tracker too: the experts draw their weights from its
    expert-parallel state, which any earlier build in the process moved on, so after torch's seed
    alone the same call drew other expert weights after other tests in the same pytest worker."""
    from megatron_kappa.model.build import build_model
    from megatron_kappa.parallel.groups import set_seed
    set_seed(seed)
    model = build_model(load_config(config, list(overrides)), device)
    torch.save({k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}, path)
    return path


def randomize(model, seed=1):
    """Weights where every part matters: the zero-initialised projections, gates, κ's α and b and
    the λ drawn at random; routers and experts scaled so that routing and κ move."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("linear_proj.weight", "linear_fc2.weight", "fc2_weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            elif name.endswith("value_gate"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith(("kappa_alpha", "kappa_bias")):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith("resid_lambda"):
                p.copy_(1 + 0.3 * torch.randn(1, generator=gen))
            elif name.endswith("x0_lambda"):
                p.copy_(0.5 * torch.randn(1, generator=gen))
            elif name.endswith("router.weight"):
                p.mul_(4.0)
            elif name == "output_layer.weight":
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)  # logits of tens: the softcap bends them
