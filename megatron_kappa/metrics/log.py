"""metrics.jsonl, TensorBoard and W&B: one JSON line per log interval in <run.dir>/metrics.jsonl,
the same scalars to TensorBoard and Weights & Biases, written by global rank 0.

TensorBoard also gets the resolved config as text (tag `config`, once per start) and histograms
at the log interval (`histograms`); W&B (megatron_kappa.metrics.wandb_run) the config and the
records."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import yaml

from megatron_kappa.config import WandbConfig

# record keys that are no TensorBoard scalar: its own x axis, and the wall clock (TensorBoard's
# events carry their own time)
NOT_SCALARS = ("step", "time")


def _warn(what: str, error: BaseException):
    """One line for a failed metrics write: the run goes on (its checkpoints, not its metrics, are
    what resumes it; a full disk stops it at the next checkpoint, in one line)."""
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    print(f"warning: {what}: {first}; training goes on without it", file=sys.stderr, flush=True)


def _quiet_tensorboard_thread():
    """TensorBoard writes its events in a thread of its own: a write that fails there (a full disk)
    printed that thread's 25-line traceback after the warning line, and the writer hands the same
    error to the next add/flush, which is where MetricsLog says it in one line. So an OSError of
    that thread is left to MetricsLog; any other thread, or error, goes to the hook as before."""
    import threading
    if getattr(threading.excepthook, "kappa_tensorboard", False):
        return
    previous = threading.excepthook

    def hook(args):
        if not (issubclass(args.exc_type, OSError) and type(args.thread).__name__ == "_AsyncWriterThread"):
            previous(args)
    hook.kappa_tensorboard = True
    threading.excepthook = hook


def read_records(path: str | Path) -> tuple[list[dict], list[int]]:
    """metrics.jsonl's records, and the line numbers (1-based) of lines that are not a whole JSON
    record: what a crash (a kill, a full disk) left half-written. Blank lines are skipped."""
    records, torn = [], []
    for number, line in enumerate(Path(path).read_text(errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        else:
            torn.append(number)
    return records, torn


class MetricsLog:
    """Writes on global rank 0 only; other ranks hold a no-op instance. A failed write is one
    warning line: metrics.jsonl keeps trying at each record, TensorBoard is dropped for the run."""

    def __init__(self, run_dir: str | Path, tensorboard: bool, enabled: bool, wandb: WandbConfig | None = None,
                 config: dict | None = None, start: int = 0, log=print):
        """`config`: the resolved config, for TensorBoard's text and W&B (written at step `start`)."""
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb = None
        self.wandb = None
        self.failing = False
        self.torn_tail = None  # whether the file ends inside a record (None: not looked yet)
        if enabled and tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            _quiet_tensorboard_thread()
            try:
                self.tb = SummaryWriter(str(Path(run_dir) / "tb"))
                if config is not None:  # indented four spaces: TensorBoard's markdown shows it as code
                    text = yaml.safe_dump(config, sort_keys=False)
                    self.tb.add_text("config", "".join("    " + line for line in text.splitlines(True)), start)
            except OSError as e:
                _warn(f"TensorBoard: {Path(run_dir) / 'tb'}", e)
                self.tb = None
        if enabled and wandb is not None and wandb.mode != "disabled":
            from megatron_kappa.metrics.wandb_run import WandbRun
            self.wandb = WandbRun(run_dir, wandb, config or {}, log=log)

    def truncate_after(self, step: int):
        """On resume: drop lines a killed run logged past its last checkpoint, and any record a
        crash left half-written (one line says which)."""
        if not self.enabled or not self.path.is_file():
            return
        records, torn = read_records(self.path)
        if torn:
            print(f"warning: metrics: {self.path}: dropped {len(torn)} torn record{'s' * (len(torn) > 1)} "
                  f"(line {', '.join(map(str, torn))}), half-written when a run stopped", file=sys.stderr, flush=True)
        keep = [json.dumps(r) for r in records if r.get("step", 0) <= step]
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, self.path)
        self.torn_tail = False

    def write(self, record: dict):
        """One record as one line, in one write() to the end of the file: a crash can leave only
        this record half-written, never an earlier one, and the next record starts a new line."""
        if not self.enabled:
            return
        data = (json.dumps(record) + "\n").encode()
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                if self.torn_tail is None:  # first write of this process: does the file end mid-record?
                    size = os.fstat(fd).st_size
                    self.torn_tail = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
                if self.torn_tail:
                    data = b"\n" + data
                written = os.write(fd, data)
                self.torn_tail = written < len(data)
                if self.torn_tail:
                    raise OSError(f"short write ({written} of {len(data)} bytes): no space left on the device?")
            finally:
                os.close(fd)
            self.failing = False
        except OSError as e:
            if not self.failing:  # once per failing spell, not once per step
                _warn(f"metrics: {self.path}", e)
            self.failing = True
        if self.tb is not None:
            try:
                for key, value in record.items():
                    if key not in NOT_SCALARS and isinstance(value, (int, float)):
                        self.tb.add_scalar(key, value, record["step"])
                self.tb.flush()
            except OSError as e:
                _warn(f"TensorBoard: {self.tb.log_dir}", e)
                self.tb = None
        if self.wandb is not None:
            self.wandb.log(record)

    def histograms(self, values: dict, step: int):
        """TensorBoard histograms ({tag: 1-d tensor}) at `step`; a no-op without TensorBoard."""
        if self.tb is None:
            return
        try:
            for tag, tensor in values.items():
                if tensor.numel():
                    self.tb.add_histogram(tag, tensor.double(), step)
            self.tb.flush()
        except OSError as e:
            _warn(f"TensorBoard: {self.tb.log_dir}", e)
            self.tb = None

    def close(self):
        if self.tb is not None:
            try:
                self.tb.close()
            except OSError as e:
                _warn(f"TensorBoard: {self.tb.log_dir}", e)
        if self.wandb is not None:
            self.wandb.close()
