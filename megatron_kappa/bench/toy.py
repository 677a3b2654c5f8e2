"""Tiny stand-ins for tests and benchmarks: a byte-level tokenizer and a small causal LM.

They implement exactly the interfaces the evaluators use (encode/bos/eod/pad/vocab_size/
token_byte_lengths, and logits_fn(tokens[B, T]) -> logits[B, T, V]), with no files or training.
"""
from __future__ import annotations

import torch


class ByteTokenizer:
    """UTF-8 bytes as tokens: id = byte + 4. Ids 0..3 are unk/bos/eod/pad like the project tokenizer."""

    bos, eod, pad, vocab_size = 1, 2, 3, 260

    def encode(self, text: str) -> list:
        return [b + 4 for b in text.encode("utf-8")]

    def decode(self, ids) -> str:
        return bytes(int(i) - 4 for i in ids if int(i) >= 4).decode("utf-8", errors="replace")

    def token_byte_lengths(self) -> list:
        return [0] * 4 + [1] * 256


class Block(torch.nn.Module):
    """Pre-norm transformer block; attention through scaled_dot_product_attention(is_causal=True),
    the memory-efficient kernel real models use, so batching costs no more per token."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyCausalLM(torch.nn.Module):
    """Embedding + learned positions -> causal transformer blocks -> vocab logits. Weights come from
    `seed`, so every process building it gets the same model."""

    def __init__(self, vocab=260, dim=64, layers=2, heads=4, max_seq_len=256, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.max_seq_len = max_seq_len
        self.emb = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(0.02 * torch.randn(max_seq_len, dim))
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)
        self.eval()

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens) + self.pos[:tokens.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(h)
