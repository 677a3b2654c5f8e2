"""The model: config → megatron-core TransformerConfig and layer specs → GPTModel.

build.py    the model from a config (specs, TransformerConfig, GPTModel)
layout.py   which layers are MoE, the padded vocabulary (no torch needed)
moe.py      the router and dispatchers that carry each pair's router logit to the experts
experts.py  κ-SwiGLU experts (α, b and the activation)
lapsum.py   the LapSum soft top-k (closed-form threshold and gradients)
softmoe.py  the SoftMoE router: truncated LapSum routing, learned per-layer budgets
softmoe_dispatch.py  dispatchers and the MoE layer for a variable number of experts per token
norms.py    the norms of the layer spec
params.py   which parameters are experts, κ, routers (one predicate each)
"""
