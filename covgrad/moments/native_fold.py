"""The compiled fold's merge of float64 moment state (:mod:`covgrad.moments.accum`) as a C++ kernel for the CPU.

The kernel takes a started batch's block (B, n) float32 and updates every half's float64 mean, M2 and (when
kept) co-moment in place, with the formulas of :func:`covgrad.moments.accum._fold_started`: per half h, over its own
rows in sample order, S1 = Σd, S2 = Σd², SA = Σ(a − ā_b)d with d = s − K (K: half 0's mean before the batch);
then rel = S1/b, M2b = max(S2 − S1·rel, 0), δ = (K − mean) + rel and m2 += M2b + (n_old·b/n·δ)·δ,
c += (SA − S1·Σ(a − ā_b)/b) + n_old·b/n·Δā·δ, mean += (b/n)·δ. Unlike the torch.compile kernel it sums each
half over its own rows (not all rows with 0/1 weights) and walks the block in strips of ``STRIP`` columns,
eight rows per pass, with the strip's sums in L1; S2 and SA accumulate by explicit fused multiply-adds
(exactly rounded, so vector and scalar code give the same bits; 8–11% faster than a multiply and an add).
Every column's arithmetic is the same whatever the strip, the block or the thread (no implicit FMA
contraction, no cross-column reduction), so tiles and ranks keep their bytes. A call costs about 14 µs
beyond its arithmetic, against about 68 µs for the torch.compile kernel's wrappers (docs/regimes.md,
"The native CPU fold").

It is built on first use by the C++ compiler (``$CXX`` or ``g++``) with ``-O3 -march=native -fopenmp`` into
``$XDG_CACHE_HOME/covgrad`` (default ``~/.cache/covgrad``), one library per source, flags and CPU feature set,
and loaded with ctypes; its OpenMP calls bind to the libgomp torch has loaded (the same soname). When no
compiler builds it, :func:`native_fold` is None and the accumulator keeps the torch.compile fold.

Shape notation: H halves, B samples, n columns of the block, P columns of the state.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

STRIP = 512  # columns per strip: the strip's three float64 sums (12 KiB) stay in L1 while its rows stream by

_SOURCE = r"""
#include <cstdint>
// R rows into the strip's sums: S1 += d, S2 += d², and with C, SA += a·d (d = x − K), one pass over its m columns
template <int R, bool C>
static inline void rows(const float* const* r, const double* a, const double* K, double* s1, double* s2, double* sa,
                        int64_t m) {
  #pragma omp simd
  for (int64_t j = 0; j < m; ++j) {
    double t1 = s1[j], t2 = s2[j], ta = C ? sa[j] : 0.0;
    for (int k = 0; k < R; ++k) {
      const double d = (double)r[k][j] - K[j];
      t1 += d;
      t2 = __builtin_fma(d, d, t2);
      if (C) ta = __builtin_fma(a[k], d, ta);
    }
    s1[j] = t1; s2[j] = t2;
    if (C) sa[j] = ta;
  }
}

extern "C" void covgrad_fold_f64(const float* x, int64_t n, int64_t H, const int64_t* order, const int64_t* offsets,
                                 const double* acen, const double* coef, double* mean, double* m2, double* c,
                                 int64_t ld, int nthreads) {
  const int64_t S = STRIP;
  #pragma omp parallel for num_threads(nthreads) schedule(static)
  for (int64_t j0 = 0; j0 < n; j0 += S) {
    const int64_t m = n - j0 < S ? n - j0 : S;
    double K[S], s1[S], s2[S], sa[S];
    for (int64_t j = 0; j < m; ++j) K[j] = mean[j0 + j];
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t j = 0; j < m; ++j) { s1[j] = 0.0; s2[j] = 0.0; sa[j] = 0.0; }
      int64_t i = offsets[h];
      for (; i + 8 <= offsets[h + 1]; i += 8) {  // eight rows per pass: the sums are loaded and stored once
        const float* r[8];
        double a[8];
        for (int k = 0; k < 8; ++k) { r[k] = x + order[i + k] * n + j0; a[k] = acen[order[i + k]]; }
        if (c) rows<8, true>(r, a, K, s1, s2, sa, m); else rows<8, false>(r, a, K, s1, s2, sa, m);
      }
      for (; i < offsets[h + 1]; ++i) {
        const float* r[1] = {x + order[i] * n + j0};
        const double a[1] = {acen[order[i]]};
        if (c) rows<1, true>(r, a, K, s1, s2, sa, m); else rows<1, false>(r, a, K, s1, s2, sa, m);
      }
      const double c0 = coef[h], c1 = coef[H + h], c2 = coef[2 * H + h], c3 = coef[3 * H + h], c4 = coef[4 * H + h];
      double* mh = mean + h * ld + j0;
      double* m2h = m2 + h * ld + j0;
      double* ch = c ? c + h * ld + j0 : nullptr;
      for (int64_t j = 0; j < m; ++j) {
        const double rel = s1[j] * c0;
        double m2b = s2[j] - s1[j] * rel;
        m2b = m2b < 0.0 ? 0.0 : m2b;
        const double delta = (K[j] - mh[j]) + rel;
        m2h[j] += m2b + (c2 * delta) * delta;
        if (ch) ch[j] += (sa[j] - s1[j] * c4) + c3 * delta;
        mh[j] += c1 * delta;
      }
    }
  }
}
""".replace("STRIP", str(STRIP))

_FLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC"]
_lock = threading.Lock()
_loaded: dict[str, Callable[..., None] | None] = {}  # by $CXX
_UNSET = object()


def _cpu_features() -> str:
    """The CPU's feature flags (Linux), so that a library built for one CPU is never loaded on another."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _build(compiler: str) -> Path:
    """The kernel's shared library, built unless the cache holds it (written under a temporary name, then
    renamed: concurrent builders never load a partial file)."""
    key = hashlib.sha256("\0".join([_SOURCE, compiler, *_FLAGS, _cpu_features()]).encode()).hexdigest()[:24]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "covgrad"
    lib = cache / f"fold-{key}.so"
    if lib.exists():
        return lib
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        src, out = Path(tmp) / "fold.cpp", Path(tmp) / "fold.so"
        src.write_text(_SOURCE)
        subprocess.run([compiler, *_FLAGS, str(src), "-o", str(out)], check=True, capture_output=True, timeout=300)
        os.replace(out, lib)
    return lib


def native_fold() -> Callable[..., None] | None:
    """The kernel (built and loaded once per process) as ``fold(x, order, offsets, acen, coef, mean, m2, c,
    col0)``, or None when no C++ compiler builds it.

    Args of the returned function:
        x: (B, n) float32, contiguous: the batch's block of columns [col0, col0 + n).
        order: (B,) int64, the samples ordered by half (stable); offsets: (H + 1,) int64, half h's samples are
            order[offsets[h]:offsets[h + 1]].
        acen: (B,) float64, each sample's a − ā_b of its half; coef: (5, H) float64 as
            :func:`covgrad.moments.accum._fold_started` takes it.
        mean, m2, c: (H, P) float64 contiguous state (c None without the co-moment), updated in place at
            columns [col0, col0 + n).
    """
    cxx = os.environ.get("CXX", "")
    fold = _loaded.get(cxx, _UNSET)  # resolved once per compiler setting (a fold calls this once per block)
    if fold is _UNSET:
        with _lock:
            if cxx not in _loaded:
                compiler = cxx or shutil.which("g++") or ""
                _loaded[cxx] = _load(compiler) if compiler else None
            fold = _loaded[cxx]
    return fold


def _load(compiler: str) -> Callable[..., None] | None:
    """The built kernel wrapped as :func:`native_fold` describes; None when it does not build or load."""
    try:
        kernel = ctypes.CDLL(str(_build(compiler))).covgrad_fold_f64
    except (OSError, subprocess.SubprocessError):
        return None
    kernel.restype = None
    kernel.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 7
    kernel.argtypes += [ctypes.c_int64, ctypes.c_int]

    def fold(
        x: Tensor,
        order: Tensor,
        offsets: Tensor,
        acen: Tensor,
        coef: Tensor,
        mean: Tensor,
        m2: Tensor,
        c: Tensor | None,
        col0: int,
    ) -> None:
        n, ld = x.shape[1], mean.shape[1]
        state = [t for t in (mean, m2, c) if t is not None]
        if not x.is_contiguous() or any(not t.is_contiguous() or t.shape != mean.shape for t in state):
            raise ValueError(f"native fold: block {tuple(x.shape)} and state {tuple(mean.shape)} must be contiguous")

        def at(t: Tensor) -> int:  # the state's column col0 of half 0
            return t.data_ptr() + col0 * t.element_size()

        kernel(
            x.data_ptr(),
            n,
            mean.shape[0],
            order.data_ptr(),
            offsets.data_ptr(),
            acen.data_ptr(),
            coef.data_ptr(),
            at(mean),
            at(m2),
            None if c is None else at(c),
            ld,
            torch.get_num_threads(),
        )

    return fold
