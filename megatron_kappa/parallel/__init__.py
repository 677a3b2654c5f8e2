"""Parallelism: how the model is spread over processes and how its gradients meet again.

Modules:
  compat.py          Every patch the stack needs to run on the CPU (gloo), in one place, applied
                     only there
  context.py         Context parallelism's data side (`parallel.cp`): each rank's chunks of a batch,
                     and the loss reduced over the context-parallel group
  engine.py          DeepSpeed around a megatron-core model: the mpu adapter, the expert wiring, the
                     engine
  failures.py        A dead or hung rank: which one, said by the ranks that are left
  grad_precision.py  fp32 gradient accumulation and reduction with bf16 parameters
                     (`train.grad_accum_dtype`)
  grads.py           The gradient reductions megatron-core expects from its caller, written once
  groups.py          Process groups, the device, and seeds: torch.distributed + megatron's parallel
                     state
  launch_env.py      Rank, world size and rendezvous address of this process, from whichever
                     launcher started it
  layout.py          A parallel layout (TP, EP, ETP, PP, CP over a world of ranks): the record of it
                     that checkpoints keep (a resume must use the same one)
  network.py         The network interface gloo and NCCL use when a job spans several hosts
  roll_call.py       The roll call: who is still alive, asked through the rendezvous store
  sharding.py        Move weights between one full (single-process) state dict and any TP/EP/ETP/PP
                     layout
  stage_norm.py      DeepSpeed's ZeRO-1/2 gradient norm when pipeline stages hold different
                     parameter groups
"""
