"""In-run statistics of on-policy distillation (``covgrad.integrations.inrun.InRunRegimeFolder``): the folded F of
the scores, the regime's G, its a² and ρ = G/(a√F) equal a float64 reference written here (one unpadded forward
and ``torch.autograd.grad`` of −Σ_t KL per sequence, the KL and its bound scalar from the two models' log-softmax),
for both full-distribution regimes; and ``CovgradInRun`` attached to a real TRL ``DistillationTrainer`` writes the
same statistics of the batch the step trained on, whose G is TRL's own step gradient times T/N (docs/regimes.md,
"Matching TRL's DistillationTrainer"). The trainer test needs the ``trl`` extra."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from covgrad.integrations.inrun import REGIME_KINDS, InRunRegimeFolder
from covgrad.layout import ParamLayout
from covgrad.moments import count_for_fraction, topk_indices
from covgrad.regimes.cotangents import Regime
from tests.helpers.distill import char_models, distillation_trainer
from tests.helpers.persample import llama, make_batch, naive_scores
from tests.helpers.trainers import StepGradient


def reference(student: Any, teacher: Any, layout: ParamLayout, batch: dict, kind: str, tau: float) -> dict:
    """F = mean_n s_n², G = mean_n ∇θ J_n with J_n = −Σ_t w_t D_t (D_t = KL(p_t‖q_t) for the reverse regime,
    KL(q_t‖p_t) for the forward one, both at temperature ``tau``), a² = mean_n Σ_t w_t² c²_t (c²_t =
    Var_{p_t}(log p − log q), χ²(q_t‖p_t)) and ρ = G/(a√F) (NaN where F = 0): (P,) float64 arrays and a float,
    from each sequence's unpadded forward."""
    params = dict(student.named_parameters())
    ps = [params[e.name] for e in layout.entries]
    g, c2 = [], []
    for ids, w in zip(batch["seqs"], batch["weights"], strict=True):
        logp = F.log_softmax(student(input_ids=ids[None]).logits[0, :-1].double() / tau, -1)  # (T, V)
        with torch.no_grad():
            logq = F.log_softmax(teacher(input_ids=ids[None]).logits[0, :-1].double() / tau, -1)
        p, q, wt = logp.exp(), logq.exp(), w[1:].double()
        if kind == "distill_reverse_kl":
            ell = logp - logq
            D = (p * ell).sum(-1)
            c = (p * (ell - D[:, None]) ** 2).sum(-1).detach()
        else:
            D = (q * (logq - logp)).sum(-1)
            c = (q * q / p).sum(-1).detach() - 1
        grads = torch.autograd.grad(-(wt * D).sum(), ps)
        g.append(torch.cat([x.reshape(-1) for x in grads]))
        c2.append(float((wt**2 * c).sum()))
    S = naive_scores(student, layout, batch, tau).double().numpy()
    out = {"F": (S**2).mean(0), "G": torch.stack(g).mean(0).numpy(), "a2": float(np.mean(c2))}
    bound = np.sqrt(out["a2"] * out["F"])
    out["rho"] = np.where(bound > 0, out["G"] / np.where(bound > 0, bound, 1.0), np.nan)
    return out


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    """‖a − b‖/‖b‖ over the entries where b is defined (a NaN where b is: ρ where F = 0)."""
    defined = ~np.isnan(b)
    assert np.array_equal(np.isnan(a), ~defined)
    return float(np.linalg.norm(a[defined] - b[defined]) / np.linalg.norm(b[defined]))


def _assert_matches(out: Path, step: int, ref: dict, layout: ParamLayout, q: float, tol: float) -> dict:
    """The step's files against the reference: F, G and a² within ``tol`` relative, ρ the saved G/(a√F), the top
    sets by F, |G| and |ρ| of the saved vectors, and its summary (returned).

    Llama's RMSNorm runs in float32 in a float64 model, so padded and unpadded rows differ by ~1e-7·max|G| per
    coordinate. ρ divides each coordinate by its own bound, which lifts that floor to ~1e-5 relative on the
    coordinates where G is tiny, so ρ is checked against the reference to 1e-4 only (and exactly against the
    saved G, F and a² it is computed from)."""
    saved = np.load(out / f"step_{step:06d}.npz")
    summary = json.loads((out / f"step_{step:06d}.json").read_text())
    for name in ("F", "G"):
        assert _rel(saved[name], ref[name]) < tol, name
    assert math.isclose(summary["bound_a2"], ref["a2"], rel_tol=tol)
    bound = np.sqrt(summary["bound_a2"] * saved["F"])
    np.testing.assert_allclose(saved["rho"], np.where(bound > 0, saved["G"] / np.where(bound > 0, bound, 1), np.nan))
    assert _rel(saved["rho"], ref["rho"]) < 1e-4
    k = count_for_fraction(q, layout.P)
    for metric, src in (("F", "F"), ("absG", "G"), ("absrho", "rho")):
        np.testing.assert_array_equal(saved[f"top_{metric}"], topk_indices(np.abs(saved[src]), k))
    assert math.isnan(summary["mean_A"]) and math.isnan(summary["std_A"]) and not summary["rho_undefined"]
    assert summary["bound_violations"] == int(np.count_nonzero(np.abs(saved["G"]) > bound * (1 + 1e-6)))
    return summary


@pytest.mark.parametrize("kind", REGIME_KINDS)
def test_the_regime_fold_equals_the_float64_reference(tmp_path: Path, kind: str):
    student = llama(tied=False).double()
    teacher = llama(tied=False).double()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # another model over the same vocabulary
        for p in teacher.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    batch = make_batch(4, [3, 5, 2, 4, 3, 2], [6, 3, 8, 5, 4, 7])  # left-padded
    tau = 0.8
    folder = InRunRegimeFolder(
        student, Regime(kind, temperature=tau, teacher_temperature=tau), out_dir=tmp_path, q=0.05
    )
    with torch.no_grad():
        zq = teacher(**{k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}).logits
    got = folder.fold(0, batch["input_ids"], batch["attention_mask"], batch["target_mask"], zq, group=np.arange(6) // 2)
    assert got is not None and got.stats["N"] == 6
    ref = reference(student, teacher, folder.layout, batch, kind, tau)
    summary = _assert_matches(tmp_path, 0, ref, folder.layout, 0.05, 1e-6)
    assert summary["regime"] == kind and summary["N"] == 6
    index = json.loads((tmp_path / "inrun.json").read_text())
    assert index["regime"] == {"kind": kind, "temperature": tau, "teacher_temperature": tau}
    assert ParamLayout.from_records(index["tensors"]) == folder.layout and index["steps"] == [0]


def test_the_regime_folder_refuses_what_it_cannot_fold():
    model = llama(tied=False)
    with pytest.raises(ValueError, match="in-run regime 'rl_token'"):
        InRunRegimeFolder(model, Regime("rl_token"))
    with pytest.raises(ValueError, match=r"vectors \['Cov'\]"):
        InRunRegimeFolder(model, Regime("distill_reverse_kl"), vectors=("F", "Cov"))


def _unpadded(batch: dict[str, Any]) -> dict[str, Any]:
    """A TRL batch's rows as the reference takes them: each row's real tokens (prompt + completion) and their
    response weights (TRL's ``completion_mask``), unpadded."""
    seqs, weights = [], []
    for p, pm, c, cm in zip(
        batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"], strict=True
    ):
        seqs.append(torch.cat([p[pm.bool()], c[cm.bool()]]))
        weights.append(torch.cat([torch.zeros(int(pm.sum())), torch.ones(int(cm.sum()))]))
    return {"seqs": seqs, "weights": weights, "input_ids": torch.zeros(1, 1)}


def test_a_distillation_trainer_writes_inrun_statistics_of_its_batch(tmp_path: Path):
    """One ``DistillationTrainer`` step at learning rate 0 (reverse KL, temperature 0.7) with ``CovgradInRun``: the
    step-0 files equal the reference on the weights and the (shuffled) batch the step trained on, and the folded G
    is −∇ of TRL's loss times T/N."""
    pytest.importorskip("trl.trainer.distillation_trainer")
    from covgrad.integrations.trl import CovgradInRun, distillation_regime
    from storage.notebook import open_inrun
    from storage.stores.inrun import inrun_series

    models, tau, q = char_models(), 0.7, 0.05
    step, inrun = StepGradient(), CovgradInRun(tmp_path / "inrun", every_n=1, q=q)
    trainer = distillation_trainer(models, tmp_path / "trl", 1.0, tau, [inrun, step.callback])
    inrun.attach(trainer)
    assert isinstance(inrun.folder, InRunRegimeFolder) and inrun.folder.regime.kind == "distill_reverse_kl"
    trainer.train()

    batch = trainer._buffered_inputs[0]
    mask = batch["completion_mask"]
    N, T = mask.shape[0], float(mask.sum())
    assert (batch["prompt_mask"] == 0).any() and len(set(mask.sum(1).tolist())) > 1  # left padding, two lengths
    layout = inrun.folder.layout
    ref = reference(models[1], models[2], layout, _unpadded(batch), "distill_reverse_kl", tau)
    summary = _assert_matches(tmp_path / "inrun", 0, ref, layout, q, 1e-6)
    assert summary["N"] == N and summary["regime"] == "distill_reverse_kl"
    assert json.loads((tmp_path / "inrun" / "inrun.json").read_text())["steps"] == [0]
    G = np.load(tmp_path / "inrun" / "step_000000.npz")["G"]
    assert _rel(G * N / T, -step.grad.numpy()) < 1e-5  # TRL's own gradient (its logits are float32)
    series = inrun_series(str(tmp_path / "inrun"))  # the trajectory stage's reader (trajectory.inrun) takes it
    assert series.steps == (0,) and series.P == layout.P
    ds = open_inrun(tmp_path / "inrun")  # and the notebook's
    assert ds.G.sel(step=0).values.tobytes() == G.tobytes() and math.isnan(float(ds.std_A.sel(step=0)))

    trainer.beta = 0.5
    with pytest.raises(ValueError, match=r"generalized JSD \(beta=0.5\)"):
        distillation_regime(trainer)
    trainer.beta, trainer.teacher_model = 0.0, None
    with pytest.raises(ValueError, match="no local teacher_model"):
        distillation_regime(trainer)
