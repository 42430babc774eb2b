"""Quantiles of the normal and Student's t distributions at the 95% level, for intervals computed
without scipy (:mod:`covgrad.report.uncertainty`, :mod:`covgrad.tokens.study`)."""

from __future__ import annotations

import math

LEVEL = 0.95
Z975 = 1.959963984540054  # standard normal 0.975 quantile
Z95 = 1.6448536269514722  # standard normal 0.95 quantile: a one-sided test at the 5% level


def t975(nu: int) -> float:
    """The 0.975 quantile of Student's t with ``nu`` (≥ 1) degrees of freedom: exact for nu = 1 and 2, a
    four-term Cornish–Fisher expansion above (error below 4e-3 at nu = 3 and 1e-4 from nu = 5)."""
    if nu < 1:
        raise ValueError(f"t quantile: {nu} degrees of freedom; it needs at least 1")
    if nu < 2:
        return math.tan(math.pi * LEVEL / 2)
    if nu < 3:
        p = (1 + LEVEL) / 2
        return (2 * p - 1) * math.sqrt(2 / (4 * p * (1 - p)))
    z = Z975
    return (
        z
        + (z**3 + z) / (4 * nu)
        + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * nu**2)
        + (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / (384 * nu**3)
        + (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / (92160 * nu**4)
    )
