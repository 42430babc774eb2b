"""scores stage: exact per-sample scores of the policy, folded on the device into O(P) moment state.

The work is ``scores.shards`` = S sample shards × K parameter blocks; job (i, k) folds the batches b with
b % S == i (:func:`covgrad.scores.fold.fold_batches`) into the columns of block k, with hooks on that block's
tensors only. The store's layout, checkpoints and readers: :mod:`storage.stores.scores`. With ``scores.ranks`` the model
is sharded over a rank group (:mod:`tasks.jobs.scores_ranks`): local processes, or a torchrun group on one or
several machines, where machine 0 runs the stage and the others only start their ranks (:func:`scores_task`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from prefect import task

from covgrad.devices import check_state_fits, device_memory, pick_device
from covgrad.distributed import keeps_rows, on_meta, resolve_shards
from covgrad.identity import model_identity
from covgrad.layout import select_parameters, split_blocks
from covgrad.moments import MomentAccumulator
from covgrad.rollouts import RolloutBatch, SamplerSpec, group_batches, require_mu_source
from covgrad.scores import LogitGrad, PerSampleGrads, SamplerCentering, fold_batches, policy_logit_grad
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.identity import IDENTITY_ATTR
from storage.models import load_models, load_rank_policy
from storage.schema import ROLLOUTS
from storage.stores.rollouts import read_batch, require_mu
from storage.stores.scores import ScoresStore, mu_recorded, read_mu
from tasks.common import StageResult, check_spec, progress_bar, run_stage
from tasks.jobs.rollout_import import sampler_source
from tasks.jobs.scores_ranks import rank_placement, run_scores_ranks, wait_for_node0
from tasks.specs import ScoresSpec


class ScoresJob:
    """One scores artifact as three explicit steps, so that jobs can share a store: ``prepare`` creates
    every array (once, before any job runs), ``run((i, k))`` folds sample shard i's batches into the
    columns of parameter block k, and ``finalize`` assembles the block edges and writes the attributes
    once every job is done. ``shards`` = (S, K) defaults to the spec's sample shards and blocks (``"auto"``
    blocks: the fewest that fit ``workers`` devices like this process's,
    covgrad.distributed.shardplan.resolve_shards)."""

    def __init__(
        self,
        store: ArtifactStore,
        ref: ArtifactRef,
        spec: ScoresSpec,
        up: dict[str, ArtifactRef],
        shards: tuple[int, int] | None = None,
        workers: int = 1,
    ) -> None:
        self.spec = spec
        self._weights: dict[str, Any] | None = None
        self.ro = store.open_group(up["rollouts"], ROLLOUTS, mode="r")
        self.device = pick_device(spec.device)
        # a sharded run's task: shapes only
        host = spec.placement.launcher != "in-process" and not dist.is_initialized()
        self.model = load_rank_policy(store, up["base_model"], spec.policy, self.device, meta=host)
        self.layout = select_parameters(self.model, spec.params)
        self.group, self.adv = self.ro["group"][:], self.ro["advantage"][:]
        self.N, self.P = len(self.group), self.layout.P
        self.batches = group_batches(self.group, spec.groups_per_batch)
        self.B = max(hi - lo for lo, hi in self.batches)
        self.equal = all(hi - lo == self.B for lo, hi in self.batches[:-1])
        if shards is None and spec.blocks == "auto":
            shards = resolve_shards(self, workers, device_memory(self.device))
        self.S, self.K = shards or (spec.sample_shards, spec.blocks)
        self.blocks = split_blocks(self.layout, self.K, cut=spec.cut_tensors)
        keep = keeps_rows(self.N, self.P, spec.byte_budget, self.K, self.equal)
        sizes = [blk.P for blk in self.blocks]
        self.out = ScoresStore(store, ref, self.N, len(self.batches), self.B, self.S, sizes, spec.state_dtype, keep)
        self.mu = self._sampler_centering(store, up["base_model"]) if spec.centering == "sampler" else None

    def _sampler_centering(self, store: ArtifactStore, base: ArtifactRef) -> SamplerCentering:
        """μ of the rollouts' record, or of the sampler model (loaded here) when they hold none."""
        s, model = self.spec.settings, None
        require_mu(self.ro, f"scores.{self.spec.sampler}.sampler")
        if not mu_recorded(self.ro):
            if s.import_path is not None:  # the store holds no top-k record: the preflight's check, again
                require_mu_source(f"rollouts.samplers.{self.spec.sampler}", {}, s.on_policy, s.mu_model)
            model = load_models(store, base, s.mu_model or s.model, sampler_source(self.spec.policy, s))[0]
        return SamplerCentering(SamplerSpec.of(s), model)

    def prepare(self) -> None:
        """Create the store's arrays (idempotent: existing arrays, checkpoints and finished batches are kept)."""
        self.out.prepare(self.adv, self.group, kl=self.mu is not None)

    def jobs(self) -> list[tuple[int, int]]:
        """Every (sample shard, parameter block) of the artifact, sample-major."""
        return [(i, k) for i in range(self.S) for k in range(self.K)]

    def _read(self, b: int) -> RolloutBatch:
        return read_batch(self.ro, *self.batches[b], trim=False)

    def _logit_grad(self, b: int, batch: RolloutBatch) -> LogitGrad:
        if self.mu is None:
            return policy_logit_grad(batch, self.device)
        return self.mu.logit_grad(batch, read_mu(self.ro, *self.batches[b]))

    def run(self, job: tuple[int, int] = (0, 0)) -> None:
        """Fold sample shard i's batches into block k's columns (``job`` = (i, k)), resuming from the
        job's newest complete checkpoint."""
        i, k = job
        if not (0 <= i < self.S and 0 <= k < self.K):
            raise ValueError(f"job {job} is not one of the {self.S} x {self.K} (sample shard, block) jobs")
        block, spec, nb = self.blocks[k], self.spec, len(self.batches)
        check_state_fits(
            self.device, block.P, spec.state_dtype, f"parameter block {k} of scores.shards={[self.S, self.K]}"
        )
        acc = MomentAccumulator(block.P, self.device, spec.state_dtype, switch_P=self.P)
        psg = PerSampleGrads(self.model, block, check=spec.self_check)
        rows = torch.empty((self.B, self.P), dtype=torch.float32, device=self.device) if self.out.keep_rows else None
        with (
            self.out.job(job, acc, list(range(i, nb, self.S)), self.batches) as w,
            progress_bar(f"scores {spec.sampler}/{spec.centering}", nb) as bar,
        ):
            bar.update(nb - len(w.todo))

            def on_batch(b: int, out: torch.Tensor | None) -> None:
                w.on_batch(b, out, None if self.mu is None else self.mu.kl)
                bar.update(1)  # folded; stored at the next checkpoint

            fold_batches(
                psg,
                acc,
                w.todo,
                self._read,
                self._logit_grad,
                w.checkpoint,
                done=w.done,
                rows=rows,
                on_batch=on_batch,
                every=spec.checkpoint_batches,
                seconds=spec.checkpoint_seconds,
            )

    def _identity(self) -> dict[str, Any]:
        """The weights' identity, computed once (a sharded run's task holds none: rank 0 records it)."""
        if self._weights is None:
            m = self.model
            held = m is not None and not on_meta(m)
            self._weights = {IDENTITY_ATTR: model_identity(m.named_parameters()) if held else self.out.identity()}
        return self._weights

    def finalize(self) -> dict[str, Any] | None:
        """Write attrs (with the model identity of the weights scored, ``storage.identity``) and consolidated
        metadata when every batch is done; return the provenance (None while batches are pending)."""
        spec = self.spec
        if not self.out.finalize(
            self.layout, spec.centering, spec.sampler, str(self.device), spec.policy.dtype, self._identity
        ):
            return None
        shards = [self.S, self.K]
        return {"n_samples": self.N, "n_params": self.P, "per_sample_rows": self.out.keep_rows, "shards": shards}


def _job(root: str, ref: ArtifactRef, spec: ScoresSpec, up: dict[str, ArtifactRef]) -> ScoresJob:
    """The job of a launched rank (a module-level function of plain values: it pickles)."""
    return ScoresJob(ArtifactStore(root), ref, spec, up)


def _compute(
    store: ArtifactStore, ref: ArtifactRef, spec: ScoresSpec, up: dict[str, ArtifactRef]
) -> dict[str, Any] | None:
    if spec.placement.launcher != "in-process":  # the model sharded over spec.placement.ranks processes
        return run_scores_ranks(_job, (store.root, ref, spec, up), rank_placement(ref.key, spec))
    job = ScoresJob(store, ref, spec, up)
    job.prepare()
    for j in job.jobs():  # the partition of the spec's shards, one job after another in this process
        job.run(j)
    return job.finalize()


def _join(ref: ArtifactRef, spec: ScoresSpec, up: dict[str, ArtifactRef]) -> StageResult:
    """Machine ``spec.placement.node_rank`` > 0 of a torchrun group: start this machine's ranks, which fold their
    columns into the artifact that node 0 prepares, then wait until node 0 completes it
    (:func:`tasks.jobs.scores_ranks.wait_for_node0`)."""
    check_spec(ref, spec)
    store = ArtifactStore(ref.root)
    if store.is_complete(ref):
        return StageResult(ref=ref, computed=False)
    t0 = time.perf_counter()
    run_scores_ranks(_job, (store.root, ref, spec, up), rank_placement(ref.key, spec))
    wait_for_node0(store, ref, spec.placement.nnodes)
    return StageResult(ref=ref, computed=True, seconds=time.perf_counter() - t0)


@task(name="scores")
def scores_task(ref: ArtifactRef, spec: ScoresSpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """Per-sample scores of the rollouts of ``spec.sampler`` under ``spec.centering`` (on a machine other
    than node 0 of a torchrun group: this machine's ranks of it, :func:`_join`)."""
    if spec.placement.launcher == "torchrun" and spec.placement.node_rank > 0:
        return _join(ref, spec, upstream)
    return run_stage(ref, spec, lambda store, r: _compute(store, r, spec, upstream), resumable=True)
