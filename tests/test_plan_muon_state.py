"""The planner's Muon/Aurora optimizer state (plan.state.muon_momentum_bytes, state_bytes' moments)
against what DeepSpeed 0.19.8's ZeRO optimizer holds after one step of tiny in one process: the
momentum buffer of each Muon group and the copy it stages that momentum in
(DeepSpeedZeroOptimizer._muon_pending_momentum), and AdamW's two moments of the other groups."""
import pytest
import torch

from megatron_kappa import plan as planner
from megatron_kappa.config import load_config
from megatron_kappa.parallel.groups import current_device
from megatron_kappa.plan.state import muon_momentum_bytes, reduced_bytes

BASE = ["data.mock=true", "model.seq_length=16", "train.micro_batch=2", "train.global_batch=4", "train.grad_clip=0",
        "train.warmup=1", "log.tensorboard=false"]
CASES = {  # name: overrides
    "muon fp32": ["train.optimizer=muon"],
    "aurora bf16 fp32-accumulation zero2": ["train.optimizer=aurora", "precision=bf16", "zero.stage=2"],
    "muon bf16 bf16-accumulation": ["train.optimizer=muon", "precision=bf16", "train.grad_accum_dtype=bf16"],
    "aurora alpha matrix routers matrix": ["train.optimizer=aurora", "model.kappa.alpha_optimizer=matrix",
                                           "train.router_optimizer=matrix"],
}


def held_after_one_step(cfg) -> dict:
    """Bytes of the ZeRO optimizer's state after one step: the Muon groups' momentum buffers, the
    staged copies, and every other state tensor (AdamW's moments)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    from megatron_kappa.model.build import build_model
    from megatron_kappa.optim import muon
    from megatron_kappa.optim import optimizer as optim
    from megatron_kappa.parallel import engine as ds_engine
    from megatron_kappa.train.loop import lm_loss
    torch.manual_seed(0)
    model = build_model(cfg, current_device())
    engine_settings = ds_engine.EngineSettings.of(cfg.train, cfg.zero, cfg.parallel, cfg.precision)
    engine, opt = ds_engine.initialize(model, optim.param_groups(model, cfg.train, cfg.model), engine_settings, 1,
                                       lambda groups: optim.build_optimizer(groups, cfg.train))
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 2048, (2, 17), generator=g)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, 16)}
    try:
        for _ in range(2):  # two micro-batches: one step
            engine.backward(lm_loss(engine, batch, torch.arange(16).expand(2, -1)))
            engine.step()
    finally:
        muon.uninstall()
    zero = engine.optimizer
    out = {"committed": 0, "staged": 0, "other": 0}
    for state in zero.optimizer.state.values():
        for key, t in state.items():
            if torch.is_tensor(t) and t.numel() > 1:
                out["committed" if key == "momentum_buffer" else "other"] += t.untyped_storage().nbytes()
    out["staged"] = sum(staged.untyped_storage().nbytes() for staged, _ in zero._muon_pending_momentum.values())
    return out


@pytest.mark.parametrize("name", CASES)
def test_muon_state_is_what_deepspeed_holds(world1, name):
    """One process (DP 1: every Muon group's partition is the group, no edges): the planner's Muon
    momentum equals DeepSpeed's momentum buffers, its staged copy the staged buffers (the same size
    and dtype: fp32 under fp32 accumulation and fp32 weights, bf16 with bf16 accumulation), and
    state_bytes' moments all of the optimizer's state, AdamW's moments included. Control: the
    count before the staged copy (one fp32 momentum of the Muon elements) misses what is held
    wherever the momentum is fp32."""
    cfg = load_config("configs/tiny.yaml", BASE + CASES[name])
    held = held_after_one_step(cfg)
    layout = planner.layout_of(cfg.parallel, 1)
    params = planner.stage_params(cfg, layout, 0)
    want = muon_momentum_bytes(params, cfg.model, cfg.train, cfg.precision, layout)
    assert held["committed"] > 0 and held["staged"] == held["committed"]
    assert want["committed"] == held["committed"] and want["staged"] == held["staged"], (want, held)
    moments = planner.state_bytes(params, cfg, layout)["moments"]
    assert moments == held["committed"] + held["staged"] + held["other"], (moments, held)
    # the control: the rule before the staged copy was counted, one fp32 momentum of the Muon elements,
    # misses what is held by the staged copy; with bf16 accumulation (a bf16 momentum and its bf16
    # copy) the two happen to agree
    elements = want["committed"] / reduced_bytes(cfg.precision, cfg.train.grad_accum_dtype)
    before = held["other"] + 4 * elements
    assert (before != moments) == (reduced_bytes(cfg.precision, cfg.train.grad_accum_dtype) == 4)
