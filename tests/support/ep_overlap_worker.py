"""Multi-process half of tests/test_ep_overlap.py: run under torchrun (2 ranks, EP2).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/support/ep_overlap_worker.py PLAN OUT

PLAN is a JSON list of cases; rank 0 writes {name: result} to OUT (torch.save). A case is
  {"name", "kind": "schedule", "overrides", "negative"}: one step's two micro-batches of the tiny
      model through megatron's schedule (get_forward_backward_func), as megatron_kappa.train
      .pipeline runs them; result: the micro-batches' losses, every parameter's gradient (this
      rank's shard, fp32) and the order of the expert events (`EventLog`);
  {"name", "kind": "train", "overrides", "negative"}: a whole `megatron_kappa.train.run` of
      configs/tiny.yaml; result: how often the combined 1F1B schedules ran (without stages: once a
      step; interleaved: once per combined forward-and-backward step) and how many weight
      gradients backward_dw computed (the run's metrics are in its run.dir).
negative "residual_grad_dropped": the overlapped schedule's split layer nodes pass zeros instead of
the gradients of the tensors they detach (the residual, the dispatched probabilities);
"force_schedule": (not a negative) the step goes through megatron's schedule without the overlap,
as with pipeline stages (ParallelConfig.megatron_schedule made true).
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: tests.support

from megatron_kappa.parallel import groups
from megatron_kappa.parallel.launch_env import exit_process
from tests.support import parity


class EventLog:
    """The expert events of the MoE layers, in the order they happen: ("dispatch", layer, mb) when a
    micro-batch's dispatch all-to-all is issued, ("expert_fwd", ...) its expert forward,
    ("expert_dgrad", ...) when its expert backward has made the experts' input gradient and
    ("expert_wgrad", ...) when fc1's weight gradient has been accumulated (the last of the
    experts' backward work). mb counts each layer's forward calls."""

    def __init__(self):
        self.events, self.forwards, self.wgrads, self.undo = [], {}, {}, []

    def install(self, model):
        from megatron.core.transformer.moe.moe_layer import MoELayer
        log = self
        dispatch, compute = MoELayer.dispatch, MoELayer.routed_experts_compute

        def logged_dispatch(layer, hidden_states, probs):
            mb = log.forwards[layer.layer_number] = log.forwards.get(layer.layer_number, -1) + 1
            log.events.append(("dispatch", layer.layer_number, mb))
            return dispatch(layer, hidden_states, probs)

        def logged_compute(layer, hidden_states, probs):
            mb = log.forwards[layer.layer_number]
            log.events.append(("expert_fwd", layer.layer_number, mb))
            if hidden_states.requires_grad:
                hidden_states.register_hook(lambda g: log.events.append(("expert_dgrad", layer.layer_number, mb)))
            return compute(layer, hidden_states, probs)

        MoELayer.dispatch, MoELayer.routed_experts_compute = logged_dispatch, logged_compute
        self.undo.append(lambda: (setattr(MoELayer, "dispatch", dispatch),
                                  setattr(MoELayer, "routed_experts_compute", compute)))
        for module in model.modules():
            if isinstance(module, MoELayer):
                weight = module.experts.fc1_weight
                number = module.layer_number

                def wgrad(param, number=number):
                    mb = log.wgrads[number] = log.wgrads.get(number, -1) + 1
                    log.events.append(("expert_wgrad", number, mb))
                self.undo.append(weight.register_post_accumulate_grad_hook(wgrad).remove)

    def remove(self):
        for undo in self.undo:
            undo()


def drop_detached_grads():
    """Negative control: the split layer nodes' backward passes zeros for their detached tensors."""
    from megatron.core.models.common.utils import TransformerLayerNode
    original = TransformerLayerNode.backward_impl

    def backward_impl(self, outputs, output_grad):
        grads = output_grad + tuple(torch.zeros_like(e) for e in self.detached)
        self.default_backward_func(outputs + self.before_detached, grads)
        return grads
    TransformerLayerNode.backward_impl = backward_impl
    return lambda: setattr(TransformerLayerNode, "backward_impl", original)


def counted(module, name, counter, key, size=lambda *a, **k: 1):
    """Wrap module.name so that each call adds size(*args) to counter[key]; returns the undo."""
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        counter[key] = counter.get(key, 0) + size(*args, **kwargs)
        return original(*args, **kwargs)
    setattr(module, name, wrapper)
    return lambda: setattr(module, name, original)


def schedule_case(case):
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_kappa.parallel.grads import install_tensor_parallel_grad_hooks
    from megatron_kappa.parallel.groups import init_distributed
    cfg = parity.make_cfg(ep=2, overrides=case["overrides"])
    init_distributed(cfg.parallel, seed=5, num_experts=cfg.model.moe.num_experts)
    model = parity.build(cfg)  # the same weights in every case (same seed, same layout)
    install_tensor_parallel_grad_hooks(model)
    log = EventLog()
    log.install(model)
    undo = drop_detached_grads() if case.get("negative") == "residual_grad_dropped" else (lambda: None)
    tokens = parity.global_batch()[0].chunk(2)[dist.get_rank()]  # this rank's 2 sequences: 2 micro-batches
    position = torch.arange(parity.SEQ).expand(1, -1)

    def forward_step(data_iterator, module, return_schedule_plan=False):  # as train/pipeline.py's
        t = next(data_iterator)
        run = module.build_schedule_plan if return_schedule_plan else module
        out = run(t[:, :-1], position, None, labels=t[:, 1:])
        return out, lambda per_token: (per_token.float().mean(), {"loss": per_token.float().mean().detach().clone()})
    micro = list(tokens.split(1))
    MoEAuxLossAutoScaler.main_loss_backward_scale = None  # a trainer case before left a [] one
    MoEAuxLossAutoScaler.set_loss_scale(torch.full((1,), 1.0 / len(micro)))
    try:
        results = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro), model=[model], num_microbatches=len(micro),
            seq_length=parity.SEQ, micro_batch_size=1, forward_only=False)
    finally:
        undo()
        log.remove()
    return {"losses": [r["loss"].item() for r in results], "events": log.events,
            "grads": {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}}


def train_case(case):
    from megatron.core.pipeline_parallel import schedules  # it imported the combined schedule by name

    from megatron_kappa.config import load_config
    from megatron_kappa.model import deferred_wgrad
    from megatron_kappa.train import loop
    calls = {}
    undo = [counted(schedules, "combined_1f1b_schedule_for_no_pipelining", calls, "combined_1f1b"),
            counted(schedules, "combined_1f1b_schedule_for_interleaved_pipelining", calls, "combined_1f1b_interleaved"),
            counted(deferred_wgrad.WgradQueue, "run", calls, "deferred_wgrads", lambda queue: len(queue.pending))]
    if case.get("negative") == "residual_grad_dropped":
        undo.append(drop_detached_grads())
    if case.get("negative") == "force_schedule":
        from megatron_kappa.config.schema import ParallelConfig
        scheduled = ParallelConfig.megatron_schedule
        ParallelConfig.megatron_schedule = property(lambda self: True)
        undo.append(lambda: setattr(ParallelConfig, "megatron_schedule", scheduled))
    try:
        loop.run(load_config("configs/tiny.yaml", case["overrides"]), log=lambda *a, **k: None)
    finally:
        for u in undo:
            u()
    return calls


def main(plan_path, out_path):
    out = {}
    for case in json.loads(Path(plan_path).read_text()):
        out[case["name"]] = (schedule_case if case["kind"] == "schedule" else train_case)(case)
    if dist.get_rank() == 0:
        torch.save(out, out_path)
    groups.teardown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    exit_process(0)
