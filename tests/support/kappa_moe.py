"""The project's κ MoE layer and the authors' (14c9b04) MoE layer, built side by side with the same
weights, for bench/kappa_moe_layer.py and its test.

The project's layer is what `build_model` puts in a MoE slot for a config (layer_specs: the
KappaMoELayer with its KappaRouter and grouped κ experts); the authors' is the MOELayer of a GPT
built by 14c9b04's own base_train.py (`build_model_meta`, read from the vendored file and run as
written: tests/support/authors_loop.py), on the CPU in fp32. The project's weights are copied into
the authors' layer with the mapping the whole-model comparison uses (authors_loop.moe_weights).

Token order: megatron's activations are [sequence, batch, hidden], the authors' [batch, sequence,
hidden]; the capacity drop depends on the token order, and the project's `drop_order: authors`
walks tokens in the authors' order, so each side gets the same tokens in its own layout.

Both sides backpropagate what their training step would from this layer: the output's gradient,
the aux loss and the z-loss with the project's coefficients (the authors' code returns its router
losses through its MOE manager and base_train adds them to the loss; megatron attaches them to the
activations). The κ L2 losses are left out on both sides (weight 0 in the paper recipe's default).
"""
from __future__ import annotations

import contextlib
import inspect
import io
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def project_sets(d: int, head_dim: int, experts: int, seq: int, drop: bool = True) -> list[str]:
    """configs/moe8.yaml (the paper block, κ scaled, the authors' capacity and router losses) in
    fp32 on one process, three layers (the third MoE, as the authors' moe-start-layer 2), sliced.
    drop=False: no capacity (nothing dropped), for code from before the authors' capacity rule."""
    return [*([] if drop else ["model.moe.capacity_factor=null"]),
            "model.num_layers=3", "model.first_dense=2", "model.aspect_ratio=null", f"model.hidden_size={d}",
            f"model.num_attention_heads={d // head_dim}", f"model.head_dim={head_dim}",
            f"model.moe.num_experts={experts}", f"model.seq_length={seq}", "model.vocab_size=512",
            "parallel.ep=1", "precision=fp32"]


def authors_argv(d: int, head_dim: int, experts: int, seq: int) -> list[str]:
    """14c9b04's base_train flags for the same layer: depth 3 (MoE from layer 2, κ from layer 2:
    their defaults), d = 3 · aspect ratio, κ-SwiGLU on."""
    assert d % 3 == 0 and d % head_dim == 0, "hidden size: a multiple of 3 and of the head size"
    return ["--depth", "3", "--aspect-ratio", str(d // 3), "--head-dim", str(head_dim), "--max-seq-len", str(seq),
            "--n-exp", str(experts), "--use-kappa-swiglu"]


def build_project(d: int, head_dim: int, experts: int, seq: int, seed: int = 0, root: Path = ROOT,
                  drop: bool = True):
    """The project's MoE layer for configs/moe8.yaml sliced (`project_sets`); κ's U at 3."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_kappa.config import ParallelConfig, load_config
    from megatron_kappa.model.build import layer_specs, transformer_config
    from megatron_kappa.model.experts import set_kappa_U
    from megatron_kappa.model.layout import model_layout
    from megatron_kappa.parallel.groups import init_distributed

    init_distributed(ParallelConfig(), seed=1)
    cfg = load_config(str(root / "configs" / "moe8.yaml"), project_sets(d, head_dim, experts, seq, drop))
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    layout = model_layout(cfg)
    index = list(layout.moe_layers).index(True)
    if "precision" in inspect.signature(layer_specs).parameters:
        spec = layer_specs(cfg.model, cfg.precision, layout).layer_specs[index]
    else:  # its signature before the config sections were passed apart (5c9407b: --old-root)
        spec = layer_specs(cfg, layout=layout).layer_specs[index]
    layer = spec.submodules.mlp(config=transformer_config(cfg, layout=layout))
    layer.set_layer_number(index + 1)
    set_kappa_U(layer, 3.0)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))  # the router losses' gradient × 1
    return layer


def build_authors(d: int, head_dim: int, experts: int, seq: int, drop: bool = True):
    """14c9b04's MOELayer from its own build_model_meta (base_train.py 548-598), as authors_loop
    builds the whole GPT: to_empty, init_weights, the declared buffers; U at 3. drop=False: its
    capacity factor (an attribute; base_train has no flag) at E/k, so every token fits."""
    from tests.support import authors_loop

    gpt = authors_loop.import_authors()
    bt = authors_loop.BaseTrain(authors_argv(d, head_dim, experts, seq), vocab_size=512)
    bt.ns["resolved_loss_chunk_tokens"] = bt.args.loss_chunk_tokens
    with contextlib.redirect_stdout(io.StringIO()):
        model = bt.build_model_meta(3)
        model.to_empty(device="cpu")
        model.init_weights()
    authors_loop.declared_buffers(model, model.config, gpt)
    model.set_kappa_slope_max_scales(moe_kappa_slope_max_scale=3.0, dense_kappa_slope_max_scale=3.0)
    layer = model.transformer.h[2].mlp
    assert isinstance(layer, gpt.MOELayer) and layer.experts.use_kappa_swiglu
    if not drop:
        layer.router.train_capacity = experts / layer.router.top_k  # `fit_capacity` lowers it for an input
    return layer.train()


def randomize(project, seed: int = 1):
    """Every weight of the project's layer drawn at a scale where each part acts: router logits of
    a few units (κ far from 1, the capacity dropping), α and b nonzero, fc2 (zero at init) drawn."""
    gen = torch.Generator().manual_seed(seed)
    experts, d = project.experts, project.config.hidden_size
    with torch.no_grad():
        project.router.weight.copy_(torch.randn(project.router.weight.shape, generator=gen) * 3 / d ** 0.5)
        experts.fc1_weight.copy_(torch.randn(experts.fc1_weight.shape, generator=gen) / d ** 0.5)
        ffn = experts.fc2_weight.shape[-1]
        experts.fc2_weight.copy_(torch.randn(experts.fc2_weight.shape, generator=gen) / ffn ** 0.5)
        experts.kappa_alpha.copy_(0.5 * torch.randn(experts.kappa_alpha.shape, generator=gen))
        experts.kappa_bias.copy_(0.5 * torch.randn(experts.kappa_bias.shape, generator=gen))


def copy_weights(project, authors):
    """The project's layer weights into the authors' layer (authors_loop.moe_weights)."""
    from tests.support import authors_loop

    mapped = authors_loop.moe_weights({n: p.detach() for n, p in project.named_parameters()})
    own = dict(authors.named_parameters())
    assert set(mapped) == set(own), set(mapped) ^ set(own)
    with torch.no_grad():
        for name, value in mapped.items():
            assert own[name].shape == value.shape, (name, own[name].shape, value.shape)
            own[name].copy_(value)


def fit_capacity(project, authors, x):
    """Without drops (drop=False): the authors' capacity factor set so that their capacity is the
    busiest expert's count for x (rounded up to even, as theirs): nothing dropped, and their
    [E, capacity] buffers padded no more than that needs (at factor E/k every expert gets T rows)."""
    top = (x.reshape(-1, x.shape[-1]) @ project.router.weight.T).topk(authors.router.top_k, dim=-1).indices
    most, tokens = torch.bincount(top.reshape(-1)).max().item(), top.shape[0]
    authors.router.train_capacity = (most + 0.5) * authors.n_exp / (authors.router.top_k * tokens)
    assert authors.router.get_capacity(tokens) >= most


def inputs(batch: int, seq: int, d: int, seed: int = 3):
    """x [batch, seq, d] (the authors' layout) and the output gradient g, fixed by `seed`."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, d, generator=gen), torch.randn(batch, seq, d, generator=gen)


def step_project(layer, x, g):
    """Forward + backward of the project's layer on the authors'-layout x: (out, dx) in that layout."""
    xp = x.transpose(0, 1).contiguous().requires_grad_()
    out, _ = layer(xp)
    out.backward(g.transpose(0, 1))
    return out.detach().transpose(0, 1), xp.grad.transpose(0, 1)


def step_authors(layer, x, g, aux: float, z: float):
    """Forward + backward of the authors' layer: the output's gradient g, plus aux · their aux loss
    and z · their z-loss, as base_train adds them (1768-1772). Returns (out, dx)."""
    from nanochat.manager import MANAGER

    x = x.detach().clone().requires_grad_()
    out = layer(x)
    loss = (out * g).sum()
    losses = MANAGER._values
    if aux:
        loss = loss + aux * torch.stack(losses["aux_loss"]).sum()
    if z:
        loss = loss + z * torch.stack(losses["router_z_loss"]).sum()
    MANAGER.reset_all()
    loss.backward()
    layer._expert_inputs_cache = layer._expert_router_scores_cache = None  # authors_loop's 4.
    return out.detach(), x.grad


def loss_weights(project) -> tuple[float, float]:
    """The aux and z-loss coefficients the project's layer uses (its TransformerConfig)."""
    c = project.config
    return float(c.moe_aux_loss_coeff or 0.0), float(c.moe_z_loss_coeff or 0.0)


def differences(project, authors, x, g) -> dict:
    """One forward + backward of each on the same x and g: the largest difference of the output, of
    the input gradient and of the router weight's gradient, each relative to the largest |value|
    of the authors' tensor."""
    for m in (project, authors):
        m.zero_grad(set_to_none=True)
    out_p, dx_p = step_project(project, x, g)
    out_a, dx_a = step_authors(authors, x, g, *loss_weights(project))
    pairs = {"out": (out_p, out_a), "dx": (dx_p, dx_a),
             "router_grad": (project.router.weight.grad, authors.router.w_g.weight.grad)}
    for m in (project, authors):
        m.zero_grad(set_to_none=True)
    return {k: ((a - b).abs().max() / b.abs().max()).item() for k, (a, b) in pairs.items()}


TOLERANCE = 1e-5  # relative to the largest |value|: fp32 rounding of the same sums in other orders
