"""The network interface gloo and NCCL use when a job spans several hosts.

gloo binds the address its host's name resolves to. On a stock Debian or Ubuntu machine the
hosts file maps the machine's own name to 127.0.1.1, so every rank of a multi-node job would
listen on loopback and the other hosts' ranks could not reach it ("Connection refused
remote=[127.0.1.1]"). When that is the case, and GLOO_SOCKET_IFNAME is not set, this module
sets GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME, which NCCL's bootstrap reads the same way) to
the interface that routes to the job's other hosts: the node list of a Slurm step, else
MASTER_ADDR. When the job spans several hosts and no single interface can be told apart, it
stops with one line saying what it found and which variable to set.
"""
from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import sys
from typing import Iterable, MutableMapping, Optional

from megatron_kappa.parallel.launch_env import LaunchEnv, LaunchEnvError, expand_hostlist

__all__ = ["choose_interface", "export_socket_interface", "interface_addresses"]

_SIOCGIFADDR = 0x8915


def _resolve(host: str) -> Optional[str]:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return None


def _loopback(addr: Optional[str]) -> bool:
    return addr is not None and ipaddress.ip_address(addr).is_loopback


def interface_addresses() -> dict:
    """{interface name: its IPv4 address} for every interface with one (loopback included)."""
    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address, or down
                continue
            found[name] = socket.inet_ntoa(packed[20:24])
    return found


def _source_address(addr: str) -> Optional[str]:
    """The local address the kernel would send from to reach `addr` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((addr, 9))
            return s.getsockname()[0]
        except OSError:
            return None


def choose_interface(peers: Iterable[str], multi_host: Optional[bool]) -> Optional[str]:
    """The interface to bind, or None to leave gloo's default (this host's name resolves to a
    routable address, or the job is on one host). `peers`: host names or addresses of the job's
    other hosts (and the rendezvous host). `multi_host`: whether the job spans several hosts
    (None: not known). Raises LaunchEnvError when it spans several and none can be chosen."""
    if multi_host is False:
        return None
    me = socket.gethostname()
    own = _resolve(me)
    if own is not None and not _loopback(own):
        return None
    by_address = {a: name for name, a in interface_addresses().items()}
    routed = set()
    for peer in peers:
        addr = _resolve(peer)
        if addr is None or _loopback(addr):
            continue
        src = _source_address(addr)
        if src is not None and not _loopback(src) and src in by_address:
            routed.add(by_address[src])
    if len(routed) == 1:
        return routed.pop()
    others = sorted(n for a, n in by_address.items() if not _loopback(a))
    if not routed and len(others) == 1:
        return others[0]
    if multi_host is None:
        return None
    what = f"the routes to the other hosts use {', '.join(sorted(routed))}" if routed else (
        f"the interfaces with an address are {', '.join(others)}" if others else "no interface has an IPv4 address")
    raise LaunchEnvError(f"cannot tell which network interface the ranks of this multi-node job should use: "
                         f"this host's name {me!r} resolves to {own or 'nothing'} and {what}; "
                         f"set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) to the interface that reaches the other "
                         f"hosts")


def _peers(found: LaunchEnv, environ) -> list:
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    hosts = []
    if found.source == "slurm" and nodelist:
        try:
            hosts = expand_hostlist(nodelist)
        except LaunchEnvError:
            hosts = []
    me = socket.gethostname()
    return [h for h in hosts if h != me] + [found.master_addr]


def _multi_host(found: LaunchEnv, environ) -> Optional[bool]:
    nnodes = environ.get("SLURM_STEP_NUM_NODES") if found.source == "slurm" else environ.get("CROSS_SIZE")
    if nnodes and nnodes.isdigit():
        return int(nnodes) > 1
    if found.local_world_size is not None:
        return found.local_world_size < found.world_size
    if environ.get("LOCAL_SIZE", "").isdigit():  # deepspeed's launcher
        return int(environ["LOCAL_SIZE"]) < found.world_size
    return None


def export_socket_interface(found: Optional[LaunchEnv], environ: Optional[MutableMapping] = None
                            ) -> Optional[str]:
    """Set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME in `environ` (default os.environ) when gloo's
    default would be loopback on a multi-host job; returns the interface set, else None. A value
    already set is the user's choice and wins."""
    env = os.environ if environ is None else environ
    if found is None or found.world_size == 1 or env.get("GLOO_SOCKET_IFNAME"):
        return None
    name = choose_interface(_peers(found, env), _multi_host(found, env))
    if name is not None:
        env["GLOO_SOCKET_IFNAME"] = name
        env.setdefault("NCCL_SOCKET_IFNAME", name)
        if found.local_rank == 0:  # once per host
            me = socket.gethostname()
            print(f"[{me}] the ranks bind {name} ({interface_addresses().get(name)}): this host's name "
                  f"resolves to {_resolve(me) or 'nothing'} (GLOO_SOCKET_IFNAME={name})", file=sys.stderr, flush=True)
    return name
