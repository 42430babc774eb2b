"""Moment state and what is read off it: the accumulators and their native fold, blocked statistics,
exact top-k sets and rank correlations, quantiles and float64 numerics.
"""

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
