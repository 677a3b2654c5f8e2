"""Config overrides of configs/tiny.yaml that several test files share."""
# the tiny MLA settings
MLA = ["model.attention_kind=mla", "model.mla.q_lora_rank=32", "model.mla.kv_lora_rank=16", "model.mla.qk_head_dim=16",
       "model.mla.qk_pos_emb_head_dim=8", "model.mla.v_head_dim=24"]
PLAIN = ["model.kappa.enabled=false"]


MODELS = {  # a model each target holds, with every optional part it can carry
    "kappa_moe": ["model.block=nanochat", "model.moe.router=sigmoid", "model.moe.shared_ffn_hidden_size=32",
                  "model.num_query_groups=2"],
    "qwen3_moe": PLAIN,
    "mixtral": [*PLAIN, "model.qk_layernorm=false", "model.first_dense=0"],
    "deepseek_v3": [*MLA, *PLAIN, "model.moe.router=sigmoid", "model.moe.num_groups=2", "model.moe.group_topk=1",
                    "model.moe.shared_ffn_hidden_size=256", "model.norm_eps=1e-6"],
}
