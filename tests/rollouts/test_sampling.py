"""Sampler distribution, generation, recomputation, top-k reconstruction and advantages.

Every fast path is compared with a slow reference: numpy float64 argsort truncation, a per-sample
generation loop without KV cache, a per-group python loop for advantages, a per-position loop for
the top-k tail rule.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

from covgrad.rollouts.sampling import (
    SamplerSpec,
    check_rewards,
    compute_advantages,
    draw_tokens,
    generate,
    mu_from_topk,
    recompute_sampler_logp,
    sample_uniforms,
    sampler_log_probs,
)
from tests.helpers.models import tiny_llama

V = 16
EOS, PAD = 0, 15
PROMPTS = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [3, 3]]
PROMPT_IDS = [101, 7, 55, 12]
G = 3
SPECS = {
    "T1": SamplerSpec(temperature=1.0, top_p=1.0, max_new_tokens=8),
    "T0.7-p0.9": SamplerSpec(temperature=0.7, top_p=0.9, max_new_tokens=8),
    "T1.3-k4": SamplerSpec(temperature=1.3, top_k=4, max_new_tokens=8),
}


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.set_num_threads(1)
    return tiny_llama(V, initializer_range=0.5)  # peaked next-token distributions, so truncation matters


def _run(model, spec, seed=1, batch_size=8, **kw):
    return generate(model, PROMPTS, PROMPT_IDS, G, spec, seed, batch_size, EOS, PAD, **kw)


# --- sampler distribution -------------------------------------------------------------------------


def _reference_log_mu(logits: np.ndarray, temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """Row-by-row numpy float64: stable argsort, keep top-k, then grow the nucleus until mass >= top_p."""
    z = logits.astype(np.float64) / temperature
    out = np.full(z.shape, -np.inf)
    for r in range(z.shape[0]):
        order = np.argsort(-z[r], kind="stable")
        kept = order[:top_k] if 0 < top_k < z.shape[1] else order
        if top_p < 1:
            p = np.exp(z[r, kept] - z[r, kept].max())
            p /= p.sum()
            mass, n = 0.0, 0
            while mass < top_p and n < len(kept):
                mass += p[n]
                n += 1
            kept = kept[:n]
        zk = z[r, kept]
        out[r, kept] = zk - (zk.max() + np.log(np.exp(zk - zk.max()).sum()))
    return out


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"),
    [
        (1.0, 1.0, 0),
        (0.7, 0.9, 0),
        (1.3, 1.0, 4),
        (0.5, 0.5, 3),
        (1.0, 0.3, 0),
        (2.0, 0.95, 40),
        (1.0, 1.0, 1),
    ],
)
def test_sampler_log_probs_matches_numpy_reference(temperature, top_p, top_k):
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 2, size=(64, 24))
    logits[:32] = np.round(logits[:32])  # many exact ties
    got = sampler_log_probs(torch.tensor(logits, dtype=torch.float32), SamplerSpec(temperature, top_p, top_k))
    ref = _reference_log_mu(logits.astype(np.float32), temperature, top_p, top_k)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(np.isinf(got.numpy()), np.isinf(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(got.numpy()[finite], ref[finite], atol=2e-6, rtol=0)


def test_sampler_log_probs_ties_go_to_lowest_id():
    flat = torch.zeros(6)
    kept_k = torch.isfinite(sampler_log_probs(flat, SamplerSpec(top_k=2)))
    assert kept_k.tolist() == [True, True, False, False, False, False]
    kept_p = torch.isfinite(sampler_log_probs(torch.zeros(4), SamplerSpec(top_p=0.5)))
    assert kept_p.tolist() == [True, True, False, False]  # 0.25 + 0.25 reaches 0.5 exactly
    top1 = sampler_log_probs(torch.tensor([0.0, 5.0, 1.0]), SamplerSpec(top_p=1e-9))
    assert top1.tolist() == [-math.inf, 0.0, -math.inf]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
    ],
)
def test_sampler_spec_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplerSpec(**kwargs)


def test_draw_tokens_is_the_inverse_cdf():
    rng = np.random.default_rng(3)
    logits = torch.tensor(rng.normal(0, 2, size=(200, 10)))
    log_mu = sampler_log_probs(logits, SamplerSpec(top_p=0.8))
    u = torch.tensor(rng.uniform(size=200))
    got = draw_tokens(log_mu, u).numpy()
    mu = np.exp(log_mu.numpy().astype(np.float64))
    for r in range(200):
        cdf = np.cumsum(mu[r])
        assert got[r] == int(np.argmax(cdf > u[r].item() * cdf[-1]))
    assert np.isfinite(log_mu.numpy()[np.arange(200), got]).all()


def test_sample_uniforms_depend_only_on_their_key():
    base = sample_uniforms(1, 7, 2, 8)
    assert base.dtype == torch.float64 and base.shape == (8,)
    assert torch.equal(base, sample_uniforms(1, 7, 2, 8))
    for other in [(2, 7, 2), (1, 8, 2), (1, 7, 3)]:
        assert not torch.equal(base, sample_uniforms(*other, 8))


# --- generation -----------------------------------------------------------------------------------


def test_generate_shapes_and_layout(model):
    spec = SPECS["T0.7-p0.9"]
    out = _run(model, spec)
    N, T = len(PROMPTS) * G, spec.max_new_tokens
    assert out["tokens"].dtype == torch.int32 and out["tokens"].shape[0] == N
    assert out["sampler_logp"].shape == (N, T) and out["sampler_logp"].dtype == torch.float32
    assert out["prompt_index"].tolist() == [p for p in range(len(PROMPTS)) for _ in range(G)]
    assert out["sample_index"].tolist() == list(range(G)) * len(PROMPTS)
    L = out["tokens"].shape[1]
    assert int((out["prompt_len"] + out["response_len"]).max()) == L
    for n in range(N):
        lp, lr = int(out["prompt_len"][n]), int(out["response_len"][n])
        assert out["tokens"][n, :lp].tolist() == PROMPTS[n // G]
        resp = out["tokens"][n, lp : lp + lr].tolist()
        assert 1 <= lr <= T and (resp[-1] == EOS or lr == T) and EOS not in resp[:-1]
        assert (out["tokens"][n, lp + lr :] == PAD).all()
        assert out["response_mask"][n].tolist() == [lp <= i < lp + lr for i in range(L)]
        assert (out["sampler_logp"][n, :lr] <= 0).all() and (out["sampler_logp"][n, lr:] == 0).all()
    assert out["response_len"].min() < T and out["response_len"].max() == T  # both stop rules occur


def test_same_seed_same_rollouts_for_any_batch_size(model):
    spec = SPECS["T1.3-k4"]
    a = _run(model, spec, batch_size=3, mu_mode="topk", mu_topk=5)
    b = _run(model, spec, batch_size=8, mu_mode="topk", mu_topk=5)
    assert a.keys() == b.keys()
    for key in ("tokens", "prompt_len", "response_len", "response_mask", "prompt_index", "sample_index"):
        assert torch.equal(a[key], b[key]), key
    assert torch.equal(a["mu_topk_ids"], b["mu_topk_ids"])
    # logits differ in the last bits between batch shapes (padding, matmul blocking)
    torch.testing.assert_close(a["sampler_logp"], b["sampler_logp"], atol=1e-5, rtol=0)
    torch.testing.assert_close(a["mu_topk_logp"], b["mu_topk_logp"], atol=1e-5, rtol=0)
    torch.testing.assert_close(a["mu_tail"], b["mu_tail"], atol=1e-5, rtol=0)


def test_different_seed_different_rollouts(model):
    spec = SPECS["T1"]
    assert not torch.equal(_run(model, spec, seed=1)["tokens"], _run(model, spec, seed=2)["tokens"])


@pytest.mark.parametrize("name", ["T0.7-p0.9", "T1.3-k4"])
def test_generate_matches_uncached_one_at_a_time_reference(model, name):
    spec = SPECS[name]
    out = _run(model, spec, batch_size=5)
    T = spec.max_new_tokens
    for n in range(len(PROMPTS) * G):
        p, g = divmod(n, G)
        u = sample_uniforms(1, PROMPT_IDS[p], g, T).numpy()
        row, logps = list(PROMPTS[p]), []
        for j in range(T):
            with torch.no_grad():
                logits = model(torch.tensor([row])).logits[0, -1]
            log_mu = sampler_log_probs(logits, spec).numpy()
            cdf = np.cumsum(np.exp(log_mu.astype(np.float64)))
            y = int(np.argmax(cdf > u[j] * cdf[-1]))
            row.append(y)
            logps.append(log_mu[y])
            if y == EOS:
                break
        lp, lr = int(out["prompt_len"][n]), int(out["response_len"][n])
        assert out["tokens"][n, : lp + lr].tolist() == row
        np.testing.assert_allclose(out["sampler_logp"][n, :lr].numpy(), logps, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(SPECS))
def test_recompute_matches_stored_sampler_logp(model, name):
    spec = SPECS[name]
    out = _run(model, spec, batch_size=4, mu_mode="full")
    re = recompute_sampler_logp(model, out["tokens"], out["prompt_len"], out["response_len"], spec)
    N, L = out["tokens"].shape
    assert re.shape == (N, L, V) and re.dtype == torch.float32
    for n in range(N):
        lp, lr = int(out["prompt_len"][n]), int(out["response_len"][n])
        pos = torch.arange(lp - 1, lp + lr - 1)
        drawn = out["tokens"][n, lp : lp + lr].long()
        torch.testing.assert_close(re[n, pos, drawn], out["sampler_logp"][n, :lr], atol=1e-5, rtol=0)
        # full μ: same kept support and values at every response position
        assert torch.equal(torch.isinf(re[n, pos]), torch.isinf(out["mu_logp"][n, :lr]))
        finite = torch.isfinite(re[n, pos])
        torch.testing.assert_close(re[n, pos][finite], out["mu_logp"][n, :lr][finite], atol=1e-5, rtol=0)
        assert (out["mu_logp"][n, lr:] == 0).all() and (re[n, lp + lr :] == 0).all()


def test_topk_record_agrees_with_full_mu(model):
    spec = SPECS["T0.7-p0.9"]
    full = _run(model, spec, mu_mode="full")
    top = _run(model, spec, mu_mode="topk", mu_topk=3)
    assert torch.equal(full["tokens"], top["tokens"])
    for n in range(full["tokens"].shape[0]):
        for j in range(int(full["response_len"][n])):
            lm = full["mu_logp"][n, j].double().numpy()
            order = np.argsort(-lm, kind="stable")[:3]
            assert top["mu_topk_ids"][n, j].tolist() == order.tolist()
            np.testing.assert_array_equal(top["mu_topk_logp"][n, j].numpy(), lm[order].astype(np.float32))
            tail = max(0.0, 1.0 - np.exp(lm[order]).sum())
            assert top["mu_tail"][n, j].item() == pytest.approx(tail, abs=1e-6)


def test_generate_progress_eval_mode_and_bad_input(model):
    calls: list[int] = []
    model.train()
    _run(model, SPECS["T1"], batch_size=5, progress=calls.append)
    assert model.training
    model.eval()
    assert calls == [5, 5, 2]
    with pytest.raises(ValueError, match="prompt_ids\\[1\\] = 101"):
        generate(model, PROMPTS[:2], [101, 101], G, SPECS["T1"], 1, 4, EOS, PAD)
    with pytest.raises(ValueError, match="prompt 1 has token id 16"):
        generate(model, [[1], [16]], [1, 2], G, SPECS["T1"], 1, 4, EOS, PAD)
    with pytest.raises(ValueError, match="mu_topk"):
        _run(model, SPECS["T1"], mu_mode="topk", mu_topk=V + 1)
    with pytest.raises(ValueError, match="mu_mode"):
        _run(model, SPECS["T1"], mu_mode="dense")


# --- top-k reconstruction -------------------------------------------------------------------------


def test_mu_from_topk_matches_per_position_tail_rule():
    rng = np.random.default_rng(11)
    B, k = 30, 4
    true_log_mu = sampler_log_probs(torch.tensor(rng.normal(0, 2, size=(B, V))), SamplerSpec(top_k=9))
    policy = torch.softmax(torch.tensor(rng.normal(0, 1, size=(B, V))), dim=-1)
    vals, ids = torch.sort(true_log_mu, dim=-1, descending=True, stable=True)
    ids, vals = ids[:, :k], vals[:, :k]
    tail = (1 - vals.double().exp().sum(-1)).clamp_min(0).float()
    got = mu_from_topk(ids, vals, tail, policy)
    true_mu = true_log_mu.double().exp().numpy()
    for b in range(B):
        ref = np.zeros(V)
        others = [v for v in range(V) if v not in ids[b].tolist()]
        ref[ids[b].numpy()] = np.exp(vals[b].numpy().astype(np.float64))
        p_other = policy[b, others].double().numpy()
        ref[others] = tail[b].item() * p_other / p_other.sum()
        ref /= ref.sum()
        np.testing.assert_allclose(got[b].numpy(), ref, atol=1e-12)
        # documented bound: total variation to the true μ is at most the tail mass
        assert 0.5 * np.abs(got[b].numpy() - true_mu[b]).sum() <= tail[b].item() + 1e-6
    torch.testing.assert_close(got.sum(-1), torch.ones(B, dtype=torch.float64))


def test_mu_from_topk_is_exact_when_k_is_the_vocabulary(model):
    spec = SPECS["T0.7-p0.9"]
    full = _run(model, spec, mu_mode="full")
    top = _run(model, spec, mu_mode="topk", mu_topk=V)
    policy = torch.full((V,), 1.0 / V).expand(*top["mu_tail"].shape, V)
    mu = mu_from_topk(top["mu_topk_ids"], top["mu_topk_logp"], top["mu_tail"], policy)
    live = torch.arange(spec.max_new_tokens)[None, :] < full["response_len"][:, None]
    torch.testing.assert_close(mu[live], full["mu_logp"][live].double().exp(), atol=1e-6, rtol=0)
    torch.testing.assert_close(mu.sum(-1), torch.ones_like(mu[..., 0]))


def test_mu_from_topk_rejects_bad_shapes_and_ids():
    policy = torch.full((2, V), 1.0 / V)
    ids, lp, tail = torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), torch.zeros(2)
    with pytest.raises(ValueError, match="tail must have shape"):
        mu_from_topk(ids, lp, torch.zeros(3), policy)
    with pytest.raises(ValueError, match="found 16"):
        mu_from_topk(ids.fill_(V), lp, tail, policy)


# --- advantages -----------------------------------------------------------------------------------


def _reference_advantages(r: np.ndarray, group: np.ndarray, kind: str, eps: float) -> np.ndarray:
    out = np.empty_like(r)
    for g in set(group.tolist()):
        idx = [i for i in range(len(r)) if group[i] == g]
        vals = [r[i] for i in idx]
        mean = sum(vals) / len(vals)
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0  # TRL's
        for i in idx:
            if kind == "group_mean":
                out[i] = r[i] - mean
            elif len(set(vals)) == 1:
                out[i] = 0.0
            else:
                out[i] = (r[i] - mean) / (std + eps)
    return out


@pytest.mark.parametrize("kind", ["group_mean", "group_zscore"])
def test_group_advantages_match_loop_and_centre_each_group(kind):
    rng = np.random.default_rng(5)
    group = rng.choice([3, -1, 40, 7], size=50)
    r = rng.normal(100.0, 3.0, size=50)
    r[group == 7] = 0.1  # constant group: zscore must give 0, not NaN or noise / eps
    got = compute_advantages(r, group, kind)
    np.testing.assert_allclose(got, _reference_advantages(r, group, kind, 1e-4), atol=1e-9)
    for g in np.unique(group):
        assert abs(got[group == g].sum()) < 1e-10
    if kind == "group_zscore":
        assert (got[group == 7] == 0).all()


def test_global_and_no_advantages():
    r = np.array([1.0, 2.0, 6.0])
    g = np.zeros(3, dtype=int)
    np.testing.assert_array_equal(compute_advantages(r, g, "global_mean"), [-2.0, -1.0, 3.0])
    none = compute_advantages(r, g, "none")
    np.testing.assert_array_equal(none, r)
    assert none is not r


def test_rewards_and_advantage_arguments_are_validated():
    with pytest.raises(ValueError, match=r"reward\[2\] = nan"):
        check_rewards(np.array([0.0, 1.0, np.nan, np.inf]))
    with pytest.raises(ValueError, match=r"reward\[1\] = inf"):
        compute_advantages(np.array([0.0, np.inf]), np.zeros(2, dtype=int), "group_mean")
    with pytest.raises(ValueError, match="advantage kind"):
        compute_advantages(np.zeros(2), np.zeros(2, dtype=int), "ppo")
    with pytest.raises(ValueError, match=r"\(N,\)"):
        compute_advantages(np.zeros(2), np.zeros(3, dtype=int), "none")
