"""Evaluation command lines refuse what they cannot honour in one line, before any work (issue 53):
a prompt longer than the model's context (generate returned no tokens without a word), a window
longer than it (eval/loss.py clamped it silently), a NaN temperature."""
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_kappa.config import load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def trained(sample_shards, tmp_path_factory, world1):
    from megatron_kappa.train import loop
    run_dir = tmp_path_factory.mktemp("cli") / "run"
    loop.run(load_config("configs/tiny.yaml", [
        "data.mock=false", f"data.paths=[{sample_shards['train'][0]}]",
                                               f"data.valid_paths=[{sample_shards['valid'][0]}]",
        f"data.tokenizer={sample_shards['tokenizer']}", f"run.dir={run_dir}", "model.seq_length=32",
        "train.steps=1", "train.micro_batch=2", "train.global_batch=2", "eval.valid_every=0",
        "log.tensorboard=false"]), log=lambda *a: None)
    return run_dir


def cli(*argv):
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_a_prompt_longer_than_the_context_is_one_line(trained):
    done = cli("eval/generate.py", "--checkpoint", str(trained), "--prompt", "word " * 100, "--prompt", "short")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().count("\n") == 0 and "--prompt:" in done.stderr and "context" in done.stderr
    ok = cli("eval/generate.py", "--checkpoint", str(trained), "--prompt", "short", "--max-new-tokens", "3")
    assert ok.returncode == 0 and ok.stdout.startswith("short"), ok.stderr[-2000:]  # control


@pytest.mark.slow
def test_a_window_longer_than_the_context_is_one_line(trained, sample_shards):
    done = cli("eval/loss.py", "--checkpoint", str(trained), "--data", sample_shards["valid"][0], "--seq-len", "4096",
               "--no-progress")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: --seq-len: 4096 is longer than the model's "
                                                           "context (model.seq_length 32"), done.stderr[-2000:]
    ok = cli("eval/loss.py", "--checkpoint", str(trained), "--data", sample_shards["valid"][0], "--seq-len", "32",
             "--max-tokens", "64", "--no-progress")
    assert ok.returncode == 0 and "loss " in ok.stdout, ok.stderr[-2000:]  # control


def test_a_nan_temperature_is_argparses_one_line():
    done = cli("eval/generate.py", "--checkpoint", "x", "--prompt", "y", "--temperature", "nan")
    assert done.returncode == 2 and "--temperature: expected a finite number ≥ 0, got 'nan'" in done.stderr


@pytest.mark.parametrize("script", ["eval/loss.py", "eval/core.py"])
def test_json_under_a_file_is_one_line_before_the_evaluation(tmp_path, script):
    """--json whose folder cannot be made is refused before any checkpoint is read (it was found
    only after the whole evaluation ran); here the checkpoint does not even exist."""
    (tmp_path / "afile").write_text("x")
    extra = ["--data", str(tmp_path / "none")] if script.endswith("loss.py") else ["--bundle", str(tmp_path / "none")]
    done = cli(script, "--checkpoint", str(tmp_path / "no_run"), *extra, "--json", str(tmp_path / "afile" / "out.json"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"error: --json: {tmp_path / 'afile'} is a file, not a folder", \
        done.stderr[-2000:]


@pytest.mark.parametrize("script", ["eval/loss.py", "eval/core.py", "eval/generate.py"])
def test_json_where_no_file_can_be_made_is_one_line_before_the_evaluation(tmp_path, script):
    """--json in /proc: access() lets root write anywhere, a probe file says it cannot (the
    evaluation ran, then the write failed); generate's --json is checked up front too."""
    extra = {"eval/loss.py": ["--data", "none"], "eval/core.py": ["--bundle", "none"],
             "eval/generate.py": ["--prompt", "x"]}[script]
    done = cli(script, "--checkpoint", str(tmp_path / "no_run"), *extra, "--json", "/proc/out.json")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("error: --json: /proc is not writable "
                                                           "("), done.stderr[-2000:]


@pytest.mark.slow
def test_an_empty_prompt_is_continued_from_bos_or_refused_in_one_line(trained, tmp_path):
    """An empty --prompt continues the start-of-document token where the documents have one;
    where they have none (data.bos false) there is nothing to continue: one line (it was
    generation's ValueError traceback)."""
    import shutil
    ok = cli("eval/generate.py", "--checkpoint", str(trained), "--prompt", "", "--max-new-tokens", "3")
    assert ok.returncode == 0, ok.stderr[-2000:]
    nobos = tmp_path / "run"
    shutil.copytree(trained, nobos)
    config = (nobos / "config.yaml").read_text()
    assert "  bos: true\n" in config or "  bos: null\n" in config
    (nobos / "config.yaml").write_text(config.replace("  bos: true\n", "  bos: false\n").replace("  bos: null\n",
                                                                                                  "  bos: false\n"))
    done = cli("eval/generate.py", "--checkpoint", str(nobos), "--prompt", "")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == ("error: --prompt: '' has no tokens, and this model's documents "
                                                    "start without a BOS token (data.bos false) to continue from: "
                                                    "give some text")


def test_junk_or_wrong_shape_init_weights_are_one_line(world1, tmp_path):
    """train.init_weights: a junk file is refused by the preflight (no torch: the zip magic), a
    state dict of another model by the trainer, naming the tensor; the right one loads (control)."""
    import torch

    from megatron_kappa.config import ConfigError
    from megatron_kappa.model.build import build_model
    from megatron_kappa.preflight import preflight
    from megatron_kappa.train import loop
    sets = ["data.mock=true", "model.seq_length=32", "train.micro_batch=2", "train.global_batch=2", "train.steps=1",
            "log.tensorboard=false", "eval.valid_every=0"]
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"not weights at all")
    with pytest.raises(ConfigError, match=r"^config: train.init_weights: .*junk.pt: not a state dict file"):
        preflight(load_config("configs/tiny.yaml", [*sets, f"train.init_weights={junk}", f"run.dir={tmp_path / 'a'}"]),
                  world=1)
    other = tmp_path / "other.pt"  # a model with another ffn size
    torch.save(build_model(load_config("configs/tiny.yaml", [*sets, "model.ffn_hidden_size=128"]), "cpu").state_dict(),
               other)
    with pytest.raises(ConfigError, match=r"^config: train.init_weights: .*other.pt: does not hold this model's "
                                          r"weights: .*linear_fc1.* shape"):
        loop.run(load_config("configs/tiny.yaml", [*sets, f"train.init_weights={other}", f"run.dir={tmp_path / 'b'}"]),
                 log=lambda *a: None)
    right = tmp_path / "right.pt"
    torch.save({k: v for k, v in build_model(load_config("configs/tiny.yaml", sets), "cpu").state_dict().items()
                if not k.endswith("_extra_state")}, right)
    loop.run(load_config("configs/tiny.yaml", [*sets, f"train.init_weights={right}", f"run.dir={tmp_path / 'c'}"]),
             log=lambda *a: None)


@pytest.mark.slow
def test_junk_weights_for_evaluation_are_one_line(trained, tmp_path):
    junk = tmp_path / "junk.pt"
    junk.write_bytes(b"PK\x03\x04 but not a zip")
    done = cli("eval/generate.py", "--checkpoint", str(trained), "--weights", str(junk), "--prompt", "hi")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: --weights: {junk}: not a state dict file")


def test_ctrl_c_is_one_line_and_exit_130(capsys, monkeypatch):
    """run_command turns a KeyboardInterrupt into one line and exit status 130 (negative control:
    the plain call lets it through as a traceback), and every evaluation and export command line
    runs its main through it: megatron_kappa.entry.run does for a module that says what an
    interrupt leaves (INTERRUPTED), which each of them does."""
    import ast
    import types

    from megatron_kappa import entry
    from megatron_kappa.parallel.launch_env import run_command

    def interrupted():
        raise KeyboardInterrupt
    with pytest.raises(SystemExit) as stop:
        run_command(interrupted, "nothing is lost")
    assert stop.value.code == 130 and capsys.readouterr().err == "interrupted: nothing is lost\n"
    with pytest.raises(KeyboardInterrupt):
        interrupted()
    command = types.ModuleType("probe_command")
    command.main = interrupted
    monkeypatch.setitem(sys.modules, "probe_command", command)
    monkeypatch.setattr(entry, "start", lambda: None)
    with pytest.raises(KeyboardInterrupt):  # negative control: a module that says nothing
        entry.run("probe_command")
    command.INTERRUPTED = "nothing is lost"
    with pytest.raises(SystemExit) as stop:
        entry.run("probe_command")
    assert stop.value.code == 130 and capsys.readouterr().err == "interrupted: nothing is lost\n"
    for path in ("megatron_kappa/cli/eval_core.py", "megatron_kappa/cli/eval_loss.py", "megatron_kappa/cli/generate.py",
                 "megatron_kappa/cli/consolidate.py", "megatron_kappa/export/__main__.py"):
        said = [n for n in ast.parse((ROOT / path).read_text()).body if isinstance(n, ast.Assign)
                and [t.id for t in n.targets if isinstance(t, ast.Name)] == ["INTERRUPTED"]]
        assert len(said) == 1 and isinstance(said[0].value, ast.Constant) and said[0].value.value, path
    for script, command in (("eval/core.py", "eval_core"), ("eval/loss.py", "eval_loss"),
                            ("eval/generate.py", "generate"), ("launch/consolidate.py", "consolidate")):
        assert f"commands.{command}()" in (ROOT / script).read_text(), script


def test_check_refuses_a_bad_config_before_any_rank_starts():
    """launch/pretrain.py --check WORLD: the preflight for that world in one process, exit 0 or one
    line and status 2 (a world the layout does not divide is what torchrun would start)."""
    ok = cli("launch/pretrain.py", "--config", "configs/tiny.yaml", "--check", "2", "--set", "data.mock=true")
    assert ok.returncode == 0 and ok.stdout.strip() == "ok: configs/tiny.yaml checked for 2 processes", ok.stderr
    bad = cli("launch/pretrain.py", "--config", "configs/tiny.yaml", "--check", "3", "--set", "data.mock=true",
              "parallel.ep=2")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().count("\n") == 0 and bad.stderr.startswith("error: config: parallel.ep: world size 3")


def test_the_local_lm_eval_task_reads_its_data_from_any_directory(tmp_path, monkeypatch):
    """eval/tasks/core_arc_easy.yaml's relative data_files are read from the repository root
    (eval/tasks/core_data.py, its custom_dataset), not the working directory; negative control:
    the plain json loader from another directory does not find them."""
    import importlib.util

    import datasets
    import yaml
    text = (ROOT / "eval/tasks/core_arc_easy.yaml").read_text()
    assert "custom_dataset: !function core_data.load" in text
    files = yaml.safe_load(text.replace("!function ", ""))["dataset_kwargs"]["data_files"]
    spec = importlib.util.spec_from_file_location("core_data", ROOT / "eval/tasks/core_data.py")
    core_data = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(core_data)
    monkeypatch.chdir(tmp_path)
    assert core_data.load(data_files=files)["test"].num_rows == 6
    with pytest.raises(Exception):
        datasets.load_dataset("json", data_files=files)


@pytest.mark.slow
def test_export_with_a_junk_tokenizer_is_one_line_before_writing(trained, sample_shards, tmp_path):
    junk = tmp_path / "junk.model"
    junk.write_text("not a tokenizer")
    done = cli("-m", "megatron_kappa.export", "--checkpoint", str(trained), "--output", str(tmp_path / "hf"),
               "--tokenizer", str(junk), "--no-progress")
    assert done.returncode == 2 and not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: --tokenizer: {junk}: not a SentencePiece model")
    ok = cli("-m", "megatron_kappa.export", "--checkpoint", str(trained), "--output", str(tmp_path / "hf"),
             "--tokenizer", sample_shards["tokenizer"], "--no-progress")
    assert ok.returncode == 0 and (tmp_path / "hf/tokenizer.json").is_file(), ok.stderr[-2000:]  # control


@pytest.fixture(scope="module")
def other_tokenizer(tmp_path_factory):
    """Another SentencePiece model than the run's (60 pieces, trained here)."""
    import sentencepiece as spm
    folder = tmp_path_factory.mktemp("other_tokenizer")
    text = folder / "text.txt"
    text.write_text("\n".join(f"a sentence number {i} about {w}" for i, w in enumerate(["cats", "dogs"] * 200)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(folder / "other"), vocab_size=60, minloglevel=2)
    return folder / "other.model"


def shards_listed_as_made_with(tokenizer, sample_shards, folder):
    """The sample's valid shard copied into `folder`, with the data prep manifest.json it would
    have had if `tokenizer` had made it (only the recorded sha256 differs)."""
    import hashlib
    import json
    import shutil
    folder.mkdir()
    name = Path(sample_shards["valid"][0]).name
    for ext in (".bin", ".idx"):
        shutil.copy(sample_shards["valid"][0] + ext, folder / (name + ext))
    manifest = json.loads((sample_shards["dir"] / "manifest.json").read_text())
    manifest["tokenizer"]["sha256"] = hashlib.sha256(Path(tokenizer).read_bytes()).hexdigest()
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return str(folder / name)


@pytest.mark.slow
def test_eval_loss_refuses_shards_of_another_tokenizer(trained, sample_shards, other_tokenizer, tmp_path):
    """Shards whose manifest records another tokenizer than the run's: one line before the model
    loads, exit 2 (it scored them: rc 0, a loss and bits per byte of the wrong ids); the same
    shards listed under the run's own tokenizer are scored (control)."""
    wrong = shards_listed_as_made_with(other_tokenizer, sample_shards, tmp_path / "wrong")
    done = cli("eval/loss.py", "--checkpoint", str(trained), "--data", wrong, "--max-tokens", "64", "--no-progress")
    assert done.returncode == 2 and done.stdout == "", done.stderr[-2000:]
    assert done.stderr.strip().count("\n") == 0
    assert done.stderr.startswith(f"error: --data: the run's data.tokenizer: {sample_shards['tokenizer']} is not the "
                                  f"tokenizer --data {wrong} was made with ({tmp_path / 'wrong' / 'manifest.json'} "
                                  "records sha256 "), done.stderr
    right = shards_listed_as_made_with(sample_shards["tokenizer"], sample_shards, tmp_path / "right")
    ok = cli("eval/loss.py", "--checkpoint", str(trained), "--data", right, "--max-tokens", "64", "--no-progress")
    assert ok.returncode == 0 and ok.stdout.startswith("loss "), ok.stderr[-2000:]


def test_a_tokenizer_replaced_since_training_is_refused_by_every_tool(trained, other_tokenizer, tmp_path, capsys):
    """The run's data.tokenizer file no longer the one that made its shards (or export's
    --tokenizer another one): eval/core.py, eval/loss.py, eval/generate.py and export stop in one
    line before the model loads (they would have encoded and decoded text with other ids)."""
    import shutil

    from megatron_kappa.cli import eval_core as core
    from megatron_kappa.cli import eval_loss as loss
    from megatron_kappa.cli import generate
    from megatron_kappa.export.__main__ import main as export
    run = tmp_path / "run"
    shutil.copytree(trained, run, ignore=shutil.ignore_patterns("checkpoints"))
    config = (run / "config.yaml").read_text()
    tokenizer = next(line.split(": ", 1)[1] for line in config.splitlines() if line.startswith("  tokenizer: "))
    (run / "config.yaml").write_text(config.replace(f"  tokenizer: {tokenizer}\n", f"  tokenizer: {other_tokenizer}\n"))
    (run / "checkpoints").symlink_to(trained / "checkpoints")
    expected = (f"error: checkpoint: {run}/config.yaml: data.tokenizer: {other_tokenizer} is not the tokenizer "
                "data.paths ")
    for main, extra in ((core.main, ["--bundle", str(ROOT / "tests/core_bundle")]),
                        (generate.main, ["--prompt", "hi"])):
        assert main(["--checkpoint", str(run), *extra]) == 2
        err = capsys.readouterr().err
        assert err.startswith(expected) and err.count("\n") == 1, err
    valid = load_config(run / "config.yaml").data.valid_paths  # the run's own shards, now another tokenizer's
    assert loss.main(["--checkpoint", str(run), "--data", *valid]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --data: the run's data.tokenizer: {other_tokenizer} is not the tokenizer --data "
                          f"{valid[0]} was made with") and err.count("\n") == 1, err
    assert export(["--checkpoint", str(run), "--output", str(tmp_path / "hf"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected.replace("error: checkpoint: ", "error: ")) and err.count("\n") == 1, err
    assert export(["--checkpoint", str(trained), "--output", str(tmp_path / "hf"), "--tokenizer", str(other_tokenizer),
                   "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --tokenizer: {other_tokenizer} is not the tokenizer data.paths ") and \
        err.count("\n") == 1, err
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()


def test_export_onto_a_full_disk_is_one_line_and_leaves_nothing(trained, tmp_path, monkeypatch, capsys):
    """A full disk while the export writes: one line saying so, exit 1, no output folder and no
    partial .tmp folder left (it was a traceback)."""
    import errno

    import safetensors.torch

    from megatron_kappa.export.__main__ import main

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    out = tmp_path / "hf"
    assert main(["--checkpoint", str(trained), "--output", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: --output: {out}: no space left on the device") and "nothing was left" in err[-1]
    assert not out.exists() and not (tmp_path / "hf.tmp").exists()
