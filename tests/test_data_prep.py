"""data_prep: round trip against SentencePiece itself, megatron-core's reader/writer as the format
reference, determinism across worker counts, resume after SIGKILL, and bad input.

Runs on a slice of the bundled sample and a 600-piece tokenizer so everything stays in seconds.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import sentencepiece as spm

from megatron_kappa.data_prep import DataPrepError
from megatron_kappa.data_prep.fineweb_edu import run
from megatron_kappa.data_prep.shards import ShardWriter, choose_dtype
from megatron_kappa.tokenizer import BOS_ID, EOD_ID, PAD_ID, UNK_ID, Tokenizer, train_tokenizer

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO / "data_prep" / "sample"
SLICE_ROWS, ROW_GROUP, VOCAB = 1536, 128, 600
COMMON = ["--shard-tokens", "20K", "--valid-fraction", "0.05", "--quiet"]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A parquet slice of the sample (12 row groups = 12 work units) and a tokenizer trained on it."""
    d = tmp_path_factory.mktemp("data_prep")
    table = pq.read_table(SAMPLE / "fwe_sample_00000.parquet").slice(0, SLICE_ROWS)
    pq.write_table(table, d / "slice.parquet", row_group_size=ROW_GROUP, compression="zstd")
    texts = table["text"].to_pylist()
    train_tokenizer(texts[:800], d / "tok.model", VOCAB, num_threads=1)
    return d


def prep(out, inputs, tokenizer, *extra):
    return run(["--input", *map(str, inputs), "--output", str(out), "--tokenizer", str(tokenizer),
                *COMMON, *extra])


def read_docs(out, prefixes):
    """Documents as megatron-core's own reader sees them (the independent format reference)."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    docs = []
    for prefix in prefixes:
        ds = IndexedDataset(str(Path(out) / prefix))
        assert len(ds.document_indices) == len(ds) + 1
        docs += [ds[i].tolist() for i in range(len(ds))]
    return docs


def check_round_trip(texts, model_file, train, valid, eod=EOD_ID, bos=True):
    """Every input text, in order, appears as [BOS] + sp.encode(text) + [EOD] ([BOS] only when
    `bos`) in train or in valid, and the shards hold nothing else. Encodes one document at a time,
    unlike the tool's batched path."""
    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    ti = vi = 0
    for text in texts:
        want = [BOS_ID] * bos + sp.encode(text) + [eod]
        if ti < len(train) and train[ti] == want:
            ti += 1
        elif vi < len(valid) and valid[vi] == want:
            vi += 1
        else:
            raise AssertionError(f"document {text[:40]!r} missing or out of order")
        assert sp.decode(want[int(bos):-1]) == text
    assert (ti, vi) == (len(train), len(valid)), "shards hold documents the input does not"


def kept_texts(path, min_score=None, language=None):
    t = pq.read_table(path)
    mask = pc.greater(pc.utf8_length(t["text"]), 0)
    if min_score is not None:
        mask = pc.and_(mask, pc.greater_equal(t["int_score"], min_score))
    if language is not None:
        mask = pc.and_(mask, pc.equal(t["language"], language))
    return t.filter(mask)["text"].to_pylist()


def files(out):
    return {p.name: p.read_bytes() for p in sorted(Path(out).iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def reference(work):
    """The slice with both filters, one process (workers=1 runs in-process)."""
    out = work / "ref"
    manifest = prep(out, [work / "slice.parquet"], work / "tok.model", "--workers", "1",
                    "--min-int-score", "4", "--language", "en")
    return out, manifest


def test_tokenizer_training_deterministic_across_threads(work, tmp_path):
    texts = pq.read_table(work / "slice.parquet")["text"].to_pylist()[:800]
    a = train_tokenizer(texts, tmp_path / "a.model", VOCAB, num_threads=2).read_bytes()
    assert a == (work / "tok.model").read_bytes()  # fixture was trained with one thread
    other = train_tokenizer(texts[1:], tmp_path / "b.model", VOCAB).read_bytes()
    assert other != a  # negative control: a different sample gives a different model
    tok = Tokenizer(work / "tok.model")
    assert (tok.vocab_size, tok.bos, tok.eod, tok.pad) == (VOCAB, BOS_ID, EOD_ID, PAD_ID)
    assert tok.sp.unk_id() == UNK_ID and tok.sp.id_to_piece(EOD_ID) == "</s>"


def test_train_tokenizer_flag_uses_first_kept_documents(work, tmp_path):
    """--train-tokenizer trains on the first --tokenizer-sample-docs kept documents, in order."""
    out = tmp_path / "trained"
    m = run(["--input", str(work / "slice.parquet"), "--output", str(out), "--train-tokenizer",
             "--vocab-size", str(VOCAB), "--tokenizer-sample-docs", "300", "--language", "en",
             "--valid-fraction", "0", "--workers", "2", "--shard-tokens", "1M", "--quiet"])
    texts = kept_texts(work / "slice.parquet", language="en")
    ref = train_tokenizer(texts[:300], tmp_path / "ref.model", VOCAB).read_bytes()
    assert (out / "tokenizer.model").read_bytes() == ref
    assert m["tokenizer"]["sha256"] == Tokenizer(tmp_path / "ref.model").sha256()
    assert m["prefixes"]["valid"] == [] and m["totals"]["train"]["documents"] == len(texts)


def test_shard_writer_matches_megatron_builder(tmp_path):
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 60000, size=n).astype(np.uint16) for n in (5, 1, 300, 17)]
    ours = ShardWriter(tmp_path / "ours", np.dtype(np.uint16))
    ref = IndexedDatasetBuilder(str(tmp_path / "ref.bin"), dtype=np.uint16)
    for doc in docs:
        ours.add(doc)
        ref.add_document(torch.from_numpy(doc.astype(np.int64)), [len(doc)])
    ours.close()
    ref.finalize(str(tmp_path / "ref.idx"))
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"ours{ext}").read_bytes() == (tmp_path / f"ref{ext}").read_bytes()
    assert read_docs(tmp_path, ["ours"]) == [d.tolist() for d in docs]


def test_round_trip_and_exact_manifest(work, reference):
    out, manifest = reference
    texts = kept_texts(work / "slice.parquet", min_score=4, language="en")
    train = read_docs(out, manifest["prefixes"]["train"])
    valid = read_docs(out, manifest["prefixes"]["valid"])
    check_round_trip(texts, out / "tokenizer.model", train, valid)
    assert 0.02 < len(valid) / len(texts) < 0.1  # --valid-fraction 0.05
    assert len(manifest["prefixes"]["train"]) > 5  # small shards: several checkpoints
    t = manifest["totals"]
    assert t["train"]["documents"] == len(train) and t["valid"]["documents"] == len(valid)
    assert t["train"]["tokens"] == sum(map(len, train)) and t["valid"]["tokens"] == sum(map(len, valid))
    for entry in manifest["shards"]:
        docs = read_docs(out, [entry["prefix"]])
        assert (entry["documents"], entry["tokens"]) == (len(docs), sum(map(len, docs)))
    table = pq.read_table(work / "slice.parquet")
    assert t["rows_read"] == SLICE_ROWS
    assert t["dropped"]["language"] == pc.sum(pc.not_equal(table["language"], "en")).as_py()
    assert SLICE_ROWS - sum(t["dropped"].values()) == len(texts)
    assert manifest["tokenizer"]["sha256"] == Tokenizer(work / "tok.model").sha256()
    assert manifest["dtype"] == "uint16" and not (out / ".progress").exists()
    assert manifest["bos"] is True and manifest["config"]["bos"] is True


def test_bos_starts_every_document_and_no_bos_leaves_it_out(work, reference, tmp_path):
    """Default shards: megatron-core's reader sees BOS first and EOD last in every document, and
    nowhere else. --no-bos: the old layout, recorded as such; the BOS check rejects it."""
    out, manifest = reference
    docs = read_docs(out, manifest["prefixes"]["train"] + manifest["prefixes"]["valid"])
    assert docs and all(d[0] == BOS_ID and d[-1] == EOD_ID for d in docs)
    assert sum(d.count(BOS_ID) for d in docs) == len(docs)  # only at document starts
    plain = prep(tmp_path / "nobos", [work / "slice.parquet"], work / "tok.model", "--workers", "1",
                 "--min-int-score", "4", "--language", "en", "--no-bos")
    assert plain["bos"] is False and "no BOS" in plain["layout"]
    texts = kept_texts(work / "slice.parquet", min_score=4, language="en")
    train = read_docs(tmp_path / "nobos", plain["prefixes"]["train"])
    valid = read_docs(tmp_path / "nobos", plain["prefixes"]["valid"])
    check_round_trip(texts, out / "tokenizer.model", train, valid, bos=False)
    assert not any(BOS_ID in d for d in train + valid)
    with pytest.raises(AssertionError):  # negative control: BOS-less shards fail the BOS layout
        check_round_trip(texts, out / "tokenizer.model", train, valid, bos=True)
    # Same documents, one token more each: the totals differ by exactly the document count.
    t, u = manifest["totals"], plain["totals"]
    assert t["train"]["tokens"] - u["train"]["tokens"] == t["train"]["documents"] == u["train"]["documents"]
    # A finished output made with the other setting is not silently reused.
    with pytest.raises(DataPrepError):
        prep(tmp_path / "nobos", [work / "slice.parquet"], work / "tok.model", "--workers", "1",
             "--min-int-score", "4", "--language", "en")


def test_round_trip_check_catches_broken_shards(work, reference):
    """Negative control: the checker above must fail on swapped documents or a missing EOD."""
    out, manifest = reference
    texts = kept_texts(work / "slice.parquet", min_score=4, language="en")
    train = read_docs(out, manifest["prefixes"]["train"])
    valid = read_docs(out, manifest["prefixes"]["valid"])
    swapped = train[:3] + [train[4], train[3]] + train[5:]
    no_eod = [train[0][:-1]] + train[1:]
    no_bos = [train[0][1:]] + train[1:]
    for bad in (swapped, no_eod, no_bos, train[:-1]):
        with pytest.raises(AssertionError):
            check_round_trip(texts, out / "tokenizer.model", bad, valid)


def test_same_bytes_for_any_worker_count_and_jsonl(work, reference, tmp_path):
    out1, _ = reference
    args = ("--min-int-score", "4", "--language", "en")
    before = {p.name: p.stat().st_mtime_ns for p in out1.iterdir()}
    prep(out1, [work / "slice.parquet"], work / "tok.model", "--workers", "2", *args)  # complete
    assert {p.name: p.stat().st_mtime_ns for p in out1.iterdir()} == before  # nothing redone
    prep(tmp_path / "w3", [work / "slice.parquet"], work / "tok.model", "--workers", "3", *args)
    assert files(tmp_path / "w3") == files(out1)
    # The same rows as jsonl, cut into many byte-range units: identical shards.
    table = pq.read_table(work / "slice.parquet")
    with open(tmp_path / "slice.jsonl", "w") as f:
        for row in table.to_pylist():
            f.write(json.dumps(row) + "\n")
    prep(tmp_path / "js", [tmp_path / "slice.jsonl"], work / "tok.model", "--workers", "2",
         "--jsonl-unit-bytes", "50K", *args)
    a, b = files(tmp_path / "js"), files(out1)
    assert a.pop("manifest.json") != b.pop("manifest.json")  # the source differs, nothing else
    assert a == b


def test_limits_stop_at_exact_counts(work, tmp_path):
    m = prep(tmp_path / "docs", [work / "slice.parquet"], work / "tok.model", "--workers", "1",
             "--max-docs", "100")
    t = m["totals"]
    assert t["train"]["documents"] + t["valid"]["documents"] == 100
    sp = spm.SentencePieceProcessor(model_file=str(work / "tok.model"))
    texts = kept_texts(work / "slice.parquet")
    lengths = np.array([len(sp.encode(x)) + 2 for x in texts])  # BOS and EOD
    m = prep(tmp_path / "tok", [work / "slice.parquet"], work / "tok.model", "--workers", "1",
             "--max-tokens", "30000")
    t = m["totals"]
    n = t["train"]["documents"] + t["valid"]["documents"]
    assert t["train"]["tokens"] + t["valid"]["tokens"] == lengths[:n].sum() <= 30000
    assert lengths[:n + 1].sum() > 30000


def test_hub_path_with_a_local_stand_in(work, reference, tmp_path, monkeypatch):
    """The streaming hub reader, fed by a local IterableDataset instead of the network."""
    import datasets
    stream = datasets.Dataset.from_parquet(str(work / "slice.parquet")).to_iterable_dataset()
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: stream)
    out = tmp_path / "hub"
    run(["--input", "HuggingFaceFW/fineweb-edu", "--name", "sample-10BT", "--output", str(out),
         "--tokenizer", str(work / "tok.model"), "--workers", "1", "--hub-unit-docs", "100",
         "--min-int-score", "4", "--language", "en", *COMMON])
    a, b = files(out), files(reference[0])
    assert json.loads(a.pop("manifest.json"))["source"] == {
        "hub": "HuggingFaceFW/fineweb-edu", "config": "sample-10BT", "split": "train"}
    b.pop("manifest.json")
    assert a == b


def _two_worker_prep(work):
    """(inputs, options, the CLI up to --input, env) of a 2-worker run over the sample in small shards."""
    inputs = [str(SAMPLE)]
    args = ["--tokenizer", str(work / "tok.model"), "--workers", "2", "--shard-tokens", "50K",
            "--valid-fraction", "0.02", "--quiet"]
    return inputs, args, [sys.executable, str(REPO / "data_prep" / "fineweb_edu.py"), "--input", *inputs], \
        dict(os.environ, OMP_NUM_THREADS="1")


def _signal_after_shards(proc, out, shards: int, signum):
    """Send `signum` to the CLI's process group once `shards` shards are finished. Waits as long
    as the CLI runs (under a loaded CI the first shard took over a minute: a deadline here once
    let the run finish unsignalled); fails if it ended first."""
    state = out / ".progress" / "state.json"
    while proc.poll() is None:
        if state.exists() and len(json.loads(state.read_text())["checkpoints"]) >= shards:
            os.killpg(proc.pid, signum)
            return
        time.sleep(0.01)
    raise AssertionError(f"the data prep CLI ended (exit {proc.returncode}) before {shards} shard(s) were "
                         "finished and it could be signalled")


@pytest.mark.slow
def test_resume_after_sigkill_is_byte_identical(work, tmp_path):
    """Kill the CLI (and its workers) once two shards are finished, rerun, compare bytes."""
    inputs, args, prep_cli, env = _two_worker_prep(work)
    killed = tmp_path / "killed"
    proc = subprocess.Popen([*prep_cli, "--output", str(killed), *args], env=env,
                            start_new_session=True, stderr=subprocess.PIPE)
    _signal_after_shards(proc, killed, 2, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it could be killed"
    assert not (killed / "manifest.json").exists()
    first = (killed / "train_00000.bin").stat()
    (killed / "train_00042.bin").write_bytes(b"partial")  # junk under a final name: not finished
    (killed / "train_00043.idx.tmp").write_bytes(b"partial")
    rerun = subprocess.run([*prep_cli, "--output", str(killed), *args], env=env, capture_output=True)
    assert rerun.returncode == 0, rerun.stderr.decode()[-2000:]
    again = (killed / "train_00000.bin").stat()
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)  # not redone
    whole = tmp_path / "whole"
    run(["--input", *inputs, "--output", str(whole), *args])
    assert files(killed) == files(whole)


@pytest.mark.slow
def test_ctrl_c_is_one_line_and_the_rerun_finishes(work, tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) once a shard is finished: one
    line, exit 130, no traceback from the CLI or its 2 workers; the same command then finishes
    with the uninterrupted run's bytes."""
    inputs, args, prep_cli, env = _two_worker_prep(work)
    out = tmp_path / "stopped"
    # SIGINT at its default, as in a terminal: a job started in the background by a non-interactive
    # shell (`cmd &`, as a CI harness may run `make test`) inherits it ignored, and Python keeps it so
    proc = subprocess.Popen([*prep_cli, "--output", str(out), *args], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _signal_after_shards(proc, out, 1, signal.SIGINT)  # what a terminal's Ctrl-C does
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip() == "interrupted: the finished shards are kept; the same command resumes", err[-2000:]
    assert not (out / "manifest.json").exists()
    rerun = subprocess.run([*prep_cli, "--output", str(out), *args], env=env, capture_output=True)
    assert rerun.returncode == 0, rerun.stderr.decode()[-2000:]
    whole = tmp_path / "whole"
    run(["--input", *inputs, "--output", str(whole), *args])
    assert files(out) == files(whole)


@pytest.mark.slow
@pytest.mark.parametrize("to_group", [False, True])
def test_sigterm_is_one_line_without_a_leak_and_the_rerun_finishes(work, tmp_path, to_group):
    """SIGTERM once a shard is finished, to the CLI alone (kill PID) or to its process group (as a
    scheduler may): one line saying what happened, exit 143, no traceback and no resource
    tracker warning of leaked semaphores (it died at once, silent but for that warning); the same
    command then finishes with the uninterrupted run's bytes."""
    inputs, args, prep_cli, env = _two_worker_prep(work)
    out = tmp_path / "stopped"
    proc = subprocess.Popen([*prep_cli, "--output", str(out), *args], env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if to_group:
        _signal_after_shards(proc, out, 1, signal.SIGTERM)
    else:
        state = out / ".progress" / "state.json"
        while proc.poll() is None and not (state.exists() and json.loads(state.read_text())["checkpoints"]):
            time.sleep(0.01)
        assert proc.poll() is None, "the data prep CLI ended before it could be signalled"
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    assert err.strip() == "terminated (SIGTERM): the finished shards are kept; the same command resumes", \
        err[-2000:]
    assert not (out / "manifest.json").exists()
    rerun = subprocess.run([*prep_cli, "--output", str(out), *args], env=env, capture_output=True)
    assert rerun.returncode == 0, rerun.stderr.decode()[-2000:]
    whole = tmp_path / "whole"
    run(["--input", *inputs, "--output", str(whole), *args])
    assert files(out) == files(whole)


def expect_error(match, *argv):
    with pytest.raises(DataPrepError, match=match) as info:
        run(list(map(str, argv)))
    assert "\n" not in str(info.value)


def test_bad_inputs_fail_before_work(work, tmp_path):
    tok = work / "tok.model"
    out = tmp_path / "out"
    base = ("--output", out, "--tokenizer", tok, "--quiet")
    expect_error(r"no column 'body'", "--input", work / "slice.parquet", "--text-column", "body", *base)
    (tmp_path / "a.jsonl").write_text('{"content": "x"}\n')
    expect_error(r"a\.jsonl: no column 'text'", "--input", tmp_path / "a.jsonl", *base)
    (tmp_path / "b.jsonl").write_text('{"text": "x"}\n')
    expect_error(r"no column 'int_score'.*--min-int-score", "--input", tmp_path / "b.jsonl",
                 "--min-int-score", "3", *base)
    (tmp_path / "empty.parquet").write_bytes(b"")
    expect_error(r"empty\.parquet: empty file", "--input", tmp_path / "empty.parquet", *base)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet at all" * 10)
    expect_error(r"junk\.parquet: corrupt or not a parquet", "--input", tmp_path / "junk.parquet", *base)
    expect_error(r"no such file", "--input", tmp_path / "nope.parquet", *base)
    expect_error(r"vocabulary 70000 does not fit --dtype uint16", "--input", work / "slice.parquet",
                 "--output", out, "--train-tokenizer", "--vocab-size", "70000", "--dtype", "uint16")
    assert not out.exists()  # every check above ran before the output folder was touched
    with pytest.raises(DataPrepError, match="does not fit"):
        choose_dtype(70000, "uint16")
    assert choose_dtype(70000).name == "int32" and choose_dtype(32768).name == "uint16"


def test_output_from_another_tokenizer_or_tool_is_refused(work, reference, tmp_path):
    texts = pq.read_table(work / "slice.parquet")["text"].to_pylist()
    other = train_tokenizer(texts[800:1200], tmp_path / "other.model", VOCAB)
    out = reference[0]
    before = files(out)
    expect_error(r"another tokenizer", "--input", work / "slice.parquet", "--output", out,
                 "--tokenizer", other, "--min-int-score", "4", "--language", "en", *COMMON)
    assert files(out) == before
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "train_00000.bin").write_bytes(b"\0\0")
    expect_error(r"not made by a run of this tool", "--input", work / "slice.parquet", "--output",
                 foreign, "--tokenizer", work / "tok.model", "--quiet")
    cli = subprocess.run([sys.executable, str(REPO / "data_prep" / "fineweb_edu.py"), "--input",
                          str(tmp_path / "missing.jsonl"), "--output", str(foreign), "--tokenizer",
                          str(work / "tok.model")], capture_output=True, text=True)
    assert cli.returncode == 1 and cli.stderr.startswith("error: ") and cli.stderr.count("\n") == 1


def test_corrupt_row_group_mid_stream_keeps_finished_shards(work, reference, tmp_path):
    bad = tmp_path / "bad.parquet"
    data = bytearray((work / "slice.parquet").read_bytes())
    col = pq.ParquetFile(work / "slice.parquet").metadata.row_group(8).column(0)
    start = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
    middle = start + col.total_compressed_size // 2
    data[middle:middle + 64] = b"\xff" * 64
    bad.write_bytes(bytes(data))
    out = tmp_path / "out"
    expect_error(r"bad\.parquet: row group 8: corrupt parquet", "--input", bad, "--output", out,
                 "--tokenizer", work / "tok.model", "--workers", "2", *COMMON)
    state = json.loads((out / ".progress" / "state.json").read_text())
    done = [c["train"]["prefix"] for c in state["checkpoints"] if c["train"]]
    assert len(done) >= 3 and not list(out.glob("*.tmp"))
    # Units before the corrupt one are the reference's documents (no filters here): compare.
    ref = tmp_path / "ref"
    prep(ref, [work / "slice.parquet"], work / "tok.model", "--workers", "1")
    for prefix in done:
        for ext in (".bin", ".idx"):
            assert (out / f"{prefix}{ext}").read_bytes() == (ref / f"{prefix}{ext}").read_bytes()


def test_no_documents_left_fails_without_a_manifest(work, tmp_path):
    """Only empty texts, with an existing tokenizer: one error, no manifest (it used to exit 0
    with 0 shards); the same run on real texts writes shards (control)."""
    import pyarrow as pa
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"text": ["", "", ""], "language": ["en"] * 3}), empty)
    with pytest.raises(DataPrepError, match=r"no documents left after the filters \(3 rows read\); no shards written"):
        prep(tmp_path / "out", [empty], work / "tok.model")
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert prep(tmp_path / "ok", [work / "slice.parquet"], work / "tok.model")["totals"]["train"]["shards"] > 0


def test_a_full_disk_is_one_line_and_the_finished_shards_stay(work, tmp_path, monkeypatch, capsys):
    """The disk fills while a shard is written: one line saying so, exit 1, no traceback (it was a
    traceback); what was finished stays for the rerun."""
    import errno

    from megatron_kappa.data_prep import fineweb_edu, shards

    def full(self, tokens, lengths):
        raise OSError(errno.ENOSPC, "No space left on device", str(self._tmp(".bin")))
    monkeypatch.setattr(shards.ShardWriter, "add_many", full)
    monkeypatch.setattr(shards.ShardWriter, "add", lambda self, doc: full(self, doc, None))
    out = tmp_path / "full"
    code = fineweb_edu.main(["--input", str(work / "slice.parquet"), "--output", str(out),
                             "--tokenizer", str(work / "tok.model"), "--workers", "1", "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("error: writing ") and "no space left on the device" in err[-1], err
    assert "the same command resumes" in err[-1] and not (out / "manifest.json").exists()


def test_progress_in_a_log_is_one_line_per_report_at_a_modest_rate():
    """stderr not a terminal (a log, a pipe): the docs-read progress is plain lines, one per report,
    none with a carriage return; at the log interval many updates give only the first and the last
    line. Negative control: on a terminal it is tqdm's bar, redrawn with carriage returns."""
    import io

    from megatron_kappa.data_prep.fineweb_edu import progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    def report(stream, interval, updates):
        bar = progress(1000, 100, False, stream=stream, interval=interval)
        for i in range(updates):
            bar.update(1)
            bar.set_postfix_str(f"{i} docs/s written", refresh=False)
        bar.close()
        return stream.getvalue()
    every = report(io.StringIO(), 0.0, 3)
    lines = every.splitlines()
    assert "\r" not in every and every.endswith("\n") and len(lines) >= 4, every
    assert lines[0].startswith("docs read: 100/1.00k (10 %)") and lines[-1].startswith("docs read: 103/1.00k (10 %)")
    modest = report(io.StringIO(), 3600.0, 500).splitlines()
    assert len(modest) == 2 and modest[-1].startswith("docs read: 600/1.00k (60 %)"), modest
    terminal = report(Terminal(), 0.0, 3)
    assert terminal.count("\r") >= 2 and terminal.count("\n") == 1  # one line, redrawn
    assert report(io.StringIO(), 0.0, 3) and progress(10, 0, True, stream=io.StringIO()).disable  # --quiet


def test_a_full_disk_names_the_output_folder_and_its_free_space(work, tmp_path, monkeypatch, capsys):
    """The buffered shard write fails as a full disk does (ENOSPC, no file name) while the command
    runs from another folder on a disk with room: the line names the shard being written, the
    output folder and the free space there (it named the current folder's, and "torch said");
    the rerun after freeing space finishes with the bytes of a run that never failed."""
    import errno
    import shutil
    from collections import namedtuple

    from megatron_kappa.data_prep import fineweb_edu, shards
    out = tmp_path / "out"
    usage = namedtuple("usage", "total used free")
    real_usage, real_open, writes = shutil.disk_usage, open, [0]
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 30, 10 << 30, 0)
                        if str(path).startswith(str(out)) else real_usage(path))

    class FullDisk:  # a .bin file whose third write finds the disk full, as a buffered write says it
        def __init__(self, f):
            self.f = f

        def write(self, data):
            writes[0] += 1
            if writes[0] == 3:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)
    monkeypatch.setattr(shards, "open", lambda path, *a, **k: FullDisk(real_open(path, *a, **k))
                        if str(path).endswith(".bin.tmp") else real_open(path, *a, **k), raising=False)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    argv = ["--input", str(work / "slice.parquet"), "--output", str(out), "--tokenizer", str(work / "tok.model"),
            "--workers", "1", *COMMON]
    assert fineweb_edu.main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(
        rf"error: writing {re.escape(str(out))}/train_\d+\.bin\.tmp: no space left on the device \(0 MiB free in "
        rf"{re.escape(str(out))}\); the finished shards are kept and the same command resumes", err[0]), err
    monkeypatch.undo()  # space freed
    assert fineweb_edu.main(argv) == 0
    whole = tmp_path / "whole"
    run([*argv[:3], str(whole), *argv[4:]])
    assert files(out) == files(whole) and writes[0] >= 3
