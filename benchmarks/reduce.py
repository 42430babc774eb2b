"""Throughput of the statistics reduction and of the exact top-k, each against plain numpy in one run.

1. ``compute_stats(sample_moments(S, A))`` over an in-memory dask array S (N, P) float32 with chunks
   (32, 65536), threaded scheduler, against a numpy float64 implementation of the same statistics
   (blocked one-pass raw sums) on the same data. Goal: dask ≥ 0.6× numpy throughput.
2. ``topk_indices`` over P float32 values in a memory-mapped file (a dask array of 4M-value chunks,
   and the numpy memmap itself) against loading it and calling ``np.argpartition``, on continuous and
   on bf16-quantised (heavily tied) values. Time without tracing; peak Python-heap memory in a
   second, traced run (tracemalloc; the page-cached file is not counted). Goal: < 2 s, < 500 MB.

Run: ``python -m benchmarks.reduce`` (full size: 1 GiB of scores, 1e8 top-k values, about 3 GB of
RAM and 800 MB of temporary disk), or smaller, e.g. ``python -m benchmarks.reduce --N 64 --P 262144
--topk-P 10000000``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import dask
import dask.array as da
import numpy as np
import torch

from covgrad.moments import compute_stats, sample_moments, topk_indices


def numpy_stats(S: np.ndarray, A: np.ndarray, block_rows: int) -> dict[str, Any]:
    """The same statistics in plain numpy: float64 raw sums over row blocks, then the 1/N formulas."""
    N, P = S.shape
    sum_s, sum_ss, sum_as = np.zeros(P), np.zeros(P), np.zeros(P)
    for i in range(0, N, block_rows):
        s = S[i : i + block_rows].astype(np.float64)  # (b, P)
        sum_s += s.sum(0)
        sum_ss += np.einsum("ij,ij->j", s, s)
        sum_as += A[i : i + block_rows] @ s
    m, F, G = sum_s / N, sum_ss / N, sum_as / N
    mean_A, std_A = A.mean(), A.std()
    Fvar = F - m * m
    Cov = G - mean_A * m
    bound = std_A * np.sqrt(Fvar)
    with np.errstate(divide="ignore", invalid="ignore"):
        rho = np.where(bound > 0, Cov / bound, np.nan)
        zm = N * m * m / Fvar
    return {
        "m": m,
        "F": F,
        "Fvar": Fvar,
        "G": G,
        "Cov": Cov,
        "rho": rho,
        "bound_violations": (np.abs(Cov) > bound * (1 + 1e-6)).sum(),
        "zero_mean_trace": N * (m * m).sum() / Fvar.sum(),
        "zero_mean_coord": zm[Fvar > 0].mean(),
    }


def best_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    best, out = np.inf, None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def peak_mb(fn: Callable[[], Any]) -> float:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()


def bench_reduce(N: int, P: int, repeats: int) -> None:
    rng = np.random.default_rng(0)
    S = rng.standard_normal((N, P), dtype=np.float32)
    A = rng.standard_normal(N)
    mb = S.nbytes / 1e6
    S_dask = da.from_array(S, chunks=(32, 65536))

    def run_dask() -> dict[str, Any]:
        (out,) = dask.compute(compute_stats(sample_moments(S_dask, A)), scheduler="threads")
        return out

    t_np, ref = best_time(lambda: numpy_stats(S, A, 32), repeats)
    t_dask, got = best_time(run_dask, repeats)
    err = max(np.max(np.abs(got[k] - ref[k]) / np.abs(ref[k]).max()) for k in ("F", "G", "Cov", "rho"))
    print(f"\n## statistics reduction: N = {N}, P = {P} ({mb:.0f} MB float32), best of {repeats}\n")
    print("| method | s | MB/s | throughput × numpy |")
    print("|---|---|---|---|")
    print(f"| numpy float64 in memory, blocked raw sums | {t_np:.3f} | {mb / t_np:.0f} | 1.00 |")
    print(f"| covgrad dask threads, chunks (32, 65536) | {t_dask:.3f} | {mb / t_dask:.0f} | {t_np / t_dask:.2f} |")
    print(f"\nmax |difference| / max |value| over F, G, Cov, rho: {err:.1e}")


def write_values(path: Path, P: int, ties: bool) -> np.memmap:
    mm = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(P,))
    rng = np.random.default_rng(1)
    step = 1 << 22
    for i in range(0, P, step):
        x = rng.standard_exponential(min(step, P - i), dtype=np.float32)
        if ties:  # bf16 quantisation: 8 mantissa bits, thousands of ties at any threshold
            x = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
        mm[i : i + step] = x
    mm.flush()
    return np.load(path, mmap_mode="r")


def _load(path: Path, start: int, stop: int) -> np.ndarray:
    return np.load(path, mmap_mode="r")[start:stop]  # a view of the page cache, no copy


def memmap_dask(path: Path, P: int, chunk: int) -> da.Array:
    """The .npy file as a dask array of memmap views (``da.from_array`` would copy the whole array)."""
    blocks = [
        da.from_delayed(dask.delayed(_load)(path, s, min(s + chunk, P)), (min(s + chunk, P) - s,), np.float32)
        for s in range(0, P, chunk)
    ]
    return da.concatenate(blocks)


def argpartition_topk(values: np.ndarray, k: int) -> np.ndarray:
    x = np.array(values)  # load into memory
    return np.sort(np.argpartition(-x, k - 1)[:k])


def bench_topk(P: int, frac: float, repeats: int) -> None:
    k = int(P * frac)
    print(f"\n## exact top-k: P = {P}, k = {k}, float32 memmap, best of {repeats}\n")
    print("| data | method | s | peak MB (tracemalloc) | same values as argpartition |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for ties in (False, True):
            path = Path(tmp) / f"values_{ties}.npy"
            values = write_values(path, P, ties)
            lazy = memmap_dask(path, P, 1 << 22)
            methods = {
                "radix, dask threads (4M chunks)": lambda v=lazy: topk_indices(v, k),
                "radix, numpy memmap": lambda v=values: topk_indices(v, k),
                "load + np.argpartition": lambda v=values: argpartition_topk(v, k),
            }
            results = {}
            for name, fn in methods.items():
                seconds, idx = best_time(fn, repeats)
                results[name] = (seconds, peak_mb(fn), np.sort(values[idx]))
            ref = results["load + np.argpartition"][2]
            for name, (seconds, peak, vals) in results.items():
                label = "bf16-quantised" if ties else "continuous"
                print(f"| {label} | {name} | {seconds:.2f} | {peak:.0f} | {np.array_equal(vals, ref)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--N", type=int, default=256, help="samples in the reduction benchmark")
    parser.add_argument("--P", type=int, default=1 << 20, help="parameters in the reduction benchmark")
    parser.add_argument("--topk-P", type=int, default=100_000_000, help="values in the top-k benchmark")
    parser.add_argument("--frac", type=float, default=0.01, help="k / P in the top-k benchmark")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions (best is reported)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    bench_reduce(args.N, args.P, args.repeats)
    bench_topk(args.topk_P, args.frac, args.repeats)


if __name__ == "__main__":
    main()
