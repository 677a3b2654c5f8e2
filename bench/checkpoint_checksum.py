"""The cost of a checkpoint file's checksum (megatron_kappa.checkpoint.listing.file_checksum, zlib's
CRC-32) against writing the file with torch.save, measured in the same run: each rank writes its
file and then reads it back for the sum (from the page cache), and a resume, an evaluation or an
export reads each file once more for it.

    python bench/checkpoint_checksum.py [--mib 64 256] [--repeat 3]

Prints, per size, the median seconds of torch.save, of the checksum right after it (page cache)
and of a full read without a sum (the floor of any check that reads the bytes), and the ratios.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from megatron_kappa.entry import start

start()  # first: the known library notices filtered before the imports below can print (megatron_kappa/entry.py)

from megatron_kappa.cli_types import positive_int  # noqa: E402


def median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    import torch

    from megatron_kappa.checkpoint import listing
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=positive_int, nargs="+", default=[64, 256], help="file sizes (MiB of fp32)")
    ap.add_argument("--repeat", type=positive_int, default=3)
    args = ap.parse_args(argv)
    print(f"{'MiB':>6} {'save s':>8} {'checksum s':>11} {'read s':>8} {'checksum/save':>14} {'read/save':>10}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rank_0.pt"
        for mib in args.mib:
            state = {f"w{i}": torch.randn(mib * 2**20 // 4 // 8) for i in range(8)}
            save = median_seconds(lambda: torch.save(state, path), args.repeat)

            def checksum():
                listing._SUMS.clear()  # no cached sum: the bytes are read and summed each time
                listing.file_checksum(path)

            def read():
                with path.open("rb") as f:
                    while f.read(listing.CHUNK):
                        pass
            summed, plain = median_seconds(checksum, args.repeat), median_seconds(read, args.repeat)
            print(f"{mib:>6} {save:>8.3f} {summed:>11.3f} {plain:>8.3f} {summed / save:>14.2f} {plain / save:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
