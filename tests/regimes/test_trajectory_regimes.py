"""Every regime's step against references: one stage step equals a hand-written step of the same loss,
optimizer and precision (weights byte-identical), and each stepping loss's logit gradient is minus the
regime's cotangent (``covgrad.regimes.cotangents.RegimeGrad``) over N."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from covgrad.layout import select_parameters
from covgrad.regimes.cotangents import Regime, RegimeGrad
from covgrad.updates.check import run_update_cell
from covgrad.updates.stepping import (
    ADAM_EPS,
    PRECISIONS,
    STEP_REGIMES,
    FixedBatches,
    OptimizerSpec,
    StepLoss,
    Stepper,
    bf16_rounded,
    stored_dtype,
)
from covgrad.updates.trajectory import run_trajectory
from tests.helpers.trajectory import LRS, hand_rows, on_policy, rollouts, tiny_llama

TEACHER_TAU = 0.5


def teacher() -> nn.Module:
    """A second tiny Llama of the same vocabulary (another seed), float32, eval mode."""
    torch.manual_seed(0)
    model = tiny_llama()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model.eval()


def loss_for(kind: str) -> StepLoss:
    tau = TEACHER_TAU if kind.startswith("distill") else 1.0
    needs_teacher = kind.startswith("distill") or kind == "sft_drift"
    return StepLoss(Regime(kind, teacher_temperature=tau), teacher() if needs_teacher else None)


def hand_loss(kind: str, work: nn.Module, ids, attn, resp, q_model: nn.Module | None) -> torch.Tensor:
    """The regime's loss written out in plain torch."""
    logp = torch.log_softmax(work(input_ids=ids, attention_mask=attn).logits[:, :-1].float(), dim=-1)
    tok = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    keep = resp[:, 1:].bool()
    zero = torch.zeros_like(tok)
    if kind == "sft_sampled":
        return -torch.where(keep, tok, zero).sum(-1).mean()
    with torch.no_grad():
        logq = torch.log_softmax(q_model(input_ids=ids, attention_mask=attn).logits.float()[:, :-1] / TEACHER_TAU, -1)
    if kind == "distill_sampled":
        A = logq.gather(-1, ids[:, 1:, None]).squeeze(-1).double() - tok.detach().double()
        return -torch.where(keep, A.float() * tok, zero).sum(-1).mean()
    kl = (logp.exp() * (logp - logq)).sum(-1)
    return torch.where(keep, kl, zero).sum(-1).mean()


def hand_update(name: str, precision: str, master: nn.Module, work: nn.Module) -> None:
    """torch's single-tensor SGD / Adam first step at lr/2 (warmup 2) in the precision's arithmetic."""
    lr, b1, b2 = LRS[name] * 0.5, 0.9, 0.999
    with torch.no_grad():
        for pm, pw in zip(master.parameters(), work.parameters(), strict=True):
            g = pw.grad.float() if precision == "fp32_master" else pw.grad
            if name == "sgd":
                pm.add_(g, alpha=-lr)
            else:
                m = torch.zeros_like(pm).lerp_(g, 1 - b1)
                v = torch.zeros_like(pm).mul_(b2).addcmul_(g, g, value=1 - b2)
                denom = (v.sqrt() / (1 - b2) ** 0.5).add_(ADAM_EPS)
                pm.addcdiv_(m, denom, value=-(lr / (1 - b1)))
            if pw is not pm:
                pw.copy_(pm)


def hand_step(kind: str, name: str, precision: str) -> dict[str, torch.Tensor]:
    master = bf16_rounded(tiny_llama())
    if precision == "bf16":
        master = master.to(torch.bfloat16)
    work = copy.deepcopy(master).to(torch.bfloat16) if precision == "fp32_master" else master
    if kind == "sft_sampled":
        b = rollouts(1)
        ids, attn, resp = b["input_ids"], b["attention_mask"], b["response_mask"]
    else:
        ids, attn, resp, _ = hand_rows(work)
    hand_loss(kind, work, ids, attn, resp, teacher()).backward()
    hand_update(name, precision, master, work)
    return {n: p.detach().clone() for n, p in work.named_parameters()}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", ["sgd", "adam"])
@pytest.mark.parametrize("kind", ["distill_sampled", "distill_reverse_kl", "sft_sampled"])
def test_one_step_equals_a_hand_written_step(kind, name, precision):
    layout = select_parameters(tiny_llama())
    spec = OptimizerSpec(name, LRS[name], warmup=2)
    loss = loss_for(kind)
    stepper = Stepper(bf16_rounded(tiny_llama()), spec, precision, loss)
    source = FixedBatches([rollouts(1)], needs=loss.needs) if kind == "sft_sampled" else on_policy()
    (rec,) = run_trajectory(stepper, source, layout, 1)
    want = hand_step(kind, name, precision)
    got = dict(stepper.model.named_parameters())
    moved = 0
    for n, w in want.items():
        assert got[n].dtype == w.dtype == stored_dtype(precision)
        assert torch.equal(bits(got[n]), bits(w)), n
        moved += int((w != bf16_rounded(tiny_llama()).get_parameter(n).to(w.dtype)).sum())
    assert moved > 0
    assert math.isfinite(rec["loss"]) and (math.isnan(rec["adv_rms"]) == (kind == "sft_sampled"))


class Logits(nn.Module):
    """A 'model' whose logits are a float64 parameter (N, L, V): its gradient is the loss's logit gradient."""

    def __init__(self, z: torch.Tensor) -> None:
        super().__init__()
        self.z = nn.Parameter(z.clone())

    def forward(self, input_ids=None, attention_mask=None):
        return SimpleNamespace(logits=self.z)


@pytest.mark.parametrize("kind", STEP_REGIMES)
def test_stepping_loss_follows_the_regime_cotangent(kind):
    g = torch.Generator().manual_seed(4)
    b = rollouts(2)
    N, L = b["input_ids"].shape
    V = 16
    z = torch.randn(N, L, V, generator=g, dtype=torch.float64)
    zq = torch.randn(N, L, V, generator=g, dtype=torch.float64)
    zr = torch.randn(N, L, V, generator=g, dtype=torch.float64)
    regime = Regime(
        kind,
        teacher_temperature=0.7,
        kl_beta=0.3 if kind == "rl_token" else 0.0,
        length_norm="response_length" if kind == "rl_token" else "none",
        baseline=kind == "distill_sampled",
    )
    model = Logits(z)
    loss = StepLoss(regime, Logits(zq), Logits(zr))
    batch = {**b, "response_mask": b["response_mask"]}
    out = loss(model, batch)
    out["loss"].backward()
    resp = b["response_mask"].to(torch.float64)
    fn = RegimeGrad(
        regime,
        b["input_ids"],
        resp,
        advantages=b["advantages"].double() if kind in ("rl", "rl_token") else None,
        teacher_logits=zq.float().double(),
        ref_logits=zr.float().double(),
    )
    want = -fn(z.float().double()) / N
    got = model.z.grad
    scale = float(want.abs().max())
    assert scale > 0
    assert float((got - want).abs().max()) <= 1e-5 * scale, kind
    if fn.bound_sq is None:
        assert math.isnan(out["bound_a"])
    elif kind == "rl":  # rl's own bound std(A)·√F (R1), not the token-summed one
        assert out["bound_a"] == float((b["advantages"].double() ** 2).mean().sqrt())
    else:
        assert out["bound_a"] == pytest.approx(float(fn.bound_sq.mean().sqrt()), rel=1e-5)


def test_update_check_steps_the_regime_loss():
    layout = select_parameters(tiny_llama())
    batches = [rollouts(1), rollouts(2)]
    loss = loss_for("distill_reverse_kl")
    cell = run_update_cell(tiny_llama, layout, batches, "adam", "bf16", 1e-3, 2, True, loss)
    stepper = Stepper(bf16_rounded(tiny_llama()), OptimizerSpec("adam", 1e-3), "bf16", loss)
    list(run_trajectory(stepper, FixedBatches(batches, needs=loss.needs), layout, 2))
    assert torch.equal(stepper.flat(layout).float(), cell["end"])
    rl = run_update_cell(tiny_llama, layout, batches, "adam", "bf16", 1e-3, 2, True)
    assert not torch.equal(rl["end"], cell["end"])


def test_a_teacher_regime_without_a_teacher_fails():
    with pytest.raises(ValueError, match="teacher"):
        StepLoss(Regime("distill_reverse_kl"))
    with pytest.raises(ValueError, match="reference"):
        StepLoss(Regime("rl_token", kl_beta=0.1))
