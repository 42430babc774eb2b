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


_LOW = np.uint64(0xFFFFFFFF)


def _key_bits(values: np.ndarray, largest: bool) -> np.ndarray:
    """(m,) unsigned integers ordered as :func:`sort_key` orders ``values`` (m,) float32 (uint32) or float64
    (uint64): the key's bits with the sign bit flipped, a negative key's bits inverted, −0 made +0."""
    key = np.negative(values) if largest else values.copy()
    key[np.isnan(key)] = np.inf
    key[key == 0] = 0.0
    unsigned = np.uint32 if key.dtype == np.float32 else np.uint64
    bits = key.view(unsigned)
    top = unsigned(1) << unsigned(8 * key.itemsize - 1)
    return np.where(bits & top, ~bits, bits | top)


def stable_order(values: np.ndarray, largest: bool, groups: np.ndarray | None = None) -> np.ndarray:
    """(n,) the columns of ``values`` (n,) float32 or float64 sorted by (group, key, column): exactly
    ``np.lexsort((sort_key(values, largest), groups))`` (a stable argsort of the key without groups), so ties go
    to the lowest column, NaN last, −0 tied with +0. ``groups``: (n,) non-negative ints, None: one group.
    int32 positions below 2**31 columns, else int64.

    A least-significant-digit radix sort whose digits are 32-bit: each pass sorts, in place, one 64-bit word per
    column, (digit << 32) | rank after the previous pass (an unstable integer sort that the unique words make
    stable), so a float64 key takes two passes (the low and high halves of its ordered bits), float32 one, groups
    one more. Memory: the words (8 B per column) and two 4-byte arrays, the digits and orders taking turns in
    them, filled a chunk at a time."""
    v = np.asarray(values).reshape(-1)
    if v.dtype != np.float32:
        v = v.astype(np.float64, copy=False)
    n = v.shape[0]
    if n >= 2**32:
        key = sort_key(v, largest)
        return np.argsort(key, kind="stable") if groups is None else np.lexsort((key, np.asarray(groups)))
    words = np.empty(n, dtype=np.uint64)
    spare = np.empty(n, dtype=np.uint32)  # the next pass's digits in column order, then an order
    wide = v.dtype != np.float32
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        bits = _key_bits(v[lo:hi], largest)
        spare[lo:hi] = bits >> np.uint64(32) if wide else bits
        if wide:
            words[lo:hi] = ((bits & _LOW) << np.uint64(32)) | np.arange(lo, hi, dtype=np.uint64)
    if wide:
        words.sort()
        first = _ranks(words, None, np.empty(n, dtype=np.uint32))
        order = _radix_pass(words, spare, first, spare)
        spare = first
    else:
        order = _radix_pass(words, spare, None, spare)
        spare = np.empty(n, dtype=np.uint32) if groups is not None else None
    if groups is not None:
        order = _radix_pass(words, np.asarray(groups).reshape(-1), order, spare)
    return order.view(np.int32) if n < 2**31 else order.astype(np.int64)


def _radix_pass(words: np.ndarray, digits: np.ndarray, order: np.ndarray | None, out: np.ndarray) -> np.ndarray:
    """One pass of :func:`stable_order`: ``order`` (n,) (None: the identity) re-sorted stably by ``digits`` (n,)
    non-negative ints < 2**32 of the columns (column order), with ``words`` (n,) uint64 as the sort buffer, into
    ``out`` (n,) uint32 (which may be ``digits``: they are all read before it is written; never ``order``)."""
    n = words.shape[0]
    for lo in range(0, n, CHUNK):
        hi = min(n, lo + CHUNK)
        d = digits[lo:hi] if order is None else digits[order[lo:hi]]
        words[lo:hi] = (d.astype(np.uint64) << np.uint64(32)) | np.arange(lo, hi, dtype=np.uint64)
    words.sort()
    return _ranks(words, order, out)


def _ranks(words: np.ndarray, order: np.ndarray | None, out: np.ndarray) -> np.ndarray:
    """``out`` (n,) uint32: the previous ranks in the low 32 bits of the sorted ``words`` (n,) uint64, mapped
    through ``order`` (None: the ranks themselves)."""
    for lo in range(0, words.shape[0], CHUNK):
        hi = min(words.shape[0], lo + CHUNK)
        rank = (words[lo:hi] & _LOW).astype(np.uint32)
        out[lo:hi] = rank if order is None else order[rank]
    return out


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
            order = stable_order(values, largest, groups)
            for g in range(sizes.shape[0]):
                for lo in range(int(starts[g]), int(starts[g + 1]), CHUNK):
                    hi = min(int(starts[g + 1]), lo + CHUNK)
                    ranks = np.arange(lo - starts[g], hi - starts[g], dtype=np.int64)
                    bucket[order[lo:hi]] = _bucket_of(ranks, np.full(hi - lo, sizes[g]))
            files.write(f"{name}.order", order.astype(index_type, copy=False))
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
