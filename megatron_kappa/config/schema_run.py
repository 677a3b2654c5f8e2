"""The config schema's other sections: data, log (with log.wandb), profile, checkpoint, eval, run.

megatron_kappa.config.schema gathers them into Config and re-exports them: import them from there."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from megatron_kappa.config.facts import NON_NEGATIVE, POSITIVE
from megatron_kappa.config.facts import key as _f
from megatron_kappa.config.facts import section as _section


@dataclass
class DataConfig:
    paths: list = _f([], "Megatron .bin/.idx prefixes, optionally weighted: [0.7, a, 0.3, b]",
                     allowed='shard prefixes, optionally weighted')
    valid_paths: list = _f([], "held-out prefixes for validation (empty: split from `paths`)",
                           allowed='shard prefixes, optionally weighted')
    split: str = _f("99,1,0", "train,valid,test split of `paths` when no `valid_paths`",
                    allowed='three numbers: train,valid,test')
    tokenizer: Optional[str] = _f(None, "SentencePiece .model used to make the shards")
    mock: bool = _f(False, "megatron-core's mock dataset instead of files (smoke tests, benchmarks; "
                           "synthetic sequences, whatever data.packing says)")
    packing: Literal["concat", "bestfit"] = _f(
        "concat", "how documents fill the rows of seq_length + 1 tokens. concat: megatron-core's GPTDataset "
                  "(documents back to back, each ending in EOD, a row may start mid-document, rows "
                  "shuffled). bestfit: 14c9b04's BOS-aligned best fit (megatron_kappa/data/bestfit.py): "
                  "every row starts at a document's BOS, the largest buffered document that fits goes "
                  "next, a gap no document fits takes the shortest one cropped (≈35 % of tokens cropped "
                  "at 2048, reported at start); the trailing EOD is dropped; needs documents that start "
                  "with BOS and data.tokenizer")
    packing_buffer: int = _f(1000, "documents bestfit chooses among (14c9b04's buffer_size; refilled 128 at "
                                   "a time below it)", range=POSITIVE)
    seed: Optional[int] = _f(None, "seed of the document order (megatron-core's shuffle, bestfit's permutation, "
                                   "mock data; null: train.seed, so another train.seed also reorders the data). "
                                   "14c9b04's order does not depend on its --seed (a corpus shuffled once on disk, "
                                   "read in order): the paper configs fix it", range=NON_NEGATIVE)
    cache_dir: Optional[str] = _f(None, "index cache folder (default: <run.dir>/data_cache)")
    bos: Optional[bool] = _f(None, "the training documents start with BOS (null: read \"bos\" from the "
                                   "data prep manifest.json beside data.paths at training start, false "
                                   "without one or with mock data; the run's config.yaml records the "
                                   "answer, and CORE puts BOS first exactly when it is true)", derived=True)


@dataclass
class WandbConfig:
    mode: Literal["disabled", "offline", "online"] = _f(
        "disabled", "Weights & Biases beside metrics.jsonl (global rank 0): the resolved config and the same "
                    "records, into <run.dir>/wandb, one W&B run per run.dir (a resume continues it); offline: "
                    "`wandb sync` later; needs the `wandb` extra (pip install -e '.[wandb]'); disabled: wandb is "
                    "never imported")
    project: str = _f("megatron_kappa", "W&B project")
    entity: Optional[str] = _f(None, "W&B entity (team or user; null: the account's default)")


@dataclass
class LogConfig:
    interval: int = _f(10, "steps between metric lines", range=POSITIVE)
    tensorboard: bool = _f(True, "also write TensorBoard events to <run.dir>/tb: the scalars of metrics.jsonl, "
                                 "the resolved config as text, κ and tokens-per-expert histograms per MoE layer")
    peak_tflops: Optional[float] = _f(None, "the device's dense bf16 peak (TFLOP/s per GPU) for MFU "
                                            "(null: looked up by GPU name for H100/H200/A100 and "
                                            "others; no MFU on the CPU)", range=POSITIVE)
    wandb: WandbConfig = _section(WandbConfig)


@dataclass
class ProfileConfig:
    steps: list = _f([], "[first, last]: trace these steps (as the step line numbers them, both included) with "
                         "torch.profiler into <run.dir>/profile/ (Chrome / TensorBoard trace; on CUDA also "
                         "cudaProfilerStart/Stop for nsys --capture-range=cudaProfilerApi); []: no profiling",
                     allowed="[] or two step numbers, 1 <= first <= last")
    ranks: list = _f([0], "the global ranks that profile", allowed="global ranks below the world size")
    memory_snapshot: bool = _f(False, "on CUDA, also a memory snapshot of the profiled steps (torch.cuda.memory."
                                      "_dump_snapshot; open at pytorch.org/memory_viz)")


@dataclass
class CheckpointConfig:
    interval: int = _f(1000, "steps between checkpoints (one is always written at the end)", range=POSITIVE)
    keep: int = _f(2, "checkpoints kept", range=POSITIVE)
    async_save: bool = _f(False, "write checkpoints in the background: each rank copies what it saves (pinned host "
                                 "buffers on a GPU) and trains on while a thread writes, checksums and publishes it "
                                 "(docs/checkpoints.md)")
    hf_every: int = _f(0, "the checkpoints at multiples of this step are also exported for Hugging Face to "
                          "<run.dir>/hf/step_<N>, in a process of their own once committed, as `python -m "
                          "megatron_kappa.export --step N` would (0: none)", range=NON_NEGATIVE)
    hf_keep: int = _f(2, "Hugging Face exports kept under <run.dir>/hf", range=POSITIVE)


@dataclass
class EvalConfig:
    valid_every: int = _f(500, "steps between validation losses, and one at the last step (0: no validation)",
                          range=NON_NEGATIVE)
    valid_iters: int = _f(10, "micro-batches per validation", range=POSITIVE)
    core_every: int = _f(0, "steps between quick CORE subsets (0: never during training)", range=NON_NEGATIVE)
    core_max_per_task: int = _f(100, "examples per task in the quick CORE subset", range=POSITIVE)
    core_bundle: Optional[str] = _f(None, "CORE bundle folder or .zip for the quick subset")
    capacity_factor: Optional[float] = _f(None, "expert capacity factor while evaluating (validation, "
                                                "CORE, eval/*.py); null: model.moe.capacity_factor "
                                                "(authors: 3.0)", range=POSITIVE)


@dataclass
class RunConfig:
    dir: str = _f("runs/default", "run directory: checkpoints, metrics.jsonl, tb/",
                  allowed='a folder that is or can be made writable', derived=True)
    name: Optional[str] = _f(None, "the run's name: the W&B run's and the exported model card's title "
                                   "(null: run.dir's folder name)")
