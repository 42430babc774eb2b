"""Exact top-k sets of (P,) values read block by block, the tables built from them, and Spearman's ρ.

A top-k set is held as its **cut**: the k-th largest value c and how many of the values equal to c
belong to the set, the lowest indices first. The set is {i : v_i > c} plus the first ``ties`` indices
with v_i = c, so ties are broken by the lowest index; NaN is never selected. ``find_cuts`` finds the
cuts of several k at once by a radix select over an order-preserving uint64 key of the float64 value:
a bincount of the top 16 key bits over all values finds the bin holding each k-th largest, a bincount
of the next 16 bits inside a bin narrows it while it holds more than ``_CANDIDATES`` values (heavy
ties), and a last pass collects the bin's values and cuts them in memory. Each pass reads the values
in blocks of ``BLOCK`` (``Values``), so memory is O(BLOCK + _CANDIDATES), not O(P); a search reads the
values twice, at most five times. ``TopSets.sweep`` then turns cuts into masks block by block, in index
order, counting the ties taken so far.

``spearman_blocked(x, y)`` holds a sorted copy of one of its inputs at a time (8 B × P) and writes y's
ranks to a temporary file (8 B × P); its sums are exact integers.

Shape notation: P parameter elements on the flat axis, b values in a block, q fractions, T tensors,
n_k elements of tensor k.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from covgrad.choices import MASK_QS
from covgrad.layout import ParamLayout
from covgrad.lazy import is_dask
from covgrad.moments.numerics import dot64

Array = Any  # numpy.ndarray, dask.array.Array, or any 1-D array that slices to numpy (a zarr array)

DEFAULT_QS = MASK_QS  # the config's default fractions
SCOPES = ("global", "per_tensor")
BLOCK = 1 << 20  # values per read (8 MiB of float64; glibc reuses such buffers, larger ones are fresh
# pages on every allocation), a multiple of the stores' param chunk
_CANDIDATES = 1 << 22  # a key bin with at most this many values is collected and cut in memory
_BINS = 1 << 16
_SIGN = 1 << 63


@dataclass(frozen=True)
class Values:
    """A (n,) axis of real values, read in blocks: ``read(start, stop)`` returns values[start:stop] as
    a float32 or float64 numpy array. Every pass over the axis calls it again."""

    read: Callable[[int, int], np.ndarray]
    n: int

    def blocks(self) -> Iterator[tuple[int, np.ndarray]]:
        """(start, values[start : start + b] as float64) for consecutive blocks of b ≤ BLOCK values."""
        for start in range(0, self.n, BLOCK):
            yield start, np.asarray(self.read(start, min(self.n, start + BLOCK)), dtype=np.float64)

    def part(self, start: int, stop: int) -> Values:
        """values[start:stop]; read once and kept in memory when it fits one block."""
        if stop - start <= BLOCK:
            v = np.asarray(self.read(start, stop), dtype=np.float64)
            return Values(lambda a, b: v[a:b], stop - start)
        return Values(lambda a, b: self.read(start + a, start + b), stop - start)


def as_values(x: Array | Values) -> Values:
    """``x`` read in blocks: slices of a numpy or zarr array, computed slices of a dask array (persist
    a lazily computed one first: every pass reads it).

    Raises:
        ValueError: x is not 1-D.
    """
    if isinstance(x, Values):
        return x
    if x.ndim != 1:
        raise ValueError(f"values must be 1-D; got shape {x.shape}")
    if is_dask(x):
        return Values(lambda a, b: x[a:b].compute(), x.shape[0])
    return Values(lambda a, b: np.asarray(x[a:b]), x.shape[0])


def _keys(v: np.ndarray) -> np.ndarray:
    """Order-preserving uint64 key of float64 v, shape (b,): −0 and +0 share a key; NaN → 0, below
    every number (the top 16 bits of a number's key are never all 0)."""
    bits = np.add(v, 0.0).view(np.int64)  # a copy; −0 + 0 = +0
    flip = bits >> 63  # 0 for +, −1 (all ones) for −
    flip |= np.int64(-_SIGN)
    bits ^= flip  # + : set the sign bit; − : invert every bit
    keys = bits.view(np.uint64)
    keys[np.isnan(v)] = 0  # key 0 is the bit pattern of a negative NaN, never a number
    return keys


def _value(key: int) -> float:
    """The float64 whose key is ``key`` (a number's key)."""
    bits = key ^ _SIGN if key & _SIGN else ~key & (2**64 - 1)
    return float(np.array(bits, dtype=np.uint64).view(np.float64))


def _in_bin(keys: np.ndarray, prefix: int, bits: int) -> np.ndarray:
    """Which keys start with the ``bits`` (≥ 16) bits ``prefix``, (b,) bool."""
    return (keys >> (64 - bits)) == prefix


class Cut(NamedTuple):
    """A top-k set: the values above ``value`` and the first ``ties`` values equal to it, in index order."""

    value: float  # the k-th largest value (+inf for an empty set)
    ties: int  # ≥ 1, 0 only for an empty set


EMPTY = Cut(math.inf, 0)


@dataclass
class _Search:
    """The k-th largest number is the ``need``-th largest of the ``count`` values whose key starts with
    the ``bits`` bits ``prefix``."""

    prefix: int
    bits: int
    need: int
    count: int

    @property
    def bin(self) -> tuple[int, int]:
        return self.prefix, self.bits

    def narrow(self, hist: np.ndarray) -> None:
        """Descend into the sub-bin holding the need-th largest; hist: (65536,) counts of the next 16 bits."""
        from_top = np.cumsum(hist[::-1])  # from_top[j] = count in sub-bins ≥ 65535 − j
        j = int(np.searchsorted(from_top, self.need))  # first j with from_top[j] ≥ need
        sub = _BINS - 1 - j
        self.need -= int(from_top[j] - hist[sub])
        self.prefix, self.bits, self.count = (self.prefix << 16) | sub, self.bits + 16, int(hist[sub])

    def cut(self, found: dict[tuple[int, int], np.ndarray]) -> Cut:
        """The cut, from the collected values of each bin that is not a single key."""
        if self.need == 0:
            return EMPTY
        if self.bits == 64:  # one key, one value
            return Cut(_value(self.prefix), self.need)
        v = found[self.bin]  # (count,) float64
        c = np.partition(v, len(v) - self.need)[len(v) - self.need]
        return Cut(float(c), self.need - int(np.count_nonzero(v > c)))


def _histograms(values: Values, bins: set[tuple[int, int]]) -> dict[tuple[int, int], np.ndarray]:
    """Counts of the next 16 key bits inside each (prefix, bits) bin, (65536,) int64 each, in one pass;
    the top level (0, 0) counts numbers only."""
    hists = {b: np.zeros(_BINS, dtype=np.int64) for b in bins}
    for _, v in values.blocks():
        keys = _keys(v)
        for (prefix, bits), hist in hists.items():
            inside = keys if bits == 0 else keys[_in_bin(keys, prefix, bits)]
            hist += np.bincount(((inside >> (48 - bits)) & 0xFFFF).astype(np.intp), minlength=_BINS)
    if (0, 0) in hists:
        hists[0, 0][0] = 0  # top-level sub-bin 0 holds only NaN keys
    return hists


def _collect(values: Values, bins: set[tuple[int, int]]) -> dict[tuple[int, int], np.ndarray]:
    """The values of each (prefix, bits) bin, float64 in index order, in one pass."""
    parts: dict[tuple[int, int], list[np.ndarray]] = {b: [] for b in bins}
    for _, v in values.blocks():
        keys = _keys(v)
        for (prefix, bits), found in parts.items():
            found.append(v[_in_bin(keys, prefix, bits)])
    return {b: np.concatenate(found) for b, found in parts.items()}


def find_cuts(values: Values, ks: Sequence[int]) -> list[Cut]:
    """The cut of the top-k set (ties to the lowest index, NaN excluded) for each k in ``ks``, exact.

    Reads ``values`` twice, more only when a 16-bit key bin at the cut holds over 4M values (at most
    five times: 64 key bits). When fewer than k values are numbers, the set holds all of them.

    Args:
        values: the (n,) axis.
        ks: set sizes, each in [0, n].

    Returns:
        One Cut per k, in order.
    """
    (top,) = _histograms(values, {(0, 0)}).values()
    numbers = int(top.sum())
    searches = [_Search(0, 0, min(k, numbers), numbers) for k in ks]
    live = [s for s in searches if s.need > 0]
    hists = {(0, 0): top} if live else {}
    while hists:
        for s in live:
            if s.bin in hists:
                s.narrow(hists[s.bin])
        wide = {s.bin for s in live if s.count > _CANDIDATES and s.bits < 64}
        hists = _histograms(values, wide) if wide else {}
    small = {s.bin for s in live if s.bits < 64}
    found = _collect(values, small) if small else {}
    return [s.cut(found) for s in searches]


def _mark(v: np.ndarray, cut: Cut, taken: int) -> tuple[np.ndarray, int]:
    """Which of the consecutive values v (b,) are in cut's set when ``taken`` of its ties came before
    them: (b,) bool, and the ties taken up to the end of v."""
    mask = v > cut.value
    if taken < cut.ties:
        ties = np.flatnonzero(v == cut.value)[: cut.ties - taken]
        mask[ties] = True
        taken += len(ties)
    return mask, taken


def topk_indices(values: Array, k: int) -> np.ndarray:
    """Indices of the k largest values, exact, NaN excluded, ties broken by the lowest index.

    Reads ``values`` three times (see find_cuts); persist a lazily computed dask array first.

    Args:
        values: shape (P,), float32 or float64, numpy, zarr or dask (any 1-D chunking).
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
    vals = as_values(values)
    (cut,) = find_cuts(vals, [k])
    taken, parts = 0, [np.zeros(0, dtype=np.int64)]
    for start, v in vals.blocks():
        mask, taken = _mark(v, cut, taken)
        parts.append(np.flatnonzero(mask) + start)
    return np.concatenate(parts).astype(np.int64)


_MERGE_AT = 1 << 16  # pending candidates of a StreamingTopK merged at once, at least (fewer sorts for small k)


class StreamingTopK:
    """The exact top-k of values pushed in parts, with :func:`topk_indices`' semantics over their union: the k
    largest, ties broken by the lowest index, NaN never selected, −0 equal to +0 (float32 values compare as
    float64).

    Held: the current set (≤ k values and indices) and pending candidates, merged once at least
    max(k, 65536) are pending (one ``np.partition`` of both). Once the set holds k values, a pushed value enters
    only if it beats the set's last member (a larger value, or an equal one at a lower index), so a part pushed
    after the set has settled costs one comparison per value. Memory: O(k + the largest part), whatever the total
    count; parts may come in any index order (each index pushed once).

    Args:
        k: the set size, ≥ 0.
    """

    def __init__(self, k: int) -> None:
        if not isinstance(k, int | np.integer) or k < 0:
            raise ValueError(f"k must be an integer >= 0; got {k!r}")
        self.k = int(k)
        self._values = np.zeros(0)  # (≤ k,) float64, the current set
        self._index = np.zeros(0, dtype=np.int64)  # (≤ k,) their indices
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []
        self._count = 0  # pending candidates
        self._last: tuple[float, int] | None = None  # the full set's last member: (value, index)

    def push(self, values: np.ndarray, index: np.ndarray) -> None:
        """Offer (b,) float32/float64 ``values`` at their (b,) int64 flat ``index`` (distinct from every other
        pushed index)."""
        v = np.asarray(values, dtype=np.float64)
        i = np.asarray(index, dtype=np.int64)
        if v.shape != i.shape or v.ndim != 1:
            raise ValueError(f"values and index must both be (b,); got {v.shape} and {i.shape}")
        if self.k == 0:
            return
        keep = ~np.isnan(v)
        if self._last is not None:
            c, last = self._last
            keep &= (v > c) | ((v == c) & (i < last))
        v, i = v[keep], i[keep]  # copies: the caller's arrays are never kept
        if len(v):
            self._pending.append((v, i))
            self._count += len(v)
            if self._count >= max(self.k, _MERGE_AT):
                self._merge()

    def _merge(self) -> None:
        """The top k of the set and the pending candidates, by (value descending, index ascending)."""
        if not self._pending:
            return
        v = np.concatenate([self._values, *(p[0] for p in self._pending)])
        i = np.concatenate([self._index, *(p[1] for p in self._pending)])
        self._pending, self._count = [], 0
        if len(v) > self.k:
            c = np.partition(v, len(v) - self.k)[len(v) - self.k]  # the k-th largest
            keep = v > c
            ties = np.flatnonzero(v == c)
            need = self.k - int(np.count_nonzero(keep))  # ≥ 1: fewer than k values exceed the k-th largest
            if need < len(ties):
                ties = ties[np.argpartition(i[ties], need - 1)[:need]]  # the lowest indices of the ties
            keep[ties] = True
            v, i = v[keep], i[keep]
        self._values, self._index = v, i
        if len(v) == self.k:
            c = float(v.min())
            self._last = (c, int(i[v == c].max()))

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """The set: its sorted (≤ k,) int64 indices (``topk_indices`` of the union) and their (≤ k,) float64
        values."""
        self._merge()
        order = np.argsort(self._index)
        return self._index[order], self._values[order]


def top_k_masks(values: np.ndarray, ks: Sequence[int], largest: bool = True) -> Iterator[np.ndarray]:
    """(P,) bool masks of the k best values for each k of ``ks``, in order: the k largest (``largest``)
    or the k smallest, ties broken by the lowest index, NaN ranked worst (tied with −inf for the largest,
    with +inf for the smallest), so every mask holds exactly k values.

    The mask of k equals the first k of the stable sort (numpy ``argsort(kind="stable")`` of −values for
    the largest, of values for the smallest, NaN replaced by the worst infinity). Memory: the search's
    blocks (see find_cuts) and one mask; ``values`` is read block by block, never copied whole.

    Args:
        values: shape (P,), float32 or float64.
        ks: set sizes, each in [0, P].

    Raises:
        ValueError: values is not 1-D, or a k is outside [0, P].
    """
    if values.ndim != 1:
        raise ValueError(f"top_k_masks needs a flat (P,) array, got shape {values.shape}")
    P = values.shape[0]
    bad = [k for k in ks if not 0 <= k <= P]
    if bad:
        raise ValueError(f"top_k_masks: k = {bad[0]} is outside [0, {P}]")

    def ranked(a: int, b: int) -> np.ndarray:
        """values[a:b] as float64, larger is better, NaN → −inf: shape (b − a,), a fresh block."""
        v = np.array(values[a:b], dtype=np.float64)
        if not largest:
            np.negative(v, out=v)
        v[np.isnan(v)] = -np.inf
        return v

    vals = Values(ranked, P)
    for cut in find_cuts(vals, ks):
        mask, taken = np.empty(P, dtype=bool), 0
        for start, v in vals.blocks():
            mask[start : start + len(v)], taken = _mark(v, cut, taken)
        yield mask


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


def _overlapping(regions: Sequence[tuple[int, int]], start: int, stop: int) -> Iterator[tuple[int, slice]]:
    """(region index, its part of the block [start, stop) as a slice of the block) for each region
    [lo, hi) that meets the block."""
    for r, (lo, hi) in enumerate(regions):
        if lo < stop and hi > start:
            yield r, slice(max(lo, start) - start, min(hi, stop) - start)


class TopSets:
    """The exact top-q sets of one (P,) metric for each q in ``qs``, held as cuts: scope ``global``,
    the top ceil(q·P) overall, and ``per_tensor``, the top ceil(q·n_k) inside each tensor k.

    Finding the cuts reads the metric about twice for each scope; ``sweep`` reads it once more.
    """

    def __init__(self, values: Values, layout: ParamLayout, qs: Sequence[float]) -> None:
        """Find the cuts of ``values`` (the (P,) metric) on ``layout`` for fractions ``qs`` in (0, 1].

        Raises:
            ValueError: values.n differs from the layout's P, or a q is outside (0, 1].
        """
        if values.n != layout.P:
            raise ValueError(f"the metric has {values.n} values but the layout has P = {layout.P}")
        self.values, self.layout, self.qs = values, layout, list(qs)
        tensors = [(e.offset, e.offset + e.numel) for e in layout.entries]
        self.regions = {"global": [(0, layout.P)], "per_tensor": tensors}
        self.cuts = {
            scope: [
                find_cuts(
                    values.part(lo, hi) if scope == "per_tensor" else values,
                    [count_for_fraction(q, hi - lo) for q in qs],
                )
                for lo, hi in regions
            ]
            for scope, regions in self.regions.items()
        }  # scope → (regions, q) cuts
        self.counts = {scope: np.zeros((len(qs), len(tensors)), dtype=np.int64) for scope in SCOPES}

    def sweep(self) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
        """(start, {scope: (q, b) bool mask}) for the metric's consecutive blocks, in index order; adds
        each block's per-tensor counts to ``counts`` ({scope: (q, T) int64}). Run it once."""
        taken = {
            scope: np.zeros((len(regions), len(self.qs)), dtype=np.int64) for scope, regions in self.regions.items()
        }
        for start, v in self.values.blocks():
            stop = start + len(v)
            masks = {}
            for scope in SCOPES:
                mask = np.zeros((len(self.qs), len(v)), dtype=bool)
                for r, seg in _overlapping(self.regions[scope], start, stop):
                    for i, cut in enumerate(self.cuts[scope][r]):
                        mask[i, seg], taken[scope][r, i] = _mark(v[seg], cut, int(taken[scope][r, i]))
                for t, seg in _overlapping(self.regions["per_tensor"], start, stop):
                    self.counts[scope][:, t] += np.count_nonzero(mask[:, seg], axis=1)
                masks[scope] = mask
            yield start, masks


def overlap_rows(
    top_G: TopSets, top_F: TopSets, n_both: dict[str, np.ndarray], layout: ParamLayout
) -> list[dict[str, Any]]:
    """The overlap table (see overlap_table) from swept TopSets of |G| and F and |topG ∩ topF| for
    each scope, ``n_both`` {scope: (q,) int}."""
    numel = np.array([e.numel for e in layout.entries], dtype=np.float64)
    rows = []
    for i, q in enumerate(top_G.qs):
        for scope in SCOPES:
            a, b = top_G.counts[scope][i], top_F.counts[scope][i]  # (T,) int64
            n_G, n_F, both = int(a.sum()), int(b.sum()), int(n_both[scope][i])
            expected = float(np.sum(np.divide(a * b, numel, out=np.zeros_like(numel), where=numel > 0)))
            rows.append(
                {
                    "q": q,
                    "scope": scope,
                    "n_G": n_G,
                    "n_F": n_F,
                    "n_both": both,
                    "overlap": both / n_G if n_G else math.nan,
                    "random": n_F / layout.P,
                    "per_tensor_random": expected / n_G if n_G else math.nan,
                }
            )
    return rows


def overlap_table(
    F: Array | Values, absG: Array | Values, layout: ParamLayout, qs: Sequence[float] = DEFAULT_QS
) -> list[dict[str, Any]]:
    """Overlap of the top sets by |G| and by F, with random and per-tensor random baselines.

    For each q and scope (``global``: top ceil(q·P) overall; ``per_tensor``: top ceil(q·n_k) inside
    each tensor): overlap = |topG ∩ topF| / |topG|; ``random`` = |topF| / P, the expected overlap of a
    random set of |topF| positions; ``per_tensor_random`` = Σ_k a_k·b_k/n_k / |topG| with a_k, b_k
    tensor k's counts in topG and topF, the expected overlap when each tensor keeps its counts but
    places them at random. Memory: a few blocks, whatever P.

    Args:
        F: Fisher, shape (P,), float32/float64, numpy, zarr, dask or Values.
        absG: |G|, shape (P,), same rules.
        layout: the flat parameter axis.
        qs: fractions in (0, 1].

    Returns:
        One dict per (q, scope): q, scope, n_G, n_F, n_both (int), overlap, random,
        per_tensor_random (float; NaN when topG is empty).

    Raises:
        ValueError: F or absG does not have the layout's shape (P,), or a q is outside (0, 1].
    """
    F, absG = as_values(F), as_values(absG)
    if F.n != layout.P or absG.n != layout.P:
        raise ValueError(f"F ({F.n},) and absG ({absG.n},) must both have shape ({layout.P},) of the layout")
    top_F, top_G = TopSets(F, layout, qs), TopSets(absG, layout, qs)
    n_both = {scope: np.zeros(len(qs), dtype=np.int64) for scope in SCOPES}
    for (_, by_F), (_, by_G) in zip(top_F.sweep(), top_G.sweep(), strict=True):
        for scope in SCOPES:
            n_both[scope] += np.count_nonzero(by_F[scope] & by_G[scope], axis=1)
    return overlap_rows(top_G, top_F, n_both, layout)


def ranks_and_order(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """1-based ranks of (n,) ``x``, tied values sharing the mean of their ranks (float64), and the ascending
    order (n,) int64 they come from (ties in any order: their shared rank does not depend on it)."""
    order = np.argsort(x)
    xs = x[order]
    starts = np.flatnonzero(np.concatenate([[True], xs[1:] != xs[:-1]]))
    ends = np.append(starts[1:], len(x))
    ranks = np.empty(len(x))
    ranks[order] = np.repeat((starts + ends + 1) / 2, ends - starts)
    return ranks, order


def rank_correlation(rx: np.ndarray, ry: np.ndarray) -> float:
    """Pearson correlation of two (n,) rank vectors of ``ranks_and_order`` (the Spearman correlation of
    what they rank); NaN when either is constant."""
    c = (len(rx) + 1) / 2  # the mean rank, exactly
    rx, ry = rx - c, ry - c
    den = math.sqrt(dot64(rx, rx) * dot64(ry, ry))
    return dot64(rx, ry) / den if den > 0 else math.nan


def spearman(x: Array, y: Array) -> float:
    """Spearman rank correlation with average ranks for ties (exact ranks, float64 sums), in memory:
    about 56 B per value; for (P,) arrays of a store use ``spearman_blocked``.

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
    return rank_correlation(ranks_and_order(x)[0], ranks_and_order(y)[0])


_SPLIT = 17  # centered ranks (|r| < 2^34) split into parts below 2^17 in size: part products < 2^34,
# so an int64 sum of a block's products (b ≤ 2^29) cannot overflow


def _parts(r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """r = hi·2^17 + lo with 0 ≤ lo < 2^17, for (b,) int64 r with |r| < 2^34."""
    return r >> _SPLIT, r & ((1 << _SPLIT) - 1)


def _exact_dot(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> int:
    """Σ a·b as an exact integer, from the _parts of two (b,) int64 vectors."""
    (a1, a0), (b1, b0) = a, b

    def dot(x: np.ndarray, y: np.ndarray) -> int:
        return int(np.einsum("i,i->", x, y))  # int64, no BLAS

    return (dot(a1, b1) << 2 * _SPLIT) + ((dot(a1, b0) + dot(a0, b1)) << _SPLIT) + dot(a0, b0)


def _sorted_copy(values: Values, name: str) -> np.ndarray:
    """All of ``values``, sorted ascending, shape (n,) float64.

    Raises:
        ValueError: values holds NaN.
    """
    out = np.empty(values.n)
    for start, v in values.blocks():
        out[start : start + len(v)] = v
    out.sort()  # in place
    if np.isnan(out[-1]):  # NaN sorts last
        raise ValueError(f"{name} holds {int(np.isnan(out).sum())} NaN values; drop them before ranking")
    return out


def _centered_ranks(ordered: np.ndarray, v: np.ndarray) -> np.ndarray:
    """2·(average rank) − (n + 1) of each value v (b,) among the n sorted values ``ordered`` that hold
    them, int64 in (−n, n): a value with ``left`` smaller and ``right − left`` equal values has average
    1-based rank (left + 1 + right) / 2, so this is left + right − n."""
    n = len(ordered)
    order = np.argsort(v)  # ascending queries reuse the cached part of the binary searches
    q = v[order]
    starts = np.flatnonzero(np.concatenate([[True], q[1:] != q[:-1]]))  # first of each distinct value
    u = q[starts]
    left = np.searchsorted(ordered, u, side="left")
    right = left + 1  # most values occur once: look at the next one before searching again
    tied = (right < n) & (ordered[np.minimum(right, n - 1)] == u)
    right[tied] = np.searchsorted(ordered, u[tied], side="right")
    ranks = np.empty(len(v), dtype=np.int64)
    ranks[order] = np.repeat(left + right - n, np.diff(np.append(starts, len(q))))
    return ranks


def spearman_blocked(x: Values, y: Values, scratch: str | None = None) -> float:
    """Spearman's rank correlation of two (n,) axes read in blocks, average ranks for ties.

    The ranks of y go to a temporary file in ``scratch`` (the system's temporary directory when None;
    8 B × n, removed on close), those of x are paired with them block by block. Each block is ranked by
    binary search in a sorted copy of its axis, so memory holds one sorted copy (8 B × n) and a few
    blocks. The sums of rank products are exact integers: ρ is their ratio rounded once more at the
    end, and agrees with ``spearman`` to its float64 rounding (≲ 1e-12).

    Args:
        x: shape (n,), real, no NaN.
        y: shape (n,), same.
        scratch: directory for the temporary file.

    Returns:
        The Pearson correlation of the average ranks; NaN when x or y is constant.

    Raises:
        ValueError: different lengths, n < 2 or n ≥ 2^34, or NaN in x or y.
    """
    n = x.n
    if y.n != n or not 2 <= n < 1 << 2 * _SPLIT:
        raise ValueError(f"spearman needs two axes of equal length in [2, 2^34); got {x.n} and {y.n}")
    with tempfile.TemporaryFile(dir=scratch) as ranks_y:
        ordered = _sorted_copy(y, "y")
        for _, v in y.blocks():
            _centered_ranks(ordered, v).tofile(ranks_y)
        del ordered
        ordered = _sorted_copy(x, "x")
        ranks_y.seek(0)
        sxx = syy = sxy = 0
        for _, v in x.blocks():
            rx = _parts(_centered_ranks(ordered, v))
            ry = _parts(np.fromfile(ranks_y, dtype=np.int64, count=len(v)))
            sxx, syy, sxy = sxx + _exact_dot(rx, rx), syy + _exact_dot(ry, ry), sxy + _exact_dot(rx, ry)
    return sxy / math.sqrt(sxx * syy) if sxx and syy else math.nan


def bound_mask_table(
    stdA: float,
    Fvar: Array | Values,
    absCov: Array | Values,
    taus: Sequence[float] | None = None,
    qs: Sequence[float] = DEFAULT_QS,
) -> list[dict[str, Any]]:
    """Bound mask {std_A·sqrt(Fvar) ≥ τ} against the set it must contain, {|Cov| ≥ τ}.

    Reads Fvar once and absCov three times (once when ``taus`` are given); memory: a few blocks.

    Args:
        stdA: std of the advantage (1/N).
        Fvar: Var(s), shape (P,), float32/float64, numpy, zarr, dask or Values.
        absCov: |Cov(A, s)|, shape (P,), same rules.
        taus: thresholds. Default: the |Cov| value at rank ceil(q·P) for each q in ``qs``.
        qs: fractions defining the default thresholds.

    Returns:
        One dict per τ: q (None for a given τ), tau, n_bound = |{bound ≥ τ}|, n_cov = |{|Cov| ≥ τ}|,
        n_both, recall = n_both / n_cov (1 in-sample, by Cauchy–Schwarz) and precision =
        n_both / n_bound (NaN when the denominator is 0).

    Raises:
        ValueError: mismatched shapes or a NaN threshold.
    """
    Fvar, absCov = as_values(Fvar), as_values(absCov)
    if Fvar.n != absCov.n:
        raise ValueError(f"Fvar ({Fvar.n},) and absCov ({absCov.n},) must be 1-D of the same shape")
    if taus is None:
        cuts = find_cuts(absCov, [count_for_fraction(q, absCov.n) for q in qs])
        labelled = [(q, cut.value) for q, cut in zip(qs, cuts, strict=True) if cut.ties]  # value: min of the set
    else:
        labelled = [(None, float(t)) for t in taus]
    if any(math.isnan(t) for _, t in labelled):
        raise ValueError(f"thresholds must not be NaN; got {[t for _, t in labelled]}")
    counts = np.zeros((len(labelled), 3), dtype=np.int64)  # n_bound, n_cov, n_both per τ
    for (_, fvar), (_, cov) in zip(Fvar.blocks(), absCov.blocks(), strict=True):
        bound = stdA * np.sqrt(fvar)  # (b,)
        for j, (_, tau) in enumerate(labelled):
            in_bound, in_cov = bound >= tau, cov >= tau
            counts[j] += [np.count_nonzero(in_bound), np.count_nonzero(in_cov), np.count_nonzero(in_bound & in_cov)]
    rows = []
    for (q, tau), (n_bound, n_cov, n_both) in zip(labelled, counts.tolist(), strict=True):
        rows.append(
            {
                "q": q,
                "tau": tau,
                "n_bound": n_bound,
                "n_cov": n_cov,
                "n_both": n_both,
                "recall": n_both / n_cov if n_cov else math.nan,
                "precision": n_both / n_bound if n_bound else math.nan,
            }
        )
    return rows
