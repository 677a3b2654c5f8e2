"""DeepSeek-V3's routing details as keys (issue 36): group-limited top-k (model.moe.num_groups,
group_topk) and the sequence-wise balance loss (model.moe.seq_aux_loss) of the sigmoid router,
through megatron-core's router, against the rules written from DeepSeek-V3's report (arXiv
2412.19437 §2.1.2, §2.1.3) as plain loops; negative controls: without groups the choice leaves the
groups, and the loss of the batch as one sequence differs."""
import pytest
import torch

from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.model.build import build_model

E, K, GROUPS, GROUP_TOPK = 8, 4, 4, 2
SETS = ["model.moe.router=sigmoid", f"model.moe.num_experts={E}", f"model.moe.topk={K}", "model.moe.route_scale=2.5"]


def router_of(*sets):
    cfg = load_config("configs/tiny.yaml", [*SETS, *sets])
    torch.manual_seed(0)
    router = build_model(cfg, "cpu").decoder.layers[1].mlp.router
    with torch.no_grad():
        router.weight.mul_(20)  # scores spread over (0, 1): the groups' choice is not by ties
        router.expert_bias.copy_(torch.randn(E, generator=torch.Generator().manual_seed(2)) * 0.1)
    return router, cfg


def naive_choice(scores, bias):
    """Per token: the groups' scores (sum of each group's best K / GROUP_TOPK biased scores), the
    GROUP_TOPK best groups, then the K best biased scores among their experts; weights are the
    unbiased scores of those, normalised, × 2.5."""
    out = []
    per = E // GROUPS
    for s in scores.tolist():
        biased = [x + b for x, b in zip(s, bias.tolist())]
        group_score = [sum(sorted(biased[g * per:(g + 1) * per],
                                  reverse=True)[:K // GROUP_TOPK]) for g in range(GROUPS)]
        groups = sorted(range(GROUPS), key=lambda g: -group_score[g])[:GROUP_TOPK]
        allowed = [e for e in range(E) if e // per in groups]
        chosen = sorted(allowed, key=lambda e: -biased[e])[:K]
        total = sum(s[e] for e in chosen)
        out.append({e: 2.5 * s[e] / total for e in chosen})
    return out


def test_group_limited_routing_follows_deepseek_v3s_rule(world1):
    router, _ = router_of(f"model.moe.num_groups={GROUPS}", f"model.moe.group_topk={GROUP_TOPK}")
    x = torch.randn(64, 1, 64, generator=torch.Generator().manual_seed(1))
    router.eval()
    with torch.no_grad():
        probs, routing_map = router(x)
        probs = probs[..., 0] if probs.dim() == 3 else probs  # κ's router: (weight, logit) per pair
        scores = torch.sigmoid(x.reshape(-1, 64) @ router.weight.T)
    want = naive_choice(scores, router.expert_bias)
    for t, choice in enumerate(want):
        assert set(routing_map[t].nonzero().flatten().tolist()) == set(choice)
        for e, w in choice.items():
            assert abs(probs[t, e].item() - w) <= 1e-5
    # negative control: the same router without groups picks experts outside them for some tokens
    plain, _ = router_of()
    plain.load_state_dict(router.state_dict())
    plain.eval()
    with torch.no_grad():
        _, free_map = plain(x)
    assert (free_map != routing_map).any()


def naive_seq_aux_loss(scores, seqs):
    """DeepSeek-V3's sequence-wise balance loss (its eq. 17-20), averaged over the sequences: per
    sequence of T tokens, Σ_i f_i·P_i with f_i = E/(K·T)·#{t: s_i,t among the K largest s_·,t} (the
    affinities, without the routing bias) and P_i = mean_t s_i,t / Σ_j s_j,t."""
    chosen = [[int(x >= sorted(row, reverse=True)[K - 1]) for x in row] for row in scores]
    total = 0.0
    for seq in seqs:
        T = len(seq)
        f = [E / (K * T) * sum(chosen[t][i] for t in seq) for i in range(E)]
        p = [sum(scores[t][i] / sum(scores[t]) for t in seq) / T for i in range(E)]
        total += sum(fi * pi for fi, pi in zip(f, p))
    return total / len(seqs)


def test_sequence_wise_balance_loss_is_deepseek_v3s(world1):
    from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    router, _ = router_of("model.moe.seq_aux_loss=1e-3")
    router.train()
    S, B = 16, 3  # megatron's [sequence, batch] order: token t of sequence b is row t·B + b
    x = torch.randn(S, B, 64, generator=torch.Generator().manual_seed(3), requires_grad=True)
    router(x)
    got = get_moe_metrics_tracker().metrics["seq_load_balancing_loss"].values.sum().item()
    with torch.no_grad():
        scores = torch.sigmoid(x.reshape(-1, 64) @ router.weight.T).tolist()
    seqs = [[t * B + b for t in range(S)] for b in range(B)]
    want = naive_seq_aux_loss(scores, seqs)
    assert abs(got - want) <= 1e-5 * want, (got, want)
    # negative control: the batch taken as one sequence (megatron's aux_loss) is another number
    assert abs(naive_seq_aux_loss(scores, [sum(seqs, [])]) - want) > 1e-4 * want


def test_the_keys_refuse_what_does_not_add_up():
    for sets, key in ((["model.moe.num_groups=4"], "group_topk"),
                      (["model.moe.num_groups=3", "model.moe.group_topk=1"], "num_groups"),
                      (["model.moe.num_groups=4", "model.moe.group_topk=3"], "group_topk"),
                      (["model.moe.router=softmax", "model.moe.seq_aux_loss=1e-4"], "seq_aux_loss")):
        with pytest.raises(ConfigError, match=key):
            load_config("configs/tiny.yaml", [*SETS, *sets])
