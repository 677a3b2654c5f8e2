"""megatron_kappa.parallel.network: the interface the ranks bind when the host's own name
resolves to loopback, against a made-up machine (its interfaces, routes and hosts file). The real
thing, with a negative control, runs on two hosts in tests/test_multinode.py."""
import pytest

from megatron_kappa.parallel import network
from megatron_kappa.parallel.launch_env import LaunchEnv, LaunchEnvError


@pytest.fixture
def machine(monkeypatch):
    """A host "node1" with interfaces and a hosts file the test sets."""
    state = {"hosts": {"node1": "127.0.1.1", "node2": "10.0.0.12"},
             "ifaces": {"lo": "127.0.0.1", "eth0": "10.0.0.11"},
             "routes": {"10.0.0.12": "10.0.0.11"}}
    monkeypatch.setattr(network.socket, "gethostname", lambda: "node1")
    monkeypatch.setattr(network, "_resolve", lambda h: state["hosts"].get(h, h if h[0].isdigit() else None))
    monkeypatch.setattr(network, "interface_addresses", lambda: dict(state["ifaces"]))
    monkeypatch.setattr(network, "_source_address", lambda a: state["routes"].get(a))
    return state


def slurm(rank=0, world=4, local=2, master="node1"):
    return LaunchEnv(rank, world, rank % local, master, 12345, "slurm", local)


SLURM = {"SLURM_STEP_NODELIST": "node[1-2]", "SLURM_STEP_NUM_NODES": "2"}


def test_loopback_name_picks_the_interface_that_routes_to_the_other_host(machine):
    machine["ifaces"]["ib0"] = "192.168.1.11"  # two candidates: the route decides
    env = dict(SLURM)
    assert network.export_socket_interface(slurm(), env) == "eth0"
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "eth0"


def test_routable_name_user_choice_and_one_host_are_left_alone(machine):
    env = dict(SLURM, GLOO_SOCKET_IFNAME="ib0")
    assert network.export_socket_interface(slurm(), env) is None and env["GLOO_SOCKET_IFNAME"] == "ib0"
    assert "NCCL_SOCKET_IFNAME" not in env
    one_host = {"SLURM_STEP_NODELIST": "node1", "SLURM_STEP_NUM_NODES": "1"}
    assert network.export_socket_interface(slurm(world=2, local=2), dict(one_host)) is None
    machine["hosts"]["node1"] = "10.0.0.11"   # a hosts file that names the machine by its address
    env = dict(SLURM)
    assert network.export_socket_interface(slurm(), env) is None and "GLOO_SOCKET_IFNAME" not in env


def test_torchrun_on_the_rendezvous_host_falls_back_to_the_only_interface(machine):
    """torchrun on node1 knows only MASTER_ADDR=node1 (itself, loopback): no route to learn from;
    the one interface with an address outside loopback is the answer."""
    found = LaunchEnv(0, 4, 0, "node1", 29400, "launcher", 2)
    env = {"LOCAL_WORLD_SIZE": "2"}
    assert network.export_socket_interface(found, env) == "eth0"


def test_ambiguous_multi_host_is_one_line_error(machine):
    machine["ifaces"]["ib0"] = "192.168.1.11"
    machine["routes"] = {}  # the other host is not reachable through any interface we know
    with pytest.raises(LaunchEnvError) as e:
        network.export_socket_interface(slurm(), dict(SLURM))
    msg = str(e.value)
    assert "\n" not in msg and "'node1' resolves to 127.0.1.1" in msg and "eth0, ib0" in msg
    assert "GLOO_SOCKET_IFNAME" in msg
    # the same machine when it is not known whether the job spans hosts: gloo's default, no error
    assert network.export_socket_interface(LaunchEnv(0, 4, 0, "node1", 1, "launcher"), {}) is None


def test_interface_addresses_of_this_machine():
    found = network.interface_addresses()
    assert found.get("lo") == "127.0.0.1", found


def test_failure_names_the_hosts_of_the_ranks(monkeypatch):
    from megatron_kappa.parallel import failures, groups
    monkeypatch.setattr(groups, "rank_hosts", lambda: ["node1", "node1", "node2", "node2"])
    assert failures.where("[Rank 0]: Ranks 2, 3 failed to pass monitoredBarrier in 15000 ms") == \
        " (on node2: ranks 2, 3)"
    assert failures.where("Rank 1 failed to pass monitoredBarrier") == " (on node1: rank 1)"
    assert failures.where("something else") == ""


def test_rank_hosts_are_gathered_with_the_control_group(world1):
    import socket

    from megatron_kappa.parallel import groups
    groups.control_group()
    assert groups.rank_hosts() == [socket.gethostname()]
