"""tokens stage: how the sequence Fisher splits over response positions, in several estimators.

Over the first ``tokens.max_samples`` samples of the analysed rollouts, batch by batch, the token-Fisher
study (:mod:`covgrad.tokens.study`) computes the token Fisher of each mode of ``tokens.modes``, the sequence
and token scores, and their summary; the store ``tokens.zarr`` (:mod:`storage.stores.tokens`) holds the batch
sums while the stage runs (its resume state) and the per-position arrays, the (param,) estimates and the
scalars when it ends. Resumable by batch; same config and seed give identical stores. With ``spec.placement.ranks`` > 1
(``scores.ranks``: the local launcher, or torchrun on one machine) the batches run on that many processes with the
model sharded over them (:mod:`tasks.jobs.tokens_ranks`); the artifact is the in-process one. A model on the token
engine's repeated-batch path (:func:`covgrad.tokens.backward.repeated_batch`: MoE blocks, generic-path parameters)
runs in this process with a warning, as without ranks.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from prefect import task

from covgrad.devices import pick_device, release_free_memory
from covgrad.distributed import on_meta
from covgrad.layout import select_parameters
from covgrad.scores import bind_rules
from covgrad.tokens import TokenStudy, batch_bounds, output_rows, repeated_batch, study_setup, summarize
from covgrad.tokens import draws as token_draws
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.models import load_models
from storage.schema import ROLLOUTS
from storage.schema import TOKENS as STORE
from storage.stores.rollouts import read_batch
from storage.stores.tokens import TokensStore, summary_step
from tasks.common import StageResult, check_spec, log, progress_bar, run_stage
from tasks.jobs.scores_ranks import wait_for_node0
from tasks.jobs.tokens_ranks import run_tokens_ranks
from tasks.specs import TokensSpec


def _sharded(model: Any, spec: TokensSpec, layout: Any) -> bool:
    """Whether the batches run on ``spec.placement.ranks`` processes: more than one, and a model off the repeated-batch
    path (:func:`covgrad.tokens.backward.repeated_batch`, which every machine of a group decides alike from the
    model's modules)."""
    if spec.placement.ranks == 1:
        return False
    if not repeated_batch(model, bind_rules(model, layout)):
        return True
    log.warning(
        "tokens: %s needs the repeated-batch path, which does not run on a sharded model; the stage runs the whole "
        "model in node 0's process (scores.ranks=%d shards only the scores stage)",
        type(model).__name__,
        spec.placement.ranks,
    )
    return False


def _compute(store: ArtifactStore, ref: ArtifactRef, spec: TokensSpec, up: dict[str, ArtifactRef]) -> dict[str, Any]:
    tb = spec.settings
    ro = store.open_group(up["rollouts"], ROLLOUTS, mode="r")
    device = pick_device(spec.device)
    if spec.placement.launcher == "local" and device.type != "cpu":
        raise ValueError(
            f"scores.ranks={spec.placement.ranks} runs the tokens stage on gloo ranks on the CPU, not on {device}; "
            "set model.device=cpu (or scores.launcher=torchrun: nccl ranks, one device each)"
        )
    # on ranks this process needs only the model's shapes: the weights are rank 0's
    model, _ = load_models(store, up["base_model"], "policy", spec.policy, meta=spec.placement.ranks > 1)
    T = ro["sampler_logp"].shape[1]
    modes, layout, head = study_setup(model, tb, T, spec.params)
    V, draws = output_rows(model), {m: token_draws(tb, m) for m in modes}
    N = min(tb.max_samples, ro["tokens"].shape[0])
    batches = batch_bounds(N)
    out = TokensStore.create(store.open_group(ref, STORE, mode="a"), N, T, layout.P, batches, modes)
    if _sharded(model, spec, layout):
        del model
        # the other machines' ranks wait for this one's at the rendezvous
        if out.pending() or spec.placement.nnodes > 1:
            run_tokens_ranks(store.root, ref, spec, up)
    else:
        if on_meta(model):
            model, _ = load_models(store, up["base_model"], "policy", spec.policy)
        study = TokenStudy.build(model.to(device).eval(), tb, T, spec.params, check=spec.self_check)
        todo = out.pending()
        with progress_bar("tokens", len(batches)) as bar:
            bar.update(len(batches) - len(todo))
            for b in todo:
                lo, hi = batches[b]
                result = study.batch(read_batch(ro, lo, hi).to(device), b, partial(out.write_row, b))
                out.write_batch(b, lo, hi, result)
                release_free_memory()
                bar.update(1)
        del model, study  # the summary reads the stored rows in chunks; only it runs from here on
    if not out.summarized:  # set last by the summary: a rerun after it only drops the rows
        record, fisher = out.summary_io(layout.P, ro["response_len"][:N])
        scalars, table = summarize(record, fisher, modes, draws, summary_step(layout.P))
        out.write_summary(
            {
                "scalars": scalars,
                "errors_vs_seq": table,
                "tensors": layout.to_records(),
                "sampler": spec.sampler,
                "on_policy": spec.on_policy,
                "modes": modes,
                "main_mode": modes[0],
                "exact_budget": tb.exact_budget,
                "lm_head": head,
                "V": V,
            }
        )
    scalars = out.finish(layout)
    store.consolidate(ref, STORE)
    return {"scalars": scalars}


def _join(ref: ArtifactRef, spec: TokensSpec, up: dict[str, ArtifactRef]) -> StageResult:
    """Machine ``spec.placement.node_rank`` > 0 of a torchrun group: start this machine's ranks, which run every pending
    batch with node 0's and write their columns into the store node 0 created, then wait until node 0 completes
    the artifact (:func:`tasks.jobs.scores_ranks.wait_for_node0`). A model on the repeated-batch path starts no ranks
    here: node 0 runs it in its own process."""
    check_spec(ref, spec)
    store = ArtifactStore(ref.root)
    if store.is_complete(ref):
        return StageResult(ref=ref, computed=False)
    t0 = time.perf_counter()
    model, _ = load_models(store, up["base_model"], "policy", spec.policy, meta=True)
    if _sharded(model, spec, select_parameters(model, spec.params)):
        del model
        run_tokens_ranks(store.root, ref, spec, up)
    wait_for_node0(store, ref, spec.placement.nnodes)
    return StageResult(ref=ref, computed=True, seconds=time.perf_counter() - t0)


@task(name="tokens")
def tokens_task(ref: ArtifactRef, spec: TokensSpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """Token-level Fisher (exact / top-k / Monte Carlo / probes) of the analysed rollouts (on a machine other than
    node 0 of a torchrun group: this machine's ranks of it, :func:`_join`)."""
    if spec.placement.launcher == "torchrun" and spec.placement.node_rank > 0:
        return _join(ref, spec, upstream)
    return run_stage(ref, spec, lambda store, r: _compute(store, r, spec, upstream), resumable=True)
