"""The fused reduction on every family: the accumulator state that ``PerSampleGrads.accumulate`` folds tensor
by tensor during the backward (tied embeddings, MoE experts and routers, flattened OPT batches, the generic
torch.func rule, LoRA adapters) equals numpy float64 moments of the same batch's per-sample rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from covgrad.layout import select_parameters
from covgrad.moments.accum import MomentAccumulator
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from covgrad.tokens.backward import TokenBackward
from tests.helpers.families import FAMILIES
from tests.helpers.persample import BATCH, make_batch


def _reference(S: np.ndarray, a: np.ndarray, half: np.ndarray, h: int) -> dict[str, np.ndarray]:
    """Per-half moments in float64: mean score, Σ(s − s̄)², Σ(a − ā)(s − s̄)."""
    s, ah = S[half == h], a[half == h]
    d = s - s.mean(0)
    return {"mean_s": s.mean(0), "m2_s": (d * d).sum(0), "c_as": (ah - ah.mean()) @ d}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_fused_state_matches_rows(name):
    model = FAMILIES[name]()
    layout = select_parameters(model)
    batch = make_batch(31, **BATCH)
    psg = PerSampleGrads(model, layout, check=False)

    def fn(z: torch.Tensor) -> torch.Tensor:
        return score_logit_grad(z, batch["input_ids"], batch["target_mask"])

    args = (batch["input_ids"], batch["attention_mask"], fn)
    rows = psg(*args, position_ids=batch["position_ids"]).double().numpy()  # (B, P)
    a = np.array([0.7, -1.3, 0.2, 0.4])
    half = np.array([0, 1, 0, 1])
    acc = MomentAccumulator(layout.P, "cpu", "float64")
    psg.accumulate(*args, acc, a, half, position_ids=batch["position_ids"])
    state = acc.rows()
    for h in (0, 1):
        ref = _reference(rows, a, half, h)
        assert state["count"][h] == (half == h).sum()
        for key, want in ref.items():
            got = state[key][h]
            scale = max(float(np.abs(want).max()), 1e-30)
            assert float(np.abs(got - want).max()) <= 1e-9 * scale, (name, key, h)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_token_backward_rows_match_per_sample_grads(name):
    """Batched logit cotangents (one forward, R rows) give, per row, the per-sample gradients of that
    cotangent alone; families whose rules read the whole call (generic rule, MoE) or run flattened take
    the repeated-batch path."""
    model = FAMILIES[name]()
    layout = select_parameters(model)
    batch = make_batch(32, **BATCH)
    ids, attn, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    eng = TokenBackward(model, layout, ids, attn, pos)
    gen = torch.Generator().manual_seed(5)
    cot = torch.randn(3, *eng.logits.shape, generator=gen) * attn[None, :, :, None]  # (R, B, L, V)
    got = eng.grads(cot).double()  # (R, B, P)
    psg = PerSampleGrads(model, layout, check=False)
    for r in range(cot.shape[0]):
        ref = psg(ids, attn, lambda z, r=r: cot[r], position_ids=pos).double()  # (B, P)
        for e in layout.entries:
            a, b = got[r][:, e.offset : e.offset + e.numel], ref[:, e.offset : e.offset + e.numel]
            assert float((a - b).norm()) <= 1e-5 * max(float(b.norm()), 1e-6 * float(ref.norm())), (name, r, e.name)
