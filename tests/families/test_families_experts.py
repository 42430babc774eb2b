"""The fused-experts rule's segmented products: torch's grouped GEMM and the padded batched-matmul fallback
(devices without a float32 grouped GEMM) give the same per-sample gradients, against the naive loop."""

from __future__ import annotations

import pytest
import torch

import covgrad.scores.experts as experts
from covgrad.layout import select_parameters
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from tests.helpers.families import FAMILIES
from tests.helpers.families_hybrid import family_model
from tests.helpers.persample import BATCH, make_batch, max_rel_err, naive_scores

BUILDERS = {"qwen3-moe": FAMILIES["qwen3-moe"], "gpt-oss": lambda: family_model("gpt-oss")}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_grouped_gemm_and_padded_fallback_agree_with_the_naive_loop(name, monkeypatch):
    model = BUILDERS[name]().eval()
    layout = select_parameters(model, ["*experts*"])
    assert any(rule is experts._experts_rule for _, rule, _ in PerSampleGrads(model, layout).bindings())
    batch = make_batch(45, **BATCH)
    args = (batch["input_ids"], batch["attention_mask"])

    def rows() -> torch.Tensor:
        fn = lambda z: score_logit_grad(z, batch["input_ids"], batch["target_mask"])  # noqa: E731
        return PerSampleGrads(model, layout, check=True)(*args, fn, position_ids=batch["position_ids"])

    grouped = rows()
    monkeypatch.setitem(experts._GROUPED_MM, ("cpu", torch.float32), False)
    padded = rows()
    assert float((grouped - padded).abs().max()) <= 1e-6 * float(grouped.abs().max())
    ref = naive_scores(model, layout, batch)
    err, where = max_rel_err(layout, padded, ref)
    assert err < 1e-5, (err, where)
