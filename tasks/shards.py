"""Sharded score extraction: one ``scores`` artifact computed by several dask workers at once.

Shard ``i`` of ``n`` folds the batches ``b`` with ``b % n == i`` of one ``scores.zarr`` store
(layout in ``tasks/scores.py``) into its own two moment-state rows (2i, 2i + 1) and checkpoints; every
batch owns its per-sample rows and ``batch_done`` flag, so shards never write the same chunk. The
order of operations keeps the store consistent:

1. ``begin`` claims the artifact (resuming finished batches) and one call creates every array
   before any shard starts, so no two shards race on ``create_array``;
2. the shards run as mapped Prefect tasks on a ``DaskTaskRunner`` (an existing scheduler or a
   ``LocalCluster``);
3. once all shards returned, one call writes the attributes and consolidated metadata, and the
   completion marker is written last; the flow holds the artifact's writer lock throughout, exactly
   as ``tasks.common.run_stage`` does.

The per-sample rows are those the unsharded stage writes (each batch's numbers depend only on the
batch, given the same torch thread count); the moment state has two rows per shard, which the stats
stage merges, so the statistics agree with the unsharded run's to float64 rounding.
"""

from typing import Any

import torch
from prefect import flow, task, unmapped
from prefect.cache_policies import NO_CACHE
from prefect_dask import DaskTaskRunner

from covgrad.config import PipelineConfig
from storage.artifacts import ArtifactRef, ArtifactStore
from tasks import scores
from tasks.plan import plan


def _shard_inputs(cfg: PipelineConfig, instance: str) -> tuple[ArtifactRef, dict[str, ArtifactRef]]:
    """The planned ref of scores instance ``instance`` and its upstream refs, which must be complete."""
    nodes = plan(cfg)
    if instance not in nodes or nodes[instance].ref.stage != "scores":
        known = [n for n, node in nodes.items() if node.ref.stage == "scores"]
        raise ValueError(f"instance {instance!r} is not a planned scores artifact; choose one of {known}")
    node = nodes[instance]
    store = ArtifactStore(cfg.root)
    upstream = {u: nodes[u].ref for u in node.upstream}
    for name, ref in upstream.items():
        if not store.is_complete(ref):
            raise ValueError(f"upstream {name} ({ref.key}) is not complete; run the pipeline up to {name} first")
    return node.ref, upstream


@task(name="scores-shard", cache_policy=NO_CACHE)
def scores_shard(
    ref: ArtifactRef,
    cfg: PipelineConfig,
    instance: str,
    upstream: dict[str, ArtifactRef],
    shard: tuple[int, int],
    torch_threads: int,
) -> None:
    """Compute the batches of ``shard = (i, n)`` into the store at ``ref`` with ``torch_threads`` threads."""
    torch.set_num_threads(torch_threads)
    scores.ScoresJob(ArtifactStore(ref.root), ref, cfg, instance, upstream, n_shards=shard[1]).run(shard)


@flow(name="covgrad-scores-sharded")
def sharded_scores_flow(
    config: PipelineConfig, instance: str, n_shards: int = 2, torch_threads: int = 1
) -> dict[str, Any]:
    """Compute scores instance ``instance`` (e.g. ``scores.policy.policy``) in ``n_shards`` mapped
    tasks on the flow's task runner; return ``{"key", "computed", "n_shards"}``."""
    if n_shards < 1:
        raise ValueError(f"n_shards {n_shards} must be at least 1")
    if torch_threads < 1:
        raise ValueError(f"torch_threads {torch_threads} must be at least 1")
    ref, upstream = _shard_inputs(config, instance)
    store = ArtifactStore(config.root)
    if store.is_complete(ref):
        return {"key": ref.key, "computed": False, "n_shards": n_shards}
    with store.lock(ref):
        if store.is_complete(ref):
            return {"key": ref.key, "computed": False, "n_shards": n_shards}
        claim = store.begin(ref, {"instance": instance, "params": config.scores.params}, resume=True)
        job = scores.ScoresJob(store, ref, config, instance, upstream, n_shards=n_shards)
        job.prepare()
        futures = scores_shard.map(
            unmapped(ref),
            unmapped(config),
            unmapped(instance),
            unmapped(upstream),
            [(i, n_shards) for i in range(n_shards)],
            unmapped(torch_threads),
        )
        futures.result()
        extra = job.finalize()
        if extra is None:
            raise RuntimeError(f"scores {ref.key}: batches still pending after all {n_shards} shards finished")
        store.complete(ref, claim, {"n_shards": n_shards, **extra})
    return {"key": ref.key, "computed": True, "n_shards": n_shards}


def sharded_scores(
    config: PipelineConfig,
    instance: str,
    n_shards: int = 2,
    address: str | None = None,
    torch_threads: int = 1,
) -> dict[str, Any]:
    """Run ``sharded_scores_flow`` on the dask scheduler at ``address`` (default ``config.dask.address``),
    or on a fresh ``LocalCluster`` of ``n_shards`` single-threaded worker processes when neither is set."""
    address = address or config.dask.address
    if address is not None:
        runner = DaskTaskRunner(address=address)
    else:
        runner = DaskTaskRunner(
            cluster_kwargs={
                "n_workers": n_shards,
                "threads_per_worker": 1,
                "processes": True,
                "dashboard_address": None,
            }
        )
    return sharded_scores_flow.with_options(task_runner=runner)(
        config=config, instance=instance, n_shards=n_shards, torch_threads=torch_threads
    )
