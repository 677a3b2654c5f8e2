"""CORE evaluation bundles (DCLM's / nanochat's format): reading, validating, baselines.

load_bundle reads a bundle from a folder, a .zip or a URL (downloaded once) and checks every file;
a malformed one is a one-line BundleError naming the file and line. The scoring is in
megatron_kappa.evaluation.core; the format is described in docs/core_eval.md.
"""
from __future__ import annotations

import csv
import io
import json
import shutil
import urllib.parse
import urllib.request
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import yaml

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
            if prefixes[0] + rel not in names:
                return None
            try:
                return zf.read(prefixes[0] + rel).decode("utf-8")
            except (zipfile.BadZipFile, zlib.error, EOFError) as e:  # a damaged member (its CRC, its data)
                raise BundleError(f"{path}!{prefixes[0]}{rel}: damaged inside the zip "
                                  f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
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
            raise BundleError(f"{at('num_fewshot')}: expected num_fewshot: [k] with k >= 0, got "
                              f"{item.get('num_fewshot')!r}")
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
                raise BundleError(f"{bundle.meta_file}:{line}: random baseline {raw!r} of {task.label!r} is not a "
                                  f"number") from None
        elif task.label in V1_BASELINES:
            out[task.label] = V1_BASELINES[task.label]
        else:
            raise BundleError(f"{bundle.meta_file}: no random baseline for task {task.label!r} (expected a row for it)")
        out[task.label] = BASELINE_TABLES[table].get(task.label, out[task.label])
    return out
