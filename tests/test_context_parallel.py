"""Context parallelism (parallel.cp), the parts that run in one process: the attention split over
CP ranks (simulated as loop iterations, float64) equals full causal attention in its output and
its gradients; the batch split and RoPE positions follow megatron's load-balanced layout; what the
config refuses. The multi-process runs against one process: tests/test_context_parallel_runs.py."""
import pytest
import torch
import torch.nn.functional as F

from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.model.cp_attention import context_parallel_attention, rank_chunks
from tests.support.context_parallel_reference import sequence_positions

S, B, HEADS, D = 24, 2, 4, 8


def full_attention(q, k, v, scale, groups):
    """Causal attention over the whole sequence, the key/value heads repeated for GQA ([s, b, h, d])."""
    rep = q.shape[2] // groups
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    scores = scores.masked_fill(torch.triu(torch.ones(q.shape[0], q.shape[0], dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v)


def split_attention(q, k, v, cp, scale, groups, positions=sequence_positions):
    """Every CP rank's output (context_parallel_attention) put back in sequence order. The ranks run
    one after the other; the "gather" concatenates every rank's piece of the same leaf tensors, so
    autograd sums each K/V gradient over the ranks that read it, as the reduce-scatter does."""
    pieces = [positions(r, cp, q.shape[0]) for r in range(cp)]

    def gather(_, which):  # every rank's [its tokens] of key or value, in rank order
        return torch.cat([which[p] for p in pieces])

    out = torch.empty(q.shape[:3] + (v.shape[-1],), dtype=q.dtype)
    for rank in range(cp):
        mine = pieces[rank]
        kv = torch.cat([k, v], dim=-1)
        got = context_parallel_attention(q[mine], k[mine], v[mine], rank=rank, size=cp, scale=scale,
                                         gather=lambda t: gather(t, kv), enable_gqa=groups != q.shape[2])
        out = out.index_put((mine,), got)
    return out


def tensors(groups, dv=D, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(S, B, HEADS, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k = torch.randn(S, B, groups, D, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(S, B, groups, dv, generator=gen, dtype=torch.float64, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("groups,dv", [(HEADS, D), (2, D), (HEADS, 5)], ids=["mha", "gqa", "mla_widths"])
def test_split_attention_equals_full_causal_attention(cp, groups, dv):
    """Output and the q, k, v gradients of the CP split equal one causal attention over the whole
    sequence to float64 rounding (≤ 1e-12), for 2, 3 and 4 ranks, multi-head, grouped-query, and
    values of another width than the keys (MLA)."""
    scale = D ** -0.5
    q, k, v = tensors(groups, dv)
    want = full_attention(q, k, v, scale, groups)
    got = split_attention(q, k, v, cp, scale, groups)
    assert (got - want).abs().max() <= 1e-12
    weight = torch.randn(want.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    grads_want = torch.autograd.grad((want * weight).sum(), (q, k, v))
    grads_got = torch.autograd.grad((got * weight).sum(), (q, k, v))
    for a, b in zip(grads_want, grads_got):
        assert (a - b).abs().max() <= 1e-12 * a.abs().max()


def test_negative_controls_unbalanced_split_and_upper_left_mask():
    """The comparison above can fail: ranks holding contiguous halves (the unbalanced split) where
    the attention expects megatron's layout, and the causal mask aligned to the upper left (SDPA's
    is_causal with fewer queries than keys), each leave full attention by far more than rounding."""
    cp, scale = 2, D ** -0.5
    q, k, v = tensors(HEADS)
    want = full_attention(q, k, v, scale, HEADS)

    def contiguous(rank, size, seq):
        return torch.arange(rank * seq // size, (rank + 1) * seq // size)
    unbalanced = split_attention(q, k, v, cp, scale, HEADS, positions=contiguous)
    assert (unbalanced - want).abs().max() > 1e-2

    original = F.scaled_dot_product_attention

    def upper_left(q_, k_, v_, attn_mask=None, **kw):
        return original(q_, k_, v_, is_causal=True, **kw)
    try:
        F.scaled_dot_product_attention = upper_left
        wrong = split_attention(q, k, v, cp, scale, HEADS)
    finally:
        F.scaled_dot_product_attention = original
    assert (wrong - want).abs().max() > 1e-2


def test_rank_chunks_are_megatrons_layout():
    """Rank r holds chunks r and 2·CP−1−r (megatron's get_pos_emb_on_this_cp_rank, read from its
    source's index tensor), and the ranks' positions cover the sequence once."""
    assert [rank_chunks(r, 4) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert sequence_positions(1, 2, 8).tolist() == [2, 3, 4, 5]
    every = torch.cat([sequence_positions(r, 4, 32) for r in range(4)])
    assert sorted(every.tolist()) == list(range(32))


class FakeGroup:
    """What the layout functions ask of a process group: its size and this rank."""

    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


@pytest.mark.parametrize("cp", [2, 4])
def test_batch_split_rope_and_attention_agree_on_the_chunks(monkeypatch, cp):
    """megatron's batch split (get_batch_on_this_cp_rank, the trainer's) and the CPU twin of its
    RoPE split (compat: get_pos_emb_on_this_cp_rank without .cuda()) give each rank the positions
    the attention expects (sequence_positions). Negative control: the contiguous split differs."""
    import torch.distributed as dist
    from megatron.core.utils import get_batch_on_this_cp_rank

    from megatron_kappa.parallel import compat
    seq = 32
    positions = torch.arange(seq)
    for rank in range(cp):
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: cp)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
        batch = get_batch_on_this_cp_rank({"tokens": positions[None].clone()}, is_hybrid_cp=False, cp_group=object())
        rope = compat._pos_emb_on_this_cp_rank(positions[:, None].clone(), 0, FakeGroup(rank, cp))[:, 0]
        want = sequence_positions(rank, cp, seq)
        assert batch["tokens"][0].tolist() == rope.tolist() == want.tolist()
        assert positions.chunk(cp)[rank].tolist() != want.tolist()


def cfg_with(*overrides):
    return load_config("configs/tiny.yaml", list(overrides))


def test_config_refusals_are_one_line():
    """A sequence length not divisible by 2·CP, megatron's local attention, MTP, the SoftMoE router,
    the CORE subset during training: each one line naming the key. Controls: the same settings at
    CP 1, and MLA under CP (its RoPE and core attention split like gqa's)."""
    cases = {("model.seq_length=130",): ("config: parallel.cp:", "not divisible by 2 × cp = 4"),
             ("model.attention=local",): ("config: model.attention:", "must be sdpa"),
             ("model.mtp.num_layers=1",): ("config: model.mtp.num_layers:", "not supported"),
             ("model.moe.router=softmoe",): ("config: model.moe.router:", "not supported"),
             ("eval.core_every=10",): ("config: eval.core_every:", "evaluate the checkpoints afterwards")}
    for overrides, (start, words) in cases.items():
        with pytest.raises(ConfigError) as refused:
            cfg_with("parallel.cp=2", *overrides)
        message = str(refused.value)
        assert message.startswith(start) and words in message and "\n" not in message, message
        cfg_with("parallel.cp=1", *overrides)  # control: allowed without context parallelism
    from tests.support.settings import MLA
    assert cfg_with("parallel.cp=2", *MLA).parallel.cp == 2


def test_layout_counts_context_parallel_ranks():
    """The world must hold tp × pp × cp; the checkpoint's layout record names cp (absent at 1, so
    earlier checkpoints still match); the preflight's data-parallel size leaves the CP ranks out."""
    from megatron_kappa.config.world import check_world
    from megatron_kappa.parallel.layout import layout_record
    from megatron_kappa.preflight import check_parallel
    par = cfg_with("parallel.cp=2", "parallel.tp=2").parallel
    with pytest.raises(ConfigError, match=r"^config: parallel.cp: world size 6 is not divisible by tp × pp × cp"):
        check_world(par, 6)
    check_world(par, 8)
    assert layout_record(par, 4) == {"world": 4, "tp": 2, "ep": 1, "etp": 2, "cp": 2}
    assert "cp" not in layout_record(cfg_with().parallel, 4)
    # global batch 8 over micro-batches of 4: DP 2 (world 8 / (tp 2 × cp 2)) fits, DP 4 would not
    check_parallel(cfg_with("parallel.cp=2", "parallel.tp=2"), 8)
    with pytest.raises(ConfigError, match="micro_batch × data-parallel size = 4 × 4"):
        check_parallel(cfg_with("parallel.cp=2"), 8)


def test_observed_chunks_hold_every_allowed_logit_once():
    """What `observe` sees (QK-Clip's largest logits read it): over every rank and chunk, the
    allowed (query, key) logits are those of full causal attention, each once, so their per-head
    maximum and count equal the full sequence's. Negative control: the mask ignored lets later keys in."""
    cp, scale = 2, D ** -0.5
    q, k, v = tensors(HEADS)
    full = torch.einsum("sbhd,tbhd->bhst", q, k).detach() * scale
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    seen = {"max": torch.full((HEADS,), float("-inf"), dtype=torch.float64), "count": 0, "unmasked_max": None}

    def observe(q_, k_, mask):
        logits = (q_ @ k_.transpose(-1, -2)).detach() * scale  # [b, heads, chunk, keys]
        seen["max"] = torch.maximum(seen["max"], logits.masked_fill(~mask, float("-inf")).amax(dim=(0, 2, 3)))
        seen["count"] += int(mask.sum()) * q_.shape[0] * q_.shape[1]
        seen["unmasked_max"] = logits.amax(dim=(0, 2, 3)) if seen["unmasked_max"] is None else \
            torch.maximum(seen["unmasked_max"], logits.amax(dim=(0, 2, 3)))

    for rank in range(cp):
        mine = sequence_positions(rank, cp, S)
        every = torch.cat([torch.cat([k, v], -1)[sequence_positions(r, cp, S)] for r in range(cp)])
        context_parallel_attention(q[mine], k[mine], v[mine], rank=rank, size=cp, scale=scale,
                                   gather=lambda t, every=every: every, enable_gqa=False, observe=observe)
    want = full.masked_fill(~causal, float("-inf")).amax(dim=(0, 2, 3))
    assert (seen["max"] - want).abs().max() <= 1e-12 and seen["count"] == int(causal.sum()) * B * HEADS
    assert (seen["unmasked_max"] > want).any()  # the mask mattered: later keys hold larger logits
