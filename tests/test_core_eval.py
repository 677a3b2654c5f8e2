"""CORE evaluation and validation loss: bundle reading, prompts, scoring, CORE arithmetic, ranks.

Scoring is proven with controlled models over a byte tokenizer: a rigged model that prefers the gold
answer (must score 1), one rigged to a wrong answer (negative control, must score 0) and a uniform
one (must score the tie-broken baseline). Expected values come from the raw files and hand arithmetic.
"""
import json
import math
import random
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from megatron_kappa.bench.toy import ByteTokenizer, TinyCausalLM
from megatron_kappa.cli import eval_core as core_cli
from megatron_kappa.evaluation import core as ce
from megatron_kappa.evaluation.lm_loss import validation_loss
from megatron_kappa.parallel.launch_env import free_port

ROOT = Path(__file__).resolve().parents[1]

BUNDLE = ROOT / "tests" / "core_bundle"
TOK = ByteTokenizer()
V = TOK.vocab_size


def raw_tasks():
    """label -> (type, [examples]) read straight from the files, independently of the library."""
    out = {}
    for t in ce.load_bundle(BUNDLE).tasks:
        lines = Path(t.file).read_text().splitlines()
        out[t.label] = (t.type, [json.loads(x) for x in lines if x.strip()])
    return out


def uniform(tokens):
    return torch.zeros(*tokens.shape, V)


class Rigged:
    """Cheating model: on rows whose text ends with a string in `prefer` it puts a high logit on the
    row's actual next token; on rows ending with one in `miss`, on the next token + 1 (so greedy
    decoding always misses); other rows are uniform."""

    def __init__(self, prefer=(), miss=()):
        self.prefer, self.miss = tuple(prefer), tuple(miss)

    def __call__(self, tokens):
        logits = torch.zeros(*tokens.shape, V)
        for i, row in enumerate(tokens):
            text = TOK.decode(row.tolist())
            if text.endswith(self.prefer) or text.endswith(self.miss):
                nxt = row[1:] if text.endswith(self.prefer) else (row[1:] - 4 + 1) % 256 + 4
                logits[i, torch.arange(len(row) - 1), nxt] = 10.0
        return logits


def endings(offset):
    """Tails of the prompts of answer (gold + offset) for every multiple-choice and schema item, and
    (gold only) of the prompt with its continuation for every language-modeling item."""
    out = set()
    delims = {t.label: t.delimiter for t in ce.load_bundle(BUNDLE).tasks}
    for label, (kind, items) in raw_tasks().items():
        d = delims[label]
        for ex in items:
            if kind == "multiple_choice":
                out.add(ex["query"] + d + ex["choices"][(ex["gold"] + offset) % len(ex["choices"])])
            elif kind == "schema":
                opts = ex["context_options"]
                out.add(opts[(ex["gold"] + offset) % len(opts)] + d + ex["continuation"])
            elif offset == 0:
                out.add(ex["context"].strip() + d + ex["continuation"])
    return out


def accuracies(result):
    return {r["task"]: r["accuracy"] for r in result["tasks"]}


# ----------------------------------------------------------------------------- bundle

def test_bundle_folder_zip_and_url_read_the_same(tmp_path):
    folder = ce.load_bundle(BUNDLE)
    assert [(t.label, t.type, t.shots, t.delimiter, len(t.examples)) for t in folder.tasks] == [
        ("arc_easy", "multiple_choice", 2, "\nAnswer: ", 6), ("commonsense_qa", "multiple_choice", 1, " ", 5),
        ("boolq", "multiple_choice", 2, "\nAnswer: ", 6), ("winograd", "schema", 0, " ", 5),
        ("winogrande", "schema", 1, " ", 5), ("lambada_openai", "language_modeling", 0, " ", 5),
        ("jeopardy", "language_modeling", 2, "\nAnswer: ", 6)]
    archive = tmp_path / "eval_bundle.zip"
    with zipfile.ZipFile(archive, "w") as zf:  # nanochat's zip holds one top folder
        for f in BUNDLE.rglob("*"):
            if f.is_file():
                zf.write(f, "eval_bundle/" + f.relative_to(BUNDLE).as_posix())
    for other in (ce.load_bundle(archive), ce.load_bundle(archive.as_uri(), cache_dir=tmp_path / "cache")):
        assert [(t.label, t.examples) for t in other.tasks] == [(t.label, t.examples) for t in folder.tasks]
    assert (tmp_path / "cache" / "eval_bundle.zip").is_file()


def broken(tmp_path, rel, edit):
    bad = tmp_path / "bundle"
    shutil.copytree(BUNDLE, bad)
    f = bad / rel
    if edit is None:
        f.unlink()
    else:
        f.write_text(edit(f.read_text()))
    return bad


@pytest.mark.parametrize("rel, edit, expected", [
    ("eval_data/reading_comprehension/boolq.jsonl", None,
     r"boolq\.jsonl: missing \(named by .*core\.yaml:16, task 'boolq'\)"),
    ("core.yaml", None, r"bundle: no core\.yaml \(expected it in the folder"),
    ("eval_data/world_knowledge/arc_easy.jsonl", lambda s: s.replace('"gold": 3}', '"gold": 3', 1),
     r"arc_easy\.jsonl:4: bad JSON line"),
    ("core.yaml", lambda s: s.replace("icl_task_type: schema", "icl_task_type: cloze", 1),
     r"core\.yaml:25: unknown icl_task_type 'cloze'"),
    ("eval_data/language_understanding/winogrande.jsonl", lambda s: s.replace('"gold": 1}', '"gold": 2}', 1),
     r"winogrande\.jsonl:3: gold 2 out of range for 2 context_options"),
    ("eval_data/world_knowledge/jeopardy_all.jsonl", lambda s: s.replace('"continuation"', '"answer"', 1),
     r"jeopardy_all\.jsonl:1: expected a non-empty string 'continuation'"),
])
def test_malformed_bundle_names_file_and_line(tmp_path, rel, edit, expected):
    with pytest.raises(ce.BundleError, match=expected):
        ce.load_bundle(broken(tmp_path, rel, edit))


def test_bad_baseline_and_cli_error_exit(tmp_path, capsys):
    bad = broken(tmp_path, "eval_meta_data.csv", lambda s: s.replace(",62,", ",sixty,"))
    with pytest.raises(ce.BundleError, match=r"eval_meta_data\.csv:4: random baseline 'sixty' of 'boolq'"):
        ce.task_baselines(ce.load_bundle(bad))
    gone = broken(tmp_path / "x", "eval_data/world_knowledge/arc_easy.jsonl", None)
    assert core_cli.main(["--checkpoint", "unused", "--bundle", str(gone)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "arc_easy.jsonl: missing" in err


# ----------------------------------------------------------------------------- prompts

def test_shuffle_and_fewshot_seeds():
    task = ce.load_bundle(BUNDLE).tasks[0]
    data = list(task.examples)
    random.Random(1337).shuffle(data)  # the note: the data list is shuffled with Random(1337)
    assert [task.examples[j] for j in ce.task_examples(task)] == data
    assert [task.examples[j] for j in ce.task_examples(task, 4)] == data[:4]
    for n, i, k in [(6, 0, 2), (6, 5, 2), (50, 17, 10), (10042, 9000, 10), (4, 2, 3)]:
        others = [j for j in range(n) if j != i]
        assert ce.fewshot_indices(i, n, k) == random.Random(1234 + i).sample(others, k)
    assert ce.fewshot_indices(0, 3, 10) == random.Random(1234).sample([1, 2], 2)  # capped at n - 1


def prompts_at(label, pos):
    task = next(t for t in ce.load_bundle(BUNDLE).tasks if t.label == label)
    data = [task.examples[j] for j in ce.task_examples(task)]
    shots = [data[j] for j in ce.fewshot_indices(pos, len(data), task.shots)]
    return ce.render_prompts(task.type, data[pos], task.delimiter, shots)


def test_prompts_equal_hand_written_strings():
    # Shuffled order of 6 items is file lines [2, 1, 4, 3, 6, 5]; item 0's two shots are items 4, 1.
    assert prompts_at("arc_easy", 0)[2] == (
        "Question: What covers most of the surface of the Earth?\nAnswer: water\n\n"
        "Question: Which object is a magnet most likely to pick up?\nAnswer: a paper clip\n\n"
        "Question: What do plants need to make their own food?\nAnswer: sunlight")
    assert prompts_at("commonsense_qa", 0)[4] == (
        "What does a café serve in the morning? coffee\n\nWhat do people use to write on paper? lamp")
    assert prompts_at("winograd", 0) == [
        "The city council refused the demonstrators a permit because the council feared violence.",
        "The city council refused the demonstrators a permit because the demonstrators feared violence."]
    assert prompts_at("winogrande", 0)[1] == (
        "Emma ran faster than Lucy since Emma trained every day.\n\n"
        "The bottle was emptier than the jar because the jar had been used more.")
    # LM: contexts are trimmed; the prompt without the continuation is stripped, the other is not.
    assert prompts_at("lambada_openai", 0) == [
        "He poured the coffee into his favorite blue", "He poured the coffee into his favorite blue mug"]
    head = ("HISTORY: He was the first president of the United States\nAnswer: George Washington\n\n"
            "GEOGRAPHY: This is the largest ocean on Earth\nAnswer: the Pacific\n\n"
            "SCIENCE: This gas makes up most of the air we breathe\nAnswer:")
    assert prompts_at("jeopardy", 0) == [head, head + " nitrogen"]


def spans(kind, prompts, tok, max_seq_len=4096):
    seqs = ce.example_sequences(kind, prompts, tok, max_seq_len)
    assert all(t[0] == tok.bos or len(t) == max_seq_len for t, _, _ in seqs)
    return [tok.decode(t[s:e]) for t, s, e in seqs], seqs


def test_scored_tokens_byte_tokenizer():
    assert spans("multiple_choice", prompts_at("arc_easy", 0), TOK)[0] == ["darkness", "salt", "sunlight", "sand"]
    # Only what differs after the common token prefix is scored.
    assert spans("multiple_choice", ["Q? a bird", "Q? a boat"], TOK)[0] == ["ird", "oat"]
    assert spans("schema", prompts_at("winograd", 0), TOK)[0] == [" feared violence."] * 2
    assert spans("language_modeling", prompts_at("jeopardy", 0), TOK)[0] == [" nitrogen"]
    full = spans("language_modeling", prompts_at("jeopardy", 0), TOK)[1][0]
    text, [(t, s, e)] = spans("language_modeling", prompts_at("jeopardy", 0), TOK, max_seq_len=20)
    assert text == [" nitrogen"] and t == full[0][-20:] and (s, e) == (11, 20)
    # Cropped into the continuation: scoring starts at position 1 (position 0 predicts nothing).
    assert spans("language_modeling", ["ab", "ab cdefgh"], TOK, max_seq_len=4)[1] == [(TOK.encode("efgh"), 1, 4)]


def test_scored_tokens_sentencepiece(tmp_path):
    """Token boundaries with the project's real tokenizer settings (BPE, byte fallback, identity)."""
    from megatron_kappa.tokenizer import Tokenizer, train_tokenizer
    texts = [json.dumps(ex) for _, items in raw_tasks().values() for ex in items] * 3
    tok = Tokenizer(train_tokenizer(texts, tmp_path / "sp.model", vocab_size=400))
    arc, jeopardy = prompts_at("arc_easy", 0), prompts_at("jeopardy", 0)
    assert [x.strip() for x in spans("multiple_choice", arc, tok)[0]] == ["darkness", "salt", "sunlight", "sand"]
    assert [x.strip() for x in spans("language_modeling", jeopardy, tok)[0]] == ["nitrogen"]
    assert [x.strip() for x in spans("language_modeling", prompts_at("lambada_openai", 0), tok)[0]] == ["mug"]
    assert spans("schema", prompts_at("winograd", 0), tok)[0][0].strip().endswith("feared violence.")
    # The newlines that join shots survive tokenization (a normalizer folding them would not).
    assert tok.decode(tok.encode(jeopardy[1])) == jeopardy[1]


# ----------------------------------------------------------------------------- scoring

def test_rigged_gold_scores_one_and_rigged_wrong_scores_zero():
    gold = ce.evaluate_core(Rigged(endings(0)), TOK, BUNDLE, 4096, batch_size=5, progress=False)
    assert set(accuracies(gold).values()) == {1.0} and gold["core"] == pytest.approx(1.0)
    # Negative control: preferring a wrong choice, and mispredicting every continuation token.
    wrong = ce.evaluate_core(Rigged(endings(1), miss=endings(0)), TOK, BUNDLE, 4096, batch_size=5, progress=False)
    assert set(accuracies(wrong).values()) == {0.0}


def test_uniform_model_scores_tie_broken_baseline():
    for cap in (None, 3):
        result = ce.evaluate_core(uniform, TOK, BUNDLE, 4096, max_per_task=cap, progress=False)
        expected = {}
        for label, (kind, items) in raw_tasks().items():
            random.Random(1337).shuffle(items)
            items = items[:cap] if cap else items
            # Equal losses: the first choice wins; LM greedy picks id 0, never a text token.
            expected[label] = 0.0 if kind == "language_modeling" else sum(ex["gold"] == 0 for ex in items) / len(items)
        assert accuracies(result) == expected
        assert {r["n"] for r in result["tasks"]} == ({3} if cap else {5, 6})


class FirstTokens:
    """A uniform model that records each row's first token and length (the BOS rule's witness)."""

    def __init__(self, bos):
        self.bos, self.rows = bos, []

    def __call__(self, tokens):
        self.rows += [row.tolist() for row in tokens]
        return torch.zeros(*tokens.shape, V)


@pytest.mark.parametrize("trained_with_bos", [True, False])
def test_bos_first_exactly_when_the_model_was_trained_with_it(trained_with_bos):
    """CORE puts BOS before every prompt iff the model's training documents started with BOS
    (logits_fn.bos, from the run's data.bos); without it no BOS appears anywhere but in padding."""
    model = FirstTokens(trained_with_bos)
    result = ce.evaluate_core(model, TOK, BUNDLE, 4096, batch_size=5, progress=False)
    assert result["bos"] is trained_with_bos and model.rows
    firsts = {row[0] for row in model.rows}
    assert (firsts == {TOK.bos}) if trained_with_bos else (TOK.bos not in firsts)
    if not trained_with_bos:  # BOS is the pad id, so only trailing padding may hold it
        for row in model.rows:
            body = row[:len(row) - next((i for i, t in enumerate(reversed(row)) if t != TOK.bos), 0)]
            assert TOK.bos not in body
    # Reference: the same prompts by hand, with and without the leading BOS, same scored text.
    prompts = prompts_at("arc_easy", 0)
    with_bos = ce.example_sequences("multiple_choice", prompts, TOK, 4096, bos=True)
    without = ce.example_sequences("multiple_choice", prompts, TOK, 4096, bos=False)
    for (t1, s1, e1), (t0, s0, e0), p in zip(with_bos, without, prompts):
        assert t1 == [TOK.bos] + TOK.encode(p) and t0 == TOK.encode(p)
        assert TOK.decode(t1[s1:e1]) == TOK.decode(t0[s0:e0])
    # An explicit argument overrides the model's attribute; a plain function defaults to BOS.
    assert ce.evaluate_core(model, TOK, BUNDLE, 4096, progress=False, bos=True)["bos"] is True
    assert ce.evaluate_core(uniform, TOK, BUNDLE, 4096, progress=False)["bos"] is True


def test_run_records_whether_its_shards_start_with_bos(tmp_path):
    """data.bos: explicit wins; else the data prep manifest beside the shards (an old manifest
    without "bos" means no BOS); mock data and manifest-less shards: false; mixed: refused."""
    from megatron_kappa.config import ConfigError, load_config
    from megatron_kappa.data.bos import documents_start_with_bos
    for name, bos in (("a", True), ("b", False), ("old", None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(json.dumps({} if bos is None else {"bos": bos}))
    (tmp_path / "bare").mkdir()

    def answer(*sets):
        return documents_start_with_bos(load_config(None, list(sets)).data)
    assert answer(f"data.paths=[{tmp_path}/a/train_00000]") is True
    assert answer(f"data.paths=[0.5,{tmp_path}/a/train_00000,0.5,{tmp_path}/a/train_00001]") is True
    assert answer(f"data.paths=[{tmp_path}/b/train_00000]") is False
    assert answer(f"data.paths=[{tmp_path}/old/train_00000]") is False
    assert answer(f"data.paths=[{tmp_path}/bare/train_00000]") is False
    assert answer("data.mock=true") is False
    assert answer(f"data.paths=[{tmp_path}/b/train_00000]", "data.bos=true") is True
    with pytest.raises(ConfigError, match="data.bos"):
        answer(f"data.paths=[{tmp_path}/a/train_00000]", f"data.valid_paths=[{tmp_path}/b/valid_00000]")


def test_centered_accuracy_and_core_by_hand():
    result = ce.evaluate_core(uniform, TOK, BUNDLE, 4096, progress=False)
    centered = {r["task"]: r["centered"] for r in result["tasks"]}
    by_hand = {"arc_easy": (2 / 6 - 0.25) / 0.75, "commonsense_qa": 0.0, "boolq": (0.5 - 0.62) / 0.38,
               "winograd": (0.4 - 0.5) / 0.5, "winogrande": (0.6 - 0.5) / 0.5, "lambada_openai": 0.0, "jeopardy": 0.0}
    assert centered == pytest.approx(by_hand)
    assert result["core"] == pytest.approx((1 / 9 - 0.12 / 0.38 - 0.2 + 0.2) / 7)
    assert result["core_no_boolq"] == pytest.approx((1 / 9 - 0.2 + 0.2) / 6)
    assert result["baselines"] == "v1" and len(result["missing"]) == 15 and "hellaswag" in result["missing"]
    v2 = ce.evaluate_core(uniform, TOK, BUNDLE, 4096, baselines="v2", progress=False)
    assert {r["task"]: r["centered"] for r in v2["tasks"]}["commonsense_qa"] == pytest.approx((0.2 - 0.403) / 0.597)
    assert v2["core"] == pytest.approx(result["core"] + ((0.2 - 0.403) / 0.597) / 7)
    assert ce.centered_accuracy(1.0, 9.1) == 1.0 and ce.centered_accuracy(0.091, 9.1) == pytest.approx(0.0)


def test_batched_forward_passes_decide_like_one_per_choice():
    model, task = TinyCausalLM(seed=1), ce.load_bundle(BUNDLE).tasks[0]
    single = ce.evaluate_task(model, TOK, task, 256, batch_size=1)
    for kwargs in ({"batch_size": 32}, {"batch_size": 7, "max_batch_tokens": 600}):
        assert ce.evaluate_task(model, TOK, task, 256, **kwargs)["correct"] == single["correct"]


def rank_worker(rank, world, port, out_dir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = TinyCausalLM(seed=0)
    result = ce.evaluate_core(model, TOK, BUNDLE, 256, batch_size=4, progress=False)
    arc = ce.evaluate_task(model, TOK, ce.load_bundle(BUNDLE).tasks[0], 256, batch_size=4)
    Path(out_dir, f"{rank}.json").write_text(json.dumps({"acc": accuracies(result), "arc": arc}))
    dist.destroy_process_group()


@pytest.mark.slow
def test_one_and_two_processes_agree(tmp_path):
    model = TinyCausalLM(seed=0)
    single = ce.evaluate_core(model, TOK, BUNDLE, 256, batch_size=4, progress=False)
    arc = ce.evaluate_task(model, TOK, ce.load_bundle(BUNDLE).tasks[0], 256, batch_size=4)
    assert 0 < sum(accuracies(single).values()) < len(single["tasks"])  # a model with opinions
    mp.spawn(rank_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["acc"] == accuracies(single) and r["arc"]["correct"] == arc["correct"]
    # The work really was split: each rank scored a part, together all of it.
    assert [r["arc"]["local"] for r in ranks] == [3, 3]
    assert sum(r["arc"]["local"] for r in ranks) == arc["n"] == arc["local"]


def test_cli_run_prints_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "out" / "core.json"
    args = core_cli.parse_args(["--checkpoint", "runs/x", "--bundle", str(BUNDLE), "--json", str(out),
                                "--no-progress", "--max-per-task", "4", "--baselines", "v2"])
    core_cli.run(args, Rigged(endings(0)), TOK, 4096)
    table = capsys.readouterr().out
    assert "winogrande" in table and "CORE (v2 baselines, 7 tasks): 1.0000" in table and "missing" in table
    saved = json.loads(out.read_text())
    assert saved["baselines"] == "v2" and saved["core"] == saved["core_no_boolq"] == pytest.approx(1.0)
    assert [set(r) for r in saved["tasks"]] == [{"task", "type", "shots", "n", "accuracy", "centered"}] * 7
    assert ([(r["task"], r["shots"], r["n"]) for r in saved["tasks"]][:2]
            == [("arc_easy", 2, 4), ("commonsense_qa", 1, 4)])


# ----------------------------------------------------------------------------- validation loss

DOCS = [TOK.encode(s) + [TOK.eod] for s in ["The cat sat on the mat.", "Bits per byte, café!", "x" * 40]]


class Bigram:
    """Fixed random next-token table: logits depend on the current token only, so the loss of a
    stream is a plain sum over its token pairs, whatever the windowing."""

    def __init__(self, seed=0):
        self.table = torch.randn(V, V, generator=torch.Generator().manual_seed(seed))

    def __call__(self, tokens):
        return self.table[tokens]


def reference(model, docs, shift=1):
    stream = [TOK.eod] + [t for d in docs for t in d]
    nats = bytes_ = text_nats = 0.0
    for p in range(1, len(stream)):
        nll = -torch.log_softmax(model.table[stream[p - shift]], -1)[stream[p]].item()
        nats += nll
        if stream[p] >= 4:
            text_nats, bytes_ = text_nats + nll, bytes_ + 1
    return nats / (len(stream) - 1), text_nats / math.log(2) / bytes_


def test_validation_loss_uniform_and_bigram_against_reference():
    u = validation_loss(uniform, DOCS, TOK, seq_len=16)
    n_tokens = sum(len(d) for d in DOCS)
    assert u["tokens"] == n_tokens and u["bytes"] == n_tokens - len(DOCS)
    assert u["loss"] == pytest.approx(math.log(V)) and u["bits_per_byte"] == pytest.approx(math.log2(V))
    model = Bigram()
    loss, bpb = reference(model, DOCS)
    for seq_len, batch in ((7, 3), (64, 1), (1000, 8)):
        r = validation_loss(model, DOCS, TOK, seq_len=seq_len, batch_size=batch)
        assert (r["loss"], r["bits_per_byte"]) == (pytest.approx(loss), pytest.approx(bpb))
    wrong_loss, _ = reference(model, DOCS, shift=0)  # negative control: scoring the current token
    assert abs(wrong_loss - loss) > 0.1
    capped = validation_loss(model, DOCS, TOK, seq_len=7, max_tokens=30)
    assert capped["tokens"] == 30 and capped["loss"] == pytest.approx(reference(model, [sum(DOCS, [])[:30]])[0])


def test_validation_loss_reads_megatron_shards(tmp_path, capsys):
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    prefixes = []
    for k, docs in enumerate((DOCS[:2], DOCS[2:])):
        prefix = str(tmp_path / f"val_{k}")
        builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
        for d in docs:
            builder.add_document(np.array(d), [len(d)])
        builder.finalize(prefix + ".idx")
        prefixes.append(prefix)
    model = Bigram()
    from_shards = validation_loss(model, prefixes, TOK, seq_len=9, batch_size=2)
    assert from_shards == pytest.approx(validation_loss(model, DOCS, TOK, seq_len=9, batch_size=2))
    from megatron_kappa.cli import eval_loss as loss_cli
    args = loss_cli.parse_args(["--checkpoint", "x", "--data", *prefixes, "--seq-len", "9", "--no-progress"])
    assert loss_cli.run(args, model, TOK, 64)["loss"] == pytest.approx(reference(model, DOCS)[0])
    assert "bits/byte" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match=r"nope\.idx: missing"):
        validation_loss(model, [str(tmp_path / "nope")], TOK, seq_len=9)
