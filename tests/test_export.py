"""A trained run leaves the stack (issue 35): `python -m megatron_kappa.export` writes a Hugging Face
folder whose model gives the training model's logits (fp32, within 1e-5 of the logits' scale) for
κ-SwiGLU and plain experts, softmax and sigmoid routers, the nanochat block, from any training
layout; plain models load into transformers' own Qwen3-MoE and Mixtral classes (code nobody here
wrote agreeing with ours). Negative controls: κ dropped from the exported config, and Qwen3-MoE's
top-k weights left unnormalised, are seen. Generation and lm-eval: tests/test_export_tools.py."""
import json

import pytest
import torch

from megatron_kappa.config import ConfigError, load_config
from tests.support.export_runs import ROOT, close, export, hf_env, hf_logits, tokens, training_logits


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kappa-nanochat-sigmoid", "kappa-softmax-gqa", "kappa-mla-grouped"])
def test_a_kappa_export_gives_the_training_models_logits(runs, tmp_path, name):
    run = runs(name)
    out = tmp_path / "hf"
    export(run, out, "--shard-mb", "1")  # several shards and their index
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "kappa_moe" and config["kappa"] is not None
    ids = tokens(config["vocab_size"])
    want = training_logits(run, ids)
    got, cls = hf_logits(out, ids)
    assert cls == "KappaMoeForCausalLM"
    assert want.abs().max() > 1  # logits that carry the weights (randomised, not the tiny init)
    assert close(got, want), (got - want).abs().max()
    without_kappa, _ = hf_logits(out, ids, kappa=None)  # negative control: the same weights as SwiGLU experts
    assert (without_kappa - want).abs().max() > 1e-2


@pytest.mark.slow
def test_plain_experts_from_tp2_load_into_transformers_qwen3_moe_and_kappa_moe(runs, tmp_path):
    run = runs("plain-softmax")  # trained with TP2: the export consolidates it a layer at a time
    native, custom = tmp_path / "native", tmp_path / "custom"
    assert "qwen3_moe" in export(run, native)
    export(run, custom, "--target", "kappa_moe")
    config = json.loads((native / "config.json").read_text())
    assert "auto_map" not in config and not (native / "modeling_kappa_moe.py").exists()
    ids = tokens(config["vocab_size"])
    want = training_logits(run, ids)
    got, cls = hf_logits(native, ids)
    assert cls == "Qwen3MoeForCausalLM" and close(got, want), (got - want).abs().max()
    got, cls = hf_logits(custom, ids)
    assert cls == "KappaMoeForCausalLM" and close(got, want), (got - want).abs().max()
    unnormalised, _ = hf_logits(native, ids, norm_topk_prob=False)  # negative control
    assert (unnormalised - want).abs().max() > 1e-2


def native_export_matches(run, tmp_path, target: str, cls_name: str):
    """Export `run` (auto picks `target`), load it into transformers' `cls_name` and compare its logits
    with the training model's; (folder, tokens, training logits)."""
    out = tmp_path / "hf"
    assert target in export(run, out)
    ids = tokens(json.loads((out / "config.json").read_text())["vocab_size"])
    want = training_logits(run, ids)
    got, cls = hf_logits(out, ids)
    assert cls == cls_name and close(got, want), (got - want).abs().max()
    return out, ids, want


@pytest.mark.slow
def test_a_deepseek_v3_shaped_model_loads_into_transformers_deepseek_v3(runs, tmp_path):
    """MLA, the sigmoid router with its balance bias, group-limited routing, route scale 2.5, a shared
    expert and a dense first layer, trained with TP2, through transformers' own DeepseekV3ForCausalLM."""
    out, ids, want = native_export_matches(runs("deepseek-v3-shaped"), tmp_path, "deepseek_v3", "DeepseekV3ForCausalLM")
    unscaled, _ = hf_logits(out, ids, routed_scaling_factor=1.0)  # negative control: route scale 1
    assert (unscaled - want).abs().max() > 1e-2


@pytest.mark.slow
def test_a_mixtral_shaped_model_loads_into_transformers_mixtral(runs, tmp_path):
    # trained with PP2: each stage's layers under the full model's numbers
    native_export_matches(runs("mixtral-shaped"), tmp_path, "mixtral", "MixtralForCausalLM")
    with pytest.raises(ConfigError, match="model.kappa.enabled is true"):
        from megatron_kappa.export.convert import target_for
        from megatron_kappa.model.layout import model_layout
        cfg = load_config("configs/tiny.yaml", ["model.qk_layernorm=false", "model.first_dense=0"])
        target_for(cfg.model, model_layout(cfg), "mixtral")


@pytest.mark.slow
def test_the_hf_tokenizer_encodes_like_sentencepiece(sample_shards):
    import pyarrow.parquet as pq

    from megatron_kappa.export.tokenizer import hf_tokenizer
    from megatron_kappa.tokenizer import Tokenizer
    ours = Tokenizer(sample_shards["tokenizer"])
    theirs = hf_tokenizer(sample_shards["tokenizer"], add_bos=True)
    texts = pq.read_table(ROOT / "data_prep/sample/fwe_sample_00001.parquet").column("text").to_pylist()[:200]
    texts += ["  two leading spaces", "digits 12345 and 3.14", "tabs\tand\nnew lines\n\n  x", "émoji 🎉 日本語", " ",
              "a  b"]
    for text in texts:
        assert theirs(text).input_ids == [ours.bos] + ours.encode(text), text[:80]
        assert theirs.decode(ours.encode(text)) == ours.decode(ours.encode(text))
    assert hf_tokenizer(sample_shards["tokenizer"], add_bos=False)("x").input_ids == ours.encode("x")


@pytest.mark.slow
def test_the_exported_tokenizer_loads_without_remote_code(sample_shards, tmp_path):
    """The tokenizer is transformers' own class (tokenizer.json, no code): PreTrainedTokenizerFast
    loads a κ export's, and AutoTokenizer a native class's, with no trust_remote_code and no y/N
    prompt, encoding as the run's SentencePiece does. Negative control: AutoTokenizer on the κ
    export prompts, as transformers 5 reads config.json (whose auto_map names the modeling file)
    before the tokenizer: what the card and docs/export.md say."""
    import subprocess
    import sys

    from megatron_kappa.export.tokenizer import hf_tokenizer
    from megatron_kappa.tokenizer import Tokenizer
    ours, text = Tokenizer(sample_shards["tokenizer"]), "The water cycle moves 1,234 drops."
    configs = {"kappa": {"model_type": "kappa_moe", "auto_map": {
                   "AutoConfig": "modeling_kappa_moe.KappaMoeConfig",
                   "AutoModelForCausalLM": "modeling_kappa_moe.KappaMoeForCausalLM"}},
               "native": {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}}
    for name, config in configs.items():
        hf_tokenizer(sample_shards["tokenizer"], add_bos=True, model_max_length=64).save_pretrained(tmp_path / name)
        (tmp_path / name / "config.json").write_text(json.dumps(config))

    def load(cls, name):
        code = (f"import json; from transformers import {cls}; t = {cls}.from_pretrained({str(tmp_path / name)!r}); "
                f"print('ids', json.dumps(t({text!r}).input_ids))")
        done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, input="n\n", capture_output=True, text=True,
                              timeout=300, env={**hf_env(), "PYTHONPATH": str(ROOT)})
        assert done.returncode == 0, done.stderr[-2000:]
        said, ids = done.stdout.rsplit("ids ", 1)  # the prompt ends without a newline
        assert json.loads(ids) == [ours.bos] + ours.encode(text), (cls, name)
        return said
    assert "[y/N]" not in load("PreTrainedTokenizerFast", "kappa")
    assert "[y/N]" not in load("AutoTokenizer", "native")
    assert "[y/N]" in load("AutoTokenizer", "kappa")  # the negative control


def test_softmoe_and_native_classes_refuse_what_they_cannot_hold():
    from megatron_kappa.export.convert import target_for
    from megatron_kappa.model.layout import model_layout

    def target(*sets, requested="auto"):
        cfg = load_config("configs/tiny.yaml", list(sets))
        return target_for(cfg.model, model_layout(cfg), requested)
    assert target() == "kappa_moe"  # κ on
    assert target("model.kappa.enabled=false") == "qwen3_moe"
    assert target("model.kappa.enabled=false", "model.qk_layernorm=false", "model.first_dense=0") == "mixtral"
    assert target("model.kappa.enabled=false", "model.qk_layernorm=false") == "kappa_moe"  # a dense layer, no q/k norm
    assert target("model.kappa.enabled=false", "model.moe.router=sigmoid") == "kappa_moe"
    mla = ["model.attention_kind=mla", "model.mla.q_lora_rank=32", "model.mla.kv_lora_rank=16"]
    deepseek = [*mla, "model.kappa.enabled=false", "model.moe.router=sigmoid", "model.moe.shared_ffn_hidden_size=512",
                "model.norm_eps=1e-6"]
    assert target(*deepseek) == "deepseek_v3"
    assert target(*deepseek, "model.norm_eps=1e-5") == "kappa_moe"  # its latent norms' epsilon is fixed
    assert target(*deepseek, "model.moe.shared_ffn_hidden_size=300") == "kappa_moe"  # not n × the expert width
    assert target(*mla) == "kappa_moe"  # κ with MLA: the project's file
    with pytest.raises(ConfigError, match="model.attention_kind is mla"):
        target(*mla, "model.kappa.enabled=false", requested="qwen3_moe")
    with pytest.raises(ConfigError, match="--target qwen3_moe: model.kappa.enabled is true"):
        target(requested="qwen3_moe")
    with pytest.raises(ConfigError, match="softmoe: the export does not implement"):
        target("model.moe.router=softmoe", "model.moe.capacity_factor=null")


def test_an_export_refuses_an_existing_output_or_a_folder_that_is_not_a_run(tmp_path):
    from megatron_kappa.export import writer
    (tmp_path / "taken").mkdir()
    with pytest.raises(ConfigError, match="exists"):
        writer.export(tmp_path / "run", tmp_path / "taken")
    with pytest.raises(ConfigError, match="no config.yaml"):
        writer.export(tmp_path / "run", tmp_path / "new")
    assert not (tmp_path / "new").exists() and not (tmp_path / "new.tmp").exists()
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"--output: .*/file is a file, not a folder \(under which"):
        writer.export(tmp_path / "run", tmp_path / "file" / "deeper" / "hf")
    # a folder whose parents do not exist yet is fine: the check reaches the run's own error
    with pytest.raises(ConfigError, match="no config.yaml"):
        writer.export(tmp_path / "run", tmp_path / "not" / "yet" / "hf")


def test_the_modeling_file_pads_left_and_caches_like_one_full_forward():
    """modeling_kappa_moe.py on its own: a left-padded batch gives each row's unpadded logits, and
    decoding through its cache gives the full forward's last logits. Negative control: the padding
    mask dropped changes the padded row."""
    from transformers import DynamicCache

    from megatron_kappa.export.modeling_kappa_moe import KappaMoeConfig, KappaMoeForCausalLM
    torch.manual_seed(0)
    config = KappaMoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=48, moe_intermediate_size=24, num_experts=4,
                            mlp_layer_types=["dense", "moe", "moe"], router_score="sigmoid",
                            kappa=dict(U=3.0, logit_scale=1.0, tanh_gain=1.0, use_alpha=True, use_bias=True,
                                       input="logit"),
                            norm_gains=False, residual_scalars=True, embedding_norm=True, value_embedding_layers=[0, 2])
    model = KappaMoeForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    short, long = torch.randint(0, 64, (1, 5)), torch.randint(0, 64, (1, 9))
    batch = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1), long])
    mask = torch.cat([torch.cat([torch.zeros(1, 4), torch.ones(1, 5)], 1), torch.ones(1, 9)]).long()
    with torch.no_grad():
        padded = model(batch, attention_mask=mask).logits
        alone = model(short).logits
        assert (padded[0, 4:] - alone[0]).abs().max() <= 1e-5 * alone.abs().max()
        assert (padded[1] - model(long).logits[0]).abs().max() <= 1e-5 * alone.abs().max()
        assert (model(batch).logits[0, 4:] - alone[0]).abs().max() > 1e-3  # negative control
        cache = DynamicCache()
        model(long[:, :6], cache=cache, use_cache=True)
        step = model(long[:, 6:7], cache=cache, use_cache=True).logits[0, -1]
        step = model(long[:, 7:8], cache=cache, use_cache=True).logits[0, -1]
        full = model(long[:, :8]).logits[0, -1]
        assert (step - full).abs().max() <= 1e-5 * full.abs().max()
