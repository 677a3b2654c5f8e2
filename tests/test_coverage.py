"""The trainer's count of passes over the training documents (megatron_kappa.data.coverage),
against the shards' own token count read independently from the .idx file (numpy, not megatron)."""
import struct

import numpy as np
import pytest

from megatron_kappa.config import load_config
from megatron_kappa.data.coverage import passes
from megatron_kappa.train.data import build_datasets


def idx_tokens(prefix: str) -> int:
    """Every document's length summed, straight from a Megatron .idx file (format: magic 9 bytes,
    version <Q, dtype code <B, sequence count <Q, document count <Q, then the int32 lengths)."""
    with open(prefix + ".idx", "rb") as f:
        assert f.read(9) == b"MMIDIDX\x00\x00"
        f.read(8 + 1)
        count = struct.unpack("<Q", f.read(8))[0]
        f.read(8)
        return int(np.frombuffer(f.read(4 * count), dtype=np.int32).sum())


def config(shards, run_dir, packing):
    return load_config("configs/tiny.yaml", [
        "data.mock=false", f"data.paths=[{shards['train'][0]}]", f"data.valid_paths=[{shards['valid'][0]}]",
        f"data.tokenizer={shards['tokenizer']}", f"data.packing={packing}", f"run.dir={run_dir}"])


@pytest.mark.parametrize("packing", ["concat", "bestfit"])
def test_passes_over_the_documents(sample_shards, tmp_path, packing):
    cfg = config(sample_shards, tmp_path / packing, packing)
    held = idx_tokens(sample_shards["train"][0])
    seq = cfg.model.seq_length
    few, many = held // (4 * seq), 3 * held // seq  # a quarter of the documents' tokens; three times them
    little = passes(build_datasets(cfg, few, 4)[0])
    lots = passes(build_datasets(config(sample_shards, tmp_path / (packing + "2"), packing), many, 4)[0])
    if packing == "concat":  # seq_length tokens a sample
        assert little == pytest.approx((few * seq + 1) / held) and little < 1
        assert lots == pytest.approx((many * seq + 1) / held) and lots > 2.9
    else:  # whole documents, their cropped tokens too: more than the rows hold (a count of the
        # rows alone, which forgets the cropping, is the negative control)
        assert (few * (seq + 1)) / held < little < 1
        assert lots > many * (seq + 1) / held > 2.9


def test_mock_data_does_not_repeat(tmp_path):
    """megatron's mock dataset stands for a corpus far larger than any test run."""
    cfg = load_config("configs/tiny.yaml", [f"run.dir={tmp_path}"])
    assert 0 < passes(build_datasets(cfg, 16, 4)[0]) < 1e-3


@pytest.mark.slow
def test_the_trainer_warns_once_when_the_documents_repeat(sample_shards, tmp_path):
    """Trained on the small validation shard with rows that need about twice its tokens, the run
    says so in one line at start (and, a negative control, not on the larger training shard)."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    held = idx_tokens(sample_shards["valid"][0])
    seq, rows = 256, 16
    steps = -(-2 * held // (seq * rows))  # twice the shard's tokens

    def run(train, name):
        done = subprocess.run(
            [sys.executable, "launch/pretrain.py", "--config", "configs/tiny.yaml", "--set", "data.mock=false",
             f"data.paths=[{train}]", f"data.valid_paths=[{sample_shards['valid'][0]}]",
             f"data.tokenizer={sample_shards['tokenizer']}", f"run.dir={tmp_path / name}", f"model.seq_length={seq}",
             f"train.global_batch={rows}", f"train.steps={steps}", "train.micro_batch=4", "eval.valid_every=0",
             "log.interval=100", "log.tensorboard=false", "checkpoint.interval=1000"],
            cwd=root, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        return [ln for ln in (done.stdout + done.stderr).splitlines() if "reads its training documents" in ln]

    warned = run(sample_shards["valid"][0], "small")
    assert len(warned) == 1, warned
    times = float(warned[0].split("documents ")[1].split(" times")[0])
    assert 1.9 <= times <= 3.0, warned  # twice the tokens, rounded up to whole steps
    assert run(sample_shards["train"][0], "large") == []


def test_the_weighted_form_without_valid_paths_builds(sample_shards, tmp_path):
    """README's [0.7, a, 0.3, b] with data.split (no data.valid_paths) builds both splits (it
    crashed in megatron-core's assertion on the unused test split); bad weights are one line."""
    from megatron_kappa.config import ConfigError
    from megatron_kappa.preflight import check_data
    a = sample_shards["train"][0]
    cfg = load_config("configs/tiny.yaml", [
        "data.mock=false", f"data.paths=[0.7,{a},0.3,{a}]", "data.split=90,10,0",
        f"data.tokenizer={sample_shards['tokenizer']}", f"run.dir={tmp_path}"])
    check_data(cfg.data, cfg.model.vocab_size)
    train, valid = build_datasets(cfg, 40, 8)
    assert len(train) >= 40 and len(valid) >= 8 and len(train.datasets) == 2
    for weights, key in (("-1,{a},2,{a}", "data.paths"), ("0,{a},0,{a}", "data.paths"),
                         (".nan,{a},1,{a}", "data.paths")):
        bad = load_config("configs/tiny.yaml", ["data.mock=false", "data.paths=[" + weights.format(a=a) + "]",
                                                f"run.dir={tmp_path}"])
        with pytest.raises(ConfigError, match=rf"^config: {key}: expected non-negative weights, not all 0"):
            check_data(bad.data, bad.model.vocab_size)


def test_the_wrong_tokenizer_for_the_shards_is_refused(sample_shards, tmp_path):
    """The shards' manifest.json records the sha256 of the tokenizer that made them: another
    SentencePiece model is refused in one line naming both; the right one passes (control)."""
    import sentencepiece as spm

    from megatron_kappa.config import ConfigError
    from megatron_kappa.preflight import check_tokenizer
    base = ["data.mock=false", f"data.paths=[{sample_shards['train'][0]}]", f"run.dir={tmp_path}"]
    def check(*sets):
        cfg = load_config("configs/tiny.yaml", [*base, *sets])
        check_tokenizer(cfg.data, cfg.model.vocab_size)

    check(f"data.tokenizer={sample_shards['tokenizer']}")
    other = tmp_path / "other.model"  # another SentencePiece model, trained here
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"a sentence number {i} about {w}" for i, w in enumerate(["cats", "dogs"] * 200)))
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=str(tmp_path / "other"), vocab_size=60,
                                   minloglevel=2)
    assert other.is_file()
    with pytest.raises(ConfigError, match=r"^config: data.tokenizer: .*other.model is not the tokenizer data.paths "
                                          r".* was made with \(.*manifest.json records sha256 "):
        check(f"data.tokenizer={other}")
