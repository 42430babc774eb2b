"""regime stage: one analysed post-training objective's per-sample gradients folded into moment state
(:class:`storage.regime_fold.RegimeJob`: the regime's g_n through the scores machinery into a scores-layout
store, with its bound scalars). Their statistics: :mod:`tasks.regimes`.

The folds of one pass group (``tasks.specs.regime_pass_group``: the regimes over the same sampler's rollouts)
share one pass: the first of them to run also folds every other one whose artifact is incomplete and that no
other run is writing, and writes its completion marker (``pass_of`` names the fold that ran the pass). A
complete artifact is never recomputed, so a changed regime recomputes only its own fold.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from prefect import task

from storage.artifacts import ArtifactRef, ArtifactStore
from storage.regime_fold import RegimeJob
from tasks.common import StageResult, check_spec, progress_bar, run_stage
from tasks.specs import RegimeSpec


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
