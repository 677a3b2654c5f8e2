"""How long a checkpoint stops training: checkpoint.async_save against the synchronous save.

One process trains the same steps twice, with checkpoints every `--interval` steps, synchronously
and with async_save, and records (through wrappers around the savers and train_step, nothing in
the training changed):
  - blocked: the seconds each checkpoint step spends in the save call (sync: the whole save;
    async: the optimizer state's gathering and the snapshot, plus any wait for the previous save);
    the end's wait for the last background save is reported apart;
  - the steps that run while a background write is under way, against the steps that run with
    none (the median), as a ratio: the write's cost to training (the writer is a thread: the GIL,
    memory bandwidth and, here, the shared CPU cores).
The shapes: configs/tiny.yaml (15.6 MB checkpoint) and its 349 MB variant (bench/checkpoint_io.py's:
hidden 256, ffn 1024, 8 experts). On a GPU (`--device cuda`: precision bf16) the snapshot goes to
pinned host buffers (checkpoint/async_save.py).

    python bench/checkpoint_async.py [--shape tiny|349mb] [--steps 16] [--interval 4] [--writer-probe] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

from megatron_kappa.cli_types import positive_int  # noqa: E402

SHAPES = {"tiny": [], "349mb": ["model.hidden_size=256", "model.ffn_hidden_size=1024", "model.moe.num_experts=8"]}


def timed_run(sets: list, async_save: bool) -> dict:
    """One training run; the savers' and steps' times."""
    from megatron_kappa.checkpoint import async_save as mod
    from megatron_kappa.config import load_config
    from megatron_kappa.train import loop

    blocked, steps, live = [], [], {}
    real = {"sync": mod.SyncSaver.save, "async": mod.AsyncSaver.save, "finish": mod.AsyncSaver.finish,
            "step": loop.train_step}

    def saver_call(kind):
        def save(self, *args, **kwargs):
            live["saver"] = self
            began = time.perf_counter()
            real[kind](self, *args, **kwargs)
            blocked.append(time.perf_counter() - began)
        return save

    def finish(self):
        began = time.perf_counter()
        real["finish"](self)
        live["finish_s"] = time.perf_counter() - began

    def step(*args, **kwargs):
        thread = getattr(live.get("saver"), "thread", None)
        writing = thread is not None and thread.is_alive()
        began = time.perf_counter()
        out = real["step"](*args, **kwargs)
        steps.append((time.perf_counter() - began, writing or (thread is not None and thread.is_alive())))
        return out

    mod.SyncSaver.save, mod.AsyncSaver.save, mod.AsyncSaver.finish = saver_call("sync"), saver_call("async"), finish
    loop.train_step = step
    try:
        with tempfile.TemporaryDirectory() as tmp:
            cfg = load_config(ROOT / "configs/tiny.yaml", [*sets, f"checkpoint.async_save={str(async_save).lower()}",
                                                            f"run.dir={tmp}/run"])
            loop.run(cfg, log=lambda *a, **k: None)
            size = sum(p.stat().st_size for p in (Path(tmp) / "run/checkpoints").rglob("rank_*.pt"))
            saves = len(list((Path(tmp) / "run/checkpoints").glob("step_*")))
    finally:
        mod.SyncSaver.save, mod.AsyncSaver.save, mod.AsyncSaver.finish = real["sync"], real["async"], real["finish"]
        loop.train_step = real["step"]
    first = steps[1:]  # the first step pays one-time costs
    plain = [s for s, writing in first if not writing]
    overlapped = [s for s, writing in first if writing]
    return {"blocked_s": blocked[:-1] or blocked,  # the last save is at the run's end: nothing overlaps it
            "last_blocked_s": blocked[-1], "finish_s": live.get("finish_s", 0.0),
            "step_s": statistics.median(plain) if plain else None,
            "overlapped_step_s": overlapped, "bytes": size // max(saves, 1),
            "pinned_buffers": len(getattr(live.get("saver"), "pinned", {}))}


def compare(shape: str, steps: int, interval: int, device: str) -> dict:
    sets = ["data.mock=true", "log.tensorboard=false", "eval.valid_every=0", f"train.steps={steps}",
            f"checkpoint.interval={interval}", f"log.interval={steps}", f"checkpoint.keep={steps}",
            *SHAPES[shape], *(["precision=bf16"] if device == "cuda" else [])]
    sync, background = timed_run(sets, False), timed_run(sets, True)
    sync_s, async_s = statistics.median(sync["blocked_s"]), statistics.median(background["blocked_s"])
    over = background["overlapped_step_s"]
    return {"shape": shape, "device": device, "checkpoint_bytes": sync["bytes"],
            "sync_blocked_s": sync_s, "async_blocked_s": async_s, "blocked_ratio": async_s / sync_s,
            "step_s": background["step_s"], "overlapped_steps": len(over),
            "overlapped_step_ratio": (statistics.mean(over) / background["step_s"]) if over else None,
            "end_wait_s": background["finish_s"], "pinned_buffers": background["pinned_buffers"]}


def writer_probe(mb: int = 349) -> dict:
    """A thread or a process for the writer: seconds of a matmul loop alone, beside torch.save of
    `mb` MB in a thread, and beside the same in a forked process (no GIL shared)."""
    import multiprocessing
    import os
    import threading

    import torch
    big, a = {"t": torch.randn(mb * 2**20 // 4)}, torch.randn(256, 256)

    def work(n=400):
        began = time.perf_counter()
        for _ in range(n):
            a @ a
        return time.perf_counter() - began
    out = {"alone_s": work()}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, make in (("thread", threading.Thread), ("process", multiprocessing.get_context("fork").Process)):
            writer = make(target=torch.save, args=(big, os.path.join(tmp, kind)))
            writer.start()
            out[f"beside_{kind}_s"] = work()
            writer.join()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=list(SHAPES), action="append", help="default: both")
    ap.add_argument("--steps", type=positive_int, default=16)
    ap.add_argument("--interval", type=positive_int, default=4)
    ap.add_argument("--json", type=Path, metavar="PATH", help="also write the records to PATH (a JSON list)")
    ap.add_argument("--writer-probe", action="store_true", help="also time a matmul loop beside a 349 MB write "
                    "in a thread and in a process (why the writer is a thread)")
    args = ap.parse_args(argv)
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    records = []
    for shape in args.shape or list(SHAPES):
        r = compare(shape, args.steps, args.interval, device)
        records.append(r)
        over = "none" if r["overlapped_step_ratio"] is None else f"{r['overlapped_step_ratio']:.2f}"
        print(f"{shape} ({r['checkpoint_bytes'] / 1e6:.1f} MB, {device}): blocked per save {r['sync_blocked_s']:.3f} s "
              f"sync, {r['async_blocked_s']:.3f} s async ({r['blocked_ratio']:.2f}x); a step {r['step_s']:.3f} s, "
              f"the {r['overlapped_steps']} steps overlapping a background write {over}x of it; "
              f"the end waited {r['end_wait_s']:.3f} s"
              + (f"; {r['pinned_buffers']} pinned host buffers" if device == "cuda" else ""), flush=True)
    if args.writer_probe:
        probe = writer_probe()
        records.append({"writer_probe": probe})
        print("a matmul loop: {alone_s:.3f} s alone, {beside_thread_s:.3f} s beside a 349 MB write in a thread, "
              "{beside_process_s:.3f} s beside one in a process".format(**probe), flush=True)
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
