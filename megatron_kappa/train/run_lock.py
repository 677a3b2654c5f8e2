"""One training per run directory: `<run.dir>/.lock`, held for the run's life.

The lock file names its holder (host, pid, Slurm job, start time) and its modification time is the
holder's heartbeat, touched every HEARTBEAT_S by a thread of the holder (so a long evaluation or
checkpoint does not let it lapse; a killed process or a lost node stops it). A lock is stale, and
taken over, when its holder is a process of this host that no longer exists (a SIGKILL), when it
belongs to this same Slurm job (a requeue), or when its heartbeat is older than `stale_after_s`
(another host's process cannot be asked), or when it holds no readable record and is older than a
few seconds (a start that failed while writing it: a full disk, a kill). A live holder's lock is
refused in one line naming it; a lock that cannot be written (a full disk) is one line too, and
leaves no empty lock behind.
The same process taking its own lock again (runs one after another in one interpreter) is no
conflict.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from pathlib import Path

from megatron_kappa.config import ConfigError
from megatron_kappa.train.preemption import proc_stat

STALE_AFTER_S = 90.0  # no heartbeat for this long: the holder is gone
HEARTBEAT_S = 15.0
# A lock without a readable record is being written by a start that took it this instant, or was
# left empty or garbled by one that failed to (a full disk, a kill): past this age, the latter.
UNREADABLE_AFTER_S = 5.0


def _start_time(pid: int) -> str | None:
    fields = proc_stat(pid)
    return fields[19] if fields and len(fields) > 19 else None  # starttime, in clock ticks since boot


def _alive(pid: int, started: str | None = None) -> bool:
    """Whether the lock's holder still runs: not gone, not a zombie (a killed rank whose parent died
    too may never be reaped), and not another process that got its pid (the start time differs)."""
    fields = proc_stat(pid)
    if fields is None:
        if os.path.isdir("/proc"):
            return False
        try:  # no /proc: ask the kernel
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    if fields[0] in ("Z", "X"):
        return False
    return started is None or _start_time(pid) == started


class RunLock:
    def __init__(self, run_dir: str | Path, stale_after_s: float = STALE_AFTER_S):
        self.path = Path(run_dir) / ".lock"
        self.stale_after_s = stale_after_s
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID"),
                   "pid_started": _start_time(os.getpid())}
        self._stop = threading.Event()

    def holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable or half-written: judged by its age alone

    def _age(self) -> float:
        try:
            return time.time() - self.path.stat().st_mtime
        except FileNotFoundError:
            return float("inf")

    def _stale(self, holder: dict) -> bool:
        if not holder:  # no record to judge by: its writer failed, unless it is writing it right now
            return self._age() > UNREADABLE_AFTER_S
        if self.me["job"] and holder.get("job") == self.me["job"]:
            return True  # this Slurm job's earlier incarnation (a requeue): Slurm ended it
        if holder.get("host") == self.me["host"] and isinstance(holder.get("pid"), int):
            return holder["pid"] == self.me["pid"] or not _alive(holder["pid"], holder.get("pid_started"))
        return self._age() > self.stale_after_s

    def refusal(self, holder: dict) -> ConfigError:
        return ConfigError(f"run.dir: {self.path.parent} is in use by pid {holder.get('pid')} on "
                           f"{holder.get('host')} (since {holder.get('started')}; lock {self.path}); "
                           "wait for it, or choose another run.dir")

    def check(self):
        """Raise the one-line refusal when a live run other than this process holds the lock."""
        holder = self.holder()
        if holder == {} and not self._stale(holder):  # a start writing it this instant, or one that failed to:
            time.sleep(max(UNREADABLE_AFTER_S - self._age(), 0.0) + 0.1)  # wait, as acquire() does, and see
            holder = self.holder()
        if holder is not None and not self._stale(holder):  # still unreadable: stale now, acquire() takes it
            raise self.refusal(holder)

    def acquire(self):
        """Take the lock, or raise a one-line ConfigError naming its live holder."""
        record = json.dumps({**self.me, "started": time.strftime("%Y-%m-%d %H:%M:%S")})
        for _ in range(3):  # a stale lock is removed and the exclusive create tried again
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self.holder()
                if holder is None:
                    continue
                if holder == {} and not self._stale(holder):  # a start writing it now, or not
                    time.sleep(max(UNREADABLE_AFTER_S - self._age(), 0.0) + 0.1)
                    continue
                if not self._stale(holder):
                    raise self.refusal(holder) from None
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                continue
            try:
                written = os.write(fd, record.encode())
                if written < len(record.encode()):
                    raise OSError(f"wrote {written} of {len(record.encode())} bytes (no space left on the device?)")
            except OSError as e:  # a full disk: leave no empty lock behind to refuse the next start
                os.close(fd)
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                raise ConfigError(f"run.dir: cannot write the lock {self.path}: {e.strerror or e}") from None
            os.close(fd)
            threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True).start()
            return
        raise ConfigError(f"run.dir: could not take the lock {self.path} (another run takes it at the same time)")

    def _beat(self):
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self):
        self._stop.set()
        holder = self.holder()
        if holder and holder.get("pid") == self.me["pid"] and holder.get("host") == self.me["host"]:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
