"""Post-training regimes (DESIGN.md §1b): each regime's per-sample cotangent (:mod:`covgrad.regimes.cotangents`),
its gradient fold (:mod:`covgrad.regimes.fold`), its moments and statistics (:mod:`covgrad.regimes.stats`), and
the teacher context (:mod:`covgrad.regimes.context`). The regime kinds are :data:`covgrad.choices.REGIME_KINDS`.

Names re-exported lazily (:mod:`covgrad.lazy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from covgrad.lazy import exports

if TYPE_CHECKING:
    from covgrad.choices import FULL_DISTRIBUTION_KINDS
    from covgrad.regimes.context import PrefixedBatch, align_prefixed_logits, prefixed_batch
    from covgrad.regimes.cotangents import (
        Regime,
        RegimeGrad,
        advantage_sq_sums,
        chi2_sums,
        distill_sampled_advantages,
        kl_penalty,
        length_normalise,
        regime_of,
        reverse_kl_var_sums,
        token_advantages,
    )
    from covgrad.regimes.errors import clustered_mean_se, moment_mean_se
    from covgrad.regimes.fold import RegimeMoments, head_token_fisher
    from covgrad.regimes.stats import (
        REGIME_OUTPUTS,
        GroupRows,
        RegimeFold,
        RegimeStats,
        regime_block_stats,
        regime_halves,
        regime_stats,
    )

_EXPORTS = {
    "FULL_DISTRIBUTION_KINDS": "covgrad.choices",
    "GroupRows": "covgrad.regimes.stats",
    "PrefixedBatch": "covgrad.regimes.context",
    "REGIME_OUTPUTS": "covgrad.regimes.stats",
    "Regime": "covgrad.regimes.cotangents",
    "RegimeFold": "covgrad.regimes.stats",
    "RegimeGrad": "covgrad.regimes.cotangents",
    "RegimeMoments": "covgrad.regimes.fold",
    "RegimeStats": "covgrad.regimes.stats",
    "advantage_sq_sums": "covgrad.regimes.cotangents",
    "align_prefixed_logits": "covgrad.regimes.context",
    "chi2_sums": "covgrad.regimes.cotangents",
    "clustered_mean_se": "covgrad.regimes.errors",
    "distill_sampled_advantages": "covgrad.regimes.cotangents",
    "head_token_fisher": "covgrad.regimes.fold",
    "kl_penalty": "covgrad.regimes.cotangents",
    "length_normalise": "covgrad.regimes.cotangents",
    "moment_mean_se": "covgrad.regimes.errors",
    "prefixed_batch": "covgrad.regimes.context",
    "regime_block_stats": "covgrad.regimes.stats",
    "regime_halves": "covgrad.regimes.stats",
    "regime_of": "covgrad.regimes.cotangents",
    "regime_stats": "covgrad.regimes.stats",
    "reverse_kl_var_sums": "covgrad.regimes.cotangents",
    "token_advantages": "covgrad.regimes.cotangents",
}

__all__ = [
    "FULL_DISTRIBUTION_KINDS",
    "REGIME_OUTPUTS",
    "GroupRows",
    "PrefixedBatch",
    "Regime",
    "RegimeFold",
    "RegimeGrad",
    "RegimeMoments",
    "RegimeStats",
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
    "regime_halves",
    "regime_of",
    "regime_stats",
    "reverse_kl_var_sums",
    "token_advantages",
]

__getattr__ = exports(__name__, _EXPORTS)
