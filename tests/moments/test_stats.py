"""covgrad.moments.stats against naive float64 numpy on the same per-sample scores."""

from __future__ import annotations

import warnings
from unittest import mock

import dask
import dask.array as da
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import covgrad.moments.stats as stats_module
from covgrad.layout import ParamLayout, TensorEntry
from covgrad.moments.stats import (
    BLOCK_OUTPUTS,
    Moments,
    adv_rms,
    blocked_stats,
    compute_stats,
    crossfit_gap,
    crossfit_stats,
    degenerate,
    merge_moments,
    sample_moments,
    tensor_summary,
)
from covgrad.moments.topk import overlap_table

RTOL = 1e-9
N, P, B = 48, 300, 8  # samples, parameters, samples per batch


def make_scores(seed: int, n: int = N, p: int = P) -> tuple[np.ndarray, np.ndarray]:
    """Float32 scores with per-parameter scales over 4 decades and nonzero means; a few special columns."""
    rng = np.random.default_rng(seed)
    scale = 10.0 ** rng.uniform(-3, 1, p)
    S = (rng.standard_t(3, (n, p)) + rng.normal(0, 0.5, p)) * scale
    A = rng.normal(0, 1, n) + 0.3
    S[:, 0] = 2.5  # constant: Fvar = 0, rho NaN
    S[:, 1] = 3.0 * A - 1.0  # perfectly aligned with A: rho = 1
    S[:, 2] = -0.5 * A  # perfectly anti-aligned: rho = -1
    return S.astype(np.float32), A


def reference(S: np.ndarray, A: np.ndarray) -> dict[str, np.ndarray]:
    """Textbook float64 formulas (1/N), two-pass."""
    s = S.astype(np.float64)
    n = len(A)
    m = s.mean(0)
    Fvar = ((s - m) ** 2).mean(0)
    Cov = ((A - A.mean())[:, None] * (s - m)).mean(0)
    std_A = np.sqrt(((A - A.mean()) ** 2).mean())
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = np.where(Fvar > 0, Cov / (std_A * np.sqrt(Fvar)), np.nan)
        zm = n * m**2 / Fvar
    return {
        "N": n,
        "mean_A": A.mean(),
        "std_A": std_A,
        "m": m,
        "F": (s**2).mean(0),
        "Fvar": Fvar,
        "G": (A[:, None] * s).mean(0),
        "Cov": Cov,
        "rho": rho,
        "zero_mean_trace": n * (m**2).sum() / Fvar.sum(),
        "zero_mean_coord": zm[Fvar > 0].mean(),
    }


def error_scales(S: np.ndarray, A: np.ndarray) -> dict[str, np.ndarray | float]:
    """Condition scale of each statistic: the size of the terms it sums, so cancellation is not blamed."""
    s = S.astype(np.float64)
    ac = A - A.mean()
    sc = s - s.mean(0)
    return {
        "m": np.abs(s).mean(0),
        "G": (np.abs(A)[:, None] * np.abs(s)).mean(0),
        "Cov": (np.abs(ac)[:, None] * np.abs(sc)).mean(0),
        "mean_A": np.abs(A).mean(),
        "rho": 1.0,
    }


def assert_matches(got: dict, ref: dict, scales: dict) -> None:
    for name, want in ref.items():
        value = np.asarray(got[name], dtype=np.float64)
        scale = scales.get(name, np.abs(want))
        np.testing.assert_array_equal(np.isnan(value), np.isnan(want), err_msg=name)
        ok = ~np.isnan(want)
        err = np.abs(value - want)[ok]
        bound = (RTOL * np.broadcast_to(scale, np.shape(want)))[ok]
        assert np.all(err <= bound), f"{name}: max error / scale = {np.max(err / np.maximum(bound, 1e-300)) * RTOL}"


def row_by_row_moments(S: np.ndarray, A: np.ndarray, rows: int, chunk: int) -> Moments:
    """The score stage's format: one moment row per batch, stored as dask arrays chunked (1, chunk)."""
    batches = [sample_moments(S[i : i + rows], A[i : i + rows]) for i in range(0, len(A), rows)]

    def column(name: str) -> da.Array:
        stacked = np.concatenate([np.asarray(getattr(b, name)) for b in batches])
        return da.from_array(stacked, chunks=(1,) + ((chunk,) if stacked.ndim == 2 else ()))

    return Moments(*(column(n) for n in ("count", "mean_a", "m2_a", "mean_s", "m2_s", "c_as")))


def compute(stats: dict) -> dict:
    (out,) = dask.compute(stats, scheduler="threads")
    return out


PATHS = {
    "numpy-one-block": lambda S, A: sample_moments(S, A),
    "numpy-blocks": lambda S, A: sample_moments(S, A, block_rows=B),
    "numpy-uneven-blocks": lambda S, A: sample_moments(S, A, block_rows=7),
    "dask-per-sample": lambda S, A: sample_moments(da.from_array(S, chunks=(B, 128)), A),
    "dask-moment-rows": lambda S, A: row_by_row_moments(S, A, B, 128),
}


@pytest.mark.parametrize("path", PATHS, ids=list(PATHS))
@pytest.mark.parametrize("seed", [0, 1])
def test_stats_match_float64_reference(path: str, seed: int) -> None:
    S, A = make_scores(seed)
    got = compute(compute_stats(PATHS[path](S, A)))
    assert_matches(got, reference(S, A), error_scales(S, A))
    assert got["N"] == N


def test_rho_within_one_and_no_bound_violation() -> None:
    S, A = make_scores(3)
    got = compute(compute_stats(PATHS["dask-moment-rows"](S, A)))
    rho = got["rho"][~np.isnan(got["rho"])]
    assert np.all(np.abs(rho) <= 1 + 1e-12)
    assert abs(got["rho"][1] - 1) < 1e-12 and abs(got["rho"][2] + 1) < 1e-12
    assert got["bound_violations"] == 0
    assert not got["rho_undefined"]


def test_zero_mean_statistics_near_one_for_centered_scores() -> None:
    rng = np.random.default_rng(4)
    S = rng.standard_normal((4000, 200)).astype(np.float32)
    got = compute_stats(sample_moments(S, rng.standard_normal(4000), block_rows=32))
    assert 0.5 < got["zero_mean_trace"] < 2 and 0.8 < got["zero_mean_coord"] < 1.2
    biased = compute_stats(sample_moments(S + 0.2, rng.standard_normal(4000), block_rows=32))
    assert biased["zero_mean_trace"] > 50 and biased["zero_mean_coord"] > 50


def test_large_mean_naive_float32_fails_merged_moments_hold() -> None:
    rng = np.random.default_rng(5)
    n = 4096
    S = (1e4 + rng.standard_normal((n, 64))).astype(np.float32)  # mean / std = 1e4
    A = rng.standard_normal(n)
    ref = reference(S, A)
    naive = (S**2).mean(0, dtype=np.float32) - S.mean(0, dtype=np.float32) ** 2
    assert np.max(np.abs(naive - ref["Fvar"]) / ref["Fvar"]) > 1e-2
    moments = row_by_row_moments(S, A, 32, 64)
    got = compute(compute_stats(moments))
    for name in ("Fvar", "Cov", "rho"):
        scale = 1.0 if name == "rho" else np.abs(ref[name]).max()
        assert np.max(np.abs(got[name] - ref[name])) <= RTOL * scale, name


@settings(max_examples=30, deadline=None)
@given(cuts=st.lists(st.integers(1, N - 1), max_size=6, unique=True), seed=st.integers(0, 2**16))
def test_any_batching_merges_to_the_same_statistics(cuts: list[int], seed: int) -> None:
    S, A = make_scores(seed, p=40)
    bounds = [0, *sorted(cuts), N]
    rows = [sample_moments(S[a:b], A[a:b]).packed() for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    merged = merge_moments(Moments.from_packed(np.concatenate(rows)))
    whole = sample_moments(S, A)
    for name in ("count", "mean_a", "m2_a", "mean_s", "m2_s", "c_as"):
        np.testing.assert_allclose(getattr(merged, name), getattr(whole, name), rtol=1e-11, atol=1e-13)


def test_graph_building_is_lazy() -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("compute_stats computed while building the graph")

    S, A = make_scores(6)
    with dask.config.set(scheduler=refuse):
        stats = compute_stats(sample_moments(da.from_array(S, chunks=(B, 128)), da.from_array(A, chunks=B)))
        crossfit_stats(row_by_row_moments(S[:24], A[:24], B, 128), row_by_row_moments(S[24:], A[24:], B, 128))
    assert all(isinstance(v, da.Array) for v in stats.values())


@pytest.mark.parametrize("lazy", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["numpy", "dask"])
def test_constant_advantage_rho_undefined_and_warns(lazy: bool) -> None:
    S, _ = make_scores(7)
    A = np.zeros(N)
    moments = row_by_row_moments(S, A, B, 128) if lazy else sample_moments(S, A, block_rows=B)
    with pytest.warns(RuntimeWarning, match="std\\(A\\) = 0"):
        got = compute(compute_stats(moments))
    assert got["rho_undefined"] and np.all(np.isnan(got["rho"]))
    assert np.all(got["G"] == 0) and np.all(got["Cov"] == 0)
    assert got["bound_violations"] == 0


def test_no_warning_when_advantage_varies() -> None:
    S, A = make_scores(8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compute(compute_stats(row_by_row_moments(S, A, B, 128)))


@pytest.mark.parametrize("lazy", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["numpy", "dask"])
def test_fewer_than_two_samples_raises(lazy: bool) -> None:
    S, A = make_scores(9, n=1)
    moments = row_by_row_moments(S, A, 1, 128) if lazy else sample_moments(S, A)
    with pytest.raises(ValueError, match="N = 1"):
        compute(compute_stats(moments))


def test_bad_moment_rows_raise() -> None:
    good = sample_moments(*make_scores(10, n=8, p=5), block_rows=4)
    with pytest.raises(ValueError, match="m2_s has shape"):
        Moments(good.count, good.mean_a, good.m2_a, good.mean_s, good.m2_s[:, :3], good.c_as)
    with pytest.raises(ValueError, match="fewer than 1 sample"):
        Moments(np.array([4.0, 0.0]), good.mean_a, good.m2_a, good.mean_s, good.m2_s, good.c_as)
    with pytest.raises(ValueError, match="A must have shape"):
        sample_moments(np.zeros((4, 3), np.float32), np.zeros(5))


@pytest.mark.parametrize("lazy", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["numpy", "dask"])
def test_crossfit_matches_reference(lazy: bool) -> None:
    S, A = make_scores(11)
    half = (np.arange(N) // B) % 2  # batch parity stands in for prompt-group parity
    S[half == 0, 3] = 1.0  # constant in the Fisher half only: ratio = inf
    moments = row_by_row_moments(S, A, B, 128) if lazy else sample_moments(S, A, block_rows=B)
    row_half = np.arange(N // B) % 2
    got = compute(crossfit_stats(moments.subset(row_half == 0), moments.subset(row_half == 1)))
    f, c = reference(S[half == 0], A[half == 0]), reference(S[half == 1], A[half == 1])
    num, den = np.abs(c["Cov"]), c["std_A"] * np.sqrt(f["Fvar"])
    with np.errstate(divide="ignore", invalid="ignore"):
        want = num / den
    np.testing.assert_array_equal(np.isnan(got["ratio"]), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got["ratio"]), np.isinf(want))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got["ratio"][finite], want[finite], rtol=RTOL)
    assert np.isinf(got["ratio"][3]) and np.isnan(got["ratio"][0])
    assert got["n_finite"] == finite.sum() and got["n_inf"] == np.isinf(want).sum()
    assert got["n_exceed"] == (want[finite] > 1).sum() > 0
    assert got["frac_exceed"] == got["n_exceed"] / got["n_finite"]


def test_crossfit_rejects_different_P() -> None:
    S, A = make_scores(12)
    with pytest.raises(ValueError, match="different P"):
        crossfit_stats(sample_moments(S, A), sample_moments(S[:, :10], A))


@pytest.mark.parametrize("lazy", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["numpy", "dask"])
def test_tensor_summary_matches_loop(lazy: bool) -> None:
    S, A = make_scores(13)
    S[:, 10:20] = 1.0  # the whole second tensor is constant: max |rho| is NaN
    layout = ParamLayout(
        (
            TensorEntry("a.weight", 0, 10, (2, 5), "float32"),
            TensorEntry("b.bias", 10, 10, (10,), "float32"),
            TensorEntry("c.weight", 20, P - 20, (P - 20,), "float32"),
        )
    )
    moments = row_by_row_moments(S, A, B, 128) if lazy else sample_moments(S, A, block_rows=B)
    stats = compute_stats(moments)
    got = compute(tensor_summary(stats, layout))
    ref = reference(S, A)
    F_tot, G_tot = ref["F"].sum(), np.abs(ref["G"]).sum()
    for t, e in enumerate(layout.entries):
        sl = slice(e.offset, e.offset + e.numel)
        assert got["numel"][t] == e.numel
        np.testing.assert_allclose(got["F_sum"][t], ref["F"][sl].sum(), rtol=RTOL)
        np.testing.assert_allclose(got["Fvar_mean"][t], ref["Fvar"][sl].mean(), rtol=RTOL, atol=1e-300)
        np.testing.assert_allclose(got["absG_sum"][t], np.abs(ref["G"][sl]).sum(), rtol=RTOL)
        np.testing.assert_allclose(got["F_share"][t], ref["F"][sl].sum() / F_tot, rtol=RTOL)
        np.testing.assert_allclose(got["absG_share"][t], np.abs(ref["G"][sl]).sum() / G_tot, rtol=RTOL)
        rho = np.abs(ref["rho"][sl])
        want = np.nan if np.isnan(rho).all() else np.nanmax(rho)
        np.testing.assert_allclose(got["max_abs_rho"][t], want, rtol=RTOL)
    assert np.isnan(got["max_abs_rho"][1])
    with pytest.raises(ValueError, match="layout has P"):
        tensor_summary({k: v[:-1] if np.ndim(v) else v for k, v in stats.items()}, layout)


def test_local_cluster_gives_same_numbers_as_threads() -> None:
    from distributed import Client, LocalCluster

    S, A = make_scores(14)
    stats = compute_stats(row_by_row_moments(S, A, B, 128))
    threaded = compute(stats)
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=None) as cluster,
        Client(cluster),
    ):
        (distributed,) = dask.compute(stats)
    for name, value in threaded.items():
        np.testing.assert_array_equal(distributed[name], value, err_msg=name)


LAYOUT = ParamLayout(
    (
        TensorEntry("a.weight", 0, 10, (2, 5), "float32"),
        TensorEntry("b.bias", 10, 10, (10,), "float32"),
        TensorEntry("c.weight", 20, P - 20, (P - 20,), "float32"),
    )
)


def blocked(S: np.ndarray, A: np.ndarray, parity: np.ndarray, lazy: bool, chunk: int = 7):
    """blocked_stats of per-sample scores (N, P) split into prompt-group halves by ``parity`` (N,), with
    blocks of 2 chunks of ``chunk``; returns the result, the filled (P,) arrays and the reads made."""
    reads: list[tuple[slice, bool]] = []

    def moments(rows: np.ndarray, cols: slice) -> Moments:
        if lazy:
            return sample_moments(da.from_array(S[rows][:, cols], chunks=(B, chunk)), A[rows])
        return sample_moments(S[rows][:, cols], A[rows], block_rows=B)

    def read(cols: slice, halves: bool) -> tuple[Moments, ...]:
        reads.append((cols, halves))
        every = np.ones(len(A), dtype=bool)
        return tuple(moments(rows, cols) for rows in ((every, parity == 0, parity == 1) if halves else (every,)))

    out = {name: np.full(P, -1.0) for name in BLOCK_OUTPUTS}
    counts = (len(A), int((parity == 0).sum()), int((parity == 1).sum()))
    with mock.patch.object(stats_module, "BLOCK_CHUNKS", 2):
        result = blocked_stats(read, counts, LAYOUT, out, chunk=chunk)
    return result, out, reads


@pytest.mark.parametrize("lazy", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["numpy", "dask"])
def test_blocked_stats_equal_the_whole_axis(lazy: bool) -> None:
    """Blocks of 14 parameters give the (P,) statistics, the scalars, the cross-fit counts, the per-tensor
    summaries and the overlap of one whole-axis reduction."""
    S, A = make_scores(15)
    parity = (np.arange(N) // B) % 2
    result, out, reads = blocked(S, A, parity, lazy)
    assert [r[0] for r in reads] == [slice(j, min(P, j + 14)) for j in range(0, P, 14)] and all(h for _, h in reads)
    whole = compute_stats(sample_moments(S, A, block_rows=B))
    even, odd = sample_moments(S[parity == 0], A[parity == 0]), sample_moments(S[parity == 1], A[parity == 1])
    cross = [crossfit_stats(even, odd), crossfit_stats(odd, even)]
    for name in BLOCK_OUTPUTS:
        want = cross[0]["ratio"] if name == "crossfit_ratio" else whole[name]
        np.testing.assert_allclose(out[name], want, rtol=1e-12, atol=1e-300, err_msg=name)
    sc = result.scalars
    assert (sc["N"], sc["P"], sc["bound_violations"], sc["rho_undefined"]) == (N, P, 0, False)
    for name in ("mean_A", "std_A", "zero_mean_trace", "zero_mean_coord"):
        np.testing.assert_allclose(sc[name], whole[name], rtol=1e-12, err_msg=name)
    np.testing.assert_allclose(sc["max_abs_rho"], np.nanmax(np.abs(whole["rho"])), rtol=1e-12)
    np.testing.assert_allclose(sc["adv_rms"], np.sqrt(np.mean(A * A)), rtol=1e-12)
    for tag, c in zip(("even_F_odd_G", "odd_F_even_G"), cross, strict=True):
        for name in ("n_exceed", "n_finite", "frac_exceed"):
            assert result.crossfit[f"crossfit_{tag}_{name}"] == c[name], (tag, name)
    overlap = overlap_table(out["F"], np.abs(out["G"]), LAYOUT, [0.01])
    assert sc["overlap_1pct"] == next(r["overlap"] for r in overlap if r["scope"] == "global")
    summary = tensor_summary(out, LAYOUT)
    for name, values in summary.items():
        np.testing.assert_allclose(result.tensors[name], values, rtol=1e-12, err_msg=name)
    assert result.degenerate is None and result.crossfit_undefined is None and result.notes == []


def test_blocked_stats_findings() -> None:
    """N < 2: NaN arrays, nothing read; one prompt group: no cross-fit read, NaN ratios; std(A) = 0: a
    finding, no overlap."""
    S, A = make_scores(16)
    result, out, reads = blocked(S[:1], A[:1], np.zeros(1, dtype=np.int64), lazy=False)
    assert reads == [] and all(np.isnan(out[name]).all() for name in BLOCK_OUTPUTS)
    assert result.degenerate.startswith("too few samples: N = 1") and result.notes == [result.degenerate]
    assert result.scalars["N"] == 1 and np.isnan(result.scalars["adv_rms"])
    result, out, reads = blocked(S, A, np.zeros(N, dtype=np.int64), lazy=False)
    assert reads and not any(h for _, h in reads) and np.isnan(out["crossfit_ratio"]).all()
    assert result.degenerate is None and result.notes == [result.crossfit_undefined]
    assert result.crossfit_undefined.startswith("cross-fit undefined: the odd prompt groups hold N = 0")
    assert result.crossfit["crossfit_even_F_odd_G_n_finite"] == 0
    assert np.isnan(result.crossfit["crossfit_even_F_odd_G_frac_exceed"])
    result, _, _ = blocked(S, np.full(N, 0.5), (np.arange(N) // B) % 2, lazy=False)
    assert result.degenerate.startswith("no reward variance") and np.isnan(result.scalars["overlap_1pct"])
    assert result.scalars["adv_rms"] == 0.5


def test_degenerate_conditions_and_adv_rms() -> None:
    assert degenerate(8, True, 0.5) is None
    assert degenerate(8, False, 0.5).startswith("no scored tokens")
    assert crossfit_gap(1, 4).startswith("cross-fit undefined: the even prompt groups hold N = 1 samples")
    assert adv_rms(3.0, 4.0) == 5.0
