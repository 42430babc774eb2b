"""regime stage: one analysed post-training objective's per-sample gradients folded into moment state.

``regime.<name>`` folds the regime's g_n (:class:`covgrad.regimes.RegimeGrad` as the logit-gradient
function) through the scores machinery (:class:`tasks.scores.ScoresJob`: the same store layout, jobs,
checkpoints and resume), with A = 0 so that ``mean_s`` is G, plus the bound scalars per batch and half
(:mod:`storage.regimes`). The teacher and reference run one forward on the same padded batch.
Their statistics: :mod:`tasks.regimes`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch
from prefect import task

from covgrad.batch import RolloutBatch
from covgrad.regimes import Regime, RegimeGrad
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.models import load_models
from storage.regimes import create_bound_arrays, write_bound
from tasks.common import StageResult, run_stage
from tasks.scores import ScoresJob
from tasks.specs import RegimeSpec

IMPORTED = {"advantages": "token_advantage", "teacher_logprobs": "teacher_logprob"}  # rollouts arrays


class RegimeJob(ScoresJob):
    """A regime fold as a scores job: g_n in place of s_n, A = 0, and the bound scalars of each batch."""

    def __init__(self, store: ArtifactStore, ref: ArtifactRef, spec: RegimeSpec, up: dict[str, ArtifactRef]) -> None:
        super().__init__(store, ref, spec, up)  # type: ignore[arg-type]
        r = spec.settings
        self.regime = Regime(
            kind=r.kind,
            temperature=r.temperature,
            teacher_temperature=r.teacher_temperature,
            kl_beta=r.kl_beta,
            kl_reward_to_go=r.kl_reward_to_go,
            length_norm=r.length_norm,
            max_length=r.max_length,
            baseline=r.baseline,
        )
        V = self.model.get_output_embeddings().weight.shape[0]
        self.teacher = self._model(store, up["base_model"], r.teacher, V, "teacher")
        self.reference = self._model(store, up["base_model"], r.reference if r.kl_beta else None, V, "reference")
        for field, name in IMPORTED.items():
            wanted = r.advantages == "imported" if field == "advantages" else r.teacher_logprobs
            if wanted and name not in self.ro:
                raise ValueError(f"regime {spec.name}: the rollouts of {spec.sampler!r} hold no imported {field} field")
        self.last: tuple[RegimeGrad, np.ndarray] | None = None

    def _model(self, store: ArtifactStore, base: ArtifactRef, which: str | None, V: int, role: str) -> Any:
        if which is None:
            return None
        model = self.model if which == "policy" else load_models(store, base, which, self.spec.policy)[0]
        if model.get_output_embeddings().weight.shape[0] != V:
            raise ValueError(f"regime {self.spec.name}: the {role} {which!r} has another vocabulary than the policy")
        return model.to(self.device).eval()

    def prepare(self) -> None:
        """The scores arrays (advantage 0) and the bound arrays."""
        self.out.prepare(np.zeros_like(self.adv), self.group, kl=False)
        create_bound_arrays(self.out.open(), len(self.batches))

    def _read(self, b: int) -> RolloutBatch:
        batch = super()._read(b)
        return dataclasses.replace(batch, advantages=torch.zeros_like(batch.advantages))

    @torch.no_grad()
    def _logits(self, model: Any, batch: RolloutBatch) -> torch.Tensor:
        dev = self.device
        return model(
            input_ids=batch.input_ids.to(dev),
            attention_mask=batch.attention_mask.to(dev),
            position_ids=batch.position_ids.to(dev),
        ).logits.detach()

    def _logit_grad(self, b: int, batch: RolloutBatch) -> RegimeGrad:  # type: ignore[override]
        lo, hi = self.batches[b]
        r = self.spec.settings
        adv: torch.Tensor | None = None
        if r.advantages == "sequence":
            adv = torch.from_numpy(self.adv[lo:hi])
        elif r.advantages == "imported":
            adv = torch.from_numpy(self.ro[IMPORTED["advantages"]][lo:hi].astype(np.float64))
        logq = None
        if r.teacher_logprobs:
            logq = torch.from_numpy(self.ro[IMPORTED["teacher_logprobs"]][lo:hi].astype(np.float64))
        fn = RegimeGrad(
            self.regime,
            batch.input_ids.to(self.device),
            batch.response_mask.to(self.device),
            advantages=adv if self.regime.kind in ("rl", "rl_token") else None,
            teacher_logits=None if self.teacher is None else self._logits(self.teacher, batch),
            teacher_logprobs=logq,
            ref_logits=None if self.reference is None else self._logits(self.reference, batch),
        )
        self.last = (fn, (batch.group % 2).numpy())
        return fn

    def after_batch(self, writer: Any, b: int) -> None:
        """Store batch ``b``'s bound scalars per half (block 0 only: the same numbers in every block)."""
        if self.last is None or writer.job[1] != 0:
            return
        fn, half = self.last
        sums, counts = np.zeros(2), np.zeros(2)
        if fn.bound_sq is not None:
            np.add.at(sums, half, fn.bound_sq.detach().cpu().numpy())
            np.add.at(counts, half, 1.0)
        write_bound(writer.g, b, sums, counts)

    def finalize(self) -> dict[str, Any] | None:
        out = super().finalize()
        if out is not None:
            self.out.open().attrs.update({"regime": self.spec.name, "kind": self.regime.kind})
        return out


def _fold(
    store: ArtifactStore, ref: ArtifactRef, spec: RegimeSpec, up: dict[str, ArtifactRef]
) -> dict[str, Any] | None:
    job = RegimeJob(store, ref, spec, up)
    job.prepare()
    for j in job.jobs():
        job.run(j)
    out = job.finalize()
    return None if out is None else {**out, "regime": spec.name, "kind": spec.settings.kind}


@task(name="regime")
def regime_task(ref: ArtifactRef, spec: RegimeSpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """The per-sample gradients of regime ``spec.name`` folded into moment state, with its bound scalars."""
    return run_stage(ref, spec, lambda store, r: _fold(store, r, spec, upstream), resumable=True)
