"""A naive per-token reference of a (κ-)SwiGLU MoE layer, in float64, for the tests."""
import torch


def layer_weights(layer):
    """Router and expert weights of a megatron MoE layer (one process, EP = TP = 1), with either
    experts class (megatron's per-expert modules or grouped stacks)."""
    experts = layer.experts
    if hasattr(experts, "fc1_weight"):  # grouped: one stack per projection
        fc1, fc2 = list(experts.fc1_weight), list(experts.fc2_weight)
    else:
        fc1 = [e.linear_fc1.weight for e in experts.local_experts]
        fc2 = [e.linear_fc2.weight for e in experts.local_experts]
    return dict(
        router=layer.router.weight, fc1=fc1, fc2=fc2,
        alpha=getattr(experts, "kappa_alpha", None), bias=getattr(experts, "kappa_bias", None),
        expert_bias=getattr(layer.router, "expert_bias", None),
    )


def expert_grads(layer) -> dict:
    """Gradients under megatron's per-expert names, with either experts class."""
    out = {}
    for name, p in layer.named_parameters():
        if p.grad is None:
            continue
        stack = getattr(p, "expert_stack", None)
        if stack is None:
            out[name] = p.grad.clone()
        else:
            prefix = name.rsplit(".", 1)[0]
            out.update({f"{prefix}.local_experts.{i}.{stack}": g.clone() for i, g in enumerate(p.grad)})
    return out


def authors_normalized(top_k_scores, router_weight, top_k_indices, detach=True):
    """The authors' normalised κ input (askerlee/kappa-swiglu 02b8de3, nanochat/gpt.py
    MOELayer._select_gate_confidence, kappa_input 'top_logits', exponent 0.5, eps 1e-4), as written
    there; `detach=False` is the negative control (gradient through the normaliser)."""
    exponent, eps = 0.5, 1e-4
    d = (lambda t: t.detach()) if detach else (lambda t: t)
    magnitudes_all = torch.linalg.vector_norm(router_weight, ord=2, dim=-1)
    smoothed_all = torch.sqrt(magnitudes_all.square() + eps)
    scale_compensation = d(smoothed_all.pow(1.0 - exponent).mean())
    smoothed = torch.sqrt(magnitudes_all[top_k_indices].square() + eps)
    token_magnitude = router_weight.size(-1) ** 0.5
    normalizer = token_magnitude * d(smoothed.pow(exponent)) * scale_compensation
    return 6 * top_k_scores / normalizer


def authors_scale_grad(x, alpha):
    """The authors' scale_grad: x forward, gradient × alpha."""
    return x.detach() + alpha * (x - x.detach())


def naive_moe(x, w, *, topk, router="softmax", route_scale=1.0, U=3.0, logit_scale=1.0,
              tanh_gain=1.0, kappa=True, logit_perm=None, kappa_input="logit", router_grad_scale=1.0,
              detach_normalizer=True):
    """out[t] = Σ_{e ∈ topk(t)} p_e · W2_e (g σ(κ g) u), recomputing s = x·W_r[e] per token.

    `logit_perm` feeds each token the logits of another token (the negative control).
    kappa_input "normalized": κ gets the authors' normalised logit; router_grad_scale: the κ
    path's gradient into the logit is scaled (authors_scale_grad).
    """
    logits_all = x @ w["router"].T
    kappa_logits = logits_all if logit_perm is None else logits_all[logit_perm]
    if kappa_input == "normalized":
        every = torch.arange(logits_all.shape[1]).expand_as(kappa_logits)
        kappa_logits = authors_normalized(kappa_logits, w["router"], every, detach=detach_normalizer)
    kappa_logits = authors_scale_grad(kappa_logits, router_grad_scale)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        s = logits_all[t]
        if router == "softmax":
            top = torch.topk(s, topk).indices
            p = torch.softmax(s[top], dim=0)
        else:
            scores = torch.sigmoid(s)
            biased = scores + (0 if w["expert_bias"] is None else w["expert_bias"].to(scores))
            top = torch.topk(biased, topk).indices
            p = scores[top] / (scores[top].sum() + 1e-20)
        p = p * route_scale
        for e, pe in zip(top.tolist(), p):
            h = w["fc1"][e] @ x[t]
            g, u = h.chunk(2)
            if kappa:
                z = torch.zeros_like(g)
                if w["alpha"] is not None:
                    z = z + w["alpha"][e] * (logit_scale * kappa_logits[t, e])
                if w["bias"] is not None:
                    z = z + w["bias"][e]
                k = U ** torch.tanh(tanh_gain * z)
            else:
                k = 1.0
            out[t] = out[t] + pe * (w["fc2"][e] @ (g * torch.sigmoid(k * g) * u))
    return out
