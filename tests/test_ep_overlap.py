"""EP communication overlap (parallel.overlap_moe_expert_parallel_comm, parallel.delay_wgrad_compute):
megatron-core's combined 1F1B schedule with the κ experts and the alltoall dispatcher under EP2.

- the same losses and gradients as the plain schedule (one step, every parameter, ≤ 1e-5), with a
  negative control (the split nodes' detached gradients dropped);
- the schedule interleaves: a micro-batch's dispatch is issued before the previous micro-batch's
  expert backward has ended (the plain schedule, the control, finishes one before the next starts);
  with delay_wgrad_compute a layer's expert weight gradient waits for the next micro-batch's
  dispatch;
- the trainer runs it: 3 steps with the overlap match 3 steps without (losses, gradient norms,
  validation), the combined schedule and the deferred weight gradients counted as they run;
- the deferred weight gradient equals autograd's; what cannot run is refused in one line.
"""
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.model.deferred_wgrad import WgradQueue, deferred_gemm, grouped_gemm

ROOT = Path(__file__).resolve().parents[1]
OVERLAP = ["parallel.overlap_moe_expert_parallel_comm=true"]
DELAY = OVERLAP + ["parallel.delay_wgrad_compute=true"]
BASE = ["parallel.ep=2", "precision=bf16"]  # megatron-core runs the overlap in bf16 or fp16 only


# ---- configuration: what is refused, in one line each

REFUSED = [  # (overrides beyond BASE + OVERLAP, the key the line names)
    (["parallel.ep=1"], "parallel.overlap_moe_expert_parallel_comm"),
    (["model.moe.dispatcher=allgather"], "parallel.overlap_moe_expert_parallel_comm"),
    (["precision=fp32"], "parallel.overlap_moe_expert_parallel_comm"),
    (["parallel.pp=2"], "parallel.overlap_moe_expert_parallel_comm"),
    (["parallel.cp=2"], "parallel.overlap_moe_expert_parallel_comm"),
    (["model.recompute=full"], "model.recompute"),
    (["model.recompute=selective", "model.recompute_modules=[moe]"], "model.recompute"),
    (["model.moe.router=softmoe", "model.moe.capacity_factor=null"], "model.moe.router"),
    (["model.value_embeddings=true"], "model.value_embeddings"),
    (["model.mtp.num_layers=1"], "model.mtp.num_layers"),
    (["zero.stage=2"], "zero.stage"),
    (["parallel.delay_wgrad_compute=true", "model.moe.grouped_gemm=false"], "parallel.delay_wgrad_compute"),
    (["parallel.delay_wgrad_compute=true", "precision=fp8"], "parallel.delay_wgrad_compute"),
]


@pytest.mark.parametrize("extra,key", REFUSED)
def test_refused_in_one_line(extra, key):
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", BASE + OVERLAP + extra)
    assert str(e.value).startswith(f"config: {key}:") and "\n" not in str(e.value)


def test_delay_wgrad_alone_refused_and_accepted_settings_load():
    with pytest.raises(ConfigError, match="parallel.delay_wgrad_compute: needs parallel.overlap_moe"):
        load_config("configs/tiny.yaml", BASE + ["parallel.delay_wgrad_compute=true"])
    # controls: what the tests below run loads, and with stages and virtual stages too
    for extra in ([], ["parallel.delay_wgrad_compute=true"], ["parallel.pp=2", "parallel.vpp=2"],
                  ["precision=fp8", "model.fp8.experts=false", "parallel.delay_wgrad_compute=true"]):
        cfg = load_config("configs/tiny.yaml", BASE + OVERLAP + extra)
        assert cfg.parallel.megatron_schedule
    assert not load_config("configs/tiny.yaml", BASE).parallel.megatron_schedule


def test_record_stream_is_a_no_op_on_cpu():
    """megatron's overlapped schedule calls tensor.record_stream(stream); on the CPU the stream is
    compat's stand-in and the call does nothing (a torch call with another non-stream object
    raises: the stand-in, not torch, makes it work)."""
    from megatron_kappa.parallel import compat
    compat.apply("cpu")
    t = torch.ones(3)
    assert t.record_stream(torch.cuda.current_stream()) is None
    with pytest.raises((TypeError, RuntimeError)):
        t.record_stream(object())


# ---- the deferred weight gradient against autograd

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_deferred_wgrad_equals_autograd(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(13, 16, generator=gen).to(dtype)
    w = torch.randn(4, 24, 16, generator=gen).to(dtype)
    offs = torch.tensor([5, 5, 9, 13], dtype=torch.int32)  # expert 1 gets no rows
    dy = torch.randn(13, 24, generator=gen).to(dtype)

    ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    grouped_gemm(ref_x, ref_w, offs).backward(dy)

    x_, w_ = x.clone().requires_grad_(), torch.nn.Parameter(w.clone())
    fired = []
    w_.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad.clone()))
    queue = WgradQueue()
    out = deferred_gemm(x_, w_, offs, queue)
    assert torch.equal(out, grouped_gemm(x, w, offs))
    out.backward(dy)
    assert torch.equal(x_.grad, ref_x.grad)
    assert w_.grad is None and len(queue.pending) == 1 and not fired  # control: nothing yet
    queue.run()
    assert not queue.pending
    if dtype == torch.float64:  # autograd runs one GEMM per expert too, in another order of sums
        torch.testing.assert_close(w_.grad, ref_w.grad, rtol=1e-14, atol=1e-14)
    else:  # the grouped GEMM torch's own backward runs: the same bits
        assert torch.equal(w_.grad, ref_w.grad)
    assert len(fired) == 1  # through the weight's AccumulateGrad: its hooks (DeepSpeed's) run
    # a second backward accumulates, as autograd's would
    deferred_gemm(x_, w_, offs, queue).backward(dy)
    queue.run()
    torch.testing.assert_close(w_.grad, 2 * ref_w.grad, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=0)


def test_grouped_experts_refuse_an_unrun_queue(world1):
    """A backward whose weight gradients nobody computed is an error at the next forward, not a
    silently missing gradient."""
    from megatron_kappa.model.build import transformer_config
    from megatron_kappa.model.experts import GroupedExperts
    tconfig = copy.copy(transformer_config(load_config("configs/tiny.yaml", ["precision=bf16"])))
    tconfig.delay_wgrad_compute = True  # EP1 here: the flag set past megatron's EP check
    experts = GroupedExperts(2, tconfig, kappa=None)
    x = torch.randn(6, 64, dtype=torch.bfloat16, requires_grad=True)
    counts, probs = torch.tensor([4, 2]), torch.rand(6, dtype=torch.bfloat16)
    out, _ = experts(x, counts, probs)
    out.float().sum().backward()
    assert experts.fc1_weight.grad is None and experts.fc2_weight.grad is None
    with pytest.raises(RuntimeError, match="never computed"):
        experts(x, counts, probs)
    experts.backward_dw()
    assert experts.fc1_weight.grad is not None and experts.fc2_weight.grad is not None
    experts(x, counts, probs)  # the queue is empty again


# ---- two ranks (EP2): the schedule and the trainer

STEPS = 3
TRAIN = [f"train.steps={STEPS}", "data.mock=true", "log.interval=1", f"eval.valid_every={STEPS}", "eval.valid_iters=2",
         "model.seq_length=32", "train.micro_batch=2", "train.global_batch=8", "train.grad_clip=0.05",
         "model.kappa.freeze_fraction=0.0", "model.kappa.warmup=1", "model.moe.aux_loss=1e-2",
         "log.tensorboard=false", "checkpoint.interval=100"] + BASE


# κ's L2 penalty off in the strict comparison: without the overlap the trainer adds its gradient
# with each micro-batch's backward, through megatron's schedule once per step (as with pipeline
# stages), and in bf16 the two orders of summing α's and b's gradients round differently (measured:
# identical losses for 2 steps, 2e-5 apart at the 3rd). The penalty under the overlap is compared
# with the schedule without it ("sched_l2").
NO_L2 = ["model.kappa.l2_alpha=0", "model.kappa.l2_bias=0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep_overlap")
    plan = []
    for name, extra, negative in (("off", [], None), ("on", OVERLAP, None), ("delay", DELAY, None),
                                  ("broken", OVERLAP, "residual_grad_dropped")):
        plan.append({"name": f"schedule_{name}", "kind": "schedule", "overrides": ["precision=bf16"] + extra,
                     "negative": negative})
        plan.append({"name": f"train_{name}", "kind": "train", "negative": negative,
                     "overrides": TRAIN + NO_L2 + [f"run.dir={tmp / name}"] + extra})
    for name, extra, negative in (("on_l2", DELAY, None), ("sched_l2", [], "force_schedule")):
        plan.append({"name": f"train_{name}", "kind": "train", "negative": negative,
                     "overrides": TRAIN + [f"run.dir={tmp / name}"] + extra})
    (tmp / "plan.json").write_text(json.dumps(plan))
    from tests.support.processes import env, free_port
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           f"--master_port={free_port()}", "tests/support/ep_overlap_worker.py", str(tmp / "plan.json"),
                           str(tmp / "out.pt")], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp, torch.load(tmp / "out.pt", weights_only=False)


# TP2 without the overlap adds κ's L2 gradient per micro-batch, as above: the penalty off there
LAYOUTS4 = {"pp2_vpp2_ep2": ["parallel.pp=2", "parallel.vpp=2"], "tp2_ep2": ["parallel.tp=2"] + NO_L2}


@pytest.fixture(scope="module")
def runs4(tmp_path_factory):
    """Four ranks: PP2 × VPP2 × EP2 (megatron's interleaved combined schedule) and TP2 × EP2
    (sequence parallelism), each with and without the overlap."""
    tmp = tmp_path_factory.mktemp("ep_overlap4")
    plan = [{"name": f"train_{layout}_{name}", "kind": "train", "negative": None,
             "overrides": TRAIN + extra + [f"run.dir={tmp / layout / name}"] + flags}
            for layout, extra in LAYOUTS4.items() for name, flags in (("off", []), ("on", DELAY))]
    (tmp / "plan.json").write_text(json.dumps(plan))
    from tests.support.processes import env, free_port
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                           f"--master_port={free_port()}", "tests/support/ep_overlap_worker.py", str(tmp / "plan.json"),
                           str(tmp / "out.pt")], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return tmp, torch.load(tmp / "out.pt", weights_only=False)


def relative_gaps(a: dict, b: dict) -> dict:
    assert a.keys() == b.keys()
    return {n: ((a[n] - b[n]).abs().max() / a[n].abs().max().clamp_min(1e-30)).item() for n in a}


@pytest.mark.slow
def test_overlap_gives_the_plain_schedules_losses_and_gradients(runs):
    _, out = runs
    off = out["schedule_off"]
    assert len(off["grads"]) > 30  # every parameter of this rank, experts and κ's α, b included
    assert any("kappa_alpha" in n for n in off["grads"]) and any("experts" in n for n in off["grads"])
    for name in ("schedule_on", "schedule_delay"):
        assert max(abs(a - b) for a, b in zip(off["losses"], out[name]["losses"])) <= 1e-5
        assert max(relative_gaps(off["grads"], out[name]["grads"]).values()) <= 1e-5, name
    # negative control: the overlapped schedule without its detached tensors' gradients
    assert max(relative_gaps(off["grads"], out["schedule_broken"]["grads"]).values()) > 1e-2


def expert_events(events, kind, mb):
    return [i for i, e in enumerate(events) if e[0] == kind and e[2] == mb]


@pytest.mark.slow
def test_the_schedule_interleaves_micro_batches(runs):
    _, out = runs
    moe_layers = {2, 3, 4}  # tiny: 4 layers, the first dense
    for name in ("schedule_off", "schedule_on", "schedule_delay"):
        events = out[name]["events"]
        for kind in ("dispatch", "expert_fwd", "expert_dgrad", "expert_wgrad"):
            assert sorted((e[1], e[2]) for e in events if e[0] == kind) == \
                sorted((layer, mb) for layer in moe_layers for mb in (0, 1)), (name, kind)
    for name in ("schedule_on", "schedule_delay"):  # micro-batch 1's first dispatch, before 0's experts are done
        events = out[name]["events"]
        assert min(expert_events(events, "dispatch", 1)) < max(expert_events(events, "expert_dgrad", 0)), name
        assert min(expert_events(events, "dispatch", 1)) < max(expert_events(events, "expert_wgrad", 0)), name
    events = out["schedule_off"]["events"]  # control: the plain schedule finishes micro-batch 0 first
    assert min(expert_events(events, "dispatch", 1)) > max(expert_events(events, "expert_wgrad", 0))

    def deferred_past_a_dispatch(events):
        """The MoE layers whose micro-batch-0 expert weight gradient comes after micro-batch 1's
        dispatch that followed that layer's expert input gradient."""
        where = {(e[0], e[1], e[2]): i for i, e in enumerate(events)}
        return {layer for layer in moe_layers
                if any(e[0] == "dispatch" and e[2] == 1 for e in
                       events[where["expert_dgrad", layer, 0]:where["expert_wgrad", layer, 0]])}
    # megatron pairs forward layer i with backward layer n-1-i: micro-batch 0's backward of layer L
    # meets micro-batch 1's forward of layer 5-L, which dispatches where that layer is MoE
    assert deferred_past_a_dispatch(out["schedule_delay"]["events"]) == {2, 3}
    assert deferred_past_a_dispatch(out["schedule_on"]["events"]) == set()  # control: computed in backward


def records(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


TIMING = {"tokens_per_s", "tflops_per_gpu", "mfu", "mem_peak_rss_gib", "time", "elapsed_s"}


def largest_gap(a_dir, b_dir) -> tuple[float, str]:
    """The largest difference, relative to max(1, |value|), between two runs' logged numbers
    (losses, gradient norm, router and κ losses, κ, routing and load statistics, validation)."""
    a, b = records(a_dir), records(b_dir)
    assert len(a) == len(b) == STEPS and a[0].keys() == b[0].keys()
    gaps = [(abs(x[k] - y[k]) / max(1.0, abs(x[k])), f"step {x['step']} {k}") for x, y in zip(a, b)
            for k in x if k not in TIMING and isinstance(x[k], (int, float))]
    return max(gaps)


@pytest.mark.slow
def test_the_trainer_runs_the_overlap(runs):
    tmp, out = runs
    assert out["train_off"].get("combined_1f1b", 0) == 0 and out["train_sched_l2"].get("combined_1f1b", 0) == 0
    for name in ("on", "delay", "on_l2"):
        assert out[f"train_{name}"]["combined_1f1b"] == STEPS
    assert out["train_on"].get("deferred_wgrads", 0) == 0
    # each step: 2 micro-batches × 3 MoE layers × (fc1, fc2)
    assert out["train_delay"]["deferred_wgrads"] == out["train_on_l2"]["deferred_wgrads"] == STEPS * 2 * 3 * 2
    assert "valid_loss" in records(tmp / "off")[-1] and "kappa/layer1/alpha_abs" in records(tmp / "off")[-1]
    for a, b in (("off", "on"), ("off", "delay"), ("sched_l2", "on_l2")):
        gap, where = largest_gap(tmp / a, tmp / b)
        assert gap <= 1e-5, (a, b, gap, where)
    gap, where = largest_gap(tmp / "off", tmp / "broken")  # negative control
    assert gap > 1e-3, (gap, where)


@pytest.mark.slow
def test_the_overlap_with_stages_and_tensor_parallelism(runs4):
    """PP2 × VPP2 × EP2 runs megatron's interleaved combined schedule and TP2 × EP2 its combined
    schedule with sequence parallelism; each matches the same layout without the overlap (with
    stages both go through megatron's schedule, so κ's L2 penalty is added the same way)."""
    tmp, out = runs4
    assert out["train_pp2_vpp2_ep2_on"].get("combined_1f1b_interleaved", 0) > 0
    assert out["train_tp2_ep2_on"]["combined_1f1b"] == STEPS
    assert out["train_pp2_vpp2_ep2_on"]["deferred_wgrads"] > 0 and out["train_tp2_ep2_on"]["deferred_wgrads"] > 0
    for layout in LAYOUTS4:
        assert not out[f"train_{layout}_off"]
        gap, where = largest_gap(tmp / layout / "off", tmp / layout / "on")
        assert gap <= 1e-5, (layout, gap, where)



@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="with two GPUs the stage runs the bench")
def test_gpu_check_says_the_overlap_is_not_run_on_one_gpu(tmp_path):
    """`make gpu-check` on a machine with fewer than two GPUs records the EP-overlap stage as not
    run, with why, and its report says so (with --cpu it runs the bench: tests/test_gpu_check.py)."""
    from bench import gpu_check
    check = gpu_check.Check(tmp_path, cpu=False)
    gpu_check.ep_overlap(check, tmp_path, small=True)
    gpu_check.write_report(check, tmp_path)
    (stage,) = check.stages
    assert stage["name"] == "bench: EP overlap on/off" and "EP >= 2" in stage["not_run"]
    assert "| bench: EP overlap on/off | not run: " in (tmp_path / "report.md").read_text()
