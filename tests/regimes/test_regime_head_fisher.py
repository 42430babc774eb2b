"""The LM head's token Fisher of the full-distribution regimes (covgrad.regimes.fold.head_token_fisher): against
autograd over the whole vocabulary, and the in-sample bound it gives, |G_i| ≤ a·√F_tok_i, on fresh random
models with left padding, fractional response weights and a temperature."""

from __future__ import annotations

import pytest
import torch

from covgrad.regimes.cotangents import Regime, RegimeGrad
from covgrad.regimes.fold import head_token_fisher
from covgrad.tokens.fisher import head_forward
from tests.helpers.models import tiny_llama
from tests.helpers.persample import V, make_batch

TAU = 0.7


def _batch(seed: int) -> dict:
    b = make_batch(seed, [3, 5, 2, 4], [6, 3, 8, 5])
    w = b["target_mask"] * torch.rand(b["target_mask"].shape, generator=torch.Generator().manual_seed(seed))
    return {**b, "target_mask": w.double()}


def _scored(mask: torch.Tensor) -> list[tuple[int, int]]:
    """(sample, logit row) of every scored position: row t predicts token t + 1."""
    return [(int(n), int(t)) for n, t in zip(*torch.nonzero(mask[:, 1:] != 0, as_tuple=True), strict=True)]


@pytest.mark.parametrize("seed", [0, 1])
def test_head_token_fisher_equals_autograd_over_the_vocabulary(seed):
    model = tiny_llama(V, seed=seed).double()
    b = _batch(seed)
    half = torch.tensor([0, 1, 1, 0])
    name, hidden, logits = head_forward(model, b["input_ids"], b["attention_mask"], b["position_ids"])
    assert name == "lm_head.weight"
    got = head_token_fisher(hidden, logits, b["target_mask"], half, TAU)
    W = model.lm_head.weight
    want = torch.zeros(2, W.numel(), dtype=torch.float64)
    out = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"])
    for n, t in _scored(b["target_mask"]):
        logp = torch.log_softmax(out.logits[n, t] / TAU, -1)
        p = logp.exp().detach()
        for v in range(V):  # f = Σ_v p_v (∂ log p_v / ∂W)², each gradient by autograd
            (g,) = torch.autograd.grad(logp[v], W, retain_graph=True)
            want[int(half[n])] += p[v] * g.reshape(-1).square()
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)


def test_a_tied_head_has_no_closed_form():
    model = tiny_llama(V, tied=True).double()
    b = _batch(0)
    assert head_forward(model, b["input_ids"], b["attention_mask"], b["position_ids"]) is None


def _head_G(kind: str, model, b: dict, zq: torch.Tensor) -> torch.Tensor:
    """G of the regime at the head weight: mean over sequences of autograd of the objective (float64)."""
    ids, mask, w = b["input_ids"], b["attention_mask"], b["target_mask"]
    B, W = ids.shape[0], model.lm_head.weight
    G = torch.zeros(W.numel(), dtype=torch.float64)
    out = model(input_ids=ids, attention_mask=mask, position_ids=b["position_ids"])
    for n in range(B):
        rows = [t for m, t in _scored(w) if m == n]
        logp = torch.log_softmax(out.logits[n, rows] / TAU, -1)
        logq = torch.log_softmax(zq[n, rows], -1)
        wt = w[n, [t + 1 for t in rows]]
        if kind == "distill_reverse_kl":
            J = (wt * (logp.exp() * (logp - logq)).sum(-1)).sum()
        elif kind == "distill_forward_kl":
            J = (wt * (logq.exp() * (logq - logp)).sum(-1)).sum()
        else:  # SFT drift towards μ = q: E_{y~q} log p(y)
            J = (wt * (logq.exp() * logp).sum(-1)).sum()
        (g,) = torch.autograd.grad(J, W, retain_graph=True)
        G += g.reshape(-1) / B
    return G


def _head_rho(kind: str, model, b: dict, zq: torch.Tensor) -> torch.Tensor:
    """|G| / (a·√F_tok) at the head, a² = mean_n of RegimeGrad's bound scalar."""
    ids, w = b["input_ids"], b["target_mask"]
    B = ids.shape[0]
    _, hidden, logits = head_forward(model, ids, b["attention_mask"], b["position_ids"])
    fn = RegimeGrad(Regime(kind, temperature=TAU), ids, w, teacher_logits=zq)
    fn(logits)
    F_tok = head_token_fisher(hidden, logits, w, torch.zeros(B, dtype=torch.long), TAU)[0] / B
    bound = (float(fn.bound_sq.mean()) * F_tok).sqrt()
    G = _head_G(kind, model, b, zq)
    assert (G.abs() <= bound * (1 + 1e-9) + 1e-15).all(), float((G.abs() / bound).max())
    return (G.abs() / bound).nan_to_num()


KINDS = ["distill_reverse_kl", "distill_forward_kl", "sft_drift"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_head_bound_holds_in_sample(kind):
    model, teacher = tiny_llama(V, seed=3).double(), tiny_llama(V, seed=4).double()
    b = _batch(3)
    with torch.no_grad():
        zq = teacher(
            input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]
        ).logits
    assert float(_head_rho(kind, model, b, zq).max()) > 0


@pytest.mark.parametrize("kind", KINDS)
def test_the_head_bound_is_tight_when_the_teacher_differs_at_one_token(kind):
    """One scored position, a teacher equal to the policy but for token u's logit: the regime's weight c_v is
    a function of δ_{vu} alone, so Cauchy–Schwarz is an equality at head row u (ρ = 1 there); a bound any
    tighter would fail."""
    model = tiny_llama(V, seed=5).double()
    b = _batch(5)
    b = {k: v[:1] if isinstance(v, torch.Tensor) else v for k, v in b.items()}
    w = torch.zeros_like(b["target_mask"])
    t = int(torch.nonzero(b["target_mask"][0])[0])
    w[0, t] = 0.8
    b["target_mask"] = w
    with torch.no_grad():
        z = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    u = 7
    zq = z / TAU
    zq[..., u] += 2.0
    rho = _head_rho(kind, model, b, zq)
    H = model.lm_head.weight.shape[1]
    torch.testing.assert_close(rho.view(V, H)[u].max(), torch.tensor(1.0, dtype=torch.float64), rtol=1e-9, atol=0)
