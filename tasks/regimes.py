"""The regime stages: ``regime.<name>``, one regime's fold, and ``regimes``, the statistics of every fold.

``regime.<name>`` folds one analysed post-training objective's per-sample gradients g_n into moment state with
its bound scalars (:class:`tasks.jobs.regime_fold.RegimeJob`: the regime's g_n through the scores machinery into
a scores-layout store). The folds of one pass group (``tasks.specs.regime_pass_group``: the regimes over the same
sampler's rollouts) share one pass: the first of them to run also folds every other one whose artifact is
incomplete and that no other run is writing, and writes its completion marker (``pass_of`` names the fold that
ran the pass). A complete artifact is never recomputed, so a changed regime recomputes only its own fold.

``regimes`` reads every ``regime.<name>`` fold and the main scores' state and reduces them with
:func:`covgrad.regimes.stats.regime_stats` in blocks along ``param``: per regime G, se, the bound a·√F with the
policy's F, ρ, violations against a sampling allowance, the cross-fit, overlap with top-q F (both random
baselines), each tensor's share of the top sets, and the cross-regime comparison (pairwise top-q overlap of |G|,
cosines). Store ``regimes.zarr`` (storage/schema.py), tables ``regimes.{json,csv,md}``,
``overlap.{json,csv,md}``, ``pairs.{json,csv,md}``, ``tensors.{csv,md}``.
"""

from __future__ import annotations

from contextlib import ExitStack
from functools import partial
from typing import Any

from prefect import task

from covgrad.layout import ParamLayout
from covgrad.regimes import REGIME_OUTPUTS, RegimeFold, regime_stats
from covgrad.tables import to_csv, to_markdown
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.schema import REGIMES, SCORES, annotate, create, param_chunk
from storage.stores.regimes import HEAD_FISHER, bound_a2, group_rows, head_fisher_sums, state_rows
from tasks.common import StageResult, check_spec, progress_bar, run_stage
from tasks.jobs.regime_fold import RegimeJob
from tasks.specs import RegimeSpec, RegimeStatsSpec


def _fold_pass(store: ArtifactStore, ref: ArtifactRef, spec: RegimeSpec, upstream: dict[str, ArtifactRef]) -> Any:
    """Fold ``spec``'s regime and its incomplete pass members in one pass; mark the members complete."""
    lead = RegimeJob(store, ref, spec, upstream)
    with ExitStack() as stack:
        members, claims = [], []
        for m in spec.pass_with:
            if store.is_complete(m.ref) or store.busy(m.ref):  # cached, or another run is writing it
                continue
            stack.enter_context(store.lock(m.ref))
            if store.is_complete(m.ref):
                continue
            member = RegimeSpec.model_validate(m.spec)
            check_spec(m.ref, member)
            claims.append((m.ref, store.begin(m.ref, m.spec, resume=True)))
            members.append(RegimeJob(store, m.ref, member, m.upstream, lead=lead))
        infos = lead.run(progress_bar, members)
        for (r, claim), info in zip(claims, infos[1:], strict=True):
            store.complete(r, claim, {**(info or {}), "pass_of": spec.name})
    return infos[0]


@task(name="regime")
def regime_task(ref: ArtifactRef, spec: RegimeSpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """The per-sample gradients of regime ``spec.name`` folded into moment state, with its bound scalars (and
    those of its pass members, in the same pass)."""
    return run_stage(ref, spec, lambda store, r: _fold_pass(store, r, spec, upstream), resumable=True)


def _stats(store: ArtifactStore, ref: ArtifactRef, spec: RegimeStatsSpec, up: dict[str, ArtifactRef]) -> dict[str, Any]:
    """Write the regimes store and tables of :func:`covgrad.regimes.stats.regime_stats` over the folds ``up``."""
    sc = store.open_group(up["scores"], SCORES, mode="r")
    layout = ParamLayout.from_records(sc.attrs["tensors"])
    folds = {name: store.open_group(up[f"regime.{name}"], SCORES, mode="r") for name in spec.names}
    g = store.open_group(ref, REGIMES, mode="w")
    out = {"F": create(g, REGIMES, "F", (layout.P,))}
    for name in spec.names:
        for stat in REGIME_OUTPUTS:
            out[f"{stat}_{name}"] = create(g, REGIMES, f"{stat}_{name}", (layout.P,))
    readers = {
        name: RegimeFold(partial(group_rows, f), partial(head_fisher_sums, f), bound_a2(f)) for name, f in folds.items()
    }
    result = regime_stats(
        partial(state_rows, sc), readers, layout, out, chunk=param_chunk(layout.P), qs=spec.qs, z=spec.allowance_z
    )
    rows = [
        {
            "regime": name,
            "kind": f.attrs["kind"],
            "sampler": f.attrs["sampler"],
            **result.regimes[name],
            "responses_mean_reward": f.attrs.get("teacher_mean_reward"),
            "bound_token_fisher": (f.attrs.get(HEAD_FISHER) or {}).get("tensor"),
        }
        for name, f in folds.items()
    ]
    for stem, table in (("regimes", rows), ("overlap", result.overlap), ("pairs", result.pairs)):
        store.write_json(ref, f"{stem}.json", table)
        if table:  # one regime has no pairs
            store.write_text(ref, f"{stem}.csv", to_csv(table))
            store.write_text(ref, f"{stem}.md", to_markdown(table))
    store.write_text(ref, "tensors.csv", to_csv(result.tensors))
    store.write_text(ref, "tensors.md", to_markdown(result.tensors))
    g.attrs.update({"tensors": sc.attrs["tensors"], "regimes": spec.names, "allowance_z": spec.allowance_z})
    annotate(g, REGIMES, layout)
    store.consolidate(ref, REGIMES)
    return {"regimes": spec.names}


@task(name="regimes")
def regimes_task(ref: ArtifactRef, spec: RegimeStatsSpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """Per-regime statistics and the cross-regime comparison (``upstream``: ``scores`` and ``regime.<name>``)."""
    return run_stage(ref, spec, lambda store, r: _stats(store, r, spec, upstream))
