"""Fisher, covariance and alignment of the score, from mergeable float64 moments.

The score stage reduces each batch of b samples to one *moment row*: the sample count, the mean and
centered sum of squares of the advantage, and for every parameter the mean score, the centered sum of
squares ``m2_s = Σ(s − mean_s)²`` and the centered co-moment ``c_as = Σ(a − mean_a)(s − mean_s)``.
Rows merge with Chan's parallel formulas, so any grouping of samples into batches gives the same
statistics up to float64 rounding, and a dask tree reduction over the batch axis never holds more
than a few rows per parameter chunk.

All estimators divide by N (DESIGN.md §1): m = mean(s), F = mean(s²), Fvar = Var(s), G = mean(A·s),
Cov = Cov(A, s), std_A, and rho = Cov / (std_A·sqrt(Fvar)).

Numerics: every accumulation is float64. Within a block the scores are shifted by the block's first
row before squaring, so the raw sums never cancel (a large mean relative to the spread costs no
accuracy), and a constant column gives exactly zero variance.

Functions accept numpy arrays (computed at once) or dask arrays (returned lazily; compute them with
the threaded scheduler or under a ``distributed.Client``). ``blocked_stats`` is the stats stage's whole
reduction: it reads the moments in blocks along P, writes the (P,) statistics block by block and returns
the scalars (``adv_rms``, the cross-fit counts), the per-tensor summaries and the findings
(``degenerate``, ``crossfit_gap``).

Shape notation: N samples, nb moment rows (batches), P parameter elements on the flat axis.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from covgrad.layout import ParamLayout
from covgrad.lazy import LazyModule, is_dask
from covgrad.moments.numerics import dot64, sum64
from covgrad.moments.topk import Values, overlap_table

Array = Any  # numpy.ndarray or dask.array.Array
da = LazyModule("dask.array")  # imported when a dask array is given

BOUND_RTOL = 1e-6  # relative slack of the in-sample bound check (float64 rounding is ~1e-15)
PARAM_STATS = ("m", "F", "Fvar", "G", "Cov", "rho")  # the (P,) statistics of compute_stats a stats store keeps
BLOCK_OUTPUTS = (*PARAM_STATS, "crossfit_ratio")  # the (P,) outputs of blocked_stats
BLOCK_CHUNKS = 64  # param chunks per block of the blocked reads of (P,) arrays: 4M parameters, 32 MB of float64
OVERLAP_Q = 0.01  # the q of the ``overlap_1pct`` scalar

# Row order of the packed (nb, 6, P) float64 representation used by the reductions; the three
# per-batch scalars are broadcast along P so that one array carries a whole moment row.
_MEAN_S, _M2_S, _C_AS, _COUNT, _MEAN_A, _M2_A = range(6)


@dataclass(frozen=True)
class Moments:
    """Per-batch moment rows (the score stage's output format), numpy or dask, float64.

    Attributes:
        count: shape (nb,), samples per row (≥ 1).
        mean_a: shape (nb,), mean advantage of the row.
        m2_a: shape (nb,), Σ(a − mean_a)² over the row.
        mean_s: shape (nb, P), mean score.
        m2_s: shape (nb, P), Σ(s − mean_s)².
        c_as: shape (nb, P), Σ(a − mean_a)(s − mean_s).
    """

    count: Array
    mean_a: Array
    m2_a: Array
    mean_s: Array
    m2_s: Array
    c_as: Array
    _packed: Array | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        nb, P = self.mean_s.shape
        for name in ("m2_s", "c_as"):
            if getattr(self, name).shape != (nb, P):
                raise ValueError(
                    f"Moments.{name} has shape {getattr(self, name).shape}; expected {(nb, P)} like mean_s"
                )
        for name in ("count", "mean_a", "m2_a"):
            if getattr(self, name).shape != (nb,):
                raise ValueError(f"Moments.{name} has shape {getattr(self, name).shape}; expected {(nb,)}")
        if not is_dask(self.count) and np.any(np.asarray(self.count) < 1):
            raise ValueError(f"Moments.count has rows with fewer than 1 sample: {np.asarray(self.count)}")

    @property
    def P(self) -> int:
        """Number of parameter elements."""
        return self.mean_s.shape[1]

    @classmethod
    def from_packed(cls, packed: Array) -> Moments:
        """Moments viewing a packed (nb, 6, P) float64 array (see ``packed``)."""
        return cls(
            count=packed[:, _COUNT, 0],
            mean_a=packed[:, _MEAN_A, 0],
            m2_a=packed[:, _M2_A, 0],
            mean_s=packed[:, _MEAN_S],
            m2_s=packed[:, _M2_S],
            c_as=packed[:, _C_AS],
            _packed=packed,
        )

    def packed(self) -> Array:
        """The rows as one (nb, 6, P) float64 array: mean_s, m2_s, c_as, then the scalars along P."""
        if self._packed is not None:
            return self._packed
        nb, P = self.mean_s.shape
        if is_dask(self.count, self.mean_a, self.m2_a, self.mean_s, self.m2_s, self.c_as):
            chunks = da.asarray(self.mean_s).chunks

            def row(x: Array) -> da.Array:
                return da.asarray(x).astype(np.float64).rechunk(chunks)

            def scalar(x: Array) -> da.Array:
                col = da.asarray(x).astype(np.float64).rechunk((chunks[0],))[:, None]  # (nb, 1)
                return da.broadcast_to(col, (nb, P), chunks=chunks)

            parts = [row(self.mean_s), row(self.m2_s), row(self.c_as)]
            parts += [scalar(self.count), scalar(self.mean_a), scalar(self.m2_a)]
            return da.stack(parts, axis=1).rechunk({1: 6})  # (nb, 6, P), one chunk along the 6
        parts = [np.asarray(x, dtype=np.float64) for x in (self.mean_s, self.m2_s, self.c_as)]
        parts += [
            np.broadcast_to(np.asarray(x, dtype=np.float64)[:, None], (nb, P))
            for x in (self.count, self.mean_a, self.m2_a)
        ]
        return np.stack(parts, axis=1)  # (nb, 6, P)

    def subset(self, rows: np.ndarray) -> Moments:
        """The moment rows selected by ``rows`` (bool mask (nb,) or integer indices), e.g. one half."""
        rows = np.asarray(rows)
        return Moments(
            self.count[rows], self.mean_a[rows], self.m2_a[rows], self.mean_s[rows], self.m2_s[rows], self.c_as[rows]
        )


def _block_moments(s: np.ndarray, a: np.ndarray) -> np.ndarray:
    """One packed moment row (1, 6, Pc) from a block of scores s (n, Pc) and advantages a (n,)."""
    n = s.shape[0]
    a = np.asarray(a, dtype=np.float64)
    ra = a - a[0]
    mean_a = a[0] + ra.sum() / n
    ac = ra - ra.sum() / n  # (n,) a − mean_a
    d = s.astype(np.float64)  # (n, Pc)
    first = d[0].copy()  # (Pc,)
    d -= first  # shift by the first row (in float64) so that the squares below do not cancel
    # numpy loops, not BLAS: BLAS threads inside dask threads oversubscribe the cores
    sum_d = d.sum(axis=0)  # (Pc,)
    dot_a = np.einsum("i,ij->j", ac, d)  # (Pc,)
    out = np.empty((1, 6, s.shape[1]))
    out[0, _MEAN_S] = first + sum_d / n
    # Σd² ≥ (Σd)²/n exactly; the clip only removes rounding below zero
    out[0, _M2_S] = np.maximum(np.einsum("ij,ij->j", d, d) - sum_d * sum_d / n, 0.0)
    out[0, _C_AS] = dot_a - sum_d * (ac.sum() / n)  # the second term removes Σ(a − mean_a)'s rounding
    out[0, _COUNT] = n
    out[0, _MEAN_A] = mean_a
    out[0, _M2_A] = dot64(ac, ac)
    return out


def sample_moments(S: Array, A: Array, *, block_rows: int | None = None) -> Moments:
    """Moment rows of per-sample scores, one row per block of consecutive samples.

    Args:
        S: per-sample scores, shape (N, P), float32 or float64, numpy or dask.
        A: advantages, shape (N,), numpy or dask.
        block_rows: samples per moment row. Default: each row chunk of a dask ``S`` (its write
            batch), or all N samples of a numpy ``S``.

    Returns:
        Moments with one row per block; lazy (dask) when ``S`` is a dask array.

    Raises:
        ValueError: on mismatched shapes or a non-positive ``block_rows``.
    """
    if S.ndim != 2:
        raise ValueError(f"S must have shape (N, P); got shape {S.shape}")
    N = S.shape[0]
    if A.shape != (N,):
        raise ValueError(f"A must have shape ({N},) to match S {S.shape}; got {A.shape}")
    if N < 1:
        raise ValueError("S has no samples (N = 0); pass at least one row")
    if block_rows is not None and block_rows < 1:
        raise ValueError(f"block_rows must be ≥ 1; got {block_rows}")
    if is_dask(S):
        if block_rows is not None:
            S = S.rechunk({0: block_rows})
        A = da.asarray(A).astype(np.float64).rechunk((S.chunks[0],))
        packed = da.blockwise(
            _block_moments,
            "bkp",
            S,
            "bp",
            A,
            "b",
            new_axes={"k": 6},
            adjust_chunks={"b": 1},
            dtype=np.float64,
            meta=np.empty((0, 0, 0)),
        )  # (nb, 6, P)
        return Moments.from_packed(packed)
    S = np.asarray(S)
    A = np.asarray(A, dtype=np.float64)
    step = N if block_rows is None else block_rows
    rows = [_block_moments(S[i : i + step], A[i : i + step]) for i in range(0, N, step)]
    return Moments.from_packed(np.concatenate(rows, axis=0))  # (nb, 6, P)


def _merge_packed(x: np.ndarray, axis: Any = None, keepdims: bool = True) -> np.ndarray:
    """Chan-merge packed rows (k, 6, Pc) into one row (1, 6, Pc); ``axis``/``keepdims`` are dask's."""
    n = x[:, _COUNT, :1]  # (k, 1)
    w = n / n.sum(axis=0)  # (k, 1)
    # shift by the first row so that equal means merge exactly (a constant column stays exact)
    ra = x[:, _MEAN_A, :1] - x[0, _MEAN_A, :1]  # (k, 1)
    shift_a = (w * ra).sum(axis=0)  # (1,)
    dA = ra - shift_a  # (k, 1) row mean − merged mean
    rs = x[:, _MEAN_S] - x[0, _MEAN_S]  # (k, Pc)
    shift_s = (w * rs).sum(axis=0)  # (Pc,)
    dS = rs - shift_s  # (k, Pc)
    out = np.empty((1, 6, x.shape[2]))
    out[0, _MEAN_S] = x[0, _MEAN_S] + shift_s
    out[0, _M2_S] = x[:, _M2_S].sum(axis=0) + (n * dS * dS).sum(axis=0)
    out[0, _C_AS] = x[:, _C_AS].sum(axis=0) + (n * dA * dS).sum(axis=0)
    out[0, _COUNT] = n.sum()
    out[0, _MEAN_A] = x[0, _MEAN_A, 0] + shift_a[0]
    out[0, _M2_A] = x[:, _M2_A, 0].sum() + (n * dA * dA).sum()
    return out


def _rows(x: np.ndarray, axis: Any = None, keepdims: bool = True) -> np.ndarray:
    """Leave a block's rows as they are; the tree's combine steps merge them."""
    return x


def merge_moments(moments: Moments, *, split_every: int | None = None) -> Moments:
    """Merge all moment rows into one (Chan's parallel formulas, float64).

    Args:
        moments: nb ≥ 1 rows.
        split_every: rows merged per task of the dask tree reduction (dask's default if None).

    Returns:
        Moments with nb = 1; lazy for dask input (a tree reduction over the batch axis).
    """
    packed = moments.packed()
    if is_dask(packed):
        merged = da.reduction(
            packed,
            chunk=_rows,
            combine=_merge_packed,
            aggregate=_merge_packed,
            axis=0,
            keepdims=True,
            dtype=np.float64,
            split_every=split_every,
            concatenate=True,
            meta=np.empty((0, 0, 0)),
        )  # (1, 6, P)
        return Moments.from_packed(merged)
    return Moments.from_packed(_merge_packed(packed))


def _checked_count(n: np.ndarray) -> np.ndarray:
    if not n >= 2:
        raise ValueError(f"the moments hold N = {n} samples; the statistics need N ≥ 2")
    return n


def _std_a(m2_a: np.ndarray, n: np.ndarray) -> np.ndarray:
    std = np.sqrt(m2_a / n)
    if std == 0:
        warnings.warn(
            "std(A) = 0 (every advantage is equal): rho is undefined (NaN) and Cov = 0",
            RuntimeWarning,
            stacklevel=2,
        )
    return std


class _Core(NamedTuple):
    N: Array  # () float64
    mean_A: Array  # ()
    std_A: Array  # ()
    m: Array  # (P,)
    Fvar: Array  # (P,)
    Cov: Array  # (P,)


def _finalize(moments: Moments) -> _Core:
    """N, mean_A, std_A, m, Fvar, Cov of all rows; N < 2 raises (at compute time for dask)."""
    merged = merge_moments(moments)
    N, mean_A, m2_a = merged.count[0], merged.mean_a[0], merged.m2_a[0]
    if is_dask(N):
        meta = np.array(0.0)
        N = da.map_blocks(_checked_count, N, dtype=np.float64, meta=meta)
        std_A = da.map_blocks(_std_a, m2_a, N, dtype=np.float64, meta=meta)
    else:
        N = _checked_count(N)
        std_A = _std_a(m2_a, N)
    return _Core(N, mean_A, std_A, merged.mean_s[0], merged.m2_s[0] / N, merged.c_as[0] / N)


def _safe_ratio(xp: Any, num: Array, den: Array) -> Array:
    """num / den where den > 0, NaN elsewhere (no division warnings, never inf)."""
    ok = den > 0
    return xp.where(ok, num / xp.where(ok, den, 1.0), np.nan)


COORD_CAP = 9.0
"""The most one coordinate's t_i² = N·m_i²/Var_i weighs in the zero-mean test's coordinate metric (|t_i| = 3).

Why a cap: at finite N a coordinate whose mean is carried by an event the sample lacks (the LM-head row of a token
that was never drawn; a weight whose score is dominated by one rare response) has a nonzero m_i and a small Var_i
although E[s_i] = 0, so its t_i² is large (on the demo the LM-head rows of the five never-drawn tokens average 36–41
over fresh data sets), exactly as a biased coordinate's is, and nothing built from the sample can add the event it
lacks. The cross-fit test (``covgrad.report.uncertainty``) weighs coordinate i by 1 / max(Var_i, N·m_i² / 9), so such
a coordinate adds at most about 9 / N to the cross term, while a centring error still lifts most coordinates' terms
(each by about b_i²/Var_i for a bias b_i, up to the cap)."""


def coord_t2_sums(N: float, m: np.ndarray, var: np.ndarray, varies: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The two parts of N·Σ_i m_i² / var_i over the coordinates that vary: below and above ``COORD_CAP``.

    Args:
        N: samples the means are over.
        m: (..., b) mean score of each coordinate.
        var: (..., b) its variance (1/N).
        varies: (..., b) bool, the coordinates that count (var_i > 0, or above a rounding floor).

    Returns:
        Σ_i min(t_i², COORD_CAP) and Σ_i (t_i² − COORD_CAP)⁺ over the last axis, t_i² = N·m_i²/var_i, each (...,)
        float64; their sum is Σ_i t_i², the sum of ``zero_mean_coord``.
    """
    t2 = np.where(varies, N * m * m / np.where(varies, var, 1.0), 0.0)
    capped = np.minimum(t2, COORD_CAP)
    return capped.sum(axis=-1), (t2 - capped).sum(axis=-1)


def compute_stats(moments: Moments) -> dict[str, Array]:
    """Score statistics of all moment rows (DESIGN.md §1), lazily for dask input.

    Args:
        moments: nb ≥ 1 rows totalling N ≥ 2 samples.

    Returns:
        A dict (numpy for numpy input, lazy dask otherwise) with
        ``N`` () int64; ``mean_A``, ``std_A`` () float64 (1/N);
        ``m`` mean score, ``F`` = mean(s²), ``Fvar`` = Var(s), ``G`` = mean(A·s), ``Cov`` = Cov(A, s),
        ``rho`` = Cov / (std_A·sqrt(Fvar)) (NaN where std_A = 0 or Fvar = 0): each (P,) float64;
        ``rho_undefined`` () bool (std_A = 0); ``bound_violations`` () int64, the coordinates with
        |Cov| > std_A·sqrt(Fvar)·(1 + 1e-6) (0 by Cauchy–Schwarz); ``zero_mean_trace`` =
        N·‖m‖² / tr Var(s) and ``zero_mean_coord`` = mean over Fvar > 0 of N·m_i²/Fvar_i, () float64,
        both ≈ 1 for a zero-mean score (NaN when no coordinate varies).

    Raises:
        ValueError: N < 2 (for dask input, when the result is computed).

    Warns:
        RuntimeWarning: std_A = 0 (for dask input, when std_A or rho is computed).
    """
    c = _finalize(moments)
    xp = da if is_dask(c.m) else np
    m, Fvar, Cov = c.m, c.Fvar, c.Cov
    bound = c.std_A * xp.sqrt(Fvar)  # (P,)
    varies = Fvar > 0  # (P,)
    n_varies = varies.sum()
    zm_coord = xp.where(varies, c.N * m * m / xp.where(varies, Fvar, 1.0), 0.0).sum()
    return {
        "N": c.N.astype(np.int64),
        "mean_A": c.mean_A,
        "std_A": c.std_A,
        "m": m,
        "F": Fvar + m * m,
        "Fvar": Fvar,
        "G": Cov + c.mean_A * m,
        "Cov": Cov,
        "rho": _safe_ratio(xp, Cov, bound),
        "rho_undefined": c.std_A == 0,
        "bound_violations": (abs(Cov) > bound * (1 + BOUND_RTOL)).sum(),
        "zero_mean_trace": _safe_ratio(xp, c.N * (m * m).sum(), Fvar.sum()),
        "zero_mean_coord": _safe_ratio(xp, zm_coord, n_varies),
    }


def crossfit_stats(fisher_half: Moments, cov_half: Moments) -> dict[str, Array]:
    """Out-of-sample check of the bound: Fvar from one half of the prompt groups, Cov from the other.

    ratio_i = |Cov_i| / (std_A·sqrt(Fvar_i)) with Cov and std_A from ``cov_half`` and Fvar from
    ``fisher_half``. In-sample the ratio never exceeds 1; here it may. Swap the arguments for the
    other direction.

    Args:
        fisher_half: moment rows of one half (e.g. even prompt groups), P parameters.
        cov_half: moment rows of the other half, same P.

    Returns:
        ``ratio`` (P,) float64 (inf where Fvar = 0 but Cov ≠ 0, NaN where both are 0 or std_A = 0);
        ``n_finite``, ``n_exceed`` (finite ratios > 1), ``n_inf`` () int64; ``frac_exceed`` =
        n_exceed / n_finite () float64 (NaN when no ratio is finite). Lazy for dask input.

    Raises:
        ValueError: the halves have different P, or a half has N < 2.
    """
    if fisher_half.P != cov_half.P:
        raise ValueError(f"the halves have different P: {fisher_half.P} (Fisher) vs {cov_half.P} (Cov)")
    f = _finalize(fisher_half)
    c = _finalize(cov_half)
    xp = da if is_dask(f.Fvar, c.Cov) else np
    num = abs(c.Cov)  # (P,)
    den = c.std_A * xp.sqrt(f.Fvar)  # (P,)
    ratio = xp.where(den > 0, num / xp.where(den > 0, den, 1.0), xp.where(num > 0, np.inf, np.nan))
    finite = xp.isfinite(ratio)
    n_finite = finite.sum()
    n_exceed = (finite & (ratio > 1)).sum()
    return {
        "ratio": ratio,
        "n_finite": n_finite,
        "n_exceed": n_exceed,
        "n_inf": xp.isinf(ratio).sum(),
        "frac_exceed": _safe_ratio(xp, n_exceed.astype(np.float64), n_finite),
    }


def tensor_summary(stats: dict[str, Array], layout: ParamLayout) -> dict[str, Array]:
    """Per-tensor sums, means and shares of F, Fvar, |G| and the largest |rho|.

    Args:
        stats: ``compute_stats`` output (uses F, Fvar, G, rho; each (P,)).
        layout: the flat parameter axis; row t of every output is ``layout.entries[t]``.

    Returns:
        Arrays of shape (n_tensors,): ``numel`` int64; ``F_sum``, ``F_mean``, ``Fvar_sum``, ``Fvar_mean``,
        ``absG_sum``, ``absG_mean``, ``max_abs_rho`` (NaN when all of a tensor's rho are NaN),
        ``F_share`` = F_sum / Σ F and ``absG_share`` = absG_sum / Σ|G| (NaN when the total is 0),
        float64. Lazy for dask input.

    Raises:
        ValueError: the layout's P differs from the arrays' length.
    """
    F = stats["F"]
    if F.shape != (layout.P,):
        raise ValueError(f"stats arrays have shape {F.shape} but the layout has P = {layout.P}")
    xp = da if is_dask(F, stats["G"], stats["rho"]) else np
    absG = abs(stats["G"])
    abs_rho = xp.where(xp.isnan(stats["rho"]), -np.inf, abs(stats["rho"]))  # (P,) NaN never wins a max
    slices = [slice(e.offset, e.offset + e.numel) for e in layout.entries]
    numel = np.array([e.numel for e in layout.entries], dtype=np.int64)

    def per_tensor(x: Array) -> Array:
        return xp.stack([x[s].sum() for s in slices])  # (n_tensors,)

    max_rho = xp.stack([abs_rho[s].max() if s.stop > s.start else xp.asarray(-np.inf) for s in slices])
    out = {"numel": numel}
    for name, x in (("F", F), ("Fvar", stats["Fvar"]), ("absG", absG)):
        total = per_tensor(x)
        out[f"{name}_sum"] = total
        out[f"{name}_mean"] = _safe_ratio(xp, total, numel)
    out["max_abs_rho"] = xp.where(max_rho == -np.inf, np.nan, max_rho)
    out["F_share"] = _safe_ratio(xp, out["F_sum"], out["F_sum"].sum())
    out["absG_share"] = _safe_ratio(xp, out["absG_sum"], out["absG_sum"].sum())
    return out


def adv_rms(mean_A: float, std_A: float) -> float:
    """√mean(A²) = √(std_A² + mean_A²) of the advantages (1/N), the scale of the bound |G_i| ≤ √mean(A²)·√F_i."""
    return math.sqrt(std_A**2 + mean_A**2)


def degenerate(N: int, any_score: bool, std_A: float) -> str | None:
    """Why the run's statistics carry no finding about G (in words), or None: fewer than two samples,
    every score 0 (no scored tokens; ``any_score`` is whether some F_i > 0), or std(A) = 0 (no reward
    variance: G ≡ 0)."""
    if N < 2:
        return f"too few samples: N = {N}, the statistics need N ≥ 2; F, G, overlap, ρ and the bound are undefined"
    if not any_score:
        return "no scored tokens: every score is 0; F, G, overlap, ρ and the bound are undefined"
    if not float(std_A) > 0:
        return "no reward variance: G ≡ 0; overlap, ρ and the bound are undefined"
    return None


def crossfit_gap(n_even: int, n_odd: int) -> str | None:
    """Why the cross-fit is undefined (a prompt-group half with fewer than two samples), or None."""
    small = [(name, n) for name, n in (("even", n_even), ("odd", n_odd)) if n < 2]
    if not small:
        return None
    name, n = small[0]
    return (
        f"cross-fit undefined: the {name} prompt groups hold N = {n} samples, each half needs N ≥ 2; "
        "give at least two prompt groups"
    )


@dataclass
class _Totals:
    """The scalars of blocked_stats that are sums, counts or maxima over parameter blocks."""

    bound_violations: int = 0
    m2_sum: float = 0.0  # Σ m_i²
    fvar_sum: float = 0.0  # Σ Fvar_i
    coord_sum: float = 0.0  # Σ m_i² / Fvar_i over Fvar_i > 0
    coord_n: int = 0  # coordinates with Fvar_i > 0
    max_rho: float = -1.0  # max |ρ_i| over finite ρ_i; −1 while there is none
    any_score: bool = False  # some F_i > 0
    nonfinite_F: int = 0  # coordinates whose F_i is NaN or ±inf
    nonfinite_G: int = 0  # coordinates whose G_i is NaN or ±inf
    n_exceed: list[int] = field(default_factory=lambda: [0, 0])  # cross-fit (even F, odd G), (odd F, even G)
    n_finite: list[int] = field(default_factory=lambda: [0, 0])

    def add(self, stats: dict[str, Any], cross: list[dict[str, Any]]) -> None:
        """Add one block's computed ``compute_stats`` and ``crossfit_stats`` (both directions, or none)."""
        m, Fvar, rho = (np.asarray(stats[k]) for k in ("m", "Fvar", "rho"))  # (b,) each
        varies = Fvar > 0
        self.any_score = self.any_score or bool((np.asarray(stats["F"]) > 0).any())
        self.nonfinite_F += int((~np.isfinite(np.asarray(stats["F"]))).sum())
        self.nonfinite_G += int((~np.isfinite(np.asarray(stats["G"]))).sum())
        self.bound_violations += int(stats["bound_violations"])
        self.m2_sum += sum64(m * m)
        self.fvar_sum += sum64(Fvar)
        self.coord_sum += sum64(m[varies] ** 2 / Fvar[varies])
        self.coord_n += int(varies.sum())
        finite = np.abs(rho[np.isfinite(rho)])
        self.max_rho = max(self.max_rho, float(finite.max()) if finite.size else -1.0)
        for i, c in enumerate(cross):
            self.n_exceed[i] += int(c["n_exceed"])
            self.n_finite[i] += int(c["n_finite"])


@dataclass(frozen=True)
class BlockedStats:
    """What blocked_stats returns besides the (P,) arrays it writes.

    Attributes:
        scalars: N, mean_A, std_A, rho_undefined, bound_violations, zero_mean_trace, zero_mean_coord,
            max_abs_rho, adv_rms, overlap_1pct and P (NaN where undefined).
        crossfit: for each cross-fit direction ``even_F_odd_G`` and ``odd_F_even_G``,
            ``crossfit_{direction}_{n_exceed, n_finite, frac_exceed}`` (counts 0 and NaN where undefined).
        tensors: ``tensor_summary`` of the written arrays, (n_tensors,) each.
        degenerate: ``degenerate``'s finding, or None.
        crossfit_undefined: ``crossfit_gap``'s reason, or None.
    """

    scalars: dict[str, Any]
    crossfit: dict[str, Any]
    tensors: dict[str, np.ndarray]
    degenerate: str | None
    crossfit_undefined: str | None

    @property
    def notes(self) -> list[str]:
        """The findings to report: the degenerate condition, else the cross-fit gap (none when neither)."""
        note = self.degenerate or self.crossfit_undefined
        return [note] if note else []


def blocked_stats(
    read: Callable[[slice, bool], tuple[Moments, ...]],
    counts: tuple[int, int, int],
    layout: ParamLayout,
    out: Mapping[str, Array],
    *,
    chunk: int,
    where: str = "the moments",
) -> BlockedStats:
    """All statistics of a run, reduced in blocks along the parameter axis, so memory is bounded by a
    block (``BLOCK_CHUNKS`` chunks), not P, except the overlap at ``OVERLAP_Q`` (it ranks F and |G|).

    The (P,) statistics are elementwise in the parameter, so blocks give exactly the whole-P values; the
    scalars are sums, counts and maxima over blocks. With N < 2 every statistic is undefined: the arrays
    are NaN and nothing is read. Degenerate runs are findings (``degenerate``, ``crossfit_gap``), not
    errors. Lazy moments are computed with dask's current scheduler (threads, or a distributed client).

    Args:
        read: ``read(cols, halves)``, the moments of the parameters ``cols`` (a block of whole chunks):
            (all samples,) or, with ``halves``, (all, even prompt groups, odd prompt groups), numpy or dask.
            Called with ``halves`` only when both halves hold N ≥ 2.
        counts: N, and the samples of the even and of the odd prompt-group halves.
        layout: the flat parameter axis, P = ``layout.P``.
        out: (P,) float64 arrays chunked by ``chunk`` (numpy, or a store's arrays), one for each name of
            ``BLOCK_OUTPUTS``: filled block by block, then read back for the per-tensor summaries.
        chunk: the outputs' chunk length along P.
        where: what the moments are, for the error (the stats stage names its scores artifact).

    Returns:
        The scalars, cross-fit counts, per-tensor summaries and findings (``BlockedStats``).

    Raises:
        ValueError: naming ``where`` and how many coordinates, when N ≥ 2 and some F_i or G_i is NaN or ±inf
            (non-finite scores: a non-finite weight or log-prob, or an overflow); checked once every block is
            written, before anything is ranked or summarised.
    """
    N, n_even, n_odd = counts
    P = layout.P
    gap = crossfit_gap(n_even, n_odd)
    block = chunk * BLOCK_CHUNKS
    nan = float("nan")
    totals = _Totals()
    first: dict[str, Any] = {}  # the first block's statistics: N, mean_A, std_A and rho_undefined are global
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # std(A) = 0 is reported as a finding, below
        for j in range(0, max(P, 1), block):
            # 1. Read the block's moments and reduce them: the statistics and both cross-fit directions
            #    (with N < 2 nothing is read and the block is NaN)
            cols = slice(j, min(P, j + block))
            if N < 2:
                for name in BLOCK_OUTPUTS:
                    out[name][cols] = np.full(cols.stop - cols.start, nan)
                continue
            full, *halves = read(cols, gap is None)
            lazy_cross = [crossfit_stats(*halves), crossfit_stats(*halves[::-1])] if halves else []
            stats, *cross = da.compute(compute_stats(full), *lazy_cross)
            # 2. Write the block's (param,) statistics
            for name in PARAM_STATS:
                out[name][cols] = np.asarray(stats[name], dtype=np.float64)
            ratio = cross[0]["ratio"] if cross else np.full(cols.stop - cols.start, nan)
            out["crossfit_ratio"][cols] = np.asarray(ratio, dtype=np.float64)
            # 3. Add the block to the totals
            first = first or stats
            totals.add(stats, cross)
        if totals.nonfinite_F or totals.nonfinite_G:
            raise ValueError(
                f"{where}: F is NaN or inf at {totals.nonfinite_F} and G at {totals.nonfinite_G} of P = {P} "
                "coordinates, so no statistics are served; check the policy's weights and the sampler's log-probs, "
                "or set scores.state_dtype float64 if the scores overflow float32"
            )
        # 4. Per-tensor summaries of the written arrays
        stored = {k: da.from_array(out[k], chunks=(chunk,)) for k in ("F", "Fvar", "G", "rho")}
        (summary,) = da.compute(tensor_summary(stored, layout))
    # 5. The findings, and the overlap of the top sets by |G| and by F when G is defined

    finding = degenerate(N, totals.any_score, float(first.get("std_A", nan)))
    abs_G = Values(lambda a, b: np.abs(np.asarray(out["G"][a:b])), P)  # read in blocks: never (P,) in memory
    overlap = [] if finding else overlap_table(out["F"], abs_G, layout, [OVERLAP_Q])
    # 6. The scalars
    if first:
        scalars: dict[str, Any] = {k: np.asarray(first[k]).item() for k in ("N", "mean_A", "std_A", "rho_undefined")}
    else:
        scalars = {"N": N, "mean_A": nan, "std_A": nan, "rho_undefined": True}
    scalars["bound_violations"] = totals.bound_violations
    scalars["zero_mean_trace"] = N * totals.m2_sum / totals.fvar_sum if totals.fvar_sum > 0 else nan
    scalars["zero_mean_coord"] = N * totals.coord_sum / totals.coord_n if totals.coord_n else nan
    scalars["max_abs_rho"] = totals.max_rho if totals.max_rho >= 0 else nan
    scalars["adv_rms"] = adv_rms(scalars["mean_A"], scalars["std_A"])
    scalars["overlap_1pct"] = next((float(r["overlap"]) for r in overlap if r["scope"] == "global"), nan)
    scalars["P"] = P
    crossfit: dict[str, Any] = {}
    for tag, n_exceed, n_finite in zip(("even_F_odd_G", "odd_F_even_G"), totals.n_exceed, totals.n_finite, strict=True):
        crossfit[f"crossfit_{tag}_n_exceed"] = n_exceed
        crossfit[f"crossfit_{tag}_n_finite"] = n_finite
        crossfit[f"crossfit_{tag}_frac_exceed"] = n_exceed / n_finite if n_finite else nan
    tensors = {k: np.asarray(v) for k, v in summary.items()}
    return BlockedStats(scalars, crossfit, tensors, finding, gap)


def rel_diff(blocks: Iterable[tuple[np.ndarray, np.ndarray]]) -> float:
    """‖a − b‖₂ / ‖a‖₂ of two (P,) vectors read as aligned blocks along P.

    Args:
        blocks: pairs (a_j, b_j), each of shape (n_j,), that cover P in order (any block lengths); read one
            pair at a time, so memory holds one pair, not P.

    Returns:
        The relative difference, the sums of squares accumulated in float64 over the blocks; NaN when
        ‖a‖ = 0 or an entry is NaN.
    """
    diff2 = norm2 = 0.0
    for a, b in blocks:
        a64 = np.asarray(a, dtype=np.float64)  # (n_j,)
        d = a64 - np.asarray(b, dtype=np.float64)  # (n_j,)
        diff2 += dot64(d, d)
        norm2 += dot64(a64, a64)
    return math.sqrt(diff2 / norm2) if norm2 > 0 else float("nan")
