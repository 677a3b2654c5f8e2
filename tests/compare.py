"""Comparisons shared by the tests."""


def max_gap(ref: list, got: list) -> float:
    """Largest |ref[i] - got[i]| of two equally long sequences (a shorter one is a failure, not a
    shorter comparison)."""
    assert len(ref) == len(got), f"lengths differ: {len(ref)} vs {len(got)} ({ref} vs {got})"
    assert len(ref) > 0, "nothing to compare"
    return max(abs(a - b) for a, b in zip(ref, got))
