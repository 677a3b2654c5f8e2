"""The layouts and memory settings the published frontier runs trained with, each with its source,
as data: one YAML file per run in configs/frontier/published/ (its README says what each field
means and where each group of runs comes from). `python -m plan --published` plans each one (does
it fit?) and ranks it among the layouts `--search` finds at its world size; docs/plan.md's tables
are its `--markdown` output.

A run's file is read strictly: an unknown or missing key, or a value of the wrong kind, is a
one-line ConfigError naming the file and the field. What a row cannot express is said in its
`note`, and anything the source does not give (micro-batch sizes) is an assumption named there.
Where a source says the run used virtual stages but not how many (Kimi K2), the row leaves the
number open (`open_vpp`) and the planner takes the fastest that fits, as `--search` picks a
layout's micro-batch.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from megatron_kappa import attention_kinds
from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.plan.estimate import Plan, plan
from megatron_kappa.plan.layout import Layout, model_shape
from megatron_kappa.plan.planned import Planned
from megatron_kappa.plan.search import divisors, rank_of, search
from megatron_kappa.plan.speed import Rates

ROOT = Path(__file__).resolve().parents[2]
FOLDER = ROOT / "configs" / "frontier" / "published"
# each group's runs in file-name order; the folder's README.md describes the groups
GROUPS = ("report", "tuned", "measured", "long_context", "long_context_dropless")


@dataclasses.dataclass(frozen=True)
class Published:
    name: str
    config: str
    layout: Layout
    sets: tuple[str, ...]  # the run's batch, precision, recompute and stage split as config overrides
    planned: Planned
    rates: Rates
    source: str
    note: str = ""
    measured_s: float | None = None  # the step time the source measured, where it gives one
    measured_tflops: float | None = None  # where it gives only megatron's model TFLOP/s per GPU (measured_seconds)
    measured_tokens_per_gpu_s: float | None = None  # where it gives only tokens per second per GPU
    open_vpp: bool = False  # virtual stages, their number not given: the fastest that fits (chosen_vpp)
    imbalance: float = 1.0  # the busiest EP rank's routed rows over the average as planned (1: forced balance)
    measured_tflops_dropless: float | None = None  # the same run's TFLOP/s with the experts' load as routed
    group: str = "report"
    table: str = ""  # the row's words in docs/plan.md's generated table (plan.tables)


# YAML key -> (Published field, what the value must be)
KEYS = {"name": ("name", "text"), "group": ("group", "text"), "config": ("config", "text"),
        "layout": ("layout", "mapping"), "set": ("sets", "list"), "planned": ("planned", "mapping"),
        "rates": ("rates", "mapping"), "source": ("source", "text"), "note": ("note", "text"),
        "measured_s": ("measured_s", "number"), "measured_tflops": ("measured_tflops", "number"),
        "measured_tokens_per_gpu_s": ("measured_tokens_per_gpu_s", "number"),
        "measured_tflops_dropless": ("measured_tflops_dropless", "number"),
        "open_vpp": ("open_vpp", "flag"), "imbalance": ("imbalance", "number"), "table": ("table", "text")}
REQUIRED = ("name", "group", "config", "layout", "set", "source")
KINDS = {"text": lambda v: isinstance(v, str) and v.strip() != "", "mapping": lambda v: isinstance(v, dict),
         "list": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
         "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
         "flag": lambda v: isinstance(v, bool)}
KIND_WORDS = {"text": "a non-empty string", "mapping": "a mapping", "list": "a list of strings",
              "number": "a positive number", "flag": "true or false"}


def fields_of(cls, given: dict, where: str) -> dict:
    """`given`'s keys checked against dataclass `cls`'s fields (a one-line error for another)."""
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in given if k not in known]
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}: unknown key (expected some of {', '.join(known)})")
    return given


def load(path: Path) -> Published:
    """One run's file, checked (module docstring); ConfigError names the file and the field."""
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not YAML: {' '.join(str(e).split())}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping of the run's fields")
    for key in raw:
        if key not in KEYS:
            raise ConfigError(f"{where}: {key}: unknown key (expected some of {', '.join(KEYS)})")
    for key in REQUIRED:
        if key not in raw:
            raise ConfigError(f"{where}: {key}: missing")
    for key, value in raw.items():
        if not KINDS[KEYS[key][1]](value):
            raise ConfigError(f"{where}: {key}: expected {KIND_WORDS[KEYS[key][1]]}, got {value!r}")
    if raw["group"] not in GROUPS:
        raise ConfigError(f"{where}: group: expected one of {', '.join(GROUPS)}, got {raw['group']!r}")
    if not (ROOT / raw["config"]).is_file():
        raise ConfigError(f"{where}: config: no file {raw['config']}")
    layout = fields_of(Layout, raw["layout"], f"{where}: layout")
    if "world" not in layout or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                                        for v in layout.values()):
        raise ConfigError(f"{where}: layout: expected positive whole numbers, world among them, got {layout}")
    # every published run also ran a fused SwiGLU (NVIDIA's recipes set bias_activation_fusion,
    # Megatron-LM's default; DeepSeek's and Moonshot's own kernels), which this trainer does not
    # (Planned.fused_swiglu), and those with context parallelism ran it through Transformer Engine's
    # attention with megatron's default cp_comm_type p2p, the ring (Planned.ring_attention; the
    # trainer all-gathers): the defaults of a run's planned settings
    planned = {"fused_swiglu": True, "ring_attention": True,
               **fields_of(Planned, raw.get("planned", {}), f"{where}: planned")}
    if isinstance(planned.get("overlap"), list):
        planned["overlap"] = tuple(planned["overlap"])
    rates = fields_of(Rates, raw.get("rates", {}), f"{where}: rates")
    try:
        planned, rates = Planned(**planned), Rates(**rates)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None
    if raw.get("imbalance", 1.0) < 1:
        raise ConfigError(f"{where}: imbalance: expected at least 1 (the busiest rank over the average)")
    values = {KEYS[k][0]: v for k, v in raw.items() if k not in ("layout", "set", "planned", "rates")}
    return Published(**values, layout=Layout(**layout), sets=tuple(raw["set"]), planned=planned, rates=rates)


def load_all(folder: Path = FOLDER) -> dict[str, tuple[Published, ...]]:
    """Every run in `folder` by group (GROUPS' order), each group in its files' name order."""
    runs = [load(p) for p in sorted(folder.glob("*.yaml"))]
    return {g: tuple(r for r in runs if r.group == g) for g in GROUPS}


_BY_GROUP = load_all()
RUNS = _BY_GROUP["report"]  # the reports' and recipes' own layouts
TUNED = _BY_GROUP["tuned"]  # NVIDIA's throughput-tuned layouts with the step times they measured
LONG_CONTEXT = _BY_GROUP["long_context"]  # one tuned layout at 16K to 128K tokens, forced balance
MEASURED = _BY_GROUP["measured"] + LONG_CONTEXT  # NVIDIA's other H100 runs, planned to set the estimate beside them
LONG_CONTEXT_DROPLESS = _BY_GROUP["long_context_dropless"]  # the same four as routed (dropless)
# The expert-imbalance margin the dropless rows are planned with (fitted at 16K:
# bench/plan_published_measured.py refits and prints it); one margin for all four.
DROPLESS_IMBALANCE = LONG_CONTEXT_DROPLESS[0].imbalance if LONG_CONTEXT_DROPLESS else 1.0
if any(r.imbalance != DROPLESS_IMBALANCE for r in LONG_CONTEXT_DROPLESS):
    raise ConfigError(f"{FOLDER.relative_to(ROOT)}: the long_context_dropless runs' imbalance differs between files")


def megatron_model_flops(cfg) -> float:
    """One sequence's training FLOPs as megatron-lm counts them for the TFLOP/s per GPU it logs
    (NVIDIA/Megatron-LM megatron/training/training.py at 001b00c, num_floating_point_operations,
    its transformer_flops): 3 passes (forward, data and weight gradients) × 2 per multiply-add
    over the q/k/v and output projections, QKᵀ and AV over the causal half, dense MLPs, the top-k
    routed and the shared experts (SwiGLU's 3 matrices), and the logits over the vocabulary padded
    to 128 × TP; no router, norms or recompute. GQA and multi-head attention, no MTP."""
    from megatron_kappa.model.layout import model_layout, padded_vocab_size
    m = cfg.model
    if attention_kinds.name_of(m) != "gqa" or m.mtp.num_layers:
        raise ValueError(f"{attention_kinds.key_of(attention_kinds.name_of(m))} / model.mtp: megatron_model_flops "
                         "counts GQA attention without MTP only")
    h, s, n = m.hidden_size, m.seq_length, m.num_attention_heads
    d = m.head_dim or h // n
    q, kv = n * d, (m.num_query_groups or n) * d
    attention = h * (q + 2 * kv) + q * s / 2 * 2 + q * h
    moe_layers = model_layout(cfg).num_moe_layers
    dense_layers = m.num_layers - moe_layers
    moe = m.moe
    mlp = 3 * h * ((m.ffn_hidden_size or 4 * h) * dense_layers
                   + ((moe.ffn_hidden_size or m.ffn_hidden_size) * moe.topk + (moe.shared_ffn_hidden_size or 0))
                   * moe_layers)
    return s * 3 * 2 * (mlp + attention * m.num_layers + h * padded_vocab_size(m.vocab_size, cfg.parallel.tp))


def measured_seconds(run: Published) -> float | None:
    """The step time the source measured: given, or read from its tokens per second per GPU (a
    step's tokens over all the run's GPUs' rate), or from megatron's model TFLOP/s per GPU (a
    step's megatron_model_flops over the rate of all the run's GPUs)."""
    if run.measured_s or not (run.measured_tflops or run.measured_tokens_per_gpu_s):
        return run.measured_s
    cfg = config_of(run)
    if run.measured_tokens_per_gpu_s:
        return cfg.train.global_batch * cfg.model.seq_length / (run.measured_tokens_per_gpu_s * run.layout.world)
    return cfg.train.global_batch * megatron_model_flops(cfg) / (run.measured_tflops * 1e12 * run.layout.world)


def config_of(run: Published):
    """The run's config: its layout and settings, with plain SwiGLU experts (the published runs
    had no κ, and so none of its α and b parameters)."""
    par = run.layout
    return load_config(run.config, [*run.sets, "model.kappa.enabled=false", f"parallel.tp={par.tp}",
                                    f"parallel.pp={par.pp}", f"parallel.ep={par.ep}", f"parallel.etp={par.etp}"])


def chosen_vpp(run: Published, *, gpu_mem_gib: float = 80.0, gpus_per_node: int = 8) -> Published:
    """`run` with its virtual stages: as given, or (open_vpp) the number above 1 that divides its
    largest stage's layers (as --search tries them) and is fastest among those that fit (the
    first tried, 2 where it divides, when none fits: the verdict then says so)."""
    if not run.open_vpp:
        return run
    cfg = config_of(run)
    most = max(model_shape(cfg, run.layout).stage_counts())
    tried = [dataclasses.replace(run.layout, vpp=v) for v in divisors(most) if v > 1]
    plans = [(layout, plan(cfg, layout, gpu_mem_gib=gpu_mem_gib, gpus_per_node=gpus_per_node, rates=run.rates,
                           imbalance=run.imbalance, planned=run.planned))
             for layout in tried]
    fitting = [(layout, p) for layout, p in plans if p.fits] or plans[:1]
    best = max(fitting, key=lambda lp: lp[1].speed.tokens_per_s)[0]
    return dataclasses.replace(run, layout=best)


@dataclasses.dataclass(frozen=True)
class RunPlan:
    """A published run planned: its plan at its layout (virtual stages chosen where open), the
    step time its source measured, and (ranked) its place among --search's layouts."""
    name: str
    plan: Plan
    fits: bool
    gib: float  # the most-loaded rank's total
    layout: Layout
    measured_s: float | None
    ranked: bool = False
    rank: int | None = None  # the layout's own position among the searched ones (None: not among them)
    layouts_that_fit: int | None = None
    by_speed: int | None = None  # where its estimate falls among the searched layouts' best ones
    of_first: float | None = None  # its estimate over the first layout's

    def as_dict(self) -> dict:
        """For --json: the plan as a dict, the search's fields only where it was ranked."""
        out = {"name": self.name, "plan": self.plan.as_dict(), "fits": self.fits, "gib": self.gib,
               "layout": self.layout}
        if self.ranked:
            out.update(rank=self.rank, layouts_that_fit=self.layouts_that_fit, by_speed=self.by_speed,
                       of_first=self.of_first)
        return out | {"measured_s": self.measured_s}


def check_run(run: Published, *, gpu_mem_gib: float = 80.0, gpus_per_node: int = 8, ranked: bool = True,
              progress: bool = False) -> RunPlan:
    """The plan of a published run (its virtual stages chosen where the source gives no number:
    chosen_vpp), and (`ranked`) its position among --search's layouts that fit at its world size
    with its planned-only settings (`progress`: the search's bar on stderr)."""
    measured = measured_seconds(run)
    run = chosen_vpp(run, gpu_mem_gib=gpu_mem_gib, gpus_per_node=gpus_per_node)
    cfg = config_of(run)
    settings = dict(gpu_mem_gib=gpu_mem_gib, gpus_per_node=gpus_per_node, rates=run.rates, imbalance=run.imbalance,
                    planned=run.planned)
    p = plan(cfg, run.layout, **settings)
    out = RunPlan(name=run.name, plan=p, fits=p.fits, gib=p.most_loaded.total_bytes / 2 ** 30, layout=run.layout,
                  measured_s=measured)
    if not ranked:
        return out
    # among every layout the planner models, those the trainer refuses too (labelled): a published run
    # is placed among its own kind (context parallelism, stages without decoder layers, ...), at its
    # own all-to-all overlap (its planned-only terms; the trainer's setting is not varied)
    rows = search(cfg, run.layout.world, top=None, progress=progress, planned_layouts=True, vary_overlap=False,
                  **settings)
    own = p.speed.tokens_per_s
    # by_speed: where the run's own estimate falls among the searched layouts' best ones (also
    # for a stage split the search does not try, such as an uneven split with virtual stages)
    return dataclasses.replace(out, ranked=True, rank=rank_of(rows, run.layout), layouts_that_fit=len(rows),
                               by_speed=1 + sum(r.speed.tokens_per_s > own for r in rows),
                               of_first=own / rows[0].speed.tokens_per_s if rows else None)
