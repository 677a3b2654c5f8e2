"""Parallelism: how the model is spread over processes and how its gradients meet again.

groups.py      the device, torch.distributed and megatron's process groups, seeds
launch_env.py  rank/world/rendezvous from torchrun, deepspeed or Slurm; free ports
network.py     the interface gloo/NCCL bind on a multi-host job (not loopback)
failures.py    a collective that failed: which ranks no longer answer
grads.py       the gradient reductions megatron-core leaves to its caller
sharding.py    full (single-process) weights <-> any TP/EP/ETP layout
engine.py      DeepSpeed around the megatron model (mpu adapter, expert wiring, ZeRO config)
compat.py      every CPU-only patch (megatron-core, torch.compile, DeepSpeed JIT ops)
"""
