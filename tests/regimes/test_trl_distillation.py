"""covgrad's full-distribution distillation regimes against TRL 1.16's ``DistillationTrainer`` (docs/regimes.md,
"Matching TRL's DistillationTrainer"): a real trainer takes one optimizer step at learning rate 0 on a float64
one-layer Llama student over a character vocabulary, with a float64 teacher of another width and seed on the same
vocabulary, and covgrad's G of ``distill_reverse_kl`` (TRL's ``beta=1``) and ``distill_forward_kl`` (``beta=0``),
computed with covgrad's per-sample engine on the exact batch the step trained on, is −∇ of TRL's loss times
T/N (T the batch's completion tokens, N its completions), with and without a temperature. The tests need the
``trl`` extra.

TRL's ``DistillationTrainer`` is always on-policy (it has no ``lmbda``; ``GKDTrainer`` in ``trl.experimental`` has):
every batch is the student's own completions, one per prompt, sampled at ``temperature``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from covgrad.layout import select_parameters
from covgrad.regimes.cotangents import Regime, RegimeGrad
from covgrad.scores.engine import PerSampleGrads
from tests.helpers.distill import N_PROMPTS, char_models, distillation_trainer
from tests.helpers.trainers import StepGradient

REGIME_OF_BETA = {1.0: "distill_reverse_kl", 0.0: "distill_forward_kl"}


@pytest.fixture(scope="module")
def models() -> tuple[Any, Any, Any]:
    """The char tokenizer, the float64 student and teacher (:func:`tests.helpers.distill.char_models`)."""
    pytest.importorskip("trl.trainer.distillation_trainer")  # a TRL that ships DistillationTrainer
    return char_models()


def _trl_step0(models: tuple[Any, Any, Any], out: Path, beta: float, temperature: float) -> dict[str, Any]:
    """One ``DistillationTrainer`` step at learning rate 0: the trainer, the gradient the step took and the batch
    it took it on (the trainer's buffered generation batch)."""
    step = StepGradient()
    trainer = distillation_trainer(models, out, beta, temperature, [step.callback])
    trainer.train()
    return {"trainer": trainer, "step_grad": step.grad, "batch": trainer._buffered_inputs[0]}


def _trl_descent(run: dict[str, Any], beta: float) -> torch.Tensor:
    """∇ of TRL's loss with ``beta`` on the step's batch at the step's weights, (P,)."""
    trainer = run["trainer"]
    trainer.beta = beta
    model = trainer.accelerator.unwrap_model(trainer.model)
    model.train()
    model.zero_grad()
    trainer.compute_loss(trainer.model, run["batch"]).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).detach().clone()


def _covgrad_rows(run: dict[str, Any], kind: str, temperature: float) -> torch.Tensor:
    """covgrad's per-sample gradients g_n of ``kind`` (student and teacher at ``temperature``) on the step's batch,
    from the per-sample engine, (N, P) float64 (G = their mean): rows prompt + completion as TRL forms them
    (left-padded prompts, the model's default positions), the response weights TRL's ``completion_mask``, the
    teacher's logits of the same rows."""
    trainer, batch = run["trainer"], run["batch"]
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attn = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    response = torch.cat([torch.zeros_like(batch["prompt_mask"]), batch["completion_mask"]], 1).double()
    teacher = trainer.accelerator.unwrap_model(trainer.teacher_model).eval()
    with torch.no_grad():
        teacher_logits = teacher(input_ids=ids, attention_mask=attn).logits
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    psg = PerSampleGrads(model, select_parameters(model), check=False)
    regime = Regime(kind, temperature=temperature, teacher_temperature=temperature)
    fn = RegimeGrad(regime, ids, response, teacher_logits=teacher_logits)
    return psg(ids, attn, fn).double()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize(("beta", "temperature"), [(1.0, 1.0), (0.0, 0.7)])
def test_covgrad_G_is_trls_distillation_gradient(models, tmp_path, beta, temperature):
    """The step's gradient (``beta``) and TRL's loss of the other β on the same batch: −∇L_TRL = (N/T)·G with
    G covgrad's regime of that β, within 1e-5 relative (TRL projects the logits and accumulates the head's
    gradient in float32). The generalized JSD (β = 0.5) has no covgrad regime and matches neither."""
    run = _trl_step0(models, tmp_path, beta, temperature)
    mask = run["batch"]["completion_mask"]
    N, T = mask.shape[0], float(mask.sum())
    assert N == N_PROMPTS and len(set(mask.sum(1).tolist())) > 1, "equal lengths would not tell the means apart"
    descent = {b: _trl_descent(run, b) for b in (beta, 1.0 - beta, 0.5)}
    assert _rel(descent[beta], run["step_grad"]) < 1e-12  # the post-hoc loss is the step's own
    rows = {b: _covgrad_rows(run, REGIME_OF_BETA[b], temperature) for b in (0.0, 1.0)}
    G = {b: g.mean(0) for b, g in rows.items()}
    for b in (0.0, 1.0):
        assert _rel(G[b] * N / T, -descent[b]) < 1e-5
        assert _rel(G[b] * N / T, -descent[0.5]) > 1e-2
    assert _rel(G[1.0], G[0.0]) > 1e-2  # the two regimes differ on this batch
    per_sequence = (rows[beta] / mask.sum(1, keepdim=True).double()).mean(0)  # a per-sequence token mean
    assert _rel(per_sequence, -descent[beta]) > 1e-3  # is not TRL's batch token mean (the lengths differ)
