"""Hugging Face exports written while the run goes on (checkpoint.hf_every, checkpoint.hf_keep).

Once the checkpoint of a step that is a multiple of `hf_every` is committed, rank 0 starts
`python -m megatron_kappa.export --checkpoint <run.dir> --step N --output <run.dir>/hf/step_<N>`
in a process of its own (it never holds the training's GIL), so the folder is the very export that
command gives when run afterwards. One export at a time: a newer step's waits for the running one
in its own thread, never in training. The step being exported is kept out of `checkpoint.keep`'s
rotation until its export ends. A failed export is one warning line (its output kept in
`hf/step_<N>.log`) and never stops training; `hf_keep` exports are kept, the oldest removed.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from pathlib import Path


def for_run(ckpts, checkpoint, run_dir, log=print):
    """Rank 0's HfExports for the `checkpoint` config section when checkpoint.hf_every is set, else
    None (the savers of checkpoint/async_save.py call its `committed`)."""
    import torch.distributed as dist
    if not checkpoint.hf_every or dist.get_rank() != 0:
        return None
    return HfExports(ckpts, run_dir, checkpoint.hf_every, checkpoint.hf_keep, log)


class HfExports:
    def __init__(self, ckpts, run_dir, hf_every: int, hf_keep: int, log=print):
        self.ckpts, self.every, self.keep, self.log = ckpts, hf_every, hf_keep, log
        self.root = Path(run_dir) / "hf"
        self.lock = threading.Lock()  # one export at a time
        self.threads: list[threading.Thread] = []
        if not hasattr(ckpts, "protected"):
            ckpts.protected = set()  # steps checkpoint.keep's rotation leaves alone

    def committed(self, step: int):
        """Checkpoint `step` is committed (rank 0 calls it, from any thread)."""
        if step % self.every:
            return
        self.ckpts.protected.add(step)  # not rotated away while it is read
        thread = threading.Thread(target=self._export, args=(step,), name=f"hf-export-{step}", daemon=True)
        self.threads.append(thread)
        thread.start()

    def _export(self, step: int):
        with self.lock:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                output, log_file = self.root / f"step_{step}", self.root / f"step_{step}.log"
                with log_file.open("w") as out:
                    code = subprocess.call([sys.executable, "-m", "megatron_kappa.export", "--checkpoint",
                                            str(self.ckpts.root.parent), "--step", str(step), "--output", str(output),
                                            "--no-progress"], stdout=out, stderr=subprocess.STDOUT)
                if code == 0:
                    log_file.unlink()
                    self._rotate()
                else:
                    said = [line for line in log_file.read_text().splitlines() if line.strip()]
                    self.log(f"warning: the Hugging Face export of step {step} failed (exit {code}: "
                             f"{said[-1][:200] if said else 'no output'}; {log_file}); training goes on")
            except Exception as e:  # never the training's failure
                self.log(f"warning: the Hugging Face export of step {step} failed ({type(e).__name__}: {e}); "
                         "training goes on")
            finally:
                self.ckpts.protected.discard(step)

    def _rotate(self):
        done = sorted(int(p.name.split("_")[1]) for p in self.root.glob("step_*")
                      if p.is_dir() and p.name.split("_")[1].isdigit())
        for old in done[:-self.keep]:
            shutil.rmtree(self.root / f"step_{old}", ignore_errors=True)

    def finish(self):
        """The run ends: the exports started are written."""
        for thread in self.threads:
            thread.join()
        self.threads = []
