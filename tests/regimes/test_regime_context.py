"""Context distillation and the teacher's own samples: the teacher's logits on [its prompt + the same response],
aligned back to the policy's positions, against a naive unpadded forward per sample; the regime's g_n against a
naive float64 loop of −Σ_t KL(p_t‖q_t) with q from that forward; the template and its one-line refusals."""

from __future__ import annotations

import copy

import pytest
import torch

from covgrad.config import fill_template, template_fields
from covgrad.layout import select_parameters
from covgrad.regimes.context import align_prefixed_logits, prefixed_batch
from covgrad.regimes.cotangents import Regime, RegimeGrad
from covgrad.scores.engine import PerSampleGrads
from tests.helpers.models import tiny_llama
from tests.helpers.persample import max_rel_err

V, PAD = 32, 0


def _rows():
    """Policy rows (right-padded, prompts of different lengths) and the teacher's prompts (other lengths)."""
    gen = torch.Generator().manual_seed(5)
    prompt_lens, response_lens, teacher_lens = [3, 5, 2, 4], [4, 2, 3, 1], [6, 2, 4, 7]

    def draw(n):
        return torch.randint(1, V, (n,), generator=gen).tolist()

    prompts = [draw(n) for n in prompt_lens]
    responses = [draw(n) for n in response_lens]
    teacher = [draw(n) for n in teacher_lens]
    L = max(p + r for p, r in zip(prompt_lens, response_lens, strict=True)) + 1  # one more padding column
    ids = torch.full((4, L), PAD, dtype=torch.long)
    mask = torch.zeros(4, L)
    for n, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[n, : len(p) + len(r)] = torch.tensor(p + r)
        mask[n, len(p) : len(p) + len(r)] = 1
    attn = (
        torch.arange(L)[None]
        < torch.tensor([len(p) + len(r) for p, r in zip(prompts, responses, strict=True)])[:, None]
    ).long()
    return prompts, responses, teacher, ids, attn, mask


def _model():
    model = tiny_llama(V, intermediate=48, pad_token_id=PAD, seed=3).double()
    model.config._attn_implementation = "eager"
    return model


def test_aligned_teacher_logits_equal_a_naive_forward_of_each_prefixed_prompt():
    prompts, responses, teacher, ids, _, _ = _rows()
    model = _model()
    pb = prefixed_batch(teacher, responses, PAD)
    assert pb.start.tolist() == [len(t) for t in teacher]
    with torch.no_grad():
        zq = model(input_ids=pb.input_ids, attention_mask=pb.attention_mask, position_ids=pb.position_ids).logits
        pl = torch.tensor([len(p) for p in prompts])
        rl = torch.tensor([len(r) for r in responses])
        aligned = align_prefixed_logits(zq, pb.start, pl, rl, ids.shape[1])
        for n, (t, r) in enumerate(zip(teacher, responses, strict=True)):
            naive = model(input_ids=torch.tensor([t + r])).logits[0]  # (len t + len r, V), unpadded
            want = torch.zeros(ids.shape[1], V, dtype=torch.float64)
            lp = len(prompts[n])
            want[lp - 1 : lp - 1 + len(r)] = naive[len(t) - 1 : len(t) - 1 + len(r)]
            torch.testing.assert_close(aligned[n], want, rtol=0, atol=1e-6)  # RMSNorm runs in float32
    moved = align_prefixed_logits(zq, pb.start - 1, pl, rl, ids.shape[1])  # one column off is not the same
    assert (moved - aligned).abs().max() > 1e-2


@pytest.mark.parametrize("kind", ["distill_reverse_kl", "distill_sampled", "sft_drift"])
def test_context_distillation_g_n_match_a_naive_float64_loop(kind):
    """g_n of the policy (prompt x) distilled towards itself given another prompt x′ on the same responses,
    against autograd of the objective written per unpadded sequence, q from the unpadded [x′ + y] forward."""
    prompts, responses, teacher, ids, attn, mask = _rows()
    model = _model()
    teacher_model = copy.deepcopy(model)  # the same weights: the teacher differs only by its prompt
    layout = select_parameters(model)
    pb = prefixed_batch(teacher, responses, PAD)
    with torch.no_grad():
        zq = teacher_model(
            input_ids=pb.input_ids, attention_mask=pb.attention_mask, position_ids=pb.position_ids
        ).logits
    pl = torch.tensor([len(p) for p in prompts])
    rl = torch.tensor([len(r) for r in responses])
    aligned = align_prefixed_logits(zq, pb.start, pl, rl, ids.shape[1])
    regime = Regime(kind, baseline=kind == "distill_sampled")
    fn = RegimeGrad(regime, ids, mask, teacher_logits=aligned)
    got = PerSampleGrads(model, layout, check=False)(ids, attn, fn)
    params = [p for _, p in model.named_parameters()]
    rows = []
    for n, (p, r, t) in enumerate(zip(prompts, responses, teacher, strict=True)):
        with torch.no_grad():
            q_logits = teacher_model(input_ids=torch.tensor([t + r])).logits[0, len(t) - 1 : len(t) - 1 + len(r)]
        z = model(input_ids=torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) - 1 + len(r)]
        logp, logq = torch.log_softmax(z, -1), torch.log_softmax(q_logits, -1)
        y = torch.tensor(r)
        kl = (logp.exp() * (logp - logq)).sum(-1)
        if kind == "distill_reverse_kl":
            J = -kl.sum()
        elif kind == "distill_sampled":  # A_t − b_t = log q(y) − log p(y) + KL_t, held constant
            lpy = logp.gather(-1, y[:, None])[:, 0]
            J = ((logq.gather(-1, y[:, None])[:, 0] - lpy + kl).detach() * lpy).sum()
        else:  # sft_drift with μ = the teacher's distribution
            J = (logq.exp() * logp).sum()
        grads = torch.autograd.grad(J, params)
        rows.append(torch.cat([g.reshape(-1) for g in grads]))
        del n
    err, name = max_rel_err(layout, got, torch.stack(rows))
    assert err < 1e-5, (kind, name, err)


def test_teacher_prompt_templates_fill_from_records_and_refuse_in_one_line():
    assert template_fields("{{literal}} answer {answer} to {prompt}") == ["answer", "prompt"]
    assert fill_template("The answer is {answer}. {prompt}", {"prompt": "1+2=", "answer": 3}) == "The answer is 3. 1+2="
    for bad in ("{}", "{0}", "{answer.x}", "{answer!r}", "{answer:>4}", "{answer"):
        with pytest.raises(ValueError) as err:
            template_fields(bad)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"needs field \{hint\}.*has \['answer', 'prompt'\]"):
        fill_template("{hint} {prompt}", {"prompt": "1+2=", "answer": "3"})
    with pytest.raises(ValueError, match="teacher prompt is empty"):
        prefixed_batch([[1], []], [[2], [3]], PAD)
