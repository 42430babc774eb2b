"""The offpolicy stage against the stats stores it reads: rel_diff_G against a direct numpy float64
computation (whole-P and in blocks that do not divide P), every other column copied from the stats
artifacts, the same rows in its zarr store, JSON and CSV, and the report showing them unchanged."""

import csv
import io
import json
import math

import numpy as np
import pytest

from covgrad.moments.stats import rel_diff
from storage.artifacts import ArtifactStore
from tasks.offpolicy import COMPARED, offpolicy_rows, rel_diff_G


def numpy_rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    """‖a − b‖ / ‖a‖ in one float64 pass (the reference)."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    return math.sqrt(((a - b) ** 2).sum()) / math.sqrt((a**2).sum())


def test_rel_diff_in_blocks_equals_one_float64_pass():
    """Any block lengths (one element, a length that does not divide P, P, more than P) give the one-pass
    value; float32 input is accumulated in float64; ‖a‖ = 0 or a NaN entry gives NaN."""
    rng = np.random.default_rng(5)
    a = (rng.standard_normal(10_007) * 1e-4).astype(np.float32)
    b = a + (rng.standard_normal(10_007) * 3e-5).astype(np.float32)
    want = numpy_rel_diff(a, b)
    for block in (1, 7, 4096, 10_007, 65_536):
        assert rel_diff_G(a, b, block) == pytest.approx(want, rel=1e-12), block
    assert math.isnan(rel_diff([(np.zeros(3), np.ones(3))]))
    assert math.isnan(rel_diff([(np.array([1.0, np.nan]), np.zeros(2))]))
    with pytest.raises(ValueError, match="differ in shape"):
        rel_diff_G(a, b[:-1], 7)


BLAS_PROBE = """
import sys
import numpy as np
from covgrad.moments.stats import rel_diff
from covgrad.tokens.study import rel_l2
rng = np.random.default_rng(0)
a = rng.standard_normal(1 << 22)
b = a + 1e-3 * rng.standard_normal(1 << 22)
print(repr(rel_diff([(a, b)])), repr(rel_l2(b, a)))
"""


@pytest.mark.slow
def test_float64_reductions_do_not_depend_on_the_blas_thread_count():
    """rel_diff_G and the tokens stage's relative L2 errors come out bit for bit the same under 1 and 2 BLAS
    threads (OpenBLAS splits ``a @ a`` over its threads, which changed rel_diff_G's last bit between a killed
    run and its resume)."""
    import os
    import subprocess
    import sys

    from tests.helpers.pipeline import REPO

    out = {}
    for threads in ("1", "2"):
        env = {**os.environ, "OPENBLAS_NUM_THREADS": threads, "OMP_NUM_THREADS": threads, "PYTHONPATH": str(REPO)}
        run = subprocess.run([sys.executable, "-c", BLAS_PROBE], env=env, capture_output=True, text=True, cwd=REPO)
        assert run.returncode == 0, run.stderr[-2000:]
        out[threads] = run.stdout.split()
    assert out["1"] == out["2"]


@pytest.fixture(scope="module")
def stored(tiny_run):
    """The tiny run's offpolicy rows as stored (JSON), its stats groups by (sampler, centering), the store."""
    root, p = tiny_run
    store = ArtifactStore(str(root))
    rows = json.loads(store.fs.cat_file(store.path(p.offpolicy.ref, "offpolicy.json")))
    groups = {(i.sampler, i.centering): store.open_group(s.ref, "stats.zarr") for i, s in p.stats.items()}
    return rows, groups, store


def test_the_stage_reads_every_stats_artifact_and_the_report_reads_the_stage(tiny_run):
    _, p = tiny_run
    assert p.offpolicy.upstream == {str(i): s.ref for i, s in sorted(p.stats.items())}
    assert p.offpolicy.spec.stats == [("policy", "policy"), ("stale", "policy"), ("stale", "sampler")]
    assert p.report.upstream["offpolicy"] == p.offpolicy.ref
    assert list(p).index("offpolicy") > max(list(p).index(str(i)) for i in p.stats)


def test_rows_equal_numpy_on_the_stats_stores(stored):
    """rel_diff_G of the stale sampler against numpy float64 over the whole G arrays (both of its rows,
    NaN for the policy); the other columns are the stats artifacts' own scalars; KL is the sampler-centered
    scores' value on both rows of a sampler, 0 on-policy."""
    rows, groups, _ = stored
    by = {(r["sampler"], r["centering"]): r for r in rows}
    assert list(by) == [("policy", "policy"), ("stale", "policy"), ("stale", "sampler")]
    want = numpy_rel_diff(groups["stale", "sampler"]["G"][:], groups["stale", "policy"]["G"][:])
    assert 0 < want < 10
    assert by["stale", "sampler"]["rel_diff_G"] == pytest.approx(want, rel=1e-12)
    assert by["stale", "policy"]["rel_diff_G"] == by["stale", "sampler"]["rel_diff_G"]
    assert math.isnan(by["policy", "policy"]["rel_diff_G"])
    worst = max(numpy_rel_diff(groups["stale", "sampler"][n][:], groups["stale", "policy"][n][:]) for n in COMPARED)
    assert worst >= want and by["stale", "sampler"]["rel_diff_stats"] == pytest.approx(worst, rel=1e-12)
    assert by["stale", "policy"]["rel_diff_stats"] == by["stale", "sampler"]["rel_diff_stats"]
    assert math.isnan(by["policy", "policy"]["rel_diff_stats"])
    columns = {
        "zero_mean_trace": "zero_mean_trace",
        "zero_mean_coord": "zero_mean_coord",
        "max_abs_rho": "max_abs_rho",
        "bound_violations": "bound_violations",
        "crossfit_frac_exceed": "crossfit_even_F_odd_G_frac_exceed",
        "overlap_1pct": "overlap_1pct",
    }
    for key, row in by.items():
        scalars = groups[key].attrs["scalars"]
        assert {c: row[c] for c in columns} == {c: scalars[s] for c, s in columns.items()}, key
        assert row["finding"] == ""
    kl = groups["stale", "sampler"].attrs["scalars"]["kl_sampler_policy_per_token"]
    assert kl > 0 and by["stale", "policy"]["kl_per_token"] == by["stale", "sampler"]["kl_per_token"] == kl
    assert by["policy", "policy"]["kl_per_token"] == 0.0


def test_blocks_that_do_not_divide_P_give_the_same_table(stored, tiny_run):
    rows, groups, store = stored
    _, p = tiny_run
    P = groups["stale", "sampler"]["G"].shape[0]
    for block in (1000, P // 3 + 1):  # many blocks and a short last one; three blocks
        assert P % block and P // block >= 2, (P, block)
        chunked = offpolicy_rows(store, p.offpolicy.spec, p.offpolicy.upstream, block)
        for col in ("rel_diff_G", "rel_diff_stats"):
            assert [r[col] for r in chunked][1:] == pytest.approx([r[col] for r in rows][1:], rel=1e-12)
        blockwise = ("rel_diff_G", "rel_diff_stats")
        assert [{k: v for k, v in r.items() if k not in blockwise} for r in chunked] == [
            {k: r[k] for k in c if k not in blockwise} for r, c in zip(rows, chunked, strict=True)
        ]


def test_store_csv_notebook_and_report_hold_the_same_rows(stored, tiny_run):
    from covgrad.report.document import finite
    from storage.notebook import open_run
    from storage.schema import OFFPOLICY_VARS

    rows, _, store = stored
    root, p = tiny_run
    ref = p.offpolicy.ref
    assert [list(r) for r in rows] == [list(OFFPOLICY_VARS)] * len(rows)
    ds = open_run(str(root), "tiny")["offpolicy"]
    assert {"sampler", "centering"} <= set(ds.coords) and ds.rel_diff_G.attrs["units"] == "1"
    assert ds.sel(row=("policy", "policy")).rel_diff_G.size == 1  # rows selected by (sampler, centering)
    table = list(csv.DictReader(io.StringIO(store.fs.cat_file(store.path(ref, "offpolicy.csv")).decode())))
    for i, row in enumerate(rows):
        for col, value in row.items():
            got = ds[col].values[i]
            if isinstance(value, float):
                np.testing.assert_equal(float(got), value)
                np.testing.assert_equal(float(table[i][col]), value)
            else:
                assert got == value and table[i][col] == str(value), col
    report = json.loads(store.fs.cat_file(store.path(p.report.ref, "report.json")))
    assert report["numbers"]["off_policy"] == [{k: finite(v) for k, v in r.items()} for r in rows]


def numpy_mismatch(s: np.ndarray, p: np.ndarray, mask: np.ndarray) -> dict[str, float]:
    """verl's definitions written out in numpy: s = log μ, p = log p of the sampled tokens (N, T)."""
    mu, pi = np.exp(s[mask]), np.exp(p[mask])
    gap = np.abs(pi - mu)
    cov = ((pi - pi.mean()) * (mu - mu.mean())).mean()
    log_rho = np.where(mask, p - s, 0.0)
    n_tok = mask.sum(1)
    seq_log_ppl_diff = np.where(mask, s, 0).sum(1) / n_tok - np.where(mask, p, 0).sum(1) / n_tok
    return {
        "rollout_probs_diff_mean": gap.mean(),
        "rollout_probs_diff_max": gap.max(),
        "probs_pearson_corr": cov / (pi.std() * mu.std()),
        "verl_kl": -log_rho[mask].mean(),
        "k3_kl": (np.exp(log_rho[mask]) - log_rho[mask] - 1).mean(),
        "chi2_token": np.exp(2 * log_rho[mask]).mean() - 1,
        "chi2_seq": np.exp(2 * log_rho.sum(1)).mean() - 1,
        "ppl_ratio": np.exp(seq_log_ppl_diff).mean(),
    }


def test_mismatch_columns_against_numpy(stored, tiny_run):
    """The verl-named columns of each sampler (the same on both of its rows) against numpy on the rollouts'
    sampler log-probs and the policy's log-probs from a plain forward of the demo policy; ≈ 0 for the policy."""
    import torch

    from storage.models import load_models
    from storage.schema import ROLLOUTS
    from tasks.offpolicy import MISMATCH_COLUMNS

    rows, _, store = stored
    _, p = tiny_run
    model = load_models(store, p.base_model.ref, "policy", p.scores[next(iter(p.scores))].spec.policy)[0]
    by = {(r["sampler"], r["centering"]): r for r in rows}
    for sampler, step in p.rollouts.items():
        ro = store.open_group(step.ref, ROLLOUTS, mode="r")
        tokens, pl, rl = ro["tokens"][:], ro["prompt_len"][:], ro["response_len"][:]
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.from_numpy(tokens).long()).logits.double(), -1).numpy()
        T = int(rl.max())
        mask = np.arange(T)[None, :] < rl[:, None]
        policy = np.zeros((len(rl), T))
        for n in range(len(rl)):
            for j in range(rl[n]):
                policy[n, j] = logp[n, pl[n] + j - 1, tokens[n, pl[n] + j]]
        want = numpy_mismatch(ro["sampler_logp"][:, :T].astype(np.float64), policy, mask)
        for (s, _), row in by.items():
            if s == sampler:
                for col in MISMATCH_COLUMNS:
                    assert row[col] == pytest.approx(want[col], rel=1e-4, abs=1e-6), (sampler, col)
    stale, on = by["stale", "sampler"], by["policy", "policy"]
    assert stale["k3_kl"] > 1e-3 and stale["rollout_probs_diff_max"] > 1e-2
    assert on["k3_kl"] < 1e-9 and on["rollout_probs_diff_max"] < 1e-5 and on["probs_pearson_corr"] > 1 - 1e-9
    assert on["ppl_ratio"] == pytest.approx(1.0, abs=1e-6)


def test_the_sweep_plot_draws_every_sampler_including_the_null():
    """A PNG for rows with an on-policy row (rel_diff_G NaN), a null (k3-KL 0, drawn at the floor) and a
    mismatched sampler."""
    from covgrad.report.plots import plot_mismatch_sweep

    rows = [
        {"sampler": s, "centering": c, "k3_kl": k3, "zero_mean_trace": z, "rel_diff_G": d}
        for s, c, k3, z, d in (
            ("policy", "policy", 1e-14, 1.1, math.nan),
            ("fp32", "policy", 0.0, 1.0, 2e-7),
            ("fp32", "sampler", 0.0, 1.0, 2e-7),
            ("t05", "policy", 0.1, 8.0, 0.2),
            ("t05", "sampler", 0.1, 1.2, 0.2),
        )
    ]
    png = plot_mismatch_sweep(rows, "test")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
