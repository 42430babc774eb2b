"""A change tracker's per-column data kept out of memory: raw files read by column ranges, and exact top-k counts
from one-byte rank buckets with each predictor's order on disk.

A tracker of a whole model (P = 134.5M for SmolLM2, 268M for Gemma 3 270M) cannot hold a rank per predictor per
column in memory (4-8 B each, a dozen predictors). :class:`ColumnFiles` writes the static per-column arrays
once into a scratch directory and reads them back a column range at a time with ``np.fromfile`` (no mapping, so
nothing stays resident). :class:`Ranking` keeps a predictor's order there and answers the one question the
tracker asks of it — how many of a set's columns are among the top k of their group — exactly:

- ``bucket[i] = r_i · NB // N_g`` (uint8) for the within-group rank r_i of column i among its group's N_g columns;
- the top k of group g are the columns of bucket < b, b = k · NB // N_g, and the ranks [⌈b·N_g/NB⌉, k) — at most
  N_g/NB + 1 columns, read as a contiguous slice of the group's sorted order;
- so |set ∩ top k| = |{i ∈ set : bucket_i < b_g}| (a scan of the buckets) + the set's columns in that slice.

Shapes: n the tracker's columns (all P, or a rank's shard), G the groups of a ranking (1, the 10 |w_0| deciles,
or the E layout tensors).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

NB = 256  # rank buckets of a ranking (uint8)

CHUNK = 1 << 22  # columns read or processed at a time

# (values (n,), largest first?, groups (n,) int or None) -> (n,) int within-group rank over every tracker's columns
Ranker = Callable[[np.ndarray, bool, "np.ndarray | None"], np.ndarray]


class ColumnFiles:
    """Flat per-column arrays as raw files in a scratch directory (removed by :meth:`close` or at garbage
    collection), each written once and read back by column ranges.

    ``root``: the directory to create the scratch directory in (None: the system's temporary directory).
    """

    def __init__(self, root: str | None = None) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="covgrad-columns-", dir=root)
        self.dtypes: dict[str, np.dtype] = {}
        self.sizes: dict[str, int] = {}

    def _path(self, name: str) -> str:
        return os.path.join(self._tmp.name, f"{name}.bin")

    def write(self, name: str, values: np.ndarray) -> None:
        """Store ``values`` (n,) under ``name``."""
        values = np.ascontiguousarray(values).reshape(-1)
        values.tofile(self._path(name))
        self.dtypes[name], self.sizes[name] = values.dtype, values.shape[0]

    def read(self, name: str, lo: int, hi: int) -> np.ndarray:
        """Elements [lo, hi) of ``name``, a fresh array."""
        self._check(name, lo, hi)
        dtype = self.dtypes[name]
        return np.fromfile(self._path(name), dtype=dtype, count=hi - lo, offset=lo * dtype.itemsize)

    def search(self, name: str, lo: int, hi: int, values: list[int]) -> list[int]:
        """``np.searchsorted(name[lo:hi], v)`` for each v of ``values`` (the slice ascending), reading only the
        O(log(hi − lo)) pages a bisection touches."""
        self._check(name, lo, hi)
        if hi == lo:
            return [0] * len(values)
        dtype = self.dtypes[name]
        part = np.memmap(self._path(name), dtype=dtype, mode="r", offset=lo * dtype.itemsize, shape=(hi - lo,))
        out = [int(np.searchsorted(part, v)) for v in values]
        del part
        return out

    def _check(self, name: str, lo: int, hi: int) -> None:
        if not 0 <= lo <= hi <= self.sizes[name]:
            raise ValueError(f"column range [{lo}, {hi}) is outside {name}'s {self.sizes[name]} elements")

    def close(self) -> None:
        self._tmp.cleanup()


def sort_key(values: np.ndarray, largest: bool) -> np.ndarray:
    """(n,) float64 ascending sort key of ``values``: −v for largest first, v for smallest first, NaN last (as
    +inf); −0 and +0 compare equal, so a stable sort ties them by column."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    key = np.negative(v) if largest else v.copy()
    key[np.isnan(key)] = np.inf
    return key


def _by_key(key: np.ndarray, float32: bool) -> np.ndarray:
    """(n,) int64 the positions of ``key`` (n,) float64 (:func:`sort_key`) sorted by (key, position), exactly as
    a stable argsort orders them, from unique 64-bit integer keys that an unstable sort orders fast: the key
    rounded to float32 (a monotone map), its bits made order-preserving (sign bit flipped, negative values' bits
    inverted, −0 made +0) in the high 32 bits, the position in the low 32. Unless the keys are exact in float32
    (``float32``), runs of equal float32 keys are then re-sorted by (float64 key, position)."""
    n = key.shape[0]
    if n >= 2**32:
        return np.argsort(key, kind="stable")
    with np.errstate(over="ignore"):  # beyond float32's range: ±inf, a run re-sorted by the float64 key below
        k32 = key.astype(np.float32)
    k32[k32 == 0] = 0.0  # −0 ties with +0
    bits = k32.view(np.uint32)
    ordered = np.where(bits >> 31 == 1, ~bits, bits | np.uint32(1 << 31)).astype(np.uint64)
    del k32, bits
    ordered <<= np.uint64(32)
    ordered |= np.arange(n, dtype=np.uint64)
    ordered.sort()
    order = (ordered & np.uint64(0xFFFFFFFF)).astype(np.int64)
    if float32:
        return order
    high = ordered >> np.uint64(32)
    del ordered
    tie = high[1:] == high[:-1]  # (n - 1,) sorted position i + 1 has the float32 key of position i
    del high
    if tie.any():
        tied = np.zeros(n, dtype=bool)
        tied[1:] |= tie
        tied[:-1] |= tie
        run = np.cumsum(np.concatenate([[True], ~tie]))  # (n,) run of equal float32 keys of each sorted position
        at = np.flatnonzero(tied)
        cols = order[at]
        order[at] = cols[np.lexsort((cols, key[cols], run[at]))]
    return order


def _order(values: np.ndarray, largest: bool, groups: np.ndarray | None) -> np.ndarray:
    """(n,) the columns sorted by (group, key, column): each group's columns in rank order, groups ascending
    (the order of a stable argsort of :func:`sort_key` within groups, computed by :func:`_by_key`)."""
    float32 = np.asarray(values).dtype == np.float32
    if groups is None:
        return _by_key(sort_key(values, largest), float32)
    by_group = np.argsort(groups, kind="stable")
    bounds = np.flatnonzero(np.diff(groups[by_group])) + 1
    v = np.asarray(values).reshape(-1)
    for part in np.split(np.arange(by_group.shape[0]), bounds):
        cols = by_group[part]
        by_group[part] = cols[_by_key(sort_key(v[cols], largest), float32)]
    return by_group


def _bucket_of(ranks: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """(m,) uint8 rank · NB // N for ranks (m,) int64 and their groups' sizes N (m,) int64."""
    return (ranks * NB // np.maximum(sizes, 1)).astype(np.uint8)


@dataclass(frozen=True)
class Ranking:
    """One predictor's order over the tracker's columns, in :class:`ColumnFiles` under ``name``: ``{name}.bucket``
    (n,) uint8, ``{name}.order`` (n,) the columns sorted by (group, rank) and, for a shard of a layout,
    ``{name}.rank`` (n,) their within-group ranks over every shard in that order.

    Attributes:
        name: the files' prefix.
        sizes: (G,) int64 columns of each group over every shard (N_g).
        starts: (G + 1,) int64 where each group's columns begin in ``{name}.order``.
        sharded: whether ``{name}.rank`` exists (False: group g's ranks are 0..N_g − 1, in order).
    """

    name: str
    sizes: np.ndarray
    starts: np.ndarray
    sharded: bool

    @classmethod
    def build(
        cls,
        files: ColumnFiles,
        name: str,
        values: np.ndarray,
        largest: bool,
        groups: np.ndarray | None,
        sizes: np.ndarray,
        ranker: Ranker | None = None,
    ) -> Ranking:
        """Rank ``values`` (n,) within ``groups`` ((n,) int ascending group ids, None: one group) whose sizes over
        every shard are ``sizes`` (G,), largest (or smallest) first, ties by the lowest column and NaN last, and
        write the files. ``ranker``: the whole layout's within-group ranks at these columns, for a shard (None:
        the columns are the whole layout and are ranked here)."""
        n = np.asarray(values).reshape(-1).shape[0]
        sizes = np.asarray(sizes, dtype=np.int64)
        local = np.full(1, n, dtype=np.int64) if groups is None else np.bincount(groups, minlength=sizes.shape[0])
        starts = np.concatenate([[0], np.cumsum(local)]).astype(np.int64)
        index_type = np.int32 if n < 2**31 else np.int64
        bucket = np.empty(n, dtype=np.uint8)
        if ranker is None:
            if not np.array_equal(local, sizes):
                raise ValueError(f"ranking {name}: the group sizes {sizes.tolist()} are not these columns' own")
            order = _order(values, largest, groups)
            for g in range(sizes.shape[0]):
                for lo in range(int(starts[g]), int(starts[g + 1]), CHUNK):
                    hi = min(int(starts[g + 1]), lo + CHUNK)
                    ranks = np.arange(lo - starts[g], hi - starts[g], dtype=np.int64)
                    bucket[order[lo:hi]] = _bucket_of(ranks, np.full(hi - lo, sizes[g]))
            files.write(f"{name}.order", order.astype(index_type))
        else:
            ranks = np.asarray(ranker(values, largest, groups), dtype=np.int64)
            group = np.zeros(n, dtype=np.int64) if groups is None else np.asarray(groups, dtype=np.int64)
            bucket[:] = _bucket_of(ranks, sizes[group])
            order = np.lexsort((ranks, group))
            files.write(f"{name}.order", order.astype(index_type))
            files.write(f"{name}.rank", ranks[order])
        files.write(f"{name}.bucket", bucket)
        return cls(name, sizes, starts, ranker is not None)

    def thresholds(self, k: np.ndarray) -> np.ndarray:
        """(G,) int64 bucket thresholds b_g = k_g · NB // N_g for top-k sizes ``k`` (G,); NB + 1 where k_g ≥ N_g
        (every bucket is below it)."""
        k = np.asarray(k, dtype=np.int64)
        b = k * NB // np.maximum(self.sizes, 1)
        return np.where(k >= self.sizes, NB + 1, b)

    def boundary(self, files: ColumnFiles, k: np.ndarray, member: np.ndarray) -> np.ndarray:
        """(G,) int64: per group g with k_g < N_g (``k`` (G,)), how many columns of ``member`` ((n,) bool) have
        within-group rank in [⌈b_g·N_g/NB⌉, k_g): the part of the top k that the buckets below b_g miss."""
        b = self.thresholds(k)
        out = np.zeros(self.sizes.shape[0], dtype=np.int64)
        for g in np.flatnonzero(b <= NB):
            lo_rank, k_g = -(-int(b[g]) * int(self.sizes[g]) // NB), int(k[g])
            s, e = int(self.starts[g]), int(self.starts[g + 1])
            if self.sharded:  # this shard's ranks of group g, ascending
                lo, hi = (s + i for i in files.search(f"{self.name}.rank", s, e, [lo_rank, k_g]))
            else:
                lo, hi = s + lo_rank, s + k_g
            if hi > lo:
                out[g] = np.count_nonzero(member[files.read(f"{self.name}.order", lo, hi)])
        return out

    def below(self, bucket: np.ndarray, group: np.ndarray | None, b: np.ndarray) -> np.ndarray:
        """(G,) int64: per group, how many of the columns with buckets ``bucket`` (m,) and groups ``group`` (m,)
        (None: one group) lie below the group's threshold ``b`` (G,) (:meth:`thresholds`)."""
        if group is None:
            return np.asarray([np.count_nonzero(bucket < b[0])], dtype=np.int64)
        G = self.sizes.shape[0]
        return np.bincount(group[bucket < b[group]], minlength=G).astype(np.int64)

    def per_column(self, files: ColumnFiles, n: int, of_rank: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """(n,) ``of_rank(r)`` of every column's within-group rank r ((m,) int64 -> (m,)), in column order."""
        out: np.ndarray | None = None
        for g in range(self.sizes.shape[0]):
            for lo in range(int(self.starts[g]), int(self.starts[g + 1]), CHUNK):
                hi = min(int(self.starts[g + 1]), lo + CHUNK)
                if self.sharded:
                    ranks = files.read(f"{self.name}.rank", lo, hi).astype(np.int64)
                else:
                    ranks = np.arange(lo - self.starts[g], hi - self.starts[g], dtype=np.int64)
                part = of_rank(ranks)
                if out is None:
                    out = np.empty(n, dtype=part.dtype)
                out[files.read(f"{self.name}.order", lo, hi)] = part
        return np.zeros(n, dtype=np.int64) if out is None else out
