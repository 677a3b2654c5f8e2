"""Units the planner counts in: GiB, and the bytes of one value in a precision."""
from __future__ import annotations

GIB = 2 ** 30


def value_bytes(precision: str) -> int:
    """Bytes of one weight, gradient or activation value in `precision`: 2 in bf16 (and fp8, whose
    weights stay bf16), 4 in fp32."""
    return 2 if precision in ("bf16", "fp8") else 4
