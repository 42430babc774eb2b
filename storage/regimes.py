"""The regime stores: a regime fold's bound scalars beside its scores-layout state, and the regimes store.

A regime fold (``regime/<key>/scores.zarr``) is a :class:`storage.scores.ScoresStore` of the regime's g_n
(``mean_s`` = mean g per row, ``advantage`` = 0) plus ``bound_sum, bound_count (batch, half)``: each batch's
Σ of the bound scalar c²_n and its samples, per prompt-group parity, written before the batch's
checkpoint (a resumed run rewrites the batches it refolds with the same numbers). The regimes store
(``regimes/<key>/regimes.zarr``) holds per regime the (param,) arrays of ``storage.schema.REGIMES_VARS``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from storage.schema import SCORES, create

BOUND = ("bound_sum", "bound_count")
IMPORTED = {"advantages": "token_advantage", "teacher_logprobs": "teacher_logprob"}  # rollouts arrays


def create_bound_arrays(g: Any, n_batches: int) -> None:
    """Create ``bound_sum`` and ``bound_count`` (n_batches, 2) in the fold's scores group ``g`` (idempotent)."""
    for name in BOUND:
        create(g, SCORES, name, (n_batches, 2))


def write_bound(g: Any, b: int, sums: np.ndarray, counts: np.ndarray) -> None:
    """Batch ``b``'s (2,) bound sums and sample counts per half."""
    g["bound_sum"][b] = sums
    g["bound_count"][b] = counts


def bound_a2(g: Any) -> tuple[float, list[float]]:
    """a² = Σ c²_n / #samples over every batch and per half (NaN where no sample has a bound scalar)."""
    s, n = g["bound_sum"][:].sum(0), g["bound_count"][:].sum(0)  # (2,)
    per_half = [float(s[h] / n[h]) if n[h] > 0 else float("nan") for h in (0, 1)]
    return (float(s.sum() / n.sum()) if n.sum() > 0 else float("nan")), per_half


def state_rows(g: Any, cols: slice) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The moment-state rows of a scores group over parameters ``cols``: count (R,), mean (R, b) float64
    (hi + lo for float32 state), m2 (R, b) float64 and each row's half (R,) (row 2i + h: half h)."""
    count = g["count"][:]
    mean = g["mean_s"][:, cols].astype(np.float64)
    if "mean_s_lo" in g:
        mean = mean + g["mean_s_lo"][:, cols].astype(np.float64)
    return count, mean, g["m2_s"][:, cols].astype(np.float64), np.arange(len(count)) % 2
