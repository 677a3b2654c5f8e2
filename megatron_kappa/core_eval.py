"""CORE: DCLM's in-context-learning tasks scored the way nanochat scores them (docs/core_eval.md).

load_bundle reads a DCLM/nanochat bundle (folder, .zip or URL); evaluate_core scores every task of it
with a plain causal LM callable `logits_fn(tokens[B, T]) -> logits[B, T, V]` and returns the result
in the JSON shape eval/core.py writes. The model side never appears here, so the training loop, the
CLI, the tests and the benchmark all share this one scorer.
"""
from __future__ import annotations

import csv
import io
import json
import os
import random
import shutil
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from tqdm import tqdm

TASK_TYPES = ("multiple_choice", "schema", "language_modeling")

# Random baselines (percent) of the 22 CORE tasks as in the eval_meta_data.csv of nanochat's
# eval_bundle.zip (DCLM "v1"). Used only for tasks the bundle's own csv does not list.
V1_BASELINES = {
    "hellaswag_zeroshot": 25.0, "jeopardy": 0.0, "bigbench_qa_wikidata": 0.0, "arc_easy": 25.0,
    "arc_challenge": 25.0, "copa": 50.0, "commonsense_qa": 20.0, "piqa": 50.0, "openbook_qa": 25.0,
    "lambada_openai": 0.0, "hellaswag": 25.0, "winograd": 50.0, "winogrande": 50.0,
    "bigbench_dyck_languages": 0.0, "agi_eval_lsat_ar": 20.0, "bigbench_cs_algorithms": 0.0,
    "bigbench_operators": 0.0, "bigbench_repeat_copy_logic": 0.0, "squad": 0.0, "coqa": 0.0,
    "boolq": 62.0, "bigbench_language_identification": 9.1,
}
CORE_TASKS = tuple(V1_BASELINES)
# The three baselines DCLM changed in September 2025 ("Core_v2"). The chosen table is forced over
# whatever the bundle's csv says, so a result is v1 or v2 no matter which bundle produced it.
BASELINE_TABLES = {
    "v1": {"commonsense_qa": 20.0, "agi_eval_lsat_ar": 20.0, "bigbench_language_identification": 9.1},
    "v2": {"commonsense_qa": 40.3, "agi_eval_lsat_ar": 25.0, "bigbench_language_identification": 25.0},
}
NANOCHAT_BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
SHUFFLE_SEED, FEWSHOT_SEED = 1337, 1234


class BundleError(Exception):
    """A malformed bundle; the message names the file (and line) and what was expected there."""


@dataclass
class Task:
    label: str
    type: str          # one of TASK_TYPES
    shots: int
    delimiter: str
    file: str          # display path of the examples, for messages
    examples: list     # parsed JSON objects in file order
    lines: list        # 1-based line of each example


@dataclass
class Bundle:
    source: str
    tasks: list
    baselines: dict    # label -> (raw csv value, line) from eval_meta_data.csv; {} when absent
    meta_file: str


# ----------------------------------------------------------------------------- bundle reading

def fetch_bundle(url: str, cache_dir=None) -> Path:
    """Download a bundle .zip once into cache_dir (default ~/.cache/megatron_kappa) and return it."""
    cache = Path(cache_dir) if cache_dir else Path.home() / ".cache" / "megatron_kappa"
    dest = cache / (Path(urllib.parse.urlparse(url).path).name or "eval_bundle.zip")
    if not dest.exists():
        cache.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(dest.name + ".part")  # rename at the end: no half file is ever reused
        with urllib.request.urlopen(url) as response, open(part, "wb") as out:
            shutil.copyfileobj(response, out)
        part.replace(dest)
    return dest


def _reader(path: Path):
    """(read(rel) -> str | None, name(rel) -> display path) for a bundle folder or .zip."""
    if path.is_dir():
        roots = [path] if (path / "core.yaml").is_file() else sorted(p.parent for p in path.glob("*/core.yaml"))
        if len(roots) != 1:
            raise BundleError(f"{path}: no core.yaml (expected it in the folder or in exactly one sub-folder)")
        root = roots[0]

        def read(rel):
            f = root / rel
            return f.read_bytes().decode("utf-8") if f.is_file() else None
        return read, lambda rel: str(root / rel)
    if path.is_file() and zipfile.is_zipfile(path):
        zf = zipfile.ZipFile(path)
        names = set(zf.namelist())
        prefixes = sorted((n[:-len("core.yaml")] for n in names if n.rsplit("/", 1)[-1] == "core.yaml"), key=len)
        if not prefixes:
            raise BundleError(f"{path}: no core.yaml inside the zip")

        def read(rel):
            return zf.read(prefixes[0] + rel).decode("utf-8") if prefixes[0] + rel in names else None
        return read, lambda rel: f"{path}!{prefixes[0]}{rel}"
    raise BundleError(f"{path}: not a bundle folder or .zip file")


def load_bundle(path, cache_dir=None) -> Bundle:
    """Read and validate a bundle from a folder, a .zip or a URL (downloaded to cache_dir)."""
    if isinstance(path, Bundle):
        return path
    if "://" in str(path):
        path = fetch_bundle(str(path), cache_dir)
    path = Path(path)
    if not path.exists():
        raise BundleError(f"{path}: no such file or folder (expected a bundle folder, .zip or URL)")
    read, name = _reader(path)
    try:
        specs = _parse_core_yaml(read("core.yaml"), name("core.yaml"))
        meta_text = read("eval_meta_data.csv")
        baselines = _parse_meta(meta_text, name("eval_meta_data.csv")) if meta_text is not None else {}
        parsed, tasks = {}, []
        for spec, line in specs:
            rel = "eval_data/" + spec["dataset_uri"]
            key = (rel, spec["icl_task_type"])
            if key not in parsed:  # hellaswag and hellaswag_zeroshot share one file
                text = read(rel)
                if text is None:
                    raise BundleError(f"{name(rel)}: missing (named by {name('core.yaml')}:{line}, "
                                      f"task {spec['label']!r})")
                parsed[key] = _parse_jsonl(text, name(rel), spec["icl_task_type"])
            examples, lines = parsed[key]
            tasks.append(Task(spec["label"], spec["icl_task_type"], spec["shots"], spec["delimiter"],
                              name(rel), examples, lines))
    except UnicodeDecodeError as e:
        raise BundleError(f"{path}: a file is not UTF-8 ({e})") from None
    return Bundle(str(path), tasks, baselines, name("eval_meta_data.csv"))


def _parse_core_yaml(text, where):
    if text is None:
        raise BundleError(f"{where}: missing (every bundle needs core.yaml)")
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)  # nodes carry line numbers
        config = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise BundleError(f"{where}: not valid YAML: {' '.join(str(e).split())}") from None
    items = config.get("icl_tasks") if isinstance(config, dict) else None
    if not isinstance(items, list):
        raise BundleError(f"{where}: expected a top-level 'icl_tasks:' list")
    nodes = next(v for k, v in root.value if k.value == "icl_tasks").value
    specs, seen = [], set()
    for item, node in zip(items, nodes):
        # Point at the offending key's line when there is one, else at the entry's first line.
        keys = {k.value: k.start_mark.line + 1 for k, _ in node.value} if isinstance(item, dict) else {}

        def line(key=None):
            return keys.get(key, node.start_mark.line + 1)

        def at(key=None):
            return f"{where}:{line(key)}"
        if not isinstance(item, dict):
            raise BundleError(f"{at()}: expected a mapping with label, dataset_uri, num_fewshot, icl_task_type")
        for key in ("label", "dataset_uri", "icl_task_type"):
            if not isinstance(item.get(key), str):
                raise BundleError(f"{at(key)}: expected a string {key!r}")
        if item["icl_task_type"] not in TASK_TYPES:
            raise BundleError(f"{at('icl_task_type')}: unknown icl_task_type {item['icl_task_type']!r} "
                              f"(expected one of {', '.join(TASK_TYPES)})")
        shots = item.get("num_fewshot")
        shots = shots[0] if isinstance(shots, list) and shots else shots  # nanochat reads num_fewshot[0]
        if not isinstance(shots, int) or isinstance(shots, bool) or shots < 0:
            raise BundleError(f"{at('num_fewshot')}: expected num_fewshot: [k] with k >= 0, got {item.get('num_fewshot')!r}")
        delimiter = item.get("continuation_delimiter", " ")
        if not isinstance(delimiter, str):
            raise BundleError(f"{at('continuation_delimiter')}: expected a string continuation_delimiter")
        if item["label"] in seen:
            raise BundleError(f"{at('label')}: task {item['label']!r} listed twice")
        seen.add(item["label"])
        specs.append((dict(item, shots=shots, delimiter=delimiter), line("label")))
    return specs


def _parse_meta(text, where):
    reader = csv.DictReader(io.StringIO(text))
    if not {"Eval Task", "Random baseline"} <= set(reader.fieldnames or []):
        raise BundleError(f"{where}:1: expected the columns 'Eval Task' and 'Random baseline'")
    # Values are converted only for the tasks evaluated (task_baselines), so an odd row for a task
    # outside core.yaml cannot stop an evaluation.
    return {row["Eval Task"].strip(): (row["Random baseline"], reader.line_num) for row in reader}


def _parse_jsonl(text, where, task_type):
    examples, lines = [], []
    for n, raw in enumerate(text.split("\n"), 1):  # split on \n only: JSON strings may hold U+2028
        if not raw.strip():
            continue
        try:
            ex = json.loads(raw)
        except json.JSONDecodeError as e:
            raise BundleError(f"{where}:{n}: bad JSON line ({e.msg} at column {e.colno})") from None
        problem = _check_example(ex, task_type)
        if problem:
            raise BundleError(f"{where}:{n}: {problem}")
        examples.append(ex)
        lines.append(n)
    if not examples:
        raise BundleError(f"{where}: no examples")
    return examples, lines


def _check_example(ex, task_type):
    if not isinstance(ex, dict):
        return f"expected a JSON object ({task_type})"
    if task_type == "language_modeling":
        if not isinstance(ex.get("context"), str):
            return "expected a string 'context' (language_modeling)"
        if not isinstance(ex.get("continuation"), str) or not ex["continuation"].strip():
            return "expected a non-empty string 'continuation' (language_modeling)"
        return None
    text_key, list_key = ("query", "choices") if task_type == "multiple_choice" else ("continuation", "context_options")
    if not isinstance(ex.get(text_key), str):
        return f"expected a string {text_key!r} ({task_type})"
    options = ex.get(list_key)
    if not (isinstance(options, list) and options and all(isinstance(o, str) for o in options)):
        return f"expected {list_key!r} to be a non-empty list of strings ({task_type})"
    gold = ex.get("gold")
    if not isinstance(gold, int) or isinstance(gold, bool):
        return f"expected an integer 'gold' ({task_type})"
    if not 0 <= gold < len(options):
        return f"gold {gold} out of range for {len(options)} {list_key} (expected 0..{len(options) - 1})"
    return None


# ----------------------------------------------------------------------------- baselines, CORE

def task_baselines(bundle: Bundle, table: str = "v1") -> dict:
    """Random baseline (percent) of every task in the bundle: its csv row, else the built-in v1
    value, then the chosen table's three overrides."""
    if table not in BASELINE_TABLES:
        raise ValueError(f"baselines must be one of {sorted(BASELINE_TABLES)}, got {table!r}")
    out = {}
    for task in bundle.tasks:
        if task.label in bundle.baselines:
            raw, line = bundle.baselines[task.label]
            try:
                out[task.label] = float(raw)
            except (TypeError, ValueError):
                raise BundleError(f"{bundle.meta_file}:{line}: random baseline {raw!r} of {task.label!r} is not a number") from None
        elif task.label in V1_BASELINES:
            out[task.label] = V1_BASELINES[task.label]
        else:
            raise BundleError(f"{bundle.meta_file}: no random baseline for task {task.label!r} (expected a row for it)")
        out[task.label] = BASELINE_TABLES[table].get(task.label, out[task.label])
    return out


def centered_accuracy(accuracy: float, baseline_percent: float) -> float:
    """DCLM's centering: 0 at the random baseline, 1 at perfect accuracy."""
    b = 0.01 * baseline_percent
    return (accuracy - b) / (1.0 - b)


def summarize(rows: list, baselines: str) -> dict:
    """The result dict: per-task rows plus CORE (mean centered) and CORE without BoolQ."""
    def mean(values):
        return sum(values) / len(values) if values else None
    labels = [r["task"] for r in rows]
    return {
        "tasks": rows,
        "core": mean([r["centered"] for r in rows]),
        "core_no_boolq": mean([r["centered"] for r in rows if r["task"] != "boolq"]),
        "baselines": baselines,
        "missing": [t for t in CORE_TASKS if t not in labels],
    }


def format_table(result: dict) -> str:
    lines = [f"{'task':<34} {'type':<17} {'shots':>5} {'n':>6} {'accuracy':>9} {'centered':>9}"]
    for r in result["tasks"]:
        lines.append(f"{r['task']:<34} {r['type']:<17} {r['shots']:>5} {r['n']:>6} "
                     f"{r['accuracy']:>9.4f} {r['centered']:>9.4f}")
    fmt = lambda v: "n/a" if v is None else f"{v:.4f}"  # noqa: E731
    lines.append(f"CORE ({result['baselines']} baselines, {len(result['tasks'])} tasks): {fmt(result['core'])}"
                 f"   CORE without BoolQ: {fmt(result['core_no_boolq'])}")
    if result["missing"]:
        lines.append(f"missing from the bundle ({len(result['missing'])}): {', '.join(result['missing'])}")
    return "\n".join(lines)


def core_metrics(result: dict, prefix: str = "core") -> dict:
    """Flat numbers for metrics.jsonl: core, core_no_boolq and centered accuracy per task."""
    out = {prefix: result["core"], f"{prefix}_no_boolq": result["core_no_boolq"]}
    out.update({f"{prefix}/{r['task']}": r["centered"] for r in result["tasks"]})
    return out


# ----------------------------------------------------------------------------- prompts

def task_examples(task: Task, max_per_task=None) -> list:
    """Indices into task.examples in evaluation order: shuffled by Random(1337), then truncated."""
    order = list(range(len(task.examples)))
    random.Random(SHUFFLE_SEED).shuffle(order)  # same permutation nanochat applies to the data list
    return order[:max_per_task] if max_per_task and max_per_task > 0 else order


def fewshot_indices(i: int, n: int, shots: int) -> list:
    """Positions of item i's few-shot examples among n items: nanochat's
    Random(1234 + i).sample(other items, shots), capped at n - 1 (nanochat would raise there)."""
    shots = min(shots, n - 1)
    if shots <= 0:
        return []
    # Sampling positions from range(n - 1) draws the same numbers as sampling the list of the other
    # items; mapping positions >= i up by one gives the item, without building that list per item.
    return [p + (p >= i) for p in random.Random(FEWSHOT_SEED + i).sample(range(n - 1), shots)]


def render_prompts(task_type: str, item: dict, delimiter: str, fewshot: list) -> list:
    """Prompt strings of one item (nanochat's templates): one per choice for multiple_choice, one per
    context option for schema, [without, with] continuation for language_modeling."""
    if task_type == "multiple_choice":
        shots = "".join(f"{ex['query']}{delimiter}{ex['choices'][ex['gold']]}\n\n" for ex in fewshot)
        return [f"{shots}{item['query']}{delimiter}{choice}" for choice in item["choices"]]
    if task_type == "schema":
        shots = "".join(f"{ex['context_options'][ex['gold']]}{delimiter}{ex['continuation']}\n\n" for ex in fewshot)
        return [f"{shots}{option}{delimiter}{item['continuation']}" for option in item["context_options"]]
    shots = "".join(f"{ex['context'].strip()}{delimiter}{ex['continuation']}\n\n" for ex in fewshot)
    head = f"{shots}{item['context'].strip()}{delimiter}"
    # The prompt without the continuation is stripped (a trailing space would merge into the next
    # token of the prompt with it); the prompt with it is not.
    return [head.strip(), head + item["continuation"]]


def _common_len(seqs) -> int:
    """Length of the common prefix of token sequences (nanochat's find_common_length)."""
    return len(os.path.commonprefix(seqs))  # works on any lists: compares the min and max one


def example_sequences(task_type: str, prompts: list, tokenizer, max_seq_len: int) -> list:
    """[(tokens, start, end)] to score: BOS + prompt tokens, tokens[start:end] the scored span."""
    toks = [[tokenizer.bos] + list(tokenizer.encode(p)) for p in prompts]
    if task_type == "multiple_choice":  # choices share the prefix; score what differs
        start = _common_len(toks)
        spans = [(start, len(t)) for t in toks]
    elif task_type == "schema":  # contexts differ, the continuation (common suffix) is scored
        k = _common_len([t[::-1] for t in toks])
        spans = [(len(t) - k, len(t)) for t in toks]
    else:  # the continuation starts where the prompt without it stops matching
        without, toks = toks[0], toks[1:]
        spans = [(_common_len([without, toks[0]]), len(toks[0]))]
    out = []
    for t, (start, end) in zip(toks, spans):
        crop = max(0, len(t) - max_seq_len)  # keep the last max_seq_len tokens
        out.append((t[crop:], max(start - crop, 1), end - crop))
    return out


# ----------------------------------------------------------------------------- scoring

@torch.no_grad()
def score_sequences(logits_fn, seqs: list, pad_id: int, device=None):
    """One padded forward pass: per sequence, the mean loss over tokens[start:end] and whether greedy
    argmax reproduces all of them. Right padding is invisible to a causal model's scored positions."""
    ids = torch.full((len(seqs), max(len(t) for t, _, _ in seqs)), pad_id, dtype=torch.long)
    for i, (t, _, _) in enumerate(seqs):
        ids[i, :len(t)] = torch.tensor(t, dtype=torch.long)
    logits = logits_fn(ids if device is None else ids.to(device))
    dev = logits.device
    rows = torch.cat([torch.full((e - s,), i, dtype=torch.long) for i, (_, s, e) in enumerate(seqs)]).to(dev)
    cols = torch.cat([torch.arange(s - 1, e - 1) for _, s, e in seqs]).to(dev)  # position t predicts t + 1
    picked = logits[rows, cols]
    if picked.dtype in (torch.float16, torch.bfloat16):
        picked = picked.float()
    targets = ids.to(dev)[rows, cols + 1]
    counts = [e - s for _, s, e in seqs]
    # Per-token losses as nanochat computes them, averaged in float64: exact when they are equal,
    # so equal candidates tie and the first wins (a float32 mean of k equal values often is not).
    nll = F.cross_entropy(picked, targets, reduction="none").double()
    means = torch.stack([c.mean() for c in nll.split(counts)]).tolist()  # empty span -> nan, as nanochat
    greedy = torch.stack([h.all() for h in (picked.argmax(-1) == targets).split(counts)]).tolist()
    return means, greedy


def is_correct(task_type: str, means, greedy, gold) -> bool:
    if task_type == "language_modeling":
        return bool(greedy[0])
    return list(means).index(min(means)) == gold  # lowest mean loss; ties go to the first choice


def _plan(keys: list, sizes: list, batch_size: int) -> list:
    """Groups of example positions, longest first, each up to batch_size sequences. Depends only on
    the data, never on the number of ranks, so every batch (and its numerics) is the same for any
    world size; ranks then take whole groups."""
    groups, cur, size = [], [], 0
    for i in sorted(range(len(keys)), key=lambda i: (-keys[i], i)):
        if cur and size + sizes[i] > batch_size:
            groups.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += sizes[i]
    return groups + [cur] if cur else groups


def _split(items: list, batch_size: int, max_batch_tokens: int) -> list:
    """Cut (pos, choice, (tokens, start, end)) items into batches of <= batch_size sequences and
    <= max_batch_tokens padded tokens (at least one sequence each)."""
    batches, cur, width = [], [], 0
    for item in sorted(items, key=lambda it: (-len(it[2][0]), it[0], it[1])):
        length = len(item[2][0])
        if cur and (len(cur) >= batch_size or (len(cur) + 1) * max(width, length) > max_batch_tokens):
            batches.append(cur)
            cur, width = [], 0
        cur.append(item)
        width = max(width, length)
    return batches + [cur] if cur else batches


def _gather(obj) -> list:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _layout(dp_rank, dp_world):
    if dp_rank is not None:
        if dp_world > 1 and not (dist.is_available() and dist.is_initialized()):
            raise ValueError("dp_world > 1 needs torch.distributed to be initialized")
        return dp_rank, dp_world
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def evaluate_task(logits_fn, tokenizer, task: Task, max_seq_len: int, max_per_task=None, batch_size=32,
                  max_batch_tokens=16384, dp_rank=None, dp_world=None, device=None, progress=False) -> dict:
    """Score one task. Returns {"accuracy", "n", "correct" (per evaluated item, in order),
    "local" (items scored by this rank)}; every rank gets the gathered result."""
    dp_rank, dp_world = _layout(dp_rank, dp_world)
    data = [task.examples[j] for j in task_examples(task, max_per_task)]
    n = len(data)

    def prompts(i):
        return render_prompts(task.type, data[i], task.delimiter, [data[j] for j in fewshot_indices(i, n, task.shots)])
    # Sort key: characters of the longest prompt, a tokenizer-free proxy for its token length.
    keys = [max(len(p) for p in prompts(i)) for i in range(n)]
    options = {"multiple_choice": "choices", "schema": "context_options"}.get(task.type)
    sizes = [len(ex[options]) if options else 1 for ex in data]  # sequences per item
    mine = _plan(keys, sizes, batch_size)[dp_rank::dp_world]
    batches = []
    for group in mine:
        items = [(i, c, seq) for i in group
                 for c, seq in enumerate(example_sequences(task.type, prompts(i), tokenizer, max_seq_len))]
        batches += _split(items, batch_size, max_batch_tokens)
    # Expert parallelism exchanges tokens inside every forward pass, so all ranks must run the same
    # number of passes; ranks with fewer batches run small throwaway ones.
    n_passes = max(_gather(len(batches)))
    scores = {}
    show = progress and (not dist.is_initialized() or dist.get_rank() == 0)
    for batch in tqdm(batches, desc=task.label, disable=not show, leave=False):
        means, greedy = score_sequences(logits_fn, [seq for _, _, seq in batch], tokenizer.bos, device)
        for (i, c, _), m, g in zip(batch, means, greedy):
            scores.setdefault(i, {})[c] = (m, g)
    for _ in range(n_passes - len(batches)):
        logits_fn(torch.full((1, min(8, max_seq_len)), tokenizer.bos, dtype=torch.long,
                             device=device if device is not None else "cpu"))
    local = {i: is_correct(task.type, *zip(*(per[c] for c in sorted(per))), data[i].get("gold"))
             for i, per in scores.items()}
    merged = {}
    for part in _gather(local):  # tensor-parallel peers send identical copies; merging by item dedups
        merged.update(part)
    correct = [merged[i] for i in range(n)]
    return {"accuracy": sum(correct) / n, "n": n, "correct": correct, "local": len(local)}


def evaluate_core(logits_fn, tokenizer, bundle, max_seq_len: int, max_per_task=None, baselines="v1",
                  batch_size=32, max_batch_tokens=16384, progress=True, dp_rank=None, dp_world=None,
                  device=None) -> dict:
    """Evaluate every task of a bundle (a Bundle or anything load_bundle takes).

    Items are split over data-parallel ranks: by default every process of the default group is its
    own rank; with tensor/expert parallelism pass this process's data-parallel dp_rank/dp_world so
    that model-parallel peers score the same batches. Results are gathered over the default group.
    """
    bundle = load_bundle(bundle)
    table = task_baselines(bundle, baselines)  # fail on a bad baseline before any forward pass
    rows = []
    for task in bundle.tasks:
        r = evaluate_task(logits_fn, tokenizer, task, max_seq_len, max_per_task, batch_size,
                          max_batch_tokens, dp_rank, dp_world, device, progress)
        rows.append({"task": task.label, "type": task.type, "shots": task.shots, "n": r["n"],
                     "accuracy": r["accuracy"], "centered": centered_accuracy(r["accuracy"], table[task.label])})
    return summarize(rows, baselines)
