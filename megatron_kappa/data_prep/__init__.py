"""Data preparation: raw corpora (FineWeb-Edu shaped) → SentencePiece → Megatron indexed shards.

Entry point: `python data_prep/fineweb_edu.py ...` or `data_prep.fineweb_edu.main(argv)`.
"""


class DataPrepError(Exception):
    """A problem with the user's input or output folder, reported as one line (`error: ...`)."""
