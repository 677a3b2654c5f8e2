"""Naive float64 references for megatron_kappa.metrics.paper_analyses: loops over experts, gate rows and
routed (token, expert) pairs, from a full (single-process layout) state dict."""
import numpy as np
import torch


def moe_layers(model):
    """(layer index, MoE layer) of every MoE layer of the model's decoder, by its name's
    `decoder.layers.<i>` (the MTP modules' layers left out)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    return [(int(name.split("decoder.layers.")[1].split(".")[0]), m) for name, m in model.named_modules()
            if isinstance(m, MoELayer) and "decoder.layers." in name]


def capture_routing(model):
    """Hook every MoE router with a copy of its input and routing map (the test's own record,
    independent of analysis.watch_routers); returns {layer index: [x, routing_map]}."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    seen = {}
    for name, m in model.named_modules():
        if isinstance(m, MoELayer):
            index = int(name.split("layers.")[1].split(".")[0])

            def hook(router, args, output, index=index):
                x = args[0].detach().reshape(-1, args[0].shape[-1]).double().clone()
                seen[index] = [x, output[1].detach().reshape(x.shape[0], -1).clone() != 0]
            m.router.register_forward_hook(hook)
    return seen


def _quantiles(values):
    low, high = np.quantile(np.asarray(values, dtype=np.float64), (0.05, 0.95))
    return float(low), float(high)


def _stats(prefix, values):
    low, high = _quantiles(values)
    return {f"{prefix}/mean": float(np.mean(values)), f"{prefix}/bottom5": low, f"{prefix}/top5": high}


def layer_reference(state, index, x, routed, *, topk, capacity_factor=None, logit_scale=1.0,
                    expert_shift=0):
    """Every analysis metric of MoE layer `index`. `expert_shift` pairs each expert with the
    router vector of expert e + shift (a negative control)."""
    pre = f"decoder.layers.{index}.mlp."
    r = state[pre + "router.weight"].double()
    num_experts = r.shape[0]
    gates = []
    for e in range(num_experts):
        fc1 = state[f"{pre}experts.local_experts.{e}.linear_fc1.weight"].double()
        gates.append(fc1[: fc1.shape[0] // 2])
    alpha, bias = state.get(pre + "experts.kappa_alpha"), state.get(pre + "experts.kappa_bias")
    alpha = None if alpha is None else alpha.double()
    bias = None if bias is None else bias.double()
    def vec(e):
        return r[(e + expert_shift) % num_experts]
    cos, proj = [], {}
    for e in range(num_experts):
        r_hat = vec(e) / vec(e).norm()
        proj[e] = []
        for j in range(gates[e].shape[0]):
            w = gates[e][j]
            cos.append(float(w @ r_hat / w.norm()))
            proj[e].append(float(w @ r_hat))
        proj[e] = torch.tensor(proj[e], dtype=torch.float64)
    out = {f"align/layer{index}/" + k.split("/")[-1]: v for k, v in _stats("x", cos).items()}
    token_cos, gate_bias, alpha_s, bias_abs = [], [], [], []
    counts = [0] * num_experts
    for t in range(x.shape[0]):
        for e in range(num_experts):
            if not routed[t, e]:
                continue
            counts[e] += 1
            s = float(x[t] @ vec(e))
            a = s / float(vec(e).norm())
            token_cos.append(a / float(x[t].norm()))
            gate_bias.extend((proj[e] * a).tolist())
            if alpha is not None:
                alpha_s.extend((alpha[e] * logit_scale * s).abs().tolist())
            if bias is not None:
                bias_abs.extend(bias[e].abs().tolist())
    out.update({f"token_cos/layer{index}/" + k.split("/")[-1]: v for k, v in _stats("x", token_cos).items()})
    out.update({f"gate_bias/layer{index}/" + k.split("/")[-1]: v for k, v in _stats("x", gate_bias).items()})
    for name, param, term in (("alpha", alpha, alpha_s), ("bias", bias, bias_abs)):
        if param is not None:
            positive = [v for v in param.reshape(-1).tolist() if v > 0]
            out[f"kappa/layer{index}/{name}_pos_mean"] = float(np.mean(positive)) if positive else 0.0
            out[f"kappa/layer{index}/{'alpha_s_abs' if name == 'alpha' else 'bias_routed_abs'}"] = float(np.mean(term))
    mean = sum(counts) / num_experts
    out[f"load/layer{index}/min"] = float(min(counts))
    out[f"load/layer{index}/max"] = float(max(counts))
    out[f"load/layer{index}/mean"] = mean
    out[f"load/layer{index}/cv"] = float(np.sqrt(np.mean([(c - mean) ** 2 for c in counts])) / mean)
    if capacity_factor is not None:
        wanted = topk * x.shape[0]
        out[f"load/layer{index}/dropped_frac"] = (wanted - sum(counts)) / wanted
    return out


def assert_close_stats(got: dict, ref: dict, rel=1e-5, abs_=1e-7, keys=None):
    keys = sorted(ref) if keys is None else keys
    missing = [k for k in keys if k not in got]
    assert not missing, f"missing metrics: {missing}"
    bad = {k: (got[k], ref[k]) for k in keys if abs(got[k] - ref[k]) > abs_ + rel * abs(ref[k])}
    assert not bad, bad


def max_rel_gap(got: dict, ref: dict) -> float:
    return max(abs(got[k] - ref[k]) / max(abs(ref[k]), 1e-12) for k in ref if k in got)
