"""stats stage: Fisher, covariance, alignment, the bound and the cross-fit of a scores artifact.

Opens the scores store lazily (per-sample rows when they were kept, else the moment-state rows, two per
shard) and reduces it with ``covgrad.moments.stats.blocked_stats`` in blocks along ``param``, on dask's threaded
scheduler or on the dask.distributed scheduler at ``dask.address``. Store ``stats.zarr``: (param,)
float64 arrays m, F, Fvar, G, Cov, rho, crossfit_ratio; per-tensor summaries over dim ``tensor``; the
scalars in attrs; ``degenerate``: why the run has no finding about G, else None; ``crossfit_undefined``:
why the cross-fit is undefined, else None. Degenerate runs are findings, not errors: the stage completes
and says why in its log and attrs. A NaN or ±inf F or G is an error: the stage fails in one line naming the
scores artifact and how many coordinates, and marks nothing complete.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from functools import partial
from typing import Any

import dask
from prefect import task

from covgrad.layout import ParamLayout
from covgrad.moments import BLOCK_OUTPUTS, blocked_stats
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.schema import SCORES, annotate, create, param_chunk, write
from storage.schema import STATS as STORE
from storage.stores.scores import load_moments, sample_counts
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


def _compute(store: ArtifactStore, ref: ArtifactRef, spec: StatsSpec, up: ArtifactRef) -> dict[str, Any]:
    sc = store.open_group(up, SCORES, mode="r")
    layout = ParamLayout.from_records(sc.attrs["tensors"])
    g = store.open_group(ref, STORE, mode="w")
    out = {name: create(g, STORE, name, (layout.P,)) for name in BLOCK_OUTPUTS}
    with dask_scheduler(spec.dask_address):
        result = blocked_stats(
            partial(load_moments, sc),
            sample_counts(sc),
            layout,
            out,
            chunk=param_chunk(layout.P),
            where=f"scores artifact {up.stage}/{up.key}",
        )
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
