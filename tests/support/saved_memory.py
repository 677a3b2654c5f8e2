"""What autograd keeps for backward, measured: the reference of the planner's activation memory
(tests/test_plan_saved.py, tests/test_recompute.py)."""
import torch


def saved_bytes(model, tokens, labels=None) -> int:
    """Bytes autograd keeps for backward in one forward of `model` on `tokens` [b, s] (with
    `labels`, through the loss): each storage once, at its size when the forward ends, parameters
    left out."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage()
        return t
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, positions, None, labels=labels)
    return sum(s.nbytes() for s in storages.values())
