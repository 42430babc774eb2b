"""stats stage: Fisher, covariance, alignment, the bound and the cross-fit, reduced with dask.

Reads the scores store lazily: per-sample rows when they were kept (exact float64 moments of the
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # std(A) = 0 is reported below, as a finding
        stats = compute_stats(full)
        cross = [crossfit_stats(even, odd), crossfit_stats(odd, even)]
        summary = tensor_summary(stats, layout)
    rho = stats["rho"]
    max_abs_rho = da.nanmax(da.where(da.isfinite(rho), abs(rho), np.nan)) if layout.P else da.asarray(np.nan)
    any_score = (da.asarray(stats["F"]) > 0).any()
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import dask
import dask.array as da
import numpy as np
from prefect import task

from covgrad.config import PipelineConfig
from covgrad.layout import ParamLayout
from covgrad.stats import Moments, compute_stats, crossfit_stats, sample_moments, tensor_summary
from storage.artifacts import ArtifactRef, ArtifactStore
from tasks.common import StageResult, log, run_stage
from tasks.scores import STORE as SCORES

STORE = "stats.zarr"
PARAM_STATS = ("m", "F", "Fvar", "G", "Cov", "rho")
SCALARS = ("N", "mean_A", "std_A", "rho_undefined", "bound_violations", "zero_mean_trace", "zero_mean_coord")


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


def load_moments(sc: Any) -> tuple[Moments, Moments, Moments]:
    """All moments and the two prompt-group-parity halves, lazily, from a scores group."""
    if "scores" in sc:
        S = da.from_zarr(sc["scores"])
        A = sc["advantage"][:]
        parity = sc["group"][:] % 2
        rows = S.chunks[0][0]
        halves = [sample_moments(S[parity == h], A[parity == h], block_rows=rows) for h in (0, 1)]
        return sample_moments(S, A, block_rows=rows), halves[0], halves[1]
    count = sc["count"][:]
    arrays = {n: da.from_zarr(sc[n]) for n in ("mean_s", "m2_s", "c_as")}
    if "mean_s_lo" in sc:  # float32 state: the mean is an unevaluated pair hi + lo
        arrays["mean_s"] = arrays["mean_s"].astype(np.float64) + da.from_zarr(sc["mean_s_lo"]).astype(np.float64)
    scal = {n: sc[n][:] for n in ("mean_a", "m2_a")}

    def pick(sel: np.ndarray) -> Moments:
        idx = np.flatnonzero(sel & (count > 0))
        return Moments(
            count[idx], scal["mean_a"][idx], scal["m2_a"][idx], *(arrays[n][idx] for n in ("mean_s", "m2_s", "c_as"))
        )

    r = np.arange(len(count))
    return pick(np.ones_like(r, dtype=bool)), pick(r % 2 == 0), pick(r % 2 == 1)


def degenerate(any_score: bool, std_A: float) -> str | None:
    """Why the run's statistics carry no finding about G (in words), or None: every score is 0 (no
    scored tokens; ``any_score`` is whether some F_i > 0), or std(A) = 0 (no reward variance: G ≡ 0)."""
    if not any_score:
        return "no scored tokens: every score is 0; F, G, overlap, ρ and the bound are undefined"
    if not float(std_A) > 0:
        return "no reward variance: G ≡ 0; overlap, ρ and the bound are undefined"
    return None


def _compute(store: ArtifactStore, ref: ArtifactRef, cfg: PipelineConfig, up: ArtifactRef) -> dict[str, Any]:
    sc = store.open_group(up, SCORES, mode="r")
    layout = ParamLayout.from_records(sc.attrs["tensors"])
    full, even, odd = load_moments(sc)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # std(A) = 0 is reported below, as a finding
        stats = compute_stats(full)
        cross = [crossfit_stats(even, odd), crossfit_stats(odd, even)]
        summary = tensor_summary(stats, layout)
    rho = stats["rho"]
    max_abs_rho = da.nanmax(da.where(da.isfinite(rho), abs(rho), np.nan)) if layout.P else da.asarray(np.nan)
    any_score = (da.asarray(stats["F"]) > 0).any()
    g = store.open_group(ref, STORE, mode="w")
    chunk = max(1, min(layout.P, 65536))
    columns = {name: stats[name] for name in PARAM_STATS} | {"crossfit_ratio": cross[0]["ratio"]}
    targets = [
        g.create_array(name, shape=(layout.P,), chunks=(chunk,), dtype="float64", dimension_names=["param"])
        for name in columns
    ]
    # (param,) arrays go to the store chunk by chunk (memory bounded by the chunk size, not P); the
    # scalars and per-tensor sums come out of the same pass over the moment rows.
    sources = [da.asarray(x, dtype=np.float64).rechunk(chunk) for x in columns.values()]
    with dask_scheduler(cfg.dask.address), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # reported below as a finding, not from inside dask
        small = {k: stats[k] for k in SCALARS}
        crossed = [{k: c[k] for k in ("n_exceed", "n_finite", "frac_exceed")} for c in cross]
        stored = da.store(sources, targets, lock=False, compute=False)
        computed = dask.compute(stored, small, crossed, summary, max_abs_rho, any_score)
        _, small, crossed, summary, max_abs_rho, any_score = computed
    finding = degenerate(bool(any_score), float(small["std_A"]))
    if finding:
        log.warning("stats %s: %s", ref.key, finding)
    summary = {k: np.asarray(v) for k, v in summary.items()}
    for name, values in summary.items():
        g.create_array(f"tensor_{name}", data=values, dimension_names=["tensor"])
    names = g.create_array("tensor_name", shape=(len(layout.entries),), dtype=str, dimension_names=["tensor"])
    names[:] = np.asarray([e.name for e in layout.entries])
    g.create_array("tensor_offset", data=np.asarray([e.offset for e in layout.entries]), dimension_names=["tensor"])
    scalars = {k: np.asarray(small[k]).item() for k in SCALARS}
    scalars["max_abs_rho"] = float(max_abs_rho)
    scalars["P"] = layout.P
    scalars["kl_sampler_policy_per_token"] = sc.attrs.get("kl_sampler_policy_per_token", float("nan"))
    for i, c in enumerate(crossed):
        tag = "even_F_odd_G" if i == 0 else "odd_F_even_G"
        scalars[f"crossfit_{tag}_n_exceed"] = int(c["n_exceed"])
        scalars[f"crossfit_{tag}_n_finite"] = int(c["n_finite"])
        scalars[f"crossfit_{tag}_frac_exceed"] = float(c["frac_exceed"])
    g.attrs.update(
        {
            "scalars": scalars,
            "tensors": sc.attrs["tensors"],
            "centering": sc.attrs["centering"],
            "sampler": sc.attrs["sampler"],
            "source": "per-sample rows" if "scores" in sc else "moment rows",
            "degenerate": finding,
        }
    )
    store.consolidate(ref, STORE)
    return {"scalars": scalars}


@task(name="stats")
def stats_task(ref: ArtifactRef, cfg: PipelineConfig, instance: str, upstream: dict[str, ArtifactRef]) -> StageResult:
    """Reduce ``scores.<sampler>.<centering>`` into statistics."""
    source = upstream[instance.replace("stats.", "scores.", 1)]
    return run_stage(ref, {"instance": instance}, lambda store, r: _compute(store, r, cfg, source))
