"""Sharded score extraction: one ``scores`` artifact computed by the workers of a dask.distributed cluster.

The artifact's partition is ``scores.shards`` = S sample shards × K parameter blocks (layout in
``storage/stores/scores.py``); job (i, k) folds the batches b with b % S == i into block k's columns, with hooks on
that block's tensors only, and owns its checkpoints and state chunks, so jobs never write the same chunk.
Where the jobs run is not part of the artifact: S × K jobs on any number of workers, or one after another
in one process (the pipeline's ``scores`` task), write the same bytes.

Placement: one single-threaded dask worker per device. With ``dask.address`` (or ``address``) the jobs go
to that scheduler; otherwise this process starts a cluster: ``dask_cuda.LocalCUDACluster`` (one worker per
visible GPU) on a cuda machine, a ``LocalCluster`` of single-threaded worker processes on a CPU. GPU
workers of a multi-machine cluster: ``CUDA_VISIBLE_DEVICES=k dask worker tcp://scheduler:8786 --nthreads 1``
per GPU (or ``dask cuda worker tcp://scheduler:8786``).

Order of operations, which keeps the store consistent:

1. the flow reuses a complete artifact, or takes the artifact's writer lock and claims it (resuming
   finished jobs) by the pipeline's run-or-reuse protocol (``tasks.common.run_stage``), and creates every
   array before any job starts, so no two jobs race on ``create_array``;
2. the jobs are submitted to the cluster as plain dask tasks. A job whose worker dies is rerun by the
   scheduler on another worker, and the rerun resumes from the job's newest complete checkpoint (a job's
   state is written only by the job, final state and ``shard_batches`` last), so no batch is folded twice;
3. once every job returned, one call copies the block edges into place and writes the attributes and
   consolidated metadata, and the completion marker is written last.

``covgrad plan --config …`` prints the partition and the memory each worker needs before anything runs.
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from distributed import Client, LocalCluster
from prefect import flow

from covgrad.config import PipelineConfig
from covgrad.devices import PeakRSS
from covgrad.distributed import ModelShape, ShardPlan, Workload, make_plan
from covgrad.layout import select_parameters
from flows.stop import rearm
from storage.artifacts import ArtifactRef, ArtifactStore
from tasks.common import run_stage
from tasks.scores import ScoresJob
from tasks.specs import ScoresSpec, Step, plan


def meta_model(cfg: PipelineConfig) -> torch.nn.Module:
    """The policy's architecture on the meta device (no weights read, no memory): from ``config.json``
    of ``model.path``, or the demo model's sizes."""
    from covgrad.scores import preflight

    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, cfg.model.dtype))
    try:
        if cfg.model.path is None:
            from covgrad.models import build_demo_model
            from covgrad.rollouts import build_char_tokenizer

            with torch.device("meta"):
                return build_demo_model(cfg.model.demo, build_char_tokenizer())
        config_file = Path(cfg.model.path) / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"model.path {cfg.model.path!r} has no config.json")
        return preflight.meta_model(cfg.model.path, cfg.model.trust_remote_code)[1]
    finally:
        torch.set_default_dtype(previous)


def plan_for_config(
    cfg: PipelineConfig, workers: int, device_bytes: int, device: str, prompt_tokens: int
) -> tuple[list[str], ShardPlan]:
    """The shard plan of ``cfg``'s scores artifacts on ``workers`` devices of ``device_bytes`` each (before
    anything runs: the model on the meta device, prompts of ``prompt_tokens`` tokens); returns the lines
    to print and the plan."""
    model = meta_model(cfg)
    layout = select_parameters(model, cfg.model.params)
    samplers = cfg.rollouts.samplers.values()
    group = max(s.group_size for s in samplers)
    if cfg.task.kind == "jsonl" and cfg.task.path and Path(cfg.task.path).is_file():
        prompts = sum(1 for line in Path(cfg.task.path).read_text().splitlines() if line.strip())
    else:
        prompts = cfg.task.n_prompts
    N = prompts * group
    work = Workload(
        B=cfg.scores.groups_per_batch * group,
        L=prompt_tokens + max(s.max_new_tokens for s in samplers),
        N=N,
        n_batches=-(-prompts // cfg.scores.groups_per_batch),
        state_dtype=cfg.scores.state_dtype,
        device=device,
        byte_budget=cfg.scores.byte_budget,
        equal_batches=True,  # every prompt group of one sampler has its group_size
        self_check=cfg.model.self_check,
    )
    shape = ModelShape.of(model)
    chosen = make_plan(layout, shape, work, cfg.scores.shards, workers, device_bytes, cut=cfg.scores.cut_tensors)
    instances = [str(i) for i in plan(cfg).scores]
    lines = [
        f"model: {cfg.model.path or 'demo'} ({shape.n_params:.4g} parameters, {cfg.model.dtype}); "
        f"selected P = {layout.P} in {len(layout.entries)} tensors",
        f"batch: B = {work.B} samples of L = {work.L} tokens ({prompt_tokens} prompt + responses), "
        f"N = {N} samples in {work.n_batches} batches; state {work.state_dtype}",
        f"scores.shards = {list(cfg.scores.shards)}",
        *chosen.lines(),
        f"scores artifacts: {len(instances)} ({', '.join(instances)}), each of this size",
    ]
    return lines, chosen


def _shard_step(cfg: PipelineConfig, instance: str) -> Step:
    """The planned step of scores instance ``instance``, whose upstream artifacts must be complete."""
    steps = plan(cfg)
    known = [str(i) for i in steps.scores]
    if instance not in known:
        raise ValueError(f"instance {instance!r} is not a planned scores artifact; choose one of {known}")
    step = steps[instance]
    store = ArtifactStore(cfg.root)
    for role, ref in step.upstream.items():
        if not store.is_complete(ref):
            raise ValueError(f"upstream {role} ({ref.key}) is not complete; run the pipeline up to {role} first")
    return step


def run_job(
    ref: ArtifactRef,
    spec: ScoresSpec,
    upstream: dict[str, ArtifactRef],
    shards: tuple[int, int],
    job: tuple[int, int],
    torch_threads: int,
) -> tuple[tuple[int, int], int]:
    """On a worker: compute ``job`` = (sample shard, block) of the store at ``ref`` with ``torch_threads``
    threads; return ``job`` and the peak resident memory (bytes) of the worker process while it ran."""
    torch.set_num_threads(torch_threads)
    with PeakRSS() as rss:
        ScoresJob(ArtifactStore(ref.root), ref, spec, upstream, shards=shards).run(job)
    return job, rss.peak


def run_sharded(config: PipelineConfig, instance: str, client: Client, torch_threads: int = 1) -> dict[str, Any]:
    """Compute scores instance ``instance`` as its S × K jobs on ``client``'s workers; return
    ``{"key", "computed", "shards"}`` and, when computed, ``peak_rss_bytes``: the largest peak resident memory
    of the worker processes over their jobs (also in the completion marker, with each job's), since the
    work is not done in this process. ``"auto"`` blocks are resolved for devices like this process's."""
    if torch_threads < 1:
        raise ValueError(f"torch_threads {torch_threads} must be at least 1")
    step = _shard_step(config, instance)
    spec = step.spec
    assert isinstance(spec, ScoresSpec)

    def compute(store: ArtifactStore, ref: ArtifactRef) -> dict[str, Any]:
        job = ScoresJob(store, ref, spec, step.upstream, workers=len(client.nthreads()))
        job.prepare()
        shards = (job.S, job.K)
        futures = [
            client.submit(
                run_job,
                ref,
                spec,
                step.upstream,
                shards,
                j,
                torch_threads,
                key=f"scores-job-{j[0]}-{j[1]}-{ref.key}",
                pure=False,
            )
            for j in job.jobs()
        ]
        peaks = dict(client.gather(futures))
        extra = job.finalize()
        if extra is None:
            raise RuntimeError(f"scores {ref.key}: jobs still pending after all {len(futures)} returned")
        jobs = {f"{i},{k}": p for (i, k), p in peaks.items()}
        return {**extra, "peak_rss_bytes": max(peaks.values()), "job_peak_rss_bytes": jobs}

    result = run_stage(step.ref, spec, compute, resumable=True)
    marker = ArtifactStore(config.root).marker(step.ref) or {}
    out = {"key": step.ref.key, "computed": result.computed, "shards": marker.get("shards")}
    if result.computed:
        out["peak_rss_bytes"] = marker["peak_rss_bytes"]
    return out


@contextmanager
def cluster_client(address: str | None, n_workers: int) -> Iterator[Client]:
    """A client of the scheduler at ``address``, or of a cluster started here: one worker per GPU
    (``dask_cuda.LocalCUDACluster``) on a cuda machine, ``n_workers`` single-threaded processes on a CPU."""
    if address is not None:
        with Client(address, timeout="30s") as client:
            yield client
        return
    if torch.cuda.is_available():
        try:
            from dask_cuda import LocalCUDACluster
        except ImportError:
            raise ValueError(
                "one dask worker per GPU needs dask-cuda (pip install dask-cuda), or start "
                "`CUDA_VISIBLE_DEVICES=k dask worker tcp://scheduler:8786 --nthreads 1` per GPU and set dask.address"
            ) from None
        cluster = LocalCUDACluster(threads_per_worker=1, dashboard_address=None)
    else:
        cluster = LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=True, dashboard_address=None)
    with cluster, Client(cluster) as client:
        yield client


@flow(name="covgrad-scores-sharded")
def sharded_scores_flow(
    config: PipelineConfig, instance: str, address: str | None = None, torch_threads: int = 1
) -> dict[str, Any]:
    """Compute scores instance ``instance`` (e.g. ``scores.policy.policy``) as the jobs of
    ``scores.shards`` on the dask scheduler at ``address`` (default ``config.dask.address``), or on a
    cluster of this machine's devices; return ``{"key", "computed", "shards"}``."""
    rearm()  # a nested flow run: Prefect's engine installs its SIGTERM handler again (flows.stop)
    samples, blocks = config.scores.shards
    n_workers = min(samples * (1 if blocks == "auto" else blocks), os.cpu_count() or 1)
    with cluster_client(address or config.dask.address, n_workers) as client:
        return run_sharded(config, instance, client, torch_threads)


def sharded_scores(
    config: PipelineConfig, instance: str, address: str | None = None, torch_threads: int = 1
) -> dict[str, Any]:
    """Run :func:`sharded_scores_flow` (a Prefect flow run) and return its result."""
    return sharded_scores_flow(config=config, instance=instance, address=address, torch_threads=torch_threads)
