"""megatron_kappa: κ-SwiGLU Mixture-of-Experts pre-training on megatron-core and DeepSpeed."""

__version__ = "0.1.0"
