"""Any checkpoint, not only the latest (issue 55): `--step N`, or a checkpoint folder
<run>/checkpoints/step_<N>, picks that checkpoint in the export, eval/generate.py, eval/core.py,
eval/loss.py and launch/consolidate.py. A step asked for is read or refused in one line: a missing
one lists the steps there are, a damaged one (its checksums) is refused, never replaced by another
(without --step, the latest that verifies is read, as before).

Shown end to end on a run with checkpoints at steps 1 and 2: the export of step 1 holds exactly the
consolidation of step 1 (read back through the export's own inverse map, bit for bit), which
differs from step 2's (so the step matters); a checkpoint folder gives the same files as --step;
generation at --step 1 gives the tokens of the consolidated step-1 weights; the loss at step 1
differs from the latest's; each tool records the step it read."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_kappa.checkpoint.listing import CheckpointDir, file_checksum, locate
from megatron_kappa.config import ConfigError, load_config
from tests.support.checkpoint_files import flip_one_byte
from tests.support.export_runs import hf_env

ROOT = Path(__file__).resolve().parents[1]


def fake_run(root: Path, steps=(1, 2, 3)) -> Path:
    """A run folder whose checkpoints hold one file each, recorded (size and checksum) as the
    trainer records them."""
    run = root / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.yaml").write_text("{}\n")
    for step in steps:
        folder = run / "checkpoints" / f"step_{step}"
        folder.mkdir()
        (folder / "rank_0.pt").write_bytes(bytes(range(256)) * (40 + step))
        files = {"rank_0.pt": (folder / "rank_0.pt").stat().st_size}
        (folder / "meta.json").write_text(json.dumps({"step": step, "files": files,
                                                      "checksums": {"rank_0.pt": file_checksum(folder / "rank_0.pt")}}))
    return run


def test_a_step_or_a_checkpoint_folder_picks_that_checkpoint(tmp_path):
    run = fake_run(tmp_path)
    assert locate(run) == (run, 3)  # the latest, as before
    assert locate(run, 2) == (run, 2)
    assert locate(run / "checkpoints" / "step_2") == (run, 2)
    assert locate(run / "checkpoints" / "step_002") == (run, 2)  # a zero-padded name is the same step
    assert locate(run / "checkpoints", 1) == (run, 1)
    with pytest.raises(ConfigError, match=r"^--step: 3, but --checkpoint .*step_2 is the checkpoint of step 2"):
        locate(run / "checkpoints" / "step_2", 3)


def test_a_missing_step_is_one_line_listing_the_steps_there_are(tmp_path):
    run = fake_run(tmp_path)
    with pytest.raises(ConfigError) as e:
        locate(run, 7)
    assert str(e.value) == f"--step: 7: no complete checkpoint at step 7 in {run / 'checkpoints'} (available: 1, 2, 3)"
    (run / "checkpoints" / "step_4").mkdir()  # a save that did not finish: no meta.json
    with pytest.raises(ConfigError, match=r"no complete checkpoint at step 4 .*\(available: 1, 2, 3\)"):
        locate(run, 4)
    with pytest.raises(ConfigError, match=r"step_4: not a complete checkpoint \(no meta.json"):
        locate(run / "checkpoints" / "step_4")
    with pytest.raises(ConfigError, match=r"^--checkpoint: .*nowhere: no config.yaml \(expected a training run"):
        locate(tmp_path / "nowhere", 1)


def test_a_damaged_step_asked_for_is_refused_never_replaced(tmp_path, capsys):
    run = fake_run(tmp_path)
    flip_one_byte(run / "checkpoints/step_2/rank_0.pt")
    for how in ((run, 2), (run / "checkpoints" / "step_2", None)):
        with pytest.raises(ConfigError) as e:
            locate(*how)
        message = str(e.value)
        assert "\n" not in message and message.startswith("--step: 2: checkpoint ") and "is damaged" in message
        assert "rank_0.pt: checksum" in message and "no other step is read in its place" in message
    assert locate(run) == (run, 3) and locate(run, 1) == (run, 1)  # the others are fine
    flip_one_byte(run / "checkpoints/step_3/rank_0.pt")
    assert locate(run) == (run, 1)  # without --step: the latest that verifies, with its warning (as before)
    assert "step_3 is damaged" in capsys.readouterr().err
    # negative control: without the checksums (sizes only) the damaged step would have been read
    assert CheckpointDir(run).verify(2, content=False) is None
    aside = run / "checkpoints" / "damaged" / "step_5"
    aside.mkdir(parents=True)
    with pytest.raises(ConfigError, match="set aside as damaged"):
        locate(aside)
    with pytest.raises(ConfigError, match=r"available: 1, 2, 3\); step 5 was set aside as damaged"):
        locate(run, 5)


# --- end to end: a run with two checkpoints, every tool --------------------------------------------


def tool(*argv, ok=True):
    done = subprocess.run([sys.executable, *map(str, argv)], cwd=ROOT, env=hf_env(), capture_output=True, text=True,
                          timeout=600)
    if ok:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done


def safetensors_of(folder: Path) -> dict:
    from safetensors.torch import load_file
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.slow
def test_export_of_step_k_is_the_consolidation_of_step_k(two_steps, tmp_path):
    from megatron_kappa.export import targets
    from megatron_kappa.model.layout import model_layout
    run = two_steps
    out = tool("launch/consolidate.py", "--checkpoint", run, "--step", 1, "--output", tmp_path / "full1.pt").stdout
    assert f"step 1 of {run}" in out
    tool("launch/consolidate.py", "--checkpoint", run / "checkpoints" / "step_2", "--output", tmp_path / "full2.pt")
    full = {k: torch.load(tmp_path / f"full{k}.pt", weights_only=True) for k in (1, 2)}
    assert any(not torch.equal(full[1][n], full[2][n]) for n in full[1])  # the two steps differ
    assert "from step 1" in tool("-m", "megatron_kappa.export", "--checkpoint", run, "--step", 1, "--output",
                                 tmp_path / "hf1", "--no-progress").stdout
    tool("-m", "megatron_kappa.export", "--checkpoint", run / "checkpoints" / "step_1", "--output", tmp_path / "hf1b",
         "--no-progress")
    exported = safetensors_of(tmp_path / "hf1")
    again = safetensors_of(tmp_path / "hf1b")
    assert exported.keys() == again.keys() and all(torch.equal(exported[k], again[k]) for k in exported)
    # the export read back into megatron's names (the export's own inverse map) is step 1's consolidation
    cfg = load_config(run / "config.yaml")
    layout = model_layout(cfg)
    adapter = targets.lookup(json.loads((tmp_path / "hf1/config.json").read_text())["model_type"])
    back = adapter.outer_from_hf(cfg.model, {k: v for k, v in exported.items() if not k.startswith("model.layers.")})
    for i in range(cfg.model.num_layers):
        layer = {k: v for k, v in exported.items() if k.startswith(f"model.layers.{i}.")}
        back.update({f"decoder.layers.{i}.{k}": v for k, v in adapter.from_hf(cfg.model, layout, i, layer).items()})

    def same(state):
        v = cfg.model.vocab_size
        return all(torch.equal(t, state[n][:v] if t.shape[0] == v and state[n].shape[0] != v else state[n])
                   for n, t in back.items())
    assert len(back) > 20 and same(full[1])
    assert not same(full[2])  # negative control: step 2's weights are not what the export of step 1 holds


@pytest.mark.slow
def test_generate_and_the_evaluations_read_the_step_asked_for(two_steps, tmp_path, sample_shards):
    run = two_steps
    tool("launch/consolidate.py", "--checkpoint", run, "--step", 1, "--output", tmp_path / "full1.pt")
    prompt = ["--prompt", "The water cycle", "--max-new-tokens", 8]
    tool("eval/generate.py", "--checkpoint", run, "--step", 1, *prompt, "--json", tmp_path / "g1.json")
    tool("eval/generate.py", "--checkpoint", run, "--weights", tmp_path / "full1.pt", *prompt,
         "--json", tmp_path / "w1.json")
    g1, w1 = (json.loads((tmp_path / f).read_text()) for f in ("g1.json", "w1.json"))
    assert g1["step"] == 1 and g1["results"][0]["ids"] == w1["results"][0]["ids"]
    loss = {}
    for name, where in (("1", ["--checkpoint", run, "--step", 1]),
                        ("folder1", ["--checkpoint", run / "checkpoints/step_1"]), ("latest", ["--checkpoint", run])):
        tool("eval/loss.py", *where, "--data", sample_shards["valid"][0], "--max-tokens", 2000, "--no-progress",
             "--json", tmp_path / f"loss{name}.json")
        loss[name] = json.loads((tmp_path / f"loss{name}.json").read_text())
    assert loss["1"]["step"] == loss["folder1"]["step"] == 1 and loss["latest"]["step"] == 2
    assert loss["1"]["loss"] == loss["folder1"]["loss"] != loss["latest"]["loss"]
    tool("eval/core.py", "--checkpoint", run / "checkpoints/step_1", "--bundle", ROOT / "tests/core_bundle",
         "--max-per-task", 2, "--no-progress", "--json", tmp_path / "core.json")
    core = json.loads((tmp_path / "core.json").read_text())
    assert core["step"] == 1 and core["checkpoint"] == str(run)


@pytest.mark.slow
def test_every_tool_refuses_a_damaged_or_missing_step_in_one_line(two_steps, tmp_path, capsys, sample_shards):
    """Each command's main in this process (the refusal comes before any model is built)."""
    from megatron_kappa.cli import consolidate, generate
    from megatron_kappa.cli import eval_core as core_cli
    from megatron_kappa.cli import eval_loss as loss_cli
    from megatron_kappa.export.__main__ import main as export_main
    run = tmp_path / "run"
    shutil.copytree(two_steps, run)
    flip_one_byte(run / "checkpoints/step_1/rank_0.pt")
    tools = {"export": lambda *a: export_main(["--checkpoint", *a, "--output", str(tmp_path / "hf"), "--no-progress"]),
             "consolidate": lambda *a: consolidate.main(["--checkpoint", *a, "--output", str(tmp_path / "full.pt")]),
             "generate": lambda *a: generate.main(["--checkpoint", *a, "--prompt", "x"]),
             "loss": lambda *a: loss_cli.main(["--checkpoint", *a, "--data", sample_shards["valid"][0]]),
             "core": lambda *a: core_cli.main(["--checkpoint", *a, "--bundle", str(ROOT / "tests/core_bundle")])}
    for name, main in tools.items():
        for how in ([str(run), "--step", "1"], [str(run / "checkpoints/step_1")]):
            capsys.readouterr()
            assert main(*how) == 2, name
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and "checkpoints/step_1 is damaged" in err and "rank_0.pt: checksum" in err, \
                (name, err)
        assert main(str(run), "--step", "7") == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "no complete checkpoint at step 7" in err and "(available: 1, 2)" in err, \
            (name, err)
    assert not (tmp_path / "hf").exists() and not (tmp_path / "full.pt").exists()
