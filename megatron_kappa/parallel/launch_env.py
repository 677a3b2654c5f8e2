"""Rank, world size and rendezvous address of this process, from whichever launcher started it.

Three cases, tried in this order:

* a launcher that sets the torch variables (``torchrun``, ``deepspeed``, ``mpirun`` wrappers):
  ``RANK`` and ``WORLD_SIZE`` (with ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``);
* a Slurm job step (``srun``; ``SLURM_STEP_ID`` is set): ``SLURM_PROCID``,
  ``SLURM_STEP_NUM_TASKS`` (or ``SLURM_NTASKS``), ``SLURM_LOCALID``; the rendezvous host is
  ``MASTER_ADDR`` when set, else the first host of the step's node list; the port is
  ``MASTER_PORT`` when set, else ``10000 + SLURM_JOB_ID % 20000`` (the same formula as
  ``launch/slurm/common.sh``, so every task of the step agrees on it without talking);
* neither: ``None`` (one plain process).

A Slurm batch shell (``sbatch`` script outside ``srun``) has ``SLURM_PROCID=0`` and the job's
``SLURM_NTASKS`` but is not a step: it counts as a plain process, so ``python x.py`` written in a
batch script does not wait for ranks that were never started.

``export(found)`` / ``export_environment()`` write the result back as the standard variables so
that ``torch.distributed`` (``env://``) and DeepSpeed see an ordinary launcher environment.
``free_port()`` finds a free TCP port (a world of one, tests). ``exit_process(code)`` ends a
command-line process without interpreter shutdown's garbage collection.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import socket
import subprocess
from collections.abc import Mapping as _MappingABC
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Mapping, MutableMapping, Optional

# a command line's ending, defined with the entry points' start (megatron_kappa/entry.py); many
# command lines import them from here
from megatron_kappa.entry import Terminated, exit_process, run_command  # noqa: F401

DEVICE_ENV = "MEGATRON_KAPPA_DEVICE"  # auto | cpu | cuda: the device a process trains on (parallel.groups)

__all__ = ["LaunchEnv", "LaunchEnvError", "from_environment", "export", "export_environment",
           "free_port", "ephemeral_ports", "expand_hostlist", "first_host", "slurm_port", "tasks_on_node"]

DEFAULT_PORT = 29500  # torch's default when a launcher gives RANK but no MASTER_PORT


class LaunchEnvError(ValueError):
    """The environment names a launcher but its variables are missing or inconsistent."""


@dataclass(frozen=True)
class LaunchEnv(_MappingABC):
    """Attributes, or read-only mapping keys (``env["world_size"]``, ``dict(env)``)."""
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    source: str                               # "launcher" (torch variables) or "slurm"
    local_world_size: Optional[int] = None    # processes on this node, when known

    def __getitem__(self, key):
        if key not in self._keys():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self):
        return iter(self._keys())

    def __len__(self):
        return len(self._keys())

    @classmethod
    def _keys(cls):
        return tuple(f.name for f in fields(cls))

    def as_env(self) -> dict:
        env = {"RANK": str(self.rank), "WORLD_SIZE": str(self.world_size),
               "LOCAL_RANK": str(self.local_rank), "MASTER_ADDR": self.master_addr,
               "MASTER_PORT": str(self.master_port)}
        if self.local_world_size is not None:
            env["LOCAL_WORLD_SIZE"] = str(self.local_world_size)
        return env


def ephemeral_ports() -> tuple[int, int]:
    """The kernel's range for outgoing connections' source ports (Linux; 32768-60999 elsewhere)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` now, picked at random just below the kernel's ephemeral range.

    Not the OS's own pick (bind to port 0): that comes from the ephemeral range, where any
    outgoing connection on the machine (gloo opens many) may take it as its source port between
    this check and the launcher's bind: EADDRINUSE when tests or runs start side by side. Below
    the range only another explicit bind can take it. Falls back to the OS's pick when 64 random
    ports are all taken."""
    low, _ = ephemeral_ports()
    rng = random.SystemRandom()
    for _ in range(64):
        port = rng.randrange(max(1024, low - 8192), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def slurm_port(job_id) -> int:
    """Rendezvous port of a Slurm job: 10000 + job id mod 20000 (below the usual ephemeral range)."""
    return 10000 + int(job_id) % 20000


# ---- Slurm host lists -------------------------------------------------------------------------

def _split_top(text: str, sep: str = ",") -> list:
    """Split on `sep` outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise LaunchEnvError(f"unbalanced ']' in host list {text!r}")
        if ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise LaunchEnvError(f"unbalanced '[' in host list {text!r}")
    parts.append("".join(cur))
    return parts


def _expand_range(spec: str, text: str) -> list:
    out = []
    for item in spec.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise LaunchEnvError(f"bad range {item!r} in host list {text!r}")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise LaunchEnvError(f"descending range {item!r} in host list {text!r}")
        width = len(lo) if lo.startswith("0") else 0   # node[01-10] keeps its zero padding
        out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
    return out


def expand_hostlist(text: str) -> list:
    """Expand a Slurm host list: ``node[01-03,07],gpu-a[1-2]-ib`` -> node01 node02 node03 node07
    gpu-a1-ib gpu-a2-ib. Several bracket groups in one name expand as Slurm does (left to right,
    the rightmost varying fastest)."""
    hosts = []
    for name in _split_top(text.strip()):
        name = name.strip()
        if not name:
            continue
        expanded = [""]
        for piece in re.split(r"(\[[^\]]*\])", name):
            if piece.startswith("["):
                choices = _expand_range(piece[1:-1], text)
            else:
                if "[" in piece or "]" in piece:
                    raise LaunchEnvError(f"bad host list {text!r}")
                choices = [piece]
            expanded = [e + c for e in expanded for c in choices]
        hosts.extend(expanded)
    if not hosts:
        raise LaunchEnvError(f"empty host list {text!r}")
    return hosts


def first_host(nodelist: str, use_scontrol: bool = True) -> str:
    """First host of a Slurm node list: ``scontrol show hostnames`` when it is there (it knows every
    form Slurm writes), else this module's parser."""
    if use_scontrol and shutil.which("scontrol"):
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                                 text=True, timeout=10)
            lines = out.stdout.split()
            if out.returncode == 0 and lines:
                return lines[0]
        except (OSError, subprocess.SubprocessError):
            pass
    return expand_hostlist(nodelist)[0]


def tasks_on_node(tasks_per_node: str, node_id: int) -> Optional[int]:
    """Tasks on node `node_id` from Slurm's compressed count list (``4(x2),3``: 4, 4, 3)."""
    counts = []
    for item in tasks_per_node.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if not m:
            return None
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts[node_id] if 0 <= node_id < len(counts) else None


# ---- the environment ---------------------------------------------------------------------------

def _int(env: Mapping, name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise LaunchEnvError(f"{name}={env[name]!r} is not an integer") from None


def _check(rank: int, world: int, local_rank: int, source: str) -> None:
    if world < 1 or not 0 <= rank < world or local_rank < 0:
        raise LaunchEnvError(f"inconsistent {source} environment: rank {rank}, world size {world}, "
                             f"local rank {local_rank}")


def from_environment(environ: Optional[Mapping] = None, *, use_scontrol: bool = True
                     ) -> Optional[LaunchEnv]:
    """This process's place in the job (see the module docstring), or None for a plain process."""
    env = os.environ if environ is None else environ

    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
        if "LOCAL_RANK" in env:
            local_rank = _int(env, "LOCAL_RANK")
        elif "SLURM_LOCALID" in env and "SLURM_STEP_ID" in env:
            local_rank = _int(env, "SLURM_LOCALID")
        else:
            local_rank = 0 if world == 1 else rank
        addr = env.get("MASTER_ADDR")
        if not addr:
            if world > 1:
                raise LaunchEnvError("RANK and WORLD_SIZE are set but MASTER_ADDR is not")
            addr = "127.0.0.1"
        port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else DEFAULT_PORT
        lws = _int(env, "LOCAL_WORLD_SIZE") if env.get("LOCAL_WORLD_SIZE") else None
        _check(rank, world, local_rank, "launcher")
        return LaunchEnv(rank, world, local_rank, addr, port, "launcher", lws)

    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        ntasks = env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS") or env.get("SLURM_NPROCS")
        if ntasks is None:
            raise LaunchEnvError("SLURM_PROCID is set but not SLURM_STEP_NUM_TASKS / SLURM_NTASKS")
        rank, world = _int(env, "SLURM_PROCID"), int(ntasks)
        local_rank = _int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0
        addr = env.get("MASTER_ADDR")
        if not addr:
            nodelist = (env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
                        or env.get("SLURM_NODELIST"))
            if not nodelist:
                raise LaunchEnvError("in a Slurm step without SLURM_STEP_NODELIST / "
                                     "SLURM_JOB_NODELIST, and MASTER_ADDR is not set")
            addr = first_host(nodelist, use_scontrol=use_scontrol)
        if env.get("MASTER_PORT"):
            port = _int(env, "MASTER_PORT")
        elif env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"):
            port = slurm_port(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"))
        else:
            raise LaunchEnvError("in a Slurm step without SLURM_JOB_ID, and MASTER_PORT is not set")
        lws = None
        tpn = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        if tpn and "SLURM_NODEID" in env:
            lws = tasks_on_node(tpn, _int(env, "SLURM_NODEID"))
        _check(rank, world, local_rank, "Slurm")
        return LaunchEnv(rank, world, local_rank, addr, port, "slurm", lws)

    return None


def export(found: LaunchEnv, environ: Optional[MutableMapping] = None) -> LaunchEnv:
    """Write `found` as RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT (and
    LOCAL_WORLD_SIZE when known) into `environ` (default os.environ)."""
    (os.environ if environ is None else environ).update(found.as_env())
    return found


def export_environment(environ: Optional[MutableMapping] = None, *, use_scontrol: bool = True
                       ) -> Optional[LaunchEnv]:
    """from_environment(), written back as RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT
    (and LOCAL_WORLD_SIZE when known) into `environ` (default os.environ). Returns what it wrote;
    None (nothing written) for a plain process."""
    env = os.environ if environ is None else environ
    found = from_environment(env, use_scontrol=use_scontrol)
    return None if found is None else export(found, env)
