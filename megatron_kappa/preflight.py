"""Every check of a run's inputs that can run before process groups and the model exist.

`preflight(cfg)` runs in the first second of `launch/pretrain.py` — before torch.distributed,
megatron-core or DeepSpeed are imported and before anything is written — and stops a bad run with
a one-line ConfigError naming the key or file and what was expected. It checks what the config
alone cannot (megatron_kappa.config.validate does the rest): the world size the launcher gives
against the parallel layout and batch sizes, the precision against what is installed, the data
files (index magic, truncated shards, empty train/valid splits that would hang megatron-core's
dataset builder), documents that start with BOS for data.packing: bestfit, the tokenizer against
the vocabulary, the CORE bundle, the init weights, and a checkpoint to resume against the layout.
"""
from __future__ import annotations

import importlib.util
import os
import struct
from pathlib import Path

from megatron_kappa.checkpoint import resume
from megatron_kappa.checkpoint.listing import CheckpointDir
from megatron_kappa.config import (
    Config,
    ConfigError,
    DataConfig,
    EvalConfig,
    LogConfig,
    ModelConfig,
    ProfileConfig,
    RunConfig,
    stage_layout,
    to_dict,
)
from megatron_kappa.config.checks import fp8_capability_error
from megatron_kappa.config.world import check_batch, check_world, data_parallel
from megatron_kappa.data.blend import parse_blend, split_ranges
from megatron_kappa.data.bos import documents_start_with_bos
from megatron_kappa.data.indexed import largest_token_id, read_index
from megatron_kappa.parallel import launch_env
from megatron_kappa.parallel.layout import layout_record
from megatron_kappa.paths import folder_problem

# --- layout -------------------------------------------------------------------------------------

def world_size() -> int:
    """The number of processes the launcher (torchrun, deepspeed, srun) started; 1 for python."""
    env = launch_env.from_environment()
    return env["world_size"] if env else 1


def check_parallel(cfg: Config, world: int):
    from megatron_kappa.model.layout import model_layout

    check_world(cfg.parallel, world, model_layout(cfg).experts)
    dp = data_parallel(cfg.parallel, world)
    check_batch(cfg.train, dp)
    per_step = cfg.train.micro_batch * dp
    pp, vpp = cfg.parallel.pp, cfg.parallel.vpp
    empty = stage_layout.empty_entries(cfg.parallel.layout) if cfg.parallel.layout else []
    if empty:  # each stage's checkpoint and layer names count from its first decoder layer
        raise ConfigError(f"config: parallel.layout: {cfg.parallel.layout!r}: entry {empty[0]} holds no decoder layer "
                          "(t); megatron runs such stages, this trainer does not (python -m plan "
                          "plans them)")
    if vpp > 1:  # megatron's interleaved schedule runs the micro-batches in groups of pp per chunk
        micro = cfg.train.global_batch // per_step
        validations = (("eval.valid_iters", cfg.eval.valid_iters),) if cfg.eval.valid_every else ()
        for key, count in (("train.global_batch", micro), *validations):
            if count % pp:
                raise ConfigError(f"config: {key}: {count} micro-batches per rank, not a multiple of parallel.pp={pp} "
                                  f"(interleaved 1F1B with parallel.vpp={vpp} runs them in groups of pp)")


def check_attention(m: ModelConfig):
    if m.attention == "te" and importlib.util.find_spec("transformer_engine") is None:
        raise ConfigError("config: model.attention: te needs Transformer Engine, which is not installed "
                          "here (use sdpa)")


def check_precision(precision: str):
    """precision: fp8 needs torchao, and on CUDA a GPU of capability 9.0 or more (the widths and
    the experts' grouped GEMM are config checks: megatron_kappa.config.checks)."""
    if precision != "fp8":
        return
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError("config: precision: fp8 needs torchao, which is not installed here "
                          "(pip install -r requirements.txt, or use bf16)")
    import torch  # only here: the other checks need no torch

    if os.environ.get(launch_env.DEVICE_ENV) != "cpu" and torch.cuda.is_available():
        error = fp8_capability_error(torch.cuda.get_device_capability())
        if error:
            raise ConfigError(error)


# --- data ---------------------------------------------------------------------------------------

def check_vocabulary(key: str, prefix: str, vocab_size: int):
    """No token id of the shard reaches the model's vocabulary (shards made with a larger
    tokenizer), whatever data.tokenizer says."""
    top, how = largest_token_id(prefix)
    if top >= vocab_size:
        raise ConfigError(f"config: {key}: {prefix}: token ids up to {top} ({how}), but model.vocab_size is "
                          f"{vocab_size}: the shards were made with a larger tokenizer")


def check_shard(key: str, prefix: str, vocab_size: int | None = None) -> list[int]:
    """A shard's files exist, its index parses and its .bin is as long as the index says (and,
    given `vocab_size`, its token ids fit the model); returns its sequence lengths."""
    for ext in (".bin", ".idx"):
        if not os.path.isfile(prefix + ext):
            raise ConfigError(f"config: {key}: {prefix}{ext}: no such file")
    try:
        index = read_index(prefix + ".idx")
    except (ValueError, struct.error) as e:
        raise ConfigError(f"config: {key}: {prefix}.idx: {e}") from None
    lengths, expected = index.lengths.tolist(), index.bin_bytes
    size = os.path.getsize(prefix + ".bin")
    if size == 0:
        raise ConfigError(f"config: {key}: {prefix}.bin: empty file")
    if size < expected:
        raise ConfigError(f"config: {key}: {prefix}.bin: truncated ({size} bytes, the index expects {expected})")
    if vocab_size is not None:
        check_vocabulary(key, prefix, vocab_size)
    return lengths


def check_data(data: DataConfig, vocab_size: int):
    """Shard files (their token ids below model.vocab_size, `vocab_size`), and splits that
    megatron-core can build (an empty split makes its dataset builder loop forever)."""
    if data.mock:
        return
    prefixes, _ = parse_blend(data.paths)
    if not prefixes:
        raise ConfigError("config: data.paths: empty (give shard prefixes, or set data.mock: true)")
    valid_prefixes, _ = parse_blend(data.valid_paths, "data.valid_paths")
    for prefix in valid_prefixes:
        if not sum(check_shard("data.valid_paths", prefix, vocab_size)):
            raise ConfigError(f"config: data.valid_paths: {prefix}: no tokens")
    for prefix in prefixes:
        lengths = check_shard("data.paths", prefix, vocab_size)
        if valid_prefixes:
            if not sum(lengths):
                raise ConfigError(f"config: data.paths: {prefix}: no tokens")
            continue
        ranges = split_ranges(data.split, len(lengths))
        for name, rng in zip(("train", "valid"), ranges[:2]):
            tokens = 0 if rng is None else sum(lengths[rng[0]:rng[1]])
            if not tokens:
                counts = ", ".join(f"{n} {0 if r is None else r[1] - r[0]}" for n, r in
                                   zip(("train", "valid", "test"), ranges))
                raise ConfigError(
                    f"config: data.split: '{data.split}' leaves the {name} split of {prefix} empty "
                    f"({len(lengths)} documents: {counts}); give that split a larger share (e.g. "
                    f"data.split=90,10,0) or set data.valid_paths to held-out shards")


def check_packing(data: DataConfig):
    """data.packing: bestfit starts every row at a document's BOS and drops its EOD: the
    documents must start with BOS (data.bos, else the data prep manifest) and the tokenizer
    must say which ids those are. The dataset checks every document it packs as well."""
    if data.packing != "bestfit" or data.mock:  # mock data: megatron's synthetic rows
        return
    if not data.tokenizer:
        raise ConfigError("config: data.packing: bestfit needs data.tokenizer (its BOS and EOD ids)")
    if not documents_start_with_bos(data):
        why = "data.bos is false" if data.bos is False else \
            "no data prep manifest.json beside data.paths says \"bos\": true (set data.bos: true if they do)"
        raise ConfigError(f"config: data.packing: bestfit needs documents that start with BOS; {why}; "
                          "or use data.packing: concat")


def check_tokenizer(data: DataConfig, vocab_size: int):
    """data.tokenizer is a SentencePiece model whose vocabulary fits model.vocab_size (`vocab_size`),
    and the one that made the shards."""
    if not data.tokenizer:
        return
    if not os.path.isfile(data.tokenizer):
        raise ConfigError(f"config: data.tokenizer: {data.tokenizer}: no such file")
    from megatron_kappa.tokenizer import Tokenizer

    try:
        vocab = Tokenizer(data.tokenizer).vocab_size
    except (RuntimeError, ValueError, OSError) as e:
        raise ConfigError(f"config: data.tokenizer: {data.tokenizer}: not a SentencePiece model "
                          f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
    if vocab > vocab_size:
        raise ConfigError(f"config: model.vocab_size: {vocab_size} is smaller than the "
                          f"tokenizer's {vocab} ({data.tokenizer})")
    check_tokenizer_made_the_shards(data)


def check_tokenizer_made_the_shards(data: DataConfig):
    """The data prep manifest.json beside each shard prefix records the sha256 of the tokenizer
    that made its token ids; another tokenizer would train on ids it does not mean (and CORE and
    export would decode them with it). Evaluation, export and the study make the same check
    (megatron_kappa.data.made_with)."""
    from megatron_kappa.data.made_with import check_run_shards
    check_run_shards(data.tokenizer, data, "config: data.tokenizer")


# --- evaluation, init weights, resume -----------------------------------------------------------

def check_eval(ev: EvalConfig, data: DataConfig):
    """The quick CORE subset (eval.core_every) has its bundle and the tokenizer."""
    if not ev.core_every:
        return
    if not ev.core_bundle or not data.tokenizer:
        raise ConfigError("config: eval.core_every: needs eval.core_bundle and data.tokenizer")
    from megatron_kappa.evaluation.bundle import BundleError, load_bundle

    try:
        load_bundle(ev.core_bundle)
    except BundleError as e:
        raise ConfigError(f"config: eval.core_bundle: {e}") from None


def check_resume(cfg: Config, world: int):
    """A checkpoint in run.dir must hold this model and optimizer (megatron_kappa.checkpoint.resume
    lists the keys); the layout may change unless it is of format 1."""
    ckpts = CheckpointDir(cfg.run.dir)
    step = ckpts.latest(content=False)  # sizes: the trainer reads the contents against their checksums
    if step is None:
        return
    meta = ckpts.meta(step)
    resume.check_layout(meta, layout_record(cfg.parallel, world), to_dict(cfg), str(ckpts.folder(step)))
    resume.check(meta.get("config"), to_dict(cfg), str(ckpts.folder(step)))
    resume.check_schedule(meta.get("config"), to_dict(cfg), str(ckpts.folder(step)), step)


def check_run_dir(run: RunConfig):
    """run.dir can be made and written, and no live training holds it (megatron_kappa.train.run_lock;
    asked on rank 0, which takes the lock)."""
    from megatron_kappa.train.run_lock import RunLock
    path = os.path.abspath(run.dir)
    problem = folder_problem(path)
    if problem:
        raise ConfigError(f"config: run.dir: {problem}")
    env = launch_env.from_environment()
    if env is None or env["rank"] == 0:  # the rank that takes the lock: only it can tell a holder
        RunLock(path).check()            # of its own host that died (the other hosts' ranks cannot)


def check_logging(log: LogConfig, profile: ProfileConfig, world: int):
    """log.wandb needs the wandb package (an optional extra); profile.ranks must exist."""
    import importlib.util
    if log.wandb.mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"config: log.wandb.mode: {log.wandb.mode} needs the wandb package "
                          "(pip install -e '.[wandb]'), or log.wandb.mode=disabled")
    if profile.steps and any(r >= world for r in profile.ranks):
        raise ConfigError(f"config: profile.ranks: {profile.ranks} names a rank the world of {world} "
                          f"process{'es' * (world > 1)} does not have")


def preflight(cfg: Config, world: int | None = None):
    """All of the above, cheapest first. `world` defaults to what the launcher says."""
    world = world_size() if world is None else world
    check_parallel(cfg, world)
    check_run_dir(cfg.run)
    check_precision(cfg.precision)
    check_attention(cfg.model)
    check_logging(cfg.log, cfg.profile, world)
    if cfg.train.init_weights and os.path.isdir(cfg.train.init_weights):  # a Hugging Face folder: the model's
        from megatron_kappa.import_hf.folder import HFFolder  # config against it (this imports torch)
        HFFolder(cfg.train.init_weights, "config: train.init_weights").check(cfg)
        from megatron_kappa.import_hf.weights import Tensors  # their headers, before config.yaml is written
        Tensors(Path(cfg.train.init_weights), "config: train.init_weights")
    elif cfg.train.init_weights and not os.path.isfile(cfg.train.init_weights):
        raise ConfigError(f"config: train.init_weights: {cfg.train.init_weights}: no such file or folder "
                          "(expected a state dict file or a Hugging Face model folder)")
    elif cfg.train.init_weights:  # a junk file, before any process group, without torch: its first bytes
        with open(cfg.train.init_weights, "rb") as f:
            if f.read(4) != b"PK\x03\x04":
                raise ConfigError(f"config: train.init_weights: {cfg.train.init_weights}: not a state dict file "
                                  "(torch.save writes a zip archive; launch/consolidate.py makes one)")
    check_data(cfg.data, cfg.model.vocab_size)
    check_packing(cfg.data)
    check_tokenizer(cfg.data, cfg.model.vocab_size)
    check_eval(cfg.eval, cfg.data)
    check_resume(cfg, world)
