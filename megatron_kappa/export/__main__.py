"""python -m megatron_kappa.export --checkpoint RUN --output DIR: a run's latest checkpoint (or
--step's, or one checkpoint folder), from any training layout, as a Hugging Face model folder
(config.json, safetensors shards, the tokenizer, a model card, and for κ models the modeling file:
AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True))."""
from __future__ import annotations

from megatron_kappa.entry import start

start()  # first: the known library notices filtered before the imports below print (megatron_kappa/entry.py)

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from safetensors import SafetensorError  # noqa: E402

from megatron_kappa.cli_types import add_checkpoint_arguments, positive_int  # noqa: E402
from megatron_kappa.config import ConfigError  # noqa: E402
from megatron_kappa.export import convert  # noqa: E402
from megatron_kappa.export.writer import DTYPES  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_kappa.export", description=" ".join(__doc__.split()),
                                 epilog="docs/export.md: which class each target is, what the folder holds")
    add_checkpoint_arguments(ap)
    ap.add_argument("--output", required=True, help="the folder to write (must not exist)")
    ap.add_argument("--target", default="auto", choices=convert.choices(), help=convert.target_help())
    ap.add_argument("--dtype", default="checkpoint", choices=list(DTYPES), help="weights' dtype (default: as trained)")
    ap.add_argument("--shard-mb", type=positive_int, default=2000, help="largest safetensors file, in MiB")
    ap.add_argument("--tokenizer", help="SentencePiece model (default: the run's data.tokenizer)")
    ap.add_argument("--license", default="other",
                    help="the model card's licence, a Hugging Face Hub identifier (apache-2.0, mit, cc-by-4.0, ...; "
                         "default: other, i.e. not chosen)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(argv)
    from megatron_kappa.export.writer import export
    try:
        done = export(args.checkpoint, args.output, args.target, args.dtype, args.shard_mb, args.tokenizer,
                      progress=not args.no_progress, step=args.step, license=args.license)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OSError, SafetensorError) as e:  # a full disk, an I/O error: export removed its partial folder
        from megatron_kappa.checkpoint.listing import write_failure
        folder = os.path.dirname(os.path.abspath(args.output))
        print(f"error: --output: {args.output}: {write_failure(e, folder)}; nothing was left behind", file=sys.stderr)
        return 1
    note = "" if done["tokenizer"] else " (no tokenizer: the run has no data.tokenizer; pass --tokenizer)"
    print(f"wrote {done['output']}: {done['target']} from step {done['step']}, {done['bytes'] / 2**20:.1f} MiB "
          f"in {done['files']} file(s){note}")
    return 0


# what Ctrl-C leaves, said in one line (megatron_kappa/cli/commands.py)
INTERRUPTED = "the export writes into <output>.tmp and renames it at the end: <output> is never half-written"

if __name__ == "__main__":  # python -m megatron_kappa.export
    from megatron_kappa.entry import run
    run("megatron_kappa.export.__main__")
