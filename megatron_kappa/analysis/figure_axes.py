"""The axes every run figure shares: steps below and tokens seen above, one y scale across a
figure's layer panels, a labelled axis everywhere, and the legend outside the data.

plots.py and softmoe.py draw with these, so every figure reads the same way: the bottom x axis is
the optimizer step, the top one the tokens seen by then (metrics.jsonl's `tokens_seen`), and
a figure's legend sits below its panels, where it covers no curve.
"""
from __future__ import annotations

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import EngFormatter

STEP_LABEL = "step"
TOKENS_LABEL = "tokens seen"


def step_to_tokens(records: list[dict]):
    """(forward, inverse) maps between steps and tokens seen, from the logged `tokens_seen`
    (piecewise linear through (0, 0) and each logged step, so a batch ramp is followed;
    extended past the ends at the nearest segment's rate). None when nothing logged tokens."""
    points = sorted({(r["step"], r["tokens_seen"]) for r in records
                     if isinstance(r.get("tokens_seen"), (int, float)) and r.get("step", 0) > 0})
    if not points:
        return None
    steps = np.array([0.0] + [float(s) for s, _ in points])
    tokens = np.array([0.0] + [float(t) for _, t in points])
    keep = np.concatenate([[True], (np.diff(steps) > 0) & (np.diff(tokens) > 0)])  # strictly increasing
    steps, tokens = steps[keep], tokens[keep]
    if len(steps) < 2:
        return None

    def through(xs, ys):
        first, last = (ys[1] - ys[0]) / (xs[1] - xs[0]), (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])

        def f(x):
            x = np.asarray(x, dtype=float)
            y = np.interp(x, xs, ys)
            y = np.where(x < xs[0], ys[0] + (x - xs[0]) * first, y)
            return np.where(x > xs[-1], ys[-1] + (x - xs[-1]) * last, y)
        return f

    return through(steps, tokens), through(tokens, steps)


def tokens_axis(ax, records: list[dict]):
    """A top x axis in tokens seen beside the steps below (nothing when no tokens were logged)."""
    maps = step_to_tokens(records)
    if maps is None:
        return None
    top = ax.secondary_xaxis("top", functions=maps)
    top.set_xlabel(TOKENS_LABEL)
    top.xaxis.set_major_formatter(EngFormatter(sep=""))  # 150k, 1.5M
    return top


def step_axes(ax, records: list[dict], ylabel: str):
    """Steps below, tokens above, the y label (with its unit), a light grid."""
    ax.set_xlabel(STEP_LABEL)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    tokens_axis(ax, records)


def grid(n: int, title: str, sharey: bool = True):
    """n panels (at most 4 a row) with one x and (by default) one y scale, so layers compare by
    eye; every panel keeps its tick labels."""
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.9 * cols, 3.2 * rows + 0.9), squeeze=False, sharex=True,
                             sharey=sharey, layout="constrained")
    fig.suptitle(title)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    for ax in axes.flat[:n]:
        ax.tick_params(labelleft=True, labelbottom=True)
    return fig, list(axes.flat[:n])


def legend_below(fig, axes, max_columns: int = 6):
    """One legend for the figure, below its panels (every label once, in drawing order)."""
    handles, labels = {}, []
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in handles and not label.startswith("_"):
                handles[label] = handle
                labels.append(label)
    if labels:
        fig.legend([handles[x] for x in labels], labels, loc="outside lower center",
                   ncol=min(len(labels), max_columns), frameon=False)


def save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
