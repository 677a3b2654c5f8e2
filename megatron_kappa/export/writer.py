"""The export: a run's checkpoint, a layer at a time, into a Hugging Face model folder.

Only one layer's full tensors are in memory at once (the checkpoint's rank files are
memory-mapped, megatron_kappa.checkpoint.Checkpoints.weights), so a model larger than one host's
memory exports as long as its largest layer fits. Everything is written into `<output>.tmp` and
renamed to `<output>` at the end: an interrupted export leaves no half-written model.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from megatron_kappa.checkpoint.listing import locate
from megatron_kappa.checkpoint.store import Checkpoints
from megatron_kappa.config import ConfigError, load_recorded
from megatron_kappa.export import convert, targets
from megatron_kappa.export.card import card
from megatron_kappa.export.licenses import check_license
from megatron_kappa.paths import folder_problem

DTYPES = {"checkpoint": None, "fp32": torch.float32, "bf16": torch.bfloat16}


class ShardWriter:
    """safetensors shards of at most `limit` bytes (a tensor larger than that gets its own), then
    the index transformers reads (model.safetensors.index.json)."""

    def __init__(self, folder: Path, limit: int):
        self.folder, self.limit = folder, limit
        self.pending, self.pending_bytes, self.files, self.index, self.total = {}, 0, [], {}, 0

    def add(self, tensors: dict):
        for name, t in tensors.items():
            size = t.numel() * t.element_size()
            if self.pending and self.pending_bytes + size > self.limit:
                self.flush()
            self.pending[name] = t.detach().contiguous()
            self.pending_bytes += size
            self.total += size

    def flush(self):
        from safetensors.torch import save_file
        if not self.pending:
            return
        name = f"part-{len(self.files) + 1:05d}.safetensors"
        save_file(self.pending, str(self.folder / name), metadata={"format": "pt"})
        self.files.append(name)
        self.index.update({k: name for k in self.pending})
        self.pending, self.pending_bytes = {}, 0

    def finish(self):
        self.flush()
        n = len(self.files)
        final = {f: f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i, f in enumerate(self.files)}
        if n == 1:
            final = {self.files[0]: "model.safetensors"}
        for old, new in final.items():
            os.replace(self.folder / old, self.folder / new)
        if n > 1:
            index = {"metadata": {"total_size": self.total}, "weight_map": {k: final[f] for k, f in self.index.items()}}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def plan(checkpoint: str | Path, target: str = "auto", tokenizer: str | None = None, step: int | None = None):
    """(config, layout, target, checkpoints, step, tokenizer path or None), checked before any
    tensor is read: one-line ConfigErrors naming what is wrong. `checkpoint`: a run directory
    (its latest checkpoint, or `step`'s) or one checkpoint folder (megatron_kappa.checkpoint.listing.locate)."""
    from megatron_kappa.model.layout import model_layout
    run_dir, step = locate(checkpoint, step)
    cfg = load_recorded(run_dir / "config.yaml")
    ckpts = Checkpoints(run_dir, keep=1)
    if ckpts.meta(step).get("format", 1) < 2:
        raise ConfigError(f"--checkpoint: {ckpts.folder(step)}: a format-1 checkpoint (DeepSpeed's files); resume "
                          "it for one step to write format 2, then export (docs/checkpoints.md)")
    layout = model_layout(cfg)  # only which layers are MoE is read (not the TP-padded vocabulary)
    target = convert.target_for(cfg.model, layout, target)
    tok = tokenizer or cfg.data.tokenizer
    if tok and not Path(tok).is_file():
        raise ConfigError(f"--tokenizer: {tok}: no such file (expected the run's SentencePiece .model)")
    if tok:  # a junk file: one line now, not a protobuf traceback after the weights are written
        from megatron_kappa.tokenizer import Tokenizer
        try:
            vocab = Tokenizer(tok).vocab_size
        except Exception as e:  # sentencepiece's own errors are RuntimeErrors or OSErrors
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"--tokenizer: {tok}: not a SentencePiece model ({first[:160]})") from None
        if vocab > cfg.model.vocab_size:
            raise ConfigError(f"--tokenizer: {tok}: its {vocab} pieces do not fit the model's vocabulary "
                              f"(model.vocab_size {cfg.model.vocab_size})")
        from megatron_kappa.data.made_with import check_run_shards  # the ids the model learnt
        check_run_shards(tok, cfg.data, "--tokenizer" if tokenizer else f"{run_dir}/config.yaml: data.tokenizer")
    return cfg, layout, target, ckpts, step, tok or None


def export(checkpoint: str | Path, output: str | Path, target: str = "auto", dtype: str = "checkpoint",
           shard_mb: int = 2000, tokenizer: str | None = None, progress: bool = True, step: int | None = None,
           license: str = "other") -> dict:
    """Write the Hugging Face folder `output` of a run's latest checkpoint (or `step`'s), or of
    one checkpoint folder. `license`: the model card's licence (a Hub identifier)."""
    from tqdm import tqdm

    from megatron_kappa.data.bos import documents_start_with_bos
    from megatron_kappa.model.build import kappa_settings
    from megatron_kappa.tokenizer import Tokenizer

    output = Path(output)
    if output.exists():
        raise ConfigError(f"--output: {output} exists (remove it or choose another folder)")
    problem = folder_problem(output)
    if problem:
        raise ConfigError(f"--output: {problem}")
    check_license(license)
    cfg, layout, target, ckpts, step, tok_file = plan(checkpoint, target, tokenizer, step)
    cast = DTYPES[dtype]
    tmp = output.with_name(output.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        special = {"bos": None, "eos": None, "pad": None}
        if tok_file:
            ours = Tokenizer(tok_file)
            special = {"bos": ours.bos, "eos": ours.eod, "pad": ours.pad}
        config = convert.hf_config(cfg.model, layout, target, special,
                                   kappa_settings(cfg.model.kappa) if cfg.model.kappa.enabled else None)
        shards = ShardWriter(tmp, shard_mb * 2**20)
        first_dtype, params = None, {"total": 0, "experts": 0}
        for i in tqdm(range(cfg.model.num_layers), desc="export", unit="layer", disable=not progress):
            prefix = f"decoder.layers.{i}."
            state = ckpts.weights(step, lambda n, prefix=prefix: n.startswith(prefix))
            tensors = convert.layer_tensors(cfg.model, layout, target, i, lambda rel, s=state, p=prefix: s.get(p + rel))
            first_dtype = first_dtype or next(iter(tensors.values())).dtype
            count(params, tensors)
            shards.add({k: v.to(cast) if cast else v for k, v in tensors.items()})
            del state, tensors
        # model.mtp's modules stay behind: inference uses the main model (transformers' DeepSeek-V3
        # loads no MTP layer either), and they would be read whole here
        outer = ckpts.weights(step, lambda n: not n.startswith(("decoder.layers.", "mtp.")))
        outer = convert.outer_tensors(cfg.model, target, outer.get)
        count(params, outer)
        shards.add({k: v.to(cast) if cast else v for k, v in outer.items()})
        shards.finish()
        config["dtype"] = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[cast or first_dtype]
        config["transformers_version"] = _transformers_version()
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        generation = {k: v for k, v in (("bos_token_id", special["bos"]), ("eos_token_id", special["eos"]),
                                        ("pad_token_id", special["pad"])) if v is not None}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        for name in convert.code_files(target):  # the modeling code of a class transformers lacks
            (tmp / name).write_text(targets.lookup(target).code(name), encoding="utf-8")
        if tok_file:
            from megatron_kappa.export.tokenizer import hf_tokenizer
            cfg.data.tokenizer = tok_file
            hf_tokenizer(tok_file, add_bos=documents_start_with_bos(cfg.data),
                         model_max_length=cfg.model.seq_length).save_pretrained(str(tmp))
        moe = cfg.model.moe
        params["active"] = params["total"] - params["experts"] * (moe.num_experts - moe.topk) // moe.num_experts
        (tmp / "README.md").write_text(card(
            name=output.name, cfg=cfg, run_dir=ckpts.root.parent, step=step, adapter=targets.lookup(target),
            hf_config=config, params=params, license=license, layout_record=ckpts.meta(step).get("layout"),
            kappa=kappa_settings(cfg.model.kappa) if cfg.model.kappa.enabled else None, tokenizer=bool(tok_file)))
        readable(tmp)
        os.replace(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"output": str(output), "target": target, "step": step, "bytes": shards.total,
            "files": len(shards.files), "tokenizer": bool(tok_file)}


ROUTED = re.compile(r"\.experts\.\d+\.|\.kappa_(alpha|bias)$")  # a routed expert's tensors (κ's α, b: per expert)


def count(params: dict, tensors: dict):
    """Add the tensors' values to params["total"], and the routed experts' to params["experts"]."""
    for name, t in tensors.items():
        params["total"] += t.numel()
        params["experts"] += t.numel() if ROUTED.search(name) else 0


def readable(folder: Path):
    """Every file the mode a new file gets (0644 under the usual umask 022): safetensors writes its
    files 0600 (a private temporary file, renamed), the other writers do not."""
    mask = os.umask(0)
    os.umask(mask)
    for path in folder.iterdir():
        os.chmod(path, 0o666 & ~mask)


def _transformers_version() -> str:
    import transformers
    return transformers.__version__
