"""Mismatch metrics in verl's, prime-rl's and TRL's terms against a token-by-token numpy computation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from covgrad.rollouts.mismatch import (
    mismatch_metrics,
    prime_rl_mismatch_kl,
    trl_sampling_metrics,
    verl_debug_metrics,
    verl_offpolicy_metrics,
)


def _case(seed: int, B: int = 5, T: int = 9):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, T + 1, B)
    mask = np.arange(T)[None, :] < lengths[:, None]
    sampler = -rng.gamma(1.0, 1.0, (B, T))
    policy = sampler + rng.normal(0, 0.3, (B, T))
    policy = np.minimum(policy, 0.0)
    sampler[~mask] = rng.normal(size=(~mask).sum())  # garbage outside the mask must not matter
    return sampler, policy, mask


def _reference(sampler, policy, mask) -> dict[str, float]:
    """Each metric from its definition, row by row, in plain Python floats."""
    rows = [
        [(float(s), float(p)) for s, p, keep in zip(srow, prow, mrow, strict=True) if keep]
        for srow, prow, mrow in zip(sampler, policy, mask, strict=True)
    ]
    tokens = [tp for row in rows for tp in row]
    n = len(tokens)
    diff = [abs(math.exp(p) - math.exp(s)) for s, p in tokens]
    mean = sum(diff) / n
    pis, mus = [math.exp(p) for _, p in tokens], [math.exp(s) for s, _ in tokens]
    mp, mm = sum(pis) / n, sum(mus) / n
    cov = sum((a - mp) * (b - mm) for a, b in zip(pis, mus, strict=True))
    corr = cov / math.sqrt(sum((a - mp) ** 2 for a in pis) * sum((b - mm) ** 2 for b in mus))
    eps = 1e-8
    mean_train = [sum(p for _, p in row) / (len(row) + eps) for row in rows]
    mean_roll = [sum(s for s, _ in row) / (len(row) + eps) for row in rows]
    lpd = [r - t for r, t in zip(mean_roll, mean_train, strict=True)]
    k3 = [math.exp(p - s) - (p - s) - 1 for s, p in tokens]
    B = len(rows)
    ordered = sorted(k3)
    out = {
        "training/rollout_probs_diff_max": max(diff),
        "training/rollout_probs_diff_mean": mean,
        "training/rollout_probs_diff_std": math.sqrt(sum((d - mean) ** 2 for d in diff) / (n - 1)),
        "training/rollout_actor_probs_pearson_corr": corr,
        "rollout_corr/training_ppl": sum(math.exp(-x) for x in mean_train) / B,
        "rollout_corr/training_log_ppl": sum(-x for x in mean_train) / B,
        "rollout_corr/rollout_ppl": sum(math.exp(-x) for x in mean_roll) / B,
        "rollout_corr/rollout_log_ppl": sum(-x for x in mean_roll) / B,
        "rollout_corr/kl": sum(s - p for s, p in tokens) / (n + eps),
        "rollout_corr/k3_kl": sum(k3) / (n + eps),
        "rollout_corr/log_ppl_diff": sum(lpd) / B,
        "rollout_corr/log_ppl_abs_diff": sum(abs(x) for x in lpd) / B,
        "rollout_corr/log_ppl_diff_max": max(lpd),
        "rollout_corr/log_ppl_diff_min": min(lpd),
        "rollout_corr/ppl_ratio": sum(math.exp(x) for x in lpd) / B,
        "rollout_corr/chi2_token": sum(math.exp(2 * max(-20, min(20, p - s))) for s, p in tokens) / (n + eps) - 1,
        "rollout_corr/chi2_seq": sum(math.exp(2 * max(-20, min(20, sum(p - s for s, p in row)))) for row in rows) / B
        - 1,
        "mismatch_kl/all/mean": sum(k3) / n,
        "mismatch_kl/all/median": ordered[(n - 1) // 2],
        "mismatch_kl/all/std": math.sqrt(sum((x - sum(k3) / n) ** 2 for x in k3) / (n - 1)),
        "mismatch_kl/all/min": min(k3),
        "mismatch_kl/all/max": max(k3),
        "sampling/sampling_logp_difference/mean": sum(abs(p - s) for s, p in tokens) / n,
        "sampling/sampling_logp_difference/max": max(abs(p - s) for s, p in tokens),
        "sampling/importance_sampling_ratio/min": min(math.exp(p - s) for s, p in tokens),
        "sampling/importance_sampling_ratio/mean": sum(math.exp(p - s) for s, p in tokens) / n,
        "sampling/importance_sampling_ratio/max": max(math.exp(p - s) for s, p in tokens),
    }
    return out


@pytest.mark.parametrize("seed", range(6))
def test_metrics_match_token_by_token_reference(seed):
    sampler, policy, mask = _case(seed)
    got = mismatch_metrics(sampler, policy, mask)
    want = _reference(sampler, policy, mask)
    assert set(got) == set(want) | {"training/rollout_probs_diff_valid"}
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key


def test_identical_log_probs_give_the_null_values():
    sampler, _, mask = _case(0)
    got = mismatch_metrics(sampler, sampler, mask)
    for key in ("training/rollout_probs_diff_max", "rollout_corr/kl", "rollout_corr/k3_kl", "mismatch_kl/all/max"):
        assert got[key] == 0.0, key
    assert got["rollout_corr/chi2_token"] == pytest.approx(0.0, abs=1e-7)  # verl's 1e-8 in the denominator
    assert got["rollout_corr/chi2_seq"] == 0.0 and got["rollout_corr/ppl_ratio"] == 1.0
    assert got["training/rollout_actor_probs_pearson_corr"] == pytest.approx(1.0)
    assert got["sampling/importance_sampling_ratio/min"] == got["sampling/importance_sampling_ratio/max"] == 1.0


def test_chi2_clips_log_ratio_like_verl():
    sampler = np.array([[-40.0, -1.0]])
    policy = np.array([[-1.0, -1.0]])
    mask = np.ones((1, 2), dtype=bool)
    got = verl_offpolicy_metrics(sampler, policy, mask)
    assert got["rollout_corr/chi2_token"] == pytest.approx((math.exp(40) + 1) / (2 + 1e-8) - 1)
    assert got["rollout_corr/chi2_seq"] == pytest.approx(math.exp(40) - 1)


def test_each_stack_function_and_errors():
    sampler, policy, mask = _case(1)
    assert set(verl_debug_metrics(sampler, policy, mask)) <= set(mismatch_metrics(sampler, policy, mask))
    assert prime_rl_mismatch_kl(sampler, policy, mask)["mismatch_kl/all/mean"] == pytest.approx(
        verl_offpolicy_metrics(sampler, policy, mask)["rollout_corr/k3_kl"], rel=1e-7
    )
    assert trl_sampling_metrics(sampler, policy, mask)["sampling/importance_sampling_ratio/min"] > 0
    with pytest.raises(ValueError, match="must all be the same"):
        mismatch_metrics(sampler, policy[:, :-1], mask)
    with pytest.raises(ValueError, match="selects no token"):
        mismatch_metrics(sampler, policy, np.zeros_like(mask))
    bad = policy.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ValueError, match="finite"):
        mismatch_metrics(sampler, bad, mask)
