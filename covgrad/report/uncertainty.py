"""Uncertainty of the headline statistics: a prompt-group bootstrap and a sign-flip null band.

**Intervals** (``group_bootstrap``, ``interval``): the G prompt groups are resampled with replacement
``n_boot`` times (a group keeps all its samples and their stored advantages, so a group-relative
advantage stays what the rollouts computed), and every replicate recomputes F, G, ρ from the per-sample
score rows with the replicate's group counts as sample weights. The interval is θ̂ shifted by the
replicates' centred quantiles (for the correlations, max |ρ| and Spearman, on Fisher's z = atanh
scale, where their spread no longer shrinks as they approach 1, mapped back with tanh), each scaled by
the few-groups factor c = √(G / (G − 1)) · t_{G−1} / z
(t_{G−1} and z: the 0.975 quantiles of Student's t with G − 1 degrees of freedom and of the normal),
[θ̂ − c·(Q(0.975) − θ̄*), θ̂ + c·(θ̄* − Q(0.025))], clipped to the statistic's range. The factor
is what turns the bootstrap interval of a mean of G groups into the exact t interval (the bootstrap
variance of a mean is (G − 1)/G times the unbiased one, and with G groups the standard error is itself
estimated); the coverage it gives is measured by ``benchmarks/intervals.py`` (docs/reading.md). The
interval says where the statistic of another run of the same
configuration with fresh seeds falls (its mean over such runs, at the same N). It does not remove the
finite-N bias of the statistic: noise in F and |G| lowers the overlap and Spearman and raises max |ρ|
against their values at N → ∞, and the replicates (which add that noise a second time) measure the
bias only in part. Only the per-sample score rows support it: the moment state is two parity halves,
too few to resample, so a run that kept only moments has no intervals (``covgrad.report`` says so).

**Null band** (``group_bootstrap``'s ``null_trace`` / ``null_coord``, ``resampled_band``): the central 95% of the
zero-mean statistics over ``n_null`` sign-flipped copies of the data: each response's score row s_n is replaced by
ε_n·s_n with independent random signs ε_n = ±1 (the same signs for every parameter), and the statistics are
recomputed. The hypothesis is the one a sampler's own samples satisfy: given the prompts, the responses are
independent and E[s_n | prompt] = 0 (under either centering). If each s_n's law given its prompt were symmetric, the
flipped copies would have the data's own joint law and the band would be exact at any N (a randomisation test).
Without symmetry the flips still keep all but the skew: every row's sparsity pattern and size (a response that
holds half of a tensor's squared norm stays one response), the correlation of the coordinates within a response,
and, for N·‖m‖² = (1/N)·Σ_{n,n'} s_n·s_n', the conditional variance of its cross terms, 2·Σ_{n≠n'} (s_n·s_n')²/N²,
the U-statistic's own under the hypothesis. F_i = mean(s_i²) is unchanged by a flip, so a null data set's
Var_i = F_i − m_i(ε)² needs one product of the (B₀, N) signs with the rows, not two.
The coordinate statistic is tested in its capped form: each coordinate's t_i² = N·m_i² / Var_i counts up to
``covgrad.moments.stats.COORD_CAP`` = 9. A coordinate whose mean is carried by an event the sample lacks (the LM-head
row of a token never drawn, whose rows are all −p_v·h) has a large t_i² although E[s_i] = 0, and no reference built
from the sample can know the event, so its share of the statistic is bounded instead. ``null_coord`` is the null
replicates' capped statistic plus the data's own part above the cap (``coord_excess`` = mean_i (t_i² − 9)⁺):
``zero_mean_coord`` lies inside that band exactly when its capped part lies inside the capped replicates' band, so
the band keeps the scale of ``zero_mean_coord`` while its verdict is the capped test's. A fraction f of coordinates
whose events the sample lacks can still move the capped statistic by up to f·(9 − 1) (on the demo f is 0.2%). The
false-alarm rate and power on the demo's own samples are measured by ``benchmarks/zero_mean.py``
(docs/reading.md). Without rows (moment state only) nothing can be flipped and the χ²_1 band (``null_band(1)``, the
widest) stands in.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from covgrad.moments.quantiles import LEVEL, Z975, t975
from covgrad.moments.stats import coord_t2_sums
from covgrad.moments.topk import count_for_fraction, rank_correlation, ranks_and_order

METHOD = "prompt-group bootstrap (centred percentile interval, Fisher z for correlations, few-groups t factor)"
REPLICATE_BUDGET = 50_000_000  # n_boot × P entries held per replicate array (float32: 200 MB each)
REPLICATE_SLICE = 1024  # parameters per pass over the replicates' (B, slice) float64 temporaries
VAR_FLOOR = 1e-12  # a null data set's Var_i at most this fraction of mean(s_i²) is rounding: every sign aligned
# replicates ranked at once (about 60 bytes per parameter each: the sort's order, the ranks, the sorted values)
SORT_THREADS = min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def chi2_quantile(d: float, p_z: float) -> float:
    """Wilson–Hilferty approximation of the χ²_d quantile at standard-normal deviate ``p_z`` (≥ 0)."""
    c = 2.0 / (9.0 * d)
    return max(0.0, d * (1.0 - c + p_z * math.sqrt(c)) ** 3)


def null_band(d: float) -> tuple[float, float]:
    """Central 95% of χ²_d / d: where a zero-mean statistic with d effective degrees of freedom falls
    when E[s] = 0."""
    return chi2_quantile(d, -Z975) / d, chi2_quantile(d, Z975) / d


def resampled_band(replicates: np.ndarray) -> tuple[float, float] | None:
    """The 95% null band of a zero-mean statistic from its B null replicates (NaN ignored), or None when fewer
    than 2: the j-th smallest and the j-th largest replicate, j = max(1, ⌊0.025·(B + 1)⌋) (5 of 200).

    Why these order statistics: when the data's statistic is exchangeable with its B replicates (sign flips of
    rows whose law is symmetric), its rank among the B + 1 values is uniform, so it lies below the j-th smallest
    replicate with probability j / (B + 1) and above the j-th largest with the same: 2·5/201 = 4.98% in all at
    B = 200. Interpolated 2.5% and 97.5% quantiles sit about one replicate further in and leave 6/201 on each
    side, 6.0% in all."""
    r = np.sort(replicates[np.isfinite(replicates)])
    if r.size < 2:
        return None
    j = max(1, math.floor((1 - LEVEL) / 2 * (r.size + 1)))
    return float(r[j - 1]), float(r[r.size - j])


class NullDraws:
    """The zero-mean statistics of ``n`` sign-flipped copies of the data (module docstring), accumulated block by
    block of parameters: the same signs for every block.

    Args:
        N: samples (score rows).
        n: null data sets B₀ (none when 0).
        rng: the signs' generator.
    """

    def __init__(self, N: int, n: int, rng: np.random.Generator) -> None:
        self.N, self.n = N, n
        self.signs = rng.choice(np.array([-1.0, 1.0]), size=(n, N))  # (B₀, N): ε_n of each response
        self.m2 = np.zeros(n)  # Σ_i m_i²
        self.var = np.zeros(n)  # Σ_i Var_i
        self.coord = np.zeros(n)  # Σ_i min(t_i², COORD_CAP) over varying coordinates
        self.varying = np.zeros(n)  # coordinates that vary
        self.observed = np.zeros(3)  # the data's own Σ_i min(t_i², COORD_CAP), Σ_i (t_i² − COORD_CAP)⁺, P_varying

    def add(self, S: np.ndarray) -> None:
        """Add the block of score rows ``S`` (N, b), float64."""
        if not self.n:
            return
        m = S.mean(axis=0)  # (b,)
        var = ((S - m) ** 2).mean(axis=0)
        second = (S * S).mean(axis=0)  # (b,): unchanged by any flip
        varies = var > 0  # the coordinates the data's own statistics count
        self.observed += (*coord_t2_sums(self.N, m, var, varies), np.count_nonzero(varies))
        for c in range(0, S.shape[1], REPLICATE_SLICE):
            cols = slice(c, c + REPLICATE_SLICE)
            m = self.signs @ S[:, cols] / self.N  # (B₀, slice)
            var = second[cols] - m * m
            flipped = varies[cols] & (var > VAR_FLOOR * second[cols])  # zero up to rounding: all signs aligned
            self.m2 += (m * m).sum(axis=1)
            self.var += np.where(flipped, var, 0.0).sum(axis=1)
            self.coord += coord_t2_sums(self.N, m, var, flipped)[0]
            self.varying += flipped.sum(axis=1)

    def statistics(self) -> dict[str, Any]:
        """``null_trace`` = N·Σ m² / Σ Var of each null data set and ``null_coord`` = its mean_i min(t_i², COORD_CAP)
        plus ``coord_excess``, (B₀,) each; ``coord_capped`` and ``coord_excess``: the data's own
        mean_i min(t_i², COORD_CAP) and mean_i (t_i² − COORD_CAP)⁺ over its varying coordinates (their sum is
        ``zero_mean_coord``; NaN without one)."""
        below, above, varying = self.observed
        capped, excess = (below / varying, above / varying) if varying else (math.nan, math.nan)
        with np.errstate(invalid="ignore", divide="ignore"):
            trace = np.where(self.var > 0, self.N * self.m2 / self.var, np.nan)
            coord = np.where(self.varying > 0, self.coord / self.varying + excess, np.nan)
        return {"null_trace": trace, "null_coord": coord, "coord_capped": capped, "coord_excess": excess}


def few_groups_factor(groups: int) -> float:
    """c = √(G / (G − 1)) · t_{G−1} / z: the factor on the bootstrap's centred quantiles with G ≥ 2
    resampled groups."""
    if groups < 2:
        raise ValueError(f"bootstrap intervals need at least 2 prompt groups, got {groups}")
    return math.sqrt(groups / (groups - 1)) * t975(groups - 1) / Z975


def interval(
    estimate: float, replicates: np.ndarray, lo: float, hi: float, *, groups: int, fisher_z: bool = False
) -> tuple[float, float]:
    """95% interval of ``estimate`` from (B,) bootstrap ``replicates`` (NaN ignored) of ``groups``
    resampled groups: ``estimate`` minus the replicates' centred 97.5% and 2.5% quantiles scaled by
    :func:`few_groups_factor`, clipped to [lo, hi]; NaN when fewer than 2 replicates. ``fisher_z``: for a
    correlation (a value in [−1, 1]), the same on Fisher's z = atanh scale, mapped back with tanh."""
    r = replicates[np.isfinite(replicates)]
    if r.size < 2 or not math.isfinite(estimate):
        return math.nan, math.nan
    c = few_groups_factor(groups)
    if fisher_z:
        edge = 1.0 - 1e-12  # |ρ| = 1 exactly has no finite z
        estimate, r = math.atanh(min(max(estimate, -edge), edge)), np.arctanh(np.clip(r, -edge, edge))
    q_lo, q_hi = c * (np.quantile(r, [(1 - LEVEL) / 2, (1 + LEVEL) / 2]) - r.mean())
    ends = (estimate - q_hi, estimate - q_lo)
    if fisher_z:
        ends = (math.tanh(ends[0]), math.tanh(ends[1]))
    return float(min(max(ends[0], lo), hi)), float(min(max(ends[1], lo), hi))


def replicates_for(P: int, n_boot: int) -> int:
    """Replicates that fit ``REPLICATE_BUDGET`` at P parameters, at most ``n_boot``."""
    return int(min(n_boot, REPLICATE_BUDGET // max(P, 1)))


def _replicate(F: np.ndarray, absG: np.ndarray, ks: Sequence[int]) -> tuple[list[float], float]:
    """One replicate's global overlap |top-k by |G| ∩ top-k by F| / k for each k (ties in any order) and
    Spearman(F, |G|), from (P,) arrays: one sort of each array serves both."""
    rank_f, order_f = ranks_and_order(F)
    rank_g, order_g = ranks_and_order(absG)
    overlap = []
    for k in ks:
        top_f = np.zeros(F.size, dtype=bool)
        top_f[order_f[F.size - k :]] = True
        overlap.append(float(top_f[order_g[F.size - k :]].sum()) / k)
    return overlap, rank_correlation(rank_f, rank_g)


def group_bootstrap(
    read: Callable[[int, int], np.ndarray],
    advantage: np.ndarray,
    group: np.ndarray,
    P: int,
    qs: Sequence[float],
    *,
    n_boot: int = 200,
    seed: int = 0,
    block: int = 16384,
    n_null: int = 200,
) -> dict[str, Any]:
    """Bootstrap replicates of the global overlap at each q, Spearman(F, |G|) and max |ρ|, and null replicates of
    the two zero-mean statistics (module docstring: every response's score row multiplied by a random sign).

    Args:
        read: ``read(a, b)``, the score rows of parameters a..b, shape (N, b − a), float32 or float64.
        advantage: (N,) advantages as stored with the scores.
        group: (N,) prompt group of each sample.
        P: parameters.
        qs: top fractions for the overlap.
        n_boot: replicates B (fewer when B × P exceeds ``REPLICATE_BUDGET``; 0 disables).
        seed: seed of the group draws and of the null draws (the report is deterministic).
        block: parameters per read.
        n_null: null data sets B₀ (their statistics are (B₀,) sums over blocks, so P does not limit them; 0
            disables).

    Returns:
        ``n_boot`` (replicates used), ``groups`` (G, the resampled units), ``overlap`` (B, len(qs)),
        ``spearman`` (B,), ``max_abs_rho`` (B,),
        ``null_trace`` and ``null_coord`` (B₀,), the null replicates of ``zero_mean_trace`` and ``zero_mean_coord``
        (NaN where a data set has no varying coordinate), ``coord_capped`` and ``coord_excess`` (floats), the
        data's own coordinate statistic below and above the cap (``NullDraws.statistics``).
    """
    A = np.asarray(advantage, dtype=np.float64)
    labels, gidx = np.unique(group, return_inverse=True)
    B = replicates_for(P, n_boot) if len(labels) >= 2 else 0
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(labels), size=(B, len(labels)))  # (B, groups)
    gcount = np.stack([np.bincount(d, minlength=len(labels)) for d in draws]) if B else np.zeros((0, len(labels)))
    member = (gidx[None, :] == np.arange(len(labels))[:, None]).astype(np.float64)  # (groups, N) one-hot
    W = gcount.astype(np.float64)  # (B, groups): a replicate's sample weights are its group's count
    sw = W @ member.sum(axis=1, keepdims=True)  # (B, 1)
    mean_a = (W @ (member @ A))[:, None] / sw  # (B, 1)
    std_a = np.sqrt(np.maximum((W @ (member @ (A * A)))[:, None] / sw - mean_a**2, 0.0))  # (B, 1)
    sums = np.concatenate([member, member * A])  # (2 groups, N): per-group sums of s and of A·s
    # filled first: writing float64 slices into never-touched pages cost 0.9 s per 180 MB on the machine measured,
    # filling them first 0.02 s
    F_b = np.full((B, P), np.nan, dtype=np.float32)
    absG_b = np.full((B, P), np.nan, dtype=np.float32)
    max_rho = np.full(B, -1.0)
    null = NullDraws(gidx.size, n_null, np.random.default_rng([seed, 1]))
    with np.errstate(invalid="ignore", divide="ignore"):
        for a in range(0, P, block):
            b = min(P, a + block)
            S = np.asarray(read(a, b), dtype=np.float64)  # (N, b)
            # 1. the null data sets' sums of this block
            null.add(S)
            if not B:
                continue
            # 2. the replicates' statistics of this block, from per-group sums (a replicate's sample weights
            # are its group counts), over column slices whose (B, slice) temporaries stay in cache
            s1, sa = np.split(sums @ S, 2)  # (groups, b) each
            s2 = member @ (S * S)
            for c in range(0, b - a, REPLICATE_SLICE):
                cols = slice(c, c + REPLICATE_SLICE)
                m = (W @ s1[:, cols]) / sw  # (B, slice)
                F = (W @ s2[:, cols]) / sw
                G = (W @ sa[:, cols]) / sw
                rho = (G - mean_a * m) / (std_a * np.sqrt(np.maximum(F - m * m, 0.0)))
                F_b[:, a + c : a + c + F.shape[1]] = F
                absG_b[:, a + c : a + c + F.shape[1]] = np.abs(G)
                max_rho = np.maximum(max_rho, np.where(np.isfinite(rho), np.abs(rho), -1.0).max(axis=1))
    ks = [count_for_fraction(q, P) for q in qs]
    overlap = np.full((B, len(qs)), np.nan)
    rank = np.full(B, np.nan)
    varied = [i for i in range(B) if std_a[i, 0] > 0]
    with ThreadPoolExecutor(max_workers=SORT_THREADS) as pool:  # numpy's sorts free the GIL
        for i, (ov, rk) in zip(varied, pool.map(lambda i: _replicate(F_b[i], absG_b[i], ks), varied), strict=True):
            overlap[i], rank[i] = ov, rk
    max_rho[(max_rho < 0) | (std_a[:, 0] <= 0)] = np.nan
    return {
        "n_boot": B,
        "groups": len(labels),
        "overlap": overlap,
        "spearman": rank,
        "max_abs_rho": max_rho,
        **null.statistics(),
    }
