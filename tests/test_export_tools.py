"""The exported model in the ecosystem's tools (issue 35): greedy `generate()` of the export equals
eval/generate.py's tokens (megatron-core's model with its key/value cache); lm-evaluation-harness
scores the export on the bundled local task, with the command of docs/export.md; an interrupted
export leaves no folder."""
import json
import subprocess
import sys

import pytest
import torch

from tests.support.export_runs import ROOT, export, hf_env


@pytest.mark.slow
def test_greedy_generate_of_the_export_equals_eval_generate(runs, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    run = runs("kappa-nanochat-sigmoid")
    out = tmp_path / "hf"
    export(run, out)
    done = subprocess.run([sys.executable, "eval/generate.py", "--checkpoint", str(run), "--prompt", "The water cycle",
                           "--max-new-tokens", "12", "--json", str(tmp_path / "gen.json")],
                          cwd=ROOT, env=hf_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ours = json.loads((tmp_path / "gen.json").read_text())["results"][0]
    tokenizer = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    prompt = tokenizer("The water cycle", return_tensors="pt").input_ids
    assert prompt[0].tolist() == ours["prompt_ids"]  # the same BOS rule and pieces
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True, dtype=torch.float32).eval()
    theirs = model.generate(prompt, max_new_tokens=12, do_sample=False, eos_token_id=None)[0, prompt.shape[1]:]
    assert len(ours["ids"]) == 12 and theirs.tolist() == ours["ids"]
    assert len(set(ours["ids"])) > 1  # not one token repeated: the cache's later steps matter


@pytest.mark.slow
def test_lm_eval_scores_an_export_on_a_local_task(runs, tmp_path):
    """The command of docs/export.md, with the bundled local task (eval/tasks/core_arc_easy.yaml)."""
    run = runs("kappa-nanochat-sigmoid")
    out = tmp_path / "hf"
    export(run, out)
    done = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                           f"pretrained={out},trust_remote_code=True,dtype=float32", "--tasks", "core_arc_easy",
                           "--include_path", "eval/tasks", "--device", "cpu", "--batch_size", "4",
                           "--output_path", str(tmp_path / "results")],
                          cwd=ROOT, env=hf_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "core_arc_easy" in done.stdout and "acc" in done.stdout  # the score table
    result = json.loads(next((tmp_path / "results").rglob("results_*.json")).read_text())
    scores = result["results"]["core_arc_easy"]
    assert 0 <= scores["acc,none"] <= 1 and result["n-samples"]["core_arc_easy"]["effective"] == 6


@pytest.mark.slow
def test_an_interrupted_export_leaves_no_folder(runs, tmp_path, monkeypatch):
    from megatron_kappa.export import convert, writer
    real = convert.layer_tensors

    def fail_at_layer_2(model, layout, target, i, get):
        if i == 2:
            raise KeyboardInterrupt
        return real(model, layout, target, i, get)
    monkeypatch.setattr(convert, "layer_tensors", fail_at_layer_2)
    with pytest.raises(KeyboardInterrupt):
        writer.export(runs("kappa-nanochat-sigmoid"), tmp_path / "hf", progress=False)
    assert list(tmp_path.iterdir()) == []


