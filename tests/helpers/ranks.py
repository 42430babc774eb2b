"""Rank references: Spearman's correlation straight from its definition."""

from __future__ import annotations

import numpy as np


def naive_spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Average ranks from the definition (O(n²)): count of smaller values plus half the ties, then Pearson in
    float64 (numpy's ``corrcoef``)."""

    def ranks(v: np.ndarray) -> np.ndarray:
        return np.array([(v < t).sum() + ((v == t).sum() + 1) / 2 for t in v])

    return float(np.corrcoef(ranks(x), ranks(y))[0, 1])
