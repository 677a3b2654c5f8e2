"""The paper recipe trained by the project's own loop (megatron_kappa.train.loop.run: megatron-core,
DeepSpeed ZeRO-1, the project's Aurora and schedules) against 14c9b04's own training loop (its GPT,
optimizer and schedules, vendored unmodified: tests/support/authors_loop.py), in fp32 on the CPU, from the
same start weights and the same batches, step for step through the κ freeze, the unfreeze, U's
ramp, κ's learning-rate warm-up and decay, the aux-weight anneal and the main warm-down.

The bound is the authors' code's own disagreement: their loop run again from start weights
multiplied by 1 + 1e-7·N(0, 1) (two draws). At every step the project's loss may differ from
theirs by at most twice the largest loss difference those runs showed up to that step (plus 2
fp32 ulps of the loss), and every parameter tensor (relative Frobenius distance) likewise.

The model is configs/moe8.yaml's recipe at a tiny size (4 layers, layers 2-3 MoE with 4 experts
top-2, d 64, 4 heads, vocabulary 512, rows of 32, 2 micro-batches of 2 per step, 16 steps) with
the κ schedule compressed by its keys: freeze max(4, ⌈5 %·16⌉) = 4 steps, κ LR warm-up 4 steps, U
ramp ⌈15 %·16⌉ = 3 steps, aux anneal 6 steps (the authors' flags of the same names). The start
weights are the project's initialisation with the zero-initialised projections, the gates, the λ
and the output layer drawn at random, so that every part (experts, κ, value embeddings) acts on
the loss from the first step; κ's α and b start at 0 as in the paper. The learning rates are the
recipe's, × √(128 / 2¹⁹) for 128 tokens a step.
"""
import math
import subprocess
from pathlib import Path

import pytest
import torch

from megatron_kappa.config import load_config
from tests.support import authors_loop

STEPS, LAYERS, HEADS, D, VOCAB, SEQ = 16, 4, 4, 64, 512, 32
PROJECT = ["model.num_layers=4", "model.aspect_ratio=null", f"model.hidden_size={D}",
           f"model.num_attention_heads={HEADS}",
           "model.ffn_hidden_size=256", f"model.vocab_size={VOCAB}", f"model.seq_length={SEQ}",
           "model.moe.num_experts=4",
           "parallel.ep=1", "precision=fp32", "train.global_batch=4", "train.micro_batch=2", f"train.steps={STEPS}",
           "data.mock=true", "model.kappa.freeze_min_steps=4", "model.kappa.warmup=4",
           "model.moe.aux_loss_warmup_steps=6", "log.interval=1", "log.tensorboard=false",
           "checkpoint.interval=1000", "eval.valid_every=0"]
AUTHORS = ["--depth", "4", "--aspect-ratio", "16", "--head-dim", "16", "--max-seq-len", str(SEQ), "--n-exp", "4",
           "--use-kappa-swiglu", f"--num-iterations={STEPS}", "--device-batch-size", "2", "--total-batch-size", "128",
           "--kappa-delay-start-min-iterations", "4", "--kappa-lr-warmup-iterations", "4",
           "--aux-loss-weight-init-anneal-iterations", "6", "--loss-chunk-tokens", "4096"]
PERTURBATION = 1e-7


def test_the_vendored_files_are_14c9b04s():
    """Every vendored file is byte for byte the authors' at 14c9b04 (its git blob id); against the
    mirror too where this machine has it."""
    for path, blob in authors_loop.VENDORED.items():
        assert authors_loop.blob_id(authors_loop.VENDOR / path) == blob, path
    mirror = Path("/work/.mirror/askerlee+kappa-swiglu/repo")
    if mirror.exists():
        for path, blob in authors_loop.VENDORED.items():
            got = subprocess.run(["git", "-C", str(mirror), "rev-parse", f"{authors_loop.COMMIT}:{path}"],
                                 capture_output=True, text=True).stdout.strip()
            assert got == blob, path


def start_weights(model):
    """The project's initialisation, with what it starts at zero (output projections, gates, x0's
    λ) and λ_resid and the output layer drawn at random; κ's α and b stay 0."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("linear_proj.weight", "linear_fc2.weight", "fc2_weight")):
                p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
            elif name.endswith("value_gate"):
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
            elif name.endswith("resid_lambda"):
                p.copy_(1 + 0.1 * torch.randn(1, generator=gen))
            elif name.endswith("x0_lambda"):
                p.copy_(0.2 * torch.randn(1, generator=gen))
            elif name == "output_layer.weight":
                p.copy_(0.05 * torch.randn(p.shape, generator=gen))


def project_run(tmp: Path, init: Path, *sets) -> dict:
    """configs/moe8.yaml at the tiny size through the project's loop.run: the batches it read,
    and after every step its loss and parameters."""
    from megatron_kappa.train import loop
    cfg = load_config("configs/moe8.yaml", [*PROJECT, *sets, f"run.dir={tmp}", f"train.init_weights={init}"])
    batches, losses, params = [], [], []
    batch_at, train_step = loop.batch_at, loop.train_step

    def reading(*a, **k):
        batch = batch_at(*a, **k)
        batches.append({k: v.clone() for k, v in batch.items()})
        return batch

    def stepping(engine, model, *a, **k):
        out = train_step(engine, model, *a, **k)
        losses.append(out[0].item())
        params.append({n: p.detach().clone() for n, p in model.named_parameters()})
        return out

    loop.batch_at, loop.train_step = reading, stepping
    try:
        loop.run(cfg, log=lambda *a, **k: None)
    finally:
        loop.batch_at, loop.train_step = batch_at, train_step
    assert len(losses) == STEPS and all(b["loss_mask"].all() for b in batches)
    return {"batches": batches, "loss": losses,
            "params": [authors_loop.authors_weights(p, LAYERS, HEADS) for p in params]}


def authors_run(weights: dict, batches: list, perturb_seed=None) -> list[dict]:
    bt = authors_loop.build(AUTHORS, VOCAB)
    assert (bt.num_iterations, bt.grad_accum_steps, bt.kappa_bias_delay_start_iterations) == (STEPS, 2, 4)
    authors_loop.load_weights(bt.model, weights)
    if perturb_seed is not None:
        gen = torch.Generator().manual_seed(perturb_seed)
        with torch.no_grad():
            for p in bt.model.parameters():
                p.mul_(1 + PERTURBATION * torch.randn(p.shape, generator=gen))
    return authors_loop.train(bt, batches)


@pytest.fixture(scope="module")
def runs(world1, tmp_path_factory):
    from megatron_kappa.model.build import build_model
    tmp = tmp_path_factory.mktemp("authors_loop")
    cfg = load_config("configs/moe8.yaml", [*PROJECT, f"run.dir={tmp / 'init'}"])
    torch.manual_seed(0)
    model = build_model(cfg, "cpu")
    start_weights(model)
    torch.save(model.state_dict(), tmp / "init.pt")
    start = authors_loop.authors_weights({n: p.detach() for n, p in model.named_parameters()}, LAYERS, HEADS)
    project = project_run(tmp / "project", tmp / "init.pt")
    authors = authors_run(start, project["batches"])
    selves = [authors_run(start, project["batches"], seed) for seed in (1, 2)]
    return {"tmp": tmp, "start": start, "project": project, "authors": authors, "selves": selves}


def distance(params: dict, reference: dict) -> float:
    """The largest relative Frobenius distance over the tensors of `params` (0 where both are 0)."""
    worst = 0.0
    for name, value in params.items():
        ref = reference[name]
        diff = (value - ref).norm().item()
        worst = max(worst, 0.0 if diff == 0 else diff / max(ref.norm().item(), 1e-30))
    return worst


def levels(runs) -> list[tuple[float, float]]:
    """(loss, parameters) bound at each step: twice the largest disagreement of the authors' code
    with itself so far; the loss's plus 2 fp32 ulps of the loss, as their runs can round it alike."""
    authors, out, loss_level, param_level = runs["authors"], [], 0.0, 0.0
    for step, mine in enumerate(authors):
        for other in runs["selves"]:
            loss_level = max(loss_level, abs(other[step]["loss"] - mine["loss"]))
            param_level = max(param_level, distance(other[step]["params"], mine["params"]))
        ulp = torch.finfo(torch.float32).eps * 2.0 ** math.floor(math.log2(abs(mine["loss"])))
        out.append((2 * loss_level + 2 * ulp, 2 * param_level))
    return out


def misses(project: dict, runs) -> float:
    """How far outside the bound a project trajectory goes: the largest ratio of its distance to
    the authors' over the bound, over steps, loss and parameters (≤ 1: inside)."""
    worst = 0.0
    for step, ((loss_bound, param_bound), theirs) in enumerate(zip(levels(runs), runs["authors"])):
        worst = max(worst, abs(project["loss"][step] - theirs["loss"]) / loss_bound,
                    distance(project["params"][step], theirs["params"]) / max(param_bound, 1e-12))
    return worst


@pytest.mark.slow
def test_the_project_loop_follows_14c9b04s_loop_step_for_step(runs):
    project, authors = runs["project"], runs["authors"]
    bounds = levels(runs)
    for step, ((loss_bound, param_bound), theirs) in enumerate(zip(bounds, authors)):
        assert abs(project["loss"][step] - theirs["loss"]) <= loss_bound, step
        assert distance(project["params"][step], theirs["params"]) <= param_bound, step
    # the bound is the authors' rounding-level disagreement, not a loose one
    assert bounds[-1][0] < 1e-5 and bounds[-1][1] < 1e-4
    # and training moved: the loss and every tensor (the unused value-embedding gates aside)
    assert authors[0]["loss"] - min(a["loss"] for a in authors) > 0.1
    for name, value in runs["start"].items():
        assert not torch.equal(authors[-1]["params"][name], value), name


@pytest.mark.slow
def test_the_run_crosses_the_freeze_the_unfreeze_and_the_warmups(runs):
    """What the 16 steps go through, on both sides: α and b exactly 0 while frozen (steps 0-4:
    the κ LR is 0 up to the delay and at its first warm-up step, U is 1), U ramping 1 → 3 over
    steps 4-7, κ's LR warming up over 4 steps then decaying, and both moving after; the authors'
    logged ntp_loss is the cross-entropy plus 1e-5·Σz (docs/recipe.md)."""
    project, authors = runs["project"], runs["authors"]
    U = [a["U"] for a in authors]
    kappa_lr = [a["kappa_lr"] for a in authors]
    assert U[:5] == [1.0] * 5 and U[7:] == [3.0] * 9 and 1 < U[5] < U[6] < 3
    assert kappa_lr[:5] == [0.0] * 5 and kappa_lr[5] < kappa_lr[6] < kappa_lr[7] < kappa_lr[8]
    assert kappa_lr[8] > kappa_lr[15] > 0
    kappa = [n for n in authors[0]["params"] if "kappa" in n]
    assert len(kappa) == 4
    for step in range(STEPS):
        for side in (authors[step]["params"], project["params"][step]):
            moved = max(side[n].abs().max().item() for n in kappa)
            assert (moved == 0.0) == (step <= 4), step
    for a in authors:
        assert 0 < a["ntp_loss"] - a["loss"] < 1e-3


NEGATIVE = {
    "α in κ's AdamW group (the prose, 02b8de3)": ["model.kappa.alpha_optimizer=adamw"],
    "κ's AdamW restarted at the unfreeze": ["model.kappa.freeze_optimizer_state=drop"],
    "no freeze": ["model.kappa.freeze_min_steps=0", "model.kappa.freeze_fraction=0"],
    "aux weight 1e-3 for the κ arm (the prose)": ["model.moe.aux_loss=1e-3"],
}


@pytest.mark.slow
@pytest.mark.parametrize("what", list(NEGATIVE))
def test_each_setting_that_differs_from_14c9b04_misses_the_bound(runs, what):
    other = project_run(runs["tmp"] / what.split()[0], runs["tmp"] / "init.pt", *NEGATIVE[what])
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(other["batches"], runs["project"]["batches"]))
    assert misses(runs["project"], runs) <= 1
    assert misses(other, runs) > 10, what
