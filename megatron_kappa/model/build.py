"""Config → megatron-core TransformerConfig + layer specs → GPTModel.

Only the model: process groups come from megatron_kappa.parallel, training from megatron_kappa.train.
The κ experts enter through megatron-core's spec slots (MoESubmodules.router/experts) and a
MoELayer subclass; with `model.kappa.enabled: false` the MoE layers are stock megatron-core.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec, get_gpt_mtp_block_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.moe.moe_layer import MoESubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

import megatron_kappa.model.attention_kinds  # hands the built-in kinds' pieces to the registry
import megatron_kappa.model.routers  # noqa: F401  (hands the built-in routers' classes to the registry)
from megatron_kappa import attention_kinds, routers
from megatron_kappa.config import Config, KappaConfig, ModelConfig, MoEConfig
from megatron_kappa.config import recompute as selective
from megatron_kappa.kappa import KappaSettings
from megatron_kappa.kappa import inputs as kappa_inputs
from megatron_kappa.model import fp8, init, nanochat, softmoe
from megatron_kappa.model.attention import SDPAttention
from megatron_kappa.model.capacity import install_capacity_switch
from megatron_kappa.model.experts import GroupedExperts, KappaSequentialMLP
from megatron_kappa.model.layout import ModelLayout, model_layout
from megatron_kappa.model.loss import ChunkedLossGPTModel, softcap_logits
from megatron_kappa.model.norms import SPTorchNorm
from megatron_kappa.model.virtual_stages import VirtualStages


def recompute_settings(m: ModelConfig, has_moe: bool) -> dict:
    """megatron's activation-recomputation settings for `model.recompute`."""
    if m.recompute == "full" and m.recompute_layers is not None:  # the first N layers of each stage
        return dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=m.recompute_layers)
    if m.recompute == "full":  # every layer's input kept, each layer recomputed in backward
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if m.recompute == "selective":
        modules = selective.selected(m, has_moe)
        return dict(recompute_granularity="selective", recompute_modules=list(modules))
    return {}


def transformer_config(cfg: Config, device: torch.device | str = "cpu",
                       layout: ModelLayout | None = None) -> TransformerConfig:
    """megatron's TransformerConfig for `cfg` (of model layout `layout`: model_layout(cfg) when not
    given), with weights created on `device`."""
    m, moe, par = cfg.model, cfg.model.moe, cfg.parallel
    layout = layout or model_layout(cfg)
    has_moe = layout.has_moe
    dtype = torch.bfloat16 if cfg.precision in ("bf16", "fp8") else torch.float32
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    kwargs = dict(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_attention_heads,
        ffn_hidden_size=ffn,
        normalization="RMSNorm", qk_layernorm=m.qk_layernorm, layernorm_epsilon=m.norm_eps, add_bias_linear=False,
        gated_linear_unit=True, activation_func=F.silu, init_method_std=m.init_std,
        hidden_dropout=0.0, attention_dropout=0.0,
        # Fused paths are GPU-only or would bypass the κ activation.
        bias_activation_fusion=False, masked_softmax_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        tensor_model_parallel_size=par.tp, sequence_parallel=par.tp > 1,
        # context parallelism: megatron's RoPE takes each rank's chunks; the SDPA core attention
        # all-gathers keys and values (model/cp_attention.py), the one exchange it implements
        context_parallel_size=par.cp, cp_comm_type="all_gather" if par.cp > 1 else None,
        pipeline_model_parallel_size=par.pp,
        num_layers_in_first_pipeline_stage=par.first_stage_layers if par.pp > 1 else None,
        num_layers_in_last_pipeline_stage=par.last_stage_layers if par.pp > 1 else None,
        pipeline_model_parallel_layout=par.layout if par.pp > 1 else None,
        virtual_pipeline_model_parallel_size=par.vpp if par.pp > 1 and par.vpp > 1 else None,
        # interleaved 1F1B sends to both neighbours at once, which are one rank when pp = 2; gloo
        # pairs a pair's messages in posting order, and the batched ops post rank 0's [gradient to
        # prev, activation to next] against rank 1's [activation from prev, gradient from next]: the
        # two arrive swapped. megatron's unbatched ops put the two directions on two groups.
        batch_p2p_comm=par.vpp == 1,
        expert_model_parallel_size=par.ep, expert_tensor_parallel_size=par.expert_tp,
        # megatron's combined 1F1B schedule (docs/ep_overlap.md); the trainer runs its step through it
        overlap_moe_expert_parallel_comm=par.overlap_moe_expert_parallel_comm,
        delay_wgrad_compute=par.delay_wgrad_compute,
        use_cpu_initialization=torch.device(device).type == "cpu",
        params_dtype=dtype, bf16=dtype == torch.bfloat16, pipeline_dtype=dtype,
        # precision fp8 runs its GEMMs through torchao (model/fp8.py); megatron's own fp8 flag would
        # need Transformer Engine and stays off
        **recompute_settings(m, has_moe),
        **(init.megatron_init_methods(m.hidden_size) if m.init == "nanochat" else {}),
    )
    if has_moe:
        kwargs.update(
            num_moe_experts=moe.num_experts, moe_router_topk=moe.topk,
            moe_ffn_hidden_size=moe.ffn_hidden_size or ffn,
            moe_layer_freq=list(layout.moe_layers),
            # "sorted" is ours (SortedMoELayer swaps it in); megatron builds its alltoall first
            moe_token_dispatcher_type="alltoall" if moe.dispatcher == "sorted" else moe.dispatcher,
            moe_router_dtype="fp32" if moe.router_dtype == "fp32" else None,  # None: the params' dtype
            moe_z_loss_coeff=moe.z_loss or None,
            moe_router_topk_scaling_factor=moe.route_scale if moe.route_scale != 1.0 else None,
            moe_expert_capacity_factor=moe.capacity_factor,
            moe_grouped_gemm=moe.grouped_gemm, moe_permute_fusion=False, moe_router_fusion=False,
            moe_shared_expert_intermediate_size=moe.shared_ffn_hidden_size,
            moe_router_num_groups=moe.num_groups, moe_router_group_topk=moe.group_topk,
        )
        # the router kind's own: score function, load balancing (megatron_kappa.routers)
        kwargs.update(routers.lookup(moe.router).megatron(moe))
    if cfg.train.qk_clip is not None:  # QK-Clip: the core attention records each head's largest logit
        kwargs.update(qk_clip=True, qk_clip_threshold=cfg.train.qk_clip, qk_clip_alpha=cfg.train.qk_clip_alpha)
    if m.mtp.num_layers:  # multi-token prediction: the block on the last stage, its loss × λ into the objective
        kwargs.update(mtp_num_layers=m.mtp.num_layers, mtp_loss_scaling_factor=m.mtp.loss_weight)
    # the attention kind's own (megatron_kappa.attention_kinds): its heads' settings, its config class
    kind = attention_kinds.of(m)
    kwargs.update(kind.megatron(m))
    with warnings.catch_warnings():
        if has_moe and moe.router_dtype == "params":  # chosen (the paper configs: the authors' bf16 router), so
            # megatron's advice for ≥ 32 experts, fp32 routing (router_dtype fp32, the default), is not taken
            warnings.filterwarnings("ignore", "Using a large number of experts", UserWarning)
        return (kind.transformer_config or TransformerConfig)(**kwargs)


def core_attention(m: ModelConfig):
    """The core-attention submodule of `model.attention`."""
    if m.attention == "sdpa":
        return SDPAttention
    if m.attention == "te":  # imported only when asked for: TE needs CUDA (the preflight checks)
        from megatron.core.extensions.transformer_engine import TEDotProductAttention
        return TEDotProductAttention
    return None  # megatron's local DotProductAttention, as the local spec has it


def fp8_linears(submodules, settings: fp8.FP8Settings | None, **names):
    """`submodules` with the megatron linears named in `names` (name → "column" | "row") built as
    their FP8 subclasses when `settings` is given."""
    if settings is None:
        return submodules
    classes = {"column": (ColumnParallelLinear, fp8.FP8ColumnParallelLinear),
               "row": (RowParallelLinear, fp8.FP8RowParallelLinear)}
    swaps = {}
    for name, kind in names.items():
        stock, fp8_class = classes[kind]
        if getattr(submodules, name) is not stock:
            raise ValueError(f"fp8: {name} is {getattr(submodules, name)}, expected megatron's {stock.__name__}")
        swaps[name] = ModuleSpec(module=fp8_class, params={"fp8": settings})
    return dataclasses.replace(submodules, **swaps)


def norm_spec(m: ModelConfig):
    """Every RMSNorm of the model: with learnable gains (megatron's) or without (model.norm_gains)."""
    return SPTorchNorm if m.norm_gains else partial(SPTorchNorm, gains=False)


def _adapt_layer_spec(spec, m: ModelConfig, precision: str, device, dense: bool, layout: ModelLayout,
                      inputs: nanochat.BlockInputs | None = None):
    """The local layer spec with every norm (input, pre-MLP, q/k) built by SPTorchNorm, the core
    attention of `model.attention`, FP8 linears where `precision: fp8` asks for them, and the
    nanochat block's layer and attention subclasses where its keys ask for them (they read `inputs`)."""
    if m.residual_scalars:
        spec = dataclasses.replace(spec, module=nanochat.ScaledResidualLayer, params={**spec.params, "inputs": inputs})
    sub = spec.submodules
    attn = sub.self_attention
    if m.value_embeddings:
        attn = dataclasses.replace(attn, module=nanochat.ValueEmbeddingAttention,
                                   params={**attn.params, "inputs": inputs, "vocab_size": layout.padded_vocab})
    norm = norm_spec(m)
    # q/k norms (MLA: the query and key/value latents' norms)
    qk = {f.name: norm for f in dataclasses.fields(attn.submodules)
          if f.name.endswith("layernorm") and getattr(attn.submodules, f.name) is not IdentityOp}
    core = core_attention(m)
    if core is not None:
        qk["core_attention"] = core
    kind = attention_kinds.of(m)  # its self-attention class (MLA: model/attention_kinds/mla.py) and linears
    attn_fp8 = fp8.settings(precision, m.fp8, device, "attention")
    if kind.attention is not None:
        attn = kind.attention(attn, attn_fp8)
    attn_sub = fp8_linears(dataclasses.replace(attn.submodules, **qk), attn_fp8,
                           **kind.fp8_linears)
    sub = dataclasses.replace(sub, input_layernorm=norm, pre_mlp_layernorm=norm,
                              self_attention=dataclasses.replace(attn, submodules=attn_sub))
    if dense:  # megatron's local spec: partial(MLP.as_mlp_submodule, submodules=MLPSubmodules(...))
        mlp = sub.mlp
        mlp_sub = fp8_linears(mlp.keywords["submodules"], fp8.settings(precision, m.fp8, device, "dense_mlp"),
                              linear_fc1="column", linear_fc2="row")
        sub = dataclasses.replace(sub, mlp=partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": mlp_sub}))
    return dataclasses.replace(spec, submodules=sub)


def kappa_settings(k: KappaConfig) -> KappaSettings:
    v = kappa_inputs.resolve(k)  # null keys take the `model.kappa.input` variant's values
    return KappaSettings(U=v.U, use_alpha=k.use_alpha, use_bias=k.use_bias,
                         logit_scale=v.logit_scale, tanh_gain=v.tanh_gain, backend=k.backend,
                         input=k.input, router_grad_scale=v.router_grad_scale)


def router_spec(moe: MoEConfig, kappa: KappaSettings | None):
    """The router class of `model.moe.router` (its entry in megatron_kappa.routers): κ experts
    (`kappa`, None for plain SwiGLU) need each pair's raw logit handed on with the probabilities."""
    return routers.lookup(moe.router).router(moe, kappa)


def experts_spec(grouped_gemm: bool, kappa: KappaSettings | None, fp8_experts: fp8.FP8Settings | None,
                 stock: MoESubmodules):
    """The experts: grouped GEMMs (FP8 or not) or megatron's per-expert loop, with κ-SwiGLU
    (`kappa`) or plain SwiGLU (None)."""
    if grouped_gemm:
        return partial(GroupedExperts, kappa=kappa, fp8=fp8_experts)
    if fp8_experts is not None:
        raise ValueError("fp8 experts need model.moe.grouped_gemm: true")
    if kappa is not None:
        return partial(KappaSequentialMLP, submodules=stock.experts.keywords["submodules"], kappa=kappa)
    return stock.experts


def moe_layer_spec(moe: MoEConfig, kappa: KappaSettings | None, fp8_experts: fp8.FP8Settings | None,
                   stock: MoESubmodules):
    """The MoE layer of `model.moe.router` (megatron_kappa.routers), with its router and experts
    (κ-SwiGLU with `kappa`, plain SwiGLU with None; FP8 grouped GEMMs with `fp8_experts`)."""
    layer = routers.lookup(moe.router).layer(moe, kappa is not None)
    experts = experts_spec(moe.grouped_gemm, kappa, fp8_experts, stock)
    return partial(layer, submodules=MoESubmodules(experts=experts, router=router_spec(moe, kappa),
                                                   shared_experts=stock.shared_experts))


def layer_specs(m: ModelConfig, precision: str, layout: ModelLayout, device="cpu", pipeline_stage: int | None = None,
                inputs: nanochat.BlockInputs | None = None, vp_stage: int = 0) -> TransformerBlockSubmodules:
    """Local (plain torch) specs per layer of model `m` in `precision` (of model layout `layout`:
    model_layout(cfg)) on `device` (of one pipeline stage and virtual stage, when given); the MoE
    layers' router, experts and layer class come from router_spec, experts_spec and
    moe_layer_spec. `inputs`: what the nanochat block's layers read (the model's BlockInputs)."""
    inputs = inputs or nanochat.BlockInputs()
    # the attention kind's stock layer (MLA: megatron's MLASelfAttention and its submodules)
    local = {"multi_latent_attention": False, **attention_kinds.of(m).local_spec}
    spec = partial(get_gpt_layer_local_spec, qk_layernorm=m.qk_layernorm, normalization="RMSNorm", **local)
    dense = _adapt_layer_spec(spec(num_experts=None), m, precision, device, dense=True, layout=layout, inputs=inputs)
    moe = None
    if layout.has_moe:
        moe = _adapt_layer_spec(spec(num_experts=m.moe.num_experts), m, precision, device, dense=False,
                                layout=layout, inputs=inputs)
        stock = moe.submodules.mlp.keywords["submodules"]  # MoESubmodules of megatron's local spec
        mlp = moe_layer_spec(m.moe, kappa_settings(m.kappa) if m.kappa.enabled else None,
                             fp8.settings(precision, m.fp8, device, "experts"), stock)
        moe = dataclasses.replace(moe, submodules=dataclasses.replace(moe.submodules, mlp=mlp))
    layers = [moe if is_moe else dense for is_moe in layout.moe_layers]
    if pipeline_stage is not None:  # this stage's layers only (megatron numbers them from its offset)
        start, stop = layout.stage_layers(pipeline_stage, vp_stage)
        layers = layers[start:stop]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=norm_spec(m))


def mtp_block_spec(m: ModelConfig, precision: str, tconfig, device, layout: ModelLayout, inputs,
                   vp_stage: int | None = None):
    """megatron's MTP block spec (model.mtp) for the last layer's kind, with our norms: megatron's
    local ones refuse sequence parallelism. None off the last stage (of its last virtual stage)."""
    spec = get_gpt_mtp_block_spec(tconfig, layer_specs(m, precision, layout, device, None, inputs),
                                  use_transformer_engine=False, vp_stage=vp_stage)
    if spec is None:  # not the last pipeline stage
        return None
    norm = norm_spec(m)
    layers = [dataclasses.replace(layer, submodules=dataclasses.replace(
        layer.submodules, enorm=norm, hnorm=norm, layer_norm=norm)) for layer in spec.layer_specs]
    return dataclasses.replace(spec, layer_specs=layers)


def build_model(cfg: Config, device: torch.device | str | None = None, meta: bool = False,
                layout: ModelLayout | None = None) -> GPTModel:
    """The GPT model of `cfg` on this rank, on `device` (the caller's: the trainer passes the one
    megatron_kappa.parallel.groups.init_distributed chose); megatron's parallel state must exist.

    meta=True builds shapes only (no memory, no initialisation), for counting parameters.
    layout: model_layout(cfg), when the caller has it already.
    """
    if device is None:
        if not meta:
            raise TypeError("build_model: give the device (the one init_distributed returned)")
        device = "cpu"
    layout = layout or model_layout(cfg)  # derived once, handed to every part of the build
    tconfig = transformer_config(cfg, device, layout)
    if meta:
        tconfig.perform_initialization = False
    if layout.vpp == 1:
        return _build_chunk(cfg, device, meta, layout, tconfig)
    # virtual stages: one chunk per virtual stage, built in order (their initialisation draws from
    # the same generators one after the other), seen as one module (model/virtual_stages.py)
    return VirtualStages([_build_chunk(cfg, device, meta, layout, tconfig, v) for v in range(layout.vpp)])


def _build_chunk(cfg: Config, device, meta: bool, layout: ModelLayout, tconfig, vp_stage: int | None = None):
    """One GPT model: this rank's pipeline stage, or its virtual stage `vp_stage` of them."""
    m = cfg.model
    with torch.device("meta") if meta else contextlib.nullcontext():
        # model.cross_entropy_chunk: the chunked loss inside the model; 0: megatron's own
        model_class = partial(ChunkedLossGPTModel, cross_entropy_chunk=m.cross_entropy_chunk)
        inputs = nanochat.BlockInputs()  # shared by the model and the layers of the nanochat block's parts
        if m.value_embeddings or m.embedding_norm or m.residual_scalars:
            model_class = partial(nanochat.NanochatGPTModel, cross_entropy_chunk=m.cross_entropy_chunk, inputs=inputs,
                                  embedding_norm=m.embedding_norm, norm_eps=m.norm_eps, carry_x0=m.residual_scalars)
        stage, stages = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
        if stages != cfg.parallel.pp:
            raise ValueError(f"build_model: parallel.pp={cfg.parallel.pp} but megatron's groups have {stages} stages")
        specs = layer_specs(m, cfg.precision, layout, device, stage if stages > 1 else None, inputs, vp_stage or 0)
        if m.mtp.num_layers:  # one layer of the model's last layer's kind per MTP depth, on the last stage
            model_class = partial(model_class, mtp_block_spec=mtp_block_spec(m, cfg.precision, tconfig, device, layout,
                                                                               inputs, vp_stage))
        model = model_class(
            config=tconfig,
            transformer_layer_spec=specs,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            vocab_size=layout.padded_vocab, max_sequence_length=cfg.model.seq_length,
            share_embeddings_and_output_weights=False, position_embedding_type="rope",
            rotary_base=cfg.model.rotary_base, **({} if vp_stage is None else {"vp_stage": vp_stage}),
        )
    if cfg.model.init == "nanochat" and model.post_process and not meta:
        init.init_output_layer(model, cfg.train.seed)
    if cfg.model.logit_softcap and model.post_process:
        softcap_logits(model.output_layer, cfg.model.logit_softcap)
    softmoe.link_budgets(model)  # the SoftMoE layers share one budget (no-op without them)
    if cfg.eval.capacity_factor is not None:  # the authors train at 1.0 and evaluate at 3.0
        install_capacity_switch(model, cfg.model.moe.capacity_factor, cfg.eval.capacity_factor)
    if not meta and torch.device(device).type == "cuda":
        # megatron creates the router weight on the CPU and moves it at the first forward; move
        # everything now, so the optimizer and the checkpoints see the model where it runs.
        model.to(device)
    return model
