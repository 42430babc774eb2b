"""stats stage: Fisher, covariance, alignment, the bound and the cross-fit of a scores artifact.

Opens the scores store lazily (per-sample rows when they were kept, else the moment-state rows, two per
shard) and reduces it with ``covgrad.stats.blocked_stats`` in blocks along ``param``, on dask's threaded
scheduler or on the dask.distributed scheduler at ``dask.address``. Store ``stats.zarr``: (param,)
float64 arrays m, F, Fvar, G, Cov, rho, crossfit_ratio; per-tensor summaries over dim ``tensor``; the
scalars in attrs; ``degenerate``: why the run has no finding about G, else None; ``crossfit_undefined``:
why the cross-fit is undefined, else None. Degenerate runs are findings, not errors: the stage completes
and says why in its log and attrs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from functools import partial
from typing import Any

import dask
import dask.array as da
import numpy as np
from prefect import task

from covgrad.layout import ParamLayout
from covgrad.stats import BLOCK_OUTPUTS, Moments, blocked_stats, sample_moments
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.schema import SCORES, annotate, create, param_chunk, write
from storage.schema import STATS as STORE
from tasks.common import StageResult, log, run_stage
from tasks.specs import StatsSpec


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


def sample_counts(sc: Any) -> tuple[int, int, int]:
    """N and the samples of the even and the odd prompt-group halves of a scores group."""
    if "scores" in sc:
        parity = sc["group"][:] % 2
        return int(parity.size), int((parity == 0).sum()), int((parity == 1).sum())
    count = sc["count"][:]  # rows 2·shard + half
    return int(count.sum()), int(count[0::2].sum()), int(count[1::2].sum())


def load_moments(sc: Any, cols: slice = slice(None), halves: bool = True) -> tuple[Moments, ...]:
    """All moments of the parameters ``cols`` and, with ``halves``, those of the two prompt-group-parity
    halves (even, odd), lazily, from a scores group."""
    if "scores" in sc:
        S = da.from_zarr(sc["scores"])[:, cols]
        A = sc["advantage"][:]
        parity = sc["group"][:] % 2
        rows = S.chunks[0][0]
        parts = [sample_moments(S[parity == h], A[parity == h], block_rows=rows) for h in (0, 1)] if halves else []
        return sample_moments(S, A, block_rows=rows), *parts
    count = sc["count"][:]
    arrays = {n: da.from_zarr(sc[n])[:, cols] for n in ("mean_s", "m2_s", "c_as")}
    if "mean_s_lo" in sc:  # float32 state: the mean is an unevaluated pair hi + lo
        lo = da.from_zarr(sc["mean_s_lo"])[:, cols]
        arrays["mean_s"] = arrays["mean_s"].astype(np.float64) + lo.astype(np.float64)
    scal = {n: sc[n][:] for n in ("mean_a", "m2_a")}

    def pick(sel: np.ndarray) -> Moments:
        idx = np.flatnonzero(sel & (count > 0))
        return Moments(
            count[idx], scal["mean_a"][idx], scal["m2_a"][idx], *(arrays[n][idx] for n in ("mean_s", "m2_s", "c_as"))
        )

    r = np.arange(len(count))
    return pick(np.ones_like(r, dtype=bool)), *((pick(r % 2 == 0), pick(r % 2 == 1)) if halves else ())


def _compute(store: ArtifactStore, ref: ArtifactRef, spec: StatsSpec, up: ArtifactRef) -> dict[str, Any]:
    sc = store.open_group(up, SCORES, mode="r")
    layout = ParamLayout.from_records(sc.attrs["tensors"])
    g = store.open_group(ref, STORE, mode="w")
    out = {name: create(g, STORE, name, (layout.P,)) for name in BLOCK_OUTPUTS}
    with dask_scheduler(spec.dask_address):
        result = blocked_stats(partial(load_moments, sc), sample_counts(sc), layout, out, chunk=param_chunk(layout.P))
    for note in result.notes:
        log.warning("stats %s: %s", ref.key, note)
    for name, values in result.tensors.items():
        write(g, STORE, f"tensor_{name}", values)
    kl = sc.attrs.get("kl_sampler_policy_per_token", math.nan)  # recorded by the scores stage
    scalars = {**result.scalars, "kl_sampler_policy_per_token": kl, **result.crossfit}
    g.attrs.update(
        {
            "scalars": scalars,
            "tensors": sc.attrs["tensors"],
            "centering": sc.attrs["centering"],
            "sampler": sc.attrs["sampler"],
            "source": "per-sample rows" if "scores" in sc else "moment rows",
            "degenerate": result.degenerate,
            "crossfit_undefined": result.crossfit_undefined,
        }
    )
    annotate(g, STORE, layout)
    store.consolidate(ref, STORE)
    return {"scalars": scalars}


@task(name="stats")
def stats_task(ref: ArtifactRef, spec: StatsSpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """Reduce the scores artifact ``upstream["scores"]`` into statistics."""
    return run_stage(ref, spec, lambda store, r: _compute(store, r, spec, upstream["scores"]))
