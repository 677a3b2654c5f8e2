"""Process groups, the device, and seeds: torch.distributed + megatron's parallel state.

The device is decided once here, at start-up: `cuda:LOCAL_RANK` where CUDA is available, else
the CPU (or what MEGATRON_KAPPA_DEVICE says: `cpu` pins a process to the CPU on a GPU machine, as
the CPU tests do). Everything that creates tensors takes it from `current_device()` or is handed
it by the caller. The backend follows the device: NCCL on CUDA, gloo on the CPU.

Works under every launcher users know (`deepspeed`, `torchrun`, `srun`, `mp.spawn`) and as a
plain `python` process (a world of one).

Failures: every group (torch's default one and megatron's) waits `parallel.timeout_s` for the
other ranks, then the collective fails instead of hanging for torch's default 30 minutes (gloo);
on NCCL the watchdog then takes the process down (TORCH_NCCL_ASYNC_ERROR_HANDLING=3, torch's
default, set explicitly). `control_group()` is a gloo group beside them for small host-side
messages (the stop agreement of megatron_kappa.train.preemption); `barrier_group()` is a second
one, used only to name an unresponsive rank (megatron_kappa.parallel.failures).
"""
from __future__ import annotations

import datetime
import gc
import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_kappa.config import ConfigError, ParallelConfig
from megatron_kappa.config.world import check_world
from megatron_kappa.parallel import compat, launch_env, network, roll_call
from megatron_kappa.parallel.launch_env import DEVICE_ENV

_device: torch.device | None = None
_control: tuple | None = None  # (the default group it was made for, control group, barrier group, hosts)
_controls_made = 0  # in this process: the same count on every rank (the roll call's key)
_timeout_s: float | None = None  # of the last init_distributed


def pick_device(requested: str | None = None) -> torch.device:
    """`cuda:LOCAL_RANK` when CUDA is available (or requested), else the CPU."""
    requested = requested or os.environ.get(DEVICE_ENV) or "auto"
    if requested not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"{DEVICE_ENV}: expected auto, cpu or cuda, got {requested!r}")
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError(f"{DEVICE_ENV}=cuda but CUDA is not available on this machine")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def current_device() -> torch.device:
    """The device of this process (decided by the first `init_distributed`; the CPU before)."""
    return _device if _device is not None else pick_device()


def init_process_group(device: torch.device, timeout_s: float | None = None) -> bool:
    """Join the group a launcher describes in the environment, or make a world of one.
    True when this call created the group (and so should destroy it)."""
    if dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    found = launch_env.export_environment()
    if found is not None:  # deepspeed, torchrun, srun
        network.export_socket_interface(found)  # not loopback when the hosts name themselves 127.0.1.1
        if device.type == "cuda":
            torch.cuda.set_device(device)
            # a timed-out or failed NCCL collective takes the process down (the launcher then
            # ends the job) instead of leaving it blocked; 3 is torch's default, pinned here
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        dist.init_process_group(backend, timeout=timeout, device_id=device if device.type == "cuda" else None)
    else:  # plain `python`: a world of one
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{launch_env.free_port()}",
                                rank=0, world_size=1, timeout=timeout)
    return True


def init_distributed(par: ParallelConfig, seed: int, num_experts: int | None = None,
                     device: torch.device | str | None = None,
                     timeout_s: float | None = None) -> torch.device:
    """Create the default process group (if the launcher has not) and megatron's groups; returns
    this process's device. Collectives time out after `timeout_s` (default: par.timeout_s)."""
    global _device, _timeout_s
    timeout_s = _timeout_s = timeout_s or par.timeout_s
    launch_env.export_environment()  # under srun, LOCAL_RANK (and so the GPU) comes from Slurm's variables
    _device = torch.device(device) if device is not None else pick_device()
    compat.apply(_device)
    init_process_group(_device, timeout_s)
    control_group()  # now, while every rank is here: it must exist before anything can fail
    check_world(par, dist.get_world_size(), num_experts)
    if parallel_state.model_parallel_is_initialized():
        current = (parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_expert_model_parallel_world_size(),
                   parallel_state.get_expert_tensor_parallel_world_size(),
                   parallel_state.get_pipeline_model_parallel_world_size(),
                   parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1,
                   parallel_state.get_context_parallel_world_size())
        if current == (par.tp, par.ep, par.expert_tp, par.pp, par.vpp,
                       par.cp):  # same layout: keep the groups (creating more is slow)
            set_seed(seed)
            return _device
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp if par.vpp > 1 else None,  # interleaved 1F1B's chunks
        context_parallel_size=par.cp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=par.expert_tp,
        create_gloo_process_groups=False,
        distributed_timeout_minutes=timeout_s / 60,  # a timedelta(minutes=...) inside: fractions work
    )
    set_seed(seed)
    return _device


def set_seed(seed: int):
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def dp_mean(value: torch.Tensor) -> torch.Tensor:
    """The mean of `value` over the data-parallel group, as a tensor on value's device (no host
    sync: call `.item()` only where the number is needed)."""
    value = value.detach().clone().float()
    group = parallel_state.get_data_parallel_group()
    if dist.get_world_size(group) > 1:
        dist.all_reduce(value, group=group)
        value /= dist.get_world_size(group)
    return value


def stage_group():
    """The ranks of this rank's pipeline stage (TP × DP, with the expert groups inside it): the
    group for statistics over the layers a stage holds. None (the world) without pipeline stages."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_and_data_parallel_group()


def merge_stages(values: dict) -> dict:
    """Every pipeline stage's `values` (keys disjoint: each names its stage's layers) in one dict,
    on every rank (collective over the pipeline group; a no-op without pipeline stages)."""
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return values
    every = [None] * parallel_state.get_pipeline_model_parallel_world_size()
    dist.all_gather_object(every, values, group=parallel_state.get_pipeline_model_parallel_group())
    return {k: v for stage in every for k, v in stage.items()}


def pipeline_sum(value: torch.Tensor) -> torch.Tensor:
    """`value` summed over the pipeline stages (each holds part of the layers); unchanged without."""
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        value = value.clone()
        dist.all_reduce(value, group=parallel_state.get_pipeline_model_parallel_group())
    return value


def collective_timeout_s() -> float:
    """Seconds a collective waits (the last init_distributed's timeout; torch's gloo default of
    30 min before any)."""
    return _timeout_s or 1800.0


def control_group() -> dist.ProcessGroup:
    """A gloo group of every rank, for a few bytes on the host now and then: gloo whatever the
    device, so its messages never wait for the GPU's queue, and apart from the training groups,
    so an asynchronous message there never interleaves with theirs. Made on the first call after
    the default group exists (a collective call: every rank makes it at the same point), with the
    timeout of the last `init_distributed`. Its first message is every rank's host name
    (`rank_hosts`), so that a failure later can say where the ranks that stopped answering run;
    then this rank starts answering roll calls (megatron_kappa.parallel.roll_call) until
    `teardown`."""
    global _control, _controls_made
    world = dist.group.WORLD
    if _control is None or _control[0] is not world:
        timeout = datetime.timedelta(seconds=_timeout_s) if _timeout_s else None
        group = dist.new_group(backend="gloo", timeout=timeout)
        barrier = dist.new_group(backend="gloo", timeout=timeout)
        hosts = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        _control = (world, group, barrier, hosts)
        _controls_made += 1
        roll_call.start_answering(_controls_made)
    return _control[1]


def barrier_group() -> dist.ProcessGroup:
    """A gloo group of every rank that carries nothing but the monitored barrier naming a hung
    rank, made with the control group. Not the control group itself: when a collective on a gloo
    group times out, gloo closes that group's connections ("Application timeout caused pair
    closure"), and a barrier there would fail at once without naming anyone; the stop agreement's
    message on the control group is often the one that times out."""
    control_group()
    return _control[2]


def rank_hosts() -> list[str] | None:
    """Each rank's host name, gathered when the control group was made (None before)."""
    return _control[3] if _control is not None else None


def teardown(peers_alive: bool = True):
    """Leave every process group before the process exits; call it last, with the model and the
    engine already dropped by the caller.

    torch's destroy_process_group only unregisters a gloo group: its C++ object (worker threads,
    the TCP pairs to every peer and their event loop) lives as long as a Python reference does.
    Megatron's parallel state, our control group and every megatron module keep such references
    in module globals, so without this the groups were destroyed while the interpreter shut
    down, racing the C++ runtime's own teardown: now and then a rank died with SIGABRT
    ("terminate called without an active exception") after its work had finished. Here the
    references go first and a garbage collection destroys the groups (joining their threads)
    while everything is alive.

    `peers_alive`: every rank reached this point (normal end): a barrier first, so no rank closes
    its connections while a peer still waits on one of them. After a failure, no barrier."""
    global _control
    if dist.is_initialized() and peers_alive and dist.get_world_size() > 1:
        try:
            dist.barrier(group=control_group())
        except RuntimeError:  # a peer already gone (it failed after all): nobody left to wait for
            peers_alive = False
    roll_call.stop_answering(release=peers_alive)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _control = None
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()
