"""bench/kappa_moe_layer.py's equality check (tests/support/kappa_moe.py): the project's κ MoE
layer and the authors' (14c9b04) MOELayer, built as each code builds them with the project's
weights copied into theirs, agree on a tiny shape (output, input gradient, router gradient), and
one perturbed weight of theirs is caught by the same check (the negative control)."""
import pytest
import torch

from tests.support import kappa_moe

SHAPE = dict(d=48, head_dim=16, experts=4, seq=16)


@pytest.fixture(scope="module")
def pair():
    project = kappa_moe.build_project(*SHAPE.values())
    authors = kappa_moe.build_authors(*SHAPE.values())
    kappa_moe.randomize(project)
    kappa_moe.copy_weights(project, authors)
    return project, authors, *kappa_moe.inputs(2, SHAPE["seq"], SHAPE["d"])


def test_the_two_layers_agree(pair):
    diffs = kappa_moe.differences(*pair)
    assert set(diffs) == {"out", "dx", "router_grad"}
    assert all(v <= kappa_moe.TOLERANCE for v in diffs.values()), diffs
    # capacity factor 1 drops tokens at this shape (experts chosen more often than their
    # capacity), so the drop rule and order are compared too
    project, authors, x, _ = pair
    top = (x.reshape(-1, SHAPE["d"]) @ project.router.weight.T).topk(2, dim=-1).indices
    assert torch.bincount(top.reshape(-1)).max() > authors.router.get_capacity(x.shape[0] * x.shape[1])


@pytest.mark.parametrize("weight", ["experts.kappa_bias", "experts.c_proj", "router.w_g.weight"])
def test_one_perturbed_weight_is_caught(pair, weight):
    project, authors, x, g = pair
    param = dict(authors.named_parameters())[weight]
    saved = param.detach().clone()
    with torch.no_grad():
        param.view(-1)[0] += 1e-2 * saved.abs().max()
    try:
        diffs = kappa_moe.differences(project, authors, x, g)
    finally:
        with torch.no_grad():
            param.copy_(saved)
    assert max(diffs.values()) > 10 * kappa_moe.TOLERANCE, diffs
