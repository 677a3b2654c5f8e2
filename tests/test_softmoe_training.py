"""The SoftMoE router under TP / EP (+DP) against one process, on a simulated device, and in a
short training run.

Parity: as tests/test_parallel.py (the reference here, the parallel cases in one torchrun launch of
tests/support/parallel_worker.py on 4 processes, every case from the reference's weights), with the
softmoe router: variable experts per token (some tokens over the cap), non-uniform budgets (θ set
per layer), κ and plain experts, grouped and sequential, both dispatchers. Negative control: the
same weights with one layer's θ moved by 1e-2 (its budget by ~0.5 %) fail both comparisons.

Device: training steps and their metrics on tests/support/simulated_device.py's device equal the CPU's,
and a step reads nothing on the host in this project's code (megatron's dispatcher does).

Training: tiny on CPU under launch/pretrain.py; the per-layer budgets k_l move away from uniform
while their mean stays at the budget, and analysis/softmoe.py draws the allocation figure.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron_kappa.config import load_config
from megatron_kappa.model.build import build_model
from megatron_kappa.model.softmoe import softmoe_routers
from megatron_kappa.parallel import groups
from megatron_kappa.parallel.sharding import gather_full
from tests.support import device_steps, parity
from tests.support.compare import max_gap, max_rel_grad_error
from tests.support.simulated_device import SIM, SimulatedDevice

ROOT = Path(__file__).resolve().parents[1]
WORLD = 4
LAYOUTS = {"tp2": (2, 1, None), "ep2": (1, 2, None), "tp2ep2_etp1": (2, 2, 1)}  # DP = 4 / tp
SOFTMOE = ("model.moe.softmoe.temperature=1.0", "model.moe.softmoe.threshold=0.1",
           "model.moe.softmoe.max_experts=3", "model.moe.softmoe.budget=1.5")
THETA = (0.3, -0.2, 0.1)  # one per MoE layer of tiny: budgets 1.5·3·softmax(θ) ≈ (1.78, 1.08, 1.64)


def model_kw(kappa, dispatcher="alltoall", grouped=True):
    return dict(kappa=kappa, router="softmoe", dispatcher=dispatcher, grouped=grouped, overrides=SOFTMOE)


def cases():
    out = []
    for layout in ("ep2", "tp2"):
        for kappa in (True, False):
            out.append((f"{layout}-{'kappa' if kappa else 'swiglu'}-alltoall", layout, model_kw(kappa), None))
    for kappa in (True, False):
        name = "kappa" if kappa else "swiglu"
        out.append((f"tp2ep2_etp1-{name}-allgather", "tp2ep2_etp1", model_kw(kappa, "allgather"), None))
        out.append((f"ep2-{name}-alltoall-sequential", "ep2", model_kw(kappa, grouped=False), None))
    out.append(("ep2-kappa-alltoall-NEG-theta", "ep2", model_kw(True), "theta"))
    return out


CASES = cases()


def key_of(kw, layout):
    return (tuple(sorted((k, v) for k, v in kw.items())), WORLD // LAYOUTS[layout][0])


@pytest.fixture(scope="module")
def runs(world1, tmp_path_factory):
    from megatron_kappa.parallel.groups import init_distributed
    refs, plan, weights = {}, [], {}
    batch = parity.global_batch()
    for name, layout, kw, negative in CASES:
        key = key_of(kw, layout)
        if key not in refs:
            cfg = parity.make_cfg(**kw)
            init_distributed(cfg.parallel, seed=5)
            model = parity.build(cfg, dtype=parity.REFERENCE_DTYPE)
            parity.init_reference_weights(model)
            routers = softmoe_routers(model)
            with torch.no_grad():
                for (_, router), theta in zip(routers, THETA, strict=True):
                    router.budget_logit.fill_(theta)
            weights[key] = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
            losses, grads = parity.train(model, cfg, parity.split_for_reference(batch, key[1]))
            counts = torch.stack([r.pop_counts("cpu") for _, r in routers])  # [layers, E + 2]
            refs[key] = {"losses": losses, "grads": gather_full(model, grads), "counts": counts}
        w = weights[key]
        if negative == "theta":
            w = dict(w)
            name0 = next(k for k in w if k.endswith("router.budget_logit"))
            w[name0] = w[name0] + 1e-2
        tp, ep, etp = LAYOUTS[layout]
        plan.append(dict(name=name, layout=dict(tp=tp, ep=ep, etp=etp), model=kw, weights=w, negative=None,
                         dtype=parity.REFERENCE_DTYPE))
    results = parity.run_plan(plan, tmp_path_factory.mktemp("softmoe_parity"), WORLD)
    return {name: (refs[key_of(kw, layout)], results[name]) for name, layout, kw, _ in CASES}


@pytest.mark.parametrize("name", [c[0] for c in CASES if c[3] is None])
@pytest.mark.slow
def test_softmoe_parallel_layout_matches_single_process(runs, name):
    ref, got = runs[name]
    assert len(got["losses"]) == parity.STEPS >= 3
    assert max_gap(ref["losses"], got["losses"]) <= parity.LOSS_GAP, (ref["losses"], got["losses"])
    assert max_rel_grad_error(ref["grads"], got["grads"]) <= parity.GRAD_ERROR
    thetas = [k for k in ref["grads"] if k.endswith("router.budget_logit")]
    assert len(thetas) == 3 and all(ref["grads"][k].abs().max() > 0 for k in thetas)
    # The reference routed a variable number of experts per token and hit the cap (3 of 4).
    counts = ref["counts"]
    assert (counts[:, : 3 + 1] > 0).sum() >= 6 and counts[:, -1].sum() > 0, counts


@pytest.mark.slow
def test_softmoe_negative_control_breaks_parity(runs):
    ref, got = runs["ep2-kappa-alltoall-NEG-theta"]
    assert max_gap(ref["losses"], got["losses"]) > 1e-5
    assert max_rel_grad_error(ref["grads"], got["grads"]) > 1e-4


@pytest.fixture
def on_sim_then_cpu(world1):
    yield
    groups._device = torch.device("cpu")
    device_steps.fresh_process_caches()


@pytest.mark.slow
# the simulated device is torch's meta device: torch calls a state dict loaded onto it a no-op, though
# the simulated tensors take the values (the losses below equal the CPU's)
@pytest.mark.filterwarnings(r"ignore:for \S+. copying from a non-meta parameter in the checkpoint to a meta "
                            r"parameter:UserWarning:(torch\.nn|megatron\.core)")
def test_training_steps_on_a_simulated_device(tmp_path, on_sim_then_cpu):
    cfg = load_config("configs/tiny.yaml", [
        f"run.dir={tmp_path}", "model.seq_length=32", "train.micro_batch=2", "train.global_batch=4",
        "model.moe.z_loss=1e-3", "eval.valid_iters=2", "model.moe.router=softmoe", *SOFTMOE])
    groups.init_distributed(cfg.parallel, cfg.train.seed, cfg.model.moe.num_experts, device="cpu")
    torch.manual_seed(0)
    state = {k: v.clone() for k, v in build_model(cfg, "cpu").state_dict().items() if not k.endswith("_extra_state")}
    with sdpa_kernel(SDPBackend.MATH):
        on_cpu = device_steps.run_steps(cfg, torch.device("cpu"), state)
        with SimulatedDevice() as sim:
            on_sim = device_steps.run_steps(cfg, SIM, state, sim)
    assert on_sim["losses"] == on_cpu["losses"] and on_sim["metrics"] == on_cpu["metrics"]
    assert on_cpu["metrics"]["softmoe/k_mean"] == pytest.approx(1.5, rel=1e-6)
    assert on_sim["step_syncs"] == [], on_sim["step_syncs"]


@pytest.mark.slow
def test_budgets_move_while_their_mean_stays(tmp_path):
    """A short CPU run: k_l leave the uniform allocation, Σ_l k_l / L stays the budget, and the
    allocation figure is drawn from the finished run."""
    budget = 1.5
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1", "DS_ACCELERATOR": "cpu",
           "PYTHONPATH": str(ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    proc = subprocess.run(
        [sys.executable, "launch/pretrain.py", "--config", "configs/tiny.yaml", "--set",
         "model.moe.router=softmoe", f"model.moe.softmoe.budget={budget}", "model.moe.softmoe.max_experts=3",
         "train.steps=30", "log.interval=5", "eval.valid_every=0", "checkpoint.interval=100",
         "log.tensorboard=false", "model.seq_length=64", "train.lr_non_matrix=1e-2", f"run.dir={run_dir}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    layers = sorted({int(k.split("/")[1][5:]) for k in records[0] if k.startswith("softmoe/layer")})
    assert layers == [1, 2, 3]
    spread = []
    for r in records:
        ks = torch.tensor([r[f"softmoe/layer{i}/k"] for i in layers], dtype=torch.float64)
        assert abs(ks.mean().item() - budget) <= 1e-6 * budget, ks  # fp32 rounding of k only
        assert abs(r["softmoe/k_mean"] - budget) <= 1e-6 * budget
        spread.append((ks - budget).abs().max().item())
        for i in layers:
            hist = r[f"softmoe/layer{i}/active_hist"]
            assert len(hist) == 5 and abs(sum(hist) - 1) < 1e-4 and hist[4] == 0  # the cap: 3 experts
            assert 0 < r[f"softmoe/layer{i}/active_mean"] <= 3
    assert spread[-1] > 0.02 and spread[-1] > 2 * spread[0], spread  # away from uniform, and moving
    from megatron_kappa.analysis.softmoe import plot_allocation
    png = plot_allocation(run_dir)
    assert png == run_dir / "plots" / "softmoe.png" and png.stat().st_size > 10_000
