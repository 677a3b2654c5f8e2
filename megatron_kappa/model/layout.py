"""The model's shape decisions that need no torch: which layers are MoE, the padded vocabulary,
and where a pipeline stage's layers sit in the full model."""
from __future__ import annotations

import math
import re

from megatron_kappa.config import Config


def moe_layer_pattern(cfg: Config) -> list[int]:
    """1 for an MoE layer, 0 for a dense one, per layer."""
    m = cfg.model
    if m.layout == "dense":
        return [0] * m.num_layers
    if m.layout == "moe":
        return [0] * m.first_dense + [1] * (m.num_layers - m.first_dense)
    middle = m.num_layers // 2
    return [1 if i in (middle - 1, middle) else 0 for i in range(m.num_layers)]


def padded_vocab_size(cfg: Config) -> int:
    multiple = 128 * cfg.parallel.tp
    return int(math.ceil(cfg.model.vocab_size / multiple) * multiple)


def layer_offset(model) -> int:
    """The global index of this pipeline stage's first layer (`decoder.layers.<i>` is local)."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


LAYER = re.compile(r"(^|\.)layers\.(\d+)\.")  # the `layers.<i>.` of a parameter or module name


def global_layer_index(model, local_name: str) -> int:
    """The global layer index of a `decoder.layers.<i>...` name of this stage's model."""
    return layer_offset(model) + int(LAYER.search(local_name).group(2))


def shift_layers(name: str, offset: int) -> str:
    """A pipeline stage's local `decoder.layers.<i>` name as the full model's (i + offset)."""
    if not offset:
        return name
    return LAYER.sub(lambda m: f"{m.group(1)}layers.{int(m.group(2)) + offset}.", name, count=1)
