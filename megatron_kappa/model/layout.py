"""The model's shape decisions that need no torch: which layers are MoE, the padded vocabulary,
and where a pipeline stage's layers sit in the full model.

`model_layout(cfg)` derives them once, as a ModelLayout that the builder, the trainer, the
preflight, evaluation, the summary and the planner are handed instead of each deriving them again.
The layer pattern and the stages' split come from megatron_kappa.config.derived, which
`python -m megatron_kappa.config` shows without building anything.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from megatron_kappa.config import Config
from megatron_kappa.config.derived import chunk_counts, moe_layer_pattern  # moe_layer_pattern: this module's API too


@dataclass(frozen=True)
class ModelLayout:
    """What a config decides about the model's shape."""
    moe_layers: tuple[int, ...]  # 1 for an MoE layer, 0 for a dense one, per layer
    num_experts: int  # routed experts of each MoE layer (model.moe.num_experts)
    padded_vocab: int  # the vocabulary padded to a multiple of 128 × TP
    pp: int  # pipeline stages; each holds consecutive layers (stage_layers)
    first_stage_layers: int | None = None  # uneven stages: parallel.first_stage_layers / last_stage_layers
    last_stage_layers: int | None = None
    stage_layout: str | None = None  # or parallel.layout (megatron's pipeline_model_parallel_layout)
    vpp: int = 1  # virtual stages per rank: pp × vpp model chunks, chunk c on rank c mod pp

    @property
    def has_moe(self) -> bool:
        return any(self.moe_layers)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_layers)

    @property
    def experts(self) -> int | None:
        """The routed experts per MoE layer, or None for a model without MoE layers (what the
        layout checks divide by)."""
        return self.num_experts if self.has_moe else None

    def stage_layers(self, stage: int, vp_stage: int = 0) -> tuple[int, int]:
        """The [start, stop) layer numbers of a pipeline stage (of its virtual stage `vp_stage`:
        model chunk vp_stage × pp + stage), as megatron splits them (get_transformer_layer_offset):
        the first and last stages hold first_stage_layers and last_stage_layers where set, the
        other stages an even share of the rest; or as the stage layout string says."""
        counts = self.chunk_counts()
        chunk = vp_stage * self.pp + stage
        start = sum(counts[:chunk])
        return start, start + counts[chunk]

    def stage_counts(self) -> list[int]:
        """The number of layers on each pipeline stage (all its virtual stages together)."""
        counts = self.chunk_counts()
        return [sum(counts[stage::self.pp]) for stage in range(self.pp)]

    def chunk_counts(self) -> list[int]:
        """The number of layers of each model chunk, in the model's order (pp × vpp of them)."""
        return chunk_counts(len(self.moe_layers), self.pp, self.vpp, self.first_stage_layers, self.last_stage_layers,
                            self.stage_layout)

    def stage_layer_indices(self, stage: int) -> list[int]:
        """The global indices of a stage's layers (of all its virtual stages, in order)."""
        return [i for v in range(self.vpp) for i in range(*self.stage_layers(stage, v))]

    def stage_moe_layers(self, stage: int) -> tuple[int, ...]:
        """Which of a stage's layers are MoE (of all its virtual stages, in order)."""
        return tuple(self.moe_layers[i] for i in self.stage_layer_indices(stage))


def model_layout(cfg: Config) -> ModelLayout:
    par = cfg.parallel
    return ModelLayout(moe_layers=tuple(moe_layer_pattern(cfg.model)), num_experts=cfg.model.moe.num_experts,
                       padded_vocab=padded_vocab_size(cfg.model.vocab_size, par.tp), pp=par.pp,
                       first_stage_layers=par.first_stage_layers,
                       last_stage_layers=par.last_stage_layers, stage_layout=par.layout, vpp=par.vpp)


VALUE_GATE_CHANNELS = 32  # a value-embedding gate reads x[..., :32] (14c9b04 nanochat/gpt.py 360)


def has_value_embedding(layer_number: int, num_layers: int) -> bool:
    """Whether layer `layer_number` (megatron's: 1-based, global) has a value embedding under
    model.value_embeddings: every other layer, the last one included, i.e. i % 2 == (L − 1) % 2
    for the 0-based i (14c9b04 nanochat/gpt.py 319-321)."""
    return (layer_number - 1) % 2 == (num_layers - 1) % 2


def padded_vocab_size(vocab_size: int, tp: int) -> int:
    """model.vocab_size padded to a multiple of 128 × TP (megatron's rule), as the model builds it."""
    multiple = 128 * tp
    return int(math.ceil(vocab_size / multiple) * multiple)


def layer_offset(model) -> int:
    """The global index of this pipeline stage's first layer (`decoder.layers.<i>` is local); 0
    for a rank's virtual stages (model/virtual_stages.py), which name their layers by the global index."""
    if getattr(model, "names_are_global", False):
        return 0
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


LAYER = re.compile(r"(^|\.)decoder\.layers\.(\d+)\.")  # the `decoder.layers.<i>.` of a parameter or module name
MTP_DEPTH = re.compile(r"(^|\.)mtp\.layers\.(\d+)\.")  # an MTP module's `mtp.layers.<depth>.` (not a decoder layer)


def global_layer_index(model, local_name: str) -> int:
    """The global layer index of a `decoder.layers.<i>...` name of this stage's model."""
    return layer_offset(model) + int(LAYER.search(local_name).group(2))


def layer_label(model, local_name: str) -> str:
    """The metrics' name of the layer a module or parameter belongs to: `layer<i>` (global index)
    for a decoder layer, `mtp<d>` for the MTP module of depth d (model.mtp)."""
    depth = MTP_DEPTH.search(local_name)
    if depth:
        return f"mtp{depth.group(2)}"
    return f"layer{global_layer_index(model, local_name)}"


def shift_layers(name: str, offset: int) -> str:
    """A pipeline stage's local `decoder.layers.<i>` name as the full model's (i + offset); the MTP
    modules' `mtp.layers.<d>` are numbered by depth, not shifted."""
    if not offset:
        return name
    return LAYER.sub(lambda m: f"{m.group(1)}decoder.layers.{int(m.group(2)) + offset}.", name, count=1)
