"""The training step, its metrics and the evaluation on a device that is not the CPU, without a GPU.

tests/support/simulated_device.py runs the model's tensors on a simulated device that refuses CPU/device
mixing the way CUDA and NCCL do and records host syncs. Before this fix, these tests failed the
way the H200 run did: `batch_at` returned CPU batches ("aten.embedding: ... found at least two
devices"), `router_losses`, `kappa_stats` and `kappa_l2` built their accumulators on the CPU and
handed them to the collectives ("a CPU tensor handed to a collective"), and the evaluation
scorers sent CPU token batches to the model. The negative controls below reproduce each of those.
"""
import pytest
import torch
import torch.distributed as dist
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_kappa.config import load_config
from megatron_kappa.model.build import build_model
from megatron_kappa.parallel import groups
from megatron_kappa.train import loop
from megatron_kappa.train.data import batch_at, build_datasets
from tests.support.device_steps import STEPS, PlainEngine, fresh_process_caches, run_steps
from tests.support.simulated_device import SIM, DeviceMixup, SimulatedDevice, on_device


@pytest.fixture
def cfg(tmp_path):
    return load_config("configs/tiny.yaml", [f"run.dir={tmp_path}", "model.seq_length=32",
                                             "train.micro_batch=2", "train.global_batch=4",
                                             "model.moe.z_loss=1e-3", "eval.valid_iters=2"])


@pytest.fixture
def on_sim_then_cpu(world1):
    """init_distributed on the simulated device for the test, the CPU again afterwards."""
    yield
    groups._device = torch.device("cpu")
    fresh_process_caches()


@pytest.mark.slow
def test_train_step_metrics_and_evaluation_on_a_non_cpu_device(cfg, on_sim_then_cpu):
    groups.init_distributed(cfg.parallel, cfg.train.seed, cfg.model.moe.num_experts, device="cpu")
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in build_model(cfg, "cpu").state_dict().items()
             if not k.endswith("_extra_state")}
    # scaled_dot_product_attention picks its kernel by device type: the same (math) kernel on both
    # sides, so that the comparison can be exact.
    with sdpa_kernel(SDPBackend.MATH):
        on_cpu = run_steps(cfg, torch.device("cpu"), state)
        with SimulatedDevice() as sim:
            on_sim = run_steps(cfg, SIM, state, sim)
    # The same numbers on the other device: nothing was silently computed elsewhere.
    assert on_sim["losses"] == on_cpu["losses"] and len(on_cpu["losses"]) == STEPS
    assert on_sim["metrics"] == on_cpu["metrics"] and any(k.startswith("kappa/") for k in on_cpu["metrics"])
    assert on_sim["valid"] == on_cpu["valid"]
    assert on_sim["core"] == on_cpu["core"] and on_sim["bpb"] == on_cpu["bpb"]
    # A training step waits for the device nowhere in this project's code (megatron's dispatcher
    # reads the token counts; see docs/benchmarks.md).
    assert on_sim["step_syncs"] == [], on_sim["step_syncs"]


def test_negative_control_cpu_batches_are_refused(cfg, on_sim_then_cpu):
    with SimulatedDevice():
        groups.init_distributed(cfg.parallel, cfg.train.seed, cfg.model.moe.num_experts, device=SIM)
        model = on_device(build_model(cfg, SIM))
        train_ds, _ = build_datasets(cfg, 10, 2)
        batch = batch_at(train_ds, 0, 2)  # the CPU, as batch_at returned before this fix
        position_ids = torch.arange(cfg.model.seq_length, device=SIM).expand(2, -1)
        with pytest.raises(DeviceMixup, match="embedding"):
            loop.lm_loss(model, batch, position_ids)


def test_negative_control_cpu_accumulators_are_refused(on_sim_then_cpu):
    with SimulatedDevice():
        value = torch.ones((), device=SIM)
        totals = torch.zeros(2)  # router_losses' accumulator before this fix
        with pytest.raises(DeviceMixup):
            totals[0] += value
        with pytest.raises(DeviceMixup, match="collective"):
            dist.all_reduce(torch.zeros(2))  # kappa_stats' sums before this fix
        dist.all_reduce(torch.zeros(2, device=SIM))  # on the device: fine


def test_negative_control_host_reads_are_recorded(on_sim_then_cpu):
    with SimulatedDevice() as sim:
        x = torch.arange(4.0, device=SIM)
        x.sum().item()
        x.tolist()
        x[x > 1]  # boolean indexing: the output size depends on the data
    assert [s.kind for s in sim.syncs] == ["item", "tolist", "data-dependent shape"]
    assert all("test_device.py" in s.where for s in sim.syncs)


def test_sorted_dispatcher_step_has_no_host_sync(cfg, on_sim_then_cpu):
    """With every expert on one rank, `model.moe.dispatcher: sorted` keeps the token counts on the
    device: a training step reads nothing on the host, megatron's dispatcher copies included
    (plain experts: κ's torch backend reads the counts, the Triton one a GPU runs does not)."""
    sorted_cfg = load_config("configs/tiny.yaml", [f"run.dir={cfg.run.dir}", "model.seq_length=32",
                                                   "train.micro_batch=2", "train.global_batch=4",
                                                   "model.moe.dispatcher=sorted", "model.kappa.enabled=false"])
    with SimulatedDevice() as sim:
        groups.init_distributed(sorted_cfg.parallel, sorted_cfg.train.seed, 4, device=SIM)
        fresh_process_caches()
        model = on_device(build_model(sorted_cfg, SIM))
        engine = PlainEngine(model, loop.grad_accumulation(sorted_cfg.train))
        train_ds, _ = build_datasets(sorted_cfg, 20, 4)
        position_ids = torch.arange(32, device=SIM).expand(2, -1)
        MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(0.5, device=SIM))
        loop.train_step(engine, model, sorted_cfg, train_ds, 0, SIM, position_ids)  # warm-up
        before = len(sim.syncs)
        loss, _ = loop.train_step(engine, model, sorted_cfg, train_ds, 1, SIM, position_ids)
        assert sim.syncs[before:] == [], sim.syncs[before:]
    # Negative control: the same step with megatron's alltoall dispatcher reads the counts.
    alltoall = load_config("configs/tiny.yaml", [f"run.dir={cfg.run.dir}", "model.seq_length=32",
                                                 "train.micro_batch=2", "train.global_batch=4",
                                                 "model.kappa.enabled=false"])
    with SimulatedDevice() as sim:
        fresh_process_caches()
        model = on_device(build_model(alltoall, SIM))
        engine = PlainEngine(model, loop.grad_accumulation(alltoall.train))
        loop.train_step(engine, model, alltoall, train_ds, 1, SIM, position_ids)
        assert any(s.kind == "copy to host" for s in sim.syncs)
