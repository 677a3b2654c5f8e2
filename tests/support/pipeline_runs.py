"""Multi-process runs of configs/tiny.yaml in one torchrun launch of tests/support/training_worker.py,
their pipeline layouts, and how a run in another layout is compared to the one-process run
(tests/test_pipeline.py, and the MTP, MLA, context-parallel, offload and resharding tests)."""
import json
import shutil
import subprocess
import sys

from tests.support.processes import ROOT, env, free_port
from tests.support.weights import save_init_weights

STEPS = 3
COMMON = [f"train.steps={STEPS}", "data.mock=true", "log.interval=1", f"eval.valid_every={STEPS}", "eval.valid_iters=4",
          "model.seq_length=32",
          "train.micro_batch=2", "train.global_batch=8", "train.grad_clip=0.05", "model.kappa.freeze_fraction=0.0",
          "model.kappa.warmup=1", "model.moe.aux_loss=1e-2", "log.tensorboard=false", "zero.stage=1",
          "checkpoint.interval=100"]


# validation: each DP rank takes every DP-th micro-batch, so DP2 with 2 iterations sees the 4 of DP1
LAYOUTS = {"pp2": (2, ["parallel.pp=2"]), "pp2_ep2": (4, ["parallel.pp=2", "parallel.ep=2", "eval.valid_iters=2"]),
           "pp2_dp2": (4, ["parallel.pp=2", "eval.valid_iters=2"]),
           # four stages: the middle ones hold neither the embedding nor the output layer, so
           # DeepSpeed's optimizer groups differ by stage (megatron_kappa.parallel.stage_norm)
           "pp4": (4, ["parallel.pp=4"]),
           # virtual stages with TP2 and sequence parallelism: the chunks' p2p tensors are s/TP long
           "pp2_vpp2_tp2": (4, ["parallel.pp=2", "parallel.vpp=2", "parallel.tp=2"])}


def launch(tmp_path, plan, nproc, check=True):
    (tmp_path / f"plan{nproc}.json").write_text(json.dumps(plan))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           f"--master_port={free_port()}", "tests/support/training_worker.py", str(tmp_path / f"plan{nproc}.json")]
    done = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1200)
    if not check:
        return done
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def resume_from_step_1(tmp, sets):
    """The PP2 run in tmp/pp2 resumed from its step-1 checkpoint in tmp/pp2-resumed; its log."""
    resumed = tmp / "pp2-resumed"
    shutil.copytree(tmp / "pp2", resumed)
    for step in range(2, STEPS + 1):
        shutil.rmtree(resumed / f"checkpoints/step_{step}")
    out = launch(tmp, [{"overrides": sets + ["parallel.pp=2", f"run.dir={resumed}"], "log": True}], 2)
    assert f"resumed from {resumed}/checkpoints/step_1" in out
    return resumed


def base_sets(tmp):
    init = save_init_weights(tmp / "init.pt", COMMON)
    return tmp, COMMON + [f"train.init_weights={init}"]


def assert_same_run(ref: list, got: list, name: str, keys=("loss",)):
    """A run in another layout against the one-process run's records: every step, the `keys` and
    the gradient norm ≤ 1e-5 (with clipping active in the reference), the validation loss."""
    assert [r["step"] for r in got] == list(range(1, STEPS + 1))
    for r, g in zip(ref, got):
        for key in keys:
            assert abs(r[key] - g[key]) <= 1e-5, (name, key, r[key], g[key])
        assert abs(r["grad_norm"] - g["grad_norm"]) <= 1e-5 * max(1.0, r["grad_norm"]), (name, r, g)
    assert all(r["grad_norm"] > 0.05 for r in ref)  # clipping was active: the norms decided the updates
    assert abs(ref[-1]["valid_loss"] - got[-1]["valid_loss"]) <= 1e-5, (name, ref[-1], got[-1])


# The nanochat block (model.block: nanochat) through two stages: x0 travels beside the hidden state
# and its gradient comes back; the value embeddings of stage 2's layers read the tokens there.
NANOCHAT = ["model.block=nanochat"]
def nanochat_sets(tmp):
    import torch
    init = save_init_weights(tmp / "init.pt", COMMON + NANOCHAT)
    state, gen = torch.load(init), torch.Generator().manual_seed(7)
    for name, value in state.items():  # the zero-initialised parts drawn, so that each has a gradient at step 1
        if not value.any():
            state[name] = torch.randn(value.shape, generator=gen) * 0.3
        if name.endswith("x0_lambda"):  # x0 weighs like the residual stream: its gradient path matters
            state[name] = torch.full_like(value, 1.5)
    torch.save(state, init)
    return tmp, COMMON + NANOCHAT + [f"train.init_weights={init}"]


def final_weights(run_dir):
    from megatron_kappa.checkpoint.store import Checkpoints
    from megatron_kappa.parallel.sharding import consolidate
    ckpts = Checkpoints(run_dir)
    full = consolidate([(f["coords"], f["weights"]) for f in ckpts.rank_files(ckpts.latest())])
    return {k: v.float() for k, v in full.items()}
