"""The module maps in the packages' `__init__.py` are generated from the modules themselves, so they
cannot go stale: each line is a module (or subpackage) and the first sentence of its docstring.

    python tests/test_module_maps.py      # rewrites every map after a module is added, moved or redescribed

A map is the block after a line `Modules:` in a package's docstring, up to the next blank line or
the docstring's end. Read from the source (ast), so no module is executed here."""
import ast
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_kappa"
HEADER = "Modules:"
WIDTH = 100


def first_sentence(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text()), clean=True) or ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    match = re.match(r"(.+?\.)(\s|$)", paragraph)  # up to the first full stop
    return (match.group(1) if match else paragraph).rstrip(".")


def members(package: Path) -> list[tuple[str, Path]]:
    """(name as the map shows it, the file whose docstring describes it), sorted by name."""
    found = [(p.name, p) for p in package.glob("*.py") if p.name != "__init__.py"]
    found += [(f"{d.name}/", d / "__init__.py") for d in package.iterdir() if (d / "__init__.py").is_file()]
    return sorted(found)


def render(package: Path) -> str:
    rows = members(package)
    width = max(len(name) for name, _ in rows) + 2
    lines = [HEADER]
    for name, path in rows:
        wrapped = textwrap.wrap(first_sentence(path), WIDTH - 2 - width) or [""]
        lines.append(f"  {name:<{width}}{wrapped[0]}")
        lines += [" " * (2 + width) + more for more in wrapped[1:]]
    return "\n".join(lines)


def packages() -> list[Path]:
    return sorted(p.parent for p in PACKAGE.rglob("__init__.py"))


def current_map(init: Path) -> str | None:
    """The map as written in `init`'s docstring, or None when it has none."""
    doc = ast.get_docstring(ast.parse(init.read_text()), clean=True) or ""
    if HEADER not in doc.splitlines():
        return None
    block = doc.split(f"\n{HEADER}\n", 1)[1] if not doc.startswith(HEADER) else doc[len(HEADER) + 1:]
    return HEADER + "\n" + block.split("\n\n")[0]


def rewrite(init: Path) -> None:
    """Replace the map in `init` (or add one at the end of its docstring)."""
    source = init.read_text()
    doc_node = ast.parse(source).body[0].value
    start, end = _offsets(source, doc_node)
    raw = source[start:end]  # the docstring's text between its quotes
    old = current_map(init)
    if old is not None:
        first, rest = raw.split(HEADER + "\n", 1)
        tail = rest.split("\n\n", 1)
        raw = first + render(init.parent) + ("\n\n" + tail[1] if len(tail) > 1 else "\n")
    else:
        raw = raw.rstrip("\n") + "\n\n" + render(init.parent) + "\n"
    init.write_text(source[:start] + raw + source[end:])


def _offsets(source: str, node) -> tuple[int, int]:
    """The docstring's text between its quotes, as character offsets (ast counts UTF-8 bytes)."""
    data = source.encode()
    lines = data.splitlines(keepends=True)
    begin = sum(map(len, lines[:node.lineno - 1])) + node.col_offset + 3
    finish = sum(map(len, lines[:node.end_lineno - 1])) + node.end_col_offset - 3
    return len(data[:begin].decode()), len(data[:finish].decode())


def test_every_package_has_a_generated_map():
    stale = [str(p.relative_to(ROOT)) for p in packages() if current_map(p / "__init__.py") != render(p)]
    assert stale == [], f"run `python tests/test_module_maps.py` to regenerate the maps of {stale}"


def test_a_moved_module_makes_the_map_stale(tmp_path):
    """Negative control: a module added after the map was written is caught."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "a.py").write_text('"""The first module. More text."""\n')
    (package / "__init__.py").write_text('"""A package of κ."""\n')
    rewrite(package / "__init__.py")
    assert current_map(package / "__init__.py") == render(package) == f"{HEADER}\n  a.py  The first module"
    (package / "b.py").write_text('"""The second: κ with a colon. Then more."""\n')
    assert current_map(package / "__init__.py") != render(package)
    rewrite(package / "__init__.py")
    assert current_map(package / "__init__.py") == render(package)
    assert "b.py  The second: κ with a colon\n" in render(package) + "\n"


if __name__ == "__main__":
    for pkg in packages():
        if current_map(pkg / "__init__.py") != render(pkg):
            rewrite(pkg / "__init__.py")
            print(f"rewrote {pkg.relative_to(ROOT)}/__init__.py", file=sys.stderr)
