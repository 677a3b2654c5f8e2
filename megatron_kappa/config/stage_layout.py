"""`parallel.layout`: megatron's pipeline_model_parallel_layout string, unrolled and checked.

The string lists each pipeline stage's layers, stages separated by `|`: `E` the embedding, `t` a
decoder layer, `m` an MTP layer, `L` the output layer and loss; `x*n` repeats a layer and
`(…)*n` a group, commas are cosmetic (megatron's PipelineParallelLayerLayout.parse_str_to_list).
DeepSeek-V3's 61 layers on 16 stages with the embedding and the loss given a layer's share each:
"Et*3|(t*4|)*14t*2mL". With virtual stages (parallel.vpp) there is one entry per model chunk,
pp × vpp of them in megatron's order: entry c is virtual stage c // pp of rank c mod pp.
"""
from __future__ import annotations

import re

LAYERS = {"E": "the embedding", "t": "a decoder layer", "m": "an MTP layer", "L": "the loss"}


def stages(text: str) -> list[str]:
    """One string of layer letters per stage, repetitions unrolled."""
    text = text.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda g: g.group(1) * int(g.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda g: g.group(1) * int(g.group(2)), text)
    return text.split("|")


def decoder_counts(text: str) -> list[int]:
    """The number of decoder layers of each entry (stage, or model chunk with virtual stages)."""
    return [stage.count("t") for stage in stages(text)]


def empty_entries(text: str) -> list[int]:
    """The entries (stages, or model chunks with virtual stages) that hold no decoder layer: an
    embedding or a loss (with the MTP layers) alone, as megatron's --account-for-embedding/loss-in-
    pipeline-split make them (DeepSeek-V3's "Et|(tt|)*30mL"). megatron runs them; this trainer
    does not (megatron_kappa.preflight refuses them), the planner plans them."""
    return [i for i, stage in enumerate(stages(text)) if "t" not in stage]


def check(text: str, pp: int, num_layers: int, mtp_layers: int, need, vpp: int = 1) -> None:
    """What megatron runs: `pp` × `vpp` entries, the embedding opening the first, the loss
    closing the last after the MTP layers, every decoder layer placed (an entry may hold none:
    empty_entries)."""
    key = "parallel.layout"
    split = stages(text)
    unknown = sorted({c for stage in split for c in stage if c not in LAYERS})
    need(not unknown, key, f"unknown layer {', '.join(map(repr, unknown))} in {text!r}: expected "
         + ", ".join(f"{c} ({what})" for c, what in LAYERS.items()) + ", with x*n and (...)*n repeats")
    need(len(split) == pp * vpp, key, f"{text!r} has {len(split)} entries for parallel.pp={pp} × parallel.vpp={vpp} "
         "(one entry per stage and virtual stage)")
    joined = "".join(split)
    need(split[0].startswith("E") and joined.count("E") == 1, key, f"{text!r}: E (the embedding) must open the "
         "first stage, once")
    need(split[-1].endswith("L") and joined.count("L") == 1, key, f"{text!r}: L (the loss) must close the last "
         "stage, once")
    need(joined.count("t") == num_layers, key, f"{text!r} places {joined.count('t')} decoder layers (t); "
         f"model.num_layers is {num_layers}")
    last = split[-1]
    need(joined.count("m") == mtp_layers and last.count("m") == mtp_layers
         and (not mtp_layers or "t" not in last[last.index("m"):]), key,
         f"{text!r}: the last stage must end with model.mtp.num_layers={mtp_layers} MTP layers (m) before L")
