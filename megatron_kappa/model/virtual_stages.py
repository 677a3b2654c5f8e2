"""A pipeline rank's model chunks (virtual stages, parallel.vpp > 1) seen as one module.

With interleaved 1F1B a rank holds vpp GPT models ("chunks"), chunk v holding the layers of model
chunk v × pp + rank: rank 0 of PP2 × VPP2 over 8 layers holds layers 0-1 and 4-5. megatron's
schedule runs the chunks; everything else in the trainer (DeepSpeed's engine and optimizer,
checkpoints, statistics, the gradient norm) sees one module, whose names are the full model's:
`decoder.layers.<global index>`, the embedding where the first chunk holds it, the final norm and
the output layer where the last one does. Each parameter and buffer of the chunks appears exactly
once under that view (checked when it is built), so a checkpoint of a rank's virtual stages
consolidates and reshards like any stage's.
"""
from __future__ import annotations

from torch import nn


class VirtualStages(nn.Module):
    """This rank's model chunks under the full model's names; `chunks` are megatron's modules for
    its schedule (not registered: their parameters appear once, under the names below)."""

    names_are_global = True  # megatron_kappa.model.layout.layer_offset reads it: no shift

    def __init__(self, chunks: list[nn.Module]):
        super().__init__()
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleDict()
        for chunk in chunks:
            for layer in chunk.decoder.layers:
                self.decoder.layers[str(layer.layer_number - 1)] = layer
            for name, module in chunk.decoder.named_children():
                if name != "layers":
                    self._place(self.decoder, name, module)
            for name, module in chunk.named_children():
                if name != "decoder":
                    self._place(self, name, module)
        object.__setattr__(self, "chunks", list(chunks))
        self.config = chunks[0].config
        self.pre_process, self.post_process = chunks[0].pre_process, chunks[-1].post_process
        self._check_covered()

    @staticmethod
    def _place(owner: nn.Module, name: str, module: nn.Module | None):
        """A chunk's own part (the embedding, the final norm, the output layer) under its name; the
        parts without parameters or buffers (rotary embedding) stay with their chunk."""
        if module is None or not _holds_tensors(module):
            return
        if name in owner._modules:
            raise ValueError(f"virtual stages: two model chunks of this rank hold '{name}'")
        owner.add_module(name, module)

    def _check_covered(self):
        """Every module of the chunks that holds parameters or buffers is in the view."""
        mine = {id(m) for m in self.modules()}
        for chunk in self.chunks:
            missing = [n for n, m in chunk.named_modules() if id(m) not in mine and _holds_tensors(m, recurse=False)]
            if missing:
                raise ValueError(f"virtual stages: '{missing[0]}' of a model chunk has no name in the rank's view")

    def train(self, mode: bool = True):
        super().train(mode)
        for chunk in self.chunks:  # the chunks' own flags (megatron reads self.training in each)
            chunk.train(mode)
        return self

    def forward(self, *args, **kwargs):
        raise RuntimeError("virtual stages run through megatron's interleaved schedule (model.chunks), "
                           "not as one module")


def _holds_tensors(module: nn.Module, recurse: bool = True) -> bool:
    """Whether `module` has parameters or buffers (its own only, unless `recurse`)."""
    return any(True for _ in module.parameters(recurse)) or any(True for _ in module.buffers(recurse))


def chunks_of(model: nn.Module) -> list[nn.Module]:
    """The modules megatron's schedule runs for `model`: its chunks, or the model itself."""
    return list(getattr(model, "chunks", [model]))

