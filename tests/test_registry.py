"""One registry mechanism (megatron_kappa.registry): every kind's registry is a Registry, register()
is defined in that one module, and the export reads what it must know of a κ input variant from
the variant's entry (the exported modeling file's kappa_logit is generated from the entries)."""
import ast
import dataclasses
import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_kappa import attention_kinds, routers
from megatron_kappa.config import ConfigError
from megatron_kappa.kappa import inputs as kappa_inputs
from megatron_kappa.registry import Registry

ROOT = Path(__file__).resolve().parents[1]


def register_definitions(files, root: Path = ROOT) -> list[str]:
    """The files (relative to `root`) that define a function or method named register."""
    found = []
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        if any(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == "register" for n in ast.walk(tree)):
            found.append(str(path.relative_to(root)))
    return found


def test_register_is_defined_in_one_module(tmp_path):
    files = [p for p in ROOT.rglob("*.py") if not {"tests", ".venv", "runs"} & set(p.relative_to(ROOT).parts)]
    assert register_definitions(files) == ["megatron_kappa/registry.py"]
    # negative control: a second definition, as a method, is found
    (tmp_path / "copy.py").write_text("class Targets:\n    def register(self, adapter):\n        pass\n")
    assert register_definitions([tmp_path / "copy.py"], tmp_path) == ["copy.py"]


def test_every_kind_uses_the_one_registry():
    from megatron_kappa.export import targets
    for registry in (attention_kinds.KINDS, routers.ROUTERS, kappa_inputs.VARIANTS, targets.TARGETS):
        assert type(registry) is Registry, registry
    assert routers.register == routers.ROUTERS.register and kappa_inputs.register == kappa_inputs.VARIANTS.register


def test_the_registry_checks_what_it_is_given():
    @dataclasses.dataclass(frozen=True)
    class Thing:
        run: object

    things = Registry("test.thing", Thing, noun="thing", needs=("run",), default="a", pieces_in="things")
    things.register("a", Thing(print))
    things.register("a", Thing(print))  # the same again: nothing happens
    with pytest.raises(ValueError, match=r"^test.thing: a is already registered$"):
        things.register("a", Thing(len))
    with pytest.raises(ValueError, match="test.thing: a thing's name must be an identifier, got 'b c'"):
        things.register("b c", Thing(print))
    with pytest.raises(TypeError, match=r"test.thing: b: expected a Thing with a callable run, got .*Thing\(run=3\)"):
        things.register("b", Thing(3))
    with pytest.raises(ValueError, match="test.thing: a is the default"):
        things.unregister("a")
    with pytest.raises(ValueError, match=r"test.thing: expected one of \['a'\], got 'z'"):
        things.lookup("z")
    things.register("b", Thing(things.piece("b", "run")))
    with pytest.raises(RuntimeError, match="test.thing: b: its run comes from things/b.py, which is not imported"):
        things["b"].run()
    things.implement("b", run=lambda: "handed")
    assert things["b"].run() == "handed" and dataclasses.replace(things["b"]).run() == "handed"
    with pytest.raises(ValueError, match="test.thing: a: run is not a piece its entry leaves to its module"):
        things.implement("a", run=print)
    assert list(things) == ["a", "b"] and things.names(lambda t: t.run is print) == ["a"]


def _modeling_module(source: str, tmp_path: Path):
    path = tmp_path / "modeling_generated.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location("modeling_generated", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def halved():
    """A κ input variant registered at run time with its export code: κ sees s / 2."""
    kappa_inputs.register("halved", kappa_inputs.Variant(
        lambda logits, w: logits / 2, U=2.5, logit_scale=1.0, tanh_gain=1.0, router_grad_scale=1.0, u_warmup=0.0,
        hf_input="halved", hf_code="return logits / 2\n", hf_doc="s / 2", card="s is half the router logit"))
    yield "halved"
    kappa_inputs.VARIANTS.unregister("halved")


def test_the_exported_modeling_file_is_written_from_the_variants(tmp_path, halved):
    """The package's modeling_kappa_moe.py is what the built-in variants generate (so an export of
    theirs is that file, byte for byte); a variant registered with its code adds its branch, which
    computes the variant's own transform; the other inputs keep theirs (normalized against the
    package's normalized_logit, an independent implementation)."""
    from megatron_kappa.export.card import kappa_section
    from megatron_kappa.export.targets.kappa_moe import kappa_input_kind, modeling_source
    shipped = (ROOT / "megatron_kappa/export/modeling_kappa_moe.py").read_text(encoding="utf-8")
    generated = modeling_source()
    assert generated != shipped and "return logits / 2" in generated  # negative control: the toy's branch
    module = _modeling_module(generated, tmp_path)
    torch.manual_seed(0)
    logits, weight = torch.randn(5, 4, dtype=torch.float64), torch.randn(4, 16)
    assert torch.equal(module.kappa_logit(logits, weight, "halved"), logits / 2)
    assert torch.equal(module.kappa_logit(logits, weight, "logit"), logits)
    torch.testing.assert_close(module.kappa_logit(logits, weight, "normalized"),
                               kappa_inputs.normalized_logit(logits, weight), rtol=1e-6, atol=0)
    # the export and the card read the entry
    assert kappa_input_kind(halved) == "halved" and kappa_input_kind("scaled") == "logit"
    kappa = SimpleNamespace(input=halved, U=2.5, logit_scale=1.0, tanh_gain=1.0, use_alpha=True, use_bias=True)
    assert "where s is half the router logit." in kappa_section(kappa)
    kappa_inputs.VARIANTS.unregister(halved)
    assert modeling_source() == shipped


def test_a_variant_without_export_code_is_refused_by_the_export():
    from megatron_kappa.export.targets.kappa_moe import kappa_input_kind
    kappa_inputs.register("bare", kappa_inputs.Variant(lambda logits, w: logits, U=3.0, logit_scale=1.0,
                                                       tanh_gain=1.0, router_grad_scale=1.0, u_warmup=0.0))
    try:
        with pytest.raises(ConfigError, match=r"^model.kappa.input: bare: no exported model computes this variant"):
            kappa_input_kind("bare")
    finally:
        kappa_inputs.VARIANTS.unregister("bare")
    assert "bare" not in kappa_inputs.VARIANTS
