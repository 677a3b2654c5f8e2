"""A trained run as a Hugging Face model folder, for transformers, serving tools and lm-eval.

    python -m megatron_kappa.export --checkpoint RUN [--step N] --output DIR
                                    [--target auto|kappa_moe|qwen3_moe|mixtral|deepseek_v3] [--license ID]

Modules:
  __main__.py            python -m megatron_kappa.export --checkpoint RUN --output DIR: a run's
                         latest checkpoint (or --step's, or one checkpoint folder), from any
                         training layout, as a Hugging Face model folder (config.json, safetensors
                         shards, the tokenizer, a model card, and for κ models the modeling file:
                         AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True))
  adapter.py             What an export target is: a state-dict adapter between megatron's tensors
                         and one Hugging Face class's (torchtitan's `StateDictAdapter` is the
                         model), and the hub layout most of them share
  card.py                The export's model card (README.md): the Hub's YAML header (licence,
                         library, tags), what the model is (its config, κ-SwiGLU's description and
                         formula when κ is on), how it was trained (the step, the tokens seen, the
                         data, the layout) and the evaluation results recorded for that step
  convert.py             A run's config and weights as a Hugging Face model's: which class takes it,
                         its config.json, and every tensor under that class's name
  licenses.py            The Hugging Face Hub's licence identifiers: the values a model card's
                         `license:` may take
  modeling_kappa_moe.py  A κ-SwiGLU Mixture-of-Experts language model for Hugging Face transformers,
                         as megatron_kappa trains it: `AutoModelForCausalLM.from_pretrained(dir,
                         trust_remote_code=True)` on a folder that `python -m megatron_kappa.export`
                         wrote
  targets/               The export targets (`--target`), each one state-dict adapter
                         (megatron_kappa.export.adapter) in one registry (`TARGETS`, a
                         megatron_kappa.registry.Registry as every kind's; `TARGETS.register(name,
                         adapter)` adds one)
  tokenizer.py           The run's SentencePiece model as a Hugging Face tokenizer (tokenizer.json
                         and its config)
  writer.py              The export: a run's checkpoint, a layer at a time, into a Hugging Face
                         model folder
"""
