"""The data flows one way: config → model/parallel setup → data → checkpoints → evaluation → the
training loop; the tools (the planner, data preparation, the analyses, the benchmarks' shared code)
and the command lines come after every stage of training. No module imports a module of a later
stage (lazy imports inside functions count too), no modules import each other in a circle, and
the scripts beside the package (launch/, eval/, ...) import only the package, without editing
sys.path, and never the tests. A string that
names a module ("megatron_kappa.x.y:attr", for importlib or a late reference such as routers'
`_late`) is an import like a statement: an arrow a reader and an IDE miss is still an arrow.
Read from the source (ast), so no module is executed here."""
import ast
import re
from collections import deque
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_kappa"

# Stages in order; a module belongs to the first prefix that matches its dotted name. The training
# loop comes after evaluation because it runs the CORE subset and validation while it trains;
# the preflight comes last because it checks the inputs of every stage before any of them runs.
STAGES = [
    # what every entry point does first (library notices, the launchers' endings); argparse types; folder
    # checks; the registry mechanism of every kind (κ inputs, routers, attention kinds, export targets)
    ("megatron_kappa.entry", "megatron_kappa.quiet", "megatron_kappa.launcher_exit", "megatron_kappa.cli_types",
     "megatron_kappa.paths", "megatron_kappa.registry"),
    ("megatron_kappa.kappa",),
    # the router and attention kinds: torch-free, read by the config
    ("megatron_kappa.config", "megatron_kappa.routers", "megatron_kappa.attention_kinds"),
    ("megatron_kappa.model",),
    ("megatron_kappa.parallel",),
    ("megatron_kappa.summary",),
    ("megatron_kappa.data", "megatron_kappa.tokenizer"),
    ("megatron_kappa.checkpoint",),
    ("megatron_kappa.evaluation",),
    # a trained run out of the stack (Hugging Face): reads checkpoints; and a Hugging Face model into
    # it (import_hf: the export's name maps read back)
    ("megatron_kappa.export", "megatron_kappa.import_hf"),
    ("megatron_kappa.optim",),
    ("megatron_kappa.metrics",),
    ("megatron_kappa.train",),
    ("megatron_kappa.preflight",),
    # the tools: nothing of training imports them (the planner reads the trainer's config and checks,
    # never the reverse: docs/plan.md)
    ("megatron_kappa.plan", "megatron_kappa.data_prep", "megatron_kappa.analysis"),
    ("megatron_kappa.bench",),
    ("megatron_kappa.cli",),  # the command lines
]
SCRIPT_DIRS = ["launch", "eval", "plan", "analysis", "bench", "data_prep"]


def stage_of(module: str) -> int:
    if module == "megatron_kappa":  # the package itself: it imports nothing
        return 0
    if not module.startswith("megatron_kappa."):  # the tools beside the package use it, never the reverse
        return len(STAGES)
    for i, prefixes in enumerate(STAGES):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module}: no stage for it in tests/test_imports.py STAGES")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


# the package and the scripts beside it (launch/, eval/, plan/, ...: named by their paths)
FIRST_PARTY = {module_name(p): p for p in [*sorted(PACKAGE.rglob("*.py")),
                                           *(p for d in SCRIPT_DIRS for p in sorted((ROOT / d).rglob("*.py")))]}
PACKAGE_MODULES = {name: path for name, path in FIRST_PARTY.items() if path.is_relative_to(PACKAGE)}
# a whole string naming a module of the package, with or without an attribute after a colon
NAMED_MODULE = re.compile(r"megatron_kappa(?:\.\w+)+(?::\w+)?")


def imports_of(source: str, known=FIRST_PARTY) -> set[tuple[str, str]]:
    """Every first-party module `source` imports, as (module, how): "imports" for a statement at
    the top or inside a function, "names" for a string naming a module of the package. `known`:
    the modules a name may resolve to (`from x import y` is x.y where that is a module, else x)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update((a.name, "imports") for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update((f"{node.module}.{a.name}", "imports") for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and NAMED_MODULE.fullmatch(node.value):
            found.add((node.value.partition(":")[0], "names"))
    return {(resolved, how) for name, how in found if (resolved := resolve(name, known))}


def resolve(name: str, known) -> str | None:
    """The module a dotted name refers to: the longest prefix of it in `known`
    (megatron_kappa.x.y.attr → megatron_kappa.x.y); None for another party's."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in known:
            return ".".join(parts)
        parts.pop()
    return None


def upward_imports(modules: dict[str, str], how=("imports", "names")) -> list[str]:
    """`modules`: dotted name → source. Each import of a later stage, as a readable line; `how`:
    import statements, strings naming a module, or both."""
    known = set(FIRST_PARTY) | set(modules)
    return [f"{here} (stage {stage_of(here)}) {kind} {target} (stage {stage_of(target)})"
            + (" in a string" if kind == "names" else "")
            for here, source in sorted(modules.items()) for target, kind in sorted(imports_of(source, known))
            if kind in how and stage_of(target) > stage_of(here)]


def package_sources() -> dict[str, str]:
    # a package's __main__.py (its command line) is held to its package's stage like any module
    modules = {name: path.read_text() for name, path in PACKAGE_MODULES.items()}
    assert {"megatron_kappa.summary.__main__", "megatron_kappa.optim.__main__"} <= set(modules)
    assert len(modules) > 40
    return modules


def first_party_sources() -> dict[str, str]:
    modules = {name: path.read_text() for name, path in FIRST_PARTY.items()}
    assert {"launch.pretrain", "megatron_kappa.parallel.groups", "megatron_kappa.plan.search"} <= set(modules)
    return modules


def test_no_module_imports_a_later_stage():
    assert upward_imports(package_sources(), how=("imports",)) == []


def test_no_string_named_upward_import():
    assert upward_imports(package_sources(), how=("names",)) == []


def test_the_check_finds_an_upward_import():
    """Negative control: a model module importing the training loop, lazily, is reported."""
    probe = "def f():\n    from megatron_kappa.train.loop import run\n"
    assert upward_imports({"megatron_kappa.model.probe": probe}) == [
        "megatron_kappa.model.probe (stage 3) imports megatron_kappa.train.loop (stage 12)"]
    assert upward_imports({"megatron_kappa.train.probe": probe}) == []
    # a command line too: summary's used to list the optimizer groups through the training package
    cli = "def main():\n    from megatron_kappa.train.recipe import KappaFreeze\n"
    assert upward_imports({"megatron_kappa.summary.__main__": cli}) == [
        "megatron_kappa.summary.__main__ (stage 5) imports megatron_kappa.train.recipe (stage 12)"]
    # the launch scripts beside the package come after every stage
    script = "from launch import pretrain\n"
    assert upward_imports({"megatron_kappa.train.probe": script}) == [
        f"megatron_kappa.train.probe (stage {stage_of('megatron_kappa.train')}) imports launch.pretrain "
        f"(stage {len(STAGES)})"]


def test_the_check_finds_a_string_named_upward_import():
    """Negative control: a config module naming the training loop in a string, for importlib or
    as a late reference, is reported like an import; prose that mentions a module is not."""
    late = 'step = _late("megatron_kappa.train.loop:run")\n'
    by_importlib = 'def f():\n    return importlib.import_module("megatron_kappa.train.loop").run\n'
    reported = [f"megatron_kappa.config.probe (stage 2) names megatron_kappa.train.loop "
                f"(stage {stage_of('megatron_kappa.train')}) in a string"]
    for source in (late, by_importlib):
        assert upward_imports({"megatron_kappa.config.probe": source}) == reported
        assert upward_imports({"megatron_kappa.config.probe": source}, how=("imports",)) == []
    # an attribute after a dot names its module; the training loop may name itself
    assert upward_imports({"megatron_kappa.config.probe": 'X = "megatron_kappa.train.loop.run"\n'}) == reported
    assert upward_imports({"megatron_kappa.train.probe": late}) == []
    prose = '"""Called by megatron_kappa.train.loop."""\nX = "see megatron_kappa.train.loop:run"\n'
    assert upward_imports({"megatron_kappa.config.probe": prose}) == []


def tangles(modules: dict[str, str]) -> list[list[str]]:
    """The modules of `modules` that import each other in a circle, directly or through others:
    each strongly connected part of the import graph (statements and strings) with two or more
    modules, sorted. Tarjan's algorithm, iterative."""
    known = set(FIRST_PARTY) | set(modules)
    graph = {m: sorted({t for t, _ in imports_of(s, known) if t in modules and t != m})
             for m, s in modules.items()}
    order, low, stack, on_stack, found = {}, {}, [], set(), []
    for root in sorted(graph):
        if root in order:
            continue
        work = [(root, iter(graph[root]))]
        order[root] = low[root] = len(order)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, targets = work[-1]
            target = next(targets, None)
            if target is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == order[node]:
                    part = []
                    while not part or part[-1] != node:
                        part.append(stack.pop())
                        on_stack.discard(part[-1])
                    if len(part) > 1:
                        found.append(sorted(part))
            elif target not in order:
                order[target] = low[target] = len(order)
                stack.append(target)
                on_stack.add(target)
                work.append((target, iter(graph[target])))
            elif target in on_stack:
                low[node] = min(low[node], order[target])
    return sorted(found)


def circle_line(modules: dict[str, str], part: list[str]) -> str:
    """One circle of a tangle as a readable line: the shortest one through its first module,
    "->" an import statement, "~>" a string naming the module; then the tangle's other modules."""
    known = set(FIRST_PARTY) | set(modules)
    arrows = {m: {} for m in part}
    for m in part:
        for target, how in sorted(imports_of(modules[m], known), key=lambda x: x[1]):
            if target in arrows and target != m:
                arrows[m].setdefault(target, "->" if how == "imports" else "~>")
    start = part[0]
    came = {}
    queue = deque([start])
    while queue:  # breadth first, so the circle is a shortest one
        node = queue.popleft()
        for target in sorted(arrows[node]):
            if target not in came:
                came[target] = node
                queue.append(target)
        if start in came:
            break
    path = [start]
    while path[-1] != start or len(path) == 1:
        path.append(came[path[-1]])
    path.reverse()  # start, ..., start
    line = path[0] + "".join(f" {arrows[a][b]} {b}" for a, b in zip(path, path[1:]))
    rest = [m for m in part if m not in path]
    return line + (f" (tangled with it: {', '.join(rest)})" if rest else "")


def circles(modules: dict[str, str]) -> list[str]:
    """Each tangle of `modules` as one readable line (see circle_line)."""
    return [circle_line(modules, part) for part in tangles(modules)]


def test_training_never_imports_the_tools():
    """Negative control for the tools' stage: the training loop importing the planner, a model module
    naming data preparation and the preflight importing a command line are reported."""
    probes = {"megatron_kappa.train.probe": "def f():\n    from megatron_kappa.plan import Layout\n",
              "megatron_kappa.model.probe": 'X = "megatron_kappa.data_prep.shards:ShardWriter"\n',
              "megatron_kappa.preflight.probe": "from megatron_kappa.cli import eval_core\n"}
    found = upward_imports(probes)
    assert [line.split(" (stage")[0] for line in found] == sorted(probes), found
    assert "imports megatron_kappa.plan (stage" in found[2] and "names megatron_kappa.data_prep.shards" in found[0]


def test_no_import_circles():
    """The package and the scripts beside it: no circle (the last tangle, routers.py's
    late strings into model/build, is untied: model/routers/ hands the pieces down)."""
    assert circles(first_party_sources()) == []


def test_the_check_finds_a_circle():
    """Negative control: two modules that import each other (one lazily, as parallel.groups did
    parallel.failures) are reported, and so is a circle closed by a string; a chain is not."""
    pair = {"megatron_kappa.parallel.probe_a": "from megatron_kappa.parallel import probe_b\n",
            "megatron_kappa.parallel.probe_b": "def f():\n    from megatron_kappa.parallel import probe_a\n"}
    assert circles(pair) == [
        "megatron_kappa.parallel.probe_a -> megatron_kappa.parallel.probe_b -> megatron_kappa.parallel.probe_a"]
    by_string = {"megatron_kappa.routers_probe": 'f = _late("megatron_kappa.model.probe:f")\n',
                 "megatron_kappa.model.probe": "from megatron_kappa.model.probe_c import x\n",
                 "megatron_kappa.model.probe_c": "from megatron_kappa import routers_probe\n",
                 "megatron_kappa.model.outside": "from megatron_kappa.model import probe\n"}
    assert circles(by_string) == [
        "megatron_kappa.model.probe -> megatron_kappa.model.probe_c -> megatron_kappa.routers_probe ~> "
        "megatron_kappa.model.probe"]
    chain = {**pair, "megatron_kappa.parallel.probe_b": "from megatron_kappa.parallel import probe_c\n"}
    assert circles(chain) == []
    # a tangle of three with a shorter circle inside: the shortest circle, then the one left over
    three = {**pair, "megatron_kappa.parallel.probe_c": "from megatron_kappa.parallel import probe_a\n",
             "megatron_kappa.parallel.probe_a": "from megatron_kappa.parallel import probe_b, probe_c\n"}
    assert circles(three) == [
        "megatron_kappa.parallel.probe_a -> megatron_kappa.parallel.probe_b -> megatron_kappa.parallel.probe_a "
        "(tangled with it: megatron_kappa.parallel.probe_c)"]


def scripts_offences(path: Path, source: str) -> list[str]:
    """A script beside the package (run as `python launch/x.py`, its own folder first on sys.path):
    each import of a first-party module that is not the package (another script's folder, the
    tests), as `path:line imports name`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            relative = isinstance(node, ast.ImportFrom) and node.level > 0
            found += [f"{path}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[0] in (*SCRIPT_DIRS, "tests") or relative]
    return found


def test_the_check_finds_a_script_importing_another():
    """Negative control: a script importing another folder's module (as launch/demo.py imported
    analysis.plots when those folders were installed packages), or a relative import, is reported."""
    assert scripts_offences(Path("launch/demo.py"), "from analysis.plots import make_plots\n") == [
        "launch/demo.py:1 imports analysis.plots"]
    assert scripts_offences(Path("bench/x.py"), "def f():\n    import bench.toy\n") == [
        "bench/x.py:2 imports bench.toy"]
    assert len(scripts_offences(Path("eval/x.py"), "from . import core\n")) == 1
    assert scripts_offences(Path("launch/demo.py"), "from megatron_kappa.analysis.plots import make_plots\n") == []


# The one script allowed both, on purpose: bench/kappa_moe_layer.py times the project's MoE layer
# against the authors' code, which is vendored only under tests/ (loaded by tests/support/
# authors_loop.py), and with --old-root imports the package of another checkout (its child puts
# that checkout first on sys.path). (file, what it does)
EXEMPT = {("bench/kappa_moe_layer.py", "edits sys.path"),
          ("bench/kappa_moe_layer.py", "imports tests.support.authors_loop")}


@pytest.mark.parametrize("folder", SCRIPT_DIRS)
def test_scripts_import_only_the_package_without_sys_path_edits(folder):
    offenders = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("insert", "append") and \
                    isinstance(node.value, ast.Attribute) and node.value.attr == "path" and \
                    isinstance(node.value.value, ast.Name) and node.value.value.id == "sys":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} edits sys.path")
        offenders += scripts_offences(path.relative_to(ROOT), path.read_text())
    assert [o for o in offenders if (o.split(":")[0], o.split(" ", 1)[1]) not in EXEMPT] == []


def third_party_imports(source: str) -> set[str]:
    """The top-level packages `source` imports (at the top or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


# the export's and lm-eval's, never training's (the Hugging Face import's, inside functions: a run reaches
# them only when train.init_weights is a Hugging Face folder)
HF_ONLY = {"transformers", "lm_eval", "accelerate"}


def test_only_the_export_imports_transformers():
    offenders = sorted(module_name(p) for p in PACKAGE.rglob("*.py")
                       if not module_name(p).startswith(("megatron_kappa.export", "megatron_kappa.import_hf"))
                       and third_party_imports(p.read_text()) & HF_ONLY)
    assert offenders == []
    # negative control: the probe is seen
    assert third_party_imports("def f():\n    from transformers import AutoModel\n") & HF_ONLY
