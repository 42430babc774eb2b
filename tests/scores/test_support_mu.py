"""μ on a per-position support: exact with the whole vocabulary, and the reported bound on random supports."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from covgrad.rollouts.formats import import_records
from covgrad.scores.centering import align_full_mu, score_logit_grad
from covgrad.scores.support_mu import (
    add_sampled_token,
    align_support_mu,
    centering_error_bound,
    mu_on_support,
    outside_range,
    support_tail,
    tail_summary,
)
from storage.readers import read_located_records
from tests.helpers.models import tiny_llama

V = 16


def _batch(seed: int, B: int = 3, T: int = 5, V: int = V):
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, 4, (B,), generator=g)
    response_len = torch.randint(1, T + 1, (B,), generator=g)
    L = int((prompt_len + response_len).max())
    mu_logp = torch.log_softmax(torch.randn(B, T, V, generator=g, dtype=torch.float64) * 2.5, -1)
    logits = torch.randn(B, L, V, generator=g) * 2.0
    y = torch.distributions.Categorical(logits=mu_logp).sample()  # (B, T) sampled tokens
    tokens = torch.zeros(B, L, dtype=torch.long)
    target = torch.zeros(B, L, dtype=torch.bool)
    for n in range(B):
        p, r = int(prompt_len[n]), int(response_len[n])
        tokens[n, p : p + r] = y[n, :r]
        target[n, p : p + r] = True
    return dict(
        prompt_len=prompt_len,
        response_len=response_len,
        mu_logp=mu_logp,
        logits=logits,
        y=y,
        tokens=tokens,
        target=target,
    )


def _random_support(b: dict, k: int, seed: int):
    """Random k-subsets per position, unioned with the sampled token, with μ's exact log-probs."""
    g = torch.Generator().manual_seed(seed)
    B, T, _ = b["mu_logp"].shape
    ids = torch.rand(B, T, V, generator=g).argsort(-1)[..., :k]
    logp = torch.gather(b["mu_logp"], -1, ids)
    sampled_logp = torch.gather(b["mu_logp"], -1, b["y"].unsqueeze(-1)).squeeze(-1)
    return add_sampled_token(ids, logp, b["y"], sampled_logp)


def test_whole_vocabulary_support_equals_full_mu():
    b = _batch(0)
    B, T, _ = b["mu_logp"].shape
    perm = torch.rand(B, T, V, generator=torch.Generator().manual_seed(1)).argsort(-1)
    mu_hat, tail = align_support_mu(
        b["logits"], perm, torch.gather(b["mu_logp"], -1, perm), b["prompt_len"], b["response_len"]
    )
    exact = align_full_mu(b["mu_logp"].float(), b["prompt_len"], b["response_len"], b["logits"].shape[1])
    assert float(tail.max()) < 1e-12
    torch.testing.assert_close(mu_hat, exact, rtol=1e-6, atol=1e-7)
    g_hat = score_logit_grad(b["logits"], b["tokens"], b["target"], mu=mu_hat)
    g_exact = score_logit_grad(b["logits"], b["tokens"], b["target"], mu=exact)
    torch.testing.assert_close(g_hat, g_exact, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("seed", range(40))
def test_bound_holds_on_random_supports(seed):
    b = _batch(seed)
    k = 1 + seed % (V - 2)
    ids, logp = _random_support(b, k, seed + 1000)
    mu_hat, tail = align_support_mu(b["logits"], ids, logp, b["prompt_len"], b["response_len"])
    L = b["logits"].shape[1]
    exact = align_full_mu(b["mu_logp"].float(), b["prompt_len"], b["response_len"], L)
    delta = score_logit_grad(b["logits"], b["tokens"], b["target"], mu=mu_hat) - score_logit_grad(
        b["logits"], b["tokens"], b["target"], mu=exact
    )  # (B, L, V): w (μ − μ̂) at each logit position
    P = 7
    X = torch.randn(*b["mu_logp"].shape, P, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    R = outside_range(X, ids, logp)  # (B, T, P)
    for n in range(b["tokens"].shape[0]):
        p0 = int(b["prompt_len"][n])
        for j in range(int(b["response_len"][n])):
            d = delta[n, p0 + j - 1].double()  # the logit position predicting response token j
            tau = float(tail[n, j])
            assert float(d.abs().sum()) <= 2 * tau + 1e-6
            assert (torch.einsum("v,vp->p", d, X[n, j]).abs() <= tau * R[n, j] + 1e-5).all()
    assert float(tail.max()) > 0  # the supports miss mass, so the check is not vacuous


def test_float64_reconstruction_matches_mu_on_support_and_outside_mass():
    g = torch.Generator().manual_seed(3)
    mu = torch.softmax(torch.randn(200, V, generator=g, dtype=torch.float64) * 3, -1)
    p = torch.softmax(torch.randn(200, V, generator=g, dtype=torch.float64), -1)
    ids = torch.rand(200, V, generator=g).argsort(-1)[:, :5]
    mu_hat, tail = mu_on_support(ids, mu.gather(-1, ids).log(), p)
    torch.testing.assert_close(mu_hat.gather(-1, ids), mu.gather(-1, ids), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(tail, 1 - mu.gather(-1, ids).sum(-1), rtol=1e-12, atol=1e-15)
    outside = torch.ones_like(mu, dtype=torch.bool).scatter_(-1, ids, False)
    spread = torch.where(outside, p, 0.0)
    torch.testing.assert_close(mu_hat, torch.where(outside, tail[:, None] * spread / spread.sum(-1, True), mu))
    assert float((mu_hat - mu).abs().sum(-1).sub(2 * tail).max()) <= 1e-12


def test_parameter_space_bound_on_a_model():
    """ĉ − c of the sampler-centred score of a tiny Llama against Σ_t τ_t R_t from its Jacobian."""
    torch.manual_seed(0)
    model = tiny_llama(V, hidden=16, intermediate=32, layers=1, heads=2, kv_heads=1, initializer_range=0.5).double()
    params = [model.lm_head.weight, model.model.layers[0].mlp.down_proj.weight]
    b = _batch(5, B=1, T=4)
    ids, logp = _random_support(b, 4, 7)
    pl, rl = int(b["prompt_len"][0]), int(b["response_len"][0])
    tokens = b["tokens"][:, : pl + rl]
    logits = model(tokens).logits  # (1, L, V)
    mu_hat, tail = align_support_mu(logits.detach().float(), ids, logp, b["prompt_len"], b["response_len"])
    exact = align_full_mu(b["mu_logp"].float(), b["prompt_len"], b["response_len"], tokens.shape[1])

    def centred(mu):
        z = logits[0, pl - 1 : pl + rl - 1]  # (rl, V) predicts the response
        objective = z.gather(-1, tokens[0, pl:, None]).squeeze(-1) - (mu[0, pl - 1 : pl + rl - 1].double() * z).sum(-1)
        return torch.cat([g.flatten() for g in torch.autograd.grad(objective.sum(), params, retain_graph=True)])

    diff = (centred(mu_hat) - centred(exact)).abs()
    J = torch.stack(
        [
            torch.stack(
                [
                    torch.cat(
                        [g.flatten() for g in torch.autograd.grad(logits[0, pl - 1 + j, v], params, retain_graph=True)]
                    )
                    for v in range(V)
                ]
            )
            for j in range(rl)
        ]
    )  # (rl, V, P)
    R = outside_range(J.unsqueeze(0), ids[:, :rl], logp[:, :rl])  # (1, rl, P)
    bound = centering_error_bound(tail[:, :rl], R)[0]
    assert float(diff.max()) > 0
    assert bool((diff <= bound + 1e-6).all())
    assert bool((bound <= 2 * tail[0, :rl].sum() * J.abs().amax(1).amax(0) + 1e-12).all())


def test_add_sampled_token_and_summary():
    ids = torch.tensor([[[3, 4], [5, 6]]])
    logp = torch.tensor([[[-1.0, -2.0], [-1.0, -torch.inf]]])
    out_ids, out_lp = add_sampled_token(ids, logp, torch.tensor([[4, 6]]), torch.tensor([[-2.0, -3.0]]))
    assert out_ids.tolist() == [[[3, 4, 3], [5, 6, 6]]]
    assert out_lp.tolist() == [[[-1.0, -2.0, -torch.inf], [-1.0, -torch.inf, -3.0]]]
    tail = support_tail(out_lp)
    summary = tail_summary(tail, torch.tensor([1]))
    assert (
        summary["support_tail_max"]
        == pytest.approx(float(tail[0, 0]))
        == pytest.approx(summary["support_tail_seq_max"])
    )


def test_trl_support_imports_to_the_same_tail():
    """TRL's rank-sorted logprobs/logprob_token_ids become the (N, T, k) support; its τ is the importer's mu_tail."""
    path = Path(__file__).parents[1] / "data" / "formats" / "trl.jsonl"
    arrays, _, _ = import_records(
        read_located_records(str(path)), "trl", 32, None, options={"reward_fields": ["accuracy_reward"]}
    )
    ids, logp = torch.from_numpy(arrays["mu_topk_ids"]), torch.from_numpy(arrays["mu_topk_logp"])
    pl, rl = torch.from_numpy(arrays["prompt_len"]), torch.from_numpy(arrays["response_len"])
    logits = torch.randn(len(pl), arrays["tokens"].shape[1], 32, generator=torch.Generator().manual_seed(0))
    mu, tail = align_support_mu(logits, ids, logp, pl, rl)
    torch.testing.assert_close(tail.float(), torch.from_numpy(arrays["mu_tail"]), rtol=0, atol=1e-6)
    rows, cols = torch.nonzero(torch.from_numpy(arrays["response_mask"]), as_tuple=True)
    torch.testing.assert_close(mu[rows, cols - 1].sum(-1), torch.ones(len(rows)), rtol=0, atol=1e-6)


def _centering_fn(b: dict, mu, adv: torch.Tensor):
    from covgrad.rollouts.batch import RolloutBatch
    from covgrad.rollouts.sampling import SamplerSpec
    from covgrad.scores.centering import SamplerCentering

    B = len(b["prompt_len"])
    batch = RolloutBatch.from_arrays(
        b["tokens"].numpy(),
        b["prompt_len"].numpy(),
        b["response_len"].numpy(),
        b["target"].numpy(),
        adv.numpy(),
        torch.arange(B).numpy(),
        trim=True,
    )
    return SamplerCentering(SamplerSpec()).logit_grad(batch, mu)


def test_sampler_centering_of_a_whole_vocabulary_support_equals_full_mu():
    """The scores' μ path for an import's per-position token set (the top-k record) is full-μ centering when
    the set is the whole vocabulary."""
    from covgrad.scores.centering import MuRecord

    b = _batch(11, B=4, T=5)
    order = b["mu_logp"].argsort(-1, descending=True)
    ids, logp = order.int(), torch.gather(b["mu_logp"], -1, order).float()
    support = MuRecord(topk_ids=ids, topk_logp=logp, tail=support_tail(logp).float())
    full = MuRecord(logp=b["mu_logp"].float())
    adv = torch.randn(4, dtype=torch.float64)
    L = b["tokens"].shape[1]
    logits = b["logits"][:, :L]
    got, want = _centering_fn(b, support, adv)(logits), _centering_fn(b, full, adv)(logits)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-7)


@pytest.mark.parametrize("seed", range(3))
def test_reported_gradient_bound_holds_on_random_supports(seed):
    """|Ĝ − G| of the sampler-centred G = mean_n A_n c_n of a tiny Llama, with μ on random supports through the
    scores' centering, is within β · max_{n,t} R_{n,t,i} (β from ``gradient_error_factor``, the rollouts'
    reported factor)."""
    from covgrad.scores.centering import MuRecord
    from covgrad.scores.support_mu import gradient_error_factor

    torch.manual_seed(seed)
    model = tiny_llama(V, hidden=16, intermediate=32, layers=1, heads=2, kv_heads=1, initializer_range=0.5)
    params = [model.lm_head.weight, model.model.layers[0].mlp.down_proj.weight]
    b = _batch(20 + seed, B=3, T=3)
    ids, logp = _random_support(b, 5, seed)
    tail = support_tail(logp)
    adv = torch.randn(3, dtype=torch.float64)
    L = b["tokens"].shape[1]
    logits = model(b["tokens"][:, :L]).logits  # (B, L, V)
    support = MuRecord(topk_ids=ids.int(), topk_logp=logp.float(), tail=tail.float())
    full = MuRecord(logp=b["mu_logp"].float())

    def G(mu):
        dz = _centering_fn(b, mu, adv)(logits)  # (B, L, V): per-sample logit cotangent of the centred score
        weights = adv.float().view(-1, 1, 1) / len(adv)
        grads = torch.autograd.grad((dz * weights * logits).sum(), params, retain_graph=True)
        return torch.cat([g.flatten() for g in grads]).double()

    diff = (G(support) - G(full)).abs()
    R = torch.zeros(params[0].numel() + params[1].numel(), dtype=torch.float64)
    for n in range(3):
        pl = int(b["prompt_len"][n])
        for j in range(int(b["response_len"][n])):
            J = torch.stack(
                [
                    torch.cat(
                        [g.flatten() for g in torch.autograd.grad(logits[n, pl - 1 + j, v], params, retain_graph=True)]
                    )
                    for v in range(V)
                ]
            )  # (V, P)
            R = torch.maximum(R, outside_range(J.unsqueeze(0), ids[n, j : j + 1], logp[n, j : j + 1])[0].double())
    beta = gradient_error_factor(torch.where(torch.arange(3)[None] < b["response_len"][:, None], tail, 0.0), adv)
    assert float(diff.max()) > 0
    assert bool((diff <= beta * R + 1e-6).all())
