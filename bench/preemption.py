"""Cost of the per-step stop agreement (megatron_kappa.train.preemption) on 2 gloo processes.

    OMP_NUM_THREADS=1 python bench/preemption.py [--steps 400] [--work-ms 5] [--repeats 3]

Each process runs `steps` fake training steps (CPU matmuls of about `work-ms`, then an all-reduce
of a 1 MB "gradient" on the default group, which keeps the ranks in step as a real step does), in
four modes, interleaved and repeated in the same run:
  none       the step alone;
  pipelined  + StopAgreement.poll() (what the loop does: the all-reduce started after step k is
             waited for after step k+1);
  blocking   + a plain all-reduce of the same integer, waited for at once (the simple design);
  every4     + the blocking all-reduce every 4th step only.
Prints the median extra time per step of each mode against `none`, in µs and as a ratio, as
markdown rows for docs/benchmarks.md. On a GPU the step runs on the device while the host
enqueues it, so host time spent here is hidden as long as the host stays ahead of the device.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

from megatron_kappa.entry import start

start()  # first: the known library notices filtered before the imports below can print (megatron_kappa/entry.py)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from megatron_kappa.parallel.launch_env import free_port  # noqa: E402
from megatron_kappa.train.preemption import StopAgreement  # noqa: E402

MODES = ("none", "pipelined", "blocking", "every4")


def calibrate(work_ms: float) -> int:
    a = torch.randn(128, 128)
    t = time.perf_counter()
    for _ in range(50):
        a @ a
    per = (time.perf_counter() - t) / 50
    return max(1, round(work_ms / 1000 / per))


def worker(rank: int, port: int, args, out):
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    side = dist.new_group(backend="gloo")
    n = torch.tensor([calibrate(args.work_ms)])
    dist.all_reduce(n, op=dist.ReduceOp.MAX)  # the same work on both ranks
    a, flag, grad = torch.randn(128, 128), torch.zeros(1, dtype=torch.int32), torch.zeros(1 << 18)
    times = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for mode in MODES:
            stop = StopAgreement(side) if mode == "pipelined" else None
            dist.barrier()
            t = time.perf_counter()
            for step in range(args.steps):
                for _ in range(int(n)):
                    a @ a
                dist.all_reduce(grad)
                if stop is not None:
                    stop.poll()
                elif mode == "blocking" or (mode == "every4" and step % 4 == 3):
                    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=side)
            if stop is not None:
                stop.close()
            times[mode].append((time.perf_counter() - t) / args.steps)
    if rank == 0:
        out.update({m: statistics.median(v) for m, v in times.items()})
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--work-ms", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(worker, args=(free_port(), args, out), nprocs=2)
        res = dict(out)
    base = res["none"]
    print(f"step alone: {base * 1e3:.2f} ms (median of {args.repeats} × {args.steps} steps, 2 gloo processes)")
    print("| mode | extra per step | step time vs none |")
    print("|---|---|---|")
    for mode in MODES[1:]:
        print(f"| {mode} | {(res[mode] - base) * 1e6:.0f} µs | {res[mode] / base:.3f}× |")


if __name__ == "__main__":
    main()
