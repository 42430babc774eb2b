"""Numeric primitives whose bits must not depend on the machine's thread count."""

from __future__ import annotations

import numpy as np


def dot64(a: np.ndarray, b: np.ndarray) -> float:
    """Σ a·b of two (n,) float64 vectors in numpy's own single-threaded loop, so an artifact's bits do not
    depend on the BLAS thread count: OpenBLAS splits ``a @ b`` over its threads once n > 10⁴, and the sum
    then changes in its last bits with ``OPENBLAS_NUM_THREADS`` (measured: 1 and 2 threads differ at n = 4M)."""
    return float(np.einsum("i,i->", a, b))
