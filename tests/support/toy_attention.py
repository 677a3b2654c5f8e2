"""An attention kind added at run time, as a user would register one (tests/test_attention_kinds.py,
tests/test_resume_check.py)."""
import dataclasses

from megatron.core.transformer.attention import SelfAttention

from megatron_kappa import attention_kinds

TOY = "toy_mha"


class CountingAttention(SelfAttention):
    """megatron's SelfAttention, counting its forwards."""
    forwards = 0

    def forward(self, *args, **kwargs):
        CountingAttention.forwards += 1
        return super().forward(*args, **kwargs)


def _toy_rules(model, par, need):
    need(model.num_query_groups is None, "model.num_query_groups", f"must be null with {TOY} (multi-head)")
    need(not model.value_embeddings, "model.value_embeddings", f"must be false with {TOY}")


def toy_kind() -> attention_kinds.Kind:
    """A plain multi-head attention with a bias on q, k and v (as Qwen2's): its megatron settings,
    its rules and its self-attention class; nothing for the planner or the export."""
    return attention_kinds.Kind(
        help=f"{TOY}: multi-head attention with a q/k/v bias",
        megatron=lambda model: dict(num_query_groups=None, kv_channels=model.head_dim, add_qkv_bias=True),
        attention=lambda spec, attention_fp8: dataclasses.replace(spec, module=CountingAttention),
        validate=_toy_rules)
