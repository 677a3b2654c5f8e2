"""What a config implies before anything is built: the layers' kinds, each pipeline stage's layers,
the data-parallel sizes and micro-batches on a world of ranks, the steps and tokens.

Torch-free and model-free (`python -m megatron_kappa.config` prints these beside the resolved
config); megatron_kappa.model.layout builds its ModelLayout from the same functions. When
train.steps is null the run's length is the token budget, train.tokens_per_param × N_eff, which
needs the parameter count: `python -m megatron_kappa.summary` counts it on a meta-device model.
"""
from __future__ import annotations

import math

from megatron_kappa.config.schema import ConfigError, ModelConfig, ParallelConfig, TrainConfig
from megatron_kappa.config.stage_layout import decoder_counts
from megatron_kappa.config.world import check_batch, check_world, data_parallel


def moe_layer_pattern(m: ModelConfig) -> list[int]:
    """1 for an MoE layer, 0 for a dense one, per layer."""
    if m.layout == "dense":
        return [0] * m.num_layers
    if m.layout == "moe":
        return [0] * m.first_dense + [1] * (m.num_layers - m.first_dense)
    middle = m.num_layers // 2
    return [1 if i in (middle - 1, middle) else 0 for i in range(m.num_layers)]


def chunk_counts(num_layers: int, pp: int, vpp: int = 1, first: int | None = None, last: int | None = None,
                 layout: str | None = None) -> list[int]:
    """The number of decoder layers of each model chunk, in the model's order (pp × vpp of them), as
    megatron splits them: parallel.layout's entries, else an even split, the first and last stages
    holding parallel.first_stage_layers / last_stage_layers where set."""
    if pp == 1:
        return [num_layers]
    if layout is not None:
        return decoder_counts(layout)
    if vpp > 1:  # an even split (the checks refuse first/last stage counts with vpp)
        return [num_layers // (pp * vpp)] * (pp * vpp)
    middle_stages = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    per = rest // middle_stages if middle_stages else 0
    counts = [per] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def smallest_world(par: ParallelConfig) -> int:
    """The fewest ranks the layout runs on: tp × cp × pp for the dense part, ep × etp × pp for the
    experts, both dividing the world."""
    return math.lcm(par.tp * par.cp, par.ep * par.expert_tp) * par.pp


def derived(m: ModelConfig, par: ParallelConfig, t: TrainConfig, world: int | None = None) -> dict:
    """The values above for a launch of `world` ranks (None: the smallest that fits). A world the
    layout or the batch does not divide is a one-line ConfigError, as the preflight says it."""
    world = world or smallest_world(par)
    dp = data_parallel(par, world)
    try:
        check_world(par, world)
        check_batch(t, dp)
    except ConfigError as e:
        raise ConfigError(f"{e} (world {world})") from None
    pattern = moe_layer_pattern(m)
    tokens_per_step = t.global_batch * m.seq_length
    return {
        "world": world, "dp": dp, "expert_dp": world // (par.ep * par.expert_tp * par.pp),
        "layers": pattern, "stage_layers": [sum(c) for c in _per_stage(chunk_counts(m.num_layers, par.pp, par.vpp,
                                                                                    par.first_stage_layers,
                                                                  par.last_stage_layers, par.layout), par.pp)],
        "micro_batches": t.global_batch // (t.micro_batch * dp), "tokens_per_step": tokens_per_step,
        "steps": t.steps, "tokens": t.steps * tokens_per_step if t.steps is not None else None,
    }


def _per_stage(chunks: list[int], pp: int) -> list[list[int]]:
    """Chunk c sits on rank c mod pp (megatron's interleaving)."""
    return [chunks[stage::pp] for stage in range(pp)]


def render(d: dict, m: ModelConfig, par: ParallelConfig, t: TrainConfig) -> str:
    """The derived values (`derived`'s, of the same sections) as YAML comments: the printed config
    stays a config file."""
    moe = sum(d["layers"])
    experts = f"; {m.moe.num_experts} experts, top-{m.moe.topk}" if moe else ""
    stages = "" if par.pp == 1 else "; layers per stage " + " ".join(map(str, d["stage_layers"])) + (
        f" (vpp {par.vpp})" if par.vpp > 1 else "")
    cp = f" × cp {par.cp}" if par.cp > 1 else ""
    lines = [
        f"layers       {' '.join('M' if x else 'd' for x in d['layers'])}  ({len(d['layers']) - moe} dense, "
        f"{moe} MoE{experts}){stages}",
        f"world        {d['world']} rank{'s' * (d['world'] > 1)}: tp {par.tp}{cp} × pp {par.pp} × dp {d['dp']}; "
             f"experts "
        f"ep {par.ep} × etp {par.expert_tp} × pp {par.pp} × expert dp {d['expert_dp']}",
        f"batch        {t.global_batch} sequences × {m.seq_length} tokens = {d['tokens_per_step']:,} tokens per step",
        f"micro-batch  {t.micro_batch} sequences; {d['micro_batches']} per rank per step (gradient accumulation)",
        f"steps        {d['steps']:,} (train.steps): {d['tokens']:,} tokens" if d["steps"] is not None else
        f"steps        from the token budget, train.tokens_per_param {t.tokens_per_param:g} × N_eff tokens "
        f"/ {d['tokens_per_step']:,} per step (python -m megatron_kappa.summary counts N_eff)",
    ]
    return "\n".join(["# derived (not config keys; python launch/pretrain.py --check WORLD checks the inputs too):"]
                     + [f"#   {line}" for line in lines])
