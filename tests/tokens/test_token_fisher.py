"""Token Fisher, token scores and the LM-head closed form against plain per-sample autograd."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from covgrad.layout import select_parameters
from covgrad.scores.engine import PerSampleGrads
from covgrad.tokens.backward import TokenBackward
from covgrad.tokens.fisher import (
    candidate_weights,
    candidates,
    check_exact_budget,
    cross_term_ratio,
    default_mode,
    lm_head_token_fisher,
    response_policy,
    response_positions,
    token_fisher,
    token_score_squares,
    token_scores,
)
from tests.helpers.models import tiny_llama

V = 16
PROMPT_LEN = torch.tensor([2, 1, 3])
RESPONSE_LEN = torch.tensor([3, 4, 2])
L = 7  # one row is fully used, the others are right-padded


def _tiny_llama(tied: bool, seed: int) -> LlamaForCausalLM:
    model = tiny_llama(V, hidden=16, intermediate=32, heads=2, kv_heads=2, max_positions=32, tied=tied, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # RMSNorm weights start at exactly 1; perturb so a wrong rule shows
                p.add_(0.1 * torch.randn_like(p))
            else:  # larger weights give peaked, varied next-token distributions
                p.mul_(4.0)
    return model


def _batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, V, (3, L), generator=gen)
    attention_mask = (torch.arange(L)[None, :] < (PROMPT_LEN + RESPONSE_LEN)[:, None]).long()
    return input_ids.masked_fill(attention_mask == 0, 0), attention_mask


def _flat_grad(out: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(out, params, retain_graph=True)])


def _reference(model: LlamaForCausalLM, layout, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Slow path, one unpadded row at a time: centered sensitivities g (B, T, V, P), p (B, T, V),
    token scores (B, T, P) and sequence scores (B, P), all float64, by plain autograd."""
    named = dict(model.named_parameters())
    params = [named[e.name] for e in layout.entries]
    B, T = len(PROMPT_LEN), int(RESPONSE_LEN.max())
    g = torch.zeros(B, T, V, layout.P, dtype=torch.float64)
    probs = torch.zeros(B, T, V, dtype=torch.float64)
    tok = torch.zeros(B, T, layout.P, dtype=torch.float64)
    seq = torch.zeros(B, layout.P, dtype=torch.float64)
    for n in range(B):
        pl, rl = int(PROMPT_LEN[n]), int(RESPONSE_LEN[n])
        row = input_ids[n : n + 1, : pl + rl]
        logits = model(input_ids=row).logits[0]  # (pl + rl, V)
        for j in range(rl):
            z = logits[pl + j - 1]
            p = torch.softmax(z, -1).detach()
            jac = torch.stack([_flat_grad(z[v], params) for v in range(V)]).double()  # (V, P)
            g[n, j] = jac - p.double() @ jac
            probs[n, j] = p.double()
            tok[n, j] = g[n, j, row[0, pl + j]]
        logp = torch.log_softmax(logits[pl - 1 : pl + rl - 1], -1).gather(1, row[0, pl:, None]).sum()
        seq[n] = _flat_grad(logp, params).double()
    return {"g": g, "p": probs, "tok": tok, "seq": seq}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a.double() - b.double()) / torch.linalg.vector_norm(b.double()))


@pytest.fixture(scope="module", params=[False, True], ids=["llama-untied", "llama-tied"])
def case(request):
    torch.set_num_threads(1)
    model = _tiny_llama(request.param, seed=3)
    layout = select_parameters(model)
    input_ids, attention_mask = _batch(seed=5)
    ref = _reference(model, layout, input_ids)
    exact = token_fisher(model, layout, input_ids, attention_mask, PROMPT_LEN, RESPONSE_LEN, "exact")
    return model, layout, input_ids, attention_mask, ref, exact


def _active() -> torch.Tensor:
    return torch.arange(int(RESPONSE_LEN.max()))[None, :] < RESPONSE_LEN[:, None]


def test_exact_matches_per_vocab_autograd(case):
    _, _, input_ids, _, ref, exact = case
    f = (ref["p"][..., None] * ref["g"].square()).sum(2)  # (B, T, P)
    assert _rel(exact["fisher_sum"], f.sum((0, 1))) < 1e-5
    active = _active()
    torch.testing.assert_close(exact["trace"][active], f.sum(-1)[active], rtol=1e-5, atol=0)
    assert (exact["trace"][~active] == 0).all()
    torch.testing.assert_close(exact["fisher_sum"].sum(), exact["trace"].sum(), rtol=1e-6, atol=0)

    p = ref["p"][active]  # (tokens, V)
    index = PROMPT_LEN[:, None] + torch.arange(active.shape[1])[None, :]  # (B, T) full token index
    drawn = input_ids.gather(1, index.clamp(max=L - 1))[active]
    torch.testing.assert_close(exact["entropy"][active], -(p * p.log()).sum(-1), rtol=1e-5, atol=0)
    torch.testing.assert_close(exact["p_drawn"][active], p.gather(1, drawn[:, None])[:, 0], rtol=1e-5, atol=0)
    assert (exact["covered_mass"][active] == 1).all() and (exact["covered_mass"][~active] == 0).all()
    assert (exact["entropy"][~active] == 0).all() and (exact["p_drawn"][~active] == 0).all()


def test_topk_full_vocab_equals_exact(case):
    model, layout, input_ids, attention_mask, _, exact = case
    top = token_fisher(model, layout, input_ids, attention_mask, PROMPT_LEN, RESPONSE_LEN, "topk", k=V)
    torch.testing.assert_close(top["fisher_sum"], exact["fisher_sum"], rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(top["trace"], exact["trace"], rtol=1e-6, atol=0)
    torch.testing.assert_close(top["covered_mass"], exact["covered_mass"], rtol=1e-12, atol=0)


def test_topk_is_the_renormalised_top_set(case):
    model, layout, input_ids, attention_mask, ref, _ = case
    k = 3
    top = token_fisher(model, layout, input_ids, attention_mask, PROMPT_LEN, RESPONSE_LEN, "topk", k=k)
    order = np.argsort(-ref["p"].numpy(), axis=-1, kind="stable")[..., :k]  # (B, T, k)
    keep = torch.zeros_like(ref["p"]).scatter_(-1, torch.from_numpy(order), 1.0)
    mass = (ref["p"] * keep).sum(-1)  # (B, T)
    active = _active()
    w = torch.where(active[..., None], ref["p"] * keep / mass[..., None], 0.0)
    f = (w[..., None] * ref["g"].square()).sum(2)  # (B, T, P)
    assert _rel(top["fisher_sum"], f.sum((0, 1))) < 1e-5
    torch.testing.assert_close(top["covered_mass"][active], mass[active], rtol=1e-5, atol=0)
    assert (top["covered_mass"][active] < 1 - 1e-3).any()


def test_mc_is_unbiased_and_seeded(case):
    model, layout, input_ids, attention_mask, _, exact = case
    args = (model, layout, input_ids, attention_mask, PROMPT_LEN, RESPONSE_LEN, "mc")
    runs = [token_fisher(*args, k=4, seed=s) for s in range(8)]
    totals = torch.stack([r["trace"] for r in runs])  # (seeds, B, T)
    mean, se = totals.mean(0), totals.std(0) / len(runs) ** 0.5
    active = _active()
    assert (se[active] > 0).any()
    assert ((mean - exact["trace"]).abs() <= 4 * se)[active].all()
    again = token_fisher(*args, k=4, seed=0)
    assert torch.equal(again["fisher_sum"], runs[0]["fisher_sum"])
    assert not torch.equal(runs[1]["fisher_sum"], runs[0]["fisher_sum"])


def test_lm_head_closed_form_matches_exact_slice():
    torch.set_num_threads(1)
    model = _tiny_llama(False, seed=7)
    layout = select_parameters(model, ["lm_head.weight", "model.norm.weight"])
    input_ids, attention_mask = _batch(seed=11)
    exact = token_fisher(model, layout, input_ids, attention_mask, PROMPT_LEN, RESPONSE_LEN, "exact")
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True)
    weights = torch.zeros(3, L)
    for n in range(3):
        weights[n, PROMPT_LEN[n] - 1 : PROMPT_LEN[n] + RESPONSE_LEN[n] - 1] = 1.0
    closed = lm_head_token_fisher(out.hidden_states[-1], torch.softmax(out.logits, -1), weights)
    entry = layout.entry("lm_head.weight")
    sl = exact["fisher_sum"][entry.offset : entry.offset + entry.numel].reshape(entry.shape)
    assert closed.dtype == torch.float64 and closed.shape == entry.shape
    assert _rel(sl, closed) < 1e-5


def test_token_scores_sum_to_sequence_score(case):
    model, layout, input_ids, attention_mask, ref, _ = case
    s = token_scores(model, layout, input_ids, attention_mask, PROMPT_LEN, RESPONSE_LEN)
    assert s.shape == (3, int(RESPONSE_LEN.max()), layout.P) and s.dtype == torch.float32
    assert _rel(s.sum(1), ref["seq"]) < 1e-6
    active = _active()
    assert _rel(s[active], ref["tok"][active]) < 1e-5
    assert (s[~active] == 0).all()


def test_cross_term_ratio_against_numpy(case):
    _, _, _, _, ref, _ = case
    seq, tok_sq = ref["seq"].float(), ref["tok"].square().sum(1).float()  # (N, P) float32 inputs
    got = cross_term_ratio(seq, tok_sq)
    s, t2 = seq.double().numpy(), tok_sq.double().numpy()
    want = np.linalg.norm((s**2 - t2).mean(0)) / np.linalg.norm((s**2).mean(0))
    assert got == pytest.approx(want, rel=1e-9) and got > 1e-3
    one = ref["tok"][:, :1]  # a single position per sample: no cross-terms
    assert cross_term_ratio(one.sum(1), one.square().sum(1)) == pytest.approx(0.0, abs=1e-12)


def test_bad_inputs():
    model = _tiny_llama(False, seed=1)
    layout = select_parameters(model, ["lm_head.weight"])
    input_ids, attention_mask = _batch(seed=2)
    args = (model, layout, input_ids, attention_mask, PROMPT_LEN, RESPONSE_LEN)
    with pytest.raises(ValueError, match="k = 17, V = 16"):
        token_fisher(*args, "topk", k=17)
    with pytest.raises(ValueError, match="k = 0, V = 16"):
        token_fisher(*args, "topk", k=0)
    with pytest.raises(ValueError, match="k = 0"):
        token_fisher(*args, "mc", k=0)
    with pytest.raises(ValueError, match="k = 0"):
        token_fisher(*args, "probe", k=0)
    with pytest.raises(ValueError, match=r"T·V = 4·16 = 64 .* above the exact budget 63; use mode='probe'"):
        token_fisher(*args, "exact", exact_budget=63)
    with pytest.raises(ValueError, match="mode must be"):
        token_fisher(*args, "sampled", k=2)
    with pytest.raises(ValueError, match="exceeds the row length"):
        token_fisher(model, layout, input_ids, attention_mask, PROMPT_LEN, RESPONSE_LEN + 3, "exact")
    with pytest.raises(ValueError, match="prompt_len must be >= 1"):
        token_scores(model, layout, input_ids, attention_mask, PROMPT_LEN - 1, RESPONSE_LEN)
    with pytest.raises(ValueError, match="attention_mask is 0"):
        token_scores(model, layout, input_ids, torch.ones_like(attention_mask).tril(), PROMPT_LEN, RESPONSE_LEN)
    with pytest.raises(ValueError, match="must both have shape"):
        cross_term_ratio(torch.ones(3, 4), torch.ones(3, 5))
    with pytest.raises(ValueError, match="undefined"):
        cross_term_ratio(torch.zeros(3, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="need hidden"):
        lm_head_token_fisher(torch.ones(2, 3, 4), torch.ones(2, 3, 5), torch.ones(2, 4))


def _per_candidate_loop(model, layout, input_ids, attention_mask, mode, k=0, seed=0) -> torch.Tensor:
    """The stage's former path: one PerSampleGrads forward and backward per (position, candidate); Σ f (P,)."""
    psg = PerSampleGrads(model, layout, check=False)
    cols, active, _ = response_positions(input_ids, PROMPT_LEN, RESPONSE_LEN)
    B, T = cols.shape
    rows = torch.arange(B)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
    p = torch.softmax(logits[rows[:, None], cols].double(), -1)
    cand, weight, _ = candidates(p, mode, k, seed, 10**9)
    fisher = torch.zeros(layout.P, dtype=torch.float64)
    for j in range(T):
        for c in range(cand.shape[-1]):

            def onehot(z, j=j, c=c):
                g = -torch.softmax(z[rows, cols[:, j]].float(), -1)
                g[rows, cand[:, j, c]] += 1
                g[~active[:, j]] = 0
                d = torch.zeros_like(z)
                d[rows, cols[:, j]] = g
                return d

            pos = torch.arange(input_ids.shape[1]).expand_as(input_ids)
            sq = psg(input_ids, attention_mask, onehot, position_ids=pos).double().square()
            fisher += (weight[:, j, c] * active[:, j]) @ sq
    return fisher


def _tiny_gpt2() -> GPT2LMHeadModel:
    """GPT-2 (Conv1D, LayerNorm, absolute positions, tied head) with dropout off."""
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0, embd_pdrop=0)
    return GPT2LMHeadModel(cfg).eval()


@pytest.mark.parametrize("arch", ["llama-untied", "llama-tied", "gpt2"])
def test_batched_cotangents_equal_the_per_candidate_loop(arch):
    """One forward + batched cotangent rows (small blocks, so several backward calls) = the former loop."""
    torch.set_num_threads(1)
    model = _tiny_gpt2() if arch == "gpt2" else _tiny_llama(arch == "llama-tied", seed=13)
    layout = select_parameters(model)
    input_ids, attention_mask = _batch(seed=17)
    args = (model, layout, input_ids, attention_mask, PROMPT_LEN, RESPONSE_LEN)
    for mode, k in (("exact", 0), ("mc", 3)):
        new = token_fisher(*args, mode, k=k, seed=4, row_bytes=1)  # one cotangent row per backward
        old = _per_candidate_loop(model, layout, input_ids, attention_mask, mode, k=k, seed=4)
        assert _rel(new["fisher_sum"], old) < 1e-6, mode
        assert _rel(token_fisher(*args, mode, k=k, seed=4)["fisher_sum"], old) < 1e-6, mode


@pytest.mark.parametrize("arch", ["llama-untied", "llama-tied", "gpt2"])
def test_add_grads_in_place_equals_grads(arch):
    """out += grads(cot) in place (rows r·B + n; tied tensors summed; the head from the backward) equals
    the per-entry blocks of ``grads``, for one and for two cotangent rows."""
    model = _tiny_gpt2() if arch == "gpt2" else _tiny_llama(arch == "llama-tied", seed=13)
    layout = select_parameters(model)
    input_ids, attention_mask = _batch(seed=17)
    pos = torch.arange(L).expand(3, L)
    eng = TokenBackward(model, layout, input_ids, attention_mask, pos)
    gen = torch.Generator().manual_seed(2)
    for R in (1, 2):
        cot = torch.randn(R, *eng.logits.shape, generator=gen)
        base = torch.randn(R * 3, layout.P, generator=gen)
        out = eng.add_grads_(base.clone(), cot)
        want = base + eng.grads(cot).reshape(R * 3, layout.P)
        assert _rel(out.double(), want.double()) < 1e-6, R
    with pytest.raises(ValueError, match="float32"):
        eng.add_grads_(torch.zeros(2, layout.P), cot)


@pytest.mark.parametrize("arch", ["llama-untied", "llama-tied", "gpt2"])
@pytest.mark.parametrize("chunk", [5, 1 << 22])
def test_square_sums_stream_equals_squared_grads(arch, chunk, monkeypatch):
    """square_sums_ (one tensor's block at a time, column chunks of ``chunk`` elements, tied tensors summed
    before squaring) against the float64 weighted squares of ``grads``, for one and for three rows."""
    monkeypatch.setattr("covgrad.tokens.backward.SQUARE_CHUNK", chunk)
    model = _tiny_gpt2() if arch == "gpt2" else _tiny_llama(arch == "llama-tied", seed=19)
    layout = select_parameters(model)
    input_ids, attention_mask = _batch(seed=23)
    eng = TokenBackward(model, layout, input_ids, attention_mask, torch.arange(L).expand(3, L))
    gen = torch.Generator().manual_seed(5)
    for R in (1, 3):
        cot = torch.randn(R, *eng.logits.shape, generator=gen)
        w = torch.rand(R, 3, 2, generator=gen, dtype=torch.float64)
        base = torch.randn(2, layout.P, generator=gen, dtype=torch.float64)
        fisher = base.clone()
        norms = eng.square_sums_(cot, w, fisher)
        g2 = eng.grads(cot).double().square()  # (R, B, P)
        assert _rel(fisher - base, torch.einsum("rbi,rbp->ip", w, g2)) < 1e-6, R
        assert _rel(norms, g2.sum(-1)) < 1e-6, R


def _tensor_sums(layout, x: torch.Tensor) -> torch.Tensor:
    """(..., P) -> (..., tensors): the sum over each tensor's elements."""
    return torch.stack([x[..., e.offset : e.offset + e.numel].sum(-1) for e in layout.entries], -1)


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_probe_is_unbiased_on_every_tensor(tied):
    """2,000 Rademacher probes u = ε⊙√p − p(εᵀ√p), batched as cotangent rows with every tensor (the LM
    head included) taken from the backward: the per-tensor mean of h² is within 3 standard errors of the
    exact token Fisher, per sequence (probes summed over positions) and per position; token_fisher's
    probe modes (LM head in closed form) land within the same bounds."""
    torch.set_num_threads(1)
    model = _tiny_llama(tied, seed=3)
    layout = select_parameters(model)
    input_ids, attention_mask = _batch(seed=5)
    args = (model, layout, input_ids, attention_mask, PROMPT_LEN, RESPONSE_LEN)
    exact = _tensor_sums(layout, token_fisher(*args, "exact")["fisher_sum"])  # (tensors,)
    eng = TokenBackward(model, layout, input_ids, attention_mask)
    cols, active, _ = response_positions(input_ids, PROMPT_LEN, RESPONSE_LEN)
    B, T = cols.shape
    p = torch.softmax(eng.logits.detach()[torch.arange(B)[:, None], cols].double(), -1)  # (B, T, V)
    R = 2000
    gen = torch.Generator().manual_seed(0)
    eps = torch.randint(0, 2, (R, B, T, V), generator=gen).double() * 2 - 1
    u = (eps * p.sqrt() - p * (eps * p.sqrt()).sum(-1, keepdim=True)) * active[..., None]  # (R, B, T, V)
    bt = torch.arange(B)[:, None].expand(B, T)
    seq_est, pos_est = [], []
    for lo in range(0, R, 250):
        cot = torch.zeros(250, B, L, V)
        cot[:, bt, cols] = u[lo : lo + 250].float()
        seq_est.append(_tensor_sums(layout, eng.grads(cot).double().square().sum(1)))  # (250, tensors)
        per_pos = torch.zeros(250, B, L, V)
        total = torch.zeros(250, layout.P, dtype=torch.float64)
        for j in range(T):
            per_pos.zero_()
            per_pos[:, torch.arange(B), cols[:, j]] = u[lo : lo + 250, :, j].float()
            total += eng.grads(per_pos).double().square().sum(1)
        pos_est.append(_tensor_sums(layout, total))
    for name, est in (("per sequence", torch.cat(seq_est)), ("per position", torch.cat(pos_est))):
        mean, se = est.mean(0), est.std(0) / R**0.5
        z = (mean - exact).abs() / se
        assert (z < 3).all(), (name, z)
        assert (se < 0.2 * exact).all(), (name, se / exact)  # the test has power
        mode = "probe_seq" if name == "per sequence" else "probe"
        fast = _tensor_sums(layout, token_fisher(*args, mode, k=R, seed=1)["fisher_sum"])
        assert ((fast - exact).abs() < 3 * se).all(), (name, (fast - exact).abs() / se)


def test_probe_modes_are_seeded_and_report_traces():
    torch.set_num_threads(1)
    model = _tiny_llama(False, seed=3)
    layout = select_parameters(model)
    input_ids, attention_mask = _batch(seed=5)
    args = (model, layout, input_ids, attention_mask, PROMPT_LEN, RESPONSE_LEN)
    a, b, c = (token_fisher(*args, "probe", k=2, seed=s) for s in (1, 1, 2))
    assert torch.equal(a["fisher_sum"], b["fisher_sum"]) and not torch.equal(a["fisher_sum"], c["fisher_sum"])
    active = _active()
    assert (a["trace"][active] > 0).all() and (a["trace"][~active] == 0).all()
    torch.testing.assert_close(a["fisher_sum"].sum(), a["trace"].sum(), rtol=1e-6, atol=0)
    seq = token_fisher(*args, "probe_seq", k=2, seed=1)
    assert seq["trace"][active].isnan().all() and (seq["trace"][~active] == 0).all()


def test_budget_and_default_mode():
    assert default_mode(4, 16) == "exact" and default_mode(64, 49152) == "probe"
    assert default_mode(4, 16, exact_budget=63) == "probe"
    check_exact_budget(4, 16, 64)
    with pytest.raises(ValueError, match="T·V = 64·49152 = 3145728 .* budget 65536; use mode='probe'"):
        check_exact_budget(64, 49152, 65536)


def test_weightings_of_the_exact_rows_equal_their_own_modes(case):
    """topk, mc and Σ_t s_t² as extra weightings of exact's rows (one pass) = their own runs."""
    model, layout, input_ids, attention_mask, _, _ = case
    args = (model, layout, input_ids, attention_mask, PROMPT_LEN, RESPONSE_LEN)
    eng = TokenBackward(model, layout, input_ids, attention_mask)
    p, active, drawn = response_policy(eng, input_ids, PROMPT_LEN, RESPONSE_LEN)
    also = {
        "topk": candidate_weights(p, active, "topk", k=3)[0],
        "mc": candidate_weights(p, active, "mc", k=4, seed=9)[0],
        "tok": torch.zeros_like(p).scatter_(-1, drawn[..., None], 1.0),
    }
    out = token_fisher(*args, "exact", engine=eng, also=also)["also"]
    for mode, k, seed in (("topk", 3, 0), ("mc", 4, 9)):
        own = token_fisher(*args, mode, k=k, seed=seed, engine=eng)
        assert _rel(out[mode]["fisher_sum"], own["fisher_sum"]) < 1e-6, mode
        torch.testing.assert_close(out[mode]["trace"], own["trace"], rtol=1e-6, atol=1e-12)
    tok_sq = token_scores(*args).double().square().sum((0, 1))
    assert _rel(out["tok"]["fisher_sum"], tok_sq) < 1e-6
    assert _rel(token_score_squares(eng, input_ids, PROMPT_LEN, RESPONSE_LEN, row_bytes=1), tok_sq) < 1e-6
    with pytest.raises(ValueError, match="also= needs mode='exact'"):
        token_fisher(*args, "topk", k=2, engine=eng, also=also)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    """The same code on cuda: exact equal to the CPU's, probes drawn on the CPU so seeded results agree."""
    model = _tiny_llama(False, seed=3)
    layout = select_parameters(model)
    input_ids, attention_mask = _batch(seed=5)
    cpu = {m: token_fisher(model, layout, input_ids, attention_mask, PROMPT_LEN, RESPONSE_LEN, m, k=4, seed=2)
           for m in ("exact", "probe")}  # fmt: skip
    model.cuda()
    for mode, want in cpu.items():
        got = token_fisher(model, layout, input_ids.cuda(), attention_mask.cuda(), PROMPT_LEN, RESPONSE_LEN, mode, 4, 2)
        assert _rel(got["fisher_sum"].cpu(), want["fisher_sum"]) < 1e-4, mode


def test_embedding_output_updated_in_place_is_exact():
    """A forward that scales the embedding output in place (Gemma's ``inputs_embeds *= √d``) keeps the token
    Fisher exact: the engine hands the model a copy of its graph root, never a leaf that requires grad."""
    torch.set_num_threads(1)
    model = _tiny_llama(False, seed=4)
    model.model.layers[0].register_forward_pre_hook(lambda layer, args: args[0].mul_(1.5))
    layout = select_parameters(model)
    input_ids, attention_mask = _batch(seed=6)
    ref = _reference(model, layout, input_ids)
    exact = token_fisher(model, layout, input_ids, attention_mask, PROMPT_LEN, RESPONSE_LEN, "exact")
    f = (ref["p"][..., None] * ref["g"].square()).sum(2)  # (B, T, P)
    assert _rel(exact["fisher_sum"], f.sum((0, 1))) < 1e-5
