"""The parts of the authors' nanochat block that megatron-core's GPT block lacks, as subclasses
its specs build (askerlee/kappa-swiglu 14c9b04 nanochat/gpt.py; docs/authors_model.md):

  NanochatGPTModel        the input embedding normed (gpt 2432) and kept as x0 for every layer;
                          with pipeline stages x0 travels beside the hidden state
  ScaledResidualLayer     x = λ_resid·x + λ_x0·x0 before the layer (gpt 2436)
  ValueEmbeddingAttention v += 2σ(W_gate·x[..., :32])·ve(tokens) on every other layer (gpt 319-321,
                          360-379)

The model and its layers share one BlockInputs: the model writes this forward's token ids and x0
into it, the layers read them. That is why `model.recompute: full` is refused with the residual
scalars (its backward would replay a layer outside the graph that made x0) and, with pipeline
stages, with value embeddings (a later micro-batch's tokens would be read).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.layers import (
    _initialize_affine_weight_cpu,
    _initialize_affine_weight_gpu,
    set_tensor_model_parallel_attributes,
)
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_kappa.config import ModelConfig
from megatron_kappa.model.layout import VALUE_GATE_CHANNELS, has_value_embedding
from megatron_kappa.model.loss import ChunkedLossGPTModel


class BlockInputs:
    """What every layer of one forward reads besides its hidden state: the token ids [b, s] and
    x0, the normed input embedding ([s, b, h], sequence-parallel like the hidden state)."""

    def __init__(self):
        self.input_ids: torch.Tensor | None = None
        self.x0: torch.Tensor | None = None


class NanochatGPTModel(ChunkedLossGPTModel):
    """GPTModel whose first stage norms the embedding (model.embedding_norm) and hands x0 to the
    layers (model.residual_scalars), and whose layers see the token ids (value embeddings).

    With pipeline stages, a stage's output is [hidden; x0] along the sequence dimension, so that
    megatron's p2p sends both (the schedule is given twice the sequence length), and the next
    stage splits its input again: x0's gradient flows back to the embedding through the stages."""

    def __init__(self, *args, inputs: BlockInputs, embedding_norm: bool, norm_eps: float, carry_x0: bool,
                 **kwargs):
        super().__init__(*args, **kwargs)
        self.inputs, self.embedding_norm, self.norm_eps, self.carry_x0 = inputs, embedding_norm, norm_eps, carry_x0
        self.stages = ps.get_pipeline_model_parallel_world_size()

    def set_input_tensor(self, input_tensor):
        tensor = input_tensor[0] if isinstance(input_tensor, list) else input_tensor
        if self.carry_x0 and tensor is not None:
            half = tensor.shape[0] // 2
            self.inputs.x0 = tensor[half:]
            input_tensor = [tensor[:half]]
        super().set_input_tensor(input_tensor)

    def forward(self, input_ids, position_ids, attention_mask, decoder_input=None, **kwargs):
        self.inputs.input_ids = input_ids
        if self.pre_process and decoder_input is None:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
            if self.embedding_norm:
                decoder_input = F.rms_norm(decoder_input, (decoder_input.shape[-1],), eps=self.norm_eps)
            if self.carry_x0:
                self.inputs.x0 = decoder_input
        output = super().forward(input_ids, position_ids, attention_mask, decoder_input=decoder_input, **kwargs)
        if self.carry_x0 and not self.post_process:
            output = torch.cat([output, self.inputs.x0], dim=0)  # to the next stage, beside the hidden state
        return output


def _param_device(config: TransformerConfig):
    """Where megatron would create this rank's parameters: the meta device while the summary
    builds shapes only (build_model(meta=True)), else as megatron's linears do."""
    if torch.get_default_device().type == "meta":
        return "meta"
    return "cpu" if config.use_cpu_initialization else torch.cuda.current_device()


def pipeline_seq_length(model: ModelConfig) -> int:
    """The sequence length megatron's pipeline schedule sizes its p2p tensors by: doubled when
    x0 travels beside the hidden state."""
    return model.seq_length * (2 if model.residual_scalars else 1)


class ScaledResidualLayer(TransformerLayer):
    """megatron's TransformerLayer after x = λ_resid·x + λ_x0·x0 (λ_resid = 1, λ_x0 = 0 at init:
    gpt 2092-2106); λ are one-element parameters, trained by AdamW (megatron_kappa.optim)."""

    def __init__(self, config: TransformerConfig, submodules, layer_number: int = 1, *args, inputs: BlockInputs,
                 **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.inputs = inputs
        device = _param_device(config)
        self.resid_lambda = torch.nn.Parameter(torch.ones(1, dtype=config.params_dtype, device=device))
        self.x0_lambda = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype, device=device))
        for p in (self.resid_lambda, self.x0_lambda):
            # each tensor-parallel rank sees only its tokens (sequence parallelism): the gradient
            # is summed over TP, as the norms' (megatron_kappa.parallel.grads)
            p.sequence_parallel = config.tensor_model_parallel_size > 1

    def forward(self, *args, **kwargs):
        if "hidden_states" in kwargs:
            kwargs["hidden_states"] = self._mix(kwargs["hidden_states"])
        else:
            args = (self._mix(args[0]), *args[1:])
        return super().forward(*args, **kwargs)

    def _mix(self, x: torch.Tensor) -> torch.Tensor:
        return self.resid_lambda * x + self.x0_lambda * self.inputs.x0


class ValueEmbeddingAttention(SelfAttention):
    """megatron's SelfAttention with the value embedding added to v on the layers that have one:
    ve = table[tokens], [V, kv_heads · head_dim] split over TP by kv head like v itself; the gate
    W [kv_heads, 32] (zero at init: gpt 2099-2102) reads the first 32 channels of the layer's normed
    input, gathered over the sequence-parallel group. v is added to after the projections and
    before attention (it is not roped or normed, so before RoPE as the authors)."""

    def __init__(self, config: TransformerConfig, submodules, layer_number: int, *args, inputs: BlockInputs,
                 vocab_size: int,
                 **kwargs):
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.inputs = inputs
        self.value_embedding = self.value_gate = None
        if not has_value_embedding(self.layer_number, config.num_layers):
            return
        tp = ps.get_tensor_model_parallel_world_size()
        kv_local, head_dim = self.num_query_groups_per_partition, self.hidden_size_per_attention_head
        device = _param_device(config)
        table = torch.empty(vocab_size, kv_local * head_dim, dtype=config.params_dtype, device=device)
        self.value_embedding = torch.nn.Parameter(table)
        if config.perform_initialization and config.use_cpu_initialization:
            # the full table drawn once and split, so that every TP layout starts the same (U(±√3/√d)
            # under init nanochat, as c_v: gpt 2096-2097)
            _initialize_affine_weight_cpu(self.value_embedding, vocab_size, kv_local * head_dim * tp,
                                          kv_local * head_dim, 1, config.init_method,
                                          params_dtype=config.params_dtype)
        elif config.perform_initialization:
            _initialize_affine_weight_gpu(self.value_embedding, config.init_method, partition_dim=1)
        else:
            set_tensor_model_parallel_attributes(self.value_embedding, True, 1, 1)
        gate = torch.zeros(kv_local, VALUE_GATE_CHANNELS, dtype=config.params_dtype, device=device)
        self.value_gate = torch.nn.Parameter(gate)
        set_tensor_model_parallel_attributes(self.value_gate, True, 0, 1)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, *args, **kwargs):
        qkv = super().get_query_key_value_tensors(hidden_states, key_value_states, *args, **kwargs)
        if self.value_embedding is None:
            return qkv
        query, key, value, *rest = qkv
        x = hidden_states[..., :VALUE_GATE_CHANNELS]
        if self.config.sequence_parallel:
            x = gather_from_sequence_parallel_region(x.contiguous())
        gate = 2 * torch.sigmoid(F.linear(x, self.value_gate))  # [s, b, kv heads]
        ve = F.embedding(self.inputs.input_ids, self.value_embedding).transpose(0, 1)  # [s, b, kv · d]
        value = value + gate.unsqueeze(-1) * ve.view(*ve.shape[:2], *value.shape[2:])
        return (query, key, value, *rest)
