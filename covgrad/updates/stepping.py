"""The optimizer step of a trajectory: one model, one optimizer, one precision regime, one regime's loss.

:class:`Stepper` holds the model in one precision regime and one optimizer, and takes a step on a batch of rows
with its regime's loss (:class:`StepLoss`: rl's REINFORCE loss ``-mean_n(A_n · log p(y_n))``, per-token rl,
distillation towards a fixed teacher in sampled-token or full-distribution form, SFT), accumulated over
minibatches, clipped to a global gradient norm, at the learning rate of :class:`OptimizerSpec`'s schedule. The
batches come from a data source: :class:`FixedBatches` (the update check's fixed rollouts, SFT data) or
:class:`OnPolicy` (fresh samples from the current policy every step, rewarded and given group advantages as
the rollouts stage does).

Precision regimes: ``bf16`` parameters, gradients and optimizer state in bf16; ``fp32_master`` forward
and backward on a bf16 copy, gradients cast to float32, the optimizer steps float32 master weights and
the analysed model is the master cast to bf16 (round-to-nearest-even); ``fp32`` everything in float32.
The *stored dtype* is the analysed model's: bf16 for ``bf16`` and ``fp32_master``, float32 for ``fp32``.

Determinism: the only randomness is the sampler's, a pure function of (seed, step, prompt, sample)
(``covgrad.rollouts.sampling.sample_uniforms``), and the prompt order, a seeded permutation per epoch.

Shapes: N samples per step, L row length, V vocabulary, P selected parameter elements (``layout.P``).
Rows are right-padded (prompt, response, pad); logit position t predicts token t + 1.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from covgrad.choices import REGIME_KINDS, TEACHER_KINDS
from covgrad.layout import ParamLayout
from covgrad.regimes.cotangents import (
    Regime,
    advantage_sq_sums,
    chi2_sums,
    distill_sampled_advantages,
    kl_penalty,
    length_normalise,
    reverse_kl_var_sums,
    token_advantages,
)
from covgrad.rollouts.problems import Problem, RewardFn, response_texts, score_rewards
from covgrad.rollouts.sampling import AdvantageKind, SamplerSpec, check_rewards, compute_advantages, generate

OPTIMIZERS = ("sgd", "adam", "adamw")


PRECISIONS = ("bf16", "fp32_master", "fp32")


SCHEDULES = ("constant", "cosine")  # after the linear warmup


ADAM_EPS = 1e-8  # torch.optim.Adam / AdamW default, used by the optimizer and by the Adam rule


BATCH_KEYS = ("input_ids", "attention_mask", "response_mask", "advantages")


# rewards of one step's samples: (generate's output, prompt index of every sample) -> (N,) float64
SampleRewards = Callable[[Mapping[str, torch.Tensor], Sequence[int]], np.ndarray]


def sequence_logp(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """log p(response) per row: Σ over response tokens of the log-softmax at the drawn token, (N,) float32.

    ``input_ids``, ``attention_mask``, ``response_mask``: (N, L), right-padded rows; response_mask marks
    response tokens in the full row. The log-softmax runs in float32 whatever the model's dtype.
    Differentiable with respect to the model's parameters.
    """
    return log_probs(model, input_ids, attention_mask, response_mask)[0]


def log_probs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence log p (N,), the float32 log-softmax (N, L-1, V), response positions (N, L-1) bool)."""
    _check_rows(input_ids, attention_mask, response_mask)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (N, L, V)
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (N, L-1, V); position t predicts t+1
    token_logp = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # (N, L-1)
    keep = response_mask[:, 1:].bool()
    return torch.where(keep, token_logp, torch.zeros_like(token_logp)).sum(-1), logp, keep


def token_kl_sum(logp: torch.Tensor, ref_logp: torch.Tensor, keep: torch.Tensor) -> float:
    """Σ over response positions of KL(p_t ‖ p_ref,t) = Σ_v p_v (log p_v − log p_ref,v), nats, in float64.

    ``logp``, ``ref_logp``: (N, L-1, V) float32 log-softmax of the current and the start model; ``keep``
    (N, L-1) bool marks the response positions.
    """
    kl = (logp.exp() * (logp - ref_logp)).sum(-1).double()  # (N, L-1)
    return float(kl[keep].sum())


STEP_REGIMES = REGIME_KINDS  # every regime steps its own loss


TEACHER_REGIMES = TEACHER_KINDS


@dataclass
class StepLoss:
    """The loss a step minimises: ``-mean_n J_n``, J_n the objective of one response in ``regime``
    (``covgrad.regimes.cotangents``; its gradient with respect to the logits is ``-c_n / N``, c_n the regime's
    cotangent, so a step follows the regime's G):

    - ``rl``: ``-mean_n(A_n · log p(y_n))`` with the batch's sequence ``advantages`` (N,);
    - ``rl_token``, ``distill_sampled``: ``-mean_n Σ_t sg(A_t − b_t) · log p(y_t)``, the per-token
      coefficients of ``covgrad.regimes.cotangents`` (the sequence advantage broadcast over tokens, the batch's
      token-aligned ``token_advantages`` (N, L) when present, the KL penalty to ``reference`` with
      ``kl_beta``, the length normalisation; for distillation A_t = log q(y_t) − log p(y_t) with q the
      ``teacher``, and with ``baseline`` b_t = −KL(p_t‖q_t));
    - ``distill_reverse_kl``: ``mean_n Σ_t KL(p_t‖q_t)`` (full distribution);
    - ``distill_forward_kl``, ``sft_drift``: ``-mean_n Σ_t Σ_v q_v log p_v`` (KL(q_t‖p_t) up to q's entropy;
      q the teacher, or for ``sft_drift`` the known data distribution μ given as the teacher);
    - ``sft_sampled``: ``-mean_n log p(y_n)`` (plain SFT on the batch's responses).

    p = softmax(z/τ), q = softmax(z_q/τ_q) with τ, τ_q the regime's temperatures; every log-softmax in
    float32. ``teacher`` and ``reference`` are fixed models (never stepped), run without gradients on the
    step's rows.
    """

    regime: Regime = field(default_factory=lambda: Regime("rl"))
    teacher: nn.Module | None = None
    reference: nn.Module | None = None
    use_advantages: bool = True  # rl_token: False steps on the KL penalty alone (A_t = 0)

    def __post_init__(self) -> None:
        kind = self.regime.kind
        if kind in TEACHER_REGIMES and self.teacher is None:
            raise ValueError(f"regime {kind!r} steps towards a teacher: pass teacher=<model>")
        if kind == "rl_token" and self.regime.kl_beta and self.reference is None:
            raise ValueError("regime 'rl_token' with kl_beta > 0 needs reference=<model> for its KL penalty")

    @property
    def needs(self) -> tuple[str, ...]:
        """The batch keys this loss reads."""
        rows = ("input_ids", "attention_mask", "response_mask")
        return (*rows, "advantages") if self.regime.kind == "rl" or self._token_adv else rows

    @property
    def _token_adv(self) -> bool:
        return self.regime.kind == "rl_token" and self.use_advantages

    def __call__(self, model: nn.Module, batch: Mapping[str, torch.Tensor]) -> dict:
        """Forward ``model`` on the batch and build the loss: ``loss`` (0-dim float32, differentiable),
        ``logp`` (N, L-1, V) float32 log-softmax at τ = 1 and ``keep`` (N, L-1) bool response positions,
        and ``bound_a`` (float): the regime's bound scalar a = √(mean_n c²_n) on these rows
        (√mean A² for rl; NaN for sft_sampled, which has none)."""
        ids, attn, resp = batch["input_ids"], batch["attention_mask"], batch["response_mask"]
        _check_rows(ids, attn, resp)
        r = self.regime
        logits = model(input_ids=ids, attention_mask=attn).logits  # (N, L, V)
        z = logits[:, :-1].float()
        logp = torch.log_softmax(z, dim=-1)  # (N, L-1, V); position t predicts t+1
        keep = resp[:, 1:].bool()
        lp = logp if r.temperature == 1 else torch.log_softmax(z / r.temperature, dim=-1)
        token_logp = lp.gather(-1, ids[:, 1:, None]).squeeze(-1)  # (N, L-1)
        zero = torch.zeros_like(token_logp)
        out: dict = {"logp": logp, "keep": keep}
        if r.kind == "rl":
            seq = torch.where(keep, token_logp, zero).sum(-1)
            A = batch["advantages"]
            out["loss"] = -(A.float() * seq).mean()
            out["bound_a"] = float((A.double() ** 2).mean().sqrt())
            return out
        if r.kind == "sft_sampled":
            out["loss"] = -torch.where(keep, token_logp, zero).sum(-1).mean()
            out["bound_a"] = float("nan")
            return out
        full = logits.detach().float()  # (N, L, V) aligned as covgrad.regimes.cotangents expects
        mask = resp.to(torch.float64)
        zq = None if self.teacher is None else _fixed_logits(self.teacher, ids, attn)
        if r.kind in ("rl_token", "distill_sampled"):
            coef = self._coefficients(full, zq, batch)  # (N, L) token-aligned float64
            c = coef[:, 1:].float()
            out["loss"] = -torch.where(keep, c * token_logp, zero).sum(-1).mean()
            out["bound_a"] = float(advantage_sq_sums(coef, mask).mean().sqrt())
            return out
        assert zq is not None
        logq = torch.log_softmax(zq[:, :-1] / r.teacher_temperature, dim=-1)  # (N, L-1, V)
        if r.kind == "distill_reverse_kl":
            kl = (lp.exp() * (lp - logq)).sum(-1)  # (N, L-1)
            out["loss"] = torch.where(keep, kl, zero).sum(-1).mean()
            a2 = reverse_kl_var_sums(full, zq, mask, r.temperature, r.teacher_temperature)
        else:
            cross = (logq.exp() * lp).sum(-1)  # Σ_v q_v log p_v, (N, L-1)
            out["loss"] = -torch.where(keep, cross, zero).sum(-1).mean()
            q = torch.softmax(zq / r.teacher_temperature, dim=-1)
            a2 = chi2_sums(full, q, mask, r.temperature)
        out["bound_a"] = float(a2.mean().sqrt())
        return out

    def _coefficients(
        self, full: torch.Tensor, zq: torch.Tensor | None, batch: Mapping[str, torch.Tensor]
    ) -> torch.Tensor:
        """The detached per-token coefficients A_t − b_t, token-aligned (N, L) float64."""
        r, ids, resp = self.regime, batch["input_ids"], batch["response_mask"]
        mask = resp.to(torch.float64)
        if r.kind == "distill_sampled":
            adv, b = distill_sampled_advantages(
                full, ids, mask, zq, None, r.temperature, r.teacher_temperature, baseline=r.baseline
            )
            return adv if b is None else adv - b
        if self.use_advantages:
            src = batch["token_advantages"] if "token_advantages" in batch else batch["advantages"]
            adv = token_advantages(src, mask)
        else:
            adv = torch.zeros(mask.shape, dtype=torch.float64)
        if r.kl_beta:
            ref = _fixed_logits(self.reference, ids, batch["attention_mask"])
            adv = adv + kl_penalty(full, ref, ids, mask, r.kl_beta, r.temperature, r.kl_reward_to_go)
        return length_normalise(adv, mask, r.length_norm, r.max_length)


def _fixed_logits(model: nn.Module, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Logits (N, L, V) float32 of a fixed (teacher or reference) model, without gradients."""
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=attn).logits.float()


@dataclass(frozen=True)
class OptimizerSpec:
    """torch.optim SGD (no momentum), Adam or AdamW, a learning-rate schedule and global grad-norm clipping.

    ``weight_decay`` None keeps torch's default (0 for SGD and Adam, 0.01 for AdamW). Schedule of step t
    (t from 1), W = ``warmup``, T = ``total_steps``: a linear warmup lr·t/W for t ≤ W (W = 0: none), then
    ``constant`` lr, or ``cosine`` lr·½(1 + cos(π·(t − W)/(T − W))) down to 0 at t = T. Transformers'
    ``get_constant_schedule_with_warmup`` / ``get_cosine_schedule_with_warmup`` give the same multipliers one
    step later (their scheduler is evaluated at 0 for the first optimizer step). ``max_grad_norm`` clips the
    gradient's global L2 norm over every stepped parameter (``torch.nn.utils.clip_grad_norm_``) before the
    step; None: no clipping.
    """

    name: str
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float | None = None
    warmup: int = 0
    schedule: str = "constant"
    total_steps: int = 0
    max_grad_norm: float | None = None

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"optimizer {self.name!r} is not one of {OPTIMIZERS}")
        if not (isinstance(self.lr, int | float) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"learning rate {self.lr!r} must be positive")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"warmup must be an int >= 0 steps, got {self.warmup!r}")
        if not all(0 <= b < 1 for b in self.betas) or len(self.betas) != 2:
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if self.weight_decay is not None and not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay!r}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule {self.schedule!r} is not one of {SCHEDULES}")
        if self.schedule == "cosine" and not self.total_steps > self.warmup:
            raise ValueError(f"a cosine schedule needs total_steps > warmup, got {self.total_steps} and {self.warmup}")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be positive (or None: no clipping), got {self.max_grad_norm!r}")

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (from 1)."""
        if self.warmup and step <= self.warmup:
            return self.lr * min(1.0, step / self.warmup)
        if self.schedule == "cosine":
            progress = (step - self.warmup) / (self.total_steps - self.warmup)
            return self.lr * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
        return self.lr

    def build(self, params: list[nn.Parameter]) -> torch.optim.Optimizer:
        """The torch optimizer over ``params`` (eps = ADAM_EPS for Adam and AdamW)."""
        decay = {} if self.weight_decay is None else {"weight_decay": self.weight_decay}
        if self.name == "sgd":
            return torch.optim.SGD(params, lr=self.lr, **decay)
        cls = torch.optim.Adam if self.name == "adam" else torch.optim.AdamW
        return cls(params, lr=self.lr, betas=self.betas, eps=ADAM_EPS, **decay)


def bf16_rounded(model: nn.Module, layout: ParamLayout | None = None) -> nn.Module:
    """``model`` in eval mode with every parameter rounded to bf16 in place (dtype kept); with ``layout``,
    checks that every layout tensor is a parameter of that shape."""
    model.eval()
    if layout is not None:
        params = dict(model.named_parameters())
        for e in layout.entries:
            if e.name not in params or tuple(params[e.name].shape) != e.shape:
                raise ValueError(f"layout tensor {e.name!r} {e.shape} is not a parameter of the model")
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))
    return model


def stored_dtype(precision: str) -> torch.dtype:
    """The analysed model's dtype in a precision regime."""
    _check_precision(precision)
    return torch.float32 if precision == "fp32" else torch.bfloat16


class Stepper:
    """One model, one optimizer, one precision regime; :meth:`backward` then :meth:`update` is one step.

    ``model`` is the start (already on the grid the caller wants, e.g. :func:`bf16_rounded`); it is
    taken over (cast in place for ``bf16``). :attr:`model` is the analysed model. ``minibatches`` M splits a
    step's N rows into M contiguous parts of N/M rows (gradient accumulation): each part's loss, divided by M,
    is backpropagated in turn, so the step follows the mean of the parts' gradients. Under ``fp32_master``
    each part's gradient (bf16, on the analysed copy) is cast to float32 and added into the master's
    gradient, as FSDP2 with ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` accumulates it;
    under ``bf16`` and ``fp32`` autograd accumulates in the parameters' dtype.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: OptimizerSpec,
        precision: str,
        loss: StepLoss | None = None,
        minibatches: int = 1,
    ) -> None:
        _check_precision(precision)
        if isinstance(minibatches, bool) or not isinstance(minibatches, int) or minibatches < 1:
            raise ValueError(f"minibatches must be an int >= 1, got {minibatches!r}")
        self.spec, self.precision, self.step, self.minibatches = optimizer, precision, 0, minibatches
        self.loss = StepLoss() if loss is None else loss
        self.master = model.to(torch.bfloat16) if precision == "bf16" else model
        self.model = copy.deepcopy(self.master).to(torch.bfloat16) if precision == "fp32_master" else self.master
        self._pairs = [
            (pm, pw)
            for (_, pm), (_, pw) in zip(self.master.named_parameters(), self.model.named_parameters(), strict=True)
            if pm.requires_grad
        ]
        self.opt = optimizer.build([pm for pm, _ in self._pairs])
        self.grad_norm = float("nan")  # the last step's global gradient norm before clipping
        self._clipped = False

    def backward(self, batch: Mapping[str, torch.Tensor], keep_logp: bool = False) -> dict:
        """Gradients of the regime's loss (:class:`StepLoss`) on the master weights, accumulated over the
        step's minibatches; returns ``loss`` (the mean of the parts' losses) and ``bound_a`` (the root mean
        square of the parts' a, floats) and, with ``keep_logp``, the detached ``logp`` (N, L-1, V) and ``keep``
        (N, L-1) of the forwards."""
        self.master.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        parts = minibatch_parts(batch, self.minibatches)
        losses, bound, logps, keeps = [], [], [], []
        for part in parts:
            fwd = self.loss(self.model, part)
            (fwd["loss"] / len(parts)).backward()
            losses.append(float(fwd["loss"].detach()))
            bound.append(fwd["bound_a"])
            if keep_logp:
                logps.append(fwd["logp"].detach())
                keeps.append(fwd["keep"])
            if self.model is not self.master:
                self._accumulate_master()
        out: dict = {
            "loss": losses[0] if len(parts) == 1 else float(np.mean(losses)),
            "bound_a": bound[0] if len(parts) == 1 else math.sqrt(float(np.mean(np.square(bound)))),
        }
        if keep_logp:
            out.update(logp=torch.cat(logps), keep=torch.cat(keeps))
        return out

    def _accumulate_master(self) -> None:
        """Add the analysed copy's gradients, cast to float32, into the master's; clear the copy's."""
        for pm, pw in self._pairs:
            if pw.grad is None:
                continue
            g = pw.grad.float()
            pm.grad = g if pm.grad is None else pm.grad.add_(g)
            pw.grad = None

    def clip(self) -> float:
        """Clip the gradients of the last :meth:`backward` to a global L2 norm of ``spec.max_grad_norm`` and
        return their norm before clipping (:attr:`grad_norm`); without clipping, NaN and nothing computed. Once
        per step: :meth:`update` calls it when the caller has not."""
        if not self._clipped and self.spec.max_grad_norm is not None:
            grads = [pm for pm, _ in self._pairs if pm.grad is not None]
            self.grad_norm = float(torch.nn.utils.clip_grad_norm_(grads, self.spec.max_grad_norm))
        self._clipped = True
        return self.grad_norm

    def update(self) -> None:
        """One optimizer step from the (clipped, :meth:`clip`) gradients of the last :meth:`backward` at
        ``spec.lr_at(step + 1)``."""
        self.step += 1
        for group in self.opt.param_groups:
            group["lr"] = self.spec.lr_at(self.step)
        self.clip()
        self._clipped = False
        self.opt.step()
        if self.model is not self.master:
            with torch.no_grad():
                for pm, pw in self._pairs:
                    pw.copy_(pm)  # round-to-nearest-even cast of the master

    def flat(self, layout: ParamLayout, grad: bool = False) -> torch.Tensor:
        """The analysed model's selected values, (P,) stored dtype; with ``grad``, the gradients the optimizer
        steps on (the master's: float32 under ``fp32_master``; 0 where None), (P,)."""
        params = dict((self.master if grad else self.model).named_parameters())
        parts = []
        for e in layout.entries:
            p = params[e.name]
            t = p.grad if grad else p
            parts.append(torch.zeros(e.numel, dtype=p.dtype) if t is None else t.detach().reshape(-1))
        return torch.cat(parts)

    def state_dict(self) -> dict:
        """Plain dict: ``step`` int, ``weights`` {name: tensor} of the master, ``optimizer`` torch's state; the
        tensors are the live ones (as ``nn.Module.state_dict`` gives them): save or copy it before the next step."""
        return {
            "step": self.step,
            "weights": {n: p.detach() for n, p in self.master.named_parameters()},
            "optimizer": self.opt.state_dict(),
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict`'s output (the analysed copy is recast from the master)."""
        with torch.no_grad():
            for n, p in self.master.named_parameters():
                p.copy_(state["weights"][n])
            if self.model is not self.master:
                for pm, pw in self._pairs:
                    pw.copy_(pm)
        self.opt.load_state_dict(copy.deepcopy(state["optimizer"]))
        self.step = int(state["step"])


def minibatch_parts(batch: Mapping[str, torch.Tensor], parts: int) -> list[Mapping[str, torch.Tensor]]:
    """The step's rows cut into ``parts`` contiguous minibatches of N/parts rows each: every tensor of the
    batch whose first dimension is N is sliced, other entries are shared; ``parts`` 1 returns ``[batch]``."""
    if parts == 1:
        return [batch]
    n = int(batch["input_ids"].shape[0])
    if n % parts:
        raise ValueError(f"a step of {n} rows does not split into {parts} equal minibatches; make N a multiple")
    size = n // parts
    return [
        {
            k: v[i * size : (i + 1) * size] if torch.is_tensor(v) and v.dim() and v.shape[0] == n else v
            for k, v in batch.items()
        }
        for i in range(parts)
    ]


class FixedBatches:
    """Fixed data (the update check's rollouts, SFT responses): step t (from 1) uses
    ``batches[(t - 1) % len]`` when ``fresh_minibatches``, else ``batches[0]``; each batch has the keys
    ``needs`` (:attr:`StepLoss.needs`): ``input_ids``, ``attention_mask``, ``response_mask`` (N, L) and,
    for the rl regimes, ``advantages`` (N,)."""

    def __init__(
        self,
        batches: Sequence[Mapping[str, torch.Tensor]],
        fresh_minibatches: bool = True,
        needs: Sequence[str] = BATCH_KEYS,
    ) -> None:
        if not batches:
            raise ValueError("batches is empty; pass at least one batch of rollouts")
        for i, batch in enumerate(batches):
            missing = [key for key in needs if key not in batch]
            if missing:
                raise ValueError(f"batch {i} lacks {missing}; each batch needs {list(needs)}")
        self.batches, self.fresh = list(batches), fresh_minibatches

    def batch(self, step: int, model: nn.Module) -> Mapping[str, torch.Tensor]:
        """The rows of step ``step`` (``model`` is unused: the data are fixed)."""
        return self.batches[(step - 1) % len(self.batches)] if self.fresh else self.batches[0]


def step_seed(seed: int, step: int) -> int:
    """The sampler seed of step ``step``: 63 bits of sha256 of (seed, step)."""
    digest = hashlib.sha256(f"covgrad.trajectory:{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@dataclass
class OnPolicy:
    """Fresh rl rows every step: ``prompts_per_step`` prompts, G = ``group_size`` samples each from the
    current analysed model (``covgrad.rollouts.sampling.generate`` with seed ``step_seed(seed, step)``), rewarded
    by ``rewards`` and given advantages of kind ``advantage`` within each prompt's group.

    Prompt order: the prompts are consumed in a seeded permutation per epoch (numpy ``default_rng([seed,
    epoch])``), ``prompts_per_step`` at a time, an epoch continuing into the next where they do not
    divide the number of prompts.
    """

    prompts: list[list[int]]
    rewards: SampleRewards
    group_size: int
    sampler: SamplerSpec
    prompts_per_step: int
    seed: int
    eos_id: int
    pad_id: int
    advantage: AdvantageKind = "group_mean"
    batch_size: int = 64

    def __post_init__(self) -> None:
        if not self.prompts:
            raise ValueError("OnPolicy needs at least one prompt")
        if self.prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {self.prompts_per_step}")

    def order(self, epoch: int) -> np.ndarray:
        """The prompt order of epoch ``epoch``, (n_prompts,) int64."""
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.prompts))

    def prompt_indices(self, step: int) -> list[int]:
        """The prompts of step ``step`` (from 1)."""
        n, lo = len(self.prompts), (step - 1) * self.prompts_per_step
        return [int(self.order(j // n)[j % n]) for j in range(lo, lo + self.prompts_per_step)]

    def batch(self, step: int, model: nn.Module) -> Mapping[str, torch.Tensor]:
        """Generate, reward and score step ``step``'s rows from ``model``: the BATCH_KEYS plus ``reward``
        (N,) float64 and ``prompt_index`` (N,) int64."""
        idx = self.prompt_indices(step)
        out = generate(
            model,
            [self.prompts[i] for i in idx],
            list(range(len(idx))),
            self.group_size,
            self.sampler,
            step_seed(self.seed, step),
            batch_size=self.batch_size,
            eos_id=self.eos_id,
            pad_id=self.pad_id,
        )
        return rl_batch(out, [idx[int(k)] for k in out["prompt_index"]], self.rewards, self.advantage)


def rl_batch(
    out: Mapping[str, torch.Tensor], prompt_of: Sequence[int], rewards: SampleRewards, advantage: AdvantageKind
) -> dict[str, torch.Tensor]:
    """Training rows from ``generate``'s output: ``input_ids`` (N, L) int64, ``attention_mask`` (N, L) int64,
    ``response_mask`` (N, L) bool, ``reward`` (N,) float64, ``advantages`` (N,) float64 (by group =
    ``out["prompt_index"]``), ``prompt_index`` (N,) int64 = ``prompt_of``."""
    r = np.asarray(rewards(out, prompt_of), dtype=np.float64)
    check_rewards(r)
    L = out["tokens"].shape[1]
    total = out["prompt_len"] + out["response_len"]
    return {
        "input_ids": out["tokens"].long(),
        "attention_mask": (torch.arange(L)[None] < total[:, None]).long(),
        "response_mask": out["response_mask"],
        "reward": torch.from_numpy(r),
        "advantages": torch.from_numpy(compute_advantages(r, out["prompt_index"].numpy(), advantage)),
        "prompt_index": torch.tensor(list(prompt_of), dtype=torch.long),
    }


def text_rewards(tokenizer, problems: Sequence[Problem], reward_fn: RewardFn) -> SampleRewards:
    """A task's reward as the rollouts stage applies it: decode each response, then
    ``reward_fn(prompt, response, answer)`` of its problem."""

    def rewards(out: Mapping[str, torch.Tensor], prompt_of: Sequence[int]) -> np.ndarray:
        texts = response_texts(tokenizer, out["tokens"].tolist(), out["prompt_len"], out["response_len"])
        probs = [problems[i] for i in prompt_of]
        return np.asarray(score_rewards(reward_fn, [p.prompt for p in probs], texts, [p.answer for p in probs]))

    return rewards


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {PRECISIONS}")


def _check_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor) -> None:
    """Shapes (N, L) agree, no response token at position 0 (nothing predicts it), none on padding."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape or response_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids, attention_mask, response_mask must all be (N, L); got {tuple(input_ids.shape)}, "
            f"{tuple(attention_mask.shape)}, {tuple(response_mask.shape)}"
        )
    response = response_mask.bool()
    if bool(response[:, 0].any()):
        raise ValueError("response_mask marks position 0, which no logit predicts; rows start with the prompt")
    if bool((response & ~attention_mask.bool()).any()):
        raise ValueError("response_mask marks padding (attention_mask == 0); mark only real response tokens")
