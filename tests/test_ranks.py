"""covgrad.ranks.spearman_streamed against covgrad.topk.spearman (the in-memory reference)."""

import math

import numpy as np
import pytest

from covgrad import ranks
from covgrad.ranks import spearman_streamed
from covgrad.topk import spearman


@pytest.mark.parametrize("chunk", [7, 1 << 22])
def test_matches_the_in_memory_spearman_with_ties_across_chunks(chunk, monkeypatch):
    monkeypatch.setattr(ranks, "CHUNK", chunk)
    rng = np.random.default_rng(3)
    for n in (2, 3, 50, 1001):
        x = rng.integers(0, 5, n).astype(np.float64)  # long runs of ties, crossing chunk edges
        y = x + rng.integers(0, 3, n)
        z = rng.standard_normal(n)
        for a, b in ((x, y), (x, z), (z, y), (z, z)):
            want = spearman(a, b)
            got = spearman_streamed(lambda a=a: a.copy(), lambda b=b: b.copy())
            assert got == pytest.approx(want, rel=1e-12, abs=1e-15), (n, want, got)


def test_constant_is_nan_and_bad_input_is_refused():
    assert math.isnan(spearman_streamed(lambda: np.ones(5), lambda: np.arange(5.0)))
    with pytest.raises(ValueError, match="NaN"):
        spearman_streamed(lambda: np.array([1.0, np.nan]), lambda: np.arange(2.0))
    with pytest.raises(ValueError, match="one shape"):
        spearman_streamed(lambda: np.arange(3.0), lambda: np.arange(4.0))
