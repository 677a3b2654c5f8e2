"""The export's model card (README.md): the Hub's YAML header (licence, library, tags), what the
model is (its config, κ-SwiGLU's description and formula when κ is on), how it was trained (the
step, the tokens seen, the data, the layout) and the evaluation results recorded for that step.

The results are only those measured at the exported step: metrics.jsonl's records of that step
(the training run's validation loss and CORE subset) and the --json files of eval/loss.py and
eval/core.py that name this run and step, in the run directory or the folder above it (where
`launch/demo.py` writes them). A result of another step is never shown as this one's.
"""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from megatron_kappa.attention_kinds import name_of as attention_kind
from megatron_kappa.config import EvalConfig
from megatron_kappa.export.adapter import ffn_sizes
from megatron_kappa.kappa import inputs as kappa_inputs
from megatron_kappa.model.layout import moe_layer_pattern

NO_TOKENIZER = "\nNo tokenizer was exported (the run named none): encode with the one it was trained with.\n"
# transformers 5's AutoTokenizer reads config.json first, and a class of our own makes that ask for remote code
TOKENIZER_ALONE = ("\nWithout `trust_remote_code`, `PreTrainedTokenizerFast.from_pretrained` loads the tokenizer "
                   "alone (it is transformers' own class; `AutoTokenizer` reads `config.json` first, which names "
                   "the modeling code, and asks).")


def step_records(run_dir: Path, step: int) -> dict:
    """metrics.jsonl's values at `step` (a resumed run's later record of a step wins); {} without it."""
    path, found = run_dir / "metrics.jsonl", {}
    if not path.is_file():
        return found
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # a torn last line
            continue
        if isinstance(record, dict) and record.get("step") == step:
            found.update(record)
    return found


def evaluations(run_dir: Path, step: int, ev: EvalConfig) -> list[tuple[str, str, str]]:
    """(what, value, where it is from) of every result measured at `step`."""
    rows, records = [], step_records(run_dir, step)
    if "valid_loss" in records:
        rows.append(("validation loss (during training)", f"{records['valid_loss']:.4f}",
                     f"metrics.jsonl: {ev.valid_iters} micro-batches of the validation data"))
    if "core" in records:
        rows.append(("CORE subset (during training)", f"{records['core']:.4f}",
                     f"metrics.jsonl: at most {ev.core_max_per_task} items per task"))
    for path in sorted([*run_dir.glob("*.json"), *run_dir.parent.glob("*.json")]):
        try:
            result = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not (isinstance(result, dict) and result.get("step") == step
                and Path(str(result.get("checkpoint", ""))).resolve() == run_dir.resolve()):
            continue
        if "bits_per_byte" in result:
            rows.append(("validation loss", f"{result['loss']:.4f}",
                         f"{path.name}: eval/loss.py, {result['tokens']:,} tokens"))
            rows.append(("bits per byte", f"{result['bits_per_byte']:.4f}", f"{path.name}: eval/loss.py"))
        if "core" in result:
            per = result.get("max_per_task")
            rows.append(("CORE", f"{result['core']:.4f}", f"{path.name}: eval/core.py"
                         + (f", at most {per} items per task" if per else ", every item")))
    return rows


def kappa_section(kappa) -> str:
    seen = kappa_inputs.lookup(kappa.input).card or \
        f"s is what the {kappa.input} input variant makes of the router logit"  # what s is: the variant's words
    learned = [n for n, on in (("α", kappa.use_alpha), ("b", kappa.use_bias)) if on]
    return f"""## κ-SwiGLU

The routed experts are κ-SwiGLU ("Confidence-Adaptive SwiGLU for Mixture-of-Experts", arXiv
2606.00761): the sharpness κ of each expert's SiLU gate is set per token and per gate unit from how
confidently the router sent the token to that expert. For a token x routed to expert e:

    κ_j = U ^ tanh(gain · (α_j · scale · s + b_j))    κ ∈ (1/U, U); κ = 1 when α = b = 0 (plain SwiGLU)
    h   = g ⊙ σ(κ ⊙ g) ⊙ u                              g = W_gate x, u = W_up x
    y   = p_e · W_down h                                p_e: the routing weight

where {seen}. This model: U = {kappa.U:g}, scale = {kappa.logit_scale:g}, gain = {kappa.tanh_gain:g};
α and b are per expert and gate unit ({" and ".join(learned) + " learned" if learned else "neither learned: κ = 1"}).
"""


def run_name(run, run_dir: Path) -> str:
    """The run's name (run.name; null: its folder's name), as its W&B run has it: the card's title."""
    return run.name or run_dir.name


def card(*, name: str, cfg, run_dir: Path, step: int, adapter, hf_config: dict, params: dict, license: str,
         layout_record: dict | None, kappa=None, tokenizer: bool) -> str:
    """README.md of an export: titled with the run's name; `name` (the output folder's) is what the
    usage example loads. `params`: {"total", "active"} counted from the written tensors;
    `layout_record`: the layout that trained the checkpoint (meta.json's); `kappa`: its KappaSettings."""
    m, moe = cfg.model, cfg.model.moe
    title = run_name(cfg.run, run_dir)
    records = step_records(run_dir, step)
    tokens = records.get("tokens_seen")
    tokens_text = f"{tokens:,} (metrics.jsonl at step {step})" if tokens else \
        f"about {step * cfg.train.global_batch * m.seq_length:,} (step × train.global_batch × model.seq_length)"
    dense = [i for i, is_moe in enumerate(moe_layer_pattern(m)) if not is_moe]
    tags = ["megatron-kappa", "mixture-of-experts"] + (["kappa-swiglu"] if kappa is not None else [])
    header = yaml.safe_dump({"license": license, "library_name": "transformers", "pipeline_tag": "text-generation",
                             "tags": tags}, sort_keys=False)
    remote = "" if adapter.native else ", trust_remote_code=True"
    attention = attention_kind(m)
    heads = (f"multi-head latent attention, {m.num_attention_heads} heads" if attention == "mla" else
             f"{m.num_attention_heads} heads of {m.head_dim or m.hidden_size // m.num_attention_heads}, "
             f"{m.num_query_groups or m.num_attention_heads} key/value heads")
    dense_width, expert_width = ffn_sizes(m)
    rows = [("class", f"`{adapter.architecture}` ({'transformers' if adapter.native else 'modeling_kappa_moe.py'})"),
            ("layers", f"{m.num_layers}" + (f" (dense: {', '.join(map(str, dense))})" if dense else "")),
            ("hidden size", f"{m.hidden_size}"), ("attention", heads),
            ("MLP widths", f"dense {dense_width}, expert {expert_width}"
             + (f", shared expert {moe.shared_ffn_hidden_size}" if moe.shared_ffn_hidden_size else "")),
            ("experts", f"{moe.num_experts} routed, top-{moe.topk}"),
            ("router", f"{moe.router}, route scale {moe.route_scale:g}"),
            ("vocabulary", f"{m.vocab_size}"), ("context", f"{m.seq_length} tokens (model.seq_length)"),
            ("parameters", f"{params['total']:,} ({params['active']:,} active per token)"),
            ("dtype", hf_config.get("dtype", "?"))]
    trained = [("step", f"{step} (train.steps: {cfg.train.steps or 'the token budget'})"), ("tokens", tokens_text),
               ("data", ", ".join(Path(str(p)).name for p in cfg.data.paths if not isinstance(p, (int, float)))
                or ("megatron-core's mock data" if cfg.data.mock else "?")),
               ("optimizer", f"{cfg.train.optimizer}, peak lr {cfg.train.lr:g}"), ("precision", cfg.precision)]
    if layout_record:
        trained.append(("layout", ", ".join(f"{k} {v}" for k, v in layout_record.items())))
    results = evaluations(run_dir, step, cfg.eval)
    def table(pairs):
        return "| | |\n|---|---|\n" + "\n".join(f"| {a} | {b} |" for a, b in pairs)
    evaluation = ("| result | value | from |\n|---|---|---|\n"
                  + "\n".join(f"| {a} | {b} | {c} |" for a, b, c in results)
                  if results else
                  f"No evaluation was recorded at step {step}. `python eval/loss.py --checkpoint RUN --step {step} "
                  f"--data ... --json loss.json` and `python eval/core.py --checkpoint RUN --step {step} --bundle ... "
                  "--json core.json` write results that the next export of this step puts here.")
    model_yaml = yaml.safe_dump({"model": json.loads(json.dumps(_plain(m)))}, sort_keys=False)
    licence_text = ("The licence was not chosen at export (`--license`): `other`. " if license == "other" else
                    f"`{license}`, chosen at export. ") + "The terms of the training data apply as well."
    return f"""---
{header}---

# {title}

A Mixture-of-Experts language model trained with megatron_kappa (megatron-core and DeepSpeed): step
{step} of the run `{title}`, exported as `{adapter.architecture}`. A small research model: no
instruction tuning, no safety tuning.

## Use

```python
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained("{name}"{remote})
tokenizer = AutoTokenizer.from_pretrained("{name}"{remote})
ids = tokenizer("The water cycle", return_tensors="pt").input_ids
print(tokenizer.decode(model.generate(ids, max_new_tokens=30)[0]))
```
{"" if tokenizer else NO_TOKENIZER}
The tokenizer pads on the left (batched generation) and its `model_max_length` is the context the
model was trained with, {m.seq_length} tokens.{TOKENIZER_ALONE if tokenizer and not adapter.native else ""}

## Model

{table(rows)}

<details><summary>The training config's model section</summary>

```yaml
{model_yaml}```
</details>

{kappa_section(kappa) if kappa is not None else ""}
## Training

{table(trained)}

## Evaluation

{evaluation}

## Licence

{licence_text}

## Notes

- Every token runs through its top-{moe.topk} experts: a capacity factor used in training drops
  tokens there, not here.
- Multi-token-prediction modules (model.mtp), if the run had them, are not exported.
"""


def _plain(obj):
    """A config dataclass as plain data (its YAML)."""
    from dataclasses import asdict, is_dataclass
    return asdict(obj) if is_dataclass(obj) else obj
