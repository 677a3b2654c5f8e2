"""CORE: DCLM's in-context-learning tasks scored the way nanochat scores them (docs/core_eval.md).

evaluate_core scores every task of a bundle (megatron_kappa.evaluation.bundle) with a plain causal
LM callable `logits_fn(tokens[B, T]) -> logits[B, T, V]` and returns the result in the JSON shape
eval/core.py writes. The model side never appears here, so the training loop, the CLI, the tests
and the benchmark all share this one scorer. Token batches are built on the host and sent to the
logits function's device (`logits_fn.device`, set by megatron_kappa.evaluation.loading).
"""
from __future__ import annotations

import os
import random

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from megatron_kappa.evaluation.bundle import (  # noqa: F401  (the bundle API, re-exported)
    BASELINE_TABLES,
    CORE_TASKS,
    NANOCHAT_BUNDLE_URL,
    TASK_TYPES,
    V1_BASELINES,
    Bundle,
    BundleError,
    Task,
    fetch_bundle,
    load_bundle,
    task_baselines,
)

SHUFFLE_SEED, FEWSHOT_SEED = 1337, 1234


def device_of(logits_fn, device=None) -> torch.device:
    """Where token batches go: the explicit `device`, else the logits function's own."""
    return torch.device(device if device is not None else getattr(logits_fn, "device", "cpu"))


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
    def fmt(v):
        return "n/a" if v is None else f"{v:.4f}"
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


def example_sequences(task_type: str, prompts: list, tokenizer, max_seq_len: int, bos: bool = True) -> list:
    """[(tokens, start, end)] to score: BOS + prompt tokens (no BOS when `bos` is false: a model
    trained on documents without BOS), tokens[start:end] the scored span."""
    toks = [[tokenizer.bos] * bos + list(tokenizer.encode(p)) for p in prompts]
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
    logits = logits_fn(ids.to(device_of(logits_fn, device)))
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
                  max_batch_tokens=16384, dp_rank=None, dp_world=None, device=None, progress=False,
                  bos=None) -> dict:
    """Score one task. Returns {"accuracy", "n", "correct" (per evaluated item, in order),
    "local" (items scored by this rank)}; every rank gets the gathered result. `bos`: put BOS
    first (None: `logits_fn.bos`, the model's training data, else true as in nanochat)."""
    dp_rank, dp_world = _layout(dp_rank, dp_world)
    bos = getattr(logits_fn, "bos", True) if bos is None else bos
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
                 for c, seq in enumerate(example_sequences(task.type, prompts(i), tokenizer, max_seq_len, bos))]
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
                             device=device_of(logits_fn, device)))
    local = {i: is_correct(task.type, *zip(*(per[c] for c in sorted(per))), data[i].get("gold"))
             for i, per in scores.items()}
    merged = {}
    for part in _gather(local):  # tensor-parallel peers send identical copies; merging by item dedups
        merged.update(part)
    correct = [merged[i] for i in range(n)]
    return {"accuracy": sum(correct) / n, "n": n, "correct": correct, "local": len(local)}


def evaluate_core(logits_fn, tokenizer, bundle, max_seq_len: int, max_per_task=None, baselines="v1",
                  batch_size=32, max_batch_tokens=16384, progress=True, dp_rank=None, dp_world=None,
                  device=None, bos=None) -> dict:
    """Evaluate every task of a bundle (a Bundle or anything load_bundle takes).

    Items are split over data-parallel ranks: by default every process of the default group is its
    own rank; with tensor/expert parallelism pass this process's data-parallel dp_rank/dp_world so
    that model-parallel peers score the same batches. Results are gathered over the default group.
    """
    bundle = load_bundle(bundle)
    table = task_baselines(bundle, baselines)  # fail on a bad baseline before any forward pass
    bos = bool(getattr(logits_fn, "bos", True) if bos is None else bos)
    rows = []
    for task in bundle.tasks:
        r = evaluate_task(logits_fn, tokenizer, task, max_seq_len, max_per_task, batch_size,
                          max_batch_tokens, dp_rank, dp_world, device, progress, bos)
        rows.append({"task": task.label, "type": task.type, "shots": task.shots, "n": r["n"],
                     "accuracy": r["accuracy"], "centered": centered_accuracy(r["accuracy"], table[task.label])})
    return {**summarize(rows, baselines), "bos": bos}
