"""One registry mechanism (megatron_kappa.registry): every kind's registry is a Registry, register()
is defined in that one module, and the export reads what it must know of a κ input variant from
the variant's entry (the exported modeling file's kappa_logit is generated from the entries)."""
import dataclasses

import pytest

from megatron_kappa.registry import Registry


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
