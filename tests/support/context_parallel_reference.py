"""Context parallelism's token layout written out from its definition, for the CP tests."""
import torch

from megatron_kappa.model.cp_attention import rank_chunks


def sequence_positions(rank: int, size: int, seq_length: int) -> torch.Tensor:
    """The positions in the full sequence of CP rank `rank`'s tokens, in its order: megatron's
    load-balanced layout (chunks r and 2·CP−1−r of 2·CP), written out from its definition."""
    chunk = seq_length // (2 * size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in rank_chunks(rank, size)])
