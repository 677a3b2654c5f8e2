"""The model: config → megatron-core TransformerConfig and layer specs → GPTModel.

build.py    the model from a config (specs, TransformerConfig, GPTModel)
layout.py   which layers are MoE, the padded vocabulary (no torch needed)
moe.py      the router and dispatchers that carry each pair's router logit to the experts
experts.py  κ-SwiGLU experts (α, b and the activation)
norms.py    the norms of the layer spec
params.py   which parameters are experts, κ, routers (one predicate each)
"""
