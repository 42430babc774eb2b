"""The statistics of a regime: G and its standard error from moment rows (:func:`moment_mean_se`,
:func:`clustered_mean_se`), the bound's statistics on a block of parameters (:func:`regime_block_stats`), and
:func:`regime_stats`, the reduction of every regime fold of a run against the policy's F (the regimes stage's
computation: the stage reads the stores and writes what this returns).

Shape notation: R moment rows (row 2i + h holds prompt-group parity half h), b parameters of a block, P every
parameter element.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from covgrad.layout import ParamLayout
from covgrad.moments import OVERLAP_Q, TopSets, Values, overlap_table
from covgrad.regimes.errors import _ratio, clustered_mean_se, moment_mean_se

Array = Any  # a (P,) float64 array that slices to numpy: numpy, or a store's array
StateRows = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
"""Moment-state rows over a block of b parameters: count (R,), mean (R, b) float64, m2 (R, b) float64, half (R,)."""

REGIME_BLOCK_CHUNKS = 16  # param chunks per block of :func:`regime_stats`
REGIME_OUTPUTS = ("G", "se", "bound", "rho", "crossfit_ratio")  # (P,) arrays per regime, named f"{stat}_{regime}"


def regime_block_stats(
    G: np.ndarray,
    se: np.ndarray,
    F: np.ndarray,
    a2: float,
    G_h: np.ndarray,
    se_h: np.ndarray,
    F_h: np.ndarray,
    a2_h: np.ndarray,
    z: float = 3.0,
) -> dict[str, Any]:
    """A regime's bound statistics on one block of b parameters (docs/regimes.md, "Statistics").

    The bound is a·√F_i with a² = mean c²_n and F the policy's Fisher; outside ``rl`` on its own rollouts it
    holds in expectation, so a violation counts against a sampling allowance: |G_i| > a√F_i + z·se_i, se the
    prompt-clustered standard error (:func:`clustered_mean_se`). The cross-fit takes G and a² from half h and F
    from half 1 − h.

    Args:
        G, se, F: shape (b,) float64: the regime's gradient, its standard error, the policy's F.
        a2: the bound's a² (NaN: no bound, sft_sampled).
        G_h, se_h, F_h: shape (2, b) float64, the same per prompt-group parity half.
        a2_h: shape (2,) a² per half.
        z: standard errors of the sampling allowance.

    Returns:
        ``bound``, ``rho``, ``crossfit_ratio`` (b,) arrays (cross-fit: G even, F odd) and counts
        ``violations`` (|G| > bound·(1 + 1e-6)), ``violations_beyond`` (beyond the allowance),
        ``crossfit_exceed`` and ``crossfit_exceed_beyond`` (2,) (G from half h), ``crossfit_defined`` (2,),
        ``max_abs_rho`` (NaN when undefined).
    """
    bound = np.sqrt(a2 * F) if a2 == a2 else np.full_like(G, np.nan)
    rho = _ratio(G, bound)
    out: dict[str, Any] = {"bound": bound, "rho": rho}
    absG = np.abs(G)
    out["violations"] = int(np.count_nonzero(absG > bound * (1 + 1e-6)))
    out["violations_beyond"] = int(np.count_nonzero(absG > bound + z * se))
    ex, exb, defined = (np.zeros(2, np.int64) for _ in range(3))
    ratios = []
    for h in (0, 1):
        b_cf = np.sqrt(a2_h[h] * F_h[1 - h]) if a2_h[h] == a2_h[h] else np.full_like(G, np.nan)
        r = _ratio(np.abs(G_h[h]), b_cf)
        ratios.append(r)
        ok = r == r
        defined[h] = int(np.count_nonzero(ok))
        ex[h] = int(np.count_nonzero(r[ok] > 1))
        exb[h] = int(np.count_nonzero(np.abs(G_h[h]) > b_cf + z * se_h[h]))
    out["crossfit_ratio"] = ratios[0]
    out["crossfit_exceed"], out["crossfit_exceed_beyond"], out["crossfit_defined"] = ex, exb, defined
    finite = np.abs(rho[rho == rho])
    out["max_abs_rho"] = float(finite.max()) if finite.size else float("nan")
    return out


@dataclass(frozen=True)
class GroupRows:
    """A regime fold's group moment rows over a block of b parameters
    (:class:`covgrad.moments.accum.GroupAccumulator`: each prompt group's sum S_c of g_n folded as one sample whose
    advantage is its size n_c).

    Attributes:
        count, mean_a, m2_a: shape (R,): groups, mean group size and Σ(n_c − n̄)² per row.
        mean, m2: shape (R, b) float64: mean(S_c) and Σ(S_c − mean)² per row.
        c: shape (R, b) float64 Σ(n_c − n̄)(S_c − mean) per row; None for groups of one size.
        half: shape (R,) each row's prompt-group parity half.
    """

    count: np.ndarray
    mean_a: np.ndarray
    m2_a: np.ndarray
    mean: np.ndarray
    m2: np.ndarray
    c: np.ndarray | None
    half: np.ndarray


def regime_halves(rows: GroupRows) -> list[tuple[np.ndarray, np.ndarray, float, float]]:
    """A regime's G and its prompt-clustered standard error (:func:`clustered_mean_se`), each (b,) float64 (se NaN
    with fewer than 2 groups), its number of samples N and of prompt groups C: of all rows, then of each half."""
    out = []
    for sel in (rows.half >= 0, rows.half == 0, rows.half == 1):
        c = None if rows.c is None else rows.c[sel]
        G, se, C = clustered_mean_se(rows.count[sel], rows.mean_a[sel], rows.m2_a[sel], rows.mean[sel], rows.m2[sel], c)
        out.append((G, se, float((rows.count[sel] * rows.mean_a[sel]).sum()), C))
    return out


HeadSums = tuple[slice, np.ndarray, np.ndarray]
"""Where a fold's LM-head token-Fisher sums meet a block: the slice of the block they cover, the sums (2, b′) per
half and the samples per half (2,) float64."""


@dataclass(frozen=True)
class RegimeFold:
    """How :func:`regime_stats` reads one regime fold.

    Attributes:
        rows: ``rows(cols)``, the fold's group moment rows over the parameters ``cols``.
        head: ``head(cols)``, the fold's LM-head token-Fisher sums on ``cols`` (None when the fold has none or
            they miss ``cols``).
        a2: the bound's a² over all samples, and per half (NaN: no bound scalar).
    """

    rows: Callable[[slice], GroupRows]
    head: Callable[[slice], HeadSums | None]
    a2: tuple[float, Sequence[float]]


@dataclass(frozen=True)
class RegimeStats:
    """What :func:`regime_stats` returns beside the (P,) arrays it writes.

    Attributes:
        regimes: per regime, its summary: ``N``, ``groups``, ``a2``, ``norm_G``, ``violations``,
            ``violations_beyond_allowance`` (None with fewer than 2 groups), ``crossfit_frac_exceed_G_even`` and
            ``_odd``, ``crossfit_beyond_allowance`` (None with fewer than 2 groups in a half), ``max_abs_rho`` and
            ``abs_rho_median``, ``_q90``, ``_q99`` (NaN where ρ is undefined everywhere).
        overlap: per regime, the rows of :func:`covgrad.moments.topk.overlap_table` of top |G| against top F.
        tensors: per regime and tensor, its share of the top-q sets by |G| and by F (q the one of ``qs`` nearest
            ``OVERLAP_Q``) and of the parameters.
        pairs: per pair of regimes (a, b), the cosine of their G and the overlap rows of top |G_a| against top
            |G_b|.
    """

    regimes: dict[str, dict[str, Any]]
    overlap: list[dict[str, Any]]
    tensors: list[dict[str, Any]]
    pairs: list[dict[str, Any]]


@dataclass
class _Totals:
    """One regime's block statistics over the blocks read so far, and its N and C (all, per half)."""

    violations: int = 0
    violations_beyond: int = 0
    exceed: np.ndarray = field(default_factory=lambda: np.zeros(2))
    exceed_beyond: np.ndarray = field(default_factory=lambda: np.zeros(2))
    defined: np.ndarray = field(default_factory=lambda: np.zeros(2))
    max_rho: float = math.nan
    N: float = 0.0
    C: tuple[float, ...] = (0.0, 0.0, 0.0)

    def add(self, out: dict[str, Any]) -> None:
        """Add one block's :func:`regime_block_stats` counts (NaN ρ maxima: undefined in every block)."""
        self.violations += out["violations"]
        self.violations_beyond += out["violations_beyond"]
        self.exceed += out["crossfit_exceed"]
        self.exceed_beyond += out["crossfit_exceed_beyond"]
        self.defined += out["crossfit_defined"]
        self.max_rho = float(np.fmax(self.max_rho, out["max_abs_rho"]))

    def summary(self, a2: float, rho: np.ndarray, G: np.ndarray) -> dict[str, Any]:
        """The regime's summary (:class:`RegimeStats`) from these totals, its (P,) ρ and its (P,) G."""
        rho = np.abs(rho)
        rho = rho[rho == rho]
        q50, q90, q99 = (float(np.quantile(rho, q)) if rho.size else math.nan for q in (0.5, 0.9, 0.99))
        return {
            "N": int(self.N),
            "groups": int(self.C[0]),
            "a2": a2,
            "norm_G": float(np.sqrt(np.sum(G**2))),
            "violations": self.violations,
            "violations_beyond_allowance": self.violations_beyond if self.C[0] >= 2 else None,
            "crossfit_frac_exceed_G_even": float(self.exceed[0] / max(self.defined[0], 1)),
            "crossfit_frac_exceed_G_odd": float(self.exceed[1] / max(self.defined[1], 1)),
            "crossfit_beyond_allowance": int(self.exceed_beyond.sum()) if min(self.C[1:]) >= 2 else None,
            "max_abs_rho": self.max_rho,
            "abs_rho_median": q50,
            "abs_rho_q90": q90,
            "abs_rho_q99": q99,
        }


def _uncentred(g: np.ndarray, se: np.ndarray, n: float) -> np.ndarray:
    """The uncentred mean(s²) from the mean and its standard error: Σ(s − m)²/N + m²."""
    return se * se * (n - 1) + g * g


def _policy_fisher(rows: StateRows) -> tuple[np.ndarray, np.ndarray]:
    """The policy's F on a block from its score moment rows: of all samples (b,) and per half (2, b), float64."""
    count, mean, m2, half = rows
    main = [moment_mean_se(count, mean, m2)] + [
        moment_mean_se(count[half == h], mean[half == h], m2[half == h]) for h in (0, 1)
    ]
    return _uncentred(*main[0]), np.stack([_uncentred(*main[1 + h]) for h in (0, 1)])


def _bound_fisher(head: HeadSums | None, F: np.ndarray, F_h: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The F of a regime's bound on a block: the policy's F (b,) and per half F_h (2, b), but where the fold holds
    the LM head's token-Fisher sums (a full-distribution regime) their mean at the fold's own rows, with which
    the bound holds in-sample exactly."""
    if head is None:
        return F, F_h
    at, sums, n = head
    with np.errstate(invalid="ignore", divide="ignore"):
        per_half = sums / n[:, None]
    tok = sums.sum(0) / n.sum()
    F, F_h = F.copy(), F_h.copy()
    F[at], F_h[:, at] = tok, per_half
    return F, F_h


def _abs(arr: Array) -> Values:
    """|arr| of a (P,) array, read in blocks."""
    return Values(lambda a, b: np.abs(arr[a:b]), arr.shape[0])


def _shares(out: Mapping[str, Array], names: Sequence[str], layout: ParamLayout, q: float) -> list[dict[str, Any]]:
    """Per regime and tensor: the tensor's share of the top-q sets by |G| and by F, and of the parameters."""
    P = layout.P
    top_F = TopSets(Values(lambda a, b: out["F"][a:b], P), layout, [q])
    for _ in top_F.sweep():
        pass
    rows = []
    for name in names:
        top = TopSets(_abs(out[f"G_{name}"]), layout, [q])
        for _ in top.sweep():
            pass
        total, total_F = max(int(top.counts["global"][0].sum()), 1), max(int(top_F.counts["global"][0].sum()), 1)
        for e, n, nf in zip(
            layout.entries, top.counts["global"][0].tolist(), top_F.counts["global"][0].tolist(), strict=True
        ):
            rows.append(
                {
                    "regime": name,
                    "tensor": e.name,
                    "q": q,
                    "share_topG": n / total,
                    "share_topF": nf / total_F,
                    "numel_share": e.numel / P,
                }
            )
    return rows


def _pairs(
    out: Mapping[str, Array], names: Sequence[str], layout: ParamLayout, qs: Sequence[float]
) -> list[dict[str, Any]]:
    """Per pair of regimes (a, b): the cosine of their G and the overlap rows of top |G_a| against top |G_b|."""
    rows = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            Ga, Gb = out[f"G_{a}"][:], out[f"G_{b}"][:]
            den = float(np.linalg.norm(Ga) * np.linalg.norm(Gb))
            cosine = float(Ga @ Gb / den) if den > 0 else math.nan
            for row in overlap_table(_abs(out[f"G_{b}"]), _abs(out[f"G_{a}"]), layout, qs):
                rows.append({"a": a, "b": b, "cosine": cosine, **row})
    return rows


def regime_stats(
    main: Callable[[slice], StateRows],
    folds: Mapping[str, RegimeFold],
    layout: ParamLayout,
    out: Mapping[str, Array],
    *,
    chunk: int,
    qs: Sequence[float],
    z: float,
) -> RegimeStats:
    """Every regime's G, its bound, ρ, violations and cross-fit against the policy's F, reduced in blocks along
    the parameter axis (``REGIME_BLOCK_CHUNKS`` chunks), then the overlap with top-q F, each tensor's share of
    the top sets and the cross-regime comparison (docs/regimes.md, "Statistics").

    The (P,) statistics are elementwise in the parameter, so blocks give exactly the whole-P values; the counts
    are sums and the maxima maxima over blocks.

    Args:
        main: ``main(cols)``, the policy scores' moment-state rows over the parameters ``cols``.
        folds: per regime name, how to read its fold.
        layout: the flat parameter axis, P = ``layout.P``.
        out: (P,) float64 arrays chunked by ``chunk``, ``F`` and ``{stat}_{regime}`` for each stat of
            ``REGIME_OUTPUTS``: filled block by block, then read back for the tables.
        chunk: the outputs' chunk length along P.
        qs: the top-set fractions of the overlap tables.
        z: standard errors of the sampling allowance (:func:`regime_block_stats`).

    Returns:
        The per-regime summaries and the overlap, tensor-share and pairwise tables (:class:`RegimeStats`).
    """
    P, step = layout.P, chunk * REGIME_BLOCK_CHUNKS
    totals = {name: _Totals() for name in folds}
    for a in range(0, P, step):
        # 1. The policy's F on the block, of all samples and per half
        cols = slice(a, min(P, a + step))
        F, F_h = _policy_fisher(main(cols))
        out["F"][cols] = F
        for name, fold in folds.items():
            # 2. The regime's G and its prompt-clustered se, of all samples and per half; its N and C
            (G, se, n, c), *halves = regime_halves(fold.rows(cols))
            t = totals[name]
            t.N, t.C = n, (c, *(h[3] for h in halves))
            G_h, se_h = np.stack([h[0] for h in halves]), np.stack([h[1] for h in halves])
            # 3. The bound's F: the policy's, or the LM head's token Fisher at the fold's rows where it has one
            F_r, F_rh = _bound_fisher(fold.head(cols), F, F_h)
            # 4. The block's bound statistics: its (param,) arrays written, its counts added
            stats = regime_block_stats(G, se, F_r, fold.a2[0], G_h, se_h, F_rh, np.asarray(fold.a2[1]), z)
            for stat, values in (("G", G), ("se", se), ("bound", stats["bound"]), ("rho", stats["rho"])):
                out[f"{stat}_{name}"][cols] = values
            out[f"crossfit_ratio_{name}"][cols] = stats["crossfit_ratio"]
            t.add(stats)
    # 5. Per regime: the summary of its totals, |ρ| and G, and the overlap of top |G| with top F
    names = list(folds)
    summaries = {n: totals[n].summary(folds[n].a2[0], out[f"rho_{n}"][:], out[f"G_{n}"][:]) for n in names}
    F_values = Values(lambda a, b: out["F"][a:b], P)
    overlap = [{"regime": n, **row} for n in names for row in overlap_table(F_values, _abs(out[f"G_{n}"]), layout, qs)]
    # 6. Each tensor's share of the top sets at the q nearest OVERLAP_Q
    q = qs[int(np.argmin(np.abs(np.asarray(qs) - OVERLAP_Q)))]
    tensors = _shares(out, names, layout, q)
    # 7. The cross-regime comparison
    return RegimeStats(summaries, overlap, tensors, _pairs(out, names, layout, qs))
