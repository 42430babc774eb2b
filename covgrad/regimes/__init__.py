"""Post-training regimes (DESIGN.md §1b): each regime's per-sample cotangent, its gradient fold, its
moments and statistics, and the teacher context.
"""

from covgrad.regimes.objectives import (
    FULL_DISTRIBUTION_KINDS,
    Regime,
    RegimeGrad,
    RegimeMoments,
    advantage_sq_sums,
    align_prefixed_logits,
    chi2_sums,
    clustered_mean_se,
    distill_sampled_advantages,
    head_token_fisher,
    kl_penalty,
    length_normalise,
    moment_mean_se,
    prefixed_batch,
    regime_block_stats,
    regime_of,
    reverse_kl_var_sums,
    token_advantages,
)

__all__ = [
    "FULL_DISTRIBUTION_KINDS",
    "Regime",
    "RegimeGrad",
    "RegimeMoments",
    "advantage_sq_sums",
    "align_prefixed_logits",
    "chi2_sums",
    "clustered_mean_se",
    "distill_sampled_advantages",
    "head_token_fisher",
    "kl_penalty",
    "length_normalise",
    "moment_mean_se",
    "prefixed_batch",
    "regime_block_stats",
    "regime_of",
    "reverse_kl_var_sums",
    "token_advantages",
]
