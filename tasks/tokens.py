"""tokens stage: how the sequence Fisher splits over response positions, in several estimators.

Over the first ``tokens.max_samples`` samples of the analysed rollouts, batch by batch, the token-Fisher
study (:mod:`covgrad.token_study`) computes the token Fisher of each mode of ``tokens.modes``, the sequence
and token scores, and their summary; the store ``tokens.zarr`` (:mod:`storage.tokens`) holds the batch
sums while the stage runs (its resume state) and the per-position arrays, the (param,) estimates and the
scalars when it ends. Resumable by batch; same config and seed give identical stores. With ``spec.ranks`` > 1
(``scores.ranks``: the local launcher, or torchrun on one machine) the batches run on that many processes with the
model sharded over them (:mod:`storage.tokens_ranks`); the artifact is the in-process one. A model on the token
engine's repeated-batch path (:func:`covgrad.token_fisher.repeated_batch`: MoE blocks, generic-path parameters)
runs in this process with a warning, as without ranks.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from prefect import task

from covgrad.devices import pick_device
from covgrad.heap import release_free_memory
from covgrad.persample import bind_rules
from covgrad.token_fisher import repeated_batch
from covgrad.token_study import TokenStudy, batch_bounds, summarize
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.models import load_models
from storage.rollouts import read_batch
from storage.schema import ROLLOUTS
from storage.schema import TOKENS as STORE
from storage.tokens import TokensStore, summary_step
from storage.tokens_ranks import run_ranks
from tasks.common import StageResult, log, progress_bar, run_stage
from tasks.specs import TokensSpec


def _compute(store: ArtifactStore, ref: ArtifactRef, spec: TokensSpec, up: dict[str, ArtifactRef]) -> dict[str, Any]:
    tb = spec.settings
    ro = store.open_group(up["rollouts"], ROLLOUTS, mode="r")
    model, _ = load_models(store, up["base_model"], "policy", spec.policy)
    device = pick_device(spec.device)
    if spec.launcher == "local" and device.type != "cpu":
        raise ValueError(
            f"scores.ranks={spec.ranks} runs the tokens stage on gloo ranks on the CPU, not on {device}; "
            "set model.device=cpu (or scores.launcher=torchrun: nccl ranks, one device each)"
        )
    model.to(device).eval()
    T = ro["sampler_logp"].shape[1]
    study = TokenStudy.build(model, tb, T, spec.params, check=spec.self_check)
    layout, modes = study.layout, study.modes
    N = min(tb.max_samples, ro["tokens"].shape[0])
    batches = batch_bounds(N)
    out = TokensStore.create(store.open_group(ref, STORE, mode="a"), N, T, layout.P, batches, modes)
    V, head, draws = study.V, study.head, study.draws()
    sharded = spec.ranks > 1 and not repeated_batch(model, bind_rules(model, layout))
    if spec.ranks > 1 and not sharded:
        log.warning(
            "tokens %s: %s needs the repeated-batch path, which does not run on a sharded model; the stage runs "
            "the whole model in this process (scores.ranks=%d shards only the scores stage)",
            ref.key,
            type(model).__name__,
            spec.ranks,
        )
    if sharded:
        del model, study  # the ranks load their own; this process keeps the layout and the store
        if out.pending():
            run_ranks(store.root, ref, spec, up)
    else:
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


@task(name="tokens")
def tokens_task(ref: ArtifactRef, spec: TokensSpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """Token-level Fisher (exact / top-k / Monte Carlo / probes) of the analysed rollouts."""
    return run_stage(ref, spec, lambda store, r: _compute(store, r, spec, upstream), resumable=True)
