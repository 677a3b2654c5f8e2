"""python -m megatron_kappa.import_hf --hf DIR: the project's model settings for a Hugging Face
folder of one of the export's classes, checked against every tensor; with --output, a config that
starts a run from the folder (train.init_weights: DIR)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_kappa.import_hf", description=" ".join(__doc__.split()),
                                 epilog="docs/export.md, 'Hugging Face import'")
    ap.add_argument("--hf", required=True, help="a Hugging Face model folder (config.json and safetensors) of "
                                                "KappaMoeForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM or "
                                                "DeepseekV3ForCausalLM")
    ap.add_argument("--config", default="configs/tiny.yaml",
                    help="the config whose other keys (training, data, layout) the run takes (default: %(default)s)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of --config (not model.*)")
    ap.add_argument("--output", help="write the run's config here (YAML): --config, --set, the folder's model "
                                     "settings and train.init_weights: the folder")
    args = ap.parse_args(argv)
    from megatron_kappa.config import ConfigError, load_config, to_dict
    from megatron_kappa.import_hf.folder import HFFolder
    from megatron_kappa.import_hf.weights import ImportedState
    source = "--hf"
    try:
        folder = HFFolder(args.hf, source)
        sets = [*args.set, *folder.overrides(), f"train.init_weights={Path(args.hf).resolve()}"]
        cfg = load_config(args.config, sets)
        folder.check(cfg)
        values = sum(t.numel() for t in ImportedState(folder, cfg).values())  # every tensor read and named
        if args.output and Path(args.output).exists():
            raise ConfigError(f"--output: {args.output} exists; choose another path")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.hf}: {folder.adapter.architecture}, {values:,} values (the vocabulary padded for parallel.tp "
          f"{cfg.parallel.tp}); its model settings:")
    print("  --set " + " ".join(folder.overrides()))
    if args.output:
        import yaml
        Path(args.output).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        print(f"wrote {args.output}: python launch/pretrain.py --config {args.output}")
    return 0


INTERRUPTED = "nothing was written"  # what Ctrl-C leaves, in one line (megatron_kappa/cli/commands.py)

if __name__ == "__main__":  # python -m megatron_kappa.import_hf
    from megatron_kappa.entry import run
    run("megatron_kappa.import_hf.__main__")
