"""The nanochat block (model.block: nanochat; issue 33) against a float64 forward written from the
authors' formulas (tests/support/nanochat_reference.py), dense and MoE layers, κ on and off, with negative
controls; its keys, parameters, optimizer groups and counts."""
import pytest
import torch

from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.model.build import build_model, kappa_settings
from megatron_kappa.model.layout import has_value_embedding
from megatron_kappa.optim.optimizer import describe_groups
from tests.support import nanochat_reference as ref
from tests.support.weights import randomize

S, B = 12, 2
# tiny: 4 layers, layer 0 dense and 1-3 MoE (4 experts, top-2), d 64, 4 heads of 16
SETS = ["model.block=nanochat", f"model.seq_length={S}", "model.kappa.input=scaled", "model.kappa.u_warmup=0"]


def build(*sets, seed=0):
    cfg = load_config("configs/tiny.yaml", [*SETS, *sets])
    torch.manual_seed(seed)
    return cfg, build_model(cfg, "cpu").eval()


def reference(cfg, model, ids, **knobs):
    m, k = cfg.model, kappa_settings(cfg.model.kappa)
    settings = dict(layers=m.num_layers, heads=m.num_attention_heads, eps=m.norm_eps, base=m.rotary_base,
                    softcap=m.logit_softcap, moe_layers={i for i in range(m.num_layers) if i >= m.first_dense},
                    kappa=dict(U=k.U, logit_scale=k.logit_scale, tanh_gain=k.tanh_gain) if m.kappa.enabled else None,
                    topk=m.moe.topk)
    return ref.forward(model.state_dict(), ids, **{**settings, **knobs})


def run(model, ids, labels=None):
    position = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    with torch.no_grad():
        return model(ids, position, None, labels=labels).double()


@pytest.mark.parametrize("kappa", [True, False])
def test_logits_and_loss_match_a_float64_forward_of_the_formulas(world1, kappa):
    cfg, model = build(f"model.kappa.enabled={str(kappa).lower()}")
    randomize(model)
    data = torch.randint(0, cfg.model.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(5))
    ids, labels = data[:, :-1], data[:, 1:]
    want = reference(cfg, model, ids)
    got = run(model, ids)
    assert want.abs().max() > 10  # the softcap bends these logits
    # fp32 model against float64: within 1e-5 of the logits' scale (fp32 rounding over 4 layers)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    loss = ref.loss(want, labels)
    assert (run(model, ids, labels) - loss).abs().max() <= 1e-5 * loss.abs().max()
    # negative controls: each part, dropped from the reference, is seen
    for knobs in (dict(gate=False), dict(gain=1.5), dict(softcap=None)):
        other = reference(cfg, model, ids, **knobs)
        assert (other - got).abs().max() > 1e-2, knobs
    if kappa:  # and κ itself: the same weights read as SwiGLU experts
        assert (reference(cfg, model, ids, kappa=None) - got).abs().max() > 1e-2


def test_the_block_preset_and_its_parameters(world1):
    cfg, model = build()
    m = cfg.model
    assert (m.value_embeddings, m.embedding_norm, m.residual_scalars, m.norm_gains, m.logit_softcap, m.init) == \
        (True, True, True, False, 15.0, "nanochat")
    names = dict(model.named_parameters())
    assert not any("layernorm" in n for n in names)  # parameter-free norms
    ve = sorted(int(n.split(".")[2]) for n in names if n.endswith("value_embedding"))
    assert ve == [1, 3] == [i for i in range(4) if has_value_embedding(i + 1, 4)]  # i % 2 == (L − 1) % 2
    assert names["decoder.layers.1.self_attention.value_embedding"].shape == (2048, 64)  # [V, kv heads · d]
    assert names["decoder.layers.1.self_attention.value_gate"].shape == (4, 32)
    assert not names["decoder.layers.1.self_attention.value_gate"].any()  # zero: the gate starts at 1
    assert all(names[f"decoder.layers.{i}.resid_lambda"].item() == 1 for i in range(4))
    assert all(names[f"decoder.layers.{i}.x0_lambda"].item() == 0 for i in range(4))
    # a preset fills only what the config leaves out
    cfg2, plain = build("model.value_embeddings=false")
    assert cfg2.model.residual_scalars and not any(n.endswith("value_embedding") for n, _ in plain.named_parameters())
    # the megatron block is untouched
    cfg3, megatron = build("model.block=megatron")
    assert not any(n.endswith(("value_embedding", "resid_lambda")) for n, _ in megatron.named_parameters())


def test_optimizer_groups_of_the_block(world1):
    cfg, model = build("train.optimizer=aurora", "train.lr_embedding=0.3", "train.batch_lr_scaling=true")
    rows = {r["group"]: r for r in describe_groups(model, cfg.train, cfg.model, kappa_peak=0.0)}
    assert any(n.endswith("value_embedding") for n in rows["embedding"]["names"])  # at the embedding rate
    assert any(n.endswith("value_gate") for n in rows["matrix"]["names"])  # the gates with the matrices
    batch = (cfg.train.global_batch * cfg.model.seq_length / 2 ** 19) ** 0.5
    assert rows["resid_lambda"]["lr"] == pytest.approx(0.005 * batch)
    assert rows["x0_lambda"]["lr"] == pytest.approx(0.5 * batch)
    assert rows["x0_lambda"]["betas"] == [0.96, 0.95] and rows["resid_lambda"]["betas"] == cfg.train.betas
    assert rows["resid_lambda"]["tensors"] == rows["x0_lambda"]["tensors"] == 4


def test_keys_that_cannot_combine_are_one_line_errors():
    with pytest.raises(ConfigError, match="model.recompute: full with model.residual_scalars"):
        load_config("configs/tiny.yaml", [*SETS, "model.recompute=full"])
    load_config("configs/tiny.yaml", [*SETS, "model.recompute=full", "model.residual_scalars=false"])
    with pytest.raises(ConfigError, match="model.block: expected one of"):
        load_config("configs/tiny.yaml", ["model.block=gpt2"])
    with pytest.raises(ConfigError, match=r"model.hidden_size: 64, but model.aspect_ratio 32 at 4 layers gives 128"):
        load_config("configs/tiny.yaml", ["model.aspect_ratio=32"])
    cfg = load_config("configs/tiny.yaml", ["model.aspect_ratio=32", "model.hidden_size=null",
                                            "model.num_attention_heads=null"])
    assert (cfg.model.hidden_size, cfg.model.num_attention_heads) == (128, 1)


def loss_and_grads(model, data):
    ids, labels = data[:, :-1], data[:, 1:]
    position = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
    model.zero_grad()
    loss = model(ids, position, None, labels=labels).float().mean()
    loss.backward()
    return loss.item(), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}


def lambda_term_sizes(model, data) -> dict:
    """Σ|terms| of each λ's gradient: dL/dλ_resid = Σ g·x and dL/dλ_x0 = Σ g·x0 over every token and
    channel (g the gradient of the layer's mixed input), from one forward and backward."""
    from megatron_kappa.model.nanochat import ScaledResidualLayer
    sizes, layers = {}, {name: m for name, m in model.named_modules() if isinstance(m, ScaledResidualLayer)}

    def recording(name, layer):
        def mix(x):
            out = layer.resid_lambda * x + layer.x0_lambda * layer.inputs.x0
            x0 = layer.inputs.x0
            out.register_hook(lambda g: sizes.update({f"{name}.resid_lambda": (g * x).abs().sum().item(),
                                                      f"{name}.x0_lambda": (g * x0).abs().sum().item()}))
            return out
        return mix

    for name, layer in layers.items():
        layer._mix = recording(name, layer)
    try:
        loss_and_grads(model, data)
    finally:
        for layer in layers.values():
            del layer._mix
    return sizes


def test_triton_kappa_backend_in_the_block(world1):
    """model.kappa.backend triton (interpreted here) inside the nanochat block gives the torch
    backend's loss and gradients from the same weights.

    The bounds are fp32 error budgets, relative to the size of what is summed: 1e-5 of a tensor's
    largest gradient entry (each entry's terms are of that size; measured ≤ 1.8e-6 on AVX-512, AVX2
    and the default kernels), and for the one-element λ, whose gradient sums terms over every
    token and channel that cancel to a small total, 1e-5 of Σ|terms| (the interpreter's and
    torch's roundings of each term are a few 1e-7 of it; a bound relative to the small sum broke
    under ATEN_CPU_CAPABILITY=default: 4.3e-7 against 1e-4 × 0.0034)."""
    cfg, torch_model = build("model.kappa.backend=torch")
    randomize(torch_model)
    _, triton_model = build("model.kappa.backend=triton")
    triton_model.load_state_dict(torch_model.state_dict())
    data = torch.randint(0, 2048, (B, S + 1), generator=torch.Generator().manual_seed(6))
    (want, want_grads), (got, got_grads) = loss_and_grads(torch_model, data), loss_and_grads(triton_model, data)
    terms = lambda_term_sizes(torch_model, data)
    assert abs(got - want) <= 1e-5 * abs(want)
    assert want_grads.keys() == got_grads.keys() and any(n.endswith("value_embedding") for n in got_grads)
    assert {n for n in want_grads if n.endswith("_lambda")} == set(terms)
    for name, g in want_grads.items():
        scale = terms[name] if name in terms else g.abs().max().item()
        assert (got_grads[name] - g).abs().max() <= 1e-5 * max(scale, 1e-6), name
    # the λ's terms do cancel: Σ|terms| is far above the sums, so the budget is not the sum's
    assert max(terms[n] / max(want_grads[n].abs().item(), 1e-12) for n in terms) > 10


def test_fp8_runs_with_the_block(world1):
    """precision fp8 (torchao, emulated here) with the nanochat block: the attention projections
    of the value-embedding layers are FP8 linears; loss and the block's own gradients (tables,
    gates, λ) are finite and near the bf16 model's from the same weights."""
    from megatron_kappa.model import fp8
    sets = ("model.seq_length=16",)
    cfg, bf16 = build("precision=bf16", *sets)
    randomize(bf16)
    _, low = build("precision=fp8", *sets)
    low.load_state_dict(bf16.state_dict())
    assert isinstance(low.decoder.layers[1].self_attention.linear_qkv, fp8.FP8ColumnParallelLinear)
    data = torch.randint(0, 2048, (2, 17), generator=torch.Generator().manual_seed(8))
    (want, _), (got, grads) = loss_and_grads(bf16, data), loss_and_grads(low, data)
    assert abs(got - want) <= 0.05 * abs(want), (got, want)
    for part in ("value_embedding", "value_gate", "resid_lambda", "x0_lambda"):
        found = [g for n, g in grads.items() if n.endswith(part)]
        assert found and all(torch.isfinite(g).all() and g.abs().max() > 0 for g in found), part
