"""Uncertainty of the headline statistics: a prompt-group bootstrap and a cross-fit zero-mean test.

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

**Zero-mean test** (``group_bootstrap``'s ``zero_mean``, :class:`CrossFit`): the hypothesis is the one a sampler's
own samples satisfy: given the prompts, the responses are independent and E[s_n | prompt] = 0 (under either
centering). The prompt groups are split by the parity of their id (the scores store's two halves, A even and B odd),
and the test is on the cross term between the halves, U = Σ_i w_i·m_{A,i}·m_{B,i}, with metric w_i = 1 for the trace
statistic and w_i = 1 / max(Var_i, N·m_i² / COORD_CAP) for the coordinate statistic (Var_i, m_i over all N: each
coordinate's t_i² = N·m_i²/Var_i counted up to ``COORD_CAP``). Given half B, U = (1/N_A)·Σ_{n∈A} s_n·(w∘m_B) is a
mean of independent terms with mean zero under the hypothesis, and the same holds with A and B swapped, so
  z = U / σ̂,  σ̂² = ½·[Σ_{n∈A} (s_n·(w∘m_B))² / N_A² + Σ_{n∈B} (s_n·(w∘m_A))² / N_B²],
each half's sum an unbiased estimate of Var(U) = tr(Σ̄_A W Σ̄_B W) / (N_A·N_B), is a self-normalised sum, standard
normal in the limit. The test is one-sided, rejecting at z > 1.645 (5%): under any centring error b = E[s],
E[U] = Σ_i w_i·b_i² ≥ 0, so a negative z is never evidence of one. A self-normalised sum stays calibrated where a
few responses carry most of a direction's squared norm (one giant row makes z ≤ about 1, not a false alarm), which
is what sign flips of the whole-sample statistic, exact only for symmetric rows, did not do on the demo's own
samples (docs/reading.md). Both statistics stay on their familiar scales: with m = (N_A·m_A + N_B·m_B)/N,
N·‖m‖²_w = (N_A²·‖m_A‖²_w + N_B²·‖m_B‖²_w)/N + 2·N_A·N_B·U/N, so the band of ``zero_mean_trace`` (÷ tr Var) and of
``zero_mean_coord`` (÷ P_varying) runs from 0 to the statistic less its cross term plus 1.645 times the cross term's
σ̂ (the coordinate statistic's part above the cap is the data's own): a statistic lies inside its band exactly when
z ≤ 1.645. The capped metric bounds what a coordinate whose mean is carried by an event the
sample lacks (the LM-head row of a token never drawn, rows all −p_v·h) adds to U at COORD_CAP / N; no reference built
from the sample can know such an event. The false-alarm rate and power on the demo's own samples are measured by
``benchmarks/zero_mean.py`` (docs/reading.md). Without rows (moment state only) σ̂ cannot be formed and the χ²_1 band
(``null_band(1)``, the widest) stands in; with one half empty (a single prompt group, or all ids of one parity)
there is no test.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from covgrad.moments.quantiles import LEVEL, Z95, Z975, t975
from covgrad.moments.stats import COORD_CAP, coord_t2_sums
from covgrad.moments.topk import count_for_fraction, rank_correlation, ranks_and_order

METHOD = "prompt-group bootstrap (centred percentile interval, Fisher z for correlations, few-groups t factor)"
REPLICATE_BUDGET = 50_000_000  # n_boot × P entries held per replicate array (float32: 200 MB each)
REPLICATE_SLICE = 1024  # parameters per pass over the replicates' (B, slice) float64 temporaries
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


METRICS = ("trace", "coord")
"""The zero-mean statistics :class:`CrossFit` tests, in the order of its metric axis."""


@dataclass(frozen=True)
class ZeroMeanTest:
    """The cross-fit test of one zero-mean statistic (module docstring).

    Attributes:
        value: the statistic recomputed from the rows (``zero_mean_trace`` or ``zero_mean_coord``, uncapped).
        z: U / σ̂, the cross term between the halves over its standard error (0 where σ̂ = 0: then U = 0).
        band: the statistic's one-sided 95% band, (0, hi): ``value`` lies inside exactly when z ≤ 1.645.
    """

    value: float
    z: float
    band: tuple[float, float]


class CrossFit:
    """The sums of the cross-fit zero-mean test (module docstring), accumulated block by block of parameters.

    Args:
        group: (N,) prompt group id of each sample; half A is the even ids, half B the odd ones.
    """

    def __init__(self, group: np.ndarray) -> None:
        odd = np.asarray(group) % 2 == 1
        self.N = odd.size
        self.halves = (np.flatnonzero(~odd), np.flatnonzero(odd))  # (N_A,), (N_B,) sample indices
        self.sizes = np.array([h.size for h in self.halves], dtype=np.float64)  # N_A, N_B
        metrics = len(METRICS)
        self.cross = np.zeros(metrics)  # U = Σ_i w_i·m_A,i·m_B,i
        self.terms = [np.zeros((metrics, h.size)) for h in self.halves]  # s_n·(w∘m_other) of each sample
        self.m2 = 0.0  # Σ_i m_i²
        self.trace_var = 0.0  # Σ_i Var_i
        self.varying = 0  # coordinates with Var_i > 0
        self.coord = 0.0  # Σ_i t_i² over them, uncapped

    @property
    def testable(self) -> bool:
        """Both halves hold samples."""
        return bool(self.sizes.min() > 0)

    def add(self, S: np.ndarray) -> None:
        """Add the block of score rows ``S`` (N, b), float64."""
        m = S.mean(axis=0)  # (b,)
        var = ((S - m) ** 2).mean(axis=0)
        varies = var > 0
        self.m2 += float((m * m).sum())
        self.trace_var += float(var.sum())
        self.varying += int(np.count_nonzero(varies))
        self.coord += float(sum(coord_t2_sums(self.N, m, var, varies)))
        if not self.testable:
            return
        capped = np.maximum(var, self.N * m * m / COORD_CAP)
        weights = (np.ones_like(m), np.where(varies, 1.0 / np.where(varies, capped, 1.0), 0.0))  # METRICS' order
        A, B = (S[h] for h in self.halves)
        m_a, m_b = A.mean(axis=0), B.mean(axis=0)
        for j, w in enumerate(weights):
            self.cross[j] += float((w * m_a * m_b).sum())
            self.terms[0][j] += A @ (w * m_b)
            self.terms[1][j] += B @ (w * m_a)

    def statistics(self) -> dict[str, ZeroMeanTest] | None:
        """``trace`` and ``coord``: each statistic's :class:`ZeroMeanTest`; None without a test (a half empty, or no
        coordinate varies)."""
        if not self.testable or self.trace_var <= 0 or not self.varying:
            return None
        N, (n_a, n_b) = self.N, self.sizes
        var_u = 0.5 * ((self.terms[0] ** 2).sum(axis=1) / n_a**2 + (self.terms[1] ** 2).sum(axis=1) / n_b**2)
        sigma = np.sqrt(var_u)  # (metrics,): σ̂ of U
        values = (N * self.m2 / self.trace_var, self.coord / self.varying)
        out = {}
        for j, (name, scale) in enumerate(zip(METRICS, (self.trace_var, self.varying), strict=True)):
            factor = 2 * n_a * n_b / (N * scale)  # the cross term's share of the statistic is factor·U
            hi = values[j] - factor * self.cross[j] + Z95 * factor * sigma[j]
            z = self.cross[j] / sigma[j] if sigma[j] > 0 else 0.0  # σ̂ = 0: every term is 0, so is U
            out[name] = ZeroMeanTest(float(values[j]), float(z), (0.0, float(hi)))
        return out


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
) -> dict[str, Any]:
    """Bootstrap replicates of the global overlap at each q, Spearman(F, |G|) and max |ρ|, and the cross-fit test
    of the two zero-mean statistics (module docstring).

    Args:
        read: ``read(a, b)``, the score rows of parameters a..b, shape (N, b − a), float32 or float64.
        advantage: (N,) advantages as stored with the scores.
        group: (N,) prompt group of each sample.
        P: parameters.
        qs: top fractions for the overlap.
        n_boot: replicates B (fewer when B × P exceeds ``REPLICATE_BUDGET``; 0 disables).
        seed: seed of the group draws (the report is deterministic).
        block: parameters per read.

    Returns:
        ``n_boot`` (replicates used), ``groups`` (G, the resampled units), ``overlap`` (B, len(qs)),
        ``spearman`` (B,), ``max_abs_rho`` (B,),
        ``zero_mean``: ``trace`` and ``coord`` -> :class:`ZeroMeanTest`, or None without a test
        (:meth:`CrossFit.statistics`).
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
    zero_mean = CrossFit(group)
    with np.errstate(invalid="ignore", divide="ignore"):
        for a in range(0, P, block):
            b = min(P, a + block)
            S = np.asarray(read(a, b), dtype=np.float64)  # (N, b)
            # 1. the zero-mean test's sums of this block
            zero_mean.add(S)
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
        "zero_mean": zero_mean.statistics(),
    }
