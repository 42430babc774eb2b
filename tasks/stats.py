"""stats stage: Fisher, covariance, alignment, the bound and the cross-fit, reduced with dask.

Reads the scores store lazily: per-sample rows when they were kept (exact float64 moments of the
stored float32 scores), else the moment rows. Runs on dask's threaded scheduler, or on the
dask.distributed scheduler at ``dask.address``. Store ``stats.zarr``: (param,) float64 arrays m, F,
Fvar, G, Cov, rho, crossfit_ratio; per-tensor summaries over dim ``tensor``; scalars in attrs, and
``degenerate``: why the run has no finding about G (std(A) = 0, no scored tokens), else None.
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
    scal = {n: sc[n][:] for n in ("mean_a", "m2_a")}

    def pick(sel: np.ndarray) -> Moments:
        idx = np.flatnonzero(sel & (count > 0))
        return Moments(
            count[idx], scal["mean_a"][idx], scal["m2_a"][idx], *(arrays[n][idx] for n in ("mean_s", "m2_s", "c_as"))
        )

    r = np.arange(len(count))
    return pick(np.ones_like(r, dtype=bool)), pick(r % 2 == 0), pick(r % 2 == 1)


def degenerate(stats: dict[str, np.ndarray]) -> str | None:
    """Why the run's statistics carry no finding about G (in words), or None: every score is 0 (no
    scored tokens), or std(A) = 0 (no reward variance: G ≡ 0)."""
    if not np.any(stats["F"] > 0):
        return "no scored tokens: every score is 0; F, G, overlap, ρ and the bound are undefined"
    if not float(stats["std_A"]) > 0:
        return "no reward variance: G ≡ 0; overlap, ρ and the bound are undefined"
    return None


def _compute(store: ArtifactStore, ref: ArtifactRef, cfg: PipelineConfig, up: ArtifactRef) -> dict[str, Any]:
    sc = store.open_group(up, SCORES, mode="r")
    layout = ParamLayout.from_records(sc.attrs["tensors"])
    full, even, odd = load_moments(sc)
    with dask_scheduler(cfg.dask.address), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # std(A) = 0 is reported below, as a finding
        stats = compute_stats(full)
        cross = [crossfit_stats(even, odd), crossfit_stats(odd, even)]
        (stats, cross) = dask.compute(stats, cross)
    stats = {k: np.asarray(v) for k, v in stats.items()}
    finding = degenerate(stats)
    if finding:
        log.warning("stats %s: %s", ref.key, finding)
    summary = {k: np.asarray(v) for k, v in tensor_summary(stats, layout).items()}
    g = store.open_group(ref, STORE, mode="w")
    chunk = min(layout.P, 65536)
    for name in PARAM_STATS:
        g.create_array(name, data=stats[name].astype(np.float64), chunks=(chunk,), dimension_names=["param"])
    g.create_array(
        "crossfit_ratio",
        data=np.asarray(cross[0]["ratio"], dtype=np.float64),
        chunks=(chunk,),
        dimension_names=["param"],
    )
    for name, values in summary.items():
        g.create_array(f"tensor_{name}", data=values, dimension_names=["tensor"])
    names = g.create_array("tensor_name", shape=(len(layout.entries),), dtype=str, dimension_names=["tensor"])
    names[:] = np.asarray([e.name for e in layout.entries])
    g.create_array("tensor_offset", data=np.asarray([e.offset for e in layout.entries]), dimension_names=["tensor"])
    scalars = {k: stats[k].item() for k in SCALARS}
    finite_rho = stats["rho"][np.isfinite(stats["rho"])]
    scalars["max_abs_rho"] = float(np.abs(finite_rho).max()) if finite_rho.size else float("nan")
    scalars["P"] = layout.P
    scalars["kl_sampler_policy_per_token"] = sc.attrs.get("kl_sampler_policy_per_token", float("nan"))
    for i, c in enumerate(cross):
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
