"""The built-in routers' pieces that need torch, one module per router, each handing its own to
the router registry (megatron_kappa.routers.implement) when imported. Importing this package
imports all three: megatron_kappa.model.build does, before it asks the registry for a router or a
layer.

Modules:
  sigmoid.py  The sigmoid router's pieces (megatron_kappa.routers' `sigmoid` entry): softmax's top-k
              router and MoE layer (megatron scores them by sigmoid through its settings), and the
              expert bias moved toward balance after every optimizer step (Trinity's aux-loss-free
              balancing)
  softmax.py  The softmax router's pieces (megatron_kappa.routers' `softmax` entry): megatron's
              top-k router, or its z-loss or κ subclass, in megatron's MoE layer or the sorted one;
              the sigmoid router uses the same two (model/routers/sigmoid.py)
  softmoe.py  The SoftMoE router's pieces (megatron_kappa.routers' `softmoe` entry): its router
              (with the logit channel for κ experts), the MoE layer that runs a variable number of
              experts per token, and its metrics for metrics.jsonl (logging steps only; one all-
              reduce for all layers)
"""
from megatron_kappa.model.routers import sigmoid, softmax, softmoe  # noqa: F401  (each gives its pieces)
