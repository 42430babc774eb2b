"""covgrad.moments.topk against stable argsort, naive average ranks and brute-force set counts."""

from __future__ import annotations

import math
from unittest import mock

import dask.array as da
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import covgrad.moments.topk as topk_module
from covgrad.layout import ParamLayout, TensorEntry
from covgrad.moments.topk import (
    bound_mask_table,
    count_for_fraction,
    overlap_table,
    spearman,
    top_k_masks,
    topk_global,
    topk_indices,
    topk_per_tensor,
)
from tests.helpers.ranks import naive_spearman


def reference_topk(values: np.ndarray, k: int) -> set[int]:
    """The k first of a stable descending argsort, minus the NaNs argsort puts last."""
    top = np.argsort(-values, kind="stable")[:k]
    return set(top[~np.isnan(values[top])].tolist())


def bf16(x: np.ndarray) -> np.ndarray:
    """Round-toward-zero to bfloat16 and back: heavy ties."""
    return (x.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


@st.composite
def value_arrays(draw: st.DrawFn) -> np.ndarray:
    kind = draw(st.sampled_from(["float32", "float64", "bf16", "few", "float64-ties-in-float32"]))
    n = draw(st.integers(1, 200))
    if kind == "few":  # a handful of distinct values incl. ±0, ±inf, NaN
        pool = np.array([0.0, -0.0, 1.0, -1.0, 2.5, np.inf, -np.inf, np.nan], dtype=np.float32)
        return pool[draw(hnp.arrays(np.int64, n, elements=st.integers(0, len(pool) - 1)))]
    width = 32 if kind in ("float32", "bf16") else 64
    elements = st.floats(allow_nan=True, allow_infinity=True, width=width)
    values = draw(hnp.arrays(np.float32 if width == 32 else np.float64, n, elements=elements))
    if kind == "bf16":
        return bf16(values)
    if kind == "float64-ties-in-float32":  # distinct in float64, equal after float32 rounding
        base = draw(st.floats(-1e3, 1e3, width=32))
        offsets = draw(hnp.arrays(np.int64, n, elements=st.integers(-3, 3)))
        return base + offsets * abs(base) * 1e-12
    return values


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(values=value_arrays(), data=st.data())
def test_topk_equals_stable_argsort(values: np.ndarray, data: st.DataObject) -> None:
    P = len(values)
    k = data.draw(st.one_of(st.just(0), st.just(P), st.integers(0, P)), label="k")
    want = reference_topk(values, k)
    chunk = data.draw(st.integers(1, P), label="chunk")
    candidates = data.draw(st.sampled_from([1, 3, 1 << 22]), label="candidates")  # small: narrow to 64 bits
    with mock.patch.object(topk_module, "BLOCK", chunk), mock.patch.object(topk_module, "_CANDIDATES", candidates):
        got_dask = topk_indices(da.from_array(values, chunks=max(1, chunk // 2)), k)
        got_numpy = topk_indices(values, k)
    for got in (got_numpy, got_dask):
        assert got.dtype == np.int64 and np.all(np.diff(got) > 0)
        assert set(got.tolist()) == want


def test_bf16_ties_break_by_lowest_index() -> None:
    rng = np.random.default_rng(0)
    values = bf16(rng.standard_normal(50_000).astype(np.float32))
    k = 5000
    got = topk_indices(da.from_array(values, chunks=4096), k)
    threshold = values[got].min()
    ties = np.flatnonzero(values == threshold)
    assert len(ties) > 1 and not set(ties.tolist()) <= set(got.tolist())  # the cut runs through the ties
    assert set(got.tolist()) == reference_topk(values, k)


def test_nan_excluded_even_when_k_exceeds_the_numbers() -> None:
    values = np.array([np.nan, 1.0, np.nan, -2.0, np.nan], dtype=np.float32)
    np.testing.assert_array_equal(topk_indices(values, 5), [1, 3])
    np.testing.assert_array_equal(topk_indices(np.full(4, np.nan), 2), np.zeros(0, np.int64))


def stable_prefix_mask(values: np.ndarray, k: int, largest: bool) -> np.ndarray:
    """(P,) bool mask of the first k of numpy's stable argsort, best first, NaN as the worst infinity."""
    v = values.astype(np.float64)
    key = np.where(np.isnan(v), np.inf, -v if largest else v)  # ascending key: best first
    mask = np.zeros(len(v), dtype=bool)
    mask[np.argsort(key, kind="stable")[:k]] = True
    return mask


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_top_k_masks_equal_stable_argsort_prefixes(largest: bool, dtype: type) -> None:
    """Every k from 0 to P on random values with many ties, ±0, ±inf and NaN, blocks and key bins small
    enough that the search narrows and the ties cross block boundaries."""
    rng = np.random.default_rng(5)
    P = 600
    values = rng.integers(-3, 4, P).astype(np.float64) * 0.5
    values[rng.integers(0, P, 30)] = np.nan
    values[rng.integers(0, P, 5)] = np.inf
    values[rng.integers(0, P, 5)] = -np.inf
    values[rng.integers(0, P, 20)] = -0.0
    values[:100] = rng.standard_normal(100)  # distinct values too
    values = values.astype(dtype)
    before = values.copy()
    ks = list(range(P + 1))
    with mock.patch.object(topk_module, "BLOCK", 37), mock.patch.object(topk_module, "_CANDIDATES", 3):
        masks = list(top_k_masks(values, ks, largest))
    for k, mask in zip(ks, masks, strict=True):
        assert mask.dtype == np.bool_ and int(mask.sum()) == k
        np.testing.assert_array_equal(mask, stable_prefix_mask(values, k, largest), err_msg=f"k = {k}")
    np.testing.assert_array_equal(values, before)  # the input is left as it was
    with pytest.raises(ValueError, match="outside"):
        next(top_k_masks(values, [P + 1]))
    with pytest.raises(ValueError, match="flat"):
        next(top_k_masks(values.reshape(2, -1), [1]))


@settings(max_examples=100, deadline=None)
@given(values=value_arrays(), data=st.data())
def test_top_k_masks_equal_stable_argsort_property(values: np.ndarray, data: st.DataObject) -> None:
    P = len(values)
    ks = data.draw(st.lists(st.integers(0, P), min_size=1, max_size=5), label="ks")
    largest = data.draw(st.booleans(), label="largest")
    block = data.draw(st.integers(1, P), label="block")
    with mock.patch.object(topk_module, "BLOCK", block):
        for k, mask in zip(ks, top_k_masks(values, ks, largest), strict=True):
            np.testing.assert_array_equal(mask, stable_prefix_mask(values, k, largest))


@pytest.mark.parametrize(
    ("values", "k", "match"),
    [
        (np.zeros((2, 2), np.float32), 1, "1-D float32/float64"),
        (np.arange(4), 1, "1-D float32/float64"),
        (np.zeros(4, np.float32), 5, "integer in \\[0, P = 4\\]"),
        (np.zeros(4, np.float32), -1, "integer in"),
        (np.zeros(4, np.float32), 2.0, "integer in"),
    ],
)
def test_bad_topk_input_raises(values: np.ndarray, k: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        topk_indices(values, k)


def test_count_for_fraction() -> None:
    assert count_for_fraction(0.07, 100) == 7  # 0.07 * 100 = 7.000000000000001 in float64
    assert count_for_fraction(0.01, 150) == 2
    assert count_for_fraction(1.0, 9) == 9
    for q in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="must be in \\(0, 1\\]"):
            count_for_fraction(q, 10)


LAYOUT = ParamLayout(
    (
        TensorEntry("embed.weight", 0, 600, (60, 10), "float32"),
        TensorEntry("norm.weight", 600, 10, (10,), "float32"),
        TensorEntry("head.weight", 610, 390, (39, 10), "float32"),
    )
)


def scope_reference(values: np.ndarray, q: float, scope: str) -> set[int]:
    if scope == "global":
        return reference_topk(values, math.ceil(round(q * len(values), 6)))
    out: set[int] = set()
    for e in LAYOUT.entries:
        part = reference_topk(values[e.offset : e.offset + e.numel], math.ceil(round(q * e.numel, 6)))
        out |= {e.offset + i for i in part}
    return out


def correlated_pair(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    scale = np.repeat(rng.uniform(0.1, 10, 3), [600, 10, 390])  # tensors differ in scale
    F = bf16(scale * rng.exponential(1, LAYOUT.P))
    absG = bf16(np.sqrt(F) * rng.uniform(0, 1, LAYOUT.P))
    return F.astype(np.float64), absG


@pytest.mark.parametrize("q", [0.001, 0.01, 0.05, 0.3, 1.0])
def test_scopes_match_reference(q: float) -> None:
    F, _ = correlated_pair(1)
    assert set(topk_global(F, q).tolist()) == scope_reference(F, q, "global")
    assert set(topk_per_tensor(da.from_array(F, chunks=128), LAYOUT, q).tolist()) == scope_reference(F, q, "per_tensor")
    with pytest.raises(ValueError, match="layout has P"):
        topk_per_tensor(F[:-1], LAYOUT, q)


@pytest.mark.parametrize("lazy", [False, True], ids=["numpy", "dask"])
def test_overlap_table_matches_brute_force(lazy: bool) -> None:
    F, absG = correlated_pair(2)
    qs = (0.01, 0.1)
    args = (da.from_array(F, chunks=256), da.from_array(absG, chunks=256)) if lazy else (F, absG)
    rows = overlap_table(*args, LAYOUT, qs)
    assert [(r["q"], r["scope"]) for r in rows] == [(q, s) for q in qs for s in ("global", "per_tensor")]
    for row in rows:
        top_G = scope_reference(absG, row["q"], row["scope"])
        top_F = scope_reference(F, row["q"], row["scope"])
        expected = 0.0
        for e in LAYOUT.entries:
            inside = set(range(e.offset, e.offset + e.numel))
            expected += len(top_G & inside) * len(top_F & inside) / e.numel
        assert (row["n_G"], row["n_F"], row["n_both"]) == (len(top_G), len(top_F), len(top_G & top_F))
        assert row["overlap"] == len(top_G & top_F) / len(top_G)
        assert row["random"] == len(top_F) / LAYOUT.P
        assert row["per_tensor_random"] == pytest.approx(expected / len(top_G), rel=1e-12)
        assert row["overlap"] > row["random"]  # absG is built from F


def test_overlap_of_identical_rankings_is_one() -> None:
    F, _ = correlated_pair(3)
    for row in overlap_table(F, F, LAYOUT, (0.05,)):
        assert row["overlap"] == 1.0


@settings(max_examples=100, deadline=None)
@given(
    pairs=hnp.arrays(
        np.float64,
        st.tuples(st.integers(2, 60), st.just(2)),
        elements=st.sampled_from([-1.5, -0.0, 0.0, 1.0, 2.0, 7.0]),
    ),
)
def test_spearman_matches_definition_with_ties(pairs: np.ndarray) -> None:
    x, y = pairs[:, 0], pairs[:, 1]
    if len(np.unique(x)) == 1 or len(np.unique(y)) == 1:
        assert math.isnan(spearman(x, y))
    else:
        assert spearman(x, y) == pytest.approx(naive_spearman(x, y), abs=1e-12)


def test_spearman_continuous_and_bad_input() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal(300)
    y = x + rng.standard_normal(300)
    assert spearman(x, y) == pytest.approx(naive_spearman(x, y), abs=1e-12)
    assert spearman(x, np.exp(x)) == pytest.approx(1.0, abs=1e-15)
    with pytest.raises(ValueError, match="NaN"):
        spearman(np.array([1.0, np.nan, 2.0]), x[:3])
    with pytest.raises(ValueError, match="equal length"):
        spearman(x, y[:-1])


@pytest.mark.parametrize("lazy", [False, True], ids=["numpy", "dask"])
def test_bound_mask_table(lazy: bool) -> None:
    rng = np.random.default_rng(5)
    n, p = 64, 2000
    S = rng.standard_normal((n, p)) * rng.uniform(0.1, 3, p)
    A = rng.standard_normal(n)
    std_A = A.std()
    Fvar = S.var(0)
    absCov = np.abs(((A - A.mean())[:, None] * (S - S.mean(0))).mean(0))
    qs = (0.01, 0.1)
    args = (da.from_array(Fvar, chunks=500), da.from_array(absCov, chunks=500)) if lazy else (Fvar, absCov)
    rows = bound_mask_table(std_A, *args, qs=qs) + bound_mask_table(std_A, *args, taus=[0.5])
    assert [r["q"] for r in rows] == [*qs, None]
    for row in rows:
        tau = row["tau"]
        if row["q"] is not None:
            assert tau == np.sort(absCov)[-math.ceil(row["q"] * p)]
        bound = std_A * np.sqrt(Fvar) >= tau
        cov = absCov >= tau
        assert (row["n_bound"], row["n_cov"], row["n_both"]) == (bound.sum(), cov.sum(), (bound & cov).sum())
        assert row["recall"] == 1.0
        assert row["precision"] == (bound & cov).sum() / bound.sum() < 1
    with pytest.raises(ValueError, match="NaN"):
        bound_mask_table(std_A, Fvar, absCov, taus=[np.nan])
