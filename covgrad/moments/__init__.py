"""Moment state and what is read off it: the accumulators and their native fold, blocked statistics,
exact top-k sets and rank correlations, quantiles and float64 numerics.

Names re-exported lazily (:mod:`covgrad.lazy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from covgrad.lazy import exports

if TYPE_CHECKING:
    from covgrad.moments.accum import FOLD_ELEMENTS, GroupAccumulator, MomentAccumulator, state_bytes_per_param
    from covgrad.moments.numerics import dot64
    from covgrad.moments.quantiles import LEVEL, Z975, t975
    from covgrad.moments.stats import (
        BLOCK_CHUNKS,
        BLOCK_OUTPUTS,
        OVERLAP_Q,
        Moments,
        blocked_stats,
        compute_stats,
        rel_diff,
        sample_moments,
    )
    from covgrad.moments.topk import (
        SCOPES,
        TopSets,
        Values,
        as_values,
        bound_mask_table,
        count_for_fraction,
        overlap_rows,
        overlap_table,
        rank_correlation,
        ranks_and_order,
        spearman,
        spearman_blocked,
        top_k_masks,
        topk_indices,
    )

_EXPORTS = {
    "BLOCK_CHUNKS": "covgrad.moments.stats",
    "BLOCK_OUTPUTS": "covgrad.moments.stats",
    "FOLD_ELEMENTS": "covgrad.moments.accum",
    "GroupAccumulator": "covgrad.moments.accum",
    "LEVEL": "covgrad.moments.quantiles",
    "MomentAccumulator": "covgrad.moments.accum",
    "Moments": "covgrad.moments.stats",
    "OVERLAP_Q": "covgrad.moments.stats",
    "SCOPES": "covgrad.moments.topk",
    "TopSets": "covgrad.moments.topk",
    "Values": "covgrad.moments.topk",
    "Z975": "covgrad.moments.quantiles",
    "as_values": "covgrad.moments.topk",
    "blocked_stats": "covgrad.moments.stats",
    "bound_mask_table": "covgrad.moments.topk",
    "compute_stats": "covgrad.moments.stats",
    "count_for_fraction": "covgrad.moments.topk",
    "dot64": "covgrad.moments.numerics",
    "overlap_rows": "covgrad.moments.topk",
    "overlap_table": "covgrad.moments.topk",
    "rank_correlation": "covgrad.moments.topk",
    "ranks_and_order": "covgrad.moments.topk",
    "rel_diff": "covgrad.moments.stats",
    "sample_moments": "covgrad.moments.stats",
    "spearman": "covgrad.moments.topk",
    "spearman_blocked": "covgrad.moments.topk",
    "state_bytes_per_param": "covgrad.moments.accum",
    "t975": "covgrad.moments.quantiles",
    "top_k_masks": "covgrad.moments.topk",
    "topk_indices": "covgrad.moments.topk",
}

__all__ = [
    "BLOCK_CHUNKS",
    "BLOCK_OUTPUTS",
    "FOLD_ELEMENTS",
    "LEVEL",
    "OVERLAP_Q",
    "SCOPES",
    "Z975",
    "GroupAccumulator",
    "MomentAccumulator",
    "Moments",
    "TopSets",
    "Values",
    "as_values",
    "blocked_stats",
    "bound_mask_table",
    "compute_stats",
    "count_for_fraction",
    "dot64",
    "overlap_rows",
    "overlap_table",
    "rank_correlation",
    "ranks_and_order",
    "rel_diff",
    "sample_moments",
    "spearman",
    "spearman_blocked",
    "state_bytes_per_param",
    "t975",
    "top_k_masks",
    "topk_indices",
]

__getattr__ = exports(__name__, _EXPORTS)
