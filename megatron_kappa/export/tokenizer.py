"""The run's SentencePiece model as a Hugging Face tokenizer (tokenizer.json and its config).

transformers' own SentencePiece converter builds it, following the model's normalizer spec (the
dummy prefix, whitespace kept as it is, byte fallback, BPE merges ranked by piece score); with
`legacy` ordering its ids equal SentencePiece's (tests/test_export.py checks them on the bundled
corpus). BOS is added to every encoded text exactly when the run's documents start with it.
It pads on the left, and its model_max_length is the model's context (model.seq_length).
"""
from __future__ import annotations

from pathlib import Path


def hf_tokenizer(model_file: str | Path, add_bos: bool, model_max_length: int = 10**9):
    """A PreTrainedTokenizerFast encoding like megatron_kappa.tokenizer.Tokenizer(model_file), padding
    on the left (a decoder's batched generation continues each row at its end) and saying the
    model's context (`model_max_length`: model.seq_length)."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SpmConverter

    from megatron_kappa.tokenizer import Tokenizer

    ours = Tokenizer(model_file)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model_file).read_bytes())
    if proto.trainer_spec.model_type != 2:
        raise ValueError(f"tokenizer: {model_file}: expected a BPE SentencePiece model (the project's), "
                         f"got model type {proto.trainer_spec.model_type}")
    vocab = {p.piece: i for i, p in enumerate(proto.pieces)}
    tok = SpmConverter.build_tokenizer_from_spm_proto(proto, vocab, legacy=True)
    piece = ours.sp.id_to_piece
    if add_bos:
        tok.post_processor = TemplateProcessing(single=f"{piece(ours.bos)} $A", pair=f"{piece(ours.bos)} $A $B",
                                                special_tokens=[(piece(ours.bos), ours.bos)])
    unk = ours.sp.unk_id()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=piece(ours.bos), eos_token=piece(ours.eod),
                                   pad_token=piece(ours.pad), unk_token=piece(unk) if unk >= 0 else None,
                                   model_max_length=model_max_length, padding_side="left",
                                   clean_up_tokenization_spaces=False)
