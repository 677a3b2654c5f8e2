"""checkpoint.hf_every: the Hugging Face export written while the run goes on is the export of
`python -m megatron_kappa.export --step N` run afterwards; a failed one is a warning line."""
import pytest
import torch

from megatron_kappa.config import load_config
from tests.support.export_runs import export, hf_logits, tokens

TRAIN = ["data.mock=true", "model.seq_length=32", "train.micro_batch=2", "train.global_batch=2",
         "log.tensorboard=false", "eval.valid_every=0", "log.interval=1", "checkpoint.interval=1",
         "checkpoint.keep=10", "train.steps=2", "checkpoint.hf_every=1", "checkpoint.hf_keep=1"]


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [True, False])
def test_background_exports_equal_the_export_run_afterwards(world1, tmp_path, monkeypatch, async_save):
    """Exports of steps 1 and 2 in the background, step 1's failing (its output exists: a file):
    one warning line, the run finishes; hf/step_2 loads in transformers with the logits of
    `export --step 2` run afterwards (negative control: `export --step 1`'s differ), hf_keep=1."""
    from megatron_kappa.train import loop
    for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}.items():
        monkeypatch.setenv(key, value)
    run = tmp_path / "run"
    (run / "hf").mkdir(parents=True)
    (run / "hf/step_1").write_text("in the way")
    lines = []
    loop.run(load_config("configs/tiny.yaml", [*TRAIN, f"run.dir={run}", f"checkpoint.async_save={async_save}"]),
             log=lines.append)
    warned = [line for line in lines if line.startswith("warning: the Hugging Face export of step 1 failed")]
    assert len(warned) == 1 and "exit 2" in warned[0] and "training goes on" in warned[0], lines
    assert sorted(p.name for p in (run / "hf").iterdir()) == ["step_1", "step_1.log", "step_2"]
    export(run, tmp_path / "after_2", "--step", "2")
    export(run, tmp_path / "after_1", "--step", "1")
    ids = tokens(2048)
    background, _ = hf_logits(run / "hf/step_2", ids)
    assert torch.equal(background, hf_logits(tmp_path / "after_2", ids)[0])
    assert not torch.allclose(background, hf_logits(tmp_path / "after_1", ids)[0])


def test_an_export_interval_that_is_not_a_multiple_of_the_checkpoints_is_one_line():
    """checkpoint.hf_every exports checkpoints: 3 with checkpoint.interval 25 would export every 75
    steps without a word; refused in one line. Control: a multiple (50) loads."""
    from megatron_kappa.config import ConfigError
    with pytest.raises(ConfigError, match=r"^config: checkpoint\.hf_every: 3 is not a multiple of checkpoint\.interval "
                                          r"\(25\): only checkpoints are exported, so the exports would come every 75"):
        load_config("configs/tiny.yaml", ["checkpoint.hf_every=3"])
    assert load_config("configs/tiny.yaml", ["checkpoint.hf_every=50"]).checkpoint.hf_every == 50
