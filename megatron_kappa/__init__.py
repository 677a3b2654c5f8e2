"""megatron_kappa: κ-SwiGLU Mixture-of-Experts pre-training on megatron-core and DeepSpeed.

Modules:
  analysis/           Analyses of finished runs: figures (plots.py, drawn on the axes of
                      figure_axes.py) and a study's table (study_table.py)
  attention_kinds.py  The attention kinds, each one entry of one registry (`KINDS`; `register` adds
                      one at run time)
  bench/              What the benchmarks in bench/ share: a toy model and tokenizer, interleaved
                      timing, and the benchmarks whose functions other benchmarks and the tests use
                      (run them as bench/<name>.py)
  checkpoint/         Checkpoints of a run: `listing` says which exist (no torch), `store` saves and
                      loads them
  cli/                The command lines: `commands` (what every console script and script beside the
                      package calls: the quiet filters first, then the command) and the commands of
                      the scripts in launch/ and eval/
  cli_types.py        argparse types for the command lines' numbers: a bad value is argparse's one
                      error line, before any work (planner, evaluation)
  config/             The run configuration: YAML validated against one dataclass schema
  data/               Data formats shared by data preparation, the preflight, training and
                      evaluation
  data_prep/          Data preparation: raw corpora (FineWeb-Edu shaped) → SentencePiece → Megatron
                      indexed shards
  entry.py            What every entry point does first: the library notices known harmless filtered
                      (quiet.py) and, in a launcher process, its endings in one line
                      (launcher_exit.py)
  evaluation/         Evaluation of a causal LM: CORE (DCLM's in-context tasks) and validation loss
                      / bits per byte
  export/             A trained run as a Hugging Face model folder, for transformers, serving tools
                      and lm-eval
  import_hf/          A Hugging Face model as a run's starting weights: `train.init_weights:
                      <folder>` takes a folder of one of the export's classes (this project's κ
                      model, transformers' Qwen3-MoE, Mixtral and DeepSeek-V3) and loads it into any
                      parallel layout, through the export's own name maps read backwards
                      (megatron_kappa.export.adapter)
  kappa/              κ-SwiGLU: SwiGLU whose SiLU sharpness κ is set per token and gate unit by the
                      router logit
  launcher_exit.py    The launchers' own endings in one line: Ctrl-C to the deepspeed runner, and
                      torchrun's signal and failed-rank reports, instead of their Python tracebacks
  metrics/            What a run reports: metrics.jsonl and TensorBoard, κ and router statistics,
                      the paper's analyses per MoE layer and the throughput (a router's own metrics,
                      SoftMoE's budgets, come from its registry entry)
  model/              The model: config → megatron-core TransformerConfig and layer specs → GPTModel
  optim/              The optimizers: the parameter groups, AdamW or Muon/Aurora under DeepSpeed's
                      ZeRO, and every group's learning-rate and weight-decay schedule (`python -m
                      megatron_kappa.optim --config X` lists the groups)
  parallel/           Parallelism: how the model is spread over processes and how its gradients meet
                      again
  paths.py            Whether a folder can be made where a command line or a config says (one check
                      for run.dir, the study's --dir, the export's and consolidation's --output and
                      the evaluations' --json, before any work)
  plan/               The memory planner: what the most-loaded rank of a layout holds, and whether
                      it fits
  preflight.py        Every check of a run's inputs that can run before process groups and the model
                      exist
  quiet.py            The library messages known to be harmless here, kept out of every command's
                      output
  registry.py         The one registry mechanism that every kind uses (attention kinds, routers, κ
                      inputs, export targets)
  routers.py          The router kinds (`model.moe.router`), each one entry of one registry
                      (`ROUTERS`; `register` adds one at run time)
  summary/            Model summary without allocating weights: parameters, active parameters,
                      N_eff, token budget
  tokenizer.py        The project's tokenizer: a SentencePiece model with the special tokens defined
                      once
  train/              Training: the loop and what it needs step by step (data, pipeline stages, the
                      κ recipe, stop signals)
"""

__version__ = "0.1.0"
