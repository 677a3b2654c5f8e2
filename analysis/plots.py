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
  load.png         tokens per expert (max / mean, min / mean, CV) and dropped tokens
From the latest checkpoint (unless --no-checkpoint or there is none):
  alignment_final.png   histogram of cos(r_e, w_e,j) per MoE layer
  kappa_params_final.png  histograms of α and b per MoE layer (κ runs)
A figure whose metrics the run did not log (e.g. κ in a SwiGLU run) is skipped.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from megatron_kappa.metrics.log import read_records  # noqa: E402

_LAYER_KEY = re.compile(r"^(?P<family>[a-z_]+)/layer(?P<layer>\d+)/(?P<stat>.+)$")
_BANDS = (("top5", "95 %", "-"), ("mean", "mean", ":"), ("bottom5", "5 %", "--"))


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file (expected a training run directory)")
    return read_records(path)[0]  # a record a crash left half-written is not plotted


def layers_of(records: list[dict], family: str) -> list[int]:
    found = {int(m["layer"]) for r in records for k in r if (m := _LAYER_KEY.match(k)) and m["family"] == family}
    return sorted(found)


def series(records: list[dict], key: str):
    points = [(r["step"], r[key]) for r in records if key in r and isinstance(r[key], (int, float))]
    return [p[0] for p in points], [p[1] for p in points]


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


def _grid(n: int, title: str):
    cols = min(n, 4)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.8 * rows), squeeze=False, sharex=True)
    fig.suptitle(title)
    for ax in axes.flat[n:]:
        ax.set_visible(False)
    return fig, list(axes.flat[:n])


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _mark_unfreeze(ax, step):
    if step is not None:
        ax.axvline(step, color="grey", lw=0.8, ls="-.", label="α, b unfrozen")


def band_figure(records, family, title, ylabel, path, unfreeze=None, reference=None):
    """One panel per MoE layer with the 95 % / mean / 5 % lines of `family`."""
    layers = layers_of(records, family)
    if not layers:
        return None
    fig, axes = _grid(len(layers), title)
    for ax, layer in zip(axes, layers):
        for stat, label, style in _BANDS:
            x, y = series(records, f"{family}/layer{layer}/{stat}")
            if x:
                ax.plot(x, y, style, color="C0", label=label)
        if reference is not None:
            ax.axhline(reference, color="black", lw=0.6)
        _mark_unfreeze(ax, unfreeze)
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def loss_axes(ax, records):
    ax.plot(*series(records, "loss"), label="train loss")
    x, y = series(records, "valid_loss")
    if x:
        ax.plot(x, y, "o-", label="valid loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend()


def loss_figure(records, path, title="training loss"):
    fig, ax = plt.subplots(figsize=(6, 4))
    loss_axes(ax, records)
    ax.set_title(title)
    return _save(fig, path)


def overview_figure(records, path, unfreeze=None, title=""):
    """The loss curve beside κ's spread: every MoE layer's 5 % / mean / 95 % of κ."""
    layers = layers_of(records, "kappa")
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    fig.suptitle(title)
    loss_axes(left, records)
    left.set_title("loss")
    for i, layer in enumerate(layers):
        for stat, label, style in _BANDS:
            x, y = series(records, f"kappa/layer{layer}/{stat}")
            if x:
                right.plot(x, y, style, color=f"C{i}", label=f"layer {layer} {label}")
    right.axhline(1.0, color="black", lw=0.6)
    _mark_unfreeze(right, unfreeze)
    right.set_title("κ per token and gate unit (routed tokens)" if layers else "κ: not a κ-SwiGLU run")
    right.set_xlabel("step")
    right.set_ylabel("κ")
    if layers:
        right.legend(fontsize=6, ncol=max(1, len(layers) // 3))
    return _save(fig, path)


def alpha_b_figure(records, path, unfreeze=None):
    layers = layers_of(records, "kappa")
    keys = ("alpha_pos_mean", "bias_pos_mean", "alpha_s_abs", "bias_routed_abs")
    labels = ("mean of positive α", "mean of positive b", "|α·s| (routed)", "|b| (routed)")
    layers = [l for l in layers if any(series(records, f"kappa/layer{l}/{k}")[0] for k in keys)]
    if not layers:
        return None
    fig, axes = _grid(len(layers), "α and b: positive means; |α·s| against |b| inside κ's tanh")
    for ax, layer in zip(axes, layers):
        for i, (key, label) in enumerate(zip(keys, labels)):
            x, y = series(records, f"kappa/layer{layer}/{key}")
            if x:
                ax.plot(x, y, "-" if i < 2 else "--", color=f"C{i}", label=label)
        _mark_unfreeze(ax, unfreeze)
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def load_figure(records, path):
    layers = layers_of(records, "load")
    if not layers:
        return None
    fig, axes = _grid(len(layers), "router load: tokens per expert (last micro-batch of each rank)")
    for ax, layer in zip(axes, layers):
        steps, cv = series(records, f"load/layer{layer}/cv")
        ax.plot(steps, cv, color="C0", label="CV")
        rows = [r for r in records if r.get(f"load/layer{layer}/mean")]
        if rows:
            ax2 = ax.twinx()
            for i, stat in ((1, "max"), (2, "min")):
                ax2.plot([r["step"] for r in rows], [r[f"load/layer{layer}/{stat}"] / r[f"load/layer{layer}/mean"]
                                                     for r in rows], color=f"C{i}", label=f"{stat} / mean")
            ax2.legend(fontsize=7, loc="upper right")
        x, dropped = series(records, f"load/layer{layer}/dropped_frac")
        if x:
            ax.plot(x, dropped, "--", color="C3", label="dropped fraction")
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("step")
        ax.legend(fontsize=7, loc="upper left")
    return _save(fig, path)


def checkpoint_figures(run_dir: Path, out: Path) -> list[Path]:
    """Histograms at the latest checkpoint: router–gate cosines, and α, b."""
    from megatron_kappa.checkpoint.listing import CheckpointDir
    if CheckpointDir(run_dir).latest() is None:
        return []
    from megatron_kappa.evaluation.loading import consolidated_state
    tables = final_tables(consolidated_state(run_dir))
    if not tables:
        return []
    written = []
    fig, axes = _grid(len(tables), "router–gate alignment at the last checkpoint: cos(r_e, w_e,j)")
    for ax, (layer, t) in zip(axes, sorted(tables.items())):
        ax.hist(t["cos"].reshape(-1).numpy(), bins=50, color="C0", histtype="stepfilled")  # one patch: fast
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("cosine")
    written.append(_save(fig, out / "alignment_final.png"))
    kappa = {l: t for l, t in tables.items() if t["alpha"] is not None or t["bias"] is not None}
    if kappa:
        fig, axes = _grid(len(kappa), "α and b at the last checkpoint")
        for ax, (layer, t) in zip(axes, sorted(kappa.items())):
            for i, name in enumerate(("alpha", "bias")):
                if t[name] is not None:
                    ax.hist(t[name].reshape(-1).numpy(), bins=50, alpha=0.6, color=f"C{i}", histtype="stepfilled",
                            label="α" if name == "alpha" else "b")
            ax.set_title(f"layer {layer}")
            ax.legend(fontsize=7)
        written.append(_save(fig, out / "kappa_params_final.png"))
    return written


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


def make_plots(run_dir, out=None, checkpoint: bool = True) -> list[Path]:
    """Write every figure the run's metrics allow; returns the files written."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    out = Path(out) if out else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    unfreeze = unfreeze_step(run_dir, records)
    written = [overview_figure(records, out / "overview.png", unfreeze, title=str(run_dir)),
               loss_figure(records, out / "loss.png"),
               band_figure(records, "kappa", "κ dynamics per MoE layer", "κ", out / "kappa.png", unfreeze, 1.0),
               alpha_b_figure(records, out / "alpha_b.png", unfreeze),
               band_figure(records, "align", "router–gate alignment cos(r_e, w_e,j)", "cosine",
                           out / "alignment.png", unfreeze, 0.0),
               band_figure(records, "gate_bias", "confidence-induced gate bias (w_e,jᵀ r̂_e)(r̂_eᵀ x), routed tokens",
                           "gate bias", out / "gate_bias.png", unfreeze, 0.0),
               band_figure(records, "token_cos", "cos(x, r_e) of routed tokens", "cosine",
                           out / "token_cos.png", unfreeze, 0.0),
               load_figure(records, out / "load.png")]
    if checkpoint:
        written += checkpoint_figures(run_dir, out)
    return [p for p in written if p is not None]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", help="training run directory (holds metrics.jsonl)")
    ap.add_argument("--out", help="where the PNGs go (default: RUN_DIR/plots)")
    ap.add_argument("--no-checkpoint", action="store_true", help="skip the figures read from the last checkpoint")
    args = ap.parse_args(argv)
    try:
        for path in make_plots(args.run_dir, args.out, checkpoint=not args.no_checkpoint):
            print(path)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
