"""Reading the rollouts store (``rollouts.zarr``, layout in :mod:`storage.schema`) into typed batches."""

from __future__ import annotations

from typing import Any

from covgrad.batch import RolloutBatch


def read_batch(ro: Any, lo: int, hi: int, trim: bool = True) -> RolloutBatch:
    """Rollouts [lo, hi) of the open rollouts group ``ro`` as a :class:`RolloutBatch` on the CPU.
    ``trim`` drops the columns past the batch's longest row; ``False`` keeps the store's padded width."""
    return RolloutBatch.from_arrays(
        ro["tokens"][lo:hi],
        ro["prompt_len"][lo:hi],
        ro["response_len"][lo:hi],
        ro["response_mask"][lo:hi],
        ro["advantage"][lo:hi],
        ro["group"][lo:hi],
        trim=trim,
    )
