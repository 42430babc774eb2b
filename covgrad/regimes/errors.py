"""Standard errors of a regime fold's gradient: of independent rows (:func:`moment_mean_se`) and clustered by prompt
group (:func:`clustered_mean_se`, what the fold's group state gives). Plain numpy: the fold imports it on images
without the pipeline's packages."""

from __future__ import annotations

import numpy as np


def moment_mean_se(count: np.ndarray, mean: np.ndarray, m2: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Chan-merge moment rows into G = mean g, its standard error √(Σ(g − G)²/(N(N − 1))) and N.

    Args:
        count: shape (R,) samples per row (rows with 0 are skipped); mean, m2: shape (R, b) float64.

    Returns:
        G (b,), se (b,) float64 (NaN for N < 2) and N.
    """
    n, g, s = 0.0, np.zeros(mean.shape[1]), np.zeros(mean.shape[1])
    for c, mu, q in zip(count, mean, m2, strict=True):
        if c == 0:
            continue
        tot = n + c
        d = mu - g
        g = g + d * (c / tot)
        s = s + q + d * d * (n * c / tot)
        n = tot
    se = np.sqrt(s / (n * (n - 1))) if n >= 2 else np.full_like(g, np.nan)
    return g, se, n


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    ok = den > 0
    return np.where(ok, num / np.where(ok, den, 1.0), np.nan)


def clustered_mean_se(
    count: np.ndarray,
    mean_a: np.ndarray,
    m2_a: np.ndarray,
    mean: np.ndarray,
    m2: np.ndarray,
    c: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, float]:
    """G = Σ_c S_c / Σ_c n_c and its prompt-clustered standard error, from the group moment rows of a
    :class:`covgrad.moments.accum.GroupAccumulator` (each prompt group's sum S_c of g_n folded as one sample whose
    advantage is its size n_c): se² = C/(C − 1)·Σ_c (S_c − n_c G)²/n², with
    Σ_c (S_c − n_c G)² = m2_S − 2G·c_nS + G²·m2_n after Chan-merging the rows (as :func:`moment_mean_se`,
    with the co-moment).

    Args:
        count, mean_a, m2_a: shape (R,) groups, mean group size and Σ(n_c − n̄)² per row (rows with 0 skipped).
        mean, m2: shape (R, b) float64: mean(S_c) and Σ(S_c − mean)² per row; c: Σ(n_c − n̄)(S_c − mean),
            None for groups of one size (then 0).

    Returns:
        G (b,), se (b,) float64 (NaN for fewer than 2 groups) and C, the number of groups.
    """
    C, nbar, m2_n = 0.0, 0.0, 0.0
    mS, m2S, cnS = (np.zeros(mean.shape[1]) for _ in range(3))
    for k in np.flatnonzero(count > 0):  # Chan's merge of the rows, the co-moment included
        tot = C + count[k]
        f = C * count[k] / tot
        d_n, d_S = mean_a[k] - nbar, mean[k] - mS
        m2S = m2S + m2[k] + d_S * d_S * f
        if c is not None:
            cnS = cnS + c[k] + d_n * d_S * f
        m2_n += m2_a[k] + d_n * d_n * f
        nbar += d_n * count[k] / tot
        mS = mS + d_S * (count[k] / tot)
        C = tot
    if C == 0:
        nan = np.full(mean.shape[1], np.nan)
        return nan, nan, 0.0
    G = mS / nbar
    resid = np.maximum(m2S - 2 * G * cnS + G * G * m2_n, 0.0)
    se = np.sqrt(C / (C - 1) * resid) / (C * nbar) if C >= 2 else np.full_like(G, np.nan)
    return G, se, C
