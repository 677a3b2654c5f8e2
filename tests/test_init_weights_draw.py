"""tests/support/weights.py's start weights are the same whatever the process built before: the runs that
are compared across layouts start from them, in whichever order pytest runs the files."""
import torch

from tests.support.weights import save_init_weights


def test_the_start_weights_do_not_depend_on_earlier_builds(world1, tmp_path):
    from megatron_kappa.config import load_config
    from megatron_kappa.model.build import build_model
    first = torch.load(save_init_weights(tmp_path / "a.pt"))
    build_model(load_config("configs/tiny.yaml"), "cpu")  # another test's build moves every RNG on
    torch.manual_seed(3)  # negative control: torch's seed alone leaves the experts' tracker moved on
    again = build_model(load_config("configs/tiny.yaml"), "cpu").state_dict()
    moved = [k for k in first if not k.endswith("_extra_state") and not torch.equal(first[k], again[k])]
    assert moved and all("experts" in k for k in moved), moved
    second = torch.load(save_init_weights(tmp_path / "b.pt"))
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)
