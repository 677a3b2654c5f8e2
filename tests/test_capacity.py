"""Expert capacity as the authors run it: factor 1.0 in training (tokens over capacity dropped),
3.0 in evaluation (megatron_kappa.model.capacity), against a naive count of megatron's rule."""
import math

import pytest
import torch

from megatron_kappa.config import load_config
from megatron_kappa.model.build import build_model
from megatron_kappa.parallel.groups import current_device

TOKENS = 48


def tiny(*sets):
    cfg = load_config("configs/tiny.yaml", ["model.seq_length=16", "model.moe.grouped_gemm=false", *sets])
    torch.manual_seed(0)
    return build_model(cfg, current_device())


def skewed_router(model):
    """The first MoE router, made to send nearly every token to experts 0 and 1."""
    layer = next(m for m in model.modules() if hasattr(m, "router") and hasattr(m.router, "config"))
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[0, 0] = 8.0
        layer.router.weight[1, 0] = 4.0
    return layer.router


def inputs():
    x = torch.randn(TOKENS, 1, 64, generator=torch.Generator().manual_seed(3))
    x[:, :, 0] = x[:, :, 0].abs() + 1.0  # positive along the skewed direction: experts 0, 1 win
    return x


def naive_kept(x, weight, topk, factor):
    """Megatron's rule by hand: top-k of the softmax per token; each expert keeps its
    ceil(T·k/E · factor) highest-probability tokens; returns kept (token, expert) pairs per expert."""
    logits = x.reshape(-1, x.shape[-1]).double() @ weight.double().T
    probs = torch.softmax(logits, dim=-1)
    T, E = probs.shape
    chosen = torch.topk(probs, topk, dim=-1).indices
    capacity = math.ceil(T * topk / E * factor) if factor is not None else T
    kept = []
    for e in range(E):
        mine = [(probs[t, e].item(), t) for t in range(T) if e in chosen[t].tolist()]
        kept.append(min(len(mine), capacity))
    return kept


def routed(router, x):
    _, routing_map = router(x)
    return routing_map.reshape(TOKENS, -1).sum(0).tolist()


def test_train_factor_drops_and_eval_factor_does_not(world1):
    model = tiny("model.moe.capacity_factor=1.0", "eval.capacity_factor=3.0")
    router, x = skewed_router(model), inputs()
    topk, weight = 2, router.weight.detach()
    model.train()
    with torch.no_grad():
        train_counts = routed(router, x)
    assert train_counts == naive_kept(x, weight, topk, 1.0)
    assert sum(train_counts) < TOKENS * topk  # tokens were dropped at factor 1.0
    model.eval()
    with torch.no_grad():
        eval_counts = routed(router, x)
    assert eval_counts == naive_kept(x, weight, topk, 3.0) == naive_kept(x, weight, topk, None)
    assert sum(eval_counts) == TOKENS * topk  # nothing dropped at 3.0 on this batch
    model.train()  # and back: the switch follows the mode both ways
    with torch.no_grad():
        assert routed(router, x) == train_counts


def test_without_an_eval_factor_evaluation_drops_like_training(world1):
    """Negative control: no eval.capacity_factor, so eval mode keeps the training factor."""
    model = tiny("model.moe.capacity_factor=1.0")
    router, x = skewed_router(model), inputs()
    model.eval()
    with torch.no_grad():
        assert routed(router, x) == naive_kept(x, router.weight.detach(), 2, 1.0)
        assert sum(routed(router, x)) < TOKENS * 2


@pytest.mark.parametrize("sets, key", [(["eval.capacity_factor=0"], "eval.capacity_factor"),
                                       (["model.moe.capacity_factor=-1"], "model.moe.capacity_factor"),
                                       (["eval.capacity_factor=3.0", "model.moe.dispatcher=sorted"],
                                        "eval.capacity_factor")])
def test_bad_capacity_settings_are_refused(sets, key):
    from megatron_kappa.config import ConfigError
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config("configs/tiny.yaml", sets)


def authors_kept(logits, topk, factor):
    """14c9b04 nanochat/gpt.py 560-600 and 679-687, re-stated over one device's tokens in the
    authors' order (batch row by batch row): top-k of the logits, capacity floor(k·f·T/E) made
    even and at least 4, ranks from a cumulative count over the top-1 slots of every token, then
    the top-2 slots; a slot is kept while its rank < capacity. Returns the kept (token, expert)
    mask [T, E] in the authors' token order, in float64 throughout."""
    T, E = logits.shape
    cap = math.floor(topk * factor * T / E)
    cap = max(cap + cap % 2, 4)
    top = logits.topk(topk, dim=-1).indices  # [T, k], slot 0 the largest
    kept = torch.zeros(T, E, dtype=torch.bool)
    used = [0] * E
    for slot in range(topk):
        for t in range(T):
            e = top[t, slot].item()
            if used[e] < cap:
                kept[t, e] = True
            used[e] += 1
    return kept


def varied_router(model):
    """The first MoE router with random weights leaning towards expert 0: experts fill unevenly,
    and a token's top-1 and another token's top-2 compete for the same expert."""
    layer = next(m for m in model.modules() if hasattr(m, "router") and hasattr(m.router, "config"))
    with torch.no_grad():
        layer.router.weight.copy_(torch.randn(layer.router.weight.shape, generator=torch.Generator().manual_seed(5)))
        layer.router.weight[0] += 0.3
    return layer.router


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_authors_capacity_and_drop_order(world1, factor):
    """The router with model.moe.capacity and drop_order authors keeps exactly the (token, expert)
    pairs 14c9b04's router keeps on the same logits. Negative controls: megatron's rule (its
    capacity, the lowest weights dropped) and the authors' order over megatron's token order
    (sequence-major) keep other pairs."""
    seq, batch = 12, 4
    sets = [f"model.moe.capacity_factor={factor}", "model.moe.capacity=authors", "model.moe.drop_order=authors"]
    router = varied_router(tiny(*sets))
    x = torch.randn(seq, batch, 64, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        _, routing_map = router(x)
        logits = (x.double() @ router.weight.double().T)  # [seq, batch, E]
    got = routing_map.reshape(seq, batch, -1).transpose(0, 1).reshape(seq * batch, -1)  # batch-major
    want = authors_kept(logits.transpose(0, 1).reshape(seq * batch, -1), 2, factor)
    assert torch.equal(got, want)
    assert want.sum() < seq * batch * 2  # tokens were dropped
    # the slot order mattered: some expert kept a later token's top-1 and dropped an earlier top-2
    top = logits.transpose(0, 1).reshape(seq * batch, -1).topk(2, dim=-1).indices
    assert any(want[t1, top[t1, 0]] and not want[t2, top[t2, 1]] and top[t1, 0] == top[t2, 1]
               for t1 in range(seq * batch) for t2 in range(t1))
    megatron = varied_router(tiny(f"model.moe.capacity_factor={factor}"))
    with torch.no_grad():
        _, megatron_map = megatron(x)
    assert not torch.equal(megatron_map.reshape(seq, batch, -1).transpose(0, 1).reshape(seq * batch, -1), want)
    sequence_major = authors_kept(logits.reshape(seq * batch, -1), 2, factor)
    assert not torch.equal(routing_map.reshape(seq * batch, -1), sequence_major)
