"""regime stage: one analysed post-training objective's per-sample gradients folded into moment state.

``regime.<name>`` folds the regime's g_n through the scores machinery: :func:`covgrad.fold.fold_batches`
with :class:`covgrad.regimes.RegimeGrad` as the logit-gradient function, into a
:class:`storage.scores.ScoresStore` (the same layout, checkpoints and resume as a scores artifact, one job,
moment state only) with A = 0, so that ``mean_s`` is G; plus each batch's bound scalars per half
(:mod:`storage.regimes`), written before its checkpoint. The teacher and the reference run one forward on
the same padded batch. Their statistics: :mod:`tasks.regimes`.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from prefect import task

from covgrad.accum import MomentAccumulator
from covgrad.batch import RolloutBatch, group_batches
from covgrad.devices import check_state_fits, pick_device
from covgrad.fold import fold_batches
from covgrad.layout import select_parameters
from covgrad.persample import PerSampleGrads
from covgrad.regimes import Regime, RegimeGrad
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.models import load_models
from storage.regimes import IMPORTED, create_bound_arrays, write_bound
from storage.rollouts import read_batch
from storage.schema import ROLLOUTS
from storage.scores import ScoresStore
from tasks.common import StageResult, progress_bar, run_stage
from tasks.specs import RegimeSpec


def regime_of(spec: RegimeSpec) -> Regime:
    """The :class:`covgrad.regimes.Regime` of a regime spec's settings."""
    r = spec.settings
    return Regime(
        kind=r.kind,
        temperature=r.temperature,
        teacher_temperature=r.teacher_temperature,
        kl_beta=r.kl_beta,
        kl_reward_to_go=r.kl_reward_to_go,
        length_norm=r.length_norm,
        max_length=r.max_length,
        baseline=r.baseline,
    )


class RegimeJob:
    """One regime fold: the policy, teacher and reference models, the rollouts' batches and the store."""

    def __init__(self, store: ArtifactStore, ref: ArtifactRef, spec: RegimeSpec, up: dict[str, ArtifactRef]) -> None:
        self.spec, self.regime = spec, regime_of(spec)
        self.ro = store.open_group(up["rollouts"], ROLLOUTS, mode="r")
        self.device = pick_device(spec.device)
        self.model = load_models(store, up["base_model"], "policy", spec.policy)[0].to(self.device).eval()
        self.layout = select_parameters(self.model, spec.params)
        self.group, self.adv = self.ro["group"][:], self.ro["advantage"][:]
        self.batches = group_batches(self.group, spec.groups_per_batch)
        B = max(hi - lo for lo, hi in self.batches)
        r, V = spec.settings, self._vocab(self.model)
        self.teacher = self._model(store, up["base_model"], r.teacher, V, "teacher")
        self.reference = self._model(store, up["base_model"], r.reference if r.kl_beta else None, V, "reference")
        for field, name in IMPORTED.items():
            wanted = r.advantages == "imported" if field == "advantages" else r.teacher_logprobs
            if wanted and name not in self.ro:
                raise ValueError(f"regime {spec.name}: the rollouts of {spec.sampler!r} hold no imported {field} field")
        N, nb, P = len(self.group), len(self.batches), self.layout.P
        self.out = ScoresStore(store, ref, N, nb, B, 1, [P], spec.state_dtype, keep_rows=False)
        self.last: tuple[RegimeGrad, np.ndarray] | None = None

    @staticmethod
    def _vocab(model: Any) -> int:
        return int(model.get_output_embeddings().weight.shape[0])

    def _model(self, store: ArtifactStore, base: ArtifactRef, which: str | None, V: int, role: str) -> Any:
        """The teacher or reference ``which`` (None: none) on the device; ValueError for another vocabulary."""
        if which is None:
            return None
        model = self.model if which == "policy" else load_models(store, base, which, self.spec.policy)[0]
        if self._vocab(model) != V:
            raise ValueError(
                f"regime {self.spec.name}: the {role} {which!r} has vocabulary {self._vocab(model)}, the policy {V}"
            )
        return model.to(self.device).eval()

    def _read(self, b: int) -> RolloutBatch:
        batch = read_batch(self.ro, *self.batches[b], trim=False)
        return RolloutBatch(**{**batch.__dict__, "advantages": torch.zeros_like(batch.advantages)})

    @torch.no_grad()
    def _logits(self, model: Any, batch: RolloutBatch) -> torch.Tensor:
        dev = self.device
        ids, attn, pos = batch.input_ids.to(dev), batch.attention_mask.to(dev), batch.position_ids.to(dev)
        return model(input_ids=ids, attention_mask=attn, position_ids=pos).logits.detach()

    def _imported(self, field: str, lo: int, hi: int) -> torch.Tensor:
        return torch.from_numpy(self.ro[IMPORTED[field]][lo:hi].astype(np.float64))

    def _logit_grad(self, b: int, batch: RolloutBatch) -> RegimeGrad:
        lo, hi = self.batches[b]
        r = self.spec.settings
        adv = None
        if self.regime.kind in ("rl", "rl_token") and r.advantages != "none":
            adv = (
                torch.from_numpy(self.adv[lo:hi])
                if r.advantages == "sequence"
                else self._imported("advantages", lo, hi)
            )
        fn = RegimeGrad(
            self.regime,
            batch.input_ids.to(self.device),
            batch.response_mask.to(self.device),
            advantages=adv,
            teacher_logits=None if self.teacher is None else self._logits(self.teacher, batch),
            teacher_logprobs=self._imported("teacher_logprobs", lo, hi) if r.teacher_logprobs else None,
            ref_logits=None if self.reference is None else self._logits(self.reference, batch),
        )
        self.last = (fn, (batch.group % 2).numpy())
        return fn

    def run(self) -> dict[str, Any] | None:
        """Fold every batch (resuming from the newest complete checkpoint); finalize; the provenance."""
        spec, P, nb = self.spec, self.layout.P, len(self.batches)
        self.out.prepare(np.zeros_like(self.adv), self.group, kl=False)
        create_bound_arrays(self.out.open(), nb)
        check_state_fits(self.device, P, spec.state_dtype, f"regime {spec.name}")
        acc = MomentAccumulator(P, self.device, spec.state_dtype)
        psg = PerSampleGrads(self.model, self.layout, check=spec.self_check)
        with (
            self.out.job((0, 0), acc, list(range(nb)), self.batches) as w,
            progress_bar(f"regime {spec.name}", nb) as bar,
        ):
            bar.update(nb - len(w.todo))

            def on_batch(b: int, _: torch.Tensor | None) -> None:
                fn, half = self.last
                sums, counts = np.zeros(2), np.zeros(2)
                if fn.bound_sq is not None:
                    np.add.at(sums, half, fn.bound_sq.detach().cpu().numpy())
                    np.add.at(counts, half, 1.0)
                write_bound(w.g, b, sums, counts)

            def checkpoint(folded: int, final: bool, batches: list[int]) -> None:
                w.checkpoint(folded, final, batches)
                bar.update(len(batches))

            fold_batches(
                psg,
                acc,
                w.todo,
                self._read,
                self._logit_grad,
                checkpoint,
                done=w.done,
                on_batch=on_batch,
                every=spec.checkpoint_batches,
                seconds=spec.checkpoint_seconds,
            )
        if not self.out.finalize(self.layout, "policy", spec.sampler, str(self.device), spec.policy.dtype):
            return None
        self.out.open().attrs.update({"regime": spec.name, "kind": self.regime.kind})
        self.out.store.consolidate(self.out.ref, "scores.zarr")
        return {"regime": spec.name, "kind": self.regime.kind, "n_samples": len(self.group), "n_params": P}


@task(name="regime")
def regime_task(ref: ArtifactRef, spec: RegimeSpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """The per-sample gradients of regime ``spec.name`` folded into moment state, with its bound scalars."""
    return run_stage(ref, spec, lambda store, r: RegimeJob(store, r, spec, upstream).run(), resumable=True)
