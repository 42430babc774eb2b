"""stats stage: Fisher, covariance, alignment, the bound and the cross-fit, reduced with dask.

Reads the scores store lazily: per-sample rows when they were kept (exact float64 moments of the
stored float32 scores), else the moment-state rows (two per shard), in blocks along ``param``, and
writes the (param,) outputs block by block, so memory is bounded by the block size, not P (except for
``overlap_1pct``, which ranks the whole F and |G| as the masks stage does). Runs on
dask's threaded scheduler, or on the dask.distributed scheduler at ``dask.address``. Store
``stats.zarr``: (param,) float64 arrays m, F, Fvar, G, Cov, rho, crossfit_ratio; per-tensor summaries
over dim ``tensor``; scalars in attrs (with ``adv_rms`` = √mean(A²) and ``overlap_1pct``, the
global overlap of the top 1% by |G| and by F); ``degenerate``: why the run has no finding about G (N < 2,
no scored tokens, std(A) = 0), else None; ``crossfit_undefined``: why the cross-fit is undefined (a
prompt-group half with N < 2, e.g. a single prompt group: its ratios are NaN), else None. Degenerate runs
are findings, not errors: the stage completes and says why in its log and attrs.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Iterator
from typing import Any

import dask
import dask.array as da
import numpy as np
from prefect import task

from covgrad.layout import ParamLayout
from covgrad.stats import compute_stats, crossfit_stats, tensor_summary
from covgrad.topk import overlap_table
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.schema import SCORES, annotate, create, param_chunk, write
from storage.schema import STATS as STORE
from storage.scores import load_moments, sample_counts
from tasks.common import StageResult, log, run_stage
from tasks.specs import StatsSpec

PARAM_STATS = ("m", "F", "Fvar", "G", "Cov", "rho")
OFF_POLICY_Q = 0.01  # the q of ``overlap_1pct``, the off-policy table's overlap column


@contextlib.contextmanager
def dask_scheduler(address: str | None) -> Iterator[None]:
    """The threaded scheduler, or a dask.distributed client connected to ``address``."""
    if address is None:
        with dask.config.set(scheduler="threads"):
            yield
        return
    from distributed import Client

    with Client(address, timeout="20s") as client:
        log.info("stats: reducing on dask.distributed scheduler %s", address)
        with dask.config.set(scheduler=client.get):
            yield


def degenerate(N: int, any_score: bool, std_A: float) -> str | None:
    """Why the run's statistics carry no finding about G (in words), or None: fewer than two samples,
    every score 0 (no scored tokens; ``any_score`` is whether some F_i > 0), or std(A) = 0 (no reward
    variance: G ≡ 0)."""
    if N < 2:
        return f"too few samples: N = {N}, the statistics need N ≥ 2; F, G, overlap, ρ and the bound are undefined"
    if not any_score:
        return "no scored tokens: every score is 0; F, G, overlap, ρ and the bound are undefined"
    if not float(std_A) > 0:
        return "no reward variance: G ≡ 0; overlap, ρ and the bound are undefined"
    return None


def crossfit_gap(n_even: int, n_odd: int) -> str | None:
    """Why the cross-fit is undefined (a prompt-group half with fewer than two samples), or None."""
    small = [(name, n) for name, n in (("even", n_even), ("odd", n_odd)) if n < 2]
    if not small:
        return None
    name, n = small[0]
    return (
        f"cross-fit undefined: the {name} prompt groups hold N = {n} samples, each half needs N ≥ 2; "
        "give at least two prompt groups"
    )


def _compute(store: ArtifactStore, ref: ArtifactRef, spec: StatsSpec, up: ArtifactRef) -> dict[str, Any]:
    sc = store.open_group(up, SCORES, mode="r")
    layout = ParamLayout.from_records(sc.attrs["tensors"])
    P = layout.P
    g = store.open_group(ref, STORE, mode="w")
    chunk = param_chunk(P)
    outputs = (*PARAM_STATS, "crossfit_ratio")
    for name in outputs:
        create(g, STORE, name, (P,))
    N, n_even, n_odd = sample_counts(sc)
    gap = crossfit_gap(n_even, n_odd)
    nan = float("nan")
    # Parameter blocks of whole chunks, one after the other: memory is bounded by the block, not P. The
    # (param,) statistics are elementwise in the parameter, so blocks give exactly the whole-P values;
    # the scalars are sums, counts and maxima over blocks. With N < 2 every statistic is undefined: the
    # arrays are written as NaN (every chunk exists) and nothing is reduced.
    block = chunk * 64
    totals = {"bound_violations": 0, "m2_sum": 0.0, "fvar_sum": 0.0, "coord_sum": 0.0, "coord_n": 0, "max_rho": -1.0}
    cross_counts = [{"n_exceed": 0, "n_finite": 0} for _ in range(2)]
    first: dict[str, Any] = {}
    any_score = False
    with dask_scheduler(spec.dask_address), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # std(A) = 0 is reported below, as a finding
        for j in range(0, max(P, 1), block):
            cols = slice(j, min(P, j + block))
            if N < 2:
                for name in outputs:
                    g[name][cols] = np.full(cols.stop - cols.start, nan)
                continue
            full, *halves = load_moments(sc, cols, halves=gap is None)
            lazy_cross = [crossfit_stats(*halves), crossfit_stats(*halves[::-1])] if halves else []
            stats, *cross = dask.compute(compute_stats(full), *lazy_cross)
            for name in PARAM_STATS:
                g[name][cols] = np.asarray(stats[name], dtype=np.float64)
            ratio = cross[0]["ratio"] if cross else np.full(cols.stop - cols.start, nan)
            g["crossfit_ratio"][cols] = np.asarray(ratio, dtype=np.float64)
            first = first or stats
            m, Fvar, rho = (np.asarray(stats[k]) for k in ("m", "Fvar", "rho"))
            varies = Fvar > 0
            any_score = any_score or bool((np.asarray(stats["F"]) > 0).any())
            totals["bound_violations"] += int(stats["bound_violations"])
            totals["m2_sum"] += float((m * m).sum())
            totals["fvar_sum"] += float(Fvar.sum())
            totals["coord_sum"] += float((m[varies] ** 2 / Fvar[varies]).sum())
            totals["coord_n"] += int(varies.sum())
            finite = np.abs(rho[np.isfinite(rho)])
            totals["max_rho"] = max(totals["max_rho"], float(finite.max()) if finite.size else -1.0)
            for c, counts in zip(cross, cross_counts[: len(cross)], strict=True):
                counts["n_exceed"] += int(c["n_exceed"])
                counts["n_finite"] += int(c["n_finite"])
        stored = {k: da.from_zarr(g[k]) for k in ("F", "Fvar", "G", "rho")}
        (summary,) = dask.compute(tensor_summary(stored, layout))
    finding = degenerate(N, any_score, float(first.get("std_A", nan)))
    overlap = [] if finding else overlap_table(g["F"][:], np.abs(g["G"][:]), layout, [OFF_POLICY_Q])
    for note in (finding, gap if not finding else None):
        if note:
            log.warning("stats %s: %s", ref.key, note)
    if first:
        scalars: dict[str, Any] = {k: np.asarray(first[k]).item() for k in ("N", "mean_A", "std_A", "rho_undefined")}
    else:
        scalars = {"N": N, "mean_A": nan, "std_A": nan, "rho_undefined": True}
    scalars["bound_violations"] = totals["bound_violations"]
    scalars["zero_mean_trace"] = N * totals["m2_sum"] / totals["fvar_sum"] if totals["fvar_sum"] > 0 else nan
    scalars["zero_mean_coord"] = N * totals["coord_sum"] / totals["coord_n"] if totals["coord_n"] else nan
    summary = {k: np.asarray(v) for k, v in summary.items()}
    for name, values in summary.items():
        write(g, STORE, f"tensor_{name}", values)
    scalars["max_abs_rho"] = totals["max_rho"] if totals["max_rho"] >= 0 else nan
    scalars["adv_rms"] = math.sqrt(scalars["std_A"] ** 2 + scalars["mean_A"] ** 2)  # √mean(A²), the bound's scale
    scalars["overlap_1pct"] = next((float(r["overlap"]) for r in overlap if r["scope"] == "global"), nan)
    scalars["P"] = P
    scalars["kl_sampler_policy_per_token"] = sc.attrs.get("kl_sampler_policy_per_token", nan)
    for i, c in enumerate(cross_counts):
        tag = "even_F_odd_G" if i == 0 else "odd_F_even_G"
        scalars[f"crossfit_{tag}_n_exceed"] = c["n_exceed"]
        scalars[f"crossfit_{tag}_n_finite"] = c["n_finite"]
        scalars[f"crossfit_{tag}_frac_exceed"] = c["n_exceed"] / c["n_finite"] if c["n_finite"] else nan
    g.attrs.update(
        {
            "scalars": scalars,
            "tensors": sc.attrs["tensors"],
            "centering": sc.attrs["centering"],
            "sampler": sc.attrs["sampler"],
            "source": "per-sample rows" if "scores" in sc else "moment rows",
            "degenerate": finding,
            "crossfit_undefined": gap,
        }
    )
    annotate(g, STORE, layout)
    store.consolidate(ref, STORE)
    return {"scalars": scalars}


@task(name="stats")
def stats_task(ref: ArtifactRef, spec: StatsSpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """Reduce the scores artifact ``upstream["scores"]`` into statistics."""
    return run_stage(ref, spec, lambda store, r: _compute(store, r, spec, upstream["scores"]))
