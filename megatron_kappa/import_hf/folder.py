"""A Hugging Face model folder as the export targets read it back: which class it is (one of the
export's targets, megatron_kappa.export.targets), the project's model settings that make that
model (the target's `settings`, its `config` inverted), and whether a run's model is that model.

A run's model is the folder's exactly when the target's `config` of the run's model gives every
field of the folder's config.json back (the fields that only name tokens, the context length or
bookkeeping aside), and the target can hold the model (`refusals`). A field the import does not
know is refused rather than ignored: it might change what the model computes.
"""
from __future__ import annotations

import importlib
import json
from pathlib import Path

from megatron_kappa.config import Config, ConfigError
from megatron_kappa.export import targets
from megatron_kappa.export.adapter import StateDictAdapter
from megatron_kappa.model.layout import model_layout

# config.json fields that are not the model's function: its tokens' ids, the context it was made
# for (RoPE's default θ does not depend on it), how its weights are stored, and transformers'
# bookkeeping (transformers' DeepSeek-V3 loads no MTP layer: `num_nextn_predict_layers`' weights,
# if present, are skipped, megatron_kappa.import_hf.weights)
NOT_COMPARED = {"architectures", "model_type", "bos_token_id", "eos_token_id", "pad_token_id",
                "max_position_embeddings", "auto_map", "dtype", "torch_dtype", "transformers_version",
                "num_nextn_predict_layers"}
# fields of the classes that only training or generation read, or that follow from others
INERT = {"initializer_range", "use_cache", "output_router_logits", "router_aux_loss_coef", "pretraining_tp",
         "qk_head_dim", "sliding_window", "_name_or_path"}
REQUIRED = {"attention_dropout": 0.0}  # the project's attention has no dropout


def config_class(adapter: StateDictAdapter):
    """The transformers config class of a target: transformers' own, or the one in the modeling
    file the target ships (read from this package: no code of the folder is run)."""
    if adapter.native:
        from transformers import CONFIG_MAPPING
        return CONFIG_MAPPING[adapter.model_type]
    from transformers import PreTrainedConfig
    for code in adapter.code_files:
        module = importlib.import_module(f"megatron_kappa.export.{code[:-3]}")
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, PreTrainedConfig) and \
                    getattr(value, "model_type", None) == adapter.model_type:
                return value
    raise ConfigError(f"{adapter.name}: no config class with model_type {adapter.model_type} in its code files")


class HFFolder:
    """A Hugging Face model folder: its config.json, the target that reads it, its config object."""

    def __init__(self, folder: str | Path, source: str):
        self.folder, self.source = Path(folder), source
        path = self.folder / "config.json"
        try:
            self.raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{source}: {self.folder}: no config.json "
                              "(expected a Hugging Face model folder)") from None
        except (OSError, ValueError) as e:
            raise ConfigError(f"{source}: {path}: not a JSON config ({str(e).splitlines()[0][:120]})") from None
        if not isinstance(self.raw, dict):
            raise ConfigError(f"{source}: {path}: expected a JSON object")
        self.adapter = self._target()
        try:
            self.hf = config_class(self.adapter).from_dict(dict(self.raw))
        except Exception as e:  # transformers' own check of its fields
            raise ConfigError(f"{source}: {path}: {self.adapter.architecture} refuses it "
                              f"({str(e).splitlines()[0][:160]})") from None

    def _target(self) -> StateDictAdapter:
        archs = self.raw.get("architectures") or []
        model_type = self.raw.get("model_type")
        for adapter in targets.TARGETS.values():
            if adapter.model_type == model_type and (not archs or archs[0] == adapter.architecture):
                return adapter
        known = ", ".join(f"{a.architecture} ({a.model_type})" for a in targets.TARGETS.values())
        raise ConfigError(f"{self.source}: {self.folder / 'config.json'}: {archs[0] if archs else model_type} "
                          f"(model_type {model_type}) is not a class the import reads; expected one of {known}")

    def settings(self) -> dict:
        """The project's model settings that make this model ({dotted key: value})."""
        return self.adapter.settings(self.hf)

    def overrides(self) -> list[str]:
        """`settings` as `--set` overrides (key=YAML value)."""
        import yaml
        return [f"{k}={yaml.safe_dump(v, default_flow_style=True).strip().removesuffix(chr(10) + '...')}"
                for k, v in self.settings().items()]

    def check(self, cfg: Config):
        """A one-line ConfigError unless the run's model is this folder's model."""
        from megatron_kappa.model.build import kappa_settings
        layout = model_layout(cfg)
        why = self.adapter.refusals(cfg.model, layout)
        if why:
            raise ConfigError(f"{self.source}: {self.folder} holds a {self.adapter.architecture}, which cannot be "
                              f"this run's model: " + "; ".join(why))
        if cfg.model.mtp.num_layers:
            raise ConfigError(f"{self.source}: {self.folder}: model.mtp.num_layers is {cfg.model.mtp.num_layers}, "
                              "and a Hugging Face folder has no MTP modules to start them from; set it to 0")
        want = self.adapter.config(cfg.model, layout, {"bos": None, "eos": None, "pad": None},
                                   kappa_settings(cfg.model.kappa) if cfg.model.kappa.enabled else None)
        # a field the folder's class does not have (the κ model's file ignores hidden_act) is not compared
        problems = [f"{k} is {_show(self._value(k))}, the run's model has {_show(v)}" for k, v in want.items()
                    if k not in NOT_COMPARED and (k in self.raw or hasattr(self.hf, k))
                    and not _same(self._value(k), v)]
        known = set(want) | {self._alias(k) for k in want} | NOT_COMPARED | INERT | set(REQUIRED) | _generic()
        problems += [f"{k} ({_show(v)}) is not a field the import knows for {self.adapter.architecture}"
                     for k, v in self.raw.items() if k not in known]
        problems += [f"{k} is {_show(self.raw[k])}, the run's model has {_show(v)}" for k, v in REQUIRED.items()
                     if k in self.raw and self.raw[k] != v]
        if problems:
            differ = {k: v for k, v in self.settings().items() if _get(cfg, k) != v}
            hint = ("; the folder's model is " + ", ".join(f"{k}={v}" for k, v in list(differ.items())[:6])
                    + " (python -m megatron_kappa.import_hf prints its settings)") if differ else ""
            raise ConfigError(f"{self.source}: {self.folder / 'config.json'}: " + "; ".join(problems[:4])
                              + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else "") + hint)

    def _alias(self, key: str) -> str:
        return getattr(type(self.hf), "attribute_map", {}).get(key, key)

    def _value(self, key: str):
        """A field as the class reads it (its aliases, defaults, and None meaning the default)."""
        value = getattr(self.hf, key, self.raw.get(key))
        if value is None and key == "head_dim":
            return self.hf.hidden_size // self.hf.num_attention_heads
        if value is None and key == "num_key_value_heads":
            return self.hf.num_attention_heads
        return value


def _generic() -> set[str]:
    """The fields every transformers config has (generation, heads, labels...), not the model's."""
    from transformers import PreTrainedConfig
    return set(PreTrainedConfig().to_dict()) - {"tie_word_embeddings"}


def _plain(v):
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _same(a, b) -> bool:
    return _plain(a) == _plain(b)


def _show(v) -> str:
    text = json.dumps(_plain(v)) if not isinstance(v, str) else v
    return text if len(text) <= 80 else text[:77] + "..."


def _get(cfg: Config, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value
