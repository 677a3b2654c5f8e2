"""The published runs as data (configs/frontier/published/*.yaml, read by plan.published.load):
every file loads into its group, and a wrong file stops the planner with one line naming the file
and the field: an unknown key (at the top, in `layout`, `planned` or `rates`), a missing one, a
value of the wrong kind, a planned setting the planner does not know."""
import dataclasses
from pathlib import Path

import pytest
import yaml

from megatron_kappa.config import ConfigError
from megatron_kappa.plan import published
from megatron_kappa.plan.published import FOLDER, load

DEEPSEEK = FOLDER / "01_deepseek_v3.yaml"


def test_every_file_loads_into_its_group():
    files = sorted(FOLDER.glob("*.yaml"))
    assert len(files) == 21
    runs = [load(p) for p in files]
    assert len({r.name for r in runs}) == 21  # one run a file, no name twice
    assert [len(published.RUNS), len(published.TUNED), len(published.MEASURED), len(published.LONG_CONTEXT),
            len(published.LONG_CONTEXT_DROPLESS)] == [4, 4, 9, 4, 4]
    assert published.MEASURED[5:] == published.LONG_CONTEXT
    assert published.RUNS[0].name == "DeepSeek-V3" and published.RUNS[0].rates.nvlink_gbs == 160.0
    assert all(r.planned.fused_swiglu for r in runs)  # the loader's default for a published run
    assert all(r.source for r in runs)


def changed(tmp_path: Path, edit) -> Path:
    raw = yaml.safe_load(DEEPSEEK.read_text())
    edit(raw)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.parametrize("edit, message", [
    (lambda r: r.update(speed=3), r"run.yaml: speed: unknown key \(expected some of name, group"),
    (lambda r: r["layout"].update(dp=8), r"run.yaml: layout.dp: unknown key \(expected some of world, tp"),
    (lambda r: r["planned"].update(fused_swigl=True), r"run.yaml: planned.fused_swigl: unknown key"),
    (lambda r: r.update(rates={"nvlink": 160}), r"run.yaml: rates.nvlink: unknown key"),
    (lambda r: r.pop("source"), r"run.yaml: source: missing$"),
    (lambda r: r.update(measured_s="19.7 s"), r"run.yaml: measured_s: expected a positive number, got '19.7 s'"),
    (lambda r: r.update(set="precision=fp8"), r"run.yaml: set: expected a list of strings"),
    (lambda r: r["layout"].update(world="2k"), r"run.yaml: layout: expected positive whole numbers"),
    (lambda r: r.update(group="reports"), r"run.yaml: group: expected one of report, tuned"),
    (lambda r: r.update(config="configs/frontier/deepseek.yaml"), r"run.yaml: config: no file configs/frontier"),
    (lambda r: r["planned"].update(fp8_activations="all"), r"run.yaml: fp8_activations: expected one of none"),
    (lambda r: r.update(imbalance=0.5), r"run.yaml: imbalance: expected at least 1"),
])
def test_a_wrong_file_is_one_line_naming_the_file_and_the_field(tmp_path, edit, message):
    with pytest.raises(ConfigError, match=message) as e:
        load(changed(tmp_path, edit))
    assert "\n" not in str(e.value)


def test_the_unchanged_file_loads_as_the_run(tmp_path):
    """Negative control: the copy written back unchanged loads, equal to the run it holds."""
    again = load(changed(tmp_path, lambda r: None))
    assert dataclasses.replace(again) == published.RUNS[0]
