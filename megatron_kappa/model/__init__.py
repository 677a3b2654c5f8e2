"""The model: config → megatron-core TransformerConfig and layer specs → GPTModel.

Modules:
  attention.py         Core attention through `torch.nn.functional.scaled_dot_product_attention`
  attention_kinds/     The built-in attention kinds' pieces that need torch, one module per kind,
                       each handing its own to the attention registry
                       (megatron_kappa.attention_kinds.implement) when imported
  aux_loss.py          The router losses' gradient scale, in a form Dynamo traces (model.compile
                       compiles the routers)
  build.py             Config → megatron-core TransformerConfig + layer specs → GPTModel
  capacity.py          Expert capacity in training and in evaluation, as the authors run it
  compile.py           model.compile: each transformer layer compiled on its own, as torchtitan
                       compiles its blocks
  cp_attention.py      Context-parallel core attention (`parallel.cp`): each rank's queries against
                       the whole sequence's keys and values, all-gathered over the context-parallel
                       group
  deferred_wgrad.py    Grouped expert GEMMs whose weight gradient is computed later, when megatron's
                       overlapped schedule asks for it (`parallel.delay_wgrad_compute`: megatron-
                       core's `backward_dw`)
  embedding_copy.py    The last pipeline stage's copy of the input embedding (model.mtp with
                       parallel.pp > 1)
  experts.py           Routed experts: κ-SwiGLU's α, b and activation, megatron's SequentialMLP with
                       that activation, and grouped-GEMM experts (κ or plain SwiGLU) that replace
                       the per-expert loop
  fp8.py               FP8 GEMMs through torchao (`precision: fp8`, `model.fp8`)
  init.py              The authors' initialisation (model.init: nanochat; askerlee/kappa-swiglu
                       14c9b04 nanochat/gpt.py 2030-2120): megatron-core's init hooks take the
                       matrices (uniform, standard deviation 1/√d), the output projections (zero)
                       and the embedding (N(0, 1)); the output layer, which megatron initialises
                       with the matrices' method, is drawn again at N(0, 0.001) here
  lapsum.py            LapSum soft top-k: a differentiable relaxation of "pick the k largest of n
                       scores"
  layout.py            The model's shape decisions that need no torch: which layers are MoE, the
                       padded vocabulary, and where a pipeline stage's layers sit in the full model
  loss.py              The language-model loss, without the [tokens, vocab] logits in fp32 at once
  moe.py               κ-SwiGLU inside megatron-core's MoE layer, by subclassing (no forks)
  nanochat.py          The parts of the authors' nanochat block that megatron-core's GPT block
                       lacks, as subclasses its specs build (askerlee/kappa-swiglu 14c9b04
                       nanochat/gpt.py; docs/authors_model.md):
  norms.py             The norms of the layer spec: torch's RMSNorm, usable with sequence
                       parallelism
  params.py            Which parameters are which: one predicate per kind, by name
  routers/             The built-in routers' pieces that need torch, one module per router, each
                       handing its own to the router registry (megatron_kappa.routers.implement)
                       when imported
  softmoe.py           The SoftMoE router (arXiv 2606.17952, reconstructed: docs/softmoe.md): a
                       truncated LapSum soft top-k whose per-layer mean number of active experts k_l
                       is learned under a global budget
  softmoe_dispatch.py  Dispatching a variable number of experts per token (the SoftMoE router's
                       routing maps)
  sorted_dispatch.py   A token dispatcher with no host sync, for MoE layers whose experts all live
                       on this rank
  virtual_stages.py    A pipeline rank's model chunks (virtual stages, parallel.vpp > 1) seen as one
                       module
"""
