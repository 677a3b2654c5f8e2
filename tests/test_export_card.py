"""The export as a user expects it (issue 55): a model card (README.md: the Hub's YAML header with
the licence, the config, κ-SwiGLU's formula, the tokens seen, the evaluation results recorded for
the exported step and only those), every file 0644 (safetensors writes 0600), a tokenizer that
pads on the left and says the model's context, whole --help texts, and no warning when transformers
loads the folder (torchao's pytree notices, at their source: megatron_kappa/quiet.py)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.support.export_runs import ROOT, hf_env


def card_of(folder: Path) -> tuple[dict, str]:
    """(the YAML header, the body) of folder/README.md."""
    text = (folder / "README.md").read_text()
    assert text.startswith("---\n")
    header, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(header), body


def tensors(folder: Path) -> dict:
    from safetensors.torch import load_file
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture(scope="module")
def exported(two_steps, tmp_path_factory):
    """Step 2 of the two-step run exported (kappa_moe), after an eval/loss.py result of each step
    was written beside the run (the step-1 one must not reach step 2's card)."""
    from megatron_kappa.export.writer import export
    run = two_steps
    for step, loss in ((1, 7.25), (2, 6.5)):
        (run / f"loss_step{step}.json").write_text(json.dumps(
            {"loss": loss, "bits_per_byte": loss / 2, "tokens": 1000, "bytes": 3000, "checkpoint": str(run),
             "step": step}))
    out = tmp_path_factory.mktemp("card") / "tiny-kappa"
    mask = os.umask(0o022)  # the usual umask: new files are 0644
    try:
        export(run, out, progress=False, license="apache-2.0")
    finally:
        os.umask(mask)
    return run, out


@pytest.mark.slow
def test_the_model_card_says_what_the_model_is_and_what_it_was_trained_on(exported):
    from megatron_kappa.config import load_config, to_dict
    run, out = exported
    header, body = card_of(out)
    assert header == {"license": "apache-2.0", "library_name": "transformers", "pipeline_tag": "text-generation",
                      "tags": ["megatron-kappa", "mixture-of-experts", "kappa-swiglu"]}
    cfg = load_config(run / "config.yaml")
    # the config: the training run's model section, whole
    block = body.split("```yaml\n", 1)[1].split("```", 1)[0]
    assert yaml.safe_load(block) == {"model": to_dict(cfg)["model"]}
    # κ-SwiGLU's description and formula, with this model's settings
    assert "κ_j = U ^ tanh(gain · (α_j · scale · s + b_j))" in body and "h   = g ⊙ σ(κ ⊙ g) ⊙ u" in body
    assert "U = 3, scale = 1, gain = 1" in body
    # the tokens seen at step 2, from metrics.jsonl (4 sequences of 32 tokens per step)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    seen = next(r["tokens_seen"] for r in records if r["step"] == 2)
    assert seen == 2 * 4 * 32 and f"| tokens | {seen:,} (metrics.jsonl at step 2) |" in body
    # the parameters, counted here from the written tensors: the routed experts' at k / E
    weights = tensors(out)
    total = sum(t.numel() for t in weights.values())
    routed = sum(t.numel() for n, t in weights.items() if ".experts." in n and ".shared_experts." not in n
                 or n.endswith(("kappa_alpha", "kappa_bias")))
    k, e = cfg.model.moe.topk, cfg.model.moe.num_experts
    assert routed > 0 and f"| parameters | {total:,} ({total - routed * (e - k) // e:,} active per token) |" in body
    # the results of step 2, not step 1's
    assert "| validation loss | 6.5000 | loss_step2.json: eval/loss.py, 1,000 tokens |" in body
    assert "| bits per byte | 3.2500 |" in body and "7.2500" not in body and "loss_step1" not in body
    assert "| step | 2 (train.steps: 2) |" in body


@pytest.mark.slow
def test_an_earlier_step_gets_its_own_card_and_an_unchosen_licence_says_so(exported, tmp_path):
    from megatron_kappa.export.writer import export
    run, _ = exported
    export(run, tmp_path / "step1", progress=False, step=1)
    header, body = card_of(tmp_path / "step1")
    assert header["license"] == "other" and "The licence was not chosen at export (`--license`)" in body
    assert "| validation loss | 7.2500 |" in body and "6.5000" not in body and "| step | 1 (" in body
    from megatron_kappa.config import ConfigError
    with pytest.raises(ConfigError, match="--license: 'Apache 2'"):
        export(run, tmp_path / "bad", progress=False, license="Apache 2")
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_every_file_is_0644_like_a_new_file(exported, tmp_path):
    _, out = exported
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {"0o644"}, modes
    # negative control: safetensors alone writes its file 0600 (what the export changes)
    from safetensors.torch import save_file
    mask = os.umask(0o022)
    try:
        save_file({"x": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    finally:
        os.umask(mask)
    assert oct((tmp_path / "x.safetensors").stat().st_mode & 0o777) == "0o600"


@pytest.mark.slow
def test_the_tokenizer_pads_left_and_says_the_models_context(exported):
    from transformers import AutoTokenizer
    _, out = exported
    tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert tokenizer.padding_side == "left" and tokenizer.model_max_length == 32
    batch = tokenizer(["a", "a much longer text than the first"], padding=True).input_ids
    assert batch[0][0] == tokenizer.pad_token_id and batch[0][-1] != tokenizer.pad_token_id


@pytest.mark.slow
def test_transformers_loads_the_export_without_a_warning(exported):
    """stderr of a fresh process that loads the model and tokenizer and generates from a padded
    batch: after the project's start (megatron_kappa/entry.py, what its command lines do first),
    nothing but transformers' progress bar. A user's own process (no start-up hook imports the
    package) shows torchao's two pytree lines and nothing else (docs/export.md), and so does the
    project's with the known notices shown (KAPPA_SHOW_WARNINGS=1): the check would see them."""
    _, out = exported
    start = "from megatron_kappa.entry import start; start(); "
    code = ("import torch; from transformers import AutoModelForCausalLM, AutoTokenizer; "
            f"m = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True, dtype=torch.float32); "
            f"t = AutoTokenizer.from_pretrained({str(out)!r}, trust_remote_code=True); "
            "b = t(['The water', 'A much longer prompt'], return_tensors='pt', padding=True); "
            "m.generate(**b, max_new_tokens=3, do_sample=False)")

    def stderr(first="", **env):
        done = subprocess.run([sys.executable, "-c", first + code], cwd=ROOT, env={**hf_env(), **env},
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return [line for line in done.stderr.replace("\r", "\n").splitlines()
                if line.strip() and not line.startswith("Loading weights")]
    assert stderr(start) == []
    for shown in (stderr(), stderr(start, KAPPA_SHOW_WARNINGS="1")):  # (with torchao's escapes, uncached)
        assert sum("is an Enum subclass" in line for line in shown) == 2, shown


def test_the_export_help_is_whole_and_names_every_target(capsys):
    from megatron_kappa.export import targets
    from megatron_kappa.export.__main__ import main
    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True))." in text  # not cut mid-sentence
    target_help = text.split("options:", 1)[1].split("--target {", 1)[1].split("--dtype", 1)[0]
    assert all(f"{a.name} ({a.architecture})" in target_help for a in targets.TARGETS.values())
    assert "deepseek_v3 (DeepseekV3ForCausalLM)" in target_help and "--step STEP" in text and "--license" in text


@pytest.mark.parametrize("run_name", [None, "moe8-kappa-seed24"])
def test_the_card_is_titled_with_the_runs_name_not_the_output_folders(tmp_path, run_name):
    """The title and "the run `…`" are run.name, or run.dir's folder name when it is null (as the
    W&B run is named); the usage example loads the output folder. Negative control: the output
    folder's name ("hf") is nowhere but in from_pretrained."""
    from megatron_kappa.config import load_config
    from megatron_kappa.export import targets
    from megatron_kappa.export.card import card
    run_dir = tmp_path / "tiny-ep2"
    cfg = load_config("configs/tiny.yaml", [f"run.dir={run_dir}"] + ([f"run.name={run_name}"] if run_name else []))
    text = card(name="hf", cfg=cfg, run_dir=run_dir, step=3, adapter=targets.lookup("kappa_moe"), hf_config={},
                params={"total": 10, "active": 5}, license="other", layout_record=None, tokenizer=False)
    title = run_name or "tiny-ep2"
    assert f"\n# {title}\n" in text and f"step\n3 of the run `{title}`" in text
    assert 'from_pretrained("hf"' in text
    assert "# hf" not in text and "`hf`" not in text and text.count('"hf"') == 2


def test_a_licence_the_hub_does_not_know_is_one_line_before_any_work(tmp_path, capsys):
    """--license not-a-license was written into the card's header: now it is refused in one line,
    exit 2, before the checkpoint is even looked for (the one given does not exist), naming the
    nearest identifiers; a Hub identifier goes on to the next check (control: the missing run)."""
    from megatron_kappa.export.__main__ import main
    from megatron_kappa.export.licenses import HUB_LICENSES
    base = ["--checkpoint", str(tmp_path / "no_run"), "--output", str(tmp_path / "hf"), "--no-progress"]
    for bad, near in (("not-a-license", ""), ("Apache-2.0", "did you mean 'apache-2.0'?"),
                      ("cc-by-4", "did you mean 'cc-by-4.0'")):
        assert main([*base, "--license", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: --license: {bad!r} is not a Hugging Face Hub licence identifier (") and \
            near in err and err.count("\n") == 1, err
    for good in ("apache-2.0", "other", "llama3.1"):
        assert main([*base, "--license", good]) == 2
        err = capsys.readouterr().err
        assert "--license" not in err and "no_run" in err and err.count("\n") == 1, err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()
    assert len(set(HUB_LICENSES)) == len(HUB_LICENSES) and all(x == x.lower().strip() for x in HUB_LICENSES)
