"""The optimizers: the parameter groups, AdamW or Muon/Aurora under DeepSpeed's ZeRO, and every
group's learning-rate and weight-decay schedule (`python -m megatron_kappa.optim --config X`
lists the groups).

Modules:
  __main__.py       `python -m megatron_kappa.optim --config X`: the optimizer's parameter groups of
                    a config (which tensors, the optimizer, the peak learning rate, the weight decay
                    at step 0), on the meta device
  groups.py         The AdamW parameter groups beside the matrices: embedding, output, non-matrix
                    and κ
  matrix.py         The orthogonalised matrix update of Muon and of the κ-SwiGLU authors' "Aurora"
                    (the math only; megatron_kappa.optim.muon runs it inside DeepSpeed's ZeRO)
  muon.py           Muon and Aurora under DeepSpeed's ZeRO-1/2: which parameters, which matrices,
                    the optimizer, and the library patch they need (docs/optimizer.md; fp32 gradient
                    accumulation has its own, megatron_kappa.parallel.grad_precision)
  optimizer.py      The optimizer: the paper's parameter groups and the optimizer built from them
  qk_clip.py        QK-Clip (Kimi K2's MuonClip, `train.qk_clip`): after each optimizer step, the
                    query/key weights of every head whose largest attention logit in the step
                    exceeded τ scaled down, in the model's weights and in ZeRO's fp32 master copy
                    (docs/optimizer.md)
  schedule.py       The learning-rate and weight-decay schedules of every optimizer group, and their
                    peak values
  sharded_alpha.py  κ's α orthogonalised as one [E, F] matrix across its expert-parallel shards, as
                    14c9b04 steps it
"""
