"""Per-sample scores from hooks against a naive loop: one unpadded forward + backward per sequence."""

from __future__ import annotations

import ast

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from covgrad.layout import select_parameters
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from tests.helpers.persample import (
    BATCH,
    MODELS,
    V,
    doubled_up_proj,
    gpt2,
    hook_scores,
    llama,
    make_batch,
    max_rel_err,
    naive_scores,
)


@pytest.mark.parametrize("name", list(MODELS))
def test_matches_naive_loop(name):
    model = MODELS[name]()
    layout = select_parameters(model)
    batch = make_batch(10, **BATCH)
    got = hook_scores(model, layout, batch, tau=0.7)
    assert got.shape == (4, layout.P) and got.dtype == torch.float32
    err, where = max_rel_err(layout, got, naive_scores(model, layout, batch, tau=0.7))
    assert err < 1e-5, (err, where)


def test_tied_weight_is_the_sum_of_both_uses():
    tied = llama(tied=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    untied = llama(tied=False)
    untied.load_state_dict(tied.state_dict())
    batch = make_batch(11, **BATCH)
    lt, lu = select_parameters(tied), select_parameters(untied)
    assert "lm_head.weight" not in lt.names
    st, su = hook_scores(tied, lt, batch), hook_scores(untied, lu, batch)

    def block(layout, S, name):
        e = layout.entry(name)
        return S[:, e.offset : e.offset + e.numel]

    both = block(lt, st, "model.embed_tokens.weight")
    emb, head = block(lu, su, "model.embed_tokens.weight"), block(lu, su, "lm_head.weight")
    torch.testing.assert_close(both, emb + head, rtol=0, atol=1e-6)
    assert float((both - head).norm()) > 0.1 * float(both.norm())


def test_glob_selection_without_embeddings():
    model = llama(tied=False)
    layout = select_parameters(model, ["model.layers.1.*", "lm_head.weight"])
    assert all(n.startswith("model.layers.1.") or n == "lm_head.weight" for n in layout.names)
    batch = make_batch(12, **BATCH)
    err, where = max_rel_err(layout, hook_scores(model, layout, batch), naive_scores(model, layout, batch))
    assert err < 1e-5, (err, where)


def test_only_lm_head_selected():
    model = llama(tied=False)
    layout = select_parameters(model, ["lm_head.weight"])
    batch = make_batch(13, **BATCH)
    err, _ = max_rel_err(layout, hook_scores(model, layout, batch), naive_scores(model, layout, batch))
    assert err < 1e-5


def test_sampler_centering_with_policy_mu_equals_policy():
    model = llama(tied=False)
    layout = select_parameters(model)
    batch = make_batch(14, **BATCH)
    tau = 1.3
    with torch.no_grad():
        z = model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            position_ids=batch["position_ids"],
        ).logits
    mu = torch.softmax(z / tau, -1)
    policy = hook_scores(model, layout, batch, tau=tau)
    sampler = hook_scores(model, layout, batch, tau=tau, mu=mu)
    err, where = max_rel_err(layout, sampler, policy)
    assert err < 1e-5, (err, where)


def test_sampler_centering_arbitrary_mu_matches_stop_gradient_autograd():
    model = gpt2()
    layout = select_parameters(model)
    batch = make_batch(15, **BATCH)
    mu = torch.distributions.Dirichlet(torch.ones(V)).sample(batch["input_ids"].shape)  # (B, L, V)
    got = hook_scores(model, layout, batch, mu=mu)
    err, where = max_rel_err(layout, got, naive_scores(model, layout, batch, mu=mu))
    assert err < 1e-5, (err, where)
    # and it is not the policy score (the test can tell the two centerings apart)
    err_policy, _ = max_rel_err(layout, got, naive_scores(model, layout, batch))
    assert err_policy > 1e-2


def test_score_logit_grad_is_logit_gradient_of_objective():
    gen = torch.Generator().manual_seed(5)
    B, L, tau = 3, 7, 0.8
    z = torch.randn(B, L, V, generator=gen, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (B, L), generator=gen)
    w = (torch.rand(B, L, generator=gen) > 0.4).double()
    w[:, 0] = 0
    w[1, 3] = 0.5
    lp = F.log_softmax(z[:, :-1] / tau, -1).gather(-1, ids[:, 1:, None])[..., 0]
    (ref,) = torch.autograd.grad((w[:, 1:] * lp).sum(), z)
    got = score_logit_grad(z.detach(), ids, w, temperature=tau)
    assert got.dtype == torch.float32
    np.testing.assert_allclose(got.numpy(), ref.numpy(), atol=1e-6)
    mu = torch.softmax(torch.randn(B, L, V, generator=gen, dtype=torch.float64), -1)
    zs = z[:, :-1] / tau
    obj = (w[:, 1:] * (zs.gather(-1, ids[:, 1:, None])[..., 0] - (mu[:, :-1] * zs).sum(-1))).sum()
    (ref_mu,) = torch.autograd.grad(obj, z)
    got_mu = score_logit_grad(z.detach(), ids, w, mu=mu, temperature=tau)
    np.testing.assert_allclose(got_mu.numpy(), ref_mu.numpy(), atol=1e-6)


def test_score_logit_grad_rejects_bad_input():
    z = torch.randn(2, 4, V)
    ids = torch.randint(0, V, (2, 4))
    w = torch.zeros(2, 4)
    with pytest.raises(ValueError, match=r"target_mask\[:, 0\]"):
        score_logit_grad(z, ids, torch.ones(2, 4))
    with pytest.raises(ValueError, match="temperature"):
        score_logit_grad(z, ids, w, temperature=0.0)
    with pytest.raises(ValueError, match="mu"):
        score_logit_grad(z, ids, torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1.0]]), mu=torch.ones(2, 4, V))
    with pytest.raises(ValueError, match="input_ids"):
        score_logit_grad(z, ids + V, w)


class ScaleNorm(nn.Module):
    """A norm-like module that owns a parameter and wraps a parametrised submodule: its own parameter takes
    the generic path (its forward replayed per sample), the submodule's keeps the Linear rule."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.inner = nn.Linear(weight.numel(), weight.numel(), bias=False)

    def forward(self, x):
        return self.inner(x) * self.weight


def test_parameter_of_a_module_with_parametrised_submodules_is_exact():
    model = llama(tied=False)
    model.model.norm = ScaleNorm(model.model.norm.weight.detach()).eval()
    layout = select_parameters(model)
    batch = make_batch(15, **BATCH)
    err, where = max_rel_err(layout, hook_scores(model, layout, batch), naive_scores(model, layout, batch))
    assert err < 1e-5, (err, where)


def test_every_unsupported_parameter_named_in_one_refusal():
    model = llama(tied=False)
    model.logit_scale = nn.Parameter(torch.ones(()))  # owned by the top-level module
    model.model.embed_tokens.max_norm = 1.0  # renormalises rows in place: no per-sample rule
    with pytest.raises(ValueError) as info:
        PerSampleGrads(model, select_parameters(model))
    msg = str(info.value)
    assert "\n" not in msg and "2 selected parameters" in msg
    assert "'logit_scale'" in msg and "'model.embed_tokens.weight'" in msg and "max_norm" in msg
    selection = ast.literal_eval(msg.split("model.params = ")[1])
    layout = select_parameters(model, selection)
    assert set(layout.names) == set(select_parameters(model).names) - {"logit_scale", "model.embed_tokens.weight"}
    assert "model.layers.*.mlp.up_proj.weight" in selection
    PerSampleGrads(model, layout)


def test_self_check_catches_rule_mismatch():
    model = doubled_up_proj(llama(tied=False))
    layout = select_parameters(model)
    batch = make_batch(16, **BATCH)
    with pytest.raises(ValueError, match=r"self-check failed for parameter 'model\.layers\.0\.mlp\.up_proj\.weight'"):
        hook_scores(model, layout, batch)
    hook_scores(model, layout, batch, check=False)  # unchecked runs, silently wrong by design


def test_leaves_no_grad_restores_flags_and_repeats():
    model = llama(tied=True)
    model.model.layers[0].mlp.down_proj.weight.requires_grad_(False)
    layout = select_parameters(model)
    batch = make_batch(17, **BATCH)
    psg = PerSampleGrads(model, layout)
    fn = lambda z: score_logit_grad(z, batch["input_ids"], batch["target_mask"])  # noqa: E731
    first = psg(batch["input_ids"], batch["attention_mask"], fn, batch["position_ids"])
    second = psg(batch["input_ids"], batch["attention_mask"], fn, batch["position_ids"])
    assert torch.equal(first, second)
    assert all(p.grad is None for p in model.parameters())
    assert not model.model.layers[0].mlp.down_proj.weight.requires_grad
    assert all(p.requires_grad for n, p in model.named_parameters() if "down_proj" not in n or "layers.1" in n)


def test_training_mode_rejected():
    model = llama(tied=False).train()
    batch = make_batch(18, **BATCH)
    with pytest.raises(ValueError, match="eval"):
        hook_scores(model, select_parameters(model), batch)


def test_bf16_model_close_to_fp32():
    model = llama(tied=False)
    layout = select_parameters(model)
    batch = make_batch(19, **BATCH)
    ref = hook_scores(model, layout, batch)
    got = hook_scores(model.to(torch.bfloat16), layout, batch)
    assert got.dtype == torch.float32
    rel = float((got.double() - ref.double()).norm() / ref.double().norm())
    assert rel < 1e-2, rel


def test_broadcast_position_ids_rejected_with_a_hint():
    model = gpt2()
    batch = make_batch(20, **BATCH)
    with pytest.raises(ValueError, match="position_ids"):
        PerSampleGrads(model, select_parameters(model))(
            batch["input_ids"],
            batch["attention_mask"],
            lambda z: score_logit_grad(z, batch["input_ids"], batch["target_mask"]),
        )


def test_out_buffer_is_filled_and_checked():
    model = llama(tied=True)
    layout = select_parameters(model)
    batch = make_batch(21, **BATCH)
    psg = PerSampleGrads(model, layout)
    fn = lambda z: score_logit_grad(z, batch["input_ids"], batch["target_mask"])  # noqa: E731
    fresh = psg(batch["input_ids"], batch["attention_mask"], fn, batch["position_ids"])
    out = torch.full((4, layout.P), float("nan"))
    got = psg(batch["input_ids"], batch["attention_mask"], fn, batch["position_ids"], out=out)
    assert got is out and torch.equal(out, fresh)
    with pytest.raises(ValueError, match="out must be"):
        psg(batch["input_ids"], batch["attention_mask"], fn, batch["position_ids"], out=torch.empty(4, layout.P + 1))
