"""`python -m megatron_kappa.config --config X [--set ...] [--world N]`: the resolved config as
YAML (itself a config file: it loads back to the same config) and what it implies (layers, layout,
batch, micro-batches, steps, tokens), without importing torch, megatron or DeepSpeed; a bad
config or world is one line and status 2."""
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_kappa.config import load_config, markdown_reference, to_dict
from megatron_kappa.config.__main__ import main

ROOT = Path(__file__).resolve().parents[1]


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def derived_lines(out: str) -> dict:
    """{name: rest} of the `#   name  rest` comment lines."""
    lines = [line.removeprefix("#   ") for line in out.splitlines() if line.startswith("#   ")]
    return {line.split("  ", 1)[0].strip(): line.split("  ", 1)[1].strip() for line in lines}


@pytest.mark.parametrize("config", sorted(str(p.relative_to(ROOT)) for p in (ROOT / "configs").glob("*.yaml")))
def test_the_printed_config_loads_back_to_the_same_config(capsys, tmp_path, config):
    """Every shipped config: the YAML printed is the config load_config reads (the reference: the
    file and overrides read directly), with the presets and extends chain already applied."""
    sets = ["train.steps=7", "log.interval=3"]
    code, out, err = run(capsys, "--config", config, "--set", *sets)
    assert code == 0 and err == "", err
    printed = tmp_path / "printed.yaml"
    printed.write_text(out)
    assert to_dict(load_config(printed)) == to_dict(load_config(ROOT / config, sets))
    assert yaml.safe_load(out)["train"]["steps"] == 7  # the override is in the printed config


def test_the_derived_values(capsys):
    """tiny on 4 ranks with EP2: the values worked out by hand from configs/tiny.yaml (4 layers,
    first one dense; global batch 8 of 128 tokens; micro-batch 1 → 8 / (1 × 4) = 2 per rank)."""
    code, out, _ = run(capsys, "--config", "configs/tiny.yaml", "--set", "parallel.ep=2", "train.micro_batch=1",
                       "train.steps=7", "--world", "4")
    assert code == 0
    d = derived_lines(out)
    assert d["layers"] == "d M M M  (1 dense, 3 MoE; 4 experts, top-2)"
    assert d["world"] == "4 ranks: tp 1 × pp 1 × dp 4; experts ep 2 × etp 1 × pp 1 × expert dp 2"
    assert d["batch"] == "8 sequences × 128 tokens = 1,024 tokens per step"
    assert d["micro-batch"] == "1 sequences; 2 per rank per step (gradient accumulation)"
    assert d["steps"] == f"7 (train.steps): {7 * 8 * 128:,} tokens"


def test_the_derived_stages_and_the_budget(capsys):
    """Pipeline stages as megatron splits them (first_stage_layers 1 of 4 layers on 2 stages: 1, 3),
    the smallest world by default (pp 2 × ep 2 = 4), and a run whose length is the token budget
    points to the summary, which counts N_eff."""
    code, out, _ = run(capsys, "--config", "configs/tiny.yaml", "--set", "parallel.pp=2", "parallel.ep=2",
                       "parallel.first_stage_layers=1", "train.steps=null", "train.micro_batch=2")
    assert code == 0
    d = derived_lines(out)
    assert d["layers"].endswith("; layers per stage 1 3"), d["layers"]
    assert d["world"].startswith("4 ranks: tp 1 × pp 2 × dp 2;"), d["world"]
    assert d["steps"].startswith("from the token budget") and "megatron_kappa.summary" in d["steps"]


@pytest.mark.parametrize("argv, message", [
    (["--set", "train.stepz=3"], "error: config: unknown key 'train.stepz'"),
    (["--set", "train.steps=[1"], "error: config: --set 'train.steps=[1': the value is not valid YAML"),
    (["--set", "parallel.ep=3"], "error: config: parallel.ep: model.moe.num_experts=4 is not divisible by ep=3"),
    (["--world", "3"], "error: config: train.global_batch: 8 is not a multiple of micro_batch × data-parallel "
                       "size = 4 × 3 (world 3)"),
    (["--set", "parallel.ep=2", "--world", "3"], "error: config: parallel.ep: world size 3 is not divisible by "
                                                 "ep × etp × pp = 2"),
])
def test_a_bad_config_is_one_line(capsys, argv, message):
    code, out, err = run(capsys, "--config", "configs/tiny.yaml", *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith(message), err


def test_markdown_stays(capsys):
    code, out, _ = run(capsys, "--markdown")
    assert code == 0 and out == markdown_reference() + "\n"


@pytest.mark.slow
def test_nothing_heavy_is_imported():
    """The view reads the config only: torch, megatron-core and DeepSpeed stay unimported (control:
    the summary, which builds a meta-device model, imports megatron-core)."""
    probe = ("import io, contextlib, sys\n"
             "from megatron_kappa.{module}.__main__ import main\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n"
             "    main(['--config', 'configs/tiny.yaml'])\n"
             "print(sorted(m for m in ('torch', 'megatron.core', 'deepspeed') if m in sys.modules))\n")
    seen = {}
    for module in ("config", "summary"):
        done = subprocess.run([sys.executable, "-c", probe.format(module=module)], cwd=ROOT, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        seen[module] = done.stdout.splitlines()[-1]
    assert seen["config"] == "[]"
    assert "megatron.core" in seen["summary"]
