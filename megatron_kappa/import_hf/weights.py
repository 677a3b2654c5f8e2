"""A Hugging Face folder's tensors as the project's full (one-process layout) state dict, a layer at
a time, loaded into a model of any layout.

The target's `from_hf` (megatron_kappa.export.adapter: `to_hf`'s exact inverse, one rule table)
names each tensor; the vocabulary rows are padded with zeros to the layout's padded vocabulary
(128 × TP: the padding belongs to the layout that reads them, as the export cuts it). The state is
a mapping read on demand: each rank reads the safetensors of the layers it holds, one layer at a
time (the files are memory-mapped), so a model larger than one host's memory loads as long as its
largest layer fits, and the tensors reach megatron_kappa.parallel.sharding.load_full_state_dict,
which cuts every rank's shards from them as it does for a consolidated checkpoint.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path

import torch

from megatron_kappa.config import Config, ConfigError
from megatron_kappa.import_hf.folder import HFFolder
from megatron_kappa.model.layout import model_layout
from megatron_kappa.parallel.sharding import global_name, load_full_state_dict

LAYER = re.compile(r"model\.layers\.(\d+)\.")
VOCAB_ROWS = ("embedding.word_embeddings.weight", "output_layer.weight", "self_attention.value_embedding")
# megatron's bookkeeping buffers, which a Hugging Face model has no tensor for: the model keeps its own
BOOKKEEPING = ("local_tokens_per_expert",)


class Tensors:
    """The folder's safetensors, by name, memory-mapped."""

    def __init__(self, folder: Path, source: str):
        """Opening reads each file's header only (the preflight opens them before anything is
        written): a junk or truncated file is one ConfigError line naming it."""
        from safetensors import SafetensorError, safe_open
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
                raise ConfigError(f"{source}: {index}: not a safetensors index ({_first_line(e)})") from None
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{source}: {folder}: no safetensors files (expected model.safetensors or its shards)")
        self.where = {}
        self.opened = []
        for name in files:
            try:
                handle = safe_open(str(folder / name), framework="pt")
            except (SafetensorError, OSError) as e:  # it was a 21-line SafetensorError traceback
                raise ConfigError(f"{source}: {folder / name}: not a readable safetensors file "
                                  f"({_first_line(e)})") from None
            self.opened.append(handle)
            self.where.update({key: handle for key in handle.keys()})

    def get(self, names) -> dict:
        return {n: self.where[n].get_tensor(n) for n in names}


def _first_line(e: BaseException) -> str:
    return ((str(e).splitlines() or [type(e).__name__])[0] or type(e).__name__)[:160]


class ImportedState(Mapping):
    """{megatron full name: tensor} of a Hugging Face folder for `cfg`'s model, read a layer at a
    time. `keep`: tensors the folder has no counterpart for (megatron's bookkeeping buffers)."""

    def __init__(self, folder: HFFolder, cfg: Config, keep: dict | None = None):
        self.folder, self.model, self.layout = folder, cfg.model, model_layout(cfg)
        self.tensors, self.keep = Tensors(folder.folder, folder.source), dict(keep or {})
        self.by_layer, outer = {}, []
        layers, mtp = cfg.model.num_layers, getattr(folder.hf, "num_nextn_predict_layers", 0) or 0
        for name in self.tensors.where:
            found = LAYER.match(name)
            if found is None:
                outer.append(name)
            elif int(found.group(1)) < layers:
                self.by_layer.setdefault(int(found.group(1)), []).append(name)
            elif int(found.group(1)) >= layers + mtp:  # beyond the MTP layers transformers skips too
                outer.append(name)  # refused by the outer rules, naming it
        self.outer_names, self.cached = outer, ("nothing yet", {})

    def _layer(self, i) -> dict:
        """Layer i's megatron tensors (`i`: None for the embedding, final norm and output layer)."""
        if self.cached[0] != i:
            try:
                if i is None:
                    state = self.folder.adapter.outer_from_hf(self.model, self.tensors.get(self.outer_names))
                else:
                    hf = self.tensors.get(self.by_layer.get(i, []))
                    state = {f"decoder.layers.{i}.{k}": t
                             for k, t in self.folder.adapter.from_hf(self.model, self.layout, i, hf).items()}
            except (KeyError, RuntimeError, ValueError) as e:  # a name missing or left over; a tensor that does not fit
                why = str(e.args[0] if isinstance(e, KeyError) and e.args else e).splitlines()[0]
                raise ConfigError(f"{self.folder.source}: {self.folder.folder}: {why}") from None
            self.cached = (i, {k: self._padded(k, t) for k, t in state.items()})
        return self.cached[1]

    def _padded(self, name: str, t: torch.Tensor) -> torch.Tensor:
        if name.endswith(VOCAB_ROWS) and t.shape[0] == self.model.vocab_size < self.layout.padded_vocab:
            return torch.cat([t, t.new_zeros(self.layout.padded_vocab - t.shape[0], *t.shape[1:])])
        return t

    def _owner(self, key: str):
        found = re.match(r"decoder\.layers\.(\d+)\.", key)
        return int(found.group(1)) if found else None

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.keep:
            return self.keep[key]
        return self._layer(self._owner(key))[key]

    def __contains__(self, key) -> bool:
        return key in self.keep or key in self._layer(self._owner(key))

    def __iter__(self):
        for i in [*sorted(self.by_layer), None]:
            yield from self._layer(i)

    def __len__(self) -> int:
        return sum(1 for _ in self)


def load_into(model, cfg: Config, folder: str | Path, source: str = "config: train.init_weights"):
    """Copy the Hugging Face folder's weights into `model` (this rank's part of `cfg`'s model, in
    any layout), after checking that the run's model is the folder's (one ConfigError line)."""
    hf = HFFolder(folder, source)
    hf.check(cfg)
    keep = {global_name(model, n): t.detach().clone() for n, t in model.state_dict().items()
            if n.endswith(BOOKKEEPING)}
    load_full_state_dict(model, ImportedState(hf, cfg, keep), source=f"{source}: {folder}")
