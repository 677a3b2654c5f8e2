"""The SoftMoE allocation figure of a training run (model.moe.router: softmoe; docs/softmoe.md).

    python analysis/softmoe.py RUN_DIR [--out PNG]      (default: RUN_DIR/plots/softmoe.png)

From metrics.jsonl (megatron_kappa.metrics.softmoe): each MoE layer's learned k_l over
training with the budget (their mean) dashed; the mean number of experts each layer ran per token;
and the distribution of experts run per token in the last logged window, per layer.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

# the file backend before pyplot is imported (here or by the modules below): no display needed
matplotlib.use("Agg")
import matplotlib.pyplot as plt

from megatron_kappa.analysis.figure_axes import legend_below, step_axes
from megatron_kappa.analysis.plots import layers_of, read_metrics, series

ROOT = Path(__file__).resolve().parents[2]


def plot_allocation(run_dir: str | Path, out: str | Path | None = None) -> Path:
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    layers = layers_of(records, "softmoe")
    if not layers:
        raise ValueError(f"{run_dir}: metrics.jsonl has no softmoe/ metrics (not a model.moe.router: softmoe run)")
    out = Path(out) if out else run_dir / "plots" / "softmoe.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = allocation_figure(records, layers)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def allocation_figure(records: list[dict], layers: list[int]):
    """The three panels (not saved): k_l and the budget, experts run per token, their histogram."""
    fig, (ax_k, ax_run, ax_hist) = plt.subplots(1, 3, figsize=(15, 4.8), layout="constrained")
    for layer in layers:
        ax_k.plot(*series(records, f"softmoe/layer{layer}/k"), label=f"layer {layer}")
        ax_run.plot(*series(records, f"softmoe/layer{layer}/active_mean"), label=f"layer {layer}")
    ax_k.plot(*series(records, "softmoe/k_mean"), "k--", linewidth=1, label="budget (mean)")
    ax_k.set_title("learned mean active experts k_l")
    step_axes(ax_k, records, "k_l (experts per token)")
    ax_run.set_title("experts run per token (mean)")
    step_axes(ax_run, records, "experts per token (count)")
    last = next(r for r in reversed(records) if f"softmoe/layer{layers[0]}/active_hist" in r)
    width = 0.8 / len(layers)
    for i, layer in enumerate(layers):
        hist = last[f"softmoe/layer{layer}/active_hist"]
        ax_hist.bar([c + (i - (len(layers) - 1) / 2) * width for c in range(len(hist))], hist, width,
                    label=f"layer {layer}")
    ax_hist.set(title=f"experts run per token, step {last['step']}", xlabel="experts run (count)",
                ylabel="fraction of tokens (0 to 1)")
    ax_hist.grid(alpha=0.3)
    legend_below(fig, (ax_k, ax_hist))  # the layers' colours, and the budget, once for the three panels
    return fig


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--out", default=None, help="PNG path (default: RUN_DIR/plots/softmoe.png)")
    args = ap.parse_args(argv)
    try:
        print(plot_allocation(args.run_dir, args.out))
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
