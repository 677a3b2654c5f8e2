"""Hugging Face import (issue 55): `train.init_weights: <folder>` starts a run from a folder of the
export's classes, tiny random models made here by transformers (and the project's modeling file),
no hub download: Qwen3-MoE, Mixtral, DeepSeek-V3 (MLA, sigmoid router with its bias, group-limited
routing, a shared expert, a dense first layer) and the κ model (κ-SwiGLU, sigmoid router, shared
expert, the nanochat block, GQA).

Shown: the project's model, configured by the folder's settings (the export targets' config map
read backwards) and loaded from it, gives the Hugging Face model's logits (fp32, within 1e-5 of
their scale); its weights written back through the export's map are the folder's bit for bit;
and the whole way, export → import → export, through a 2-process layout (TP2 or EP2): a run that
starts from the folder and takes one step at learning rate 0, exported by `python -m
megatron_kappa.export`, gives back the folder's tensors bit for bit and its config's fields.
Negative controls: a transposed weight (a square one: other logits; another: one line naming it),
a wrong name map (Mixtral's w1 and w3 swapped: other logits; a name nothing maps: one line), a
model whose settings differ, an unsupported class and an unsupported config field, each refused
in one line."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_kappa.config import ConfigError, load_config
from tests.support.export_runs import hf_env

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 300  # not a multiple of 128: the import pads the rows for the layout
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, rms_norm_eps=1e-6,
              max_position_embeddings=64, num_experts_per_tok=2, tie_word_embeddings=False)


def qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    return Qwen3MoeForCausalLM, Qwen3MoeConfig(**COMMON, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                                               moe_intermediate_size=32, num_experts=4, norm_topk_prob=True,
                                               mlp_only_layers=[0], rope_parameters={"rope_type": "default",
                                                                                    "rope_theta": 10000.0})


def mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM
    return MixtralForCausalLM, MixtralConfig(**COMMON, num_key_value_heads=2, intermediate_size=48, num_local_experts=4,
                                             rope_parameters={"rope_type": "default", "rope_theta": 1e6})


def deepseek_v3():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    return DeepseekV3ForCausalLM, DeepseekV3Config(
        **COMMON, num_key_value_heads=4, intermediate_size=96, moe_intermediate_size=32, n_routed_experts=4,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        head_dim=8, num_nextn_predict_layers=1, rope_interleave=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def kappa_moe():
    from megatron_kappa.export.modeling_kappa_moe import KappaMoeConfig, KappaMoeForCausalLM
    config = KappaMoeConfig(**COMMON, num_key_value_heads=2, intermediate_size=96, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32, num_experts=4, mlp_layer_types=["dense", "moe", "moe"],
                            router_score="sigmoid", kappa=dict(U=4.0, logit_scale=1.0, tanh_gain=1.0, use_alpha=True,
                                                               use_bias=True, input="normalized"),
                            norm_gains=False, embedding_norm=True, residual_scalars=True, value_embedding_layers=[0, 2],
                            logit_softcap=15.0, rope_theta=10000.0)
    config.architectures = ["KappaMoeForCausalLM"]
    return KappaMoeForCausalLM, config


MODELS = {"qwen3_moe": qwen3_moe, "mixtral": mixtral, "deepseek_v3": deepseek_v3, "kappa_moe": kappa_moe}
LAYOUTS = {"qwen3_moe": "parallel.tp=2", "mixtral": "parallel.ep=2", "deepseek_v3": "parallel.tp=2",
           "kappa_moe": "parallel.ep=2"}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Each MODELS entry with random weights (std 0.3: every part matters), saved as transformers
    saves it. The routers' weights are scaled down: sigmoid scores saturated at 1.0 tie, and two
    top-k implementations may break a tie differently."""
    out = {}
    for name, make in MODELS.items():
        cls, config = make()
        torch.manual_seed(1)
        model = cls(config).eval()
        with torch.no_grad():
            for key, p in model.named_parameters():
                p.copy_(torch.randn_like(p) * (0.05 if key.endswith("gate.weight") else 0.3))
            for key, b in model.named_buffers():
                if key.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn_like(b) * 0.05)
        folder = tmp_path_factory.mktemp(name) / "hf"
        model.save_pretrained(folder)
        out[name] = folder
    return out


def run_config(folder, *sets):
    from megatron_kappa.import_hf.folder import HFFolder
    return load_config("configs/tiny.yaml", [*HFFolder(folder, "--hf").overrides(), "model.seq_length=32",
                                             f"train.init_weights={folder}", *sets])


def imported_model(folder, *sets):
    from megatron_kappa.import_hf.weights import load_into
    from megatron_kappa.model.build import build_model
    cfg = run_config(folder, *sets)
    model = build_model(cfg, "cpu")
    load_into(model, cfg, folder)
    return model.eval(), cfg


def ids():
    return torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))


def hf_logits(folder, name):
    cls, _ = MODELS[name]()
    model = cls.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids()).logits.double()


def our_logits(model):
    tokens = ids()
    with torch.no_grad():
        return model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None)[..., :VOCAB].double()


def close(got, want):
    return (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def hf_tensors(folder) -> dict:
    from safetensors.torch import load_file
    return {k: v for f in sorted(Path(folder).glob("*.safetensors")) for k, v in load_file(f).items()}


def exported_again(model, cfg, adapter) -> dict:
    """The model's weights through the export's map (what `python -m megatron_kappa.export` writes)."""
    from megatron_kappa.model.layout import model_layout
    state, layout, out = model.state_dict(), model_layout(cfg), {}
    for i in range(cfg.model.num_layers):
        out.update(adapter.to_hf(cfg.model, layout, i, lambda rel, i=i: state.get(f"decoder.layers.{i}.{rel}")))
    out.update(adapter.outer_to_hf(cfg.model, state.get))
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_the_imported_model_gives_the_hf_models_logits_and_its_weights_back(world1, folders, name):
    from megatron_kappa.export import targets
    folder = folders[name]
    model, cfg = imported_model(folder)
    want = hf_logits(folder, name)
    got = our_logits(model)
    assert want.abs().max() > 1  # logits that carry the weights
    assert close(got, want), (got - want).abs().max()
    original, back = hf_tensors(folder), exported_again(model, cfg, targets.lookup(name))
    assert back.keys() == original.keys()
    assert [k for k in original if not torch.equal(original[k], back[k])] == []


@pytest.mark.parametrize("target", ["kappa_moe", "qwen3_moe", "mixtral", "deepseek_v3"])
def test_settings_read_back_the_models_that_each_target_exports(target):
    """Every target's `settings` inverts its `config` on the export tests' models (each with every
    optional part its class can carry, tests/test_export_adapters.py): the settings make a model
    whose config.json is the same. Negative control: a κ setting changed is seen."""
    from megatron_kappa.export import targets
    from megatron_kappa.import_hf.folder import config_class
    from megatron_kappa.model.build import kappa_settings
    from megatron_kappa.model.layout import model_layout
    from tests.support.settings import MODELS as EXPORTED
    adapter, special = targets.lookup(target), {"bos": 1, "eos": 2, "pad": 3}

    def config_json(cfg):
        return adapter.config(cfg.model, model_layout(cfg), special,
                              kappa_settings(cfg.model.kappa) if cfg.model.kappa.enabled else None)
    cfg = load_config("configs/tiny.yaml", [*EXPORTED[target], "model.seq_length=32"])
    written = config_json(cfg)
    hf = config_class(adapter).from_dict(json.loads(json.dumps(written)))
    sets = [f"{k}={json.dumps(v)}" for k, v in adapter.settings(hf).items()]
    assert config_json(load_config("configs/tiny.yaml", [*sets, "model.seq_length=32"])) == written
    if target == "kappa_moe":
        other = load_config("configs/tiny.yaml", [*sets, "model.seq_length=32", "model.kappa.U=2.0"])
        assert config_json(other) != written


def test_a_transposed_weight_is_seen(world1, folders, tmp_path):
    """A square weight transposed loads (its shape fits) but gives other logits; a non-square one is
    refused in one line naming it."""
    import shutil

    from safetensors.torch import load_file, save_file
    folder = tmp_path / "hf"
    shutil.copytree(folders["qwen3_moe"], folder)
    path = folder / "model.safetensors"
    state = load_file(path)
    square = "model.layers.1.self_attn.o_proj.weight"  # [64, 4 × 16]
    assert state[square].shape[0] == state[square].shape[1]
    save_file({**state, square: state[square].t().contiguous()}, path, metadata={"format": "pt"})
    model, _ = imported_model(folder)
    want = hf_logits(folders["qwen3_moe"], "qwen3_moe")
    assert (our_logits(model) - want).abs().max() > 1e-2
    wide = "model.layers.1.mlp.experts.0.down_proj.weight"  # [64, 32]
    save_file({**state, wide: state[wide].t().contiguous()}, path, metadata={"format": "pt"})
    with pytest.raises(ConfigError) as e:
        imported_model(folder)
    assert "\n" not in str(e.value) and "does not hold this model's weights" in str(e.value) \
        and "linear_fc2" in str(e.value), e.value


def test_a_wrong_name_map_is_seen(world1, folders, monkeypatch):
    """Mixtral's map with w1 and w3 (gate and up) swapped loads but gives other logits; a name the
    map does not cover is refused in one line."""
    from megatron_kappa.export import targets
    from megatron_kappa.export.targets.mixtral import Mixtral
    want = hf_logits(folders["mixtral"], "mixtral")
    mixtral = targets.lookup("mixtral")  # the registered target, its name map swapped for this test
    swapped = tuple((a, {"w1.": "w3.", "w3.": "w1."}.get(b, b)) for a, b in Mixtral.renames)
    monkeypatch.setattr(mixtral, "renames", swapped)
    model, _ = imported_model(folders["mixtral"])
    assert (our_logits(model) - want).abs().max() > 1e-2
    monkeypatch.setattr(mixtral, "renames", Mixtral.renames[:-1] + (("up_proj.", "w9."),))
    with pytest.raises(ConfigError, match=r"^config: train.init_weights: .*: layer 0: .*w9.weight missing"):
        imported_model(folders["mixtral"])


def test_a_run_whose_model_differs_is_refused_in_one_line(world1, folders):
    from megatron_kappa.import_hf.weights import load_into
    from megatron_kappa.model.build import build_model
    cfg = run_config(folders["qwen3_moe"], "model.hidden_size=128")
    with pytest.raises(ConfigError) as e:
        load_into(build_model(cfg, "cpu"), cfg, folders["qwen3_moe"])
    message = str(e.value)
    assert "\n" not in message and "hidden_size is 64, the run's model has 128" in message
    assert "the folder's model is model.hidden_size=64" in message
    cfg = run_config(folders["qwen3_moe"], "model.kappa.enabled=true")
    with pytest.raises(ConfigError, match=r"holds a Qwen3MoeForCausalLM, which cannot be this run's model: "
                                          r"model.kappa.enabled is true"):
        load_into(build_model(cfg, "cpu"), cfg, folders["qwen3_moe"])


def test_unsupported_classes_and_fields_are_refused_in_one_line(folders, tmp_path):
    import shutil

    from megatron_kappa.import_hf.folder import HFFolder
    for edit, expected in (
            ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
             r"LlamaForCausalLM \(model_type llama\) is not a class the import reads; expected one of "
             r"KappaMoeForCausalLM \(kappa_moe\), Qwen3MoeForCausalLM"),
            ({"use_sliding_window": True}, r"use_sliding_window is true, the run's model has false"),
            ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 32}}, r"rope_parameters is .*yarn"),
            ({"some_new_field": 3}, r"some_new_field \(3\) is not a field the import knows for Qwen3MoeForCausalLM"),
            ({"attention_dropout": 0.1}, r"attention_dropout is 0.1, the run's model has 0.0")):
        folder = tmp_path / "hf"
        shutil.rmtree(folder, ignore_errors=True)
        shutil.copytree(folders["qwen3_moe"], folder)
        raw = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**raw, **edit}))
        with pytest.raises(ConfigError) as e:
            hf = HFFolder(folder, "--hf")
            hf.check(load_config("configs/tiny.yaml", [*HFFolder(folders["qwen3_moe"], "--hf").overrides()]))
        assert "\n" not in str(e.value), e.value
        import re
        assert re.search(expected, str(e.value)), (expected, str(e.value))


def test_the_preflight_checks_the_folder_against_the_model(folders, tmp_path):
    """Before any process group: the folder's config against the run's model, one line."""
    from megatron_kappa.preflight import preflight
    sets = ["data.mock=true", f"run.dir={tmp_path / 'run'}"]
    preflight(run_config(folders["mixtral"], *sets), world=1)  # the folder's own settings: accepted
    with pytest.raises(ConfigError) as e:
        preflight(run_config(folders["mixtral"], *sets, "model.moe.num_experts=8"), world=1)
    assert "\n" not in str(e.value) and "num_local_experts is 4, the run's model has 8" in str(e.value), e.value
    with pytest.raises(ConfigError, match="no such file or folder"):
        preflight(load_config("configs/tiny.yaml", [*sets, f"train.init_weights={tmp_path / 'none'}"]), world=1)


def test_a_junk_or_truncated_safetensors_file_is_one_line_before_anything_is_written(folders, tmp_path):
    """model.safetensors junk (it was a 21-line SafetensorError traceback, after config.yaml was
    written) or cut short: the launcher stops in one line naming the file before it writes
    anything; the intact folder passes the same preflight (control, above)."""
    import shutil

    from megatron_kappa.import_hf.folder import HFFolder
    from megatron_kappa.preflight import preflight
    folder = tmp_path / "hf"
    shutil.copytree(folders["mixtral"], folder)
    whole = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(b"\x00junk, not a safetensors file" * 10)
    run_dir = tmp_path / "run"
    overrides = [*HFFolder(folder, "--hf").overrides(), f"train.init_weights={folder}", f"run.dir={run_dir}",
                 "data.mock=true", "model.seq_length=32", "train.steps=1"]
    done = subprocess.run([sys.executable, "launch/pretrain.py", "--config", "configs/tiny.yaml", "--set", *overrides],
                          cwd=ROOT, env=hf_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert done.stderr.startswith(f"error: config: train.init_weights: {folder / 'model.safetensors'}: not a "
                                  "readable safetensors file ("), done.stderr
    assert not (run_dir / "config.yaml").exists()
    (folder / "model.safetensors").write_bytes(whole[:len(whole) // 2])
    with pytest.raises(ConfigError, match=r"^config: train.init_weights: .*model.safetensors: not a readable "
                                          r"safetensors file \(.*\)$"):
        preflight(run_config(folder, "data.mock=true", f"run.dir={run_dir}"), world=1)


def test_the_cli_prints_the_settings_and_writes_a_config(folders, tmp_path):
    out = tmp_path / "run.yaml"
    done = subprocess.run([sys.executable, "-m", "megatron_kappa.import_hf", "--hf", str(folders["deepseek_v3"]),
                           "--set", "data.mock=true", "--output", str(out)], cwd=ROOT, env=hf_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "DeepseekV3ForCausalLM" in done.stdout and "model.attention_kind=mla" in done.stdout
    cfg = load_config(out)
    assert cfg.train.init_weights == str(folders["deepseek_v3"].resolve()) and cfg.model.mla.kv_lora_rank == 16
    assert cfg.model.moe.route_scale == 2.5 and cfg.model.first_dense == 1 and cfg.data.mock
    done = subprocess.run([sys.executable, "-m", "megatron_kappa.import_hf", "--hf", str(tmp_path)], cwd=ROOT,
                          env=hf_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "no config.json" in done.stderr


@pytest.mark.slow
def test_export_import_export_round_trips_through_a_parallel_layout(folders, tmp_path):
    """Each folder starts a 2-process run (TP2 or EP2) that takes one step at learning rate 0; the
    run's export is the folder again, bit for bit, and its config.json has the folder's fields."""
    from megatron_kappa.import_hf.folder import HFFolder
    from tests.support.pipeline_runs import launch
    zero = ["train.lr=0", "train.lr_non_matrix=0", "model.kappa.lr=0", "model.kappa.lr_end=0",
            "train.lr_resid_scalar=0", "train.lr_x0_scalar=0", "model.moe.bias_update_rate=0",
            "model.kappa.freeze_fraction=0", "train.steps=1",
            "train.micro_batch=2", "train.global_batch=4", "data.mock=true", "eval.valid_every=0",
            "log.tensorboard=false", "checkpoint.interval=1", "model.seq_length=32"]
    plan = [{"overrides": [*HFFolder(folders[name], "--hf").overrides(), *zero, LAYOUTS[name],
                           f"train.init_weights={folders[name]}", f"run.dir={tmp_path / name}"]} for name in MODELS]
    launch(tmp_path, plan, 2)
    for name in MODELS:
        out = tmp_path / f"{name}_hf"
        done = subprocess.run([sys.executable, "-m", "megatron_kappa.export", "--checkpoint", str(tmp_path / name),
                               "--output", str(out), "--target", name, "--no-progress"], cwd=ROOT, env=hf_env(),
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        original, again = hf_tensors(folders[name]), hf_tensors(out)
        assert again.keys() == original.keys(), name
        assert [k for k in original if not torch.equal(original[k], again[k])] == [], name
        # the config: the export's config.json reads back as the folder's model
        assert HFFolder(out, "--hf").settings() == HFFolder(folders[name], "--hf").settings(), name
