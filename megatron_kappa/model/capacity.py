"""Expert capacity in training and in evaluation, as the authors run it.

The authors train with capacity factor 1.0 (tokens over an expert's capacity are dropped: the
layer passes them on through the residual only) and evaluate with 3.0 (nanochat/gpt.py,
`get_capacity`: `train_capacity if self.training else eval_capacity`). megatron-core reads one
value, `config.moe_expert_capacity_factor`, in the router (which drops) and in the dispatcher
(which then sizes its buffers from the routing map). A forward pre-hook on every MoE router
sets that value from the router's own train/eval mode just before it routes, so `model.eval()`
alone switches to the evaluation factor, in validation, CORE and eval/*.py alike.

What stays megatron-core's: its capacity is ceil(T·k/E · factor) over a rank's T tokens and it
drops the lowest routing probabilities ("probs" policy); the authors' is floor(k·factor·T/E)
rounded up to even, at least 4, and fills each expert with top-1 choices first, then by position.
"""
from __future__ import annotations

from typing import Optional


def _set_factor(router, args):
    factor = router.train_capacity_factor if router.training else router.eval_capacity_factor
    router.config.moe_expert_capacity_factor = factor


def install_capacity_switch(model, train_factor: Optional[float], eval_factor: Optional[float]) -> int:
    """Hook every MoE router of `model` (returns how many). Nothing is installed when both factors
    are the same: the model's config already holds the training one."""
    if train_factor == eval_factor:
        return 0
    hooked = 0
    for module in model.modules():
        router = getattr(module, "router", None)
        if router is None or not hasattr(router, "config") or hasattr(router, "train_capacity_factor"):
            continue
        router.train_capacity_factor, router.eval_capacity_factor = train_factor, eval_factor
        router.register_forward_pre_hook(_set_factor)
        hooked += 1
    return hooked
