"""The export targets as state-dict adapters (megatron_kappa.export.targets): for every registered
target, `from_hf` gives back every tensor `to_hf` wrote under its megatron name, bit for bit (the
later Hugging Face import reads through it), and the converter holds no target's name. Negative
controls: an adapter whose names collide, and one whose join swaps two tensors, are caught."""
from pathlib import Path

import pytest
import torch

from megatron_kappa.config import load_config
from megatron_kappa.export import convert, targets
from megatron_kappa.export.adapter import Rule
from megatron_kappa.export.targets.mixtral import Mixtral
from megatron_kappa.export.targets.qwen3_moe import Qwen3Moe
from megatron_kappa.model.layout import model_layout
from tests.support.settings import MODELS

ROOT = Path(__file__).resolve().parents[1]
NOT_EXPORTED = ("_extra_state", "local_tokens_per_expert")  # megatron's bookkeeping, not weights


def trained_state(sets):
    """(config, layout, {megatron name: tensor}) of a tiny model with random weights."""
    from megatron_kappa.model.build import build_model
    cfg = load_config("configs/tiny.yaml", [*sets, "model.seq_length=32"])
    torch.manual_seed(0)
    model = build_model(cfg, "cpu")
    state = {k: torch.randn_like(v.float()).to(v.dtype) if v.is_floating_point() else v
             for k, v in model.state_dict().items() if not k.endswith(NOT_EXPORTED)}
    return cfg, model_layout(cfg), state


def round_trip_problems(adapter, cfg, layout, state) -> list[str]:
    """What does not come back when the model goes to_hf then from_hf: names lost, added or moved,
    and tensors changed. The vocabulary's padding rows are the only thing the export drops."""
    v, problems, exported, covered = cfg.model.vocab_size, [], [], set()
    for i in range(cfg.model.num_layers):
        prefix = f"decoder.layers.{i}."
        hf = adapter.to_hf(cfg.model, layout, i, lambda rel: state.get(prefix + rel))
        exported += hf
        try:
            back = {prefix + k: t for k, t in adapter.from_hf(cfg.model, layout, i, hf).items()}
        except KeyError as e:
            problems.append(f"layer {i}: {e}")
            continue
        problems += compare(back, {k: t for k, t in state.items() if k.startswith(prefix)}, v)
        covered |= set(back)
    hf = adapter.outer_to_hf(cfg.model, state.get)
    exported += hf
    back = adapter.outer_from_hf(cfg.model, hf)
    problems += compare(back, {k: state[k] for k in back}, v)
    covered |= set(back)
    problems += [f"{name}: not exported" for name in sorted(set(state) - covered) if not name.startswith("mtp.")]
    problems += [f"{name}: written twice" for name in sorted(set(exported)) if exported.count(name) > 1]
    return problems


def compare(back: dict, want: dict, vocab: int) -> list[str]:
    problems = [f"{name}: came back, not in the model" for name in sorted(set(back) - set(want))]
    for name in sorted(set(back) & set(want)):
        w = want[name][:vocab] if name.endswith(("word_embeddings.weight", "output_layer.weight", "value_embedding")) \
            else want[name]
        if back[name].shape != w.shape or not torch.equal(back[name], w):
            problems.append(f"{name}: a different tensor came back")
    return problems


def test_the_registry_holds_the_four_targets():
    assert convert.choices() == ["auto", "kappa_moe", "qwen3_moe", "mixtral", "deepseek_v3"]
    assert [a.name for a in targets.auto_order()] == ["qwen3_moe", "mixtral", "deepseek_v3", "kappa_moe"]
    assert set(MODELS) == set(targets.TARGETS)  # a new target gets a model in MODELS, so its round trip is tested


@pytest.mark.parametrize("target", list(MODELS))
def test_from_hf_undoes_to_hf(world1, target):
    cfg, layout, state = trained_state(MODELS[target])
    adapter = targets.lookup(target)
    assert adapter.refusals(cfg.model, layout) == [] and convert.target_for(cfg.model, layout, target) == target
    assert round_trip_problems(adapter, cfg, layout, state) == []


def test_a_broken_inverse_is_caught(world1):
    """Negative controls: Mixtral's names with two hub names written as one (w1), and Qwen3-MoE
    with q/k/v joined in the wrong order."""
    class Colliding(Mixtral):
        renames = Mixtral.renames[:-1] + (("up_proj.", "w1."),)

    class Swapped(Qwen3Moe):
        def layer_rules(self, model, layout, i):
            rules = super().layer_rules(model, layout, i)
            return [Rule(r.megatron, r.hf, r.split, (lambda ts, join=r.join: join([ts[0], ts[2], ts[1]])), r.required)
                    if r.megatron.endswith("linear_qkv.weight") else r for r in rules]

    cfg, layout, state = trained_state(MODELS["mixtral"])
    problems = round_trip_problems(Colliding(), cfg, layout, state)
    assert problems and problems[0].startswith("layer 0: ") and "experts.0.w1.weight" in problems[0], problems[:2]
    cfg, layout, state = trained_state(MODELS["qwen3_moe"])
    problems = round_trip_problems(Swapped(), cfg, layout, state)
    assert problems == [f"decoder.layers.{i}.self_attention.linear_qkv.weight: a different tensor came back"
                        for i in range(cfg.model.num_layers)]


def test_from_hf_refuses_a_tensor_it_has_no_name_for(world1):
    cfg, layout, state = trained_state(MODELS["qwen3_moe"])
    adapter = targets.lookup("qwen3_moe")
    hf = adapter.to_hf(cfg.model, layout, 1, lambda rel: state.get("decoder.layers.1." + rel))
    with pytest.raises(KeyError, match="layer 1: no megatron tensor for model.layers.1.mlp.extra.weight"):
        adapter.from_hf(cfg.model, layout, 1, {**hf, "model.layers.1.mlp.extra.weight": torch.zeros(1)})
    del hf["model.layers.1.self_attn.k_proj.weight"]
    with pytest.raises(KeyError, match="k_proj.weight missing"):
        adapter.from_hf(cfg.model, layout, 1, hf)


def test_the_converter_names_no_target():
    names = list(targets.TARGETS)
    sources = {p: (ROOT / "megatron_kappa/export" / p).read_text() for p in ("convert.py", "writer.py")}
    assert {p: [n for n in names if n in s] for p, s in sources.items()} == {p: [] for p in sources}
    assert [n for n in names if n in 'if target == "mixtral":'] == ["mixtral"]  # negative control
