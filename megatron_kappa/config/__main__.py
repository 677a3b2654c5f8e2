"""`python -m megatron_kappa.config`: a config as the trainer reads it, or docs/config.md.

    python -m megatron_kappa.config --config configs/tiny.yaml [--set key=value ...] [--world N]
    python -m megatron_kappa.config --markdown > docs/config.md

The first prints the resolved config (its `extends:` chain, the presets and the overrides applied,
every key with its value: YAML that is itself a config file) and, as YAML comments, what it
implies: the layers, the layout on N ranks, the batch, micro-batches, steps and tokens
(megatron_kappa.config.derived). Nothing is built and no file but the config is read; a bad config
is one line and exit status 2.
"""
from __future__ import annotations

import argparse
import sys

import yaml

from megatron_kappa.cli_types import positive_int
from megatron_kappa.config import derived
from megatron_kappa.config.loading import load_config
from megatron_kappa.config.reference import markdown_reference
from megatron_kappa.config.schema import ConfigError, to_dict


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m megatron_kappa.config", description=__doc__.splitlines()[0])
    ap.add_argument("--config", help="a YAML config (docs/config.md)")
    ap.add_argument("--set", nargs="+", action="extend", default=[], metavar="KEY=VALUE",
                    help="config overrides, e.g. --set train.steps=100 parallel.ep=2")
    ap.add_argument("--world", type=positive_int, default=None,
                    help="ranks of the launch the derived values are for (default: the fewest the layout runs on)")
    ap.add_argument("--markdown", action="store_true", help="print docs/config.md (every key) instead")
    args = ap.parse_args(argv)
    if args.markdown:
        if args.config or args.set or args.world:
            ap.error("--markdown takes no other argument")
        print(markdown_reference())
        return 0
    if not args.config and not args.set:
        ap.error("give --config FILE (and/or --set KEY=VALUE over the defaults), or --markdown")
    try:
        cfg = load_config(args.config, args.set)
        values = derived.derived(cfg.model, cfg.parallel, cfg.train, args.world)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False, allow_unicode=True), end="")
    print(derived.render(values, cfg.model, cfg.parallel, cfg.train))
    return 0


if __name__ == "__main__":  # python -m megatron_kappa.config
    from megatron_kappa.entry import run
    run("megatron_kappa.config.__main__")
