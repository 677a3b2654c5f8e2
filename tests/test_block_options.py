"""Parts of the authors' nanochat block as keys of their own (issue 33): the logit softcap
(model.logit_softcap), parameter-free RMSNorm (model.norm_gains: false) and its epsilon
(model.norm_eps), the initialisation (model.init: nanochat), against float64 re-computations from
the formulas, with negative controls."""
import math

import pytest
import torch

from megatron_kappa import plan as planner
from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.model.build import build_model

SETS = ["model.kappa.enabled=true", "model.seq_length=16"]


def tokens(b=2, s=16, vocab=2048, seed=3):
    return torch.randint(0, vocab, (b, s + 1), generator=torch.Generator().manual_seed(seed))


def forward(model, batch, labels=False):
    inputs, position = batch[:, :-1], torch.arange(batch.shape[1] - 1).expand(batch.shape[0], -1)
    return model(inputs, position, None, labels=batch[:, 1:] if labels else None)


def twins(world1, *sets):
    """The tiny model without and with `sets`, from the same weights."""
    torch.manual_seed(0)
    plain = build_model(load_config("configs/tiny.yaml", SETS), "cpu").eval()
    other = build_model(load_config("configs/tiny.yaml", [*SETS, *sets]), "cpu").eval()
    missing, unexpected = other.load_state_dict(plain.state_dict(), strict=False)
    assert not [k for k in missing if not k.endswith("_extra_state")]
    return plain, other, unexpected


def test_softcap_logits_and_loss_against_float64(world1):
    plain, capped, _ = twins(world1, "model.logit_softcap=15")
    with torch.no_grad():
        for p in plain.output_layer.parameters():  # logits of tens, where the cap bends them
            p.mul_(400)
        capped.output_layer.load_state_dict(plain.output_layer.state_dict())
    batch = tokens()
    with torch.no_grad():
        raw, got = forward(plain, batch).double(), forward(capped, batch).double()
        want = 15 * torch.tanh(raw / 15)
        assert raw.abs().max() > 30  # the cap matters here
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        loss = forward(capped, batch, labels=True).double()  # the chunked loss (model.cross_entropy_chunk)
        labels = batch[:, 1:]
        ref = torch.logsumexp(want, -1) - want.gather(-1, labels[..., None]).squeeze(-1)
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
        # negative control: without the cap the loss is another
        uncapped = forward(plain, batch, labels=True).double()
        assert (uncapped - ref).abs().max() > 1.0


def test_parameter_free_norms_against_float64(world1):
    plain, bare, unexpected = twins(world1, "model.norm_gains=false")
    gains = [k for k in plain.state_dict() if "layernorm" in k or k.startswith("decoder.final_layernorm")]
    assert gains and sorted(unexpected) == sorted(gains)  # every gain is gone, nothing else
    assert not any("layernorm" in name for name, _ in bare.named_parameters())
    # the planner counts what is built
    cfg = load_config("configs/tiny.yaml", [*SETS, "model.norm_gains=false"])
    counted = sum(planner.stage_params(cfg, planner.Layout(1), 0).values())
    assert counted == sum(p.numel() for p in bare.parameters())
    batch = tokens()
    with torch.no_grad():
        # the gains start at 1: the same function; a gain ≠ 1 (negative control) is another
        torch.testing.assert_close(forward(bare, batch), forward(plain, batch), rtol=0, atol=0)
        plain.decoder.final_layernorm.weight.mul_(1.5)
        assert (forward(bare, batch) - forward(plain, batch)).abs().max() > 1e-3
    # each norm is x / sqrt(mean(x²) + eps), eps from model.norm_eps
    norm = bare.decoder.final_layernorm
    x = torch.randn(5, norm.normalized_shape[0], dtype=torch.float64) * 1e-3
    cfg_eps = load_config("configs/tiny.yaml", [*SETS, "model.norm_gains=false", "model.norm_eps=1.1920929e-07"])
    small = build_model(cfg_eps, "cpu").decoder.final_layernorm
    for module, eps in ((norm, 1e-5), (small, 1.1920929e-07)):
        assert module.eps == eps
        ref = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)
        torch.testing.assert_close(module(x.float()).double(), ref, rtol=1e-5, atol=1e-6)


def test_a_run_trains_with_the_block_options(world1, tmp_path):
    """Two steps through the trainer (DeepSpeed's engine, one process) with both options on: no
    norm parameters left for the non-matrix group, the cap in the loss."""
    from megatron_kappa.train.loop import run
    cfg = load_config("configs/tiny.yaml", [*SETS, "model.norm_gains=false", "model.logit_softcap=15",
                                            "model.init=nanochat",
                                            "data.mock=true", "train.steps=2", "log.interval=1",
                                            "checkpoint.interval=100", "eval.valid_every=0",
                                            "train.micro_batch=2", "train.global_batch=2", "log.tensorboard=false",
                                            f"run.dir={tmp_path}"])
    record = run(cfg, log=lambda *a: None)
    assert record["step"] == 2 and math.isfinite(record["loss"])
    assert (tmp_path / "checkpoints/step_2").is_dir()


@pytest.mark.parametrize("setting,message", [("model.logit_softcap=0", "model.logit_softcap: must be positive"),
                                             ("model.norm_eps=0", "model.norm_eps: must be positive")])
def test_block_option_errors(setting, message):
    with pytest.raises(ConfigError, match=message):
        load_config("configs/tiny.yaml", [setting])


def test_parameter_free_qk_norm_commutes_with_rope():
    """The authors norm q and k after RoPE (14c9b04 nanochat/gpt.py 382-384), megatron before it.
    RoPE rotates pairs of a head's channels, which keeps the head vector's mean square, so a norm
    without gains gives the same q and k either way: model.norm_gains false is the authors'
    attention. Checked in float64 with megatron's own RoPE (its rotate-half convention; the
    authors' −θ sign is a relabelling of the same rotation); negative control: with per-channel
    gains (megatron's learnable ones) the order matters."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd
    s, b, heads, d = 12, 2, 3, 16
    inv_freq = 1.0 / 10000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    angles = torch.outer(torch.arange(s, dtype=torch.float64), inv_freq)
    freqs = torch.cat([angles, angles], dim=-1)[:, None, None, :]  # megatron's [s, 1, 1, d] layout
    q = torch.randn(s, b, heads, d, dtype=torch.float64, generator=torch.Generator().manual_seed(5)) * 3
    def rms(x, gain=1.0):
        return x / torch.sqrt(x.square().mean(-1, keepdim=True) + 1.1920929e-07) * gain
    def rope(x):
        return _apply_rotary_pos_emb_bshd(x, freqs)
    torch.testing.assert_close(rms(rope(q)), rope(rms(q)), rtol=1e-12, atol=1e-12)
    gain = torch.linspace(0.5, 1.5, d, dtype=torch.float64)
    assert (rms(rope(q), gain) - rope(rms(q, gain))).abs().max() > 1e-2


def test_nanochat_init_against_its_definition(world1):
    """model.init nanochat: the matrices U(±√3/√d) (std 1/√d), output projections exactly 0, the
    embedding N(0, 1), the output layer N(0, 0.001); negative control: megatron's init."""
    cfg = load_config("configs/tiny.yaml", [*SETS, "model.init=nanochat"])
    d = cfg.model.hidden_size
    torch.manual_seed(0)
    model = build_model(cfg, "cpu")
    params = dict(model.named_parameters())
    bound = math.sqrt(3) / math.sqrt(d)
    matrices = [n for n in params if n.endswith(("linear_qkv.weight", "linear_fc1.weight", "fc1_weight",
                                                  "router.weight"))]
    outputs = [n for n in params if n.endswith(("linear_proj.weight", "linear_fc2.weight", "fc2_weight"))]
    assert matrices and outputs and any("experts" in n for n in outputs)
    for name in matrices:
        w = params[name].detach().double()
        assert w.abs().max() <= bound and w.std().item() == pytest.approx(1 / math.sqrt(d), rel=0.15), name
        if w.numel() > 10000:  # enough samples for a tight standard deviation
            assert w.std().item() == pytest.approx(1 / math.sqrt(d), rel=0.03), name
    assert all(torch.count_nonzero(params[n]) == 0 for n in outputs)
    assert params["embedding.word_embeddings.weight"].std().item() == pytest.approx(1.0, rel=0.02)
    assert params["output_layer.weight"].std().item() == pytest.approx(0.001, rel=0.02)
    torch.manual_seed(0)
    stock = dict(build_model(load_config("configs/tiny.yaml", SETS), "cpu").named_parameters())
    assert all(torch.count_nonzero(stock[n]) > 0 for n in outputs)
    assert stock["embedding.word_embeddings.weight"].std().item() == pytest.approx(0.02, rel=0.05)


def test_nanochat_output_layer_is_the_same_in_every_tp_layout():
    from megatron_kappa.model.init import output_layer_rows
    full = output_layer_rows(1024, 8, 1, 0, seed=7)
    for tp in (2, 4, 8):
        torch.testing.assert_close(torch.cat([output_layer_rows(1024, 8, tp, r, seed=7) for r in range(tp)]), full,
                                   rtol=0, atol=0)
    assert not torch.equal(output_layer_rows(1024, 8, 1, 0, seed=8), full)  # negative control: another seed
