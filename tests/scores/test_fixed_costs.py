"""The per-call shortcuts of the fused reduction keep every byte: the accumulator's direct native fold, and the
block pool's choice of buffer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from covgrad.moments import accum
from covgrad.moments.accum import MomentAccumulator
from covgrad.scores.blocks import _smallest_fit


def _folded(direct: bool) -> dict[str, torch.Tensor]:
    """State after three batches of blocks of several widths, the started ones by the native kernel either directly
    (``MomentAccumulator.fold``'s shortcut) or through ``_fold_compiled``."""
    gen = torch.Generator().manual_seed(3)
    acc = MomentAccumulator(300, "cpu", compiled=True)
    adv, half = np.linspace(-1.0, 1.0, 6), np.arange(6) % 2
    for _ in range(3):
        acc.begin_batch(adv, half)
        if not direct:
            acc._batch.native = None  # the compiled fold's general route (tiles, kernel looked up per block)
        for at, n in ((0, 7), (7, 1), (8, 200), (208, 92)):
            acc.fold(at, torch.randn(6, n, generator=gen))
        acc.end_batch()
    return {k: getattr(acc, k).clone() for k in ("mean", "m2", "c")}


def test_direct_native_fold_is_byte_identical() -> None:
    if accum.native_fold() is None:
        pytest.skip("the native fold does not build here")
    direct, routed = _folded(True), _folded(False)
    for k in direct:
        assert torch.equal(direct[k], routed[k]), k


def test_smallest_fit_is_the_first_smallest_fitting_buffer() -> None:
    cpu = torch.device("cpu")
    pool = [torch.empty(n) for n in (40, 12, 25, 10, 10, 19)]
    for need in (1, 5, 10, 11, 13, 20, 30, 41):
        fits = [(b.numel(), i) for i, b in enumerate(pool) if need <= b.numel() <= 2 * need]
        assert _smallest_fit(pool, need, cpu) == (min(fits)[1] if fits else None), need
