"""The zero-mean test's null band: sign flips of the score rows, the coordinate statistic capped at COORD_CAP.

Exact against a float64 loop that flips every row itself; its false-alarm rate measured on synthetic on-policy
scores that are sparse, skewed and heavy-tailed as the demo's are, where the uncapped coordinate statistic would
alarm in almost every run; and it rejects a centring error.
"""

import numpy as np
import pytest

from covgrad.moments.stats import COORD_CAP
from covgrad.report.uncertainty import VAR_FLOOR, group_bootstrap, resampled_band

GROUPS, PER_GROUP, P = 32, 8, 400
N = GROUPS * PER_GROUP
GROUP = np.repeat(np.arange(GROUPS), PER_GROUP)


def reference(S: np.ndarray, signs: np.ndarray) -> dict[str, np.ndarray | float]:
    """The null replicates and the data's own capped parts, one flipped data set at a time, float64."""
    s = S.astype(np.float64)
    data_var = s.var(axis=0)
    t2 = np.zeros(s.shape[1])
    for i in np.flatnonzero(data_var > 0):
        t2[i] = N * s[:, i].mean() ** 2 / data_var[i]
    varying = np.count_nonzero(data_var > 0)
    capped, excess = np.minimum(t2, COORD_CAP).sum() / varying, np.maximum(t2 - COORD_CAP, 0.0).sum() / varying
    trace, coord = [], []
    for eps in signs:
        flipped = eps[:, None] * s
        m, second = flipped.mean(axis=0), (flipped * flipped).mean(axis=0)
        var = second - m * m
        keep = (data_var > 0) & (var > VAR_FLOOR * second)
        trace.append(N * (m * m).sum() / var[keep].sum())
        coord.append(np.minimum(N * m[keep] ** 2 / var[keep], COORD_CAP).mean() + excess)
    return {
        "null_trace": np.array(trace),
        "null_coord": np.array(coord),
        "coord_capped": capped,
        "coord_excess": excess,
    }


@pytest.mark.parametrize("block", [7, 64, 5000])
def test_null_draws_are_the_statistics_of_the_sign_flipped_rows(block: int):
    """Every null data set's trace and capped coordinate statistic equal those of the rows multiplied by its signs,
    with float32 rows, a constant coordinate, an all-zero one, one nonzero in a single response, and coordinates
    far beyond the cap."""
    rng = np.random.default_rng(21)
    S = (rng.standard_t(3, size=(N, P)) * np.exp(rng.normal(size=P))).astype(np.float32)
    S[:, 0], S[:, 1] = 2.5, 0.0
    S[:, 2] = 0.0
    S[17, 2] = 4.0
    S[:, 3:9] += 3.0  # t_i² far above COORD_CAP
    b = group_bootstrap(lambda a, c: S[:, a:c], np.zeros(N), GROUP, P, [], n_boot=0, seed=4, n_null=30, block=block)
    signs = np.random.default_rng([4, 1]).choice(np.array([-1.0, 1.0]), size=(30, N))
    want = reference(S, signs)
    for k in ("null_trace", "null_coord"):
        np.testing.assert_allclose(b[k], want[k], rtol=1e-9)
    for k in ("coord_capped", "coord_excess"):
        assert b[k] == pytest.approx(want[k], rel=1e-9)
    assert want["coord_excess"] > 0.1  # the cap is in play
    s = S.astype(np.float64)
    var = s.var(axis=0)
    whole = (N * s.mean(axis=0) ** 2 / np.where(var > 0, var, 1.0))[var > 0].mean()
    assert b["coord_capped"] + b["coord_excess"] == pytest.approx(whole, rel=1e-9)  # zero_mean_coord


def on_policy_scores(rng: np.random.Generator, bias: float = 0.0) -> np.ndarray:
    """(N, P) scores with E[s | prompt] = 0 (plus ``bias``·σ_i), shaped like the demo's: three shared factors
    correlate the coordinates; row sizes are heavy-tailed (a log-normal factor per response); a quarter of the
    coordinates are skewed by a rare event (probability 0.02–0.2, centred: (1[event] − p)·x); and 2 of 400, like
    the LM-head rows of tokens the sampler almost never draws (p = 0.001), are all −p·x in most runs: a large
    t_i² with E[s_i] = 0."""
    fixed = np.random.default_rng(7)
    factors, sigma = fixed.normal(size=(3, P)) * 0.5, np.exp(fixed.normal(size=P) * 0.5)
    k = P // 4
    p = np.concatenate([np.exp(fixed.uniform(np.log(0.02), np.log(0.2), k)), [1e-3, 1e-3]])  # (k + 2,)
    S = (rng.normal(size=(N, 3)) @ factors + rng.normal(size=(N, P))) * np.exp(0.5 * rng.normal(size=(N, 1)))
    events = (rng.random((N, p.size)) < p) - p
    S[:, : p.size] = 3 * events * (1 + 0.5 * rng.normal(size=(N, p.size)))
    return (S + bias * S.std(axis=0)) * sigma


def outside(trials: int, bias: float, seed: int) -> dict[str, float]:
    """The share of ``trials`` runs whose statistics fall outside their 95% null bands, and (``uncapped``) the share
    whose zero_mean_coord exceeds the band it would have without the cap (the capped replicates' band)."""
    rng = np.random.default_rng(seed)
    out = dict.fromkeys(("trace", "coord", "uncapped"), 0)
    for t in range(trials):
        S = on_policy_scores(rng, bias)
        m, var = S.mean(axis=0), S.var(axis=0)
        stats = {"trace": N * (m * m).sum() / var.sum(), "coord": (N * m * m / var).mean()}
        b = group_bootstrap(lambda a, c, S=S: S[:, a:c], np.zeros(N), GROUP, P, [], n_boot=0, seed=t)
        for k, v in stats.items():
            lo, hi = resampled_band(b[f"null_{k}"])
            out[k] += not lo <= v <= hi
        out["uncapped"] += stats["coord"] > resampled_band(b["null_coord"] - b["coord_excess"])[1]
    return {k: v / trials for k, v in out.items()}


def test_the_band_holds_on_sparse_skewed_on_policy_scores():
    """E[s | prompt] = 0: each statistic leaves its band in at most 21 of 300 runs (7%: a rate of 5% gets there
    with probability 0.04; here 5.3% and 5.3%), while zero_mean_coord against the band it would have without the
    cap leaves it in at least 90% of them (here 97%)."""
    rates = outside(300, 0.0, seed=0)
    assert rates["trace"] <= 0.07 and rates["coord"] <= 0.07, rates
    assert rates["uncapped"] >= 0.9, rates


def test_the_band_rejects_a_centring_error():
    """E[s] = 0.1·σ: both statistics leave their bands in at least 90% of 40 runs."""
    rates = outside(40, 0.1, seed=1)
    assert rates["trace"] >= 0.9 and rates["coord"] >= 0.9, rates


@pytest.mark.slow
def test_the_band_holds_over_many_runs():
    """2000 runs: the coordinate statistic leaves its band in 1–5% of them (measured 4.85%); the trace, which is not
    capped and whose dominant directions carry the skew and the heavy-tailed rows the flips do not reproduce, in
    1–7% (measured 5.95%: not held to 5%, docs/reading.md)."""
    rates = outside(2000, 0.0, seed=2)
    assert 0.01 <= rates["coord"] <= 0.05 and 0.01 <= rates["trace"] <= 0.07, rates
