"""The attention registry (megatron_kappa.attention_kinds): a kind added at run time by one
register(...) trains through the unchanged training loop and is refused by the export and the
planner in one line; one key names the kind (model.attention_kind), the retired MLA switch
(model.mla.enabled) is refused saying what to write; the registry stays torch-free and is the only
reader of MLA's keys."""
import re
from pathlib import Path

import pytest
import yaml

from megatron_kappa import attention_kinds
from megatron_kappa.checkpoint import resume
from megatron_kappa.config import ConfigError, facts, load_config, load_recorded, to_dict
from megatron_kappa.config.schema import Config
from tests.support.bare_python import run_bare
from tests.support.settings import MLA  # the tiny MLA settings
from tests.support.toy_attention import TOY, CountingAttention, toy_kind

ROOT = Path(__file__).resolve().parents[1]
STEPS, MICRO_BATCHES, LAYERS = 2, 2, 4  # configs/tiny.yaml: 4 layers
TRAIN = [f"train.steps={STEPS}", "log.interval=1", "data.mock=true", "model.seq_length=32",
         "train.micro_batch=2", f"train.global_batch={2 * MICRO_BATCHES}", "eval.valid_every=0",
         "checkpoint.interval=2", "log.tensorboard=false"]


@pytest.fixture
def toy():
    attention_kinds.register(TOY, toy_kind())
    yield TOY
    attention_kinds.unregister(TOY)


def test_a_toy_kind_is_one_registration_that_trains_and_the_export_refuses(world1, tmp_path, capsys, toy):
    """The toy kind validates, builds (its class and its q/k/v bias in every layer) and trains 2
    steps through the unchanged loop; the export refuses its run in one line naming
    model.attention_kind (its entry names no Hugging Face tensors). Negative control: the default
    kind's run exports."""
    from megatron_kappa.export.__main__ import main as export
    from megatron_kappa.train.loop import run
    runs = {}
    for name in (toy, "gqa"):
        runs[name] = tmp_path / name
        cfg = load_config("configs/tiny.yaml", TRAIN + [f"run.dir={runs[name]}", f"model.attention_kind={name}"])
        CountingAttention.forwards = 0
        run(cfg, log=lambda *a: None)
        assert CountingAttention.forwards == (STEPS * MICRO_BATCHES * LAYERS if name == toy else 0)
    capsys.readouterr()
    assert export(["--checkpoint", str(runs[toy]), "--output", str(tmp_path / "hf"), "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        f"error: model.attention_kind: {toy}: no exported model computes this attention kind (its registry entry "
        "names no Hugging Face tensors, hf_names); export a run of gqa or mla\n")
    assert not (tmp_path / "hf").exists()
    assert export(["--checkpoint", str(runs["gqa"]), "--output", str(tmp_path / "hf"), "--no-progress"]) == 0
    assert "kappa_moe from step 2" in capsys.readouterr().out


def test_the_toy_kinds_settings_reach_the_model(world1, toy):
    """megatron's settings of the kind (add_qkv_bias) shape the built model; gqa's do not."""
    from megatron_kappa.model.build import build_model
    biases = {}
    for name in (toy, "gqa"):
        model = build_model(load_config("configs/tiny.yaml", [f"model.attention_kind={name}"]), meta=True)
        biases[name] = sum(n.endswith("linear_qkv.bias") for n, _ in model.named_parameters())
    assert biases == {toy: LAYERS, "gqa": 0}


def test_the_planner_refuses_a_kind_it_does_not_model(toy):
    from megatron_kappa import plan
    cfg = load_config("configs/tiny.yaml", [f"model.attention_kind={toy}"])
    with pytest.raises(ConfigError, match=f"^plan: model.attention_kind: {toy} is not modelled by the planner$"):
        plan.plan(cfg, plan.Layout(1))
    plan.plan(load_config("configs/tiny.yaml", []), plan.Layout(1))  # control: the default kind


RETIRED = (r"^config: model.mla.enabled: no longer a key: model.attention_kind alone picks the attention: write "
           r"`model.attention_kind: mla` for true, and nothing for false \(gqa is the default\)$")


def test_one_key_names_the_kind_and_the_retired_switch_is_refused(tmp_path):
    """model.attention_kind alone picks the attention (gqa by default); model.mla.enabled, the
    switch that once stood beside it, is refused in one line that says what to write instead,
    from --set or a file; a run's recorded config.yaml with it reads as its kind
    (load_recorded: older runs still export); an unknown name is refused naming the registered ones."""
    assert attention_kinds.name_of(load_config("configs/tiny.yaml", []).model) == "gqa"
    assert attention_kinds.name_of(load_config("configs/tiny.yaml", MLA).model) == "mla"
    assert attention_kinds.name_of(load_config("configs/frontier/deepseek_v3.yaml").model) == "mla"
    for value in ("true", "false"):
        with pytest.raises(ConfigError, match=RETIRED):
            load_config("configs/tiny.yaml", [*MLA, f"model.mla.enabled={value}"])
    old = to_dict(load_config("configs/tiny.yaml", MLA))
    old["model"].update(attention_kind=None, mla={**old["model"]["mla"], "enabled": True})  # as recorded before
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    with pytest.raises(ConfigError, match=RETIRED):
        load_config(tmp_path / "config.yaml")
    assert attention_kinds.name_of(load_recorded(tmp_path / "config.yaml").model) == "mla"
    old["model"]["mla"]["enabled"] = False  # negative control: the recorded switch decides
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert attention_kinds.name_of(load_recorded(tmp_path / "config.yaml").model) == "gqa"
    with pytest.raises(ConfigError, match=r"model.attention_kind: expected one of \['gqa', 'mla'\], got 'nope'"):
        load_config("configs/tiny.yaml", ["model.attention_kind=nope"])
    # an export written with the switch (modeling_kappa_moe.py's mla entry had `enabled`) imports as its kind
    exported = {"enabled": True, **{k: v for k, v in old["model"]["mla"].items() if k != "enabled"}}
    sets = attention_kinds.lookup("mla").from_hf_config(exported)
    assert sets["model.attention_kind"] == "mla" and not any(k.endswith("enabled") for k in sets)
    assert load_config("configs/tiny.yaml", [f"{k}={'null' if v is None else v}" for k, v in sets.items()]).model.mla \
        == load_config("configs/tiny.yaml", MLA).model.mla


def test_what_a_resume_may_not_change_covers_every_kinds_section():
    """The kind's name and each kind's own section are refused on resume (the schema's `state`);
    a checkpoint's config recorded with model.mla.enabled (before the one switch) resumes under the
    kind it named, and is refused under another."""
    state = facts.marked(Config, "state")
    assert "model.attention_kind" in state
    for name, kind in attention_kinds.KINDS.items():
        assert kind.section is None or f"model.{kind.section}" in state, name
    for sets, enabled in ((MLA, True), ([], False)):
        now = to_dict(load_config("configs/tiny.yaml", sets))
        recorded_mla = {**now["model"]["mla"], "enabled": enabled}
        old = {**now, "model": {**now["model"], "attention_kind": None, "mla": recorded_mla}}
        assert resume.changes(old, now)[0] == [], sets
        other = to_dict(load_config("configs/tiny.yaml", [] if enabled else MLA))  # control: another kind
        assert "model.attention_kind" in resume.changes(old, other)[0], sets


def test_the_recompute_module_of_a_kind_needs_it():
    with pytest.raises(ConfigError, match="mla_up_proj needs model.mla"):
        load_config("configs/tiny.yaml", ["model.recompute=selective", "model.recompute_modules=[mla_up_proj]"])
    load_config("configs/tiny.yaml", [*MLA, "model.recompute=selective", "model.recompute_modules=[mla_up_proj]"])


def test_the_registry_and_the_config_import_no_torch():
    code = ("import sys; from megatron_kappa import attention_kinds; from megatron_kappa.config import load_config; "
            f"cfg = load_config(None, {MLA!r} + ['model.qk_layernorm=false']); "
            "print('TORCH', 'torch' in sys.modules, attention_kinds.name_of(cfg.model))")
    done = run_bare(code)
    assert "TORCH False mla" in done.stdout, done.stdout + done.stderr


def test_a_piece_called_before_its_module_is_imported_says_so():
    early = attention_kinds.KINDS.piece("nowhere", "attention")
    with pytest.raises(RuntimeError, match="model.attention_kind: nowhere: its attention comes from "
                                           "model/attention_kinds/nowhere.py, which is not imported yet"):
        early(None, None, None)
    with pytest.raises(ValueError, match="gqa: attention is not a piece its entry leaves to its module"):
        attention_kinds.implement("gqa", attention=print)


# what reads MLA's switch or section (issue 51's grep)
MLA_READS = re.compile(r"mla.enabled|m\.mla|\.mla\.")
OWNERS = {"megatron_kappa/attention_kinds.py", "megatron_kappa/model/attention_kinds/mla.py",
          "megatron_kappa/config/schema.py"}


def mla_readers(files) -> set[str]:
    return {str(p.relative_to(ROOT)) for p in files if MLA_READS.search(p.read_text())}


def test_only_the_registry_its_mla_module_and_the_schema_read_mla():
    files = [*(ROOT / "megatron_kappa").rglob("*.py"), *(ROOT / "plan").rglob("*.py")]
    assert mla_readers(files) <= OWNERS, sorted(mla_readers(files) - OWNERS)
    # negative control: a line that reads the switch is found
    assert MLA_READS.search("    if m.mla.enabled:") and MLA_READS.search("cfg.model.mla.kv_lora_rank")
