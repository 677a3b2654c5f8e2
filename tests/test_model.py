"""Model from config: layouts, config errors, parameter counts, and a tiny model that learns."""
from pathlib import Path

import pytest
import torch

from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.model.build import build_model, moe_layer_pattern
from megatron_kappa.summary import count, main as summary_main, summarize

CONFIGS = sorted(Path(__file__).resolve().parents[1].glob("configs/*.yaml"))


def test_layouts():
    cfg = lambda layout, n, **kw: load_config(None, [f"model.layout={layout}", f"model.num_layers={n}"] +
                                              [f"{k}={v}" for k, v in kw.items()])
    assert moe_layer_pattern(cfg("dense", 4)) == [0, 0, 0, 0]
    assert moe_layer_pattern(cfg("moe", 5, **{"model.first_dense": 2})) == [0, 0, 1, 1, 1]
    assert moe_layer_pattern(cfg("sandwich", 6)) == [0, 0, 1, 1, 0, 0]
    assert moe_layer_pattern(cfg("sandwich", 7)) == [0, 0, 1, 1, 0, 0, 0]


@pytest.mark.parametrize("sets,message", [
    (["model.hidden_sise=3"], "unknown key 'model.hidden_sise'"),
    (["model.moe.router=top1"], "model.moe.router: expected one of"),
    (["model.num_layers=two"], "model.num_layers: expected an integer"),
    (["model.kappa.U=1"], "model.kappa.U: must be > 1"),
    (["parallel.ep=3"], "parallel.ep: model.moe.num_experts=8 is not divisible by ep=3"),
    (["zero.stage=3"], "zero.stage: ZeRO-3 is not supported"),
    (["train.global_batch=7", "train.micro_batch=2"], "train.global_batch: 7 is not a multiple"),
    (["nonsense"], "expected key=value"),
    (["model.moe=3"], "model.moe: expected a mapping"),
])
def test_config_errors_are_one_line_and_name_the_key(sets, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, sets)
    assert "\n" not in str(err.value)


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(bad)


def analytic_counts(cfg):
    """Parameters written out from the architecture, independently of the model code."""
    m = cfg.model
    d, L, V, E, F = m.hidden_size, m.num_layers, 2048 if m.vocab_size <= 2048 else m.vocab_size, \
        m.moe.num_experts, m.ffn_hidden_size
    head = d // m.num_attention_heads
    moe_layers = sum(moe_layer_pattern(cfg))
    attn = L * (3 * d * d + d * d)  # qkv, proj
    norms = L * (2 * d + 2 * head) + d  # input/pre-mlp norms, q/k norms, final norm
    dense = (L - moe_layers) * 3 * d * F
    experts = moe_layers * E * (3 * d * F + (2 * F if m.kappa.enabled else 0))
    router = moe_layers * E * d
    return dict(embedding=2 * V * d, attention=attn, norm=norms,
                dense_mlp=dense, router=router, experts=experts)


@pytest.mark.parametrize("name", ["moe8", "sandwich28", "tiny"])
def test_summary_counts_match_architecture(world1, name):
    cfg = load_config(next(c for c in CONFIGS if c.stem == name))
    s = summarize(cfg)
    assert s["by_category"] == analytic_counts(cfg)
    # active = all but the experts + k/E of them; the paper's N_eff rule; budget 5 × N_eff.
    by, k, E = s["by_category"], cfg.model.moe.topk, cfg.model.moe.num_experts
    assert s["active_params_per_token"] == round(sum(by.values()) - by["experts"] * (1 - k / E))
    assert s["n_eff"] == round(by["embedding"] + by["norm"] + by["dense_mlp"] + by["router"] +
                               by["attention"] + by["experts"] * (k / E) ** 0.5)
    assert s["token_budget"] == round(5 * (by["embedding"] + by["norm"] + by["dense_mlp"] + by["router"] +
                                           by["attention"] + by["experts"] * (k / E) ** 0.5))
    # Negative control: a different expert count changes the architecture's numbers.
    other = load_config(next(c for c in CONFIGS if c.stem == name), ["model.moe.num_experts=8", "parallel.ep=1"])
    assert analytic_counts(other) != s["by_category"]


def test_summary_cli_runs_for_every_config(world1, capsys):
    paper = {f"moe{n}" for n in (8, 10, 12, 14)} | {f"sandwich{n}" for n in (16, 20, 24, 28)}
    assert paper | {"tiny", "study_cpu"} <= {c.stem for c in CONFIGS}  # every config below is run
    for path in CONFIGS:
        assert summary_main(["--config", str(path), "--json"]) == 0
        assert '"n_eff"' in capsys.readouterr().out
    assert summary_main(["--config", str(CONFIGS[0]), "--set", "model.bogus=1"]) == 2
    assert "unknown key 'model.bogus'" in capsys.readouterr().err


@pytest.mark.parametrize("kappa", [True, False])
def test_tiny_model_learns_on_cpu(world1, kappa):
    cfg = load_config(next(c for c in CONFIGS if c.stem == "tiny"),
                      [f"model.kappa.enabled={str(kappa).lower()}", "model.seq_length=32"])
    torch.manual_seed(0)
    model = build_model(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.arange(33).repeat(4, 1) * 7 % 2048  # a learnable pattern
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    position = torch.arange(32).expand(4, -1)
    losses = []
    for _ in range(8):
        loss = model(inputs, position, None, labels=labels).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    if kappa:  # α, b got gradients through the router logits
        assert any("kappa_alpha" in n and p.grad is not None and p.grad.abs().sum() > 0
                   for n, p in model.named_parameters())


def test_config_reference_in_docs_is_current():
    from megatron_kappa.config import markdown_reference
    doc = Path(__file__).resolve().parents[1] / "docs/config.md"
    assert doc.read_text().strip() == markdown_reference().strip(), \
        "regenerate: python -m megatron_kappa.config --markdown > docs/config.md"
