"""Comparisons shared by the tests."""


def max_gap(ref: list, got: list) -> float:
    """Largest |ref[i] - got[i]| of two equally long sequences (a shorter one is a failure, not a
    shorter comparison)."""
    assert len(ref) == len(got), f"lengths differ: {len(ref)} vs {len(got)} ({ref} vs {got})"
    assert len(ref) > 0, "nothing to compare"
    return max(abs(a - b) for a, b in zip(ref, got))


def max_rel_grad_error(ref: dict, got: dict) -> float:
    """Largest per-tensor max |got − ref| / max |ref| over two dicts of gradients with the same keys."""
    assert ref.keys() == got.keys()
    return max(((got[k] - ref[k]).abs().max() / ref[k].abs().max().clamp_min(1e-12)).item() for k in ref)
