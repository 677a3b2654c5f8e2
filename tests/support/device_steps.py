"""Training steps, metrics and evaluation on a given device, the simulated one included
(tests/test_device.py, tests/test_softmoe_training.py)."""
import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

from megatron_kappa.bench.toy import ByteTokenizer
from megatron_kappa.evaluation.core import evaluate_core, load_bundle
from megatron_kappa.evaluation.lm_loss import validation_loss
from megatron_kappa.evaluation.loading import logits_fn_for
from megatron_kappa.model.build import build_model
from megatron_kappa.parallel import groups
from megatron_kappa.train import loop
from megatron_kappa.train.data import build_datasets
from tests.support.simulated_device import SIM, on_device

BUNDLE = "tests/core_bundle"
STEPS = 3


class PlainEngine:
    """The part of DeepSpeed's engine the loop uses, over torch's AdamW (DeepSpeed itself would
    move the model to its own accelerator, which is the CPU here)."""

    def __init__(self, model, micro_batches: int):
        self.module, self.micro_batches, self.micro = model, micro_batches, 0
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss):
        (loss / self.micro_batches).backward()

    def step(self):  # DeepSpeed steps at the gradient-accumulation boundary only
        self.micro += 1
        if self.micro % self.micro_batches == 0:
            self.optimizer.step()
            self.optimizer.zero_grad()

    def get_global_grad_norm(self):
        return 0.0

    def train(self):
        self.module.train()

    def eval(self):
        self.module.eval()


def fresh_process_caches():
    """megatron's attention scratch buffer and MoE metrics tracker are process-wide caches that
    keep the device of their first use: made anew for the next device."""
    parallel_state.destroy_global_memory_buffer()
    parallel_state._set_global_memory_buffer()
    destroy_moe_metrics_tracker()


def run_steps(cfg, device, state, sim=None):
    """STEPS training steps from `state` on `device`; the losses, the logged metrics, the syncs the
    step itself caused, validation, and CORE and bits-per-byte of the trained model."""
    groups.init_distributed(cfg.parallel, cfg.train.seed, cfg.model.moe.num_experts, device=device)
    fresh_process_caches()
    model = build_model(cfg, device)
    if device == SIM:
        on_device(model)  # megatron leaves the router weight on the CPU until the first forward
    model.load_state_dict(state)
    engine = PlainEngine(model, loop.grad_accumulation(cfg.train))
    train_ds, valid_ds = build_datasets(cfg, 100, 10)
    position_ids = torch.arange(cfg.model.seq_length, device=device).expand(cfg.train.micro_batch, -1)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / loop.grad_accumulation(cfg.train), device=device))
    losses, step_syncs = [], []
    for step in range(STEPS):
        before = len(sim.syncs) if sim else 0
        loss, l2 = loop.train_step(engine, model, cfg, train_ds, step, device, position_ids)
        if sim:
            step_syncs += [s for s in sim.syncs[before:] if "megatron_kappa/" in s.where
                           and "parallel/compat.py" not in s.where]  # compat: megatron's own copies
        losses.append(loss)
    out = {"losses": [x.item() for x in losses], "step_syncs": step_syncs,
           "metrics": loop.step_metrics(engine, model, cfg, l2, device),
           "valid": loop.validate(engine, valid_ds, cfg, device, position_ids).item()}
    model.eval()
    logits_fn = logits_fn_for(model, cfg.model.vocab_size)
    tok = ByteTokenizer()
    core = evaluate_core(logits_fn, tok, load_bundle(BUNDLE), 32, max_per_task=4, progress=False)
    docs = [[5 + (i * 7 + j) % 250 for j in range(40)] + [tok.eod] for i in range(6)]
    out["core"] = [t["accuracy"] for t in core["tasks"]]
    out["bpb"] = validation_loss(logits_fn, docs, tok, 32)
    return out
