"""Model FLOPs per token and MFU, against a count by hand for configs/tiny.yaml."""
import pytest
import torch

from megatron_kappa.config import load_config
from megatron_kappa.metrics import throughput
from megatron_kappa.summary import summarize


def test_flops_per_token_of_tiny_by_hand(world1):
    cfg = load_config("configs/tiny.yaml")
    d, layers, heads, ffn, vocab, seq, experts, topk = 64, 4, 4, 256, 2048, 128, 4, 2
    attention = layers * (3 * d * d + d * d)                 # qkv and output projections
    norms = layers * (2 * d + 2 * (d // heads)) + d           # input/pre-MLP, q/k norms; final norm
    dense_mlp = 1 * 3 * d * ffn                               # first_dense = 1
    routers = 3 * experts * d
    experts_active = 3 * topk * (3 * d * ffn + 2 * ffn)       # top-2 of 4 experts (with κ's α, b)
    output_layer = vocab * d                                  # the input embedding is a lookup
    by_hand = 6 * (attention + norms + dense_mlp + routers + experts_active + output_layer) \
        + 12 * layers * d * seq
    assert by_hand == 3_664_512
    assert throughput.flops_per_token(cfg.model, summarize(cfg)) == by_hand
    # Negative control: another sequence length changes the count (the attention term).
    other = load_config("configs/tiny.yaml", ["model.seq_length=256"])
    assert throughput.flops_per_token(other.model, summarize(other)) == by_hand + 12 * layers * d * 128


def test_mfu_from_tokens_per_second():
    cfg = load_config("configs/tiny.yaml", ["log.peak_tflops=100"])
    peak = throughput.peak_tflops(cfg.log, torch.device("cpu"))
    assert peak == 100
    out = throughput.throughput(tokens_per_s=2e6, flops_token=3e8, world=4, peak=peak)
    assert out["tflops_per_gpu"] == pytest.approx(150.0)  # 2e6 × 3e8 / 4 / 1e12
    assert out["mfu"] == pytest.approx(1.5)
    assert "mfu" not in throughput.throughput(1e3, 1e6, 1, throughput.peak_tflops(load_config(None).log,
                                                                                  torch.device("cpu")))
