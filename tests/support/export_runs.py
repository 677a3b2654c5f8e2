"""Trained runs and their Hugging Face exports, shared by tests/test_export.py and
tests/test_export_tools.py (each module trains the runs it uses once)."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_kappa.config import load_config
from tests.support.settings import MLA  # the tiny MLA settings

ROOT = Path(__file__).resolve().parents[2]

COMMON = ["model.seq_length=32", "train.micro_batch=2", "train.global_batch=4", "train.steps=1",
          "checkpoint.interval=1", "eval.valid_every=0", "log.tensorboard=false", "log.interval=1",
          "model.kappa.freeze_fraction=0", "data.mock=false"]
RUNS = {  # name: (model settings, layout settings, processes)
    "kappa-nanochat-sigmoid": (["model.block=nanochat", "model.moe.router=sigmoid",
                                "model.moe.shared_ffn_hidden_size=32",
                                "model.kappa.input=normalized", "model.kappa.u_warmup=0"], [], 1),
    "kappa-softmax-gqa": (["model.num_query_groups=2", "model.kappa.input=scaled", "model.kappa.u_warmup=0",
                           "model.moe.route_scale=1.5"], ["parallel.ep=2"], 2),
    "plain-softmax": (["model.kappa.enabled=false"], ["parallel.tp=2"], 2),
    "deepseek-v3-shaped": ([*MLA, "model.kappa.enabled=false", "model.moe.router=sigmoid", "model.moe.num_groups=2",
                            "model.moe.group_topk=1", "model.moe.route_scale=2.5",
                            "model.moe.shared_ffn_hidden_size=256",
                            "model.moe.seq_aux_loss=1e-4", "model.norm_eps=1e-6"], ["parallel.tp=2"], 2),
    "kappa-mla-grouped": ([*MLA, "model.moe.router=sigmoid", "model.moe.num_groups=2", "model.moe.group_topk=1",
                           "model.moe.shared_ffn_hidden_size=64"], ["parallel.ep=2"], 2),
    "mixtral-shaped": (["model.kappa.enabled=false", "model.qk_layernorm=false", "model.first_dense=0"],
                       ["parallel.pp=2"], 2),
}


def hf_env():
    from tests.support.processes import env
    return {**env(), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, sample_shards, world1):
    """Each RUNS entry trained one step from randomised weights (every part matters: the zero-
    initialised projections, κ's α and b, the gates and λ drawn at random), on the sample shards.
    The first request of a multi-process run trains every run of that process count in one
    launch (tests/support/training_worker.py: the imports dominate on CPU)."""
    from tests.support.pipeline_runs import launch
    made = {}

    def prepare(name):
        """The run's folder with its randomised initial weights, and its settings."""
        from megatron_kappa.model.build import build_model
        from tests.support.weights import randomize
        model_sets, layout_sets, _ = RUNS[name]
        folder = tmp_path_factory.mktemp(name)
        data = [f"data.paths=[{sample_shards['train'][0]}]", f"data.tokenizer={sample_shards['tokenizer']}"]
        sets = [*COMMON, *data, *model_sets]
        torch.manual_seed(0)
        model = build_model(load_config("configs/tiny.yaml", [*sets, "model.seq_length=32"]), "cpu")
        randomize(model)
        if "model.moe.router=sigmoid" in model_sets:  # ×4 saturates sigmoid scores at 1.0: exact ties, whose
            with torch.no_grad():                     # order two top-k implementations may break differently
                for key, p in model.named_parameters():
                    if key.endswith("router.weight"):
                        p.div_(4)
        torch.save({k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}, folder / "init.pt")
        return folder, [*sets, *layout_sets, f"train.init_weights={folder / 'init.pt'}", f"run.dir={folder / 'run'}"]

    def get(name):
        if name in made:
            return made[name]
        nproc = RUNS[name][2]
        if nproc == 1:
            folder, sets = prepare(name)
            done = subprocess.run([sys.executable, "launch/pretrain.py", "--config", "configs/tiny.yaml", "--set",
                                   *sets],
                                  cwd=ROOT, env=hf_env(), capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
            made[name] = folder / "run"
            return made[name]
        names = [n for n, (_, _, k) in RUNS.items() if k == nproc and n not in made]
        prepared = {n: prepare(n) for n in names}
        launch(tmp_path_factory.mktemp(f"export_runs{nproc}"), [{"overrides": sets} for _, sets in prepared.values()],
               nproc)
        made.update({n: folder / "run" for n, (folder, _) in prepared.items()})
        return made[name]
    return get


@pytest.fixture(scope="module")
def two_steps(world1, sample_shards, tmp_path_factory):
    """A one-process κ run of 2 steps with a checkpoint after each, on the sample shards (the
    steps' weights differ clearly: lr 3e-3 from the first step)."""
    from megatron_kappa.checkpoint.listing import CheckpointDir
    from megatron_kappa.train import loop
    folder = tmp_path_factory.mktemp("two_steps")
    sets = ["model.seq_length=32", "train.micro_batch=2", "train.global_batch=4", "train.steps=2",
            "checkpoint.interval=1", "checkpoint.keep=2", "eval.valid_every=0", "log.tensorboard=false",
            "model.kappa.freeze_fraction=0", "data.mock=false", "train.lr=3e-3", "train.warmup=0",
            f"data.paths=[{sample_shards['train'][0]}]", f"data.tokenizer={sample_shards['tokenizer']}",
            f"run.dir={folder / 'run'}"]
    loop.run(load_config("configs/tiny.yaml", sets), log=lambda *a: None)
    assert CheckpointDir(folder / "run").complete() == [1, 2]
    return folder / "run"


def export(run, out, *args):
    done = subprocess.run([sys.executable, "-m", "megatron_kappa.export", "--checkpoint", str(run), "--output",
                           str(out),
                           "--no-progress", *args], cwd=ROOT, env=hf_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def tokens(vocab, b=2, s=24, seed=5):
    return torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(seed))


def training_logits(run, ids):
    """The training model's logits (megatron-core, loaded by evaluation) on `ids`, float64."""
    from megatron_kappa.evaluation.loading import load_model
    model, cfg = load_model(run)
    with torch.no_grad():
        out = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
    return out[..., :cfg.model.vocab_size].double()


def hf_logits(folder, ids, **config_changes):
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
    for key, value in config_changes.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_pretrained(folder, config=config, trust_remote_code=True, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(ids).logits.double(), type(model).__name__


def close(got, want):
    return (got - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


