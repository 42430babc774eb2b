"""Exact top-k index sets without a full sort, and the tables built from them.

``topk_indices`` is a radix select on an order-preserving uint32 key of the float32 bit pattern:
one bincount over the high 16 key bits finds the bucket of the k-th largest value, a second one over
the low 16 bits inside that bucket finds its exact key, and a filter pass collects everything above
it plus the lowest-index ties. Each pass reads the values chunk by chunk, so memory is
O(chunk + 65536 bins + k). float64 values are keyed by their float32 rounding, which is monotone:
a larger key means a strictly larger value, and only the values sharing the threshold key are ranked
in float64.

Shape notation: P parameter elements on the flat axis, k selected indices, n_k elements of tensor k.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial, reduce
from typing import Any

import dask
import dask.array as da
import numpy as np

from covgrad.layout import ParamLayout

Array = Any  # numpy.ndarray or dask.array.Array

DEFAULT_QS = (0.001, 0.01, 0.05, 0.1)
NUMPY_CHUNK = 1 << 22  # values per pass step for numpy input (16 MiB of float32)
_BINS = 1 << 16
_TREE_WIDTH = 8  # partial results combined per task in the dask tree


def _keys(v: np.ndarray) -> np.ndarray:
    """Order-preserving uint32 key of float32(v): −0 and +0 share a key; NaN → 0, below every value."""
    with np.errstate(over="ignore"):  # float64 beyond float32 range rounds to ±inf, still in order
        f = np.add(v, np.float32(0), dtype=np.float32)  # copy; −0 + 0 = +0
    nan = np.isnan(f)
    bits = f.view(np.int32)
    flip = bits >> 31  # 0 for +, −1 (all ones) for −
    flip |= np.int32(-(1 << 31))
    bits ^= flip  # + : set the sign bit; − : invert every bit
    keys = bits.view(np.uint32)
    keys[nan] = 0  # key 0 is the bit pattern of a negative NaN, never a number
    return keys


def _hist_high(v: np.ndarray, offset: int) -> np.ndarray:
    return np.bincount(_keys(v) >> 16, minlength=_BINS)  # (65536,)


def _hist_low(v: np.ndarray, offset: int, high: int) -> np.ndarray:
    keys = _keys(v)
    return np.bincount(keys[(keys >> 16) == high] & 0xFFFF, minlength=_BINS)  # (65536,)


def _best(idx: np.ndarray, vals: np.ndarray, need: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``need`` largest of vals, ties to the lowest index; idx (ascending) and vals in idx order."""
    if len(vals) <= need:
        return idx, vals
    cut = np.partition(vals, len(vals) - need)[len(vals) - need]  # the need-th largest value
    above = vals > cut
    ties = np.flatnonzero(vals == cut)[: need - int(above.sum())]
    keep = np.sort(np.concatenate([np.flatnonzero(above), ties]))
    return idx[keep], vals[keep]


Selection = tuple[np.ndarray, np.ndarray, np.ndarray]  # (indices above, tie indices, tie values)


def _select(v: np.ndarray, offset: int, threshold: int, need: int) -> Selection:
    keys = _keys(v)
    above = np.flatnonzero(keys > threshold) + offset
    ties = np.flatnonzero(keys == threshold)
    tie_idx, tie_vals = _best(ties + offset, v[ties], need)
    return above, tie_idx, tie_vals


def _merge_selections(parts: Sequence[Selection], need: int) -> Selection:
    """Concatenate selections of consecutive chunks (in index order), keeping the best ``need`` ties."""
    above = np.concatenate([p[0] for p in parts])
    tie_idx, tie_vals = _best(np.concatenate([p[1] for p in parts]), np.concatenate([p[2] for p in parts]), need)
    return above, tie_idx, tie_vals


def _sum_hists(parts: Sequence[np.ndarray]) -> np.ndarray:
    return np.sum(parts, axis=0)


def _pass(values: Array, fn: Callable[..., Any], combine: Callable[[list[Any]], Any], *args: Any) -> Any:
    """Apply ``fn(chunk, offset, *args)`` to every chunk in index order and fold the results with
    ``combine`` (a sequential fold for numpy; a dask tree on the active scheduler for dask)."""
    if isinstance(values, da.Array):
        offsets = np.concatenate([[0], np.cumsum(values.chunks[0])[:-1]])
        parts = [
            dask.delayed(fn)(blk, int(off), *args)
            for blk, off in zip(values.to_delayed().ravel(), offsets, strict=True)
        ]
        while len(parts) > 1:
            parts = [dask.delayed(combine)(parts[i : i + _TREE_WIDTH]) for i in range(0, len(parts), _TREE_WIDTH)]
        return parts[0].compute()
    starts = range(0, max(len(values), 1), NUMPY_CHUNK)
    return reduce(
        lambda acc, s: combine([acc, fn(values[s : s + NUMPY_CHUNK], s, *args)]),
        starts[1:],
        fn(values[:NUMPY_CHUNK], 0, *args),
    )


def _split(hist: np.ndarray, k: int) -> tuple[int, int]:
    """Bin holding the k-th largest (1 ≤ k ≤ hist.sum()) and the count in the bins above it."""
    from_top = np.cumsum(hist[::-1])  # from_top[j] = count in bins ≥ 65535 − j
    j = int(np.searchsorted(from_top, k))  # first j with from_top[j] ≥ k
    return _BINS - 1 - j, int(from_top[j] - hist[_BINS - 1 - j])


def topk_indices(values: Array, k: int) -> np.ndarray:
    """Indices of the k largest values, exact, NaN excluded, ties broken by the lowest index.

    Reads ``values`` three times (two histogram passes and a filter pass); persist a lazily computed
    dask array first.

    Args:
        values: shape (P,), float32 or float64, numpy or dask (any 1-D chunking).
        k: 0 ≤ k ≤ P. When fewer than k values are not NaN, all of them are returned.

    Returns:
        Sorted indices, shape (min(k, number of non-NaN values),), int64.

    Raises:
        ValueError: values is not a 1-D float32/float64 array, or k is not an integer in [0, P].
    """
    if values.ndim != 1 or values.dtype not in (np.float32, np.float64):
        raise ValueError(f"values must be a 1-D float32/float64 array; got shape {values.shape}, dtype {values.dtype}")
    if not isinstance(k, int | np.integer) or not 0 <= k <= values.shape[0]:
        raise ValueError(f"k must be an integer in [0, P = {values.shape[0]}]; got {k!r}")
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    hist = _pass(values, _hist_high, _sum_hists)  # (65536,)
    hist[0] = 0  # bin 0 holds only NaN keys
    k = min(k, int(hist.sum()))
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    high, n_above = _split(hist, k)
    low, n_above_low = _split(_pass(values, _hist_low, _sum_hists, high), k - n_above)
    need = k - n_above - n_above_low  # ≥ 1 ties at the threshold key are taken
    above, ties, _ = _pass(
        values,
        _select,
        partial(_merge_selections, need=need),
        (high << 16) | low,
        need,
    )
    return np.sort(np.concatenate([above, ties])).astype(np.int64)


def count_for_fraction(q: float, n: int) -> int:
    """k = ceil(q·n), ignoring float noise in the product (q = 0.07, n = 100 gives 7, not 8).

    Raises:
        ValueError: q is outside (0, 1].
    """
    if not 0 < q <= 1:
        raise ValueError(f"the fraction q must be in (0, 1]; got {q}")
    return math.ceil(round(q * n, 6))


def topk_global(values: Array, q: float) -> np.ndarray:
    """Sorted int64 indices of the top ceil(q·P) values over the whole flat axis (see topk_indices)."""
    return topk_indices(values, count_for_fraction(q, values.shape[0]))


def topk_per_tensor(values: Array, layout: ParamLayout, q: float) -> np.ndarray:
    """Sorted int64 indices of the top ceil(q·n_k) values inside each tensor k of ``layout``.

    Raises:
        ValueError: the layout's P differs from len(values), or q is outside (0, 1].
    """
    if values.shape != (layout.P,):
        raise ValueError(f"values have shape {values.shape} but the layout has P = {layout.P}")
    parts = [
        e.offset + topk_indices(values[e.offset : e.offset + e.numel], count_for_fraction(q, e.numel))
        for e in layout.entries
        if e.numel > 0
    ]
    return np.concatenate(parts).astype(np.int64)


def _tensor_counts(idx: np.ndarray, layout: ParamLayout) -> np.ndarray:
    """How many of the flat indices idx fall in each tensor, shape (n_tensors,) int64."""
    offsets = np.array([e.offset for e in layout.entries])
    tensor = np.searchsorted(offsets, idx, side="right") - 1
    return np.bincount(tensor, minlength=len(offsets))


def overlap_table(F: Array, absG: Array, layout: ParamLayout, qs: Sequence[float] = DEFAULT_QS) -> list[dict[str, Any]]:
    """Overlap of the top sets by |G| and by F, with random and per-tensor random baselines.

    For each q and scope (``global``: top ceil(q·P) overall; ``per_tensor``: top ceil(q·n_k) inside
    each tensor): overlap = |topG ∩ topF| / |topG|; ``random`` = |topF| / P, the expected overlap of a
    random set of |topF| positions; ``per_tensor_random`` = Σ_k a_k·b_k/n_k / |topG| with a_k, b_k
    tensor k's counts in topG and topF, the expected overlap when each tensor keeps its counts but
    places them at random.

    Args:
        F: Fisher, shape (P,), float32/float64, numpy or dask.
        absG: |G|, shape (P,), same dtype rules.
        layout: the flat parameter axis.
        qs: fractions in (0, 1].

    Returns:
        One dict per (q, scope): q, scope, n_G, n_F, n_both (int), overlap, random,
        per_tensor_random (float; NaN when topG is empty).

    Raises:
        ValueError: F or absG does not have the layout's shape (P,), or a q is outside (0, 1].
    """
    if F.shape != (layout.P,) or absG.shape != (layout.P,):
        raise ValueError(f"F {F.shape} and absG {absG.shape} must both have shape ({layout.P},) of the layout")
    numel = np.array([e.numel for e in layout.entries], dtype=np.float64)
    rows = []
    for q in qs:
        for scope in ("global", "per_tensor"):
            if scope == "global":
                top_G, top_F = topk_global(absG, q), topk_global(F, q)
            else:
                top_G, top_F = topk_per_tensor(absG, layout, q), topk_per_tensor(F, layout, q)
            n_G, n_F = len(top_G), len(top_F)
            n_both = len(np.intersect1d(top_G, top_F, assume_unique=True))
            a, b = _tensor_counts(top_G, layout), _tensor_counts(top_F, layout)
            expected = float(np.sum(np.divide(a * b, numel, out=np.zeros_like(numel), where=numel > 0)))
            rows.append(
                {
                    "q": q,
                    "scope": scope,
                    "n_G": n_G,
                    "n_F": n_F,
                    "n_both": n_both,
                    "overlap": n_both / n_G if n_G else math.nan,
                    "random": n_F / layout.P,
                    "per_tensor_random": expected / n_G if n_G else math.nan,
                }
            )
    return rows


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, tied values sharing the mean of their ranks, shape (n,) float64."""
    order = np.argsort(x, kind="stable")
    xs = x[order]
    starts = np.flatnonzero(np.concatenate([[True], xs[1:] != xs[:-1]]))
    ends = np.append(starts[1:], len(x))
    ranks = np.empty(len(x))
    ranks[order] = np.repeat((starts + ends + 1) / 2, ends - starts)
    return ranks


def spearman(x: Array, y: Array) -> float:
    """Spearman rank correlation with average ranks for ties (exact, float64).

    Args:
        x: shape (n,), real, no NaN (a dask array is computed).
        y: shape (n,), same.

    Returns:
        The Pearson correlation of the average ranks; NaN when x or y is constant.

    Raises:
        ValueError: different shapes, n < 2, or NaN in x or y.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    if x.ndim != 1 or x.shape != y.shape or len(x) < 2:
        raise ValueError(f"spearman needs two 1-D arrays of equal length ≥ 2; got {x.shape} and {y.shape}")
    for name, v in (("x", x), ("y", y)):
        if np.isnan(v).any():
            raise ValueError(f"{name} holds {int(np.isnan(v).sum())} NaN values; drop them before ranking")
    rx = _average_ranks(x) - (len(x) + 1) / 2  # centered ranks (the mean rank is (n+1)/2 exactly)
    ry = _average_ranks(y) - (len(x) + 1) / 2
    den = math.sqrt(float(rx @ rx) * float(ry @ ry))
    return float(rx @ ry) / den if den > 0 else math.nan


def bound_mask_table(
    stdA: float | Array,
    Fvar: Array,
    absCov: Array,
    taus: Sequence[float] | None = None,
    qs: Sequence[float] = DEFAULT_QS,
) -> list[dict[str, Any]]:
    """Bound mask {std_A·sqrt(Fvar) ≥ τ} against the set it must contain, {|Cov| ≥ τ}.

    Args:
        stdA: std of the advantage (1/N), a float or 0-d array.
        Fvar: Var(s), shape (P,), numpy or dask.
        absCov: |Cov(A, s)|, shape (P,), float32/float64, numpy or dask.
        taus: thresholds. Default: the |Cov| value at rank ceil(q·P) for each q in ``qs``.
        qs: fractions defining the default thresholds.

    Returns:
        One dict per τ: q (None for a given τ), tau, n_bound = |{bound ≥ τ}|, n_cov = |{|Cov| ≥ τ}|,
        n_both, recall = n_both / n_cov (1 in-sample, by Cauchy–Schwarz) and precision =
        n_both / n_bound (NaN when the denominator is 0).

    Raises:
        ValueError: mismatched shapes or a NaN threshold.
    """
    if Fvar.shape != absCov.shape or absCov.ndim != 1:
        raise ValueError(f"Fvar {Fvar.shape} and absCov {absCov.shape} must be 1-D of the same shape")
    if taus is None:
        labelled = []
        for q in qs:
            top = topk_global(absCov, q)
            if len(top):
                labelled.append((q, float(np.min(np.asarray(absCov[top])))))
    else:
        labelled = [(None, float(t)) for t in taus]
    if any(math.isnan(t) for _, t in labelled):
        raise ValueError(f"thresholds must not be NaN; got {[t for _, t in labelled]}")
    xp = da if isinstance(Fvar, da.Array) or isinstance(absCov, da.Array) else np
    bound = stdA * xp.sqrt(Fvar)  # (P,)
    counts = []
    for _, tau in labelled:
        in_bound, in_cov = bound >= tau, absCov >= tau
        counts.append((in_bound.sum(), in_cov.sum(), (in_bound & in_cov).sum()))
    (counts,) = dask.compute(counts)
    rows = []
    for (q, tau), (n_bound, n_cov, n_both) in zip(labelled, counts, strict=True):
        rows.append(
            {
                "q": q,
                "tau": tau,
                "n_bound": int(n_bound),
                "n_cov": int(n_cov),
                "n_both": int(n_both),
                "recall": n_both / n_cov if n_cov else math.nan,
                "precision": n_both / n_bound if n_bound else math.nan,
            }
        )
    return rows
