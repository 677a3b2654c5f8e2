"""Bad inputs a new user would try: each is a one-line error from the preflight, before any
process group exists, with nothing written."""
import json
from pathlib import Path

import numpy as np
import pytest

from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.data.blend import split_ranges
from megatron_kappa.data_prep.shards import ShardWriter
from megatron_kappa.preflight import preflight
from tests.support.bare_python import run_bare

ROOT = Path(__file__).resolve().parents[1]


def shard(tmp_path, name="corpus", docs=50, tokens=200, vocab=2000, seed=0) -> str:
    """A real Megatron shard of `docs` documents of `tokens` tokens each."""
    rng = np.random.default_rng(seed)
    writer = ShardWriter(tmp_path / name, np.dtype(np.uint16))
    for _ in range(docs):
        writer.add(rng.integers(4, vocab, tokens, dtype=np.uint16))
    writer.close()
    return str(tmp_path / name)


def check(tmp_path, sets, world=1):
    cfg = load_config("configs/tiny.yaml", [f"run.dir={tmp_path / 'run'}", *sets])
    preflight(cfg, world)


def error(tmp_path, sets, world=1) -> str:
    with pytest.raises(ConfigError) as err:
        check(tmp_path, sets, world)
    message = str(err.value)
    assert "\n" not in message
    assert not (tmp_path / "run").exists()  # nothing written
    return message


def test_negative_steps(tmp_path):
    assert "train.steps: must be positive" in error(tmp_path, ["train.steps=-5"])


def test_data_paths_with_mock_data(tmp_path):
    prefix = shard(tmp_path)
    message = error(tmp_path, [f"data.paths=[{prefix}]"])  # tiny.yaml says data.mock: true
    assert "data.mock" in message and "data.paths" in message


def test_truncated_bin(tmp_path):
    prefix = shard(tmp_path)
    data = Path(prefix + ".bin").read_bytes()
    Path(prefix + ".bin").write_bytes(data[: len(data) // 2])
    message = error(tmp_path, ["data.mock=false", f"data.paths=[{prefix}]", "data.split=50,50,0"])
    assert f"{prefix}.bin: truncated" in message


def test_small_corpus_with_default_split_names_the_empty_split(tmp_path):
    prefix = shard(tmp_path)  # 50 documents: 99,1,0 rounds the valid split to 0 documents
    message = error(tmp_path, ["data.mock=false", f"data.paths=[{prefix}]"])
    assert "data.split" in message and "valid split" in message and "valid 0" in message
    assert "data.valid_paths" in message  # says what would fix it
    # The same shard with a split that gives every part documents passes.
    check(tmp_path, ["data.mock=false", f"data.paths=[{prefix}]", "data.split=50,50,0"])


def test_split_ranges_match_megatron_core():
    from megatron.core.datasets.blended_megatron_dataset_config import (
        convert_split_vector_to_split_matrix,
        parse_and_normalize_split,
    )
    for split in ("99,1,0", "50,50,0", "98,2,0", "90,5,5", "1,1,1", "3,0,1"):
        for n in (1, 2, 3, 50, 99, 100, 101, 1000):
            matrix = convert_split_vector_to_split_matrix(parse_and_normalize_split(split))
            theirs = [None if m is None else (int(round(m[0] * n)), int(round(m[1] * n))) for m in matrix]
            assert split_ranges(split, n) == theirs, (split, n)


def test_fp8_runs_without_transformer_engine(tmp_path):
    """precision: fp8 goes through torchao (tests/test_fp8.py has its checks); Transformer
    Engine's backend is the one refused."""
    check(tmp_path, ["precision=fp8"])
    assert "model.fp8.backend: te is not supported" in error(tmp_path, ["precision=fp8", "model.fp8.backend=te"])


def test_layout_against_the_world_size(tmp_path):
    assert "parallel.ep" in error(tmp_path, ["parallel.ep=2"], world=1)
    assert "parallel.tp" in error(tmp_path, ["parallel.tp=2"], world=3)
    assert "train.global_batch" in error(tmp_path, ["train.global_batch=4", "train.micro_batch=4"], world=2)
    check(tmp_path, ["parallel.ep=2"], world=2)


def test_a_stage_without_decoder_layers_is_planned_not_trained(tmp_path):
    """megatron runs an entry of parallel.layout that holds only the embedding or the loss (the
    config loads, the planner plans it and says "planned only"); this trainer refuses it in one
    line. The same 5 layers with a layer on every stage pass (the control)."""
    from megatron_kappa.plan import Layout, plan
    pp3 = ["model.num_layers=5", "parallel.pp=3", "train.global_batch=12", "train.micro_batch=1"]
    for text, entry in (("E|t*5|L", 0), ("Et*4|t|L", 2)):
        message = error(tmp_path, [*pp3, f"parallel.layout={text}"], world=3)
        assert f"parallel.layout: '{text}': entry {entry} holds no decoder layer" in message
        cfg = load_config("configs/tiny.yaml", [*pp3, f"parallel.layout={text}"])
        assert "stages without decoder layers" in plan(cfg, Layout(3, pp=3), gpu_mem_gib=80).planned_only
    check(tmp_path, [*pp3, "parallel.layout=Et*3|t|tL"], world=3)
    cfg = load_config("configs/tiny.yaml", [*pp3, "parallel.layout=Et*3|t|tL"])
    assert "stages without decoder layers" not in plan(cfg, Layout(3, pp=3), gpu_mem_gib=80).planned_only


def test_tokenizer_larger_than_vocab_and_core_bundle(tmp_path):
    from megatron_kappa.tokenizer import train_tokenizer
    words = [" ".join(f"w{i * j % 997}" for j in range(40)) for i in range(400)]
    tok = train_tokenizer(words, tmp_path / "tok.model", vocab_size=273)
    assert "model.vocab_size: 264 is smaller than the tokenizer's 273" in error(
        tmp_path, [f"data.tokenizer={tok}", "model.vocab_size=264"])
    assert "eval.core_every" in error(tmp_path, ["eval.core_every=10"])
    bad = tmp_path / "bundle"
    bad.mkdir()
    (bad / "core.yaml").write_text("icl_tasks: 3\n")
    message = error(tmp_path, ["eval.core_every=10", f"eval.core_bundle={bad}", f"data.tokenizer={tok}"])
    assert "eval.core_bundle" in message and "core.yaml" in message


def test_resume_with_another_layout(tmp_path):
    step = tmp_path / "run" / "checkpoints" / "step_4"
    step.mkdir(parents=True)
    (step / "meta.json").write_text(json.dumps({"layout": {"world": 2, "tp": 1, "ep": 2, "etp": 1}}))
    with pytest.raises(ConfigError, match=r"checkpoint .* \(format 1, written before checkpoints resharded\) "
                                          r"loads only in its own layout"):
        check(tmp_path, [], world=2)
    check(tmp_path, ["parallel.ep=2"], world=2)
    (step / "meta.json").write_text(json.dumps({"layout": {"world": 2, "tp": 1, "ep": 2, "etp": 1}, "format": 2}))
    check(tmp_path, [], world=2)  # format 2 loads in any layout (tests/test_reshard.py)


def test_paper_config_on_one_process_fails_before_heavy_imports(tmp_path):
    """The launcher's path: one line, exit status 2, no run directory, and neither
    torch.distributed nor megatron-core nor DeepSpeed imported (so it takes a second, not 20)."""
    code = ("import sys; sys.argv[0] = 'launch/pretrain.py'; from megatron_kappa.cli import pretrain; "
            f"rc = pretrain.main(['--config', 'configs/moe8.yaml', '--set', 'run.dir={tmp_path / 'run'}', "
            "'data.mock=true']); "
            "heavy = [m for m in ('megatron.core', 'deepspeed', 'torch.distributed') if m in sys.modules]; "
            "print('RC', rc, 'HEAVY', heavy)")
    done = run_bare(code)
    assert "RC 2 HEAVY []" in done.stdout, done.stdout + done.stderr
    assert "parallel.ep" in done.stderr and done.stderr.strip().count("\n") == 0, done.stderr
    assert not (tmp_path / "run").exists()
