"""The project's tokenizer: a SentencePiece model with the special tokens defined once.

Data prep, training and evaluation all go through `Tokenizer`, so BOS/EOD/PAD ids are the same
everywhere. Models trained by `train_tokenizer` (data_prep) reserve these ids; a loaded third-party
`.model` keeps its own ids for BOS/EOS and falls back to EOS for padding.
"""
from __future__ import annotations

import hashlib
import io
import os
from collections.abc import Iterable
from pathlib import Path

import sentencepiece as spm

# Ids reserved by the tokenizers this project trains.
UNK_ID, BOS_ID, EOD_ID, PAD_ID = 0, 1, 2, 3


class Tokenizer:
    """SentencePiece wrapper with the interface megatron-core's GPTDataset and our eval expect."""

    def __init__(self, model_file: str | Path):
        path = Path(model_file)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer: {path}: no such file (expected a SentencePiece .model)")
        self.model_file = path
        self.sp = spm.SentencePieceProcessor(model_file=str(path))
        self.vocab_size = self.sp.get_piece_size()
        self.bos = self.sp.bos_id()
        self.eod = self.sp.eos_id()
        pad = self.sp.pad_id()
        self.pad = pad if pad >= 0 else self.eod
        if self.bos < 0 or self.eod < 0:
            raise ValueError(f"tokenizer: {path}: model has no BOS or EOS piece (expected both)")
        self.unique_identifiers = {"class": "Tokenizer", "sha256": self.sha256()}

    def sha256(self) -> str:
        return hashlib.sha256(self.model_file.read_bytes()).hexdigest()

    def encode(self, text):
        """Token ids of a string (or a list of strings), without BOS/EOD."""
        return self.sp.encode(text)

    def encode_batch(self, texts: list[str], num_threads: int = 1) -> list[list[int]]:
        """Token ids of many strings in one C++ call; num_threads=1 inside worker processes."""
        return self.sp.encode(texts, num_threads=num_threads)

    def decode(self, ids) -> str:
        return self.sp.decode(list(ids))

    def token_byte_lengths(self) -> list[int]:
        """UTF-8 byte length of every piece as it appears in decoded text (for bits per byte)."""
        lengths = []
        for i in range(self.vocab_size):
            if self.sp.is_control(i) or self.sp.is_unknown(i):
                lengths.append(0)
            elif self.sp.is_byte(i):
                lengths.append(1)
            else:
                lengths.append(len(self.sp.id_to_piece(i).replace("\u2581", " ").encode("utf-8")))
        return lengths


def train_tokenizer(texts: Iterable[str], model_file: str | Path, vocab_size: int, *,
                    num_threads: int = 1, max_sentence_length: int = 16384) -> Path:
    """Train a byte-fallback BPE SentencePiece model on `texts` and write it to `model_file`.

    Deterministic: the result depends only on `texts` (in order) and `vocab_size`. Every text is
    split into lines (SentencePiece skips sentences longer than max_sentence_length bytes, and web
    documents are often longer), all lines are used (no random sampling or shuffling; the caller
    picks the sample), and `num_threads` is erased from the stored trainer spec so that the same
    corpus gives the same file bytes whatever the thread count. Normalization is the identity, so
    decode(encode(text)) == text and byte counts for bits-per-byte stay exact. Special ids are the
    module constants UNK_ID, BOS_ID, EOD_ID, PAD_ID. The file is written atomically.
    """
    from sentencepiece import sentencepiece_model_pb2

    def sentences():
        for text in texts:
            for line in text.split("\n"):
                if line.strip():
                    yield line

    writer = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=sentences(), model_writer=writer, model_type="bpe",
        vocab_size=vocab_size, byte_fallback=True, character_coverage=0.9995,
        unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOD_ID, pad_id=PAD_ID,
        unk_piece="<unk>", bos_piece="<s>", eos_piece="</s>", pad_piece="<pad>",
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        split_digits=True, allow_whitespace_only_pieces=True,
        input_sentence_size=0, shuffle_input_sentence=False,
        max_sentence_length=max_sentence_length, num_threads=num_threads, minloglevel=2)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(writer.getvalue())
    proto.trainer_spec.num_threads = 0  # thread count does not change the pieces; keep bytes equal
    path = Path(model_file)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(proto.SerializeToString(deterministic=True))
    os.replace(tmp, path)
    return path
