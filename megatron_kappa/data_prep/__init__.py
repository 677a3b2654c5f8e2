"""Data preparation: raw corpora (FineWeb-Edu shaped) → SentencePiece → Megatron indexed shards.

Entry point: `python data_prep/fineweb_edu.py ...` (or `kappa-prep`), or
`megatron_kappa.data_prep.fineweb_edu.main(argv)`.

Modules:
  fineweb_edu.py  FineWeb-Edu (or any text corpus in its shape) → SentencePiece → Megatron indexed
                  binary shards
  shards.py       Megatron indexed binary shards (`<prefix>.bin` + `<prefix>.idx`), written without
                  megatron-core
  sources.py      Inputs: local parquet/jsonl files (paths, globs, folders) or a streamed hub
                  dataset
  state.py        The output folder: what is finished, what may be resumed, what must be refused
  work.py         Worker side: read a unit, filter it, encode it in one batched call, split
                  train/valid
"""


class DataPrepError(Exception):
    """A problem with the user's input or output folder, reported as one line (`error: ...`)."""
