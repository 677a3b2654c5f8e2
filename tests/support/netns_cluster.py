"""A real 2-host Slurm cluster on this machine, built from Linux network namespaces, for tests.

    with netns_cluster(tmp_path, sshd=True) as cluster:
        job = cluster.submit("launch/slurm/pretrain.sbatch", ..., options=["--nodes=2", ...])
        cluster.wait(job)                          # SlurmCluster's job helpers, unchanged
        cluster.run("hostname", host="node2")      # any command "on" a host
        cluster.link("node2", up=False)            # pull node2's cable

Each host is a network namespace with its own interface (eth0 on a bridge), address, hostname and
hosts file; the Slurm controller lives in a third one ("ctl", the bridge's end). One slurmd per
host, optionally one sshd per host (key-only root login) for pdsh and `deepspeed --hostfile`.
Nothing is added to the machine's own network namespace and /etc is never edited: each command
enters its host through `nsenter --net` + `unshare --mount --uts` and tests/support/netns_host.sh, which
bind-mounts the host's hosts file and sets its hostname. Processes share the machine's pid
namespace and file system, so the test sees and signals every rank and reads every file.

By default each host's own name resolves to 127.0.1.1 in its hosts file, as on a stock Debian or
Ubuntu machine: gloo then binds loopback unless the launch environment picks the interface
(megatron_kappa/parallel/network.py), which is what these hosts test.

Authentication is auth/none, as in tests/support/slurm_cluster.py; here the daemons listen only inside
namespaces no other process can reach. Teardown: SlurmCluster's (jobs cancelled, daemons stopped,
marked processes killed), then every process left in the namespaces, then the namespaces. A
cluster whose test process died is removed by the next one (the owner's pid is in the names).
Skips (pytest.skip, with the reason) without Slurm, root or network namespaces.
"""
from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal as _signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.support.slurm_cluster import SlurmCluster, SlurmError, _which, shared_settings
from tests.support.slurm_cluster import missing_reason as _slurm_missing

HOST_SH = Path(__file__).resolve().with_name("netns_host.sh")
SUBNET = "10.77.0"           # private, and only inside namespaces made here
NETNS_DIR = Path("/run/netns")
_NAME = re.compile(r"^kpt(\d+)x[0-9a-f]+-")


def missing_reason(sshd: bool = False) -> str | None:
    """Why a namespace cluster cannot start here, or None."""
    reason = _slurm_missing()
    if reason:
        return reason
    for exe in ("ip", "nsenter", "unshare", "mount") + (("sshd", "ssh", "ssh-keygen", "pdsh") if sshd else ()):
        if shutil.which(exe) is None and not Path("/usr/sbin", exe).exists():
            return f"{exe} not installed (.ci/run installs openssh-server and pdsh)"
    probe = f"kpprobe{secrets.token_hex(3)}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ns_pids(ns: str) -> list[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _remove_namespaces(names, grace: float = 3.0):
    """Kill every process in the namespaces (TERM, then KILL), then delete them."""
    for sig, wait in ((_signal.SIGTERM, grace), (_signal.SIGKILL, 2.0)):
        pids = [p for ns in names for p in _ns_pids(ns)]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while pids and time.monotonic() < deadline:
            pids = [p for ns in names for p in _ns_pids(ns)]
            time.sleep(0.1)
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _remove_orphans():
    """Namespaces of clusters whose test process is gone."""
    if not NETNS_DIR.is_dir():
        return
    gone = [p.name for p in NETNS_DIR.iterdir()
            if (m := _NAME.match(p.name)) and not Path(f"/proc/{m.group(1)}").exists()]
    if gone:
        _remove_namespaces(gone, grace=0.5)


class NetnsCluster(SlurmCluster):
    """SlurmCluster over hosts in network namespaces. `self.node` is the first host."""

    def __init__(self, root: Path, hosts=("node1", "node2"), cpus: int = 2, kill_wait: int = 10,
                 requeue_delay: int = 10, slurmd_timeout: int = 20, self_loopback: bool = True,
                 sshd: bool = False):
        super().__init__(root, cpus, kill_wait, requeue_delay)
        self.hosts = list(hosts)
        self.node = self.hosts[0]
        self.slurmd_timeout = slurmd_timeout
        self.self_loopback = self_loopback
        self.sshd = sshd
        tag = f"kpt{os.getpid()}x{secrets.token_hex(3)}"
        self.ns = {h: f"{tag}-{h}" for h in ["ctl", *self.hosts]}
        self.addr = {"ctl": f"{SUBNET}.1", **{h: f"{SUBNET}.{11 + i}" for i, h in enumerate(self.hosts)}}
        self.bin = root / "bin"   # the ssh wrapper (put first in PATH for pdsh and deepspeed)

    # ---- hosts -----------------------------------------------------------------------------------

    def hosts_file(self, host: str) -> Path:
        return self.root / "hosts" / host

    def wrap(self, host: str, argv) -> list[str]:
        """argv as run "on" `host`: its network, hostname and hosts file."""
        return ["nsenter", f"--net={NETNS_DIR / self.ns[host]}", "unshare", "--mount", "--uts", "--",
                "bash", str(HOST_SH), host, str(self.hosts_file(host)), *map(str, argv)]

    def run(self, *cmd, host: str = "ctl", check: bool = True, timeout: float = 60,
            env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
        """A command on `host` (default the controller: sbatch, scontrol, squeue ...)."""
        return super().run(*self.wrap(host, cmd), check=check, timeout=timeout, env=env, cwd=cwd)

    def popen(self, *cmd, host: str, env: dict | None = None, cwd=None, log: Path) -> subprocess.Popen:
        """A long command on `host`, output to `log`; killed by stop() with the namespaces."""
        with open(log, "ab") as f:
            return subprocess.Popen(self.wrap(host, cmd), env={**self.env, **(env or {})}, cwd=cwd,
                                    stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)

    def link(self, host: str, up: bool):
        """Bring `host`'s network interface down (a pulled cable) or up again. Up again, its slurmd
        is told to register (SIGHUP, as an admin restarting it after the repair): slurmctld pings a
        DOWN node only every ~100 s, after which it would come back by itself."""
        subprocess.run(["ip", "-n", self.ns[host], "link", "set", "eth0", "up" if up else "down"],
                       check=True)
        if up:
            self._procs[f"slurmd-{host}"].send_signal(_signal.SIGHUP)

    def host_pids(self, host: str) -> list[int]:
        return _ns_pids(self.ns[host])

    # ---- building it -----------------------------------------------------------------------------

    def _make_net(self):
        ctl = self.ns["ctl"]
        def sh(*a):
            return subprocess.run(a, check=True, capture_output=True, text=True)
        for ns in self.ns.values():
            sh("ip", "netns", "add", ns)
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        sh("ip", "-n", ctl, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", ctl, "addr", "add", f"{self.addr['ctl']}/24", "dev", "br0")
        sh("ip", "-n", ctl, "link", "set", "br0", "up")
        for h in self.hosts:
            sh("ip", "-n", ctl, "link", "add", f"v-{h}", "type", "veth", "peer", "name", "eth0",
               "netns", self.ns[h])
            sh("ip", "-n", ctl, "link", "set", f"v-{h}", "master", "br0", "up")
            sh("ip", "-n", self.ns[h], "addr", "add", f"{self.addr[h]}/24", "dev", "eth0")
            sh("ip", "-n", self.ns[h], "link", "set", "eth0", "up")

    def _write_hosts(self):
        (self.root / "hosts").mkdir(parents=True, exist_ok=True)
        for me in ["ctl", *self.hosts]:
            lines = ["127.0.0.1 localhost"]
            for h, a in self.addr.items():
                own = h == me and me != "ctl" and self.self_loopback
                lines.append(f"{'127.0.1.1' if own else a} {h}")
            self.hosts_file(me).write_text("\n".join(lines) + "\n")

    def _write_conf(self, ctld_port: int = 6817, slurmd_port: int = 6818):
        r = self.root
        for d in ("state", "log", "jobs"):
            (r / d).mkdir(parents=True, exist_ok=True)
        self._link_short_root()
        nodes = "\n".join(f"NodeName={h} NodeHostname={h} NodeAddr={self.addr[h]} CPUs={self.ncpus} "
                          f"RealMemory=2000 State=UNKNOWN" for h in self.hosts)
        self.conf.write_text(f"""\
# test cluster {self.name} (tests/support/netns_cluster.py); all state under {r}
ClusterName={self.name}
SlurmctldHost=ctl({self.addr['ctl']})
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
{shared_settings(r, self.kill_wait, self.requeue_delay, f'{self.short_root}/spool-%n')}\
# a host that stops answering is DOWN after SlurmdTimeout; its jobs end (NODE_FAIL)
SlurmdTimeout={self.slurmd_timeout}
MessageTimeout=5
{nodes}
PartitionName=debug Nodes={','.join(self.hosts)} Default=YES MaxTime=INFINITE State=UP
""")

    def _spawn_on(self, name: str, host: str, argv):
        self._spawn(name, self.wrap(host, argv))

    def _start_sshd(self):
        d = self.root / "ssh"
        d.mkdir(mode=0o700, exist_ok=True)
        key, hostkey = d / "id_ed25519", d / "host_ed25519"
        for k in (key, hostkey):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(k)], check=True)
        shutil.copy(f"{key}.pub", d / "authorized_keys")
        pub = " ".join(Path(f"{hostkey}.pub").read_text().split()[:2])
        (d / "known_hosts").write_text("".join(f"{h},{self.addr[h]} {pub}\n" for h in self.hosts))
        (d / "ssh_config").write_text(
            f"Host *\n  User root\n  IdentityFile {key}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {d / 'known_hosts'}\n  GlobalKnownHostsFile /dev/null\n"
            "  StrictHostKeyChecking yes\n  PasswordAuthentication no\n  BatchMode yes\n"
            "  LogLevel ERROR\n  ConnectTimeout 5\n")
        self.bin.mkdir(exist_ok=True)
        wrapper = self.bin / "ssh"   # pdsh and deepspeed call plain `ssh HOST CMD`
        wrapper.write_text(f"#!/bin/sh\nexec {shutil.which('ssh')} -F {d / 'ssh_config'} \"$@\"\n")
        wrapper.chmod(0o755)
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
        for h in self.hosts:
            conf = d / f"sshd_config.{h}"
            conf.write_text(
                f"ListenAddress 0.0.0.0\nPort 22\nHostKey {hostkey}\nPidFile {self.root}/sshd-{h}.pid\n"
                f"PermitRootLogin prohibit-password\nPubkeyAuthentication yes\n"
                f"AuthorizedKeysFile {d / 'authorized_keys'}\nPasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\nPrintMotd no\n"
                f"SetEnv SLURM_CONF={self.conf} PATH={self.bin}:{self.env['PATH']}\n")
            self._spawn_on(f"sshd-{h}", h, [_which("sshd"), "-D", "-e", "-f", str(conf)])

    def _idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=10)
        states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
        return out.returncode == 0 and all(states.get(h, "").rstrip("*") == "idle" for h in self.hosts)

    def _start_once(self, timeout: float) -> bool:
        self._make_net()
        self._write_hosts()
        self._write_conf()
        self._spawn_on("slurmctld", "ctl", [_which("slurmctld"), "-D", "-i", "-f", self.conf])
        for h in self.hosts:
            self._spawn_on(f"slurmd-{h}", h, [_which("slurmd"), "-D", "-f", self.conf, "-N", h])
        if self.sshd:
            self._start_sshd()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, p in self._procs.items():
                if p.poll() is not None:
                    raise SlurmError(f"{name} exited with status {p.returncode}\n{self._log_tail()}")
            with contextlib.suppress(subprocess.TimeoutExpired):
                if self._idle():
                    return True
            time.sleep(0.3)
        raise SlurmError(f"hosts not idle after {timeout:.0f} s\n{self._log_tail()}")

    def wait_idle(self, timeout: float = 90):
        """Until every host is idle again (after a failure: ReturnToService=2 brings it back)."""
        deadline = time.monotonic() + timeout
        while not self._idle():
            if time.monotonic() > deadline:
                raise TimeoutError(f"hosts not idle after {timeout:.0f} s: "
                                   f"{self.run('sinfo', '-N', check=False).stdout}")
            time.sleep(0.5)

    def start(self, timeout: float = 60, tries: int = 1):
        _remove_orphans()  # namespaces; SlurmCluster.start kills the processes of dead clusters
        return super().start(timeout, tries)

    def stop(self):
        try:
            super().stop()
        finally:
            _remove_namespaces([ns for ns in self.ns.values() if (NETNS_DIR / ns).exists()])


@contextlib.contextmanager
def netns_cluster(tmp_path, *, sshd: bool = False, timeout: float = 60, **kwargs):
    """Start a 2-host cluster under tmp_path/netns, yield a NetnsCluster, stop it whatever
    happens (keyword arguments: NetnsCluster's)."""
    reason = missing_reason(sshd)
    if reason:
        pytest.skip(reason)
    root = Path(tmp_path) / "netns"
    root.mkdir(parents=True, exist_ok=True)
    cluster = NetnsCluster(root, sshd=sshd, **kwargs)
    try:
        cluster.start(timeout)
        yield cluster
    finally:
        cluster.stop()
