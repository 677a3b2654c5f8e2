"""The data flows one way: config → model/parallel setup → data → checkpoints → evaluation → the
training loop. No module imports a module of a later stage (lazy imports inside functions
count too), the command-line scripts import the package without editing sys.path, and the
benchmarks do not import the tests. Read from the source (ast), so no module is executed here."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_kappa"

# Stages in order; a module belongs to the first prefix that matches its dotted name. The training
# loop comes after evaluation because it runs the CORE subset and validation while it trains;
# the preflight comes last because it checks the inputs of every stage before any of them runs.
STAGES = [
    ("megatron_kappa.quiet", "megatron_kappa.cli_types", "megatron_kappa.paths"),  # the first import; argparse types; folder checks
    ("megatron_kappa.kappa",),
    ("megatron_kappa.config", "megatron_kappa.routers"),  # the router kinds: torch-free, read by the config
    ("megatron_kappa.model",),
    ("megatron_kappa.parallel",),
    ("megatron_kappa.summary",),
    ("megatron_kappa.plan",),
    ("megatron_kappa.data", "megatron_kappa.tokenizer"),
    ("megatron_kappa.checkpoint",),
    ("megatron_kappa.evaluation",),
    ("megatron_kappa.export",),  # a trained run out of the stack (Hugging Face): reads checkpoints
    ("megatron_kappa.optim",),
    ("megatron_kappa.metrics",),
    ("megatron_kappa.train",),
    ("megatron_kappa.preflight",),
]
SCRIPT_DIRS = ["launch", "eval", "analysis", "bench", "data_prep"]


def stage_of(module: str) -> int:
    if module == "megatron_kappa":  # the package itself: it imports only megatron_kappa.quiet
        return 0
    for i, prefixes in enumerate(STAGES):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module}: no stage for it in tests/test_imports.py STAGES")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(source: str) -> set[str]:
    """Every megatron_kappa module `source` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            # `from megatron_kappa.x import y` may name a submodule y
            found.update(f"{node.module}.{a.name}" for a in node.names
                         if (ROOT / (node.module.replace(".", "/") + f"/{a.name}.py")).is_file())
    return {m for m in found if m.startswith("megatron_kappa.")}


def upward_imports(modules: dict[str, str]) -> list[str]:
    """`modules`: dotted name → source. Each import of a later stage, as a readable line."""
    return [f"{here} (stage {stage_of(here)}) imports {target} (stage {stage_of(target)})"
            for here, source in sorted(modules.items()) for target in sorted(imports_of(source))
            if stage_of(target) > stage_of(here)]


def test_no_module_imports_a_later_stage():
    # a package's __main__.py (its command line) is held to its package's stage like any module
    modules = {module_name(p): p.read_text() for p in PACKAGE.rglob("*.py")}
    assert {"megatron_kappa.summary.__main__", "megatron_kappa.optim.__main__"} <= set(modules)
    assert len(modules) > 40
    assert upward_imports(modules) == []


def test_the_check_finds_an_upward_import():
    """Negative control: a model module importing the training loop, lazily, is reported."""
    probe = "def f():\n    from megatron_kappa.train.loop import run\n"
    assert upward_imports({"megatron_kappa.model.probe": probe}) == [
        "megatron_kappa.model.probe (stage 3) imports megatron_kappa.train.loop (stage 13)"]
    assert upward_imports({"megatron_kappa.train.probe": probe}) == []
    # a command line too: summary's used to list the optimizer groups through the training package
    cli = "def main():\n    from megatron_kappa.train.recipe import KappaFreeze\n"
    assert upward_imports({"megatron_kappa.summary.__main__": cli}) == [
        "megatron_kappa.summary.__main__ (stage 5) imports megatron_kappa.train.recipe (stage 13)"]


@pytest.mark.parametrize("folder", SCRIPT_DIRS)
def test_scripts_import_the_package_without_sys_path_edits(folder):
    offenders = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("insert", "append") and \
                    isinstance(node.value, ast.Attribute) and node.value.attr == "path" and \
                    isinstance(node.value.value, ast.Name) and node.value.value.id == "sys":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            if folder == "bench" and isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                offenders += [f"{path.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                              if n == "tests" or n.startswith("tests.")]
    assert offenders == []


def third_party_imports(source: str) -> set[str]:
    """The top-level packages `source` imports (at the top or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


HF_ONLY = {"transformers", "lm_eval", "accelerate"}  # the export's and lm-eval's, never training's


def test_only_the_export_imports_transformers():
    offenders = sorted(module_name(p) for p in PACKAGE.rglob("*.py")
                       if not module_name(p).startswith("megatron_kappa.export")
                       and third_party_imports(p.read_text()) & HF_ONLY)
    assert offenders == []
    # negative control: the probe is seen
    assert third_party_imports("def f():\n    from transformers import AutoModel\n") & HF_ONLY
