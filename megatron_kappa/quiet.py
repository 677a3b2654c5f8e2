"""The library messages known to be harmless here, kept out of every command's output.

`install()` is the first thing every entry point does (megatron_kappa/entry.py: the scripts
beside the package, the console scripts, the package's `python -m` mains), in every rank of
every launcher, before megatron-core, DeepSpeed or torch's extension loader print anything;
importing the package installs nothing. It drops exactly the messages below, each at its source
(a `warnings` filter by message, or a filter on the logger that emits it); any other warning
still shows. KAPPA_SHOW_WARNINGS=1 in the
environment shows them all.
"""
from __future__ import annotations

import logging
import os
import re
import warnings

ENV = "KAPPA_SHOW_WARNINGS"

# (category, message regex): Python warnings, with why they are harmless here
KNOWN_WARNINGS = [
    (UserWarning, r"Transformer Engine and Apex are not installed"),  # megatron falls back to torch (intended)
    (UserWarning, r"Apex is not installed\. Falling back to Torch Norm"),  # the norms are torch's (intended)
    (UserWarning, r"full scope is deprecated\. Use empty cuda_graph_modules"),  # megatron's own default
    (UserWarning, r"The pad token id in the tokenizer collides"),  # the mock dataset's tokenizer
    # torch 2.14 renamed it; DeepSpeed's ZeRO, megatron-core and torch 2.11 (the GPU image) use the old name
    (FutureWarning, r"`torch\.distributed\.all_gather_into_tensor` is deprecated"),
    # its twin, from DeepSpeed's reduce-scatter (deepspeed/comm/torch.py) once per rank under parallel.cp=2
    (FutureWarning, r"`torch\.distributed\.reduce_scatter_tensor` is deprecated"),
]
# A library's invalid string escapes (megatron-core's, torchao's docstrings), which Python reports
# when it compiles the file: once with bytecode cached, at every start of every process when it is
# not (PYTHONDONTWRITEBYTECODE=1, as many container images set it). Only for files under a
# site-packages folder: this project's own still show.
LIBRARY_SOURCE = r".*[/\\]site-packages[/\\]"  # warnings' `module`: a compiled file's path
# logger name → message regexes: log records, with why
KNOWN_LOG_LINES = {
    "torch.utils.cpp_extension": [r"No CUDA runtime is found"],  # a CPU machine
    # DS_ACCELERATOR=cpu, as asked; one host needs no hostfile (several: `--hostfile`, docs/multinode.md)
    "DeepSpeed": [r"Setting accelerator to CPU", r"Unable to find hostfile, will proceed with training with local"],
    # torchrun's advice when OMP_NUM_THREADS is unset: it sets 1 per rank, what CPU ranks want
    # (its logger is "__main__" when run as `python -m torch.distributed.run`)
    "torch.distributed.run": [r"Setting OMP_NUM_THREADS environment variable for each process"],
    "__main__": [r"Setting OMP_NUM_THREADS environment variable for each process"],
    "megatron.core.models.gpt.gpt_model": [r"GPTModel IS DEPRECATED"],  # megatron-core 0.19's notice
    "megatron.core.tensor_parallel.random": [r"CPU RNG state changed within GPU RNG context"],  # CPU runs
    # torchao 0.18 registers its Enums (KernelPreference, ScaleCalculationMode) as pytree constants,
    # which torch 2.14 supports natively and deprecates: printed at torchao's import, which
    # transformers' quantizer registry triggers on every from_pretrained (e.g. of an export)
    "torch.utils._pytree": [r"is an Enum subclass and is now natively supported by torch\.compile"],
}


class _DropKnown(logging.Filter):
    def __init__(self, patterns):
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(p.search(message) for p in self.patterns)


_installed = False


def install() -> bool:
    """Filter the known messages (once per process); False when KAPPA_SHOW_WARNINGS is set."""
    global _installed
    if os.environ.get(ENV, "") not in ("", "0"):
        return False
    if _installed:
        return True
    for category, pattern in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    warnings.filterwarnings("ignore", message=r"invalid escape sequence", category=SyntaxWarning,
                            module=LIBRARY_SOURCE)
    for name, patterns in KNOWN_LOG_LINES.items():
        logging.getLogger(name).addFilter(_DropKnown(patterns))
    _installed = True
    return True

