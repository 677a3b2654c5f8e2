"""Data formats shared by data preparation, the preflight, training and evaluation.

  indexed.py  Megatron indexed shards (`.bin` + `.idx`): the one reader and writer of the index
  blend.py    `data.paths` as Megatron-LM's --data-path (prefixes, optionally weighted) and its split
  bos.py      whether a run's documents start with BOS (data.bos, else the data prep manifests)
"""
