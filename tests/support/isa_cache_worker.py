"""One process of tests/test_compile.py's vector-width cache test: compiles an RMS norm over
16-element rows (the q/k-norm's shape, whose reduction inductor vectorizes), with the inductor
cache folder and ATEN_CPU_CAPABILITY of its environment, and prints the largest difference from
eager. argv[1]: "pin" to pin the vector width as model.compile does, "bare" not to."""
import sys

import torch

from megatron_kappa.model import compile as model_compile


def rms_norm(x, weight):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight


if __name__ == "__main__":
    if sys.argv[1] == "pin":
        model_compile.pin_vector_isa()
    x = torch.randn(128, 48, generator=torch.Generator().manual_seed(0))[:, 16:32]
    weight = torch.linspace(0.5, 1.5, 16)
    got = torch.compile(rms_norm)(x, weight)
    print((got - rms_norm(x, weight)).abs().max().item())
