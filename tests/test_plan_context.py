"""The planner's context parallelism (plan.context) against the trainer's own all-gather attention
(megatron_kappa.model.cp_attention), run in one process on tiny's shapes: the values its gather and
the gather's backward (a reduce-scatter) move per layer, with and without the core attention
recomputed, and the bytes autograd keeps for backward beside what SDPA keeps without CP. The
shapes come from the config here (heads, groups, head widths), not from the planner."""
import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from megatron_kappa import plan as planner
from megatron_kappa.config import load_config
from megatron_kappa.model.cp_attention import context_parallel_attention
from megatron_kappa.plan import Layout, speed
from megatron_kappa.plan import context as plan_context
from megatron_kappa.plan.planned import Planned
from tests.support.settings import MLA  # the tiny MLA settings

CASES = {  # name: (cp, tp, extra config)
    "cp2": (2, 1, []), "cp4_gqa": (4, 1, ["model.num_query_groups=2"]), "cp2_tp2": (2, 2, []),
    "cp2_mla": (2, 1, MLA)}
LAYERS, MICRO = 4, 2  # tiny: 4 layers; global batch 8 of micro-batches of 4 on one replica


def tiny(extra, precision="fp32", recompute="none"):
    return load_config("configs/tiny.yaml", [f"precision={precision}", "train.global_batch=8", "train.micro_batch=4",
                                             f"model.recompute={recompute}", *extra])


def rank_tensors(cfg, cp: int, tp: int, dtype):
    """One CP rank's q [s/cp, b, heads/tp, dk], k [.., groups/tp, dk], v [.., groups/tp, dv] for
    one micro-batch of `cfg`, the widths read from the config."""
    m = cfg.model
    heads = m.num_attention_heads
    if m.attention_kind == "mla":
        groups, dk, dv = heads, m.mla.qk_head_dim + m.mla.qk_pos_emb_head_dim, m.mla.v_head_dim
    else:
        groups, dk = m.num_query_groups or heads, m.hidden_size // heads
        dv = dk
    s, b = m.seq_length // cp, cfg.train.micro_batch
    g = torch.Generator().manual_seed(0)

    def make(width, n):
        return torch.randn(s, b, n // tp, width, generator=g, dtype=dtype).requires_grad_()
    return make(dk, heads), make(dk, groups), make(dv, groups)


class RingGather(torch.autograd.Function):
    """One rank's all-gather over `cp` ranks (the other ranks' pieces: copies of this one) with its
    reduce-scatter backward, counting what a ring sends: cp − 1 shares forward, and (cp − 1)/cp of
    the gradient backward, one message a step."""

    @staticmethod
    def forward(ctx, t, cp, log):
        ctx.cp, ctx.log = cp, log
        log["values"] += (cp - 1) * t.numel()
        log["messages"] += cp - 1
        return torch.cat([t] * cp)

    @staticmethod
    def backward(ctx, grad):
        ctx.log["values"] += grad.numel() - grad.numel() // ctx.cp
        ctx.log["messages"] += ctx.cp - 1
        return grad[:grad.shape[0] // ctx.cp], None, None


def attention(q, k, v, cp, rank=0, log=None):
    log = log if log is not None else {"values": 0, "messages": 0}
    return context_parallel_attention(q, k, v, rank=rank, size=cp, scale=0.25, enable_gqa=q.shape[2] != k.shape[2],
                                      gather=lambda t: RingGather.apply(t, cp, log))


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_all_gather_traffic_is_what_the_trainers_gather_moves(name, recompute):
    """Per layer and micro-batch, the values (and messages) the trainer's attention sends through
    its gather and the gather's backward, with the core attention checkpointed as selective
    recompute does (backward gathers again: 3 exchanges instead of 2), equal the planner's
    context term (its bytes at a link of 1 byte/s; its messages at a 1 s latency). Controls: the
    ring's count (what the planner priced before) without recompute, and the count that forgets
    the recomputed core's second gather with it, miss the measurement."""
    cp, tp, extra = CASES[name]
    cfg = tiny(extra, recompute=recompute)
    log = {"values": 0, "messages": 0}
    q, k, v = rank_tensors(cfg, cp, tp, torch.float32)
    if recompute == "selective":  # megatron's core_attn module: a reentrant checkpoint of the core
        out = checkpoint(lambda *t: attention(*t, cp, log=log), q, k, v, use_reentrant=True)
    else:
        out = attention(q, k, v, cp, log=log)
    out.sum().backward()
    layout = Layout(cp * tp, tp=tp, cp=cp)
    params = [planner.stage_params(cfg, layout, 0)]

    def term(ring=False, **rates):
        return speed.step_time(cfg, layout, rates=speed.Rates(**rates), gpus_per_node=8, stage_params=params,
                               ring_attention=ring).terms["context"]
    values = term(latency_us=0, nvlink_gbs=1e-9) * 1 / speed.WIRE_BYTES  # 1 byte/s: the bytes, in values
    assert values / (LAYERS * MICRO) == pytest.approx(log["values"], rel=1e-12)
    messages = term(latency_us=1e6, nvlink_gbs=1e12) - term(latency_us=0, nvlink_gbs=1e12)
    assert messages / (LAYERS * MICRO) == pytest.approx(log["messages"], rel=1e-9)
    # controls: without recompute the ring's 3 (cp − 1) (what the planner priced before) is another
    # figure; with it, the count that leaves out the recomputed core's second gather
    if recompute == "none":
        other = term(ring=True, latency_us=0, nvlink_gbs=1e-9) / speed.WIRE_BYTES
    else:
        plain = tiny(extra)
        other = speed.step_time(plain, layout, rates=speed.Rates(latency_us=0, nvlink_gbs=1e-9), gpus_per_node=8,
                                stage_params=params).terms["context"] / speed.WIRE_BYTES
    assert other / (LAYERS * MICRO) != pytest.approx(log["values"])


def saved_bytes(fn, *tensors) -> int:
    """Bytes of the distinct storages autograd keeps for backward while `fn(*tensors)` runs."""
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*tensors)
    return sum(kept.values())


def plain_attention(q, k, v):
    """The trainer's attention without CP (model/attention.py): SDPA over the rank's tokens, causal."""
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.25, enable_gqa=q.shape[1] != k.shape[1])


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_all_gather_keeps_what_autograd_saves(name, precision):
    """What the trainer's CP attention keeps for backward (autograd's saved tensors, by storage) less
    what SDPA keeps over the same tokens without CP (q, k, v, output, log-sum-exp) is, per layer,
    the planner's: the gathered K and V of 2cp + 1 chunks and the chunks' masks, in the
    activations' dtype, less the rank's own K and V, for the first and the last rank alike; so a
    stage of tiny's 4 layers keeps 4 × that more than under the ring (one micro-batch in flight).
    Under selective recompute (core_attn: the checkpoint keeps its inputs) both keep the same.
    Controls: the K and V alone, without the masks, miss it; so does the ring's count (0)."""
    cp, tp, extra = CASES[name]
    cfg = tiny(extra, precision)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    size = {"fp32": 4, "bf16": 2}[precision]
    plain = saved_bytes(plain_attention, *rank_tensors(cfg, cp, tp, dtype))
    measured = {r: saved_bytes(lambda *t: attention(*t, cp, rank=r), *rank_tensors(cfg, cp, tp, dtype)) - plain
                for r in (0, cp - 1)}
    assert measured[0] == measured[cp - 1] > 0
    tokens = cfg.model.seq_length * cfg.train.micro_batch / cp
    assert plan_context.kept_values(cfg.model, tokens, tp, cp) * size == measured[0]
    layout = Layout(cp * tp, tp=tp, cp=cp)

    def act(recompute, ring=False):
        return planner.activation_bytes(cfg, layout, 0, recompute, cfg.train.micro_batch,
                                        planned=Planned(ring_attention=ring))
    assert act("none") - act("none", ring=True) == LAYERS * measured[0]
    assert plan_context.kept_values(cfg.model, tokens, tp, cp, ring=True) == 0 != measured[0]
    chunk = cfg.model.seq_length / (2 * cp)
    kv_only = measured[0] - (2 * cp + 1) * chunk ** 2 * size  # the masks left out
    assert kv_only != measured[0] and kv_only == pytest.approx(
        ((2 * cp + 1) / 2 - 1) * tokens * plan_context.kv_width(cfg.model, tp) * size)
    # selective recompute of the core attention: its reentrant checkpoint keeps q, k, v either way
    kept = [saved_bytes(lambda *t, f=f: checkpoint(f, *t, use_reentrant=True), *rank_tensors(cfg, cp, tp, dtype))
            for f in (plain_attention, lambda *t: attention(*t, cp))]
    assert kept[0] == kept[1]
    assert act("selective") == act("selective", ring=True)
