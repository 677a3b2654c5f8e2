"""Process groups and seeds: torch.distributed (gloo on CPU, NCCL on GPU) + megatron parallel state.

Works under every launcher users know (`deepspeed`, `torchrun`, `mp.spawn`) and as a plain
`python` process (a world of one).
"""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

from megatron_kappa import compat
from megatron_kappa.config import ConfigError, ParallelConfig


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_layout(par: ParallelConfig, world: int, num_experts: int | None = None):
    """One-line errors for a layout that cannot be built on `world` ranks."""
    etp = par.etp or par.tp
    if world % par.tp:
        raise ConfigError(f"config: parallel.tp: world size {world} is not divisible by tp={par.tp}")
    if world % (etp * par.ep):
        raise ConfigError(f"config: parallel.ep: world size {world} is not divisible by "
                          f"ep × etp = {par.ep} × {etp}")
    if num_experts is not None and num_experts % par.ep:
        raise ConfigError(f"config: parallel.ep: {num_experts} experts are not divisible by ep={par.ep}")


def init_distributed(par: ParallelConfig, seed: int, num_experts: int | None = None):
    """Create the default process group (if the launcher has not) and megatron's groups."""
    compat.apply()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if "RANK" in os.environ and "MASTER_ADDR" in os.environ:  # deepspeed, torchrun, srun wrapper
            check_layout(par, world, num_experts)
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend)
        elif world > 1:
            raise ConfigError(f"WORLD_SIZE={world} but MASTER_ADDR is not set: start multi-process "
                              "runs with deepspeed or torchrun")
        else:  # plain `python`: a world of one
            check_layout(par, 1, num_experts)
            dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}",
                                    rank=0, world_size=1)
    check_layout(par, dist.get_world_size(), num_experts)
    etp = par.etp or par.tp
    if parallel_state.model_parallel_is_initialized():
        current = (parallel_state.get_tensor_model_parallel_world_size(),
                   parallel_state.get_expert_model_parallel_world_size(),
                   parallel_state.get_expert_tensor_parallel_world_size())
        if current == (par.tp, par.ep, etp):  # same layout: keep the groups (creating more is slow)
            set_seed(seed)
            return
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par.tp,
        expert_model_parallel_size=par.ep,
        expert_tensor_parallel_size=etp,
        create_gloo_process_groups=False,
    )
    set_seed(seed)


def set_seed(seed: int):
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def teardown():
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
