"""A real one-node Slurm cluster on this machine, for tests (Debian's slurm-wlm, Slurm 22.05).

    with slurm_cluster(tmp_path) as cluster:
        job = cluster.submit("launch/slurm/pretrain.sbatch", "--config", "x.yaml",
                             options=["--ntasks-per-node=2", "--gpus-per-node=0"])
        assert cluster.wait(job, timeout=120) == "COMPLETED"

Everything lives in `tmp_path/slurm`: slurm.conf, state, spool, logs. Ports are picked free at
start (retried when another process takes one first), the daemons listen on 127.0.0.1 only, and
the cluster name is random, so several instances (other tests, other users) run side by side.

Authentication is `auth/none` + `cred/none` (both ship with 22.05): munge would need a munged
of its own (the system one at /run/munge is shared by every instance and by a real Slurm) whose
socket folder and every folder above it must be world-searchable, which pytest's 0700 tmp_path is
not. auth/none trusts the uid a client claims: acceptable for a cluster that listens on loopback
only and lives for one test, run as root on a CI or development machine.

Teardown (also on failures and KeyboardInterrupt): cancel the jobs, stop slurmd and slurmctld by
their pids, then SIGKILL every process still carrying this instance's marker in its environment
(slurmstepd and job processes outlive slurmd by design) — never by name. Should the test process
itself be killed, the daemons get SIGTERM from the kernel (PR_SET_PDEATHSIG) and the next cluster
started on the machine kills what is left of instances whose owner process is gone.

Skips (pytest.skip, with the reason) when slurmctld/slurmd are not installed or we are not root.
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal as _signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
                "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
MARKER = "KAPPA_SLURM_TEST_CLUSTER"   # environment variable naming this instance
# Variables of an enclosing launcher or Slurm job that must not leak into the test cluster's jobs.
_LEAKY = re.compile(r"^(SLURM_|SLURMD_|SBATCH_|SRUN_|SALLOC_|SQUEUE_|SCANCEL_|SINFO_)|"
                    r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|GROUP_RANK|MASTER_ADDR|"
                    r"MASTER_PORT|CROSS_RANK|CROSS_SIZE|LOCAL_SIZE)$")
_HOST = "localhost"


class SlurmError(RuntimeError):
    pass


def missing_reason() -> str | None:
    """Why a cluster cannot start here, or None."""
    for exe in ("slurmctld", "slurmd", "sbatch", "scontrol"):
        if shutil.which(exe) is None and not Path("/usr/sbin", exe).exists():
            return f"{exe} not installed (Debian: apt-get install slurm-wlm; .ci/run does it)"
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd runs jobs as their user)"
    return None


def _which(exe: str) -> str:
    return shutil.which(exe) or str(Path("/usr/sbin", exe))


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _memory_mb() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 1024


def _die_with_parent():
    """In a daemon before exec: SIGTERM when the test process dies, even by SIGKILL (Linux)."""
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(_signal.SIGTERM))  # PR_SET_PDEATHSIG
    except Exception:  # best effort; stop() and _kill_orphans() remain
        pass


def _environments():
    """(pid, b"\\0" + environment + b"\\0") of every other process we may read."""
    me = os.getpid()
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != me:
            try:
                yield int(d.name), b"\0" + (d / "environ").read_bytes() + b"\0"
            except OSError:
                continue


def _kill_orphans():
    """SIGKILL what a test cluster left when its test process was killed (the pid at the end of
    each marker is its owner's; only markers whose owner is gone are touched)."""
    key = f"\0{MARKER}=".encode()
    for pid, env in _environments():
        i = env.find(key)
        if i < 0:
            continue
        value = env[i + len(key):env.index(b"\0", i + len(key))].decode(errors="replace")
        owner = value.rsplit(":", 1)[-1]
        if owner.isdigit() and not Path(f"/proc/{owner}").exists():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, _signal.SIGKILL)


def _parse_show(text: str) -> dict:
    """`scontrol show job -o` (one line of Key=Value) -> dict. Values may contain spaces
    (Command=, WorkDir=); a new key starts where ` Word=` follows."""
    out = {}
    for m in re.finditer(r"(?:^|\s)([A-Za-z][\w:/.]*)=(.*?)(?=\s+[A-Za-z][\w:/.]*=|\s*$)", text.strip()):
        out[m.group(1)] = m.group(2)
    return out


def shared_settings(r: Path, kill_wait: int, requeue_delay: int, spool: str) -> str:
    """slurm.conf lines every test cluster has: auth/none, root daemons, state and logs under `r`
    (a pid and log file per node: %n), the spool folder `spool` (a short path: slurmstepd's
    socket path in it must stay under 108 bytes), no cgroups, no accounting, requeue allowed, a
    scheduler that looks every second."""
    return f"""\
AuthType=auth/none
# cred_expire: credential lifetime, and how long a requeued job is held (default 120 s)
AuthInfo=cred_expire={requeue_delay}
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r}/state
SlurmdSpoolDir={spool}
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
# finished jobs stay visible to `scontrol show job` (no sacct without accounting)
MinJobAge=86400
JobRequeue=1
KillWait={kill_wait}
InactiveLimit=0
SchedulerParameters=sched_interval=1
"""


class SlurmCluster:
    """Handle on a running test cluster: its environment and a few job helpers."""

    def __init__(self, root: Path, ncpus: int, kill_wait: int = 30, requeue_delay: int = 10):
        self.root = root
        self.ncpus = ncpus
        self.kill_wait = kill_wait
        self.requeue_delay = requeue_delay
        self.conf = root / "slurm.conf"
        self.name = "kappa" + secrets.token_hex(4)
        self.marker = f"{self.name}:{root}:{os.getpid()}"  # ends with the owner's pid
        self.node = _HOST
        self._procs: dict[str, subprocess.Popen] = {}
        base = {k: v for k, v in os.environ.items() if not _LEAKY.match(k)}
        base.update(SLURM_CONF=str(self.conf), **{MARKER: self.marker})
        path = base.get("PATH", "/usr/bin:/bin")
        if "/usr/sbin" not in path.split(":"):
            path += ":/usr/sbin"
        base["PATH"] = path
        self.env = base  # environment for the Slurm clients and (with --export=ALL) the jobs

    # ---- configuration and daemons -------------------------------------------------------------

    @property
    def short_root(self) -> Path:
        """/tmp/<cluster name>, a link to the root: slurmstepd's socket lives in the spool folder
        and its path must stay under 108 bytes, which a pytest-xdist worker's tmp_path is not."""
        return Path("/tmp") / self.name

    def _link_short_root(self):
        link = self.short_root
        if not link.is_symlink():
            link.symlink_to(self.root, target_is_directory=True)

    def _write_conf(self, ctld_port: int, slurmd_port: int):
        r = self.root
        for d in ("state", "spool", "log", "jobs"):
            (r / d).mkdir(parents=True, exist_ok=True)
        self._link_short_root()
        mem = max(256, min(_memory_mb() - 256, 8000))
        self.conf.write_text(f"""\
# test cluster {self.name} (tests/support/slurm_cluster.py); all state under {r}
ClusterName={self.name}
SlurmctldHost={_HOST}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
{shared_settings(r, self.kill_wait, self.requeue_delay, f"{self.short_root}/spool")}\
NodeName={_HOST} NodeHostname={_HOST} NodeAddr=127.0.0.1 CPUs={self.ncpus} RealMemory={mem} State=UNKNOWN
PartitionName=debug Nodes={_HOST} Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn(self, name: str, argv: list[str]):
        log = open(self.root / "log" / f"{name}.stdout", "ab")
        try:
            env = dict(self.env)
            self._procs[name] = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                                 stderr=subprocess.STDOUT, start_new_session=True,
                                                 preexec_fn=_die_with_parent)
        finally:
            log.close()

    def _log_tail(self, n: int = 15) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            lines = f.read_text(errors="replace").splitlines()[-n:]
            if lines:
                parts.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(parts)

    def _start_once(self, timeout: float) -> bool:
        """One try with fresh ports; False when a port was taken (caller retries)."""
        ctld_port, slurmd_port = _free_ports(2)
        self._write_conf(ctld_port, slurmd_port)
        self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._spawn("slurmd", [_which("slurmd"), "-D", "-f", str(self.conf), "-N", _HOST])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if "Address already in use" in self._log_tail(50):
                return False  # slurmctld retries the bind for a while; don't wait for it
            for name, p in self._procs.items():
                if p.poll() is not None:
                    raise SlurmError(f"{name} exited with status {p.returncode}\n{self._log_tail()}")
            try:
                out = self.run("sinfo", "-h", "-N", "-o", "%T", check=False, timeout=5)
                if out.returncode == 0 and out.stdout.strip().rstrip("*") == "idle":
                    return True
            except subprocess.TimeoutExpired:
                pass
            time.sleep(0.3)
        raise SlurmError(f"node not idle after {timeout:.0f} s\n{self._log_tail()}")

    def start(self, timeout: float = 60, tries: int = 3):
        _kill_orphans()
        for _ in range(tries):
            if self._start_once(timeout):
                return self
            self._stop_daemons()
            for d in ("state", "spool", "log"):
                shutil.rmtree(self.root / d, ignore_errors=True)
        raise SlurmError(f"no free ports after {tries} tries\n{self._log_tail()}")

    def _stop_daemons(self, timeout: float = 15):
        names = list(reversed(self._procs))  # the last started first: slurmd before slurmctld
        for name in names:
            p = self._procs[name]
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.terminate()
        for name in names:
            p = self._procs.pop(name)
            try:
                p.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                p.wait(10)

    def _marked_pids(self) -> list[int]:
        """Processes of this instance: the marker (or our SLURM_CONF) in their environment."""
        needles = (f"\0{MARKER}={self.marker}\0".encode(), f"\0SLURM_CONF={self.conf}\0".encode())
        return [pid for pid, env in _environments() if any(n in env for n in needles)]

    def stop(self):
        """Cancel the jobs, stop the daemons, kill what is left of this instance. Idempotent."""
        try:
            if self._procs.get("slurmctld") is not None and self._procs["slurmctld"].poll() is None:
                ids = self.run("squeue", "-h", "-o", "%A", check=False, timeout=10).stdout.split()
                if ids:
                    self.run("scancel", *ids, check=False, timeout=10)
                    deadline = time.monotonic() + 5
                    while time.monotonic() < deadline and self.run(
                            "squeue", "-h", "-t", "RUNNING,COMPLETING", "-o", "%A",
                            check=False, timeout=10).stdout.strip():
                        time.sleep(0.3)
        except Exception:  # teardown goes on whatever happens
            pass
        finally:
            self._stop_daemons()
            for _ in range(3):
                pids = self._marked_pids()
                if not pids:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.kill(pid, _signal.SIGKILL)
                time.sleep(0.2)
            if self.short_root.is_symlink():
                self.short_root.unlink()

    # ---- clients -------------------------------------------------------------------------------

    def run(self, *cmd, check: bool = True, timeout: float = 60, env: dict | None = None,
            cwd=None) -> subprocess.CompletedProcess:
        out = subprocess.run([str(c) for c in cmd], env={**self.env, **(env or {})}, cwd=cwd,
                             capture_output=True, text=True, timeout=timeout)
        if check and out.returncode:
            raise SlurmError(f"{' '.join(map(str, cmd))}: status {out.returncode}\n{out.stderr}")
        return out

    def submit(self, script, *args, options=(), env: dict | None = None, cwd=None) -> int:
        """sbatch [options] script args -> job id. `env` adds to (or overrides) self.env; the job
        gets it all (--export=ALL unless `options` says otherwise). Default output: jobs/%j.out."""
        opts = list(options)
        if not any(o.startswith(("--output", "-o")) for o in opts):
            opts.append(f"--output={self.root / 'jobs' / '%j.out'}")
        out = self.run("sbatch", "--parsable", *opts, script, *args, env=env, cwd=cwd)
        return int(out.stdout.strip().split(";")[0])

    def show(self, job_id: int) -> dict:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, StdOut, Reason, ...)."""
        return _parse_show(self.run("scontrol", "show", "job", "-o", job_id).stdout)

    def state(self, job_id: int) -> str:
        return self.show(job_id).get("JobState", "UNKNOWN")

    def exit_code(self, job_id: int) -> tuple[int, int]:
        """(exit status, signal) of the batch script, from ExitCode=S:G."""
        rc, sig = self.show(job_id).get("ExitCode", "0:0").split(":")
        return int(rc), int(sig)

    def output(self, job_id: int) -> str:
        """The job's stdout file (as sbatch's --output resolved it)."""
        path = self.show(job_id).get("StdOut")
        return Path(path).read_text(errors="replace") if path and Path(path).exists() else ""

    def wait(self, job_id: int, timeout: float = 120, states=FINAL_STATES, restarts: int = 0,
             poll: float = 0.5) -> str:
        """Wait until the job's state is in `states` (default: any final state) in a run with at
        least `restarts` restarts (requeue() says which); returns the state."""
        states = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        while True:
            info = self.show(job_id)
            st = info.get("JobState", "UNKNOWN")
            if st in states and int(info.get("Restarts", "0")) >= restarts:
                return st
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {st} after {timeout:.0f} s (waiting for "
                                   f"{sorted(states)})\n{self.show(job_id)}\n--- output\n"
                                   f"{self.output(job_id)[-3000:]}")
            time.sleep(poll)

    def wait_output(self, job_id: int, text: str, timeout: float = 60) -> str:
        """Wait until the job's output contains `text` (e.g. a "ready" line printed by the job)."""
        deadline = time.monotonic() + timeout
        while text not in (out := self.output(job_id)):
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id}: {text!r} not in its output after {timeout:.0f} s"
                                   f" (state {self.state(job_id)})\n{out[-3000:]}")
            time.sleep(0.3)
        return out

    def signal(self, job_id: int, sig="USR1", batch: bool = False, full: bool = False):
        """scancel --signal: by default to every step (srun tasks), not the batch shell, as
        sbatch --signal=SIG@T does; batch=True: the batch shell only (B:); full=True: both."""
        name = sig.name.removeprefix("SIG") if isinstance(sig, _signal.Signals) else str(sig)
        flags = ["--batch"] if batch else ["--full"] if full else []
        self.run("scancel", f"--signal={name}", *flags, job_id)

    def cancel(self, job_id: int):
        self.run("scancel", job_id)

    def requeue(self, job_id: int) -> int:
        """scontrol requeue; returns the Restarts count the next run will have (for wait()).
        Slurm sends SIGCONT + SIGTERM to the batch shell and every step (SIGKILL after KillWait),
        the job goes COMPLETING -> PENDING (Reason=BeginTime) and runs again once its begin time,
        requeue time + cred_expire + 1 s, has passed (cred_expire: 120 s by default, `requeue_delay`
        here). Forcing StartTime=now earlier races the old run's clean-up: the new run can fail."""
        restarts = int(self.show(job_id).get("Restarts", "0"))
        self.run("scontrol", "requeue", job_id)
        return restarts + 1

@contextlib.contextmanager
def slurm_cluster(tmp_path, *, cpus: int | None = None, kill_wait: int = 30, requeue_delay: int = 10,
                  timeout: float = 60):
    """Start a one-node cluster under tmp_path/slurm, yield a SlurmCluster, stop it whatever
    happens. `cpus`: CPUs the node offers (default: this machine's count, at least 2; the node
    may claim more than the machine has). `kill_wait`: seconds between SIGTERM and SIGKILL when
    a job is cancelled, requeued or out of time (Slurm's default 30). `requeue_delay`: Slurm's
    cred_expire (default 120 s), which also holds a requeued job back that long."""
    reason = missing_reason()
    if reason:
        pytest.skip(reason)
    root = Path(tmp_path) / "slurm"
    root.mkdir(parents=True, exist_ok=True)
    cluster = SlurmCluster(root, cpus or max(2, os.cpu_count() or 1), kill_wait, requeue_delay)
    try:
        cluster.start(timeout)
        yield cluster
    finally:
        cluster.stop()
