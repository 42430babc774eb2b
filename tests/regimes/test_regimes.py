"""Regime cotangents (covgrad.regimes.cotangents): per-sample gradients through the score's hooks against naive float64
autograd of each regime's objective, the KL gradients and their vocabulary-covariance form against autograd
of the KL, the sampled/full distillation identity with power against wrong variants, the bounds (random and
nearly tight) by exact enumeration, and an independent numpy computation of every regime's G."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from covgrad.choices import REGIME_KINDS
from covgrad.layout import select_parameters
from covgrad.regimes.cotangents import (
    Regime,
    RegimeGrad,
    advantage_sq_sums,
    chi2_sums,
    distill_sampled_advantages,
    drift_logit_grad,
    reverse_kl_logit_grad,
    reverse_kl_var_sums,
    token_advantage_logit_grad,
)
from covgrad.regimes.fold import RegimeMoments
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from tests.helpers.families import FAMILIES
from tests.helpers.models import tiny_llama
from tests.helpers.persample import BATCH, PAD, V, make_batch, max_rel_err

TAU, TAU_Q, BETA = 0.8, 1.3, 0.3

# (case id, regime) pairs of the family matrix; every regime kind appears at least once
CASES = [
    ("rl", Regime("rl", temperature=TAU)),
    ("rl_token", Regime("rl_token", temperature=TAU, kl_beta=BETA, length_norm="response_length")),
    (
        "rl_token_to_go",
        Regime("rl_token", temperature=TAU, kl_beta=BETA, kl_reward_to_go=True, length_norm="constant", max_length=9),
    ),
    ("distill_sampled", Regime("distill_sampled", temperature=TAU, teacher_temperature=TAU_Q, baseline=True)),
    ("distill_sampled_logprobs", Regime("distill_sampled", temperature=TAU, teacher_temperature=TAU_Q)),
    ("distill_reverse_kl", Regime("distill_reverse_kl", temperature=TAU, teacher_temperature=TAU_Q)),
    ("distill_forward_kl", Regime("distill_forward_kl", temperature=TAU, teacher_temperature=TAU_Q)),
    ("sft_drift", Regime("sft_drift", temperature=TAU)),
    ("sft_sampled", Regime("sft_sampled", temperature=TAU)),
]
assert {r.kind for _, r in CASES} == set(REGIME_KINDS)


def _teacher(seed: int) -> nn.Module:
    return tiny_llama(V, intermediate=48, pad_token_id=PAD, seed=seed).double()


def _padded(rows: list[torch.Tensor], L: int) -> torch.Tensor:
    """Left-pad per-sequence logit rows (Ln, V) into (B, L, V) (zeros on padding)."""
    out = torch.zeros(len(rows), L, rows[0].shape[-1], dtype=torch.float64)
    for n, r in enumerate(rows):
        out[n, L - len(r) :] = r
    return out


def _naive_objectives(z, zq, zr, mu_rows, y, w, a_seq, a_tok, base, max_len):
    """Every case's objective of one unpadded sequence (positions 0 … Ln-2 predict y = ids[1:]), written
    directly from its definition; advantages and baselines detached."""
    logp = F.log_softmax(z / TAU, -1)  # (Ln-1, V)
    lpy = logp.gather(-1, y[:, None])[:, 0]
    logq = F.log_softmax(zq / TAU_Q, -1)
    lqy = logq.gather(-1, y[:, None])[:, 0]
    lref = F.log_softmax(zr / TAU, -1).gather(-1, y[:, None])[:, 0]
    p = logp.exp()
    kl_rev = (p * (logp - logq)).sum(-1)
    q = logq.exp()
    kl_fwd = (q * (logq - logp)).sum(-1)
    k = (lpy - lref).detach()
    on = w != 0
    A = a_tok + -BETA * k * on
    to_go = (-BETA * k * on).flip(0).cumsum(0).flip(0) * on
    adv_norm = A / on.sum()
    adv_to_go = (a_tok + to_go) / max_len
    dist = (lqy - lpy).detach()
    return {
        "rl": a_seq * (w * lpy).sum(),
        "rl_token": (w * (adv_norm - base) * lpy).sum(),
        "rl_token_to_go": (w * (adv_to_go - base) * lpy).sum(),
        "distill_sampled": (w * (dist + kl_rev.detach()) * lpy).sum(),
        "distill_sampled_logprobs": (w * dist * lpy).sum(),
        "distill_reverse_kl": -(w * kl_rev).sum(),
        "distill_forward_kl": -(w * kl_fwd).sum(),
        "sft_drift": (w * (mu_rows * logp).sum(-1)).sum(),
        "sft_sampled": (w * lpy).sum(),
    }


@pytest.mark.parametrize("family", ["llama-untied", "llama-tied", "qwen3", "gemma3", "gpt2", "qwen3-moe"])
def test_regime_grads_match_naive_float64_objectives(family):
    model = FAMILIES[family]()
    layout = select_parameters(model)
    model64 = copy.deepcopy(model).double()
    if hasattr(model64.config, "_experts_implementation"):  # grouped_mm has no float64 kernel
        model64.config._experts_implementation = "eager"
    teacher, ref = _teacher(7), _teacher(8)
    batch = make_batch(40, **BATCH)
    ids, L = batch["input_ids"], batch["input_ids"].shape[1]
    B = ids.shape[0]
    gen = torch.Generator().manual_seed(3)
    a_seq = torch.randn(B, generator=gen, dtype=torch.float64)
    a_tok = torch.randn(B, L, generator=gen, dtype=torch.float64) * batch["target_mask"]
    base = torch.randn(B, L, generator=gen, dtype=torch.float64) * batch["target_mask"]  # given: prefix-only
    with torch.no_grad():
        tq = [teacher(input_ids=s[None]).logits[0] for s in batch["seqs"]]
        tr = [ref(input_ids=s[None]).logits[0] for s in batch["seqs"]]
    zq, zr = _padded(tq, L), _padded(tr, L)
    mu = torch.softmax(zr, -1)  # sft data distribution: the reference model's
    logq_tok = torch.zeros(B, L, dtype=torch.float64)  # imported teacher log-probs of the drawn tokens
    logq_tok[:, 1:] = F.log_softmax(zq[:, :-1] / TAU_Q, -1).gather(-1, ids[:, 1:, None])[..., 0]
    logq_tok *= batch["target_mask"]

    psg = PerSampleGrads(model, layout, check=True)
    common = {"input_ids": ids, "response_mask": batch["target_mask"]}
    inputs = {
        "rl": {"advantages": a_seq},
        "rl_token": {"advantages": a_tok, "baseline": base, "ref_logits": zr},
        "rl_token_to_go": {"advantages": a_tok, "baseline": base, "ref_logits": zr},
        "distill_sampled": {"teacher_logits": zq},
        "distill_sampled_logprobs": {"teacher_logprobs": logq_tok},
        "distill_reverse_kl": {"teacher_logits": zq},
        "distill_forward_kl": {"teacher_logits": zq},
        "sft_drift": {"mu": mu},
        "sft_sampled": {},
    }
    got = {}
    for case, regime in CASES:
        fn = RegimeGrad(regime, **common, **inputs[case])
        got[case] = psg(ids, batch["attention_mask"], fn, position_ids=batch["position_ids"])
        assert fn.bound_sq is None if case == "sft_sampled" else fn.bound_sq.shape == (B,)

    params = dict(model64.named_parameters())
    ps = [params[e.name] for e in layout.entries]
    ref_rows = {case: [] for case, _ in CASES}
    for n, (s, w) in enumerate(zip(batch["seqs"], batch["weights"], strict=True)):
        Ln = len(s)
        z = model64(input_ids=s[None]).logits[0, :-1]
        sl = slice(L - Ln, L - 1)  # this sequence's logit positions in the padded batch
        objs = _naive_objectives(
            z,
            tq[n][:-1],
            tr[n][:-1],
            mu[n, sl],
            s[1:],
            w[1:].double(),
            a_seq[n],
            a_tok[n, L - Ln + 1 :],
            base[n, L - Ln + 1 :],
            9,
        )
        for case, _ in CASES:
            grads = torch.autograd.grad(objs[case], ps, retain_graph=True, allow_unused=True)
            ref_rows[case].append(
                torch.cat(
                    [torch.zeros(p.numel()) if g is None else g.reshape(-1) for p, g in zip(ps, grads, strict=True)]
                )
            )
    for case, _ in CASES:
        err, where = max_rel_err(layout, got[case], torch.stack(ref_rows[case]))
        assert err < 1e-5, (family, case, err, where)
    # the cases differ from each other (the matrix would catch a regime silently computing another's)
    assert max_rel_err(layout, got["distill_sampled"], got["distill_sampled_logprobs"])[0] > 1e-2
    assert max_rel_err(layout, got["rl_token"], got["rl_token_to_go"])[0] > 1e-2


def _flat_grad(obj: torch.Tensor, ps: list[torch.Tensor]) -> torch.Tensor:
    grads = torch.autograd.grad(obj, ps, retain_graph=True, allow_unused=True)
    return torch.cat(
        [torch.zeros(p.numel(), dtype=p.dtype) if g is None else g.reshape(-1) for p, g in zip(ps, grads, strict=True)]
    )


@pytest.mark.parametrize("family", ["gpt2", "llama-untied"])
def test_kl_gradients_match_autograd_of_the_kl_at_every_position(family):
    """float64 model: −∇θ KL(p_t‖q_t) and −∇θ KL(q_t‖p_t) of every sample at every scored position."""
    model = FAMILIES[family]().double()
    layout = select_parameters(model)
    ps = [dict(model.named_parameters())[e.name] for e in layout.entries]
    teacher = _teacher(9)
    batch = make_batch(41, **BATCH)
    ids, mask, L = batch["input_ids"], batch["target_mask"], batch["input_ids"].shape[1]
    with torch.no_grad():
        tq = [teacher(input_ids=s[None]).logits[0] for s in batch["seqs"]]
    zq = _padded(tq, L)
    q = torch.softmax(zq / TAU_Q, -1)
    psg = PerSampleGrads(model, layout, check=False)
    hook = {"rev": {}, "fwd": {}}
    for j in range(1, L):  # token j, predicted by logit position j - 1
        mj = mask * (torch.arange(L) == j)
        if not bool(mj.any()):
            continue
        kw = {"position_ids": batch["position_ids"]}
        hook["rev"][j] = psg(
            ids, batch["attention_mask"], lambda z, m=mj: reverse_kl_logit_grad(z, zq, m, TAU, TAU_Q), **kw
        )
        hook["fwd"][j] = psg(ids, batch["attention_mask"], lambda z, m=mj: drift_logit_grad(z, q, m, TAU), **kw)
    checked = 0
    for n, s in enumerate(batch["seqs"]):
        Ln = len(s)
        logp = F.log_softmax(model(input_ids=s[None]).logits[0, :-1] / TAU, -1)
        logq = F.log_softmax(tq[n][:-1] / TAU_Q, -1)
        p, qq = logp.exp(), logq.exp()
        for t in range(Ln - 1):
            j = L - Ln + t + 1
            if mask[n, j] == 0:
                continue
            rev = -_flat_grad((p[t] * (logp[t] - logq[t])).sum(), ps)
            fwd = -_flat_grad((qq[t] * (logq[t] - logp[t])).sum(), ps)
            for kind, ref in (("rev", rev), ("fwd", fwd)):
                got = hook[kind][j][n].double()
                rel = float((got - ref).norm() / ref.norm())
                assert rel < 1e-6, (family, kind, n, t, rel)
            checked += 1
    assert checked == sum(BATCH["resp_lens"])


def test_vocabulary_covariance_forms_equal_autograd():
    """∇θ KL(p_t‖q_t) = Σ_v p_v(ℓ_v − KL_t) J_v = Cov_{v~p_t}(ℓ, J), ∇θ KL(q‖p) = −Cov_p(q/p, J) and the SFT
    drift J_tᵀ(μ − p) = Cov_p(μ/p, J) with J_t = ∂z_t/∂θ from autograd (float64, GPT-2, last block and head);
    with the per-position bounds std_p(ℓ)·√f and √χ²·√f."""
    model = FAMILIES["gpt2"]().double()
    params = dict(model.named_parameters())
    ps = [p for n, p in params.items() if n.startswith("transformer.h.1.") or n == "transformer.ln_f.weight"]
    ids = make_batch(42, [3], [5])["seqs"][0]
    z = model(input_ids=ids[None]).logits[0]  # (Ln, V), τ = 1 here
    gen = torch.Generator().manual_seed(4)
    zq = torch.randn(z.shape, generator=gen, dtype=torch.float64) * 2
    mu = torch.softmax(torch.randn(z.shape, generator=gen, dtype=torch.float64), -1)
    for t in (2, 4, 6):
        J = torch.stack([_flat_grad(z[t, v], ps) for v in range(V)])  # (V, P)
        logp = F.log_softmax(z[t], -1)
        logq = F.log_softmax(zq[t], -1)
        p, q, ell = logp.exp(), logq.exp(), logp - logq
        ref = _flat_grad((p * ell).sum(), ps)
        ref_fwd = _flat_grad((q * (logq - logp)).sum(), ps)
        ref_sft = _flat_grad((mu[t] * logp).sum(), ps)
        p, ell, logp = p.detach(), ell.detach(), logp.detach()
        kl = (p * ell).sum()
        Jc = J - p @ J  # centred sensitivities
        cov_rev = (p * (ell - kl)) @ Jc
        assert float((cov_rev - (p * (ell - kl)) @ J).norm() / cov_rev.norm()) < 1e-12
        assert float((cov_rev - ref).norm() / ref.norm()) < 1e-6
        cov_fwd = -((q / p - 1) * p) @ Jc
        assert float((cov_fwd - ref_fwd).norm() / ref_fwd.norm()) < 1e-6
        drift = (mu[t] - p) @ J
        assert float((drift - ((mu[t] / p - 1) * p) @ Jc).norm() / drift.norm()) < 1e-10
        assert float((drift - ref_sft).norm() / ref_sft.norm()) < 1e-6
        f = p @ Jc**2  # token Fisher (P,)
        var_ell = p @ (ell - kl) ** 2
        assert bool((ref.abs() <= var_ell.sqrt() * f.sqrt() * (1 + 1e-9) + 1e-15).all())
        chi2 = (q * q / p).sum() - 1
        assert bool((ref_fwd.abs() <= chi2.sqrt() * f.sqrt() * (1 + 1e-9) + 1e-15).all())


# --- a direct parametrisation: z_t = J_t(prefix) θ, everything exact ---


class Linear2:
    """Two response positions over V tokens: z_1 = J1 θ, z_2 = J2[y_1] θ (an autoregressive model whose
    sensitivities depend on the prefix), θ ∈ R^P, float64."""

    def __init__(self, V: int, P: int, seed: int, scale: float = 1.0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.V, self.P = V, P
        self.theta = torch.randn(P, generator=gen, dtype=torch.float64)
        self.J1 = torch.randn(V, P, generator=gen, dtype=torch.float64) * scale
        self.J2 = torch.randn(V, V, P, generator=gen, dtype=torch.float64) * scale

    def jac(self, ids: torch.Tensor) -> torch.Tensor:
        """Per-sample sensitivities (N, L=3, V, P) aligned like the logits (position 2 predicts nothing)."""
        N = ids.shape[0]
        Jall = torch.zeros(N, 3, self.V, self.P, dtype=torch.float64)
        Jall[:, 0] = self.J1
        Jall[:, 1] = self.J2[ids[:, 1]]
        return Jall

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.jac(ids) @ self.theta  # (N, 3, V)

    def grads(self, ids: torch.Tensor, cot: torch.Tensor) -> torch.Tensor:
        """g_n = Σ_t J_tᵀ c_t: (N, P)."""
        return torch.einsum("ntv,ntvp->np", cot.double(), self.jac(ids))

    def sample(self, N: int, seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.zeros(N, 3, dtype=torch.long)
        ids[:, 1] = torch.multinomial(torch.softmax(self.J1 @ self.theta, -1), N, replacement=True, generator=gen)
        p2 = torch.softmax(self.J2[ids[:, 1]] @ self.theta, -1)  # (N, V)
        ids[:, 2] = torch.multinomial(p2, 1, generator=gen)[:, 0]
        return ids

    def outcomes(self, tau: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        """Every (y_1, y_2) as ids (V², 3) with its probability (V²,) under softmax(z/τ)."""
        ids = torch.tensor([[0, a, b] for a, b in itertools.product(range(self.V), repeat=2)])
        logp = torch.log_softmax(self.logits(ids) / tau, -1)
        return ids, (logp[:, 0].gather(-1, ids[:, 1:2]) + logp[:, 1].gather(-1, ids[:, 2:3]))[:, 0].exp()

    def token_fisher(self, ids: torch.Tensor, tau: float = 1.0) -> torch.Tensor:
        """Σ_t f_t per outcome (N, P), f_t = Var_{v~p_t}(J_{t,v})/τ²."""
        Jall = self.jac(ids)[:, :2]
        p = torch.softmax(self.logits(ids)[:, :2] / tau, -1)  # (N, 2, V)
        Jc = Jall - torch.einsum("ntv,ntvp->ntp", p, Jall)[:, :, None]
        return torch.einsum("ntv,ntvp->np", p, Jc**2) / tau**2


MASK3 = torch.tensor([[0.0, 1.0, 1.0]])


def _mean_se(g: torch.Tensor, u: torch.Tensor) -> tuple[float, float]:
    x = g @ u
    return float(x.mean()), float(x.std() / len(x) ** 0.5)


def test_sampled_distillation_mean_is_the_full_reverse_kl_gradient_and_rejects_wrong_variants():
    lin = Linear2(V=6, P=5, seed=0, scale=0.8)
    gen = torch.Generator().manual_seed(1)
    zq_table = torch.randn(6, 6, generator=gen, dtype=torch.float64) * 1.5  # teacher logits of position 2 per y_1
    zq1 = torch.randn(6, generator=gen, dtype=torch.float64) * 1.5
    N, zs, zs_wrong = 20000, [], {"sign": [], "uncentred": [], "token_baseline": []}
    for seed in range(6):
        ids = lin.sample(N, seed)
        z = lin.logits(ids)
        zq = torch.zeros_like(z)
        zq[:, 0], zq[:, 1] = zq1, zq_table[ids[:, 1]]
        mask = MASK3.expand(N, 3)
        full = lin.grads(ids, reverse_kl_logit_grad(z, zq, mask)).mean(0)  # exact at each sampled prefix
        adv, b = distill_sampled_advantages(z, ids, mask, teacher_logits=zq, baseline=True)
        g_plain = lin.grads(ids, token_advantage_logit_grad(z, ids, mask, adv))
        g_base = lin.grads(ids, token_advantage_logit_grad(z, ids, mask, adv, b))
        u = torch.randn(lin.P, generator=gen, dtype=torch.float64)
        target = float(full @ u)
        for g in (g_plain, g_base):
            m, se = _mean_se(g, u)
            zs.append((m - target) / se)
        # per coordinate too (fixed seeds; 5 coordinates × 2 estimators × 6 seeds)
        for g in (g_plain, g_base):
            zc = (g.mean(0) - full) / (g.std(0) / N**0.5)
            assert float(zc.abs().max()) < 4.0, zc
        # wrong variants, each tested along its difference from the right G (the most powerful direction)
        p = torch.softmax(z, -1)
        ell = torch.log_softmax(z, -1) - torch.log_softmax(zq, -1)
        uncentred = lin.grads(ids, -(p * ell) * torch.tensor([1.0, 1.0, 0.0])[:, None]).mean(0)  # no − KL
        # a "baseline" that depends on the drawn token is not a baseline: biased
        bad_b = F.pad(0.5 * torch.log_softmax(zq, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0], (1, 0))
        g_bad = lin.grads(ids, token_advantage_logit_grad(z, ids, mask, adv, bad_b))
        for name, g, claim in (
            ("sign", g_base, -full),
            ("uncentred", g_base, uncentred),
            ("token_baseline", g_bad, full),
        ):
            # (the biased one along its observed bias: a right estimator gives |z| ~ √P there, not > 10)
            d = (g.mean(0) - full) if name == "token_baseline" else (claim - full)
            m, se = _mean_se(g, d / d.norm())
            zs_wrong[name].append((m - float(claim @ d / d.norm())) / se)
    zs = np.array(zs)
    assert np.abs(zs).max() < 3.0, zs
    assert 0.1 < float(np.mean(zs**2)) < 3.0, zs  # ≈ 1: the standard errors are right
    for name, w in zs_wrong.items():
        assert np.abs(np.array(w)).min() > 10, (name, w)


def test_sampled_sft_is_sampler_centred_score_plus_drift_and_filtered_sft_is_binary_rl():
    gen = torch.Generator().manual_seed(2)
    B, L, Vv = 3, 6, 9
    z = torch.randn(B, L, Vv, generator=gen, dtype=torch.float64)
    ids = torch.randint(0, Vv, (B, L), generator=gen)
    w = (torch.rand(B, L, generator=gen) > 0.3).double()
    w[:, 0] = 0
    mu = torch.softmax(torch.randn(B, L, Vv, generator=gen, dtype=torch.float64), -1)
    plain = RegimeGrad(Regime("sft_sampled", temperature=TAU), ids, w)(z)
    split = score_logit_grad(z, ids, w, mu=mu, temperature=TAU).double() + drift_logit_grad(z, mu, w, TAU)
    assert float((plain - split).abs().max()) < 1e-6
    assert float((plain - score_logit_grad(z, ids, w, temperature=TAU).double()).abs().max()) < 1e-6
    # E_{y~μ}[e_y − p] = μ − p: the sampled estimator's mean is the drift (one position, many draws)
    lin = Linear2(V=5, P=4, seed=3)
    ids, prob = lin.outcomes()
    zz = lin.logits(ids)
    r = (ids[:, 2] == 1).double()  # binary reward on the second token
    m = MASK3.expand(len(ids), 3)
    s = lin.grads(ids, RegimeGrad(Regime("sft_sampled"), ids, m)(zz))
    rl = lin.grads(ids, RegimeGrad(Regime("rl"), ids, m, advantages=r)(zz))
    kept = r == 1
    # per sample: SFT on the kept samples is rl with A = r (zero elsewhere), exactly
    assert torch.allclose(rl[kept], s[kept], atol=1e-12) and float(rl[~kept].abs().max()) == 0
    # in expectation: E[∇ log p | r = 1] = E[r s]/P(r = 1) = Cov(r, s)/P(r = 1), as E[s] = 0 on policy
    Es = prob @ s
    assert float(Es.abs().max()) < 1e-12
    pr = float(prob @ r)
    sft_mean = (prob[kept] @ s[kept]) / pr
    cov = prob @ ((r - pr)[:, None] * (s - Es))
    assert torch.allclose(sft_mean, cov / pr, atol=1e-12)


def _enumerated(lin: Linear2, regime: Regime, tau: float = 1.0, **inputs):
    """Exact G (P,), mean bound scalar a² and F (P,) (E Σ_t f_t, also checked as E (Σ_t s_t)²) over all outcomes."""
    ids, prob = lin.outcomes(tau)
    z = lin.logits(ids)
    m = MASK3.expand(len(ids), 3)
    fn = RegimeGrad(regime, ids, m, **{k: v(ids, z) if callable(v) else v for k, v in inputs.items()})
    G = prob @ lin.grads(ids, fn(z))
    a2 = float(prob @ fn.bound_sq)
    F_tok = prob @ lin.token_fisher(ids, tau)
    seq = lin.grads(ids, score_logit_grad(z, ids, m, temperature=tau))
    assert torch.allclose(prob @ seq**2, F_tok, rtol=1e-6), "E[s_t | prefix] = 0 ⇒ F = E Σ_t f_t"
    return G, a2, F_tok


def _teacher_tables(seed: int, Vv: int):
    gen = torch.Generator().manual_seed(seed)
    z1 = torch.randn(Vv, generator=gen, dtype=torch.float64)
    z2 = torch.randn(Vv, Vv, generator=gen, dtype=torch.float64)

    def logits(ids, z):
        out = torch.zeros_like(z)
        out[:, 0], out[:, 1] = z1, z2[ids[:, 1]]
        return out

    return logits


def test_bounds_hold_on_random_data_by_exact_enumeration():
    Vv = 5
    for seed in range(4):
        lin = Linear2(V=Vv, P=6, seed=10 + seed)
        gen = torch.Generator().manual_seed(seed)
        table = torch.randn(Vv, Vv, 3, generator=gen, dtype=torch.float64)  # A_t(y_1, y_2), any function
        b1 = float(torch.randn(1, generator=gen))
        b2 = torch.randn(Vv, generator=gen, dtype=torch.float64)  # b_2(y_1): prefix-only
        tau = 0.7

        def adv(ids, z, table=table):
            return table[ids[:, 1], ids[:, 2]] * MASK3

        def base(ids, z, b1=b1, b2=b2):
            out = torch.zeros(len(ids), 3, dtype=torch.float64)
            out[:, 1], out[:, 2] = b1, b2[ids[:, 1]]
            return out

        teacher = _teacher_tables(20 + seed, Vv)
        mu = lambda ids, z, t=teacher: torch.softmax(t(ids, z), -1)  # noqa: E731
        cases = [
            (Regime("rl_token", temperature=tau), {"advantages": adv, "baseline": base}),
            (Regime("rl", temperature=tau), {"advantages": torch.randn(Vv * Vv, generator=gen, dtype=torch.float64)}),
            (Regime("distill_sampled", temperature=tau, baseline=True), {"teacher_logits": teacher}),
            (Regime("distill_reverse_kl", temperature=tau), {"teacher_logits": teacher}),
            (Regime("distill_forward_kl", temperature=tau), {"teacher_logits": teacher}),
            (Regime("sft_drift", temperature=tau), {"mu": mu}),
        ]
        for regime, inputs in cases:
            G, a2, Fi = _enumerated(lin, regime, tau, **inputs)
            ratio = G.abs() / (a2**0.5 * Fi.sqrt())
            assert float(ratio.max()) <= 1 + 1e-9, (regime.kind, ratio)
            assert float(ratio.max()) > 1e-3, (regime.kind, ratio)  # not vacuous


def test_nearly_tight_bounds_reject_a_smaller_constant():
    """Cases where Cauchy–Schwarz is an equality for coordinate i: the ratio |G_i|/(a·√F_i) is 1, so any
    bound constant smaller than the right one (e.g. a mean over positions instead of the sum) fails."""
    Vv, i = 5, 2
    lin = Linear2(V=Vv, P=4, seed=30)
    tau = 0.9

    def score_i(ids, z):  # A_t = the token score's coordinate i: G_i = E Σ s_{t,i}² = a² = F_i
        Jall = lin.jac(ids)[:, :2, :, i]  # (N, 2, V)
        p = torch.softmax(z[:, :2] / tau, -1)
        s = (Jall.gather(-1, ids[:, 1:, None])[..., 0] - (p * Jall).sum(-1)) / tau
        return F.pad(s, (1, 0))

    def tilted(ids, z, c=0.7):  # ℓ = log p − log q = c·J_{·,i} + const: Cov_p(ℓ, J_i) = std(ℓ)·std(J_i)
        return torch.log_softmax(z / tau, -1) - c * lin.jac(ids)[..., i]

    Jc = lin.jac(lin.outcomes()[0])[:, :2, :, i]
    eps = 0.5 / float(Jc.abs().max()) / 2

    def ratio_q(ids, z):  # q/p − 1 = ε (J_i − E_p J_i): Cov_p(q/p, J_i) = √χ² · std(J_i)
        p = torch.softmax(z / tau, -1)
        Ji = lin.jac(ids)[..., i]
        return p * (1 + eps * (Ji - (p * Ji).sum(-1, keepdim=True)))

    cases = [
        (Regime("rl_token", temperature=tau), {"advantages": score_i}),
        (Regime("distill_reverse_kl", temperature=tau), {"teacher_logits": tilted}),
        (Regime("distill_forward_kl", temperature=tau), {"teacher_logits": lambda ids, z: torch.log(ratio_q(ids, z))}),
        (Regime("sft_drift", temperature=tau), {"mu": ratio_q}),
    ]
    for regime, inputs in cases:
        G, a2, Fi = _enumerated(lin, regime, tau, **inputs)
        r = float(G[i].abs() / (a2**0.5 * Fi[i].sqrt()))
        assert 0.999 < r <= 1 + 1e-9, (regime.kind, r)
        # the bound with a per-position mean (a²/T, T = 2) instead of the sum is violated here
        assert r * 2**0.5 > 1.4, regime.kind


# --- an independent numpy float64 computation of G on a tiny bigram model ---


class Bigram(nn.Module):
    """z_t = W tanh(E[y_t]): logits depend on the current token only."""

    def __init__(self, V: int, H: int, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(V, H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None, use_cache=False):
        class Out:
            pass

        out = Out()
        out.logits = self.head(torch.tanh(self.embed(input_ids)))
        return out


def _np_softmax(x):
    x = x - x.max(-1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(-1, keepdims=True)


def test_independent_numpy_G_for_every_regime():
    Vv, H, tau, tq_tau = 7, 5, 0.9, 1.2
    model = Bigram(Vv, H, seed=0).double().eval()
    E = model.embed.weight.detach().numpy().copy()
    W = model.head.weight.detach().numpy().copy()
    rng = np.random.default_rng(0)
    B, L = 5, 6
    ids = rng.integers(0, Vv, (B, L))
    mask = (rng.random((B, L)) > 0.25).astype(float)
    mask[:, 0] = 0
    mask[:, :2] = 0  # a prompt of two tokens
    QT = rng.normal(size=(Vv, Vv)) * 1.5  # teacher logits table: next-token logits given the current token
    RT = rng.normal(size=(Vv, Vv))  # reference logits table
    MT = _np_softmax(rng.normal(size=(Vv, Vv)))  # sft data distribution table
    a_seq = rng.normal(size=B)
    a_tok = rng.normal(size=(B, L)) * mask
    base = rng.normal(size=(B, L)) * mask
    beta = 0.4

    # numpy: logits, the cotangent c_t of each regime from its formula, then dW = Σ c hᵀ, dE[y] += Wᵀc ⊙ (1 − h²)
    h = np.tanh(E[ids])  # (B, L, H)
    z = h @ W.T  # (B, L, V)
    p = _np_softmax(z / tau)
    q = _np_softmax(QT[ids] / tq_tau)
    mu = MT[ids]
    pref = _np_softmax(RT[ids] / tau)
    y_next = np.zeros((B, L), dtype=int)
    y_next[:, :-1] = ids[:, 1:]
    w_next = np.zeros((B, L))
    w_next[:, :-1] = mask[:, 1:]
    onehot = np.eye(Vv)[y_next]
    take = lambda a: np.take_along_axis(a, y_next[..., None], -1)[..., 0]  # noqa: E731
    a_next = np.zeros((B, L))
    a_next[:, :-1] = a_tok[:, 1:]
    b_next = np.zeros((B, L))
    b_next[:, :-1] = base[:, 1:]
    kpen = -beta * (np.log(take(p)) - np.log(take(pref)))
    ntok = mask.sum(1, keepdims=True)
    kl_rev = (p * (np.log(p) - np.log(q))).sum(-1)
    cot = {
        "rl": a_seq[:, None, None] * (onehot - p),
        "rl_token": (((a_next + kpen) / ntok) - b_next)[..., None] * (onehot - p),
        "distill_sampled": (np.log(take(q)) - np.log(take(p)) + kl_rev)[..., None] * (onehot - p),
        "distill_reverse_kl": -p * (np.log(p) - np.log(q) - kl_rev[..., None]),
        "distill_forward_kl": q - p,
        "sft_drift": mu - p,
        "sft_sampled": onehot - p,
    }
    G_np = {}
    for k, c in cot.items():
        c = c * (w_next / tau)[..., None]
        dW = np.einsum("blv,blh->vh", c, h) / B
        dE = np.zeros_like(E)
        np.add.at(dE, ids.reshape(-1), ((c @ W) * (1 - h**2)).reshape(-1, H) / B)
        G_np[k] = np.concatenate([dE.ravel(), dW.ravel()])

    t = torch.from_numpy
    tids, tmask = t(ids), t(mask)
    teacher = t(QT[ids])
    inputs = {
        "rl": (Regime("rl", temperature=tau), {"advantages": t(a_seq)}),
        "rl_token": (
            Regime("rl_token", temperature=tau, kl_beta=beta, length_norm="response_length"),
            {"advantages": t(a_tok), "baseline": t(base), "ref_logits": t(RT[ids])},
        ),
        "distill_sampled": (
            Regime("distill_sampled", temperature=tau, teacher_temperature=tq_tau, baseline=True),
            {"teacher_logits": teacher},
        ),
        "distill_reverse_kl": (
            Regime("distill_reverse_kl", temperature=tau, teacher_temperature=tq_tau),
            {"teacher_logits": teacher},
        ),
        "distill_forward_kl": (
            Regime("distill_forward_kl", temperature=tau, teacher_temperature=tq_tau),
            {"teacher_logits": teacher},
        ),
        "sft_drift": (Regime("sft_drift", temperature=tau), {"mu": t(mu)}),
        "sft_sampled": (Regime("sft_sampled", temperature=tau), {}),
    }
    layout = select_parameters(model)
    assert layout.names == ["embed.weight", "head.weight"]
    psg = PerSampleGrads(model, layout, check=True)
    pos = torch.arange(L).expand(B, L)
    for k, (regime, kw) in inputs.items():
        fn = RegimeGrad(regime, tids, tmask, **kw)
        G = psg(tids, torch.ones(B, L, dtype=torch.long), fn, position_ids=pos).double().mean(0).numpy()
        rel = np.linalg.norm(G - G_np[k]) / np.linalg.norm(G_np[k])
        assert rel < 1e-6, (k, rel)
        # and the bound scalars from numpy
        if k in ("rl_token", "distill_sampled"):
            A = ((a_next + kpen) / ntok) - b_next if k == "rl_token" else np.log(take(q)) - np.log(take(p)) + kl_rev
            np.testing.assert_allclose(fn.bound_sq.numpy(), ((A * w_next) ** 2).sum(1), rtol=1e-10)
        if k == "distill_reverse_kl":
            ell = np.log(p) - np.log(q)
            var = (p * (ell - kl_rev[..., None]) ** 2).sum(-1)
            np.testing.assert_allclose(fn.bound_sq.numpy(), (w_next**2 * var).sum(1), rtol=1e-10)
        if k in ("distill_forward_kl", "sft_drift"):
            d = q if k == "distill_forward_kl" else mu
            np.testing.assert_allclose(fn.bound_sq.numpy(), (w_next**2 * ((d**2 / p).sum(-1) - 1)).sum(1), rtol=1e-8)


def test_regimes_refuse_missing_inputs_and_bad_options():
    ids = torch.zeros(2, 4, dtype=torch.long)
    m = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1.0]])
    with pytest.raises(ValueError, match="needs advantages"):
        RegimeGrad(Regime("rl"), ids, m)
    with pytest.raises(ValueError, match="needs teacher_logits"):
        RegimeGrad(Regime("distill_reverse_kl"), ids, m)
    with pytest.raises(ValueError, match="needs ref_logits"):
        RegimeGrad(Regime("rl_token", kl_beta=0.1), ids, m)
    with pytest.raises(ValueError, match="baseline needs teacher_logits"):
        RegimeGrad(Regime("distill_sampled", baseline=True), ids, m, teacher_logprobs=torch.zeros(2, 4))
    with pytest.raises(ValueError, match="not one of"):
        Regime("ppo")
    with pytest.raises(ValueError, match="max_length"):
        Regime("rl_token", length_norm="constant")
    z = torch.randn(2, 4, 5)
    with pytest.raises(ValueError, match="response_mask"):
        reverse_kl_logit_grad(z, z, torch.ones(2, 4))
    with pytest.raises(ValueError, match="probability vectors"):
        drift_logit_grad(z, torch.ones(2, 4, 5), m)
    # bound helpers: shapes and dtype
    assert advantage_sq_sums(torch.ones(2), m).tolist() == [2.0, 3.0]
    assert reverse_kl_var_sums(z, z, m).abs().max() < 1e-10
    assert chi2_sums(z, torch.softmax(z, -1), m).dtype == torch.float64


def test_regime_moments_fold_per_half_like_the_rows():
    model = FAMILIES["gpt2"]()
    layout = select_parameters(model)
    teacher = _teacher(11)
    psg = PerSampleGrads(model, layout, check=True)
    mom = RegimeMoments(layout.P, "cpu", group_comoment=True)
    rows, bounds, halves, groups = [], [], [], []
    for seed, half, group in ((43, [0, 1, 0, 1], [4, 5, 4, 5]), (44, [1, 1, 0, 1], [7, 7, 6, 7])):
        batch = make_batch(seed, **BATCH)
        ids, L = batch["input_ids"], batch["input_ids"].shape[1]
        with torch.no_grad():
            zq = _padded([teacher(input_ids=s[None]).logits[0] for s in batch["seqs"]], L)
        args = (ids, batch["attention_mask"])
        fn = RegimeGrad(Regime("distill_reverse_kl", temperature=TAU), ids, batch["target_mask"], teacher_logits=zq)
        mom.fold(psg, *args, fn, torch.tensor(half), position_ids=batch["position_ids"], group=np.array(group))
        rows.append(psg(*args, fn, position_ids=batch["position_ids"]).double())
        bounds.append(fn.bound_sq)
        halves, groups = halves + half, groups + group
    g, b, h, c = torch.cat(rows), torch.cat(bounds), torch.tensor(halves), np.array(groups)
    assert mom.acc.count.tolist() == [2.0, 2.0]  # prompt groups per half (of 3 and 5 samples)
    for hs in ([0], [1], None):
        sel = torch.ones(len(h), dtype=torch.bool) if hs is None else h == hs[0]
        ref = g[sel].mean(0)
        assert np.linalg.norm(mom.gradient(hs) - ref.numpy()) / float(ref.norm()) < 1e-6, hs
        assert mom.bound_a2(hs) == pytest.approx(float(b[sel].mean()), rel=1e-12)
        ids = np.unique(c[sel.numpy()])  # the prompt-clustered standard error, from the groups' sums
        resid = sum((g[sel][torch.from_numpy(c[sel.numpy()] == k)] - ref).sum(0) ** 2 for k in ids)
        se = torch.sqrt(len(ids) / (len(ids) - 1) * resid) / int(sel.sum())
        err = np.abs(mom.standard_error(hs) - se.numpy()).max() / float(se.max())
        assert err < 1e-5, (hs, err)
    assert RegimeMoments(layout.P, "cpu").bound_a2() is None


def test_sft_on_mu_prefixes_drift_is_the_sampled_mean_and_bounded_by_token_fisher_at_mu():
    """Responses from an autoregressive μ (not the policy): E_μ[Σ_t s_t] = E_μ Σ_t J_tᵀ(μ_t − p_t)/τ, and
    |G_i| ≤ √(E_μ Σ χ²(μ_t‖p_t))·√(E_μ Σ_t f_{t,i}); the score's second moment on μ's samples is not that
    Fisher (its cross-position terms do not vanish off-policy)."""
    Vv, tau = 5, 0.8
    lin = Linear2(V=Vv, P=6, seed=50)
    ids, _ = lin.outcomes()
    z = lin.logits(ids)
    mu_logits = _teacher_tables(51, Vv)(ids, z) * 2
    mu = torch.softmax(mu_logits, -1)  # (N, 3, V): μ_1, μ_2(y_1)
    prob_mu = mu[:, 0].gather(-1, ids[:, 1:2])[:, 0] * mu[:, 1].gather(-1, ids[:, 2:3])[:, 0]
    assert abs(float(prob_mu.sum()) - 1) < 1e-12
    m = MASK3.expand(len(ids), 3)
    drift = RegimeGrad(Regime("sft_drift", temperature=tau), ids, m, mu=mu)
    G = prob_mu @ lin.grads(ids, drift(z))
    sampled = prob_mu @ lin.grads(ids, RegimeGrad(Regime("sft_sampled", temperature=tau), ids, m)(z))
    assert float((sampled - G).norm() / G.norm()) < 1e-6
    a2 = float(prob_mu @ drift.bound_sq)
    F_mu = prob_mu @ lin.token_fisher(ids, tau)
    assert float((G.abs() / (a2**0.5 * F_mu.sqrt())).max()) <= 1 + 1e-9
    seq = lin.grads(ids, score_logit_grad(z, ids, m, temperature=tau))
    assert float(((prob_mu @ seq**2) - F_mu).abs().max() / F_mu.max()) > 1e-2


def test_near_policy_chi2_masked_vocabulary_and_low_precision_logits():
    gen = torch.Generator().manual_seed(6)
    B, L, Vv = 2, 5, 4000
    z = torch.randn(B, L, Vv, generator=gen) * 3
    m = torch.zeros(B, L)
    m[:, 2:] = 1
    # near policy: χ² ~ 1e-9 from float32 inputs, kept to 1e-2 relative (their rounding limits it);
    # Σ q²/p − 1 in float32 cancels to noise
    p64 = torch.softmax(z.double(), -1)
    u = torch.randn(B, L, Vv, generator=gen, dtype=torch.float64)
    u -= (p64 * u).sum(-1, keepdim=True)
    q = p64 * (1 + 1e-4 * u / u.abs().amax(-1, keepdim=True))
    chi2_ref = ((q - p64) ** 2 / p64).sum(-1)[:, :-1] * m[:, 1:]
    got = chi2_sums(z, q.float(), m)
    assert float(((got - chi2_ref.sum(1)) / chi2_ref.sum(1)).abs().max()) < 1e-2, (got, chi2_ref.sum(1))
    pf, qf = torch.softmax(z, -1), q.float()
    naive = ((qf * qf / pf).sum(-1) - 1)[:, :-1] * m[:, 1:]
    assert float(((naive.sum(1).double() - chi2_ref.sum(1)) / chi2_ref.sum(1)).abs().max()) > 0.5
    # −inf logits (a masked vocabulary) in the policy: those tokens contribute nothing
    zm = z.clone()
    zm[..., :100] = float("-inf")
    zq = torch.randn(B, L, Vv, generator=gen)
    c = reverse_kl_logit_grad(zm, zq, m)
    assert bool(torch.isfinite(c).all()) and float(c[..., :100].abs().max()) == 0
    ref = reverse_kl_logit_grad(zm[..., 100:], zq[..., 100:] - torch.logsumexp(zq, -1, keepdim=True), m)
    assert float((c[..., 100:] - ref).abs().max()) < 1e-6
    zq_bad = zq.clone()
    zq_bad[..., 200] = float("-inf")
    with pytest.raises(ValueError, match="infinite"):
        reverse_kl_logit_grad(zm, zq_bad, m)
    # bf16 logits: float32 cotangents, equal to those of the float32 copy
    zb = z.bfloat16()
    for fn in (lambda x: reverse_kl_logit_grad(x, zq, m), lambda x: drift_logit_grad(x, q.float(), m)):
        a, b = fn(zb), fn(zb.float())
        assert a.dtype == torch.float32 and torch.equal(a, b)
