"""One installed package, and no side effects on import (issue 59): the wheel holds megatron_kappa
alone, from outside the checkout only it imports, the console scripts' targets exist, the
environment holds no start-up hook, `import megatron_kappa` leaves warnings.filters and
sys.excepthook as they were, and a command line's own start (megatron_kappa/entry.py) filters the
known library lines before its imports print them. Each with a negative control."""
import os
import re
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
TOP_FOLDERS = ("plan", "eval", "bench", "analysis", "launch", "data_prep")


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("KAPPA_SHOW_WARNINGS", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def startup_hooks(site_packages: Path) -> list[str]:
    """The .pth files in `site_packages` that import this package at every start of Python (an
    editable install's own finder, `import __editable___megatron_kappa_..._finder`, is not it)."""
    return sorted(p.name for p in site_packages.glob("*.pth")
                  if any(line.startswith("import") and re.search(r"(?<!\w)megatron_kappa(?!\w)", line)
                         for line in p.read_text().splitlines()))


def test_the_environment_holds_no_start_up_hook(tmp_path):
    """`make venv` wrote megatron_kappa_quiet.pth until issue 59 and removes a stale one now."""
    assert startup_hooks(Path(sysconfig.get_paths()["purelib"])) == [], "a stale start-up hook: run `make venv`"
    (tmp_path / "megatron_kappa_quiet.pth").write_text("import megatron_kappa  # the library notices\n")
    (tmp_path / "other.pth").write_text("/some/path\n")
    (tmp_path / "__editable__.megatron_kappa-0.1.0.pth").write_text(
        "import __editable___megatron_kappa_0_1_0_finder; __editable___megatron_kappa_0_1_0_finder.install()")
    assert startup_hooks(tmp_path) == ["megatron_kappa_quiet.pth"]  # negative control


def test_the_package_list_is_megatron_kappa_alone():
    from setuptools import find_namespace_packages, find_packages
    found = find_packages(str(ROOT), **PYPROJECT["tool"]["setuptools"]["packages"]["find"])
    assert {name.split(".")[0] for name in found} == {"megatron_kappa"}
    assert {"megatron_kappa.plan", "megatron_kappa.cli", "megatron_kappa.data_prep"} <= set(found)
    # negative control: the include list of before issue 59 takes the folders beside it too (plan/,
    # analysis/ and bench/ are packages for `python -m plan` & co., the others folders of scripts)
    old = find_namespace_packages(str(ROOT), include=["megatron_kappa*", *(f"{d}*" for d in TOP_FOLDERS)])
    assert {"plan", "eval", "launch", "bench"} <= {name.split(".")[0] for name in old}


def console_script_problems(scripts: dict[str, str]) -> list[str]:
    """Each console script whose target (module:function) does not resolve to a function."""
    import importlib
    problems = []
    for name, target in sorted(scripts.items()):
        module, _, attr = target.partition(":")
        try:
            ok = callable(getattr(importlib.import_module(module), attr, None))
        except ImportError as e:
            ok, attr = False, f"{attr} ({e})"
        if not ok:
            problems.append(f"{name}: {module}:{attr}")
    return problems


def test_the_console_scripts_resolve():
    scripts = PYPROJECT["project"]["scripts"]
    assert {"kappa-plan", "kappa-prep", "kappa-eval-core", "kappa-deepspeed"} <= set(scripts)
    assert all(name.startswith("kappa-") for name in scripts)
    assert console_script_problems(scripts) == []
    # what each command runs exists too (a module with main())
    import importlib.util

    from megatron_kappa.cli import commands
    modules = [c.co_consts for c in (f.__code__ for f in vars(commands).values() if callable(f)
                                     and getattr(f, "__module__", "") == commands.__name__)]
    named = [m for consts in modules for m in consts if isinstance(m, str) and m.startswith("megatron_kappa.")]
    assert len(named) >= 10 and all(importlib.util.find_spec(m) for m in named), named
    assert console_script_problems({"kappa-x": "megatron_kappa.cli.commands:nothing",
                                    "kappa-y": "megatron_kappa.no_such:main"}) == [
        "kappa-x: megatron_kappa.cli.commands:nothing",
        "kappa-y: megatron_kappa.no_such:main (No module named 'megatron_kappa.no_such')"]  # negative control


@pytest.mark.slow
def test_the_wheel_holds_one_package_and_only_it_imports(tmp_path):
    """The wheel built from pyproject.toml: its top-level names, and from a folder outside the
    checkout (no site-packages: -S, so no editable install either) megatron_kappa imports and the
    folders beside it do not."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "megatron_kappa", *TOP_FOLDERS):  # a copy: a build writes build/
        (src / name).symlink_to(ROOT / name) if name.endswith((".toml", ".md")) else \
            subprocess.run(["cp", "-r", str(ROOT / name), str(src / name)], check=True)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "wheel"), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    wheel, = (tmp_path / "wheel").glob("*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        z.extractall(tmp_path / "site")
        scripts = z.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert {n.split("/")[0] for n in names if ".dist-info/" not in n} == {"megatron_kappa"}
    assert "kappa-plan = megatron_kappa.cli.commands:plan" in scripts
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(tmp_path / "site")}
    probe = ("import importlib, sys\n"
             "for name in sys.argv[1:]:\n"
             "    try:\n        importlib.import_module(name); print(name, 'imports')\n"
             "    except ImportError:\n        print(name, 'missing')\n")
    done = subprocess.run([sys.executable, "-S", "-c", probe, "megatron_kappa", "megatron_kappa.entry", *TOP_FOLDERS],
                          cwd=outside, env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout.split("\n")[:-1] == ["megatron_kappa imports", "megatron_kappa.entry imports",
                                           *(f"{d} missing" for d in TOP_FOLDERS)], done.stdout + done.stderr
    # negative control: from the checkout the folders beside the package are there (as its scripts' folders)
    inside = subprocess.run([sys.executable, "-S", "-c", probe, "plan"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=60)
    assert inside.stdout == "plan imports\n", inside.stdout + inside.stderr


# Run as a file named torchrun, so that the package's former import-time hook would have set the
# launcher's excepthook: what `import megatron_kappa` changes, then what start() changes.
PROBE = """import logging, sys, warnings
for name in [m for m in sys.modules if m == "megatron_kappa" or m.startswith("megatron_kappa.")]:
    del sys.modules[name]  # an environment's stale start-up hook may have imported it already
LOGGERS = ("DeepSpeed", "torch.distributed.run", "torch.distributed.elastic.multiprocessing.api")
def state():
    return (list(warnings.filters), sys.excepthook, [list(logging.getLogger(n).filters) for n in LOGGERS])
before = state()
import megatron_kappa, megatron_kappa.quiet, megatron_kappa.launcher_exit, megatron_kappa.entry
import megatron_kappa.cli.commands, megatron_kappa.cli.launcher
after = state()
megatron_kappa.entry.start()
started = state()
print("import:", "unchanged" if after == before else "changed")
print("filters:", "unchanged" if started[0] == before[0] else "changed")
print("excepthook:", "unchanged" if started[1] is before[1] else "changed")
print("loggers:", "unchanged" if started[2] == before[2] else "changed")
"""


def test_importing_the_package_changes_nothing_and_start_does(tmp_path):
    script = tmp_path / "torchrun"
    script.write_text(PROBE)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=clean_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    # the import changes nothing; start() (negative control) sets the filters, torchrun's hook and
    # its loggers' filters
    assert done.stdout.splitlines() == ["import: unchanged", "filters: changed", "excepthook: changed",
                                        "loggers: changed"], done.stdout
    shown = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=clean_env(KAPPA_SHOW_WARNINGS="1"),
                           capture_output=True, text=True, timeout=120)
    assert shown.stdout.splitlines() == ["import: unchanged", "filters: unchanged", "excepthook: unchanged",
                                         "loggers: unchanged"], shown.stdout


def test_a_console_scripts_start_comes_before_the_library_lines(tmp_path):
    """kappa-export's main (the export imports megatron-core and torch's extension loader): --help
    prints no library line; KAPPA_SHOW_WARNINGS=1 shows them (negative control)."""
    code = "from megatron_kappa.cli.commands import export; export()"
    quiet = subprocess.run([sys.executable, "-c", code, "--help"], cwd=tmp_path, env=clean_env(), capture_output=True,
                           text=True, timeout=300)
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr[-2000:]
    assert quiet.stdout.startswith("usage: python -m megatron_kappa.export")
    loud = subprocess.run([sys.executable, "-c", code, "--help"], cwd=tmp_path, env=clean_env(KAPPA_SHOW_WARNINGS="1"),
                          capture_output=True, text=True, timeout=300)
    assert "Transformer Engine and Apex are not installed" in loud.stderr, loud.stderr[-2000:]


def test_the_deepspeed_runner_logs_at_warning_unless_told():
    from megatron_kappa.cli.launcher import runner_arguments
    assert runner_arguments(["--num_gpus", "2", "launch/pretrain.py", "--log_level", "x"]) == [
        "--log_level", "warning", "--num_gpus", "2", "launch/pretrain.py", "--log_level", "x"]
    for said in (["--log_level", "info"], ["--log_level=debug"], ["-q"]):
        assert runner_arguments([*said, "launch/pretrain.py"]) == [*said, "launch/pretrain.py"]
