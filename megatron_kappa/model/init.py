"""The authors' initialisation (model.init: nanochat; askerlee/kappa-swiglu 14c9b04 nanochat/gpt.py
2030-2120): megatron-core's init hooks take the matrices (uniform, standard deviation 1/√d), the
output projections (zero) and the embedding (N(0, 1)); the output layer, which megatron initialises
with the matrices' method, is drawn again at N(0, 0.001) here.

Drawn on the host in blocks of 128 vocabulary rows, each from its own seed: a rank draws only its
rows (the vocabulary is padded to a multiple of 128 × TP), and the output layer starts the same in
every tensor-parallel layout, as megatron's CPU initialisation makes the other weights.
"""
from __future__ import annotations

import math
from functools import partial

import torch

OUTPUT_STD = 0.001  # lm_head: N(0, 0.001), gpt 2047
EMBEDDING_STD = 1.0  # wte: N(0, 1), gpt 2046


def megatron_init_methods(hidden_size: int) -> dict:
    """TransformerConfig's init_method, output_layer_init_method and embedding_init_method."""
    bound = math.sqrt(3.0) / math.sqrt(hidden_size)  # U(−s, s) has standard deviation 1/√d, gpt 2051
    return dict(init_method=partial(torch.nn.init.uniform_, a=-bound, b=bound),
                output_layer_init_method=torch.nn.init.zeros_,
                embedding_init_method=partial(torch.nn.init.normal_, mean=0.0, std=EMBEDDING_STD))


BLOCK = 128  # vocabulary rows per seed (model.layout.padded_vocab_size pads to 128 × TP)


def output_layer_rows(vocab: int, hidden: int, tp: int, rank: int, seed: int) -> torch.Tensor:
    """This TP rank's [vocab / tp, hidden] rows of the output layer's N(0, OUTPUT_STD) matrix."""
    rows = vocab // tp
    first = rank * rows
    blocks = [torch.randn(BLOCK, hidden, generator=torch.Generator().manual_seed(seed * 1_000_003 + b))
              for b in range(first // BLOCK, (first + rows) // BLOCK)]
    return torch.cat(blocks) * OUTPUT_STD


def init_output_layer(model, seed: int):
    from megatron.core import parallel_state as ps
    weight = model.output_layer.weight
    tp = ps.get_tensor_model_parallel_world_size()
    rows = output_layer_rows(weight.shape[0] * tp, weight.shape[1], tp, ps.get_tensor_model_parallel_rank(), seed)
    with torch.no_grad():
        weight.copy_(rows)
