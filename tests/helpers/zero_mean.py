"""A float64 reference of the report's zero-mean test (``covgrad.report.uncertainty.CrossFit``), shared by the
report's tests."""

import math

import numpy as np

from covgrad.moments.quantiles import Z95
from covgrad.moments.stats import COORD_CAP


def reference(S: np.ndarray, group: np.ndarray) -> dict[str, tuple[float, float, float, float]]:
    """(value, z, lo, hi) of each statistic, float64, from the halves' means and a loop over each half's samples."""
    s = S.astype(np.float64)
    n = s.shape[0]
    m, var = s.mean(axis=0), s.var(axis=0)
    varies = var > 0
    values = {
        "trace": n * (m * m).sum() / var.sum(),
        "coord": (n * m[varies] ** 2 / var[varies]).mean(),
    }
    metric = {"trace": np.ones_like(m), "coord": np.zeros_like(m)}
    metric["coord"][varies] = 1.0 / np.maximum(var[varies], n * m[varies] ** 2 / COORD_CAP)
    A, B = s[group % 2 == 0], s[group % 2 == 1]
    m_a, m_b = A.mean(axis=0), B.mean(axis=0)
    out = {}
    for k, w in metric.items():
        U = float((w * m_a * m_b).sum())
        var_a = sum(float(row @ (w * m_b)) ** 2 for row in A) / len(A) ** 2
        var_b = sum(float(row @ (w * m_a)) ** 2 for row in B) / len(B) ** 2
        sigma = math.sqrt((var_a + var_b) / 2)
        scale = var.sum() if k == "trace" else np.count_nonzero(varies)
        factor = 2 * len(A) * len(B) / (n * scale)
        out[k] = (values[k], U / sigma, 0.0, values[k] - factor * U + Z95 * factor * sigma)
    return out
