"""Resume is checked before anything is written (issue 34): the keys that shape the parameters or
the optimizer state are refused in one line, the others allowed and recorded in the run's config
history. The list (megatron_kappa.checkpoint.resume.SHAPES_STATE) is checked against the model:
every schema key is changed in turn, and each change that alters the parameters' names, shapes or
dtypes or the optimizer's groups must be a refused key."""
import dataclasses
import typing

import pytest

from megatron_kappa import attention_kinds, preflight, routers
from megatron_kappa.checkpoint import resume
from megatron_kappa.config import Config, ConfigError, load_config, to_dict
from megatron_kappa.config.schema import flat_keys
from megatron_kappa.kappa import inputs as kappa_inputs
from megatron_kappa.model.build import build_model
from megatron_kappa.optim.optimizer import param_groups
from tests.support.toy_attention import TOY, toy_kind  # an attention kind with a q/k/v bias: another model

BASES = {"tiny": [], "softmoe": ["model.moe.router=softmoe"], "nanochat": ["model.block=nanochat"],
         "aurora": ["train.optimizer=aurora"]}
# refused, but not visible in the built model: the layout of ZeRO's saved partitions; the width
# rule, which sets hidden_size (tiny sets that itself)
STATE_ONLY = {"zero.stage", "model.aspect_ratio"}


# keys whose values are names in a registry (strings in the schema)
REGISTRIES = {"model.moe.router": list(routers.ROUTERS), "model.kappa.input": list(kappa_inputs.VARIANTS),
              "model.attention_kind": [*attention_kinds.KINDS, TOY]}


@pytest.fixture
def toy_attention():
    attention_kinds.register(TOY, toy_kind())
    yield
    attention_kinds.unregister(TOY)


def leaves(cls, prefix=""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind):
            yield from leaves(kind, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", kind


def other_values(kind, value):
    """Changed values of a key worth trying (invalid ones are skipped by the caller)."""
    args = typing.get_args(kind)
    if type(None) in args:
        (kind,) = [a for a in args if a is not type(None)]
        if value is None:
            return {int: [2, 32, 128], float: [0.5], bool: [True, False]}.get(kind, [])
        return ["null"] + other_values(kind, value)
    if typing.get_origin(kind) is typing.Literal:
        return [v for v in args if v != value]
    if kind is bool:
        return [not value]
    if kind is int:
        return [value * 2 if value else 1]
    if kind is float:
        return [value * 2 if value else 0.5]
    return []  # strings (paths, names) and lists: not model shapes


def signature(cfg):
    from megatron_kappa.parallel.groups import init_distributed
    init_distributed(cfg.parallel, cfg.train.seed)
    model = build_model(cfg, meta=True)
    # the buffers too: a checkpoint holds them (the sigmoid router's expert bias)
    params = sorted((n, tuple(p.shape), str(p.dtype)) for n, p in [*model.named_parameters(), *model.named_buffers()])
    groups = [(g["kind"], len(g["params"])) for g in param_groups(model, cfg.train, cfg.model) if g["params"]]
    return params, groups


def test_every_key_that_changes_the_model_or_optimizer_groups_is_refused(world1, toy_attention):
    changed = set()
    for base, sets in BASES.items():
        cfg = load_config("configs/tiny.yaml", sets)
        flat = flat_keys(to_dict(cfg))
        want = signature(cfg)
        for key, kind in leaves(Config):
            if resume._covered(key, resume.IGNORED):
                continue
            values = other_values(kind, flat[key]) or [v for v in REGISTRIES.get(key, ()) if v != flat[key]]
            for value in values:
                try:
                    other = load_config("configs/tiny.yaml", [*sets, f"{key}={value}"])
                    preflight.check_attention(other.model)  # TE attention: not on this machine
                except ConfigError:
                    continue
                try:
                    got = signature(other)
                except (ValueError, AssertionError, RuntimeError):
                    continue  # a combination megatron refuses at build time
                if got != want:
                    changed.add(key)
                    assert resume._covered(key, resume.SHAPES_STATE), (base, key, value)
    # and the refused list holds nothing that changes neither (negative control of the listing)
    listed = set(resume.SHAPES_STATE) - STATE_ONLY
    # (model.mla: turning MLA on needs several keys at once, which this one-key sweep never gives)
    assert listed <= changed | {"model.head_dim", "model.num_query_groups", "model.mla"}, sorted(listed - changed)


def test_refusal_names_the_keys_and_allows_the_rest():
    saved = to_dict(load_config("configs/tiny.yaml", []))
    now = to_dict(load_config("configs/tiny.yaml", ["model.hidden_size=128", "model.num_layers=8",
                                                    "train.steps=80", "log.interval=2", "train.lr=1e-3"]))
    refused, allowed = resume.changes(saved, now)
    assert refused == ["model.hidden_size", "model.num_layers"]
    assert allowed == ["log.interval", "train.lr", "train.steps"]
    with pytest.raises(ConfigError, match=r"model.hidden_size 64 → 128, model.num_layers 4 → 8: checkpoint x") as e:
        resume.check(saved, now, "x")
    assert "\n" not in str(e.value)
    resume.check(saved, to_dict(load_config("configs/tiny.yaml", ["train.steps=80"])), "x")  # allowed
    resume.check(None, now, "x")  # a checkpoint without a recorded config: nothing to compare


def test_a_resume_that_changes_the_schedules_length_is_refused_unless_allowed():
    """train.steps 50 → 80 at step 20 would move the learning rate there (the schedules run over the
    total): refused in one line naming the key, allowed with train.allow_schedule_change (which returns
    the line said at start). Negative controls: the same length, other allowed changes and a run with
    no step left to train pass without a word."""
    saved = to_dict(load_config("configs/tiny.yaml", ["train.steps=50"]))
    def now(*sets):
        return to_dict(load_config("configs/tiny.yaml", ["train.steps=50", *sets]))
    with pytest.raises(ConfigError, match=r"^config: train.steps 50 → 80: checkpoint x was trained on schedules of "
                                          r"the other length.*step 20.*train.allow_schedule_change=true") as e:
        resume.check_schedule(saved, now("train.steps=80"), "x", 20)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="train.steps 50 → 30"):
        resume.check_schedule(saved, now("train.steps=30"), "x", 20)
    said = resume.check_schedule(saved, now("train.steps=80", "train.allow_schedule_change=true"), "x", 20)
    assert said.startswith("resume: train.steps 50 → 80 (train.allow_schedule_change)") and "\n" not in said
    assert resume.check_schedule(saved, now(), "x", 20) is None
    assert resume.check_schedule(saved, now("train.lr=1e-3", "log.interval=2", "train.global_batch=16"), "x",
                                 20) is None
    assert resume.check_schedule(saved, now("train.steps=20"), "x", 20) is None  # nothing left: the loop says so
    assert resume.check_schedule(None, now("train.steps=80"), "x", 20) is None  # no recorded config
    # the token budget (train.steps null): its inputs set the length
    budget = to_dict(load_config("configs/tiny.yaml", ["train.steps=null"]))
    assert resume.check_schedule(budget, to_dict(load_config("configs/tiny.yaml", ["train.steps=null"])), "x",
                                 2) is None
    for change in ("train.global_batch=16", "train.tokens_per_param=10", "model.moe.topk=1", "train.steps=80"):
        key = change.split("=")[0]
        with pytest.raises(ConfigError, match=f"^config: {key} "):
            resume.check_schedule(budget, to_dict(load_config("configs/tiny.yaml", ["train.steps=null", change])),
                                  "x", 2)


def test_config_history_keeps_every_start(tmp_path):
    import yaml
    first = to_dict(load_config("configs/tiny.yaml", []))
    second = to_dict(load_config("configs/tiny.yaml", ["train.steps=80"]))
    resume.record(tmp_path, first, 0)
    resume.record(tmp_path, second, 50)
    resume.record(tmp_path, second, 50)
    history = sorted(p.name for p in (tmp_path / "config_history").iterdir())
    assert history == ["start_0.yaml", "start_50.yaml", "start_50_1.yaml"]
    assert yaml.safe_load((tmp_path / "config_history/start_0.yaml").read_text())["train"]["steps"] == 50
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["train"]["steps"] == 80


@pytest.mark.slow
def test_resume_with_another_shape_is_refused_before_any_write(world1, tmp_path, monkeypatch):
    """A run resumed with another hidden size stops in one line before writing anything (its
    config.yaml still describes its checkpoint); an allowed change resumes and adds to the history.
    Negative control: without the check the resume crashes inside the load."""
    from megatron_kappa.train import loop
    sets = ["train.steps=2", "data.mock=true", "model.seq_length=32", "train.micro_batch=2", "train.global_batch=4",
            "log.tensorboard=false", "eval.valid_every=0", f"run.dir={tmp_path}"]
    loop.run(load_config("configs/tiny.yaml", sets), log=lambda *a: None)
    config = (tmp_path / "config.yaml").read_text()
    with pytest.raises(ConfigError, match=r"model.hidden_size 64 → 128: checkpoint .*step_2"):
        loop.run(load_config("configs/tiny.yaml", [*sets, "model.hidden_size=128", "train.steps=3"]),
                 log=lambda *a: None)
    assert (tmp_path / "config.yaml").read_text() == config
    assert sorted(p.name for p in (tmp_path / "config_history").iterdir()) == ["start_0.yaml"]
    # another schedule length: refused before any write too, unless train.allow_schedule_change
    with pytest.raises(ConfigError, match=r"train.steps 2 → 3: checkpoint .*step_2 .*allow_schedule_change=true"):
        loop.run(load_config("configs/tiny.yaml", [*sets, "train.steps=3"]), log=lambda *a: None)
    assert (tmp_path / "config.yaml").read_text() == config
    assert sorted(p.name for p in (tmp_path / "config_history").iterdir()) == ["start_0.yaml"]
    lines = []
    loop.run(load_config("configs/tiny.yaml", [*sets, "train.steps=3", "train.allow_schedule_change=true"]),
             log=lines.append)  # allowed, and said at start
    assert sum(line.startswith("resume: train.steps 2 → 3 (train.allow_schedule_change)") for line in lines) == 1
    assert sorted(p.name for p in (tmp_path / "config_history").iterdir()) == ["start_0.yaml", "start_2.yaml"]
    monkeypatch.setattr(resume, "check", lambda *a: None)
    with pytest.raises(Exception) as crash:
        loop.run(load_config("configs/tiny.yaml", [*sets, "model.hidden_size=128", "train.steps=4",
                                                   "train.allow_schedule_change=true"]), log=lambda *a: None)
    assert not isinstance(crash.value, ConfigError)


def test_the_preflight_refuses_another_schedule_length_before_any_process_group(tmp_path):
    """launch/pretrain.py --check's path (megatron_kappa.preflight.check_resume) reads the newest
    checkpoint's recorded config: another train.steps is refused, the same is not."""
    import json
    step = tmp_path / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    saved = to_dict(load_config("configs/tiny.yaml", ["train.steps=4", f"run.dir={tmp_path}"]))
    (step / "meta.json").write_text(json.dumps({"layout": {}, "format": 2, "step": 2, "files": {}, "config": saved}))
    with pytest.raises(ConfigError, match=r"train.steps 4 → 8: checkpoint .*step_2"):
        preflight.check_resume(load_config("configs/tiny.yaml", ["train.steps=8", f"run.dir={tmp_path}"]), 1)
    preflight.check_resume(load_config("configs/tiny.yaml", ["train.steps=4", f"run.dir={tmp_path}"]), 1)
