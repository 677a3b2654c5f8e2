"""Data formats shared by data preparation, the preflight, training and evaluation.

Modules:
  bestfit.py    `data.packing: bestfit`: the authors' BOS-aligned best-fit packing (14c9b04
                nanochat/dataloader.py:4-13, 80-106) over Megatron indexed shards, as a megatron-
                core dataset
  blend.py      `data.paths` in Megatron-LM's --data-path form, and `data.split` as megatron-core
                cuts it
  bos.py        Whether a run's training documents start with BOS: the question CORE must answer the
                same way as training did (a model trained without BOS scores worse with it, and the
                other way round)
  cache.py      The dataset index cache (`data.cache_dir`, by default `<run.dir>/data_cache`): a
                write into it that fails (a full disk) is one line naming the folder, and leaves
                none of its files behind
  coverage.py   How many times a run reads its training documents
  indexed.py    Megatron indexed shards (`<prefix>.bin` + `<prefix>.idx`): the index format, read
                and written only here (data_prep writes shards with `index_bytes`; the preflight
                checks them with `read_index`)
  made_with.py  Whether shards were made by a given tokenizer: the one check that training,
                evaluation, export and the study make before token ids meet a tokenizer (another
                tokenizer's ids mean other pieces: a loss, bits per byte or a continuation from them
                would be wrong with no word)
"""
