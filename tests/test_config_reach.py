"""How many functions of megatron_kappa take the whole config (issue 51, deliverable 6).

Leaf functions take the section they read (`train: TrainConfig`, `model: ModelConfig`,
`moe: MoEConfig`...); the whole config stays with the functions that read several sections or
hand them on: the training loop's top, the preflight, the cross-field checks, build_model's entry
point, the CLIs. A function counts when one of its parameters is annotated `Config` or is named
`cfg` without another annotation. The limit keeps new leaf functions from taking the whole config
again: one that does pushes the count up, and the message lists every function counted.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_kappa"
LIMIT = 70  # the aim: fewer than 70 (124 of 743 before the sections were handed down)


def whole_config_functions(source: str, where: str = "") -> list[str]:
    """`where:line name` of each function in `source` with a parameter that is the whole config."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in (*a.posonlyargs, *a.args, *a.kwonlyargs):
                annotation = ast.unparse(arg.annotation) if arg.annotation else ""
                if annotation in ("Config", "'Config'") or (arg.arg == "cfg" and annotation in ("", "Config")):
                    found.append(f"{where}:{node.lineno} {node.name}")
                    break
    return found


def package_whole_config_functions() -> list[str]:
    return [f for path in sorted(PACKAGE.rglob("*.py"))
            for f in whole_config_functions(path.read_text(), str(path.relative_to(PACKAGE.parent)))]


def test_fewer_than_the_limit_take_the_whole_config():
    found = package_whole_config_functions()
    assert len(found) < LIMIT, f"{len(found)} functions take the whole config (limit {LIMIT}):\n" + "\n".join(found)


def test_the_count_sees_a_leaf_that_takes_the_whole_config():
    """Negative control: a probe module's leaves that take the whole config are counted (annotated
    or a bare cfg), those that take a section are not, whatever their parameter's name."""
    probe = '''
from megatron_kappa.config import Config, ModelConfig, TrainConfig

def annotated(step: int, cfg: Config) -> float:
    return cfg.train.lr

def bare(model, cfg):
    return cfg.model.hidden_size

async def quoted(run: "Config"):
    return run.train.steps

class Holder:
    def __init__(self, whole: Config):
        self.whole = whole

def section(step: int, train: TrainConfig) -> float:
    return train.lr

def named_cfg_but_a_section(cfg: ModelConfig) -> int:
    return cfg.hidden_size

def launch(params: dict) -> int:
    return params["block_n"]
'''
    names = [f.split()[-1] for f in whole_config_functions(probe, "probe")]
    assert sorted(names) == ["__init__", "annotated", "bare", "quoted"]
    # and a package with that many such leaves reaches the limit
    assert len(whole_config_functions("\n".join(f"def leaf{i}(cfg): pass" for i in range(LIMIT)))) == LIMIT
