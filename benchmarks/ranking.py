"""Benchmark of the trajectory tracker's rankings: ``covgrad.updates.columns.stable_order`` against numpy's stable
argsort (the definition it must equal) on one predictor's float64 values, over the whole layout and within the
10 |w_0| deciles; seconds, the peak of numpy's allocations above the input (``tracemalloc``, which numpy reports
to), and whether the two orders are equal.

The values are continuous (normal) float64 with a tenth of them exactly 0 (a Fisher over rows nobody samples),
so float32 rounding ties most columns and exact ties are many: the case that made the earlier sort of float32
keys re-sort nearly every column. Default size: SmolLM2-135M with every parameter selected (P = 134,515,008).

Run: ``python -m benchmarks.ranking`` (about 3 GB of RAM at full size), smaller ``--columns 10000000``.
"""

from __future__ import annotations

import argparse
import time
import tracemalloc
from collections.abc import Callable

import numpy as np

from covgrad.updates.columns import sort_key, stable_order
from covgrad.updates.kstep import N_DECILES

SMOLLM2_P = 134_515_008


def measured(fn: Callable[[], np.ndarray]) -> tuple[np.ndarray, float, float]:
    """``fn()``, its seconds and the peak of traced allocations during it (GB), its result included."""
    tracemalloc.start()
    t = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t
    peak = tracemalloc.get_traced_memory()[1] / 1e9
    tracemalloc.stop()
    return out, seconds, peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--columns", type=int, default=SMOLLM2_P)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    values = rng.standard_normal(args.columns)
    values[rng.random(args.columns) < 0.1] = 0.0
    deciles = (np.arange(args.columns, dtype=np.int64) * N_DECILES // args.columns).astype(np.int8)
    rng.shuffle(deciles)
    print(f"columns {args.columns:,}, input {values.nbytes / 1e9:.2f} GB float64")
    print(f"{'ranking':10s} {'method':24s} {'seconds':>8s} {'peak GB':>8s}")
    cases = {
        "whole": (lambda: stable_order(values, True), lambda: np.argsort(sort_key(values, True), kind="stable")),
        "deciles": (
            lambda: stable_order(values, True, deciles),
            lambda: np.lexsort((sort_key(values, True), deciles)),
        ),
    }
    for name, (fast, reference) in cases.items():
        got, s_fast, m_fast = measured(fast)
        print(f"{name:10s} {'stable_order':24s} {s_fast:8.1f} {m_fast:8.2f}")
        want, s_ref, m_ref = measured(reference)
        label = "argsort(stable)" if name == "whole" else "lexsort"
        print(f"{name:10s} {label:24s} {s_ref:8.1f} {m_ref:8.2f}")
        equal = np.array_equal(got, want)
        print(f"{name:10s} equal {equal}; time ratio {s_fast / s_ref:.2f}, memory ratio {m_fast / m_ref:.2f}")
        del got, want


if __name__ == "__main__":
    main()
