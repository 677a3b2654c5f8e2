"""docs/plan.md's tables of the published runs are the planner's output (plan.tables, `python -m
plan --published --markdown`): regenerated here without the searches, every cell but the search
position must equal what the docs say. Controls: a changed number, and a row left out, are found."""
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_kappa.plan import tables

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def generated():
    return tables.tables(ranked=False)


def test_the_docs_tables_are_the_planners_output(generated):
    text = tables.DOCS.read_text()
    assert set(tables.blocks(text)) == {"report", "measured"}
    assert tables.drift(text, generated) == [], "run `python -m plan.tables` to regenerate docs/plan.md's tables"


def test_a_changed_number_or_a_missing_row_is_found(generated):
    text = tables.DOCS.read_text()
    report = tables.blocks(text)["report"]
    assert "| 79.7 GiB |" in report  # DeepSeek-V3's most-loaded rank
    changed = text.replace("| 79.7 GiB |", "| 79.8 GiB |", 1)
    found = tables.drift(changed, generated)
    assert len(found) == 1 and "79.8 GiB" in found[0] and "79.7 GiB" in found[0]
    dropped = text.replace(report.splitlines()[-1] + "\n", "", 1)
    assert "report: 3 rows written, 4 generated" in tables.drift(dropped, generated)


def test_rewrite_puts_the_tables_between_their_markers(generated):
    text = tables.DOCS.read_text()
    assert tables.rewrite(text, tables.blocks(text)) == text
    stale = text.replace("| 79.7 GiB |", "| 79.8 GiB |", 1)
    fresh = tables.rewrite(stale, {name: table for name, table in generated.items()})
    assert tables.drift(fresh, generated) == [] and "| 79.7 GiB |" in fresh
    with pytest.raises(ValueError, match="no '<!-- generated: plan.tables other -->' line"):
        tables.rewrite(text, {"other": "| x |"})


def test_the_command_line_prints_them():
    done = subprocess.run([sys.executable, "-m", "plan", "--published", "--markdown", "--no-progress"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert tables.blocks(done.stdout) == tables.tables(ranked=False)
