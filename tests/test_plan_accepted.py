"""`python -m plan --search` proposes only what the trainer runs (plan.accepted).

Every row of the default search is written back into configs/tiny.yaml as --set overrides, as a
user would launch it, and handed to the trainer's own preflight (megatron_kappa.preflight: the
config read from the file, every check `launch/pretrain.py --check 8` runs): none is refused. The
negative control: the same search with --planned-layouts proposes rows the preflight refuses
(today: interleaved stages with fewer micro-batches than stages), and each of those is labelled.
The EP overlap (parallel.overlap_moe_expert_parallel_comm) is a setting the search tries: in bf16
it proposes rows with it on, each passing the preflight, and the same rows in tiny's fp32 are
refused (the control); in fp32 the default search proposes none.
"""
import subprocess
import sys

import pytest

from megatron_kappa.config import ConfigError, load_config
from megatron_kappa.plan import Layout, search
from megatron_kappa.plan.accepted import refusal
from megatron_kappa.preflight import preflight

ROOT = __import__("pathlib").Path(__file__).resolve().parents[1]
WORLD = 8


def launch_overrides(row, tmp_path) -> list[str]:
    """The row as a user writes it for the trainer: its layout, micro-batch, recompute mode and EP
    overlap."""
    lay = row.layout
    sets = [f"parallel.tp={lay.tp}", f"parallel.pp={lay.pp}", f"parallel.ep={lay.ep}", f"parallel.etp={lay.etp}",
            f"parallel.vpp={lay.vpp}", f"train.micro_batch={row.micro_batch}",
            f"model.recompute={row.most_loaded.recompute}", f"run.dir={tmp_path / 'run'}"]
    sets += [f"parallel.overlap_moe_expert_parallel_comm={str(row.ep_overlap).lower()}"]
    return sets + [f"parallel.cp={lay.cp}"] * (lay.cp > 1)  # a key the trainer may not know: its refusal


def trainer_refuses(row, tmp_path, config_sets=()) -> str | None:
    try:
        preflight(load_config("configs/tiny.yaml", [*config_sets, *launch_overrides(row, tmp_path)]), world=WORLD)
    except ConfigError as e:
        return str(e)
    return None


BF16 = ("precision=bf16",)  # the EP overlap needs bf16 or fp8 (tiny is fp32)


@pytest.fixture(scope="module")
def searches():
    cfg = load_config("configs/tiny.yaml")
    return {"default": search.search(cfg, WORLD, top=None),
            "planned": search.search(cfg, WORLD, top=None, planned_layouts=True),
            "bf16": search.search(load_config("configs/tiny.yaml", list(BF16)), WORLD, top=None)}


def test_default_search_proposes_nothing_the_trainer_refuses(searches, tmp_path):
    rows = searches["default"]
    assert len(rows) > 10
    refused = {r.label: why for r in rows if (why := trainer_refuses(r, tmp_path))}
    assert refused == {}
    assert all(not r.planned_only for r in rows)  # nothing planned only unless asked for
    assert not any(r.ep_overlap for r in rows)  # fp32: the trainer refuses the EP overlap


def test_the_ep_overlap_is_searched_as_a_trainer_setting(searches, tmp_path):
    rows = searches["bf16"]
    on = [r for r in rows if r.ep_overlap]
    assert on and len(on) < len(rows)  # where it pays and the trainer runs it
    refused = {r.label: why for r in rows if (why := trainer_refuses(r, tmp_path, BF16))}
    assert refused == {}
    assert all(not r.planned_only for r in rows)  # the trainer runs it: not planned only
    assert all(r.layout.ep >= 2 and r.layout.cp == 1 and (r.layout.pp == 1 or r.layout.vpp > 1) for r in on)
    # the control: the same rows in tiny's own fp32 are refused, naming the overlap
    for r in on:
        assert "parallel.overlap_moe_expert_parallel_comm: needs precision bf16 or fp8" in trainer_refuses(r, tmp_path)


def test_a_refused_overlap_drops_out_through_the_trainers_checks(monkeypatch):
    """ZeRO-2 (refused with the overlap: config/checks.py) in bf16: no row has it; the control:
    the same search with the trainer's checks judging each setting as ZeRO-1 proposes it. (64
    sequences a step: ZeRO-2 allows no stages, and without them tiny's 8 leave too few
    micro-batches to pair for the overlap to pay.)"""
    import dataclasses
    cfg = load_config("configs/tiny.yaml", [*BF16, "zero.stage=2", "train.global_batch=64"])
    on = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, overlap_moe_expert_parallel_comm=True))
    assert "zero.stage" in refusal(on, Layout(WORLD, ep=2))
    assert not any(r.ep_overlap for r in search.search(cfg, WORLD, top=None))
    def as_zero1(variant, layout):
        return refusal(dataclasses.replace(variant, zero=dataclasses.replace(
variant.zero, stage=1)), layout)
    monkeypatch.setattr(search, "refusal", as_zero1)
    assert any(r.ep_overlap for r in search.search(cfg, WORLD, top=None))


def test_negative_control_planned_layouts_propose_what_the_trainer_refuses(searches, tmp_path):
    rows = searches["planned"]
    refused = [r for r in rows if trainer_refuses(r, tmp_path)]
    assert refused  # the unfiltered search proposes layouts and settings the trainer refuses
    for r in rows:  # exactly those are labelled, in every row
        marked = any(label.startswith("refused by the trainer") for label in r.planned_only)
        assert marked == (r in refused), (r.label, r.planned_only)
    # where a layout's fastest setting is refused, the default search keeps its best accepted one
    accepted = {r.layout for r in searches["default"]}
    assert all(r.layout in accepted or trainer_refuses(r, tmp_path) for r in rows)


def test_a_factor_the_schema_lacks_is_refused_as_the_trainer_refuses_it():
    """A layout factor that is not a config key (before parallel.cp existed, CP) is the loader's
    unknown-key error, here shown with a key no schema has."""
    import dataclasses

    from megatron_kappa.plan import accepted
    cfg = load_config("configs/tiny.yaml")
    assert refusal(cfg, Layout(WORLD, tp=2, pp=2)) is None
    original = accepted.to_dict

    def with_unknown(c):
        data = original(c)
        data["parallel"]["ring"] = 2
        return data
    try:
        accepted.to_dict = with_unknown
        assert "unknown key 'parallel.ring'" in refusal(cfg, Layout(WORLD, tp=2, pp=2))
    finally:
        accepted.to_dict = original
    # a layout the trainer's batch check refuses: 8 sequences, micro-batch 4 over DP 8
    assert "train.global_batch" in refusal(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train,
                                                                                              micro_batch=4)),
                                           Layout(WORLD))


def test_command_line_marks_every_row():
    def run(*a):
        return subprocess.run([sys.executable, "-m", "plan", "--config", "configs/tiny.yaml",
                               "--world", str(WORLD), "--search", "--no-progress", "--top", "100", *a],
                              cwd=ROOT, capture_output=True, text=True, timeout=300)
    plain, moments, planned = run(), run("--optimizer-states", "bf16"), run("--planned-layouts")
    assert plain.returncode == moments.returncode == planned.returncode == 0, plain.stderr + planned.stderr
    head, *rows = plain.stdout.splitlines()
    assert head.endswith("planned only") and rows and all(r.endswith("  -") for r in rows)
    # a planned-only setting asked for is marked in every row
    rows = moments.stdout.splitlines()[1:]
    assert rows and all(r.endswith("bf16 optimizer moments") for r in rows)
    # refused layouts only with --planned-layouts, each marked
    rows = planned.stdout.splitlines()[1:]
    assert any("refused by the trainer" in r for r in rows)
    alone = subprocess.run([sys.executable, "-m", "plan", "--config", "configs/tiny.yaml", "--world", "8",
                            "--planned-layouts"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert alone.returncode == 2 and "--planned-layouts goes with --search" in alone.stderr
