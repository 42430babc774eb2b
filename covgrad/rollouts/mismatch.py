"""Sampler–policy mismatch in the metric names RL stacks log, from per-token log-probabilities.

All functions take the sampler's (rollout engine's) log-probabilities of the sampled tokens
``sampler_logp`` (B, T), the policy's (trainer's) log-probabilities of the same tokens ``policy_logp``
(B, T), both in nats, and a (B, T) mask of scored response tokens; they compute in float64 and return
plain floats keyed exactly as the stack logs them. Definitions follow the stacks' sources:

- verl ``verl/utils/debug/metrics.py`` ``calculate_debug_metrics`` (prefix ``training/``): with
  π = exp(policy_logp), μ = exp(sampler_logp) over masked tokens, ``rollout_probs_diff_{max,mean,std}``
  of |π − μ| (std with n − 1), ``rollout_actor_probs_pearson_corr`` = Pearson correlation of π and μ.
- verl ``verl/trainer/ppo/rollout_corr_helper.py`` ``compute_offpolicy_metrics`` (prefix
  ``rollout_corr/``), with ``masked_mean(x) = Σ x·m / (Σ m + 1e-8)`` (``verl/utils/torch_functional.py``)
  and log ρ = policy_logp − sampler_logp: ``training_ppl`` = mean over sequences of
  exp(−masked_mean_t policy_logp), ``training_log_ppl``, ``rollout_ppl``, ``rollout_log_ppl`` likewise;
  ``kl`` = masked_mean(sampler_logp − policy_logp); ``k3_kl`` = masked_mean(ρ − log ρ − 1);
  ``log_ppl_diff`` = mean over sequences of (masked_mean_t sampler_logp − masked_mean_t policy_logp),
  with ``log_ppl_abs_diff``, ``log_ppl_diff_max``, ``log_ppl_diff_min``; ``ppl_ratio`` = mean of
  exp(log_ppl_diff); ``chi2_token`` = masked_mean(exp(clip(log ρ, ±20))²) − 1; ``chi2_seq`` = mean over
  sequences of exp(2·clip(Σ_t log ρ, ±20)) − 1.
- prime-rl ``src/prime_rl/trainer/rl/loss.py`` ``compute_importance_ratio_and_mismatch_kl`` and
  ``trainer/utils.py`` ``compute_stats``: per token ``mismatch_kl`` = ρ − log ρ − 1 over trainable tokens,
  logged as ``mismatch_kl/all/{mean,median,std,min,max}`` (std with n − 1; the median is the lower one,
  as ``torch.median``).
- TRL ``trl/trainer/grpo_trainer.py`` (vLLM importance sampling, token mode, before truncation):
  ``sampling/sampling_logp_difference/{mean,max}`` of |policy_logp − sampler_logp|,
  ``sampling/importance_sampling_ratio/{min,mean,max}`` of ρ.

The stacks compute in their trainer's dtype (usually float32); these values are float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np

SAFETY_BOUND = 20.0  # verl's clip on log ρ in the χ² metrics (rollout_corr_helper.py)


def _inputs(sampler_logp: Any, policy_logp: Any, mask: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    s = np.asarray(sampler_logp, dtype=np.float64)
    p = np.asarray(policy_logp, dtype=np.float64)
    m = np.asarray(mask).astype(bool)
    if s.ndim != 2 or s.shape != p.shape or s.shape != m.shape:
        raise ValueError(
            f"sampler_logp {s.shape}, policy_logp {p.shape} and mask {m.shape} must all be the same (B, T)"
        )
    if not m.any():
        raise ValueError("the mask selects no token; mismatch metrics need at least one scored token")
    if not (np.isfinite(s[m]).all() and np.isfinite(p[m]).all()):
        raise ValueError("sampler_logp and policy_logp must be finite at masked tokens")
    return np.where(m, s, 0.0), np.where(m, p, 0.0), m


def _masked_mean(x: np.ndarray, m: np.ndarray, axis: int | None = None) -> np.ndarray:
    """verl's ``masked_mean``: Σ x·m / (Σ m + 1e-8)."""
    return np.where(m, x, 0.0).sum(axis=axis) / (m.sum(axis=axis) + 1e-8)


def verl_debug_metrics(sampler_logp: Any, policy_logp: Any, mask: Any) -> dict[str, float]:
    """verl's ``calculate_debug_metrics`` (``training/rollout_probs_diff_*``, Pearson correlation)."""
    s, p, m = _inputs(sampler_logp, policy_logp, mask)
    pi, mu = np.exp(p[m]), np.exp(s[m])
    diff = np.abs(pi - mu)
    corr = float(np.corrcoef(pi, mu)[0, 1]) if diff.size > 1 else float("nan")
    return {
        "training/rollout_probs_diff_valid": 1,
        "training/rollout_probs_diff_max": float(diff.max()),
        "training/rollout_probs_diff_mean": float(diff.mean()),
        "training/rollout_probs_diff_std": float(diff.std(ddof=1)) if diff.size > 1 else float("nan"),
        "training/rollout_actor_probs_pearson_corr": corr,
    }


def verl_offpolicy_metrics(sampler_logp: Any, policy_logp: Any, mask: Any) -> dict[str, float]:
    """verl's ``compute_offpolicy_metrics``, keyed with the ``rollout_corr/`` prefix it is logged under."""
    s, p, m = _inputs(sampler_logp, policy_logp, mask)
    mean_train = _masked_mean(p, m, axis=-1)  # (B,)
    mean_roll = _masked_mean(s, m, axis=-1)
    log_ratio = p - s
    log_ppl_diff = mean_roll - mean_train
    rho = np.exp(np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    seq = np.clip(np.where(m, log_ratio, 0.0).sum(-1), -SAFETY_BOUND, SAFETY_BOUND)
    metrics = {
        "training_ppl": np.exp(-mean_train).mean(),
        "training_log_ppl": (-mean_train).mean(),
        "kl": _masked_mean(s - p, m),
        "k3_kl": _masked_mean(np.exp(log_ratio) - log_ratio - 1, m),
        "rollout_ppl": np.exp(-mean_roll).mean(),
        "rollout_log_ppl": (-mean_roll).mean(),
        "log_ppl_diff": log_ppl_diff.mean(),
        "log_ppl_abs_diff": np.abs(log_ppl_diff).mean(),
        "log_ppl_diff_max": log_ppl_diff.max(),
        "log_ppl_diff_min": log_ppl_diff.min(),
        "ppl_ratio": np.exp(log_ppl_diff).mean(),
        "chi2_token": _masked_mean(rho**2, m) - 1.0,
        "chi2_seq": np.exp(2.0 * seq).mean() - 1.0,
    }
    return {f"rollout_corr/{k}": float(v) for k, v in metrics.items()}


def prime_rl_mismatch_kl(sampler_logp: Any, policy_logp: Any, mask: Any) -> dict[str, float]:
    """prime-rl's ``mismatch_kl/all/{mean,median,std,min,max}`` over the masked tokens."""
    s, p, m = _inputs(sampler_logp, policy_logp, mask)
    log_ratio = (p - s)[m]
    kl = np.exp(log_ratio) - log_ratio - 1
    ordered = np.sort(kl)
    return {
        "mismatch_kl/all/mean": float(kl.mean()),
        "mismatch_kl/all/median": float(ordered[(kl.size - 1) // 2]),
        "mismatch_kl/all/std": float(kl.std(ddof=1)) if kl.size > 1 else float("nan"),
        "mismatch_kl/all/min": float(kl.min()),
        "mismatch_kl/all/max": float(kl.max()),
    }


def trl_sampling_metrics(sampler_logp: Any, policy_logp: Any, mask: Any) -> dict[str, float]:
    """TRL's vLLM importance-sampling metrics (token mode, untruncated ratio)."""
    s, p, m = _inputs(sampler_logp, policy_logp, mask)
    delta = np.abs(p - s)[m]
    ratio = np.exp((p - s)[m])
    return {
        "sampling/sampling_logp_difference/mean": float(delta.mean()),
        "sampling/sampling_logp_difference/max": float(delta.max()),
        "sampling/importance_sampling_ratio/min": float(ratio.min()),
        "sampling/importance_sampling_ratio/mean": float(ratio.mean()),
        "sampling/importance_sampling_ratio/max": float(ratio.max()),
    }


def mismatch_metrics(sampler_logp: Any, policy_logp: Any, mask: Any) -> dict[str, float]:
    """All of the above in one dict (keys do not collide), for the off-policy table.

    Args:
        sampler_logp: (B, T) log μ(y_t) from the rollouts (``sampler_logp``), nats.
        policy_logp: (B, T) log p(y_t) recomputed by the policy, nats.
        mask: (B, T) bool, True at scored response tokens (t < response_len).
    """
    out: dict[str, float] = {}
    for fn in (verl_debug_metrics, verl_offpolicy_metrics, prime_rl_mismatch_kl, trl_sampling_metrics):
        out.update(fn(sampler_logp, policy_logp, mask))
    return out
