"""A Hugging Face model as a run's starting weights: `train.init_weights: <folder>` takes a folder
of one of the export's classes (this project's κ model, transformers' Qwen3-MoE, Mixtral and
DeepSeek-V3) and loads it into any parallel layout, through the export's own name maps read
backwards (megatron_kappa.export.adapter).

    python -m megatron_kappa.import_hf --hf DIR [--config configs/tiny.yaml] [--output run.yaml]

prints the model settings that make the folder's model (and checks every tensor); with --output it
writes a config that trains from it. docs/export.md, "Hugging Face import".

Modules:
  __main__.py  python -m megatron_kappa.import_hf --hf DIR: the project's model settings for a
               Hugging Face folder of one of the export's classes, checked against every tensor;
               with --output, a config that starts a run from the folder (train.init_weights: DIR)
  folder.py    A Hugging Face model folder as the export targets read it back: which class it is
               (one of the export's targets, megatron_kappa.export.targets), the project's model
               settings that make that model (the target's `settings`, its `config` inverted), and
               whether a run's model is that model
  weights.py   A Hugging Face folder's tensors as the project's full (one-process layout) state
               dict, a layer at a time, loaded into a model of any layout
"""
