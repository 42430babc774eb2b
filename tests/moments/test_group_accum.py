"""The prompt-group moments of GroupAccumulator against numpy float64 of the groups' sums, and the clustered
standard error of covgrad.regimes.errors.clustered_mean_se against its formula."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from covgrad.moments import accum
from covgrad.moments.accum import GroupAccumulator
from covgrad.regimes.errors import clustered_mean_se, moment_mean_se
from tests.helpers.moments import assert_close, numpy_moments, state

TOL = {"float64": 1e-9, "float32": 1e-5}
GROUP_TOL = 2e-6  # the groups' sums are float32 GEMMs of the float32 rows (relative error ≲ size·6e-8)
SIZES = {"equal": [4] * 10, "unequal": [3, 5, 1, 4, 2, 6, 3, 1, 2, 5]}


def _data(seed: int, sizes: list[int], P: int = 257) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int]]]:
    """Rows (N, P) float32 with a per-group offset (the samples of a group alike), each sample's group id and
    batches of whole groups (one of a single group)."""
    rng = np.random.default_rng(seed)
    group = np.repeat(np.arange(len(sizes)) + 100, sizes)
    S = rng.standard_normal((len(group), P)) + 3 * rng.standard_normal((len(sizes), P))[group - 100]
    ends = np.cumsum(sizes)
    cuts = [0, *ends[[0, 1, 4, 5]].tolist(), int(ends[-1])]
    return S.astype(np.float32), group, list(zip(cuts[:-1], cuts[1:], strict=True))


def _fold(acc: GroupAccumulator, S: np.ndarray, group: np.ndarray, batches: list[tuple[int, int]]) -> None:
    for lo, hi in batches:
        acc.set_groups(group[lo:hi])
        acc.begin_batch(np.zeros(hi - lo), group[lo:hi] % 2)
        for c0, c1 in ((0, 100), (100, 101), (101, S.shape[1])):  # tensors folded in pieces
            acc.fold(c0, torch.from_numpy(S[lo:hi, c0:c1]))
        acc.end_batch()


def _group_sums(S: np.ndarray, group: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each group's Σ of its rows (C, P) float64, its size (C,) and its half (C,)."""
    ids = np.unique(group)
    sums = np.stack([S[group == c].astype(np.float64).sum(0) for c in ids])
    return sums, np.array([np.sum(group == c) for c in ids], np.float64), ids % 2


def _clustered(S: np.ndarray, group: np.ndarray) -> np.ndarray:
    """√(C/(C − 1)·Σ_c (S_c − n_c·mean)²) / N, straight from the rows."""
    sums, n_c, _ = _group_sums(S, group)
    G = S.astype(np.float64).mean(0)
    C, N = len(n_c), len(group)
    return np.sqrt(C / (C - 1) * ((sums - n_c[:, None] * G) ** 2).sum(0)) / N


@pytest.mark.parametrize("sums", ["index_add", "product"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("state_dtype", ["float64", "float32"])
@pytest.mark.parametrize("sizes", list(SIZES), ids=list(SIZES))
def test_state_is_the_moments_of_the_groups_sums(sizes, state_dtype, compiled, sums, monkeypatch):
    """Both ways of forming the groups' sums (the product is cuda's; run here on the CPU)."""
    monkeypatch.setattr(accum, "PRODUCT_SUMS", ("cpu",) if sums == "product" else ())
    S, group, batches = _data(len(sizes), SIZES[sizes])
    equal = sizes == "equal"
    acc = GroupAccumulator(S.shape[1], "cpu", state_dtype, compiled=compiled, comoment=not equal)
    _fold(acc, S, group, batches)
    sums, n_c, half = _group_sums(S, group)
    want = numpy_moments(sums, n_c, half)
    if equal:
        want.pop("c_as")
        assert "c_as" not in acc.rows()
    assert_close(state(acc), want, max(GROUP_TOL, TOL[state_dtype]))
    assert acc.fold_path == ("compiled" if compiled else "eager")


@pytest.mark.parametrize("sizes", list(SIZES), ids=list(SIZES))
def test_clustered_se_is_its_formula_per_half_and_over_both(sizes):
    S, group, batches = _data(7 + len(sizes), SIZES[sizes])
    acc = GroupAccumulator(S.shape[1], "cpu", comoment=sizes == "unequal")
    _fold(acc, S, group, batches)
    r = acc.rows()
    for rows in ([0], [1], [0, 1]):
        G, se, C = clustered_mean_se(
            r["count"][rows],
            r["mean_a"][rows],
            r["m2_a"][rows],
            r["mean_s"][rows],
            r["m2_s"][rows],
            r["c_as"][rows] if "c_as" in r else None,
        )
        sel = np.isin(group % 2, rows)
        assert len(np.unique(group[sel])) == C
        mean = S[sel].astype(np.float64).mean(0)
        np.testing.assert_allclose(G, mean, rtol=0, atol=GROUP_TOL * np.abs(mean).max())
        np.testing.assert_allclose(se, _clustered(S[sel], group[sel]), rtol=GROUP_TOL)
        iid = S[sel].astype(np.float64).std(0, ddof=1) / np.sqrt(sel.sum())
        assert np.median(se / iid) > 1.5  # the groups' shared offsets: samples of one group are not independent


def test_groups_of_one_sample_give_the_independent_standard_error():
    S, group, batches = _data(3, [1] * 40)
    acc = GroupAccumulator(S.shape[1], "cpu")
    _fold(acc, S, group, batches)
    r = acc.rows()
    se = clustered_mean_se(r["count"], r["mean_a"], r["m2_a"], r["mean_s"], r["m2_s"])[1]
    S64 = S.astype(np.float64)
    want = moment_mean_se(np.array([40.0]), S64.mean(0)[None], (S64.var(0) * 40)[None])
    np.testing.assert_allclose(se, want[1], rtol=1e-6)


def test_a_resumed_group_accumulator_ends_with_the_same_bytes():
    S, group, batches = _data(5, SIZES["unequal"])
    whole = GroupAccumulator(S.shape[1], "cpu", comoment=True)
    _fold(whole, S, group, batches)
    first = GroupAccumulator(S.shape[1], "cpu", comoment=True)
    _fold(first, S, group, batches[:2])
    resumed = GroupAccumulator(S.shape[1], "cpu", comoment=True)
    resumed.load(first.rows())
    _fold(resumed, S, group, batches[2:])
    for k, v in whole.rows().items():
        np.testing.assert_array_equal(resumed.rows()[k], v, err_msg=k)


def test_group_accumulator_refuses_what_it_cannot_fold():
    acc = GroupAccumulator(3, "cpu")
    with pytest.raises(ValueError, match="set_groups before each batch"):
        acc.begin_batch(np.zeros(2), np.array([0, 0]))
    acc.set_groups(np.array([4, 4]))
    with pytest.raises(ValueError, match="prompt group 4 has samples in two halves"):
        acc.begin_batch(np.zeros(2), np.array([0, 1]))
    acc.set_groups(np.array([4, 4, 6]))
    with pytest.raises(ValueError, match=r"sizes \[1.0, 2.0\]; make the accumulator with comoment=True"):
        acc.begin_batch(np.zeros(3), np.array([0, 0, 0]))
    with pytest.raises(ValueError, match="fold called outside a batch"):
        acc.fold(0, torch.zeros(2, 3))
    acc.set_groups(np.array([4, 4, 6, 6]))
    acc.begin_batch(np.zeros(4), np.zeros(4))
    with pytest.raises(ValueError, match="block of 2 samples does not fit the batch of 4"):
        acc.fold(0, torch.zeros(2, 3))


def test_the_clustered_allowance_keeps_its_level_where_the_independent_one_does_not():
    """Coordinates whose true mean is 0, with samples of one prompt moving together (a per-group offset of 3×
    the within-group noise): |G| > 3·se at about the nominal rate with the clustered error (t with C − 1 = 39
    degrees of freedom: 0.5%), and far above it with the independent-samples error."""
    rng = np.random.default_rng(11)
    sizes, P = [8] * 40, 4000
    group = np.repeat(np.arange(len(sizes)), sizes)
    S = (rng.standard_normal((len(group), P)) + 3 * rng.standard_normal((len(sizes), P))[group]).astype(np.float32)
    acc = GroupAccumulator(P, "cpu")
    _fold(acc, S, group, [(lo, lo + 32) for lo in range(0, len(group), 32)])
    r = acc.rows()
    G, se, _ = clustered_mean_se(r["count"], r["mean_a"], r["m2_a"], r["mean_s"], r["m2_s"])
    iid = S.astype(np.float64).std(0, ddof=1) / np.sqrt(len(group))
    assert np.mean(np.abs(G) > 3 * se) < 0.015
    assert np.mean(np.abs(G) > 3 * iid) > 0.2


def test_a_half_with_one_prompt_group_has_no_standard_error():
    """regime_gradient of a fold whose half 0 holds one group: G of every half, C = (3, 1, 2), and no standard
    error (NaN) where fewer than 2 groups are (so the regimes table reports no allowance count there)."""
    from storage.stores.regimes import regime_gradient

    group = np.repeat([100, 101, 103], 4)  # one group in half 0, two in half 1
    S = np.random.default_rng(2).standard_normal((12, 257)).astype(np.float32)
    acc = GroupAccumulator(S.shape[1], "cpu")
    _fold(acc, S, group, [(0, 4), (4, 12)])
    (G, se, N, C), (G0, se0, N0, C0), (G1, se1, N1, C1) = regime_gradient(acc.rows(), slice(None))
    assert (N, N0, N1) == (12.0, 4.0, 8.0) and (C, C0, C1) == (3.0, 1.0, 2.0)
    assert np.isnan(se0).all() and np.isfinite(se).all() and np.isfinite(se1).all()
    for got, rows in ((G, slice(None)), (G0, slice(0, 4)), (G1, slice(4, 12))):
        mean = S[rows].astype(np.float64).mean(0)
        np.testing.assert_allclose(got, mean, rtol=0, atol=GROUP_TOL * np.abs(mean).max())
    want = _clustered(S[4:], group[4:])
    np.testing.assert_allclose(se1, want, rtol=0, atol=GROUP_TOL * want.max())
