"""Spearman's rank correlation of two long vectors in bounded memory (about 28 bytes per element).

:func:`covgrad.topk.spearman` holds both vectors, both average-rank vectors and the sort's temporaries
at once (≈ 56 bytes per element: 7.5 GB at P = 134.5M). Here the vectors are loaded one after the other:
x's centered average ranks are kept (8 bytes per element); y is ranked in sorted order and never
scattered back, its ranks meeting x's through y's sort order in chunks. Same definition: average ranks
for ties, Pearson correlation of the ranks, float64; sums taken in chunks, so it agrees with
``topk.spearman`` to rounding (~1e-15 relative).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np

CHUNK = 1 << 22  # elements per step of the chunked passes


def _sorted_ranks(xs: np.ndarray) -> np.ndarray:
    """The 1-based average ranks of a sorted (n,) float64 array, written over it (returns ``xs``)."""
    n = len(xs)
    new = np.empty(n, dtype=bool)  # True where a run of equal values starts
    new[0] = True
    np.not_equal(xs[1:], xs[:-1], out=new[1:])
    carry = 0
    for lo, hi in _chunks(n):  # forward: each position's run start, kept in xs
        idx = np.where(new[lo:hi], np.arange(lo, hi), carry)
        np.maximum.accumulate(idx, out=idx)
        xs[lo:hi] = idx
        carry = int(idx[-1])
    carry = n
    for lo, hi in reversed(list(_chunks(n))):  # backward: each position's run end (exclusive)
        nxt = np.empty(hi - lo, dtype=np.int64)
        nxt[:-1] = np.where(new[lo + 1 : hi], np.arange(lo + 1, hi), n)
        nxt[-1] = carry
        end = np.minimum.accumulate(nxt[::-1])[::-1]
        xs[lo:hi] = (xs[lo:hi] + end + 1) / 2  # ranks start + 1 .. end, averaged
        carry = int(end[0]) if new[lo] == 0 else lo
    return xs


def _chunks(n: int) -> Iterator[tuple[int, int]]:
    for lo in range(0, n, CHUNK):
        yield lo, min(lo + CHUNK, n)


def spearman_streamed(load_x: Callable[[], np.ndarray], load_y: Callable[[], np.ndarray]) -> float:
    """Spearman's ρ (average ranks for ties, float64) of x and y, each (n,) real without NaN, loaded by
    ``load_x`` / ``load_y`` one after the other; NaN when x or y is constant.

    Raises:
        ValueError: different shapes, n < 2, or NaN in x or y.
    """
    x = np.asarray(load_x(), dtype=np.float64)
    n = len(x)
    if x.ndim != 1 or n < 2 or np.isnan(x).any():
        raise ValueError(f"spearman needs 1-D arrays of length ≥ 2 without NaN; x has shape {x.shape}")
    order = np.argsort(x, kind="stable")
    xs = x[order]
    del x
    rx = np.empty(n)
    rx[order] = _sorted_ranks(xs)
    del order, xs
    center = (n + 1) / 2
    rx -= center
    y = np.asarray(load_y(), dtype=np.float64)
    if y.shape != (n,) or np.isnan(y).any():
        raise ValueError(f"spearman needs two arrays of one shape without NaN; got ({n},) and {y.shape}")
    order = np.argsort(y, kind="stable")
    ys = y[order]
    del y
    ry = _sorted_ranks(ys)
    ry -= center
    sxx = syy = sxy = 0.0
    for lo, hi in _chunks(n):
        a = rx[order[lo:hi]]
        sxx += float(a @ a)
        syy += float(ry[lo:hi] @ ry[lo:hi])
        sxy += float(a @ ry[lo:hi])
    den = math.sqrt(sxx * syy)
    return sxy / den if den > 0 else math.nan
