"""regime stage: one analysed post-training objective's per-sample gradients folded into moment state
(:class:`storage.regime_fold.RegimeJob`: the regime's g_n through the scores machinery into a scores-layout
store, with its bound scalars). Their statistics: :mod:`tasks.regimes`.
"""

from __future__ import annotations

from prefect import task

from storage.artifacts import ArtifactRef
from storage.regime_fold import RegimeJob
from tasks.common import StageResult, progress_bar, run_stage
from tasks.specs import RegimeSpec


@task(name="regime")
def regime_task(ref: ArtifactRef, spec: RegimeSpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """The per-sample gradients of regime ``spec.name`` folded into moment state, with its bound scalars."""
    return run_stage(ref, spec, lambda store, r: RegimeJob(store, r, spec, upstream).run(progress_bar), resumable=True)
