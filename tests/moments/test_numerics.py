"""covgrad.moments.numerics: sums whose bits do not depend on where the array lies in memory."""

from __future__ import annotations

import numpy as np
import pytest

from covgrad.moments.numerics import sum64


@pytest.mark.parametrize("offset", range(1, 8))
def test_sum64_of_a_misaligned_array_has_the_aligned_bits(offset):
    """The values at a byte offset that breaks float64 alignment sum to the same bits as in place, and to
    math.fsum's exactly rounded value within a few ulps (fresh random inputs each run)."""
    import math

    x = np.random.default_rng().standard_normal(100_003) ** 2
    raw = bytearray(x.nbytes + 8)
    moved = np.frombuffer(memoryview(raw)[offset : offset + x.nbytes], dtype=np.float64)
    moved[:] = x
    assert not moved.flags.aligned
    assert sum64(moved) == sum64(x) == float(x.sum())
    assert sum64(moved) == pytest.approx(math.fsum(x), rel=1e-13)
