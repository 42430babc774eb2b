"""Numeric primitives whose bits must not depend on the machine's thread count."""

from __future__ import annotations

import numpy as np


def dot64(a: np.ndarray, b: np.ndarray) -> float:
    """Σ a·b of two (n,) float64 vectors in numpy's own single-threaded loop, so an artifact's bits do not
    depend on the BLAS thread count: OpenBLAS splits ``a @ b`` over its threads once n > 10⁴, and the sum
    then changes in its last bits with ``OPENBLAS_NUM_THREADS`` (measured: 1 and 2 threads differ at n = 4M)."""
    return float(np.einsum("i,i->", a, b))


def sum64(x: np.ndarray) -> float:
    """Σ x of an (n,) float64 array in numpy's pairwise sum over an aligned copy when ``x`` is not
    dtype-aligned: numpy sums unaligned memory in another order, so a block unpickled misaligned from a dask
    worker gave other last bits than the same values in place (measured: n = 10⁵, 4-byte offset, 1.5e-11)."""
    return float(np.require(x, np.float64, ["A", "C"]).sum())
