"""DeepSeek-V3's DualPipe as the planner models it (planned only: the trainer runs 1F1B or
interleaved 1F1B).

DualPipe (DeepSeek-V3 report §3.2.1, Table 2; github.com/deepseek-ai/DualPipe at 3da1bbe) feeds
micro-batches from both ends of the pipeline. The model is cut into p stages as for 1F1B, and rank
r holds two of them: stage r and its mirror p − 1 − r (examples/example_dualpipe.py:138), each run
for half of the step's micro-batches, one direction each. For rank r, with h = min(r, p − 1 − r):
  memory    both stages' parameters, gradients and optimizer state (the README's "2×" parameters
            per device); at the peak p − h micro-batches of stage h in flight and h + 1 of stage
            p − 1 − h, p + 1 in all (dualpipe.py's steps 1 to 4: 2 (p/2 − h − 1) + (h + 1) + 1
            forward chunks of one phase before its first backward, h + 1 of the other)
  compute   half the micro-batches through each of its two stages
  bubble    (p/2 − 1)(F&B + B − 3W) per step (Table 2), F a chunk's forward, B its full backward,
            W the weight-gradient half of it, F&B a forward and a backward overlapped (the sum of
            their compute, the traffic hidden): with B = 2F + R (R the recompute) and W = F, that
            is (p/2 − 1)(2F + 2R), where 1F1B idles (p − 1)(3F + R)
  mirror    the two copies of each stage are trained on different micro-batches: their gradients
            are summed between the mirror ranks every step (an all-reduce of both stages'
            gradients over 2 ranks, as examples/example_dualpipe.py:167-174 checks them), before
            ZeRO's reduce over data parallelism
It runs only where p is even, without virtual stages, with an even number of micro-batches per
step of at least 2p (dualpipe.py:332-333).
"""
from __future__ import annotations

from megatron_kappa.config import ConfigError
from megatron_kappa.plan.activations import activation_bytes
from megatron_kappa.plan.params import stage_params


def applies(planned, layout) -> bool:
    """Whether `layout` runs DualPipe under `planned` (a layout without stages has no schedule)."""
    return planned.dualpipe and layout.pp > 1


def check(layout, micro_batches: int):
    """A one-line error where DualPipe cannot run `layout` with `micro_batches` per step."""
    p = layout.pp
    if p % 2:
        raise ConfigError(f"plan: DualPipe needs an even number of pipeline stages, got {p} ({layout.label()})")
    if layout.vpp > 1:
        raise ConfigError(f"plan: DualPipe has no virtual stages, got {layout.vpp} ({layout.label()})")
    if micro_batches % 2 or micro_batches < 2 * p:
        raise ConfigError(f"plan: DualPipe needs an even number of micro-batches per step, at least 2 × PP = {2 * p}, "
                          f"got {micro_batches} ({layout.label()})")


def stages_of(pp: int, rank: int) -> tuple[int, int]:
    """The two stages pipeline rank `rank` holds: (h, p − 1 − h), h = min(rank, p − 1 − rank)."""
    h = min(rank, pp - 1 - rank)
    return h, pp - 1 - h


def in_flight(pp: int, rank: int) -> tuple[int, int]:
    """Micro-batches of each of `stages_of(pp, rank)` whose activations rank `rank` holds at its
    peak: p − h of stage h and h + 1 of its mirror."""
    h = min(rank, pp - 1 - rank)
    return pp - h, h + 1


def bubble(busy: float, pp: int, micro_batches: int, forward: float, recomputed: float) -> float:
    """Seconds idle per step: (p/2 − 1)(F&B + B − 3W) with F&B = F + B, B = 2F + R and W = F, in
    units of a chunk's busy time F + B = busy / micro_batches (`forward`: F's share of the rank's
    compute, `recomputed`: R's)."""
    if forward + recomputed <= 0:
        return 0.0
    chunk = busy / micro_batches
    return (pp / 2 - 1) * chunk * (2 * forward + 2 * recomputed) / (3 * forward + recomputed)


def rank_params(cfg, layout, rank: int) -> dict[str, int]:
    """Every parameter pipeline rank `rank` holds under DualPipe, by kind: its two stages'."""
    first, second = (stage_params(cfg, layout, s) for s in stages_of(layout.pp, rank))
    return {kind: n + second[kind] for kind, n in first.items()}


def rank_activations(cfg, layout, rank: int, recompute: str, micro_batch: int, *, imbalance: float,
                     planned) -> float:
    """The activations pipeline rank `rank` keeps at its peak under DualPipe (in_flight of each of
    its stages); with activation offload, two chunks of the larger stage, as under 1F1B."""
    one = [activation_bytes(cfg, layout, s, recompute, micro_batch, imbalance=imbalance, planned=planned, held=1)
           for s in stages_of(layout.pp, rank)]
    if planned.offload_activations:
        return 2 * max(one)
    first, second = in_flight(layout.pp, rank)
    return first * one[0] + second * one[1]


def ranks(per_stage: list[dict], layout, gpus_per_node: int, nvlink: float, ib: float, alpha: float,
          grad_bytes: int) -> list[dict]:
    """Each pipeline rank's terms under DualPipe from its two stages' (the module's docstring):
    half the micro-batches through each, so half of each stage's compute and traffic; both stages'
    ZeRO traffic, and the two copies' gradients summed with the mirror rank (an all-reduce over 2
    ranks: each sends its gradients once, `grad_bytes` a value: 4 where they are accumulated in
    fp32, 2 messages), on NVLink where the ranks of both stages, and those between, fit in one
    node."""
    p, apart = layout.pp, layout.tp * layout.cp * layout.dp  # ranks between neighbouring stages
    out = []
    for rank in range(p):
        h, mirror = stages_of(p, rank)
        a, b = per_stage[h], per_stage[mirror]
        row = {k: (a[k] + b[k]) / 2 for k in ("compute", "memory", "fixed", "tensor", "context", "expert",
                                              "pipeline", "forward", "recomputed")}
        one_node = h * apart // gpus_per_node == ((mirror + 1) * apart - 1) // gpus_per_node
        link = nvlink if one_node else ib
        row["data"] = a["data"] + b["data"] + grad_bytes * (a["params"] + b["params"]) / link + 2 * alpha
        row["layers"], row["params"] = a["layers"] + b["layers"], a["params"] + b["params"]
        out.append(row)
    return out
