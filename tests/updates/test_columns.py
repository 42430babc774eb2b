"""The tracker's column files and rank buckets against a whole-array numpy recount."""

from __future__ import annotations

import numpy as np
import pytest

from covgrad.updates.columns import NB, ColumnFiles, Ranking
from covgrad.updates.tracking import group_ranks


def brute_top_counts(values, largest, groups, member, k):
    """(G,) |member ∩ top k_g of group g| with ties by the lowest column and NaN last, by argsort."""
    out = np.zeros(len(k), dtype=np.int64)
    g_of = np.zeros(values.shape[0], dtype=int) if groups is None else groups
    for g in range(len(k)):
        idx = np.flatnonzero(g_of == g)
        v = values[idx]
        key = np.where(np.isnan(v), np.inf, -v if largest else v)
        top = idx[np.argsort(key, kind="stable")[: k[g]]]
        out[g] = member[top].sum()
    return out


def counts(r: Ranking, files: ColumnFiles, member, k, groups, n, chunk=37):
    """Ranking's exact count: buckets below the threshold (scanned in chunks) plus the boundary slice."""
    b = r.thresholds(k)
    total = r.boundary(files, k, member)
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        s = member[lo:hi]
        total += r.below(files.read(f"{r.name}.bucket", lo, hi)[s], None if groups is None else groups[lo:hi][s], b)
    return total


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("grouped", [False, True])
def test_bucketed_top_k_counts_equal_argsort(tmp_path, largest, grouped):
    rng = np.random.default_rng(7)
    n = 3 * NB + 101  # several columns per bucket, and a group smaller than NB
    values = rng.integers(-20, 20, n).astype(np.float64) / 4  # many ties
    values[rng.choice(n, 25, replace=False)] = np.nan
    values[rng.choice(n, 10, replace=False)] = -0.0
    groups = rng.integers(0, 4, n) if grouped else None
    G = 4 if grouped else 1
    sizes = np.bincount(groups, minlength=G) if grouped else np.asarray([n])
    files = ColumnFiles(str(tmp_path))
    r = Ranking.build(files, "p", values, largest, groups, sizes)
    for _ in range(15):
        member = rng.random(n) < rng.uniform(0.01, 0.9)
        k = np.asarray([rng.integers(0, s + 2) for s in sizes])
        k = np.minimum(k, sizes) if rng.random() < 0.5 else k
        want = brute_top_counts(values, largest, groups, member, np.minimum(k, sizes))
        np.testing.assert_array_equal(counts(r, files, member, k, groups, n), want)
    files.close()


def test_shards_count_what_the_whole_layout_counts(tmp_path):
    """Two shards with ranks over both (as covgrad.distributed.stepper's ranker gives them) sum to the whole."""
    rng = np.random.default_rng(11)
    n = 2 * NB + 77
    values = rng.integers(-9, 9, n).astype(np.float64)
    groups = rng.integers(0, 3, n)
    sizes = np.bincount(groups, minlength=3)
    whole = group_ranks(values, True, groups)
    halves = [np.sort(rng.choice(n, n // 2, replace=False))]
    halves.append(np.setdiff1d(np.arange(n), halves[0]))
    shards = []
    for i, index in enumerate(halves):
        files = ColumnFiles(str(tmp_path))
        ranking = Ranking.build(
            files, f"s{i}", values[index], True, groups[index], sizes, lambda v, big, g, ix=index: whole[ix]
        )
        shards.append((index, files, ranking))
    for _ in range(12):
        member = rng.random(n) < 0.3
        k = np.asarray([rng.integers(0, s + 1) for s in sizes])
        got = sum(counts(r, f, member[ix], k, groups[ix], ix.shape[0]) for ix, f, r in shards)
        np.testing.assert_array_equal(got, brute_top_counts(values, True, groups, member, k))


def test_column_files_read_ranges_and_refuse_outside(tmp_path):
    files = ColumnFiles(str(tmp_path))
    files.write("x", np.arange(100, dtype=np.int32))
    np.testing.assert_array_equal(files.read("x", 10, 20), np.arange(10, 20))
    assert files.search("x", 10, 20, [0, 15, 99]) == [0, 5, 10]
    with pytest.raises(ValueError, match=r"column range \[90, 101\)"):
        files.read("x", 90, 101)
    files.close()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("chunk", [None, 64])
def test_fast_order_is_the_stable_argsort(dtype, grouped, chunk, monkeypatch):
    """The integer-key sort orders columns as a stable argsort of the sort key within groups: ties (many),
    ±0, ±inf and NaN included; in one chunk and in many (a chunk of 64 columns)."""
    from covgrad.updates import columns
    from covgrad.updates.columns import sort_key, stable_order

    if chunk is not None:
        monkeypatch.setattr(columns, "CHUNK", chunk)

    rng = np.random.default_rng(5)
    n = 5000
    v = (rng.integers(-30, 30, n) / 8).astype(dtype)
    v[rng.choice(n, 40, replace=False)] = np.nan
    v[rng.choice(n, 40, replace=False)] = -0.0
    v[rng.choice(n, 10, replace=False)] = np.inf
    v[rng.choice(n, 10, replace=False)] = -np.inf
    if dtype == np.float64:  # values float32 cannot tell apart
        v[:100] = 1.0 + np.arange(100) * 1e-12
    groups = rng.integers(0, 5, n) if grouped else None
    for largest in (True, False):
        key = sort_key(v, largest)
        want = np.argsort(key, kind="stable") if groups is None else np.lexsort((key, groups))
        np.testing.assert_array_equal(stable_order(v, largest, groups), want)


def test_fast_order_of_continuous_float64_is_the_stable_argsort(monkeypatch):
    """Continuous float64 values, most of them tied in float32 and some exactly tied, in many chunks."""
    from covgrad.updates import columns
    from covgrad.updates.columns import sort_key, stable_order

    monkeypatch.setattr(columns, "CHUNK", 1000)
    rng = np.random.default_rng(11)
    v = rng.standard_normal(20_000) * 1e-6
    v = 1.0 + (v - v % 1e-9)  # values a float32 rounds to a handful of keys; exact ties among them
    v[rng.choice(v.shape[0], 500, replace=False)] = 0.0
    groups = rng.integers(0, 7, v.shape[0]).astype(np.int8)
    for largest in (True, False):
        key = sort_key(v, largest)
        order = stable_order(v, largest)
        assert order.dtype == np.int32
        np.testing.assert_array_equal(order, np.argsort(key, kind="stable"))
        np.testing.assert_array_equal(stable_order(v, largest, groups), np.lexsort((key, groups)))
