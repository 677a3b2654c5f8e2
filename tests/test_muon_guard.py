"""Muon/Aurora's non-finite guard (megatron_kappa.optim.muon.update_fn): one finiteness check of
the direction. A finite step equals matrix_update's (the reference: momentum, then orthogonalize)
bit for bit; a non-finite gradient anywhere, in any Newton–Schulz block, leaves the momentum
exactly as it was and passes the gradient through (a loss scaler still sees the overflow).
Negative control: without the guard the same gradient makes the momentum non-finite."""
import pytest
import torch

from megatron_kappa.config import load_config
from megatron_kappa.optim import muon
from megatron_kappa.optim.matrix import as_blocks, matrix_update


def update(optimizer):
    train = load_config("configs/tiny.yaml", [f"train.optimizer={optimizer}"]).train
    return train, muon.update_fn(train)


def data(seed=0, shape=(8, 12)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g) * 0.1


@pytest.mark.parametrize("optimizer", ["muon", "aurora"])
@pytest.mark.parametrize("heads", [None, 2])
def test_finite_step_equals_the_reference(optimizer, heads):
    train, fn = update(optimizer)
    grad, momentum = data()
    mu = train.muon
    ref_buf = momentum.clone()
    ref = matrix_update(grad, ref_buf, 0.9, mu.nesterov, blocks=as_blocks(heads), method=optimizer,
                        ns_steps=mu.ns_steps, scale_mode=mu.scale, max_scale=mu.max_scale,
                        rounds=mu.aurora_rounds, exponent=mu.aurora_exponent)
    out = fn(grad, momentum, beta=0.9, num_heads=heads)
    assert torch.equal(out, ref) and torch.equal(momentum, ref_buf)


@pytest.mark.parametrize("optimizer", ["muon", "aurora"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("heads", [None, 2])
def test_nonfinite_gradient_keeps_the_momentum_and_passes_through(optimizer, bad, heads):
    _, fn = update(optimizer)
    grad, momentum = data(1)
    grad[7, 3] = bad  # in the second of two row blocks
    before = momentum.clone()
    out = fn(grad, momentum, beta=0.9, num_heads=heads)
    assert torch.equal(momentum, before)
    assert torch.equal(out, grad) or torch.allclose(out, grad, equal_nan=True, rtol=0, atol=0)
    # negative control: the unguarded update poisons the momentum
    buf = before.clone()
    matrix_update(grad, buf, 0.9, True, blocks=as_blocks(heads), method=optimizer)
    assert not torch.isfinite(buf).all()
