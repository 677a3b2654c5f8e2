"""data.packing: bestfit — the authors' BOS-aligned best-fit rows (14c9b04 nanochat/dataloader.py
80-157) over the bundled sample's shards, checked against the authors' loop written out again here
from their code (a list buffer scanned per piece), not from megatron_kappa/data/bestfit.py; first-fit,
cropping the first document instead of the shortest, and the default concat packing are the negative
controls. Also: the cropped fraction, BOS at every row's start, determinism, a restart (the cached
index) and a longer run reading the same rows, and the one-line refusals."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.data.bestfit import cropped_report
from megatron_kappa.preflight import check_packing
from megatron_kappa.tokenizer import Tokenizer
from megatron_kappa.train.data import build_datasets

ROOT = Path(__file__).resolve().parents[1]


# --- the authors' loop, as 14c9b04 nanochat/dataloader.py:104-157 runs it ----------------------

def authors_rows(documents, n_rows, T, buffer_size=1000, tokenizer_batch_size=128, choose="best", crop="shortest"):
    """n_rows rows of T + 1 tokens from the endless iterator `documents` (token lists, each
    BOS + text as `tokenizer.encode(doc_batch, prepend=bos_token)` gives them), and the tokens
    (taken, cropped). choose="first" / crop="first" are the negative controls' changes."""
    row_capacity = T + 1
    doc_buffer = []
    rows, taken, cropped = [], 0, 0

    def refill_buffer():  # one tokenizer batch: 128 documents
        for _ in range(tokenizer_batch_size):
            doc_buffer.append(next(documents))

    while len(rows) < n_rows:
        row, pos = [], 0
        while pos < row_capacity:
            while len(doc_buffer) < buffer_size:
                refill_buffer()
            remaining = row_capacity - pos
            best_idx, best_len = -1, 0
            for i, doc in enumerate(doc_buffer):
                doc_len = len(doc)
                if doc_len <= remaining and doc_len > best_len:
                    best_idx, best_len = i, doc_len
                    if choose == "first":
                        break
            if best_idx >= 0:
                doc = doc_buffer.pop(best_idx)
                row += doc
                pos += len(doc)
                taken += len(doc)
            else:
                if crop == "shortest":
                    pick = min(range(len(doc_buffer)), key=lambda i: len(doc_buffer[i]))
                else:
                    pick = 0
                doc = doc_buffer.pop(pick)
                row += doc[:remaining]
                taken += len(doc)
                cropped += len(doc) - remaining
                pos += remaining
        rows.append(row)
    return rows, taken, cropped


def shard_documents(prefix, eod):
    """The shard's documents as the authors' tokenizer gives them: data prep stored BOS, the
    text's tokens and one EOD; the authors' documents have no EOD."""
    data = IndexedDataset(prefix)
    docs = [data[i].tolist() for i in range(len(data))]
    assert all(d[-1] == eod for d in docs)
    return [d[:-1] for d in docs]


def endless(docs, seed):
    """The order the key documents: each epoch a permutation from one RandomState(train.seed)."""
    rng = np.random.RandomState(seed)
    while True:
        for i in rng.permutation(len(docs)):
            yield docs[i]


# --- the project's rows ------------------------------------------------------------------------

def config(shards, run_dir, *sets):
    return load_config("configs/tiny.yaml", [
        "data.mock=false", f"data.paths=[{shards['train'][0]}]", f"data.valid_paths=[{shards['valid'][0]}]",
        f"data.tokenizer={shards['tokenizer']}", "data.packing=bestfit", f"run.dir={run_dir}", *sets])


def rows_of(dataset):
    return [dataset[i]["tokens"].tolist() + dataset[i]["labels"][-1:].tolist() for i in range(len(dataset))]


@pytest.fixture(scope="module")
def tok(sample_shards):
    return Tokenizer(sample_shards["tokenizer"])


@pytest.mark.parametrize("seq, buffer", [(256, 1000), (512, 16), (64, 100)])
def test_rows_equal_the_authors_algorithm(sample_shards, tok, tmp_path, seq, buffer):
    assert len(sample_shards["train"]) == len(sample_shards["valid"]) == 1
    cfg = config(sample_shards, tmp_path, f"model.seq_length={seq}", f"data.packing_buffer={buffer}",
                 "train.seed=7")
    train, valid = build_datasets(cfg, 300, 12)
    for dataset, prefix, n in ((train, sample_shards["train"][0], 300), (valid, sample_shards["valid"][0], 12)):
        docs = shard_documents(prefix, tok.eod)
        assert all(d[0] == tok.bos for d in docs)
        expected, taken, cropped = authors_rows(endless(docs, 7), n, seq, buffer)
        got = rows_of(dataset)
        assert len(got) == n and got == expected
        assert all(row[0] == tok.bos for row in got)  # every row starts at a document's BOS
        # the cropped fraction the run's log reports is the test's count
        assert cropped > 0 and dataset.token_counts()[1:] == (taken, cropped)
        assert f"{100 * cropped / taken:.1f} % of their tokens cropped" in cropped_report(dataset)
        if dataset is valid:  # 19 documents: too few for the controls to tell (they fill the buffer many times over)
            continue
        # negative controls: first-fit, cropping the first buffered document, or another order packs other rows
        assert authors_rows(endless(docs, 7), n, seq, buffer, choose="first")[0] != got
        assert authors_rows(endless(docs, 7), n, seq, buffer, crop="first")[0] != got
        assert authors_rows(endless(docs, 8), n, seq, buffer)[0] != got


def test_concat_rows_differ_and_start_anywhere(sample_shards, tok, tmp_path):
    """The default packing (megatron's GPTDataset) is not the authors': the control for the
    BOS-at-every-row check."""
    cfg = config(sample_shards, tmp_path, "model.seq_length=256", "data.packing=concat")
    train, _ = build_datasets(cfg, 100, 4)
    rows = [train[i]["tokens"].tolist() for i in range(len(train))]
    assert sum(r[0] != tok.bos for r in rows) > len(rows) // 2
    assert cropped_report(train) is None


def test_deterministic_restart_and_longer_run(sample_shards, tmp_path):
    """Row i is a function of (seed, i): a fresh build, a restart that reads the cached index,
    and a longer run all give the same rows; another seed gives other rows."""
    sets = ("model.seq_length=128", "train.seed=3")
    first = rows_of(build_datasets(config(sample_shards, tmp_path / "a", *sets), 200, 4)[0])
    cache = list((tmp_path / "a" / "data_cache").glob("*BestFitDataset-train-row_start.npy"))
    assert len(cache) == 1
    restarted = build_datasets(config(sample_shards, tmp_path / "a", *sets), 200, 4)[0]
    assert isinstance(restarted.row_start, np.memmap)  # read from the cache, not packed again
    assert rows_of(restarted) == first
    assert rows_of(build_datasets(config(sample_shards, tmp_path / "b", *sets), 200, 4)[0]) == first
    assert rows_of(build_datasets(config(sample_shards, tmp_path / "c", *sets), 500, 4)[0])[:200] == first
    other = rows_of(build_datasets(config(sample_shards, tmp_path / "d", "model.seq_length=128", "train.seed=4"),
                                   200, 4)[0])
    assert other != first


def test_blend_of_two_prefixes(sample_shards, tok, tmp_path):
    """Weighted blends go through megatron's BlendedDataset over best-fit parts."""
    train = sample_shards["train"][0]
    cfg = config(sample_shards, tmp_path, "model.seq_length=128", f"data.paths=[0.7,{train},0.3,{train}]")
    blended, _ = build_datasets(cfg, 100, 4)
    assert type(blended).__name__ == "BlendedDataset" and len(blended) == 100
    assert all(blended[i]["tokens"][0] == tok.bos for i in range(len(blended)))
    assert "% of their tokens cropped" in cropped_report(blended)


def test_refusals(sample_shards, tmp_path):
    def refused(*sets):
        with pytest.raises(ConfigError) as e:
            check_packing(config(sample_shards, tmp_path, *sets).data)
        assert str(e.value).startswith("config: data.packing: bestfit needs") and "\n" not in str(e.value)
        return str(e.value)

    check_packing(config(sample_shards, tmp_path).data)  # the manifest says bos: true
    assert "data.bos is false" in refused("data.bos=false")
    assert "data.tokenizer" in refused("data.tokenizer=null")
    # documents without BOS, though data.bos says otherwise: the dataset refuses them
    prefix = str(tmp_path / "nobos")
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in ([5, 6, 7, 2], [1, 8, 9, 2]):
        builder.add_document(np.array(doc, dtype=np.uint16), [len(doc)])
    builder.finalize(prefix + ".idx")
    cfg = config(sample_shards, tmp_path, f"data.paths=[{prefix}]", f"data.valid_paths=[{prefix}]", "data.bos=true")
    with pytest.raises(ConfigError, match=r"^config: data.packing: bestfit needs documents that start with BOS"):
        build_datasets(cfg, 4, 4)


@pytest.mark.slow
def test_training_logs_the_cropped_fraction(sample_shards, tmp_path):
    """A run with bestfit trains, validates and says at start how much it crops."""
    done = subprocess.run(
        [sys.executable, "launch/pretrain.py", "--config", "configs/tiny.yaml", "--set", "data.mock=false",
         f"data.paths=[{sample_shards['train'][0]}]", f"data.valid_paths=[{sample_shards['valid'][0]}]",
         f"data.tokenizer={sample_shards['tokenizer']}", "data.packing=bestfit", f"run.dir={tmp_path / 'run'}",
         "train.steps=2", "eval.valid_every=2", "log.interval=1", "log.tensorboard=false", "checkpoint.interval=100"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    line = [ln for ln in done.stdout.splitlines() if ln.startswith("data: bestfit packing")]
    assert len(line) == 1 and "train 16 rows from" in line[0] and "valid 8 rows" in line[0], done.stdout
