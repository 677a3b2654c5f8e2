"""pytest's warning filters (pyproject.toml, [tool.pytest.ini_options] filterwarnings): a warning
raised from a megatron_kappa module fails the test, each library warning ignored is named by its
message (and module), and no whole class of warnings is ignored, so a new deprecation shows in the
summary. The project's error is checked with the filters pytest has installed for this very test;
the named ones with pyproject's alone, as pytest reads them (megatron_kappa/quiet.py's filters,
installed where the package is imported, would hide a library message from any module)."""
import tomllib
import warnings
from pathlib import Path

import pytest
from _pytest.config import parse_warning_filter

ROOT = Path(__file__).resolve().parents[1]


def configured() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["filterwarnings"]


def whole_classes(filters: list[str]) -> list[str]:
    """The "ignore" entries that name neither a message nor a module: a whole class ignored."""
    found = []
    for entry in filters:
        action, message, _category, module, *_ = (entry.split(":") + ["", "", "", ""])[:5]
        if action == "ignore" and not message and not module:
            found.append(entry)
    return found


def outcome(message: str, category: type[Warning], module: str, only_configured: bool = True) -> str:
    """What the filters do with `message` raised from `module`: error, ignored or shown. The
    configured ones alone (in pytest's order: the last wins), or those in force in this test."""
    with warnings.catch_warnings(record=True) as seen:
        if only_configured:
            warnings.resetwarnings()
            for entry in configured():
                warnings.filterwarnings(*parse_warning_filter(entry, escape=False))
        try:
            warnings.warn_explicit(message, category, module.replace(".", "/") + ".py", 1, module=module)
        except Warning:
            return "error"
    return "shown" if seen else "ignored"


def test_no_whole_class_of_warnings_is_ignored():
    assert whole_classes(configured()) == []
    assert "error:::megatron_kappa" in configured()


def test_negative_control_the_old_filters_ignored_whole_classes():
    old = ["ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning"]
    assert whole_classes(old) == old
    assert whole_classes(["ignore:Apex is not installed:UserWarning", "ignore:::megatron\\.core"]) == []


@pytest.mark.parametrize("category", [UserWarning, DeprecationWarning, FutureWarning, RuntimeWarning])
def test_a_warning_of_the_project_fails_the_test(category):
    assert outcome("a probe", category, "megatron_kappa.train.loop") == "error"
    assert outcome("a probe", category, "megatron_kappa.train.loop", only_configured=False) == "error"
    with pytest.warns(category, match="a probe"):  # a test that expects one says so
        warnings.warn_explicit("a probe", category, "megatron_kappa/train/loop.py", 1,
                               module="megatron_kappa.train.loop")


def test_the_named_library_warnings_are_ignored():
    assert outcome("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.",
                   UserWarning, "megatron.core.optimizer") == "ignored"
    assert outcome("Warning: tp_group is None, using default tp group. Passing tp_group will be mandatory soon",
                   DeprecationWarning, "megatron.core.tensor_parallel.layers") == "ignored"
    # a compiled file's module is its path: megatron-core's invalid escapes
    assert outcome("invalid escape sequence '\\-'", SyntaxWarning,
                   "/venv/lib/python3.12/site-packages/megatron/core/inference/kv_block_allocator") == "ignored"
    # the one deprecation our own call triggers and keeps on purpose (torch 2.11 has only the old name)
    assert outcome("`torch.distributed.all_gather_into_tensor` is deprecated. Users should use all_gather_single",
                   FutureWarning, "megatron_kappa.parallel.compat") == "ignored"


def test_negative_control_other_library_warnings_show():
    """A message not named, or a named one from another library, is shown, not ignored."""
    assert outcome("something new is deprecated", DeprecationWarning, "megatron.core.transformer") == "shown"
    assert outcome("something new", UserWarning, "deepspeed.runtime.engine") == "shown"
    assert outcome("Apex is not installed. Falling back to Torch Norm", UserWarning, "otherlib.norms") == "shown"
    assert outcome("invalid escape sequence '\\-'", SyntaxWarning, "/repo/megatron_kappa/model/build") == "shown"
    assert outcome("`torch.distributed.reduce_scatter_tensor` is deprecated.", FutureWarning,
                   "megatron.core.distributed") == "shown"
