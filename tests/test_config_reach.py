"""How many functions of the repository take the whole config (issue 51, deliverable 6; issue 59,
deliverable 3).

Leaf functions take the section they read (`train: TrainConfig`, `model: ModelConfig`,
`moe: MoEConfig`...), derived value objects (megatron_kappa.model.layout.ModelLayout) or narrow
values (the spec builders' `grouped_gemm`, `kappa`, as megatron-core's spec functions take
`num_experts`, `moe_grouped_gemm`); the whole config stays with the functions that read several
sections or hand them on: the training loop's top, the preflight, the cross-field checks,
build_model's entry point, the planner's estimate, the CLIs. A function counts when one of its
parameters is annotated `Config` (also quoted, or as `module.Config`) or is named `cfg`, `config`
or `conf` without an annotation, whatever the folder: every .py of the repository but tests/ and
hidden folders (.venv). The limit keeps new leaf functions from taking the whole config again: one
that does pushes the count up, and the message lists every function counted.
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 60  # issue 59: at most 60 (131 by this rule before the sections were handed down)
WHOLE_NAMES = ("cfg", "config", "conf")  # a bare parameter of these names is taken to be the whole config


def _is_whole_config(arg: ast.arg) -> bool:
    annotation = ast.unparse(arg.annotation) if arg.annotation else ""
    if annotation.strip("'\"") == "Config" or annotation.strip("'\"").endswith(".Config"):
        return True
    return arg.arg in WHOLE_NAMES and not annotation


def whole_config_functions(source: str, where: str = "") -> list[str]:
    """`where:line name` of each function in `source` with a parameter that is the whole config."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            if any(_is_whole_config(arg) for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs)):
                found.append(f"{where}:{node.lineno} {node.name}")
    return found


def scanned_files(root: Path = ROOT) -> list[Path]:
    """Every .py of the repository outside tests/ and hidden folders (.venv, .git)."""
    return [p for p in sorted(root.rglob("*.py"))
            if not any(part == "tests" or part.startswith(".") for part in p.relative_to(root).parts[:-1])]


def repository_whole_config_functions() -> list[str]:
    return [f for path in scanned_files()
            for f in whole_config_functions(path.read_text(), str(path.relative_to(ROOT)))]


def test_at_most_the_limit_take_the_whole_config():
    found = repository_whole_config_functions()
    assert len(found) <= LIMIT, f"{len(found)} functions take the whole config (limit {LIMIT}):\n" + "\n".join(found)


def test_the_scan_covers_the_package_and_the_tools():
    """The files counted include the package and the top-level tools, and none of tests/."""
    folders = {p.relative_to(ROOT).parts[0] for p in scanned_files()}
    assert "megatron_kappa" in folders and "launch" in folders, folders
    assert "tests" not in folders and ".venv" not in folders, folders


def test_the_count_sees_a_leaf_that_takes_the_whole_config():
    """Negative control: a probe module's leaves that take the whole config are counted (annotated,
    quoted, dotted, or a bare cfg, config or conf), those that take a section or megatron's
    TransformerConfig are not, whatever their parameter's name."""
    probe = '''
from megatron_kappa.config import Config, ModelConfig, TrainConfig
from megatron_kappa.config import schema

def annotated(step: int, cfg: Config) -> float:
    return cfg.train.lr

def bare(model, cfg):
    return cfg.model.hidden_size

def bare_config(config):
    return config.model.hidden_size

def bare_conf(*, conf):
    return conf.train.steps

async def quoted(run: "Config"):
    return run.train.steps

def dotted(whole: schema.Config):
    return whole.model

class Holder:
    def __init__(self, whole: Config):
        self.whole = whole

def section(step: int, train: TrainConfig) -> float:
    return train.lr

def named_cfg_but_a_section(cfg: ModelConfig) -> int:
    return cfg.hidden_size

def megatrons(config: TransformerConfig) -> int:
    return config.num_layers

def launch(params: dict) -> int:
    return params["block_n"]
'''
    names = [f.split()[-1] for f in whole_config_functions(probe, "probe")]
    assert sorted(names) == ["__init__", "annotated", "bare", "bare_conf", "bare_config", "dotted", "quoted"]
    # and a repository with one such leaf more than the limit fails the count
    assert len(whole_config_functions("\n".join(f"def leaf{i}(config): pass" for i in range(LIMIT + 1)))) > LIMIT
