"""Checkpoint save and load time and bytes: format 2 (each rank's owned weights with ZeRO's master
copy and the optimizer state shaped like them: loads into any layout) against format 1 (DeepSpeed's
ZeRO files beside the rank files: one layout only), measured in the same run on the same trained
engine. One process on the CPU (a world of one: no all-reduce cost in format 2's save here).
Also torch.distributed.checkpoint (DCP, what torchtitan uses) writing and reading the same tensors
format 2 holds (weights, master copy, moments), synchronously and with its async_save: DCP's I/O
alone, as DCP could not restore them into ZeRO's flat partitions by itself (docs/checkpoints.md).

    python bench/checkpoint_io.py [--config configs/tiny.yaml] [--set key=value ...] [--repeat 3]

Prints the median seconds and the bytes of each, and format 2 / format 1 ratios.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from megatron_kappa.entry import start

ROOT = Path(__file__).resolve().parents[1]

start()  # first: the known library notices filtered before the imports below can print (megatron_kappa/entry.py)

from megatron_kappa.cli_types import positive_int  # noqa: E402


def measure(engine, model, device, ckpts, repeat: int, save_format2) -> dict:
    import torch

    from megatron_kappa.checkpoint import store
    from megatron_kappa.parallel import sharding
    meta = {"layout": {"world": 1}}

    def save2(step):
        save_format2(ckpts, engine, model, step, meta, device)

    def save1(step):  # what earlier versions wrote (store.py before format 2)
        tag = f"step_{step}"
        staging = ckpts.tmp / tag
        staging.mkdir(parents=True)
        with store._deepspeed_without_module_copy(engine):
            engine.save_checkpoint(str(ckpts.tmp), tag=tag, save_latest=False)
        torch.save({"rng": store.rng_state(device), "coords": sharding.rank_coords(model),
                    "weights": sharding.owned_state(model), "buffers": dict(model.named_buffers())},
                   staging / "rank_0.pt")
        (staging / "meta.json").write_text(json.dumps({**meta, "step": step}))
        shutil.rmtree(ckpts.folder(step), ignore_errors=True)
        staging.rename(ckpts.folder(step))

    import torch.distributed.checkpoint as dcp

    from megatron_kappa.checkpoint import optimizer_state

    def format2_tensors():
        moments, _ = optimizer_state.by_parameter(engine, model)
        return {"weights": sharding.owned_state(model), "optimizer": moments}

    def save_dcp(step, wait=None):
        folder = ckpts.folder(step)
        shutil.rmtree(folder, ignore_errors=True)
        if wait is None:
            dcp.save(format2_tensors(), checkpoint_id=str(folder))
        else:  # async: the time until training could go on; the write finishes in the background
            wait.append(dcp.async_save(format2_tensors(), checkpoint_id=str(folder)))

    def load_dcp(step):  # into tensors of the right shapes (DCP loads in place)
        def empty(tree):
            return {k: empty(v) for k, v in tree.items()} if isinstance(tree, dict) else torch.empty_like(tree)
        dcp.load(empty(format2_tensors()), checkpoint_id=str(ckpts.folder(step)))

    pending = []

    def save_dcp_async(step):
        save_dcp(step, pending)

    def load_after_async(step):
        pending.pop().result()  # the background write done before reading it back
        load_dcp(step)

    out = {}
    for name, save, load in (
            ("format 1 (DeepSpeed ZeRO files)", save1, lambda s: ckpts._load_format1(engine, model, s, device)),
            ("format 2 (any layout)", save2, lambda s: ckpts.load(engine, model, s, device, True)),
            ("DCP, same tensors (I/O only)", save_dcp, load_dcp),
            ("DCP async_save (blocking part)", save_dcp_async, load_after_async)):
        saves, loads = [], []
        for i in range(repeat):
            step = 1000 + i
            t0 = time.perf_counter()
            save(step)
            saves.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            load(step)
            loads.append(time.perf_counter() - t0)
        size = sum(f.stat().st_size for f in ckpts.folder(step).rglob("*") if f.is_file())
        out[name] = {"save_s": statistics.median(saves), "load_s": statistics.median(loads), "bytes": size}
        for i in range(repeat):
            shutil.rmtree(ckpts.folder(1000 + i), ignore_errors=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/tiny.yaml")
    p.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE")
    p.add_argument("--repeat", type=positive_int, default=3)
    args = p.parse_args()
    from megatron_kappa.checkpoint import store
    from megatron_kappa.config import load_config
    from megatron_kappa.train.loop import run

    results = {}
    real_save = store.Checkpoints.save

    def hooked(self, engine, model, step, meta, device):  # the trained engine, at its first save
        if not results:
            results.update(measure(engine, model, device, self, args.repeat, real_save))
        real_save(self, engine, model, step, meta, device)

    store.Checkpoints.save = hooked
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(ROOT / args.config, ["train.steps=2", "checkpoint.interval=2", "data.mock=true",
                                               "log.tensorboard=false", "eval.valid_every=0", *args.set,
                                               f"run.dir={tmp}/run"])
        run(cfg, log=lambda *a, **k: None)
    r1 = next(iter(results.values()))
    print(f"{'':34s} {'save s':>8s} {'load s':>8s} {'bytes':>12s} {'save/f1':>8s} {'load/f1':>8s} {'bytes/f1':>9s}")
    for name, r in results.items():
        print(f"{name:34s} {r['save_s']:8.3f} {r['load_s']:8.3f} {r['bytes']:12,d} {r['save_s'] / r1['save_s']:8.2f} "
              f"{r['load_s'] / r1['load_s']:8.2f} {r['bytes'] / r1['bytes']:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
