"""Figures of a training run: one PNG per figure under <run.dir>/plots/ (docs/analysis.md).

    python analysis/plots.py RUN_DIR [--out DIR] [--no-checkpoint]

From metrics.jsonl (what the training loop logged at log.interval):
  overview.png     the loss curve beside κ's spread (5 % / mean / 95 %, every MoE layer)
  loss.png         train and validation loss
  kappa.png        κ dynamics per MoE layer (5 %, mean, 95 %), the unfreeze step marked
  alpha_b.png      mean of the positive α and b; |α·s| against |b| over routed tokens
  alignment.png    router–gate alignment cos(r_e, w_e,j): mean, 5 %, 95 %
  gate_bias.png    confidence-induced gate bias (w_e,jᵀ r̂_e)(r̂_eᵀ x): mean, 5 %, 95 %
  token_cos.png    cos(x, r_e) of routed tokens: mean, 5 %, 95 %
  load.png         tokens per expert against their mean: max / mean, min / mean, CV
  dropped.png      the fraction of routed (token, expert) pairs dropped (runs with a capacity)
From the latest checkpoint (unless --no-checkpoint or there is none):
  alignment_final.png   histogram of cos(r_e, w_e,j) per MoE layer
  kappa_params_final.png  histograms of α and b per MoE layer (κ runs)
A figure whose metrics the run did not log (e.g. κ in a SwiGLU run) is skipped. Every figure
has steps below and tokens seen above (figure_axes.py), one y scale across its layer panels, a
label with its unit on every axis, its legend below the panels, and a title without paths.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import matplotlib

# the file backend before pyplot is imported (here or by the modules below): no display needed
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.lines import Line2D

from megatron_kappa.analysis.figure_axes import grid, legend_below, save, step_axes
from megatron_kappa.metrics.log import read_records

ROOT = Path(__file__).resolve().parents[2]

_LAYER_KEY = re.compile(r"^(?P<family>[a-z_]+)/layer(?P<layer>\d+)/(?P<stat>.+)$")
_BANDS = (("top5", "95 %", "-"), ("mean", "mean", ":"), ("bottom5", "5 %", "--"))
LOSS = "loss (nats/token)"
KAPPA = "κ (unitless; 1 = SwiGLU)"
COSINE = "cosine (unitless)"
UNFROZEN = "α, b unfrozen"


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (expected a training run directory)")
    records = read_records(path)[0]  # a record a crash left half-written is not plotted
    if not any(isinstance(r.get("step"), int) for r in records):  # figures of nothing, exit 0, it was
        raise ValueError(f"{path}: no records yet (the run has not logged a step)")
    return records


def layers_of(records: list[dict], family: str) -> list[int]:
    found = {int(m["layer"]) for r in records for k in r if (m := _LAYER_KEY.match(k)) and m["family"] == family}
    return sorted(found)


def series(records: list[dict], key: str):
    points = [(r["step"], r[key]) for r in records if key in r and isinstance(r[key], (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


def run_config(run_dir: Path) -> dict:
    """The run's config.yaml as written (plain YAML: old runs' configs need not validate)."""
    import yaml
    path = Path(run_dir) / "config.yaml"
    try:
        return yaml.safe_load(path.read_text()) or {} if path.is_file() else {}
    except (OSError, yaml.YAMLError):
        return {}


def run_title(run_dir: Path, config: dict) -> str:
    """The run's folder name and its model in words: no path (the file says where it is)."""
    model = config.get("model") or {}
    moe = model.get("moe") or {}
    kappa = (model.get("kappa") or {}).get("enabled")
    words = [f"{model['num_layers']} layers" if model.get("num_layers") else None,
             f"hidden {model['hidden_size']}" if model.get("hidden_size") else None,
             f"{moe['num_experts']} experts, top-{moe.get('topk')}" if moe.get("num_experts") else None,
             None if kappa is None else ("κ-SwiGLU" if kappa else "SwiGLU")]
    words = [w for w in words if w]
    return Path(run_dir).resolve().name + (f": {', '.join(words)}" if words else "")


def unfreeze_step(run_dir: Path, records: list[dict]) -> int | None:
    """The step at which α, b start training (None for a run without κ or without a config)."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    from megatron_kappa.config import load_config
    from megatron_kappa.optim.schedule import kappa_start as first_trained
    cfg = load_config(path)
    if not cfg.model.kappa.enabled:
        return None
    total = cfg.train.steps or (records[-1]["step"] if records else 0)
    return first_trained(total, cfg.model.kappa)


def _mark_unfreeze(ax, step):
    if step is not None:
        ax.axvline(step, color="grey", lw=0.8, ls="-.", label=UNFROZEN)


def band_figure(records, family, title, ylabel, unfreeze=None, reference=None):
    """One panel per MoE layer with the 95 % / mean / 5 % lines of `family`, one y scale."""
    layers = layers_of(records, family)
    if not layers:
        return None
    fig, axes = grid(len(layers), title)
    for ax, layer in zip(axes, layers):
        for stat, label, style in _BANDS:
            x, y = series(records, f"{family}/layer{layer}/{stat}")
            if x:
                ax.plot(x, y, style, color="C0", label=label)
        if reference is not None:
            ax.axhline(reference[0], color="black", lw=0.6, label=reference[1] or "_zero")  # "_": no legend entry
        _mark_unfreeze(ax, unfreeze)
        ax.set_title(f"layer {layer}")
        step_axes(ax, records, ylabel)
    legend_below(fig, axes)
    return fig


def loss_axes(ax, records):
    ax.plot(*series(records, "loss"), label="train loss (the step's batch)")
    x, y = series(records, "valid_loss")
    if x:
        ax.plot(x, y, "o-", label="valid loss")
    step_axes(ax, records, LOSS)
    ax.legend(loc="best")  # two entries, placed where the curves are not


def loss_figure(records, title="training loss"):
    fig, ax = plt.subplots(figsize=(6.4, 4.4), layout="constrained")
    loss_axes(ax, records)
    ax.set_title(title)
    return fig


def overview_figure(records, unfreeze=None, title=""):
    """The loss curve beside κ's spread: every MoE layer's 5 % / mean / 95 % of κ (a colour per
    layer; a colour bar instead of legend entries past 8 layers)."""
    layers = layers_of(records, "kappa")
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8), layout="constrained")
    fig.suptitle(title)
    loss_axes(left, records)
    left.set_title("loss")
    cmap = plt.get_cmap("viridis", len(layers)) if len(layers) > 8 else None
    for i, layer in enumerate(layers):
        color = cmap(i) if cmap else f"C{i}"
        for stat, _, style in _BANDS:
            x, y = series(records, f"kappa/layer{layer}/{stat}")
            if x:
                right.plot(x, y, style, color=color)
    right.axhline(1.0, color="black", lw=0.6)
    _mark_unfreeze(right, unfreeze)
    right.set_title("κ per token and gate unit (routed tokens)" if layers else "κ: not a κ-SwiGLU run")
    step_axes(right, records, KAPPA)
    if layers:
        handles = [Line2D([], [], color="black", ls=style, label=label) for _, label, style in _BANDS]
        if unfreeze is not None:
            handles.append(Line2D([], [], color="grey", lw=0.8, ls="-.", label=UNFROZEN))
        if cmap:
            bar = fig.colorbar(plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(layers[0], layers[-1])), ax=right)
            bar.set_label("MoE layer")
        else:
            handles = [Line2D([], [], color=f"C{i}", label=f"layer {layer}") for i,
                       layer in enumerate(layers)] + handles
        right.legend(handles=handles, loc="center left", bbox_to_anchor=(1.02, 0.5), frameon=False)
    return fig


def alpha_b_figure(records, unfreeze=None):
    layers = layers_of(records, "kappa")
    keys = ("alpha_pos_mean", "bias_pos_mean", "alpha_s_abs", "bias_routed_abs")
    labels = ("mean of positive α", "mean of positive b", "mean |α·s| (routed)", "mean |b| (routed)")
    layers = [layer for layer in layers if any(series(records, f"kappa/layer{layer}/{k}")[0] for k in keys)]
    if not layers:
        return None
    fig, axes = grid(len(layers), "α and b: positive means; |α·s| against |b|, the two terms inside κ's tanh")
    for ax, layer in zip(axes, layers):
        for i, (key, label) in enumerate(zip(keys, labels)):
            x, y = series(records, f"kappa/layer{layer}/{key}")
            if x:
                ax.plot(x, y, "-" if i < 2 else "--", color=f"C{i}", label=label)
        _mark_unfreeze(ax, unfreeze)
        ax.set_title(f"layer {layer}")
        step_axes(ax, records, "value (unitless)")
    legend_below(fig, axes, max_columns=5)
    return fig


def load_figure(records):
    """Tokens per expert against their mean, all three ratios on one scale (1 = balanced)."""
    layers = [layer for layer in layers_of(records, "load") if series(records, f"load/layer{layer}/cv")[0]]
    if not layers:
        return None
    fig, axes = grid(len(layers), "router load: tokens per expert against the mean (last micro-batch of each rank)")
    for ax, layer in zip(axes, layers):
        rows = [r for r in records if r.get(f"load/layer{layer}/mean")]
        for i, stat in ((1, "max"), (2, "min")):
            ax.plot([r["step"] for r in rows], [r[f"load/layer{layer}/{stat}"] / r[f"load/layer{layer}/mean"]
                                                for r in rows], color=f"C{i}", label=f"{stat} / mean")
        ax.plot(*series(records, f"load/layer{layer}/cv"), color="C0", label="CV (std / mean)")
        ax.axhline(1.0, color="black", lw=0.6, label="balanced: max = min = mean")
        ax.set_title(f"layer {layer}")
        step_axes(ax, records, "ratio to the mean (unitless)")
    legend_below(fig, axes)
    return fig


def dropped_figure(records):
    layers = [layer for layer in layers_of(records, "load") if series(records, f"load/layer{layer}/dropped_frac")[0]]
    if not layers:
        return None
    fig, axes = grid(len(layers), "dropped by the expert capacity (model.moe.capacity_factor)")
    for ax, layer in zip(axes, layers):
        ax.plot(*series(records, f"load/layer{layer}/dropped_frac"), color="C3", label="dropped")
        ax.set_title(f"layer {layer}")
        step_axes(ax, records, "fraction of (token, expert) pairs")
        ax.set_ylim(bottom=0)
    legend_below(fig, axes)
    return fig


def checkpoint_figures(run_dir: Path) -> dict:
    """Histograms at the latest checkpoint: router–gate cosines, and α, b (one scale per figure)."""
    from megatron_kappa.checkpoint.listing import CheckpointDir
    step = CheckpointDir(run_dir).latest()
    if step is None:
        return {}
    from megatron_kappa.evaluation.loading import consolidated_state
    tables = final_tables(consolidated_state(run_dir))
    if not tables:
        return {}
    figures = {}
    fig, axes = grid(len(tables), f"router–gate alignment at step {step} (the last checkpoint)")
    for ax, (layer, t) in zip(axes, sorted(tables.items())):
        ax.hist(t["cos"].reshape(-1).numpy(), bins=50, color="C0", histtype="stepfilled")  # one patch: fast
        ax.set_title(f"layer {layer}")
        ax.set(xlabel="cos(r_e, w_e,j) (unitless)", ylabel="gate rows (count)")
        ax.grid(alpha=0.3)
    figures["alignment_final.png"] = fig
    kappa = {layer: t for layer, t in tables.items() if t["alpha"] is not None or t["bias"] is not None}
    if kappa:
        fig, axes = grid(len(kappa), f"α and b at step {step} (the last checkpoint)")
        for ax, (layer, t) in zip(axes, sorted(kappa.items())):
            for i, name in enumerate(("alpha", "bias")):
                if t[name] is not None:
                    ax.hist(t[name].reshape(-1).numpy(), bins=50, alpha=0.6, color=f"C{i}", histtype="stepfilled",
                            label="α" if name == "alpha" else "b")
            ax.set_title(f"layer {layer}")
            ax.set(xlabel="value (unitless)", ylabel="entries (count)")
            ax.grid(alpha=0.3)
        legend_below(fig, axes)
        figures["kappa_params_final.png"] = fig
    return figures


def final_tables(state: dict) -> dict:
    """Per MoE layer of a full state dict: `cos` [E, F] = cos(r_e, w_e,j), `alpha`, `bias` [E, F]."""
    import torch
    tables = {}
    for name, router in state.items():
        m = re.match(r"^decoder\.layers\.(\d+)\.mlp\.router\.weight$", name)
        if not m:
            continue
        pre = f"decoder.layers.{m[1]}.mlp.experts."
        gates = []
        for e in range(router.shape[0]):
            fc1 = state[f"{pre}local_experts.{e}.linear_fc1.weight"].float()
            gates.append(fc1[: fc1.shape[0] // 2])
        gates, r = torch.stack(gates), router.float()
        cos = torch.einsum("efh,eh->ef", gates, r / r.norm(dim=-1, keepdim=True)) / gates.norm(dim=-1)
        tables[int(m[1])] = {"cos": cos, "alpha": _float(state.get(pre + "kappa_alpha")),
                             "bias": _float(state.get(pre + "kappa_bias"))}
    return tables


def _float(t):
    return None if t is None else t.float()


def build_figures(run_dir, checkpoint: bool = True) -> dict:
    """{file name: matplotlib Figure} of every figure the run's metrics allow (not saved)."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    unfreeze = unfreeze_step(run_dir, records)
    kappa_one = (1.0, "κ = 1 (SwiGLU)")
    figures = {
        "overview.png": overview_figure(records, unfreeze, title=run_title(run_dir, run_config(run_dir))),
        "loss.png": loss_figure(records),
        "kappa.png": band_figure(records, "kappa", "κ dynamics per MoE layer (routed tokens, every gate unit)", KAPPA,
                                 unfreeze, kappa_one),
        "alpha_b.png": alpha_b_figure(records, unfreeze),
        "alignment.png": band_figure(records, "align", "router–gate alignment cos(r_e, w_e,j) over experts e and "
                                     "gate rows j", COSINE, unfreeze, (0.0, None)),
        "gate_bias.png": band_figure(records, "gate_bias", "confidence-induced gate bias (w_e,jᵀ r̂_e)(r̂_eᵀ x), "
                                     "routed tokens", "gate bias (gate pre-activation units)", unfreeze, (0.0, None)),
        "token_cos.png": band_figure(records, "token_cos", "cos(x, r_e) of routed tokens x and their experts' "
                                     "router vectors", COSINE, unfreeze, (0.0, None)),
        "load.png": load_figure(records),
        "dropped.png": dropped_figure(records)}
    if checkpoint:
        figures.update(checkpoint_figures(run_dir))
    return {name: fig for name, fig in figures.items() if fig is not None}


def make_plots(run_dir, out=None, checkpoint: bool = True) -> list[Path]:
    """Write every figure the run's metrics allow; returns the files written."""
    figures = build_figures(run_dir, checkpoint)
    out = Path(out) if out else Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    return [save(fig, out / name) for name, fig in figures.items()]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="training run directory (holds metrics.jsonl)")
    ap.add_argument("--out", help="where the PNGs go (default: RUN_DIR/plots)")
    ap.add_argument("--no-checkpoint", action="store_true", help="skip the figures read from the last checkpoint")
    args = ap.parse_args(argv)
    try:
        for path in make_plots(args.run_dir, args.out, checkpoint=not args.no_checkpoint):
            print(path)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
