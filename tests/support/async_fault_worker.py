"""launch/pretrain.py with a fault in its checkpoint writes (tests/test_async_checkpoint.py).

KAPPA_TEST_FAULT (JSON): {"step": N, "rank": R, "marker": PATH, "sleep": S, "raise": "enospc"}: rank R's
write of step N's file writes its pid to PATH, sleeps S seconds, then fails with ENOSPC if asked
(else writes). Everything else is launch/pretrain.py's, run as under any launcher."""
import errno
import json
import os
import runpy
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
fault = json.loads(os.environ.get("KAPPA_TEST_FAULT", "{\"step\": null}"))  # none: a plain run
real_save = torch.save


def faulty_save(obj, path, *args, **kwargs):
    if f"step_{fault['step']}" in str(path) and f"rank_{fault.get('rank', 0)}.pt" in str(path):
        if fault.get("marker"):
            Path(fault["marker"]).write_text(str(os.getpid()))
        time.sleep(fault.get("sleep", 0))
        if fault.get("raise") == "enospc":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
    return real_save(obj, path, *args, **kwargs)


torch.save = faulty_save
sys.argv = [str(ROOT / "launch/pretrain.py"), *sys.argv[1:]]
runpy.run_path(str(ROOT / "launch/pretrain.py"), run_name="__main__")
