"""What a resumed run may change: the config keys that shape the parameters or the optimizer
state (refused: the checkpoint could not be loaded, or would load into another model), against
everything else (intervals, logging, data paths, learning-rate and κ schedules, losses'
weights...: allowed, and recorded in the run's config history). The schedules' length (train.steps)
is allowed only with train.allow_schedule_change: the schedules are computed over it, so another
length moves the learning rate at the resumed step (`check_schedule`).

No torch: the preflight asks before any process group exists (megatron_kappa.preflight), and the
trainer again before it writes anything (megatron_kappa.train.loop). tests/test_resume_check.py
changes every schema key in turn and checks that exactly these keys change the parameters or
the optimizer's groups.
"""
from __future__ import annotations

from megatron_kappa import attention_kinds
from megatron_kappa.config import ConfigError, facts
from megatron_kappa.config.schema import Config, flat_keys

# The keys (dotted; a section name covers all of it) whose change gives other parameters or
# buffers, other shapes, names or dtypes, or another optimizer-group structure (model.block and
# model.aspect_ratio through the keys they set): the schema's `state` keys (config/facts.py). The
# layout (parallel.*) and zero.stage are free for checkpoints of format 2 (parameter-shaped
# optimizer state, megatron_kappa.checkpoint.store); format 1 ones hold ZeRO's partitions of one
# layout: `check_layout` refuses a change there.
SHAPES_STATE = facts.marked(Config, "state")
# Derived or recorded by the trainer itself, not the user's to compare (the schema's `derived`).
IGNORED = facts.marked(Config, "derived")


def _covered(key: str, names) -> bool:
    return any(key == n or key.startswith(n + ".") for n in names)


def changes(saved: dict, now: dict) -> tuple[list[str], list[str]]:
    """(refused, allowed): the keys that differ between the checkpoint's config and this run's."""
    a, b = flat_keys(attention_kinds.recorded(saved)), flat_keys(now)  # an older config's keys as today's
    differ = sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k) and not _covered(k, IGNORED))
    return [k for k in differ if _covered(k, SHAPES_STATE)], [k for k in differ if not _covered(k, SHAPES_STATE)]


def check(saved: dict | None, now: dict, checkpoint: str):
    """A one-line ConfigError when `now` changes a key that shapes the parameters or the
    optimizer state of the checkpoint written with `saved` (None: a checkpoint that recorded no
    config, not checked)."""
    if saved is None:
        return
    refused, _ = changes(saved, now)
    if refused:
        a, b = flat_keys(saved), flat_keys(now)
        listed = ", ".join(f"{k} {a.get(k)!r} → {b.get(k)!r}" for k in refused)
        raise ConfigError(f"config: {listed}: checkpoint {checkpoint} holds another model or optimizer state; "
                          "resume with its values, or start a new run.dir (train.init_weights for its weights)")


# The schedules' length: train.steps, or when it is null the token budget, 5 × N_eff tokens in steps
# of global_batch × seq_length (megatron_kappa.summary.count); N_eff's other inputs shape the model,
# which `check` compares.
LENGTH = ("train.steps",)
BUDGET = ("train.tokens_per_param", "train.budget_discount", "train.global_batch", "model.seq_length",
          "model.moe.topk", "model.moe.softmoe.budget")


def schedule_changes(saved: dict, now: dict, step: int) -> list[str]:
    """"key old → new" of each change of the schedules' length between the checkpoint's config
    and this run's; none where the run has no step left to train (the loop says so)."""
    a, b = flat_keys(saved), flat_keys(now)
    steps = b.get("train.steps")
    if steps is not None and step >= steps:
        return []
    keys = LENGTH if steps is not None or a.get("train.steps") is not None else LENGTH + BUDGET
    return [f"{k} {a.get(k)!r} → {b.get(k)!r}" for k in keys if a.get(k) != b.get(k)]


def check_schedule(saved: dict | None, now: dict, checkpoint: str, step: int) -> str | None:
    """A one-line ConfigError when a resume from `step` changes the schedules' length, unless
    train.allow_schedule_change; then the line that says so at start (None: no change)."""
    changed = schedule_changes(saved, now, step) if saved is not None else []
    if not changed:
        return None
    listed = ", ".join(changed)
    if now["train"].get("allow_schedule_change"):
        return (f"resume: {listed} (train.allow_schedule_change): the learning-rate, weight-decay and κ schedules "
                f"are recomputed over the new length from step {step}")
    raise ConfigError(f"config: {listed}: checkpoint {checkpoint} was trained on schedules of the other length, "
                      f"and resuming would move the learning rate at step {step}; resume with its values, or set "
                      "train.allow_schedule_change=true (docs/checkpoints.md)")


def check_layout(meta: dict, now_layout: dict, now: dict, checkpoint: str):
    """A format-1 checkpoint (DeepSpeed's ZeRO files) loads only in the layout and ZeRO stage
    that wrote it; format 2 loads in any (megatron_kappa.checkpoint.store)."""
    if meta.get("format", 1) >= 2:
        return
    saved_stage = (meta.get("config") or {}).get("zero", {}).get("stage", now["zero"]["stage"])
    if meta["layout"] != now_layout or saved_stage != now["zero"]["stage"]:
        raise ConfigError(f"config: parallel: checkpoint {checkpoint} (format 1, written before checkpoints "
                          f"resharded) loads only in its own layout {meta['layout']} with zero.stage "
                          f"{saved_stage}; this run is {now_layout} with zero.stage {now['zero']['stage']}: "
                          "resume once in its layout, and the next checkpoint loads in any")


def record(run_dir, config: dict, start: int):
    """The run's config.yaml (this start's config) and its history: every start of the run adds
    config_history/start_<step>[_<n>].yaml, so a resume with allowed changes keeps what the earlier
    steps were trained with. Written atomically."""
    from pathlib import Path

    import yaml

    from megatron_kappa.checkpoint.listing import atomic_write_text
    run_dir = Path(run_dir)
    text = yaml.safe_dump(config, sort_keys=False)
    history = run_dir / "config_history"
    history.mkdir(parents=True, exist_ok=True)
    name, n = f"start_{start}", 1
    while (history / f"{name}.yaml").exists():
        name, n = f"start_{start}_{n}", n + 1
    atomic_write_text(history / f"{name}.yaml", text)
    atomic_write_text(run_dir / "config.yaml", text)
