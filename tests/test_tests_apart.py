"""The test files are kept apart: no file under tests/ imports a test file (test_*.py) or a module
at the top of tests/ other than conftest; what several files share lives in tests/support/ (a
package, imported as tests.support.x) or in a fixture. An import of a test file runs that file's
module-level code and binds its fixtures a second time, and a helper imported as a top-level name
beside the same file imported as tests.support.x is two modules with two states. Read from the
source (ast), imports inside functions included; the vendored authors' code is not ours to check."""
import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
VENDORED = "authors_14c9b04"


def top_level_modules(tests: Path) -> set[str]:
    """The importable names at the top of `tests` (its .py files and packages), conftest left out."""
    names = {p.stem for p in tests.glob("*.py")} | {p.name for p in tests.iterdir() if (p / "__init__.py").is_file()}
    return names - {"conftest"}


def imported_names(source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every absolute import in `source`, at the top or inside a function."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
    return found


def crossings(tests: Path) -> list[str]:
    """Each import under `tests` of a test file or of a top-level module of `tests` (conftest aside)."""
    top, found = top_level_modules(tests), []
    for path in sorted(tests.rglob("*.py")):
        rel = path.relative_to(tests)
        if rel.parts[0] == VENDORED:
            continue
        for line, name in imported_names(path.read_text()):
            full = name.startswith(f"{tests.name}.")  # tests.x, with the repository root on sys.path
            parts = name.split(".")[1:] if full else name.split(".")
            test_file = any(p.startswith("test_") for p in parts)
            # tests.support.x is the one way in; support.x would be a second copy of the same module
            helper = parts[0] in top and not (full and parts[0] == "support")
            if test_file or helper:
                found.append(f"tests/{rel}:{line} imports {name}")
    return found


def test_no_file_under_tests_imports_another_test_file_or_a_top_level_helper():
    assert crossings(TESTS) == []


def test_the_top_of_tests_holds_only_test_files_and_conftest():
    """Helpers live in tests/support/, so a new one cannot be imported by its bare name by mistake."""
    helpers = sorted(p.name for p in TESTS.glob("*.py") if not p.name.startswith("test_") and p.name != "conftest.py")
    assert helpers == []
    assert (TESTS / "support/__init__.py").is_file()


def test_negative_control_each_kind_of_crossing_is_found(tmp_path):
    tests = tmp_path / "tests"
    (tests / "support").mkdir(parents=True)
    (tests / "support/__init__.py").write_text("")
    (tests / "support/shared.py").write_text("X = 1\n")
    (tests / "helper.py").write_text("Y = 2\n")  # a helper left at the top
    (tests / "conftest.py").write_text("import pytest\n")
    (tests / VENDORED).mkdir()
    (tests / VENDORED / "theirs.py").write_text("import test_theirs\n")  # not checked
    (tests / "test_a.py").write_text("from tests.support.shared import X\nfrom tests.support import shared\n"
                                     "from conftest import pytest\nimport torch\n")
    assert crossings(tests) == []
    (tests / "test_b.py").write_text(
        "from test_a import X\n"              # a test file by its bare name
        "import tests.test_a\n"               # and by its full name
        "import helper\n"                     # a top-level helper
        "from support.shared import X\n"      # a second copy of tests.support.shared
        "def f():\n    from test_a import X\n")  # inside a function
    (tests / "support/uses.py").write_text("from tests.helper import Y\n")
    assert crossings(tests) == ["tests/support/uses.py:1 imports tests.helper",
                                "tests/test_b.py:1 imports test_a", "tests/test_b.py:2 imports tests.test_a",
                                "tests/test_b.py:3 imports helper", "tests/test_b.py:4 imports support.shared",
                                "tests/test_b.py:6 imports test_a"]
