"""Optimizer trajectories: K steps of one regime from a policy, and which parameters each step changes.

One code path steps an optimizer: :class:`Stepper` holds the model in one precision regime and one
optimizer, and takes a step on a batch of rows with its regime's loss (:class:`StepLoss`: rl's
REINFORCE loss ``-mean_n(A_n · log p(y_n))``, per-token rl, distillation towards a fixed teacher in
sampled-token or full-distribution form, SFT). The batches come from a data source:
:class:`FixedBatches` (the update check's fixed rollouts, SFT data) or :class:`OnPolicy` (fresh samples
from the current policy every step, rewarded and given group advantages as the rollouts stage does).
:func:`run_trajectory` steps K times and yields one compact record per step from
:class:`ChangeTracker`: the step's changed set in the stored dtype (exact inequality, bit-packed),
counts at |Δ| thresholds, sign flips, reward, loss, the per-token KL to the start, and how well
step-0 predictors (top-k by F, |G|, |ρ|, smallest |w|, random, per-tensor random, the absorption
rules) match the per-step and cumulative changed sets, globally and within |w| deciles.

Precision regimes: ``bf16`` parameters, gradients and optimizer state in bf16; ``fp32_master`` forward
and backward on a bf16 copy, gradients cast to float32, the optimizer steps float32 master weights and
the analysed model is the master cast to bf16 (round-to-nearest-even); ``fp32`` everything in float32.
The *stored dtype* is the analysed model's: bf16 for ``bf16`` and ``fp32_master``, float32 for ``fp32``.

Determinism and resume: the only randomness is the sampler's, a pure function of (seed, step, prompt,
sample) (``covgrad.rollouts.sampling.sample_uniforms``), and the prompt order, a seeded permutation per epoch.
:func:`trajectory_state` is a plain dict of tensors and ints (weights, optimizer state, tracker state,
step, seed); a run rebuilt from it by :func:`load_trajectory_state` continues byte-identically.

Shapes: N samples per step, L row length, V vocabulary, P selected parameter elements (``layout.P``),
E layout tensors. Rows are right-padded (prompt, response, pad); logit position t predicts token t + 1.
"""

from __future__ import annotations

import copy
import hashlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from covgrad.layout import ParamLayout
from covgrad.regimes.objectives import (
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
ADAM_EPS = 1e-8  # torch.optim.Adam / AdamW default, used by the optimizer and by the Adam rule
BATCH_KEYS = ("input_ids", "attention_mask", "response_mask", "advantages")
THRESHOLDS = (0.0, 1e-8, 1e-6, 1e-5, 1e-4)  # |Δ| > threshold counts, Δ in float32
SCOPES = ("step", "cum")  # the step's changed set (w_t != w_{t-1}) and the cumulative one (w_t != w_0)
RANKED = ("F", "absG", "absrho", "smallw", "random", "tensor_random")
DECILE_PREDICTORS = ("F", "absG", "absrho", "random")
RULES = ("absorb", "bound")
SET_STATS = ("precision", "recall", "jaccard", "size")
N_DECILES = 10

# rewards of one step's samples: (generate's output, prompt index of every sample) -> (N,) float64
SampleRewards = Callable[[Mapping[str, torch.Tensor], Sequence[int]], np.ndarray]


def bf16_half_spacing(w: torch.Tensor) -> torch.Tensor:
    """Half the gap from ``bf16(w)`` to its nearest bf16 neighbour, float32, same shape as ``w``.

    A step smaller than this cannot change a bf16 value under round-to-nearest-even; a step of at
    least this much can (toward the nearer neighbour). Exact, from the bf16 bit pattern:

    - normal, ``2**e <= |w| < 2**(e+1)``: the spacing is ``2**(e-7)``, half of it ``2**(e-8)``;
      at an exact power of two above the smallest normal the gap toward zero is half the gap away
      from zero, so the result there is ``2**(e-9)``;
    - zero, subnormals and the smallest normal ``2**-126``: the spacing is ``2**-133``, half ``2**-134``.

    ``w`` is any floating tensor; it is first rounded to bf16 (round-to-nearest-even).
    """
    if not w.is_floating_point():
        raise ValueError(f"bf16_half_spacing needs a floating tensor, got dtype {w.dtype}")
    wb = w.detach().to(torch.bfloat16)
    if not torch.isfinite(wb).all():
        raise ValueError("bf16_half_spacing: bf16(w) has inf or NaN entries; pass finite weights within bf16 range")
    bits = wb.view(torch.int16).to(torch.int32) & 0x7FFF  # magnitude bits: 8 exponent, 7 mantissa
    biased = bits >> 7
    mantissa = bits & 0x7F
    exponent = biased.clamp(min=1) - 127 - 8  # half of the binade spacing 2**(e - 7)
    exponent = exponent - ((mantissa == 0) & (biased >= 2)).to(torch.int32)
    return torch.exp2(exponent.to(torch.float64)).to(torch.float32)


def half_spacing(w: torch.Tensor) -> torch.Tensor:
    """Half the gap from ``w`` to its nearest neighbour in ``w``'s own dtype (bf16 or float32), float64.

    bf16: :func:`bf16_half_spacing`. float32: ``min(nextafter(w, +inf) - w, w - nextafter(w, -inf)) / 2``.
    """
    if w.dtype == torch.bfloat16:
        return bf16_half_spacing(w).double()
    if w.dtype != torch.float32:
        raise ValueError(f"half_spacing handles bf16 and float32 weights, got {w.dtype}")
    up = torch.nextafter(w, torch.tensor(math.inf)).double() - w.double()
    down = w.double() - torch.nextafter(w, torch.tensor(-math.inf)).double()
    return torch.minimum(up, down) / 2


def count(mask: torch.Tensor) -> int:
    """The True elements of a bool tensor, without the int64 copy of the whole mask that ``mask.sum()`` makes
    (8 bytes per element: 2.1 GB for a (P,) mask of Gemma 3 270M)."""
    return int(torch.count_nonzero(mask))


def set_metrics(pred: torch.Tensor, true: torch.Tensor) -> dict[str, float]:
    """Precision |pred ∩ true|/|pred|, recall |pred ∩ true|/|true|, Jaccard |∩|/|∪| and size |pred|.

    ``pred`` and ``true`` are bool tensors of one shape. A ratio whose denominator is 0 is NaN.
    """
    if pred.dtype != torch.bool or true.dtype != torch.bool:
        raise ValueError(f"set_metrics needs bool masks, got {pred.dtype} and {true.dtype}")
    if pred.shape != true.shape:
        raise ValueError(f"set_metrics: mask shapes differ, pred {tuple(pred.shape)} vs true {tuple(true.shape)}")
    return count_metrics(count(pred), count(true), count(pred & true))


def sequence_logp(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """log p(response) per row: Σ over response tokens of the log-softmax at the drawn token, (N,) float32.

    ``input_ids``, ``attention_mask``, ``response_mask``: (N, L), right-padded rows; response_mask marks
    response tokens in the full row. The log-softmax runs in float32 whatever the model's dtype.
    Differentiable with respect to the model's parameters.
    """
    return _log_probs(model, input_ids, attention_mask, response_mask)[0]


def _log_probs(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence log p (N,), the float32 log-softmax (N, L-1, V), response positions (N, L-1) bool)."""
    _check_rows(input_ids, attention_mask, response_mask)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits  # (N, L, V)
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)  # (N, L-1, V); position t predicts t+1
    token_logp = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)  # (N, L-1)
    keep = response_mask[:, 1:].bool()
    return torch.where(keep, token_logp, torch.zeros_like(token_logp)).sum(-1), logp, keep


def token_kl(logp: torch.Tensor, ref_logp: torch.Tensor, keep: torch.Tensor) -> float:
    """Mean over response positions of KL(p_t ‖ p_ref,t) = Σ_v p_v (log p_v − log p_ref,v), in nats per token.

    ``logp``, ``ref_logp``: (N, L-1, V) float32 log-softmax of the current and the start model; ``keep``
    (N, L-1) bool marks the response positions. Summed in float64.
    """
    kl = (logp.exp() * (logp - ref_logp)).sum(-1).double()  # (N, L-1)
    n = int(keep.sum())
    return float(kl[keep].sum() / n) if n else float("nan")


STEP_REGIMES = (
    "rl",
    "rl_token",
    "distill_sampled",
    "distill_reverse_kl",
    "distill_forward_kl",
    "sft_drift",
    "sft_sampled",
)  # covgrad.regimes.objectives.REGIMES: every regime steps its own loss
TEACHER_REGIMES = ("distill_sampled", "distill_reverse_kl", "distill_forward_kl", "sft_drift")


@dataclass
class StepLoss:
    """The loss a step minimises: ``-mean_n J_n``, J_n the objective of one response in ``regime``
    (``covgrad.regimes.objectives``; its gradient with respect to the logits is ``-c_n / N``, c_n the regime's
    cotangent, so a step follows the regime's G):

    - ``rl``: ``-mean_n(A_n · log p(y_n))`` with the batch's sequence ``advantages`` (N,);
    - ``rl_token``, ``distill_sampled``: ``-mean_n Σ_t sg(A_t − b_t) · log p(y_t)``, the per-token
      coefficients of ``covgrad.regimes.objectives`` (the sequence advantage broadcast over tokens, the batch's
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
        full = logits.detach().float()  # (N, L, V) aligned as covgrad.regimes.objectives expects
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
    """torch.optim SGD (no momentum), Adam or AdamW with a linear warmup of the learning rate.

    ``weight_decay`` None keeps torch's default (0 for SGD and Adam, 0.01 for AdamW); ``warmup`` W > 0
    scales step t's learning rate (t from 1) by min(1, t / W); W = 0 keeps ``lr`` for every step.
    """

    name: str
    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float | None = None
    warmup: int = 0

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

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (from 1)."""
        return self.lr if self.warmup == 0 else self.lr * min(1.0, step / self.warmup)

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
    taken over (cast in place for ``bf16``). :attr:`model` is the analysed model.
    """

    def __init__(
        self, model: nn.Module, optimizer: OptimizerSpec, precision: str, loss: StepLoss | None = None
    ) -> None:
        _check_precision(precision)
        self.spec, self.precision, self.step = optimizer, precision, 0
        self.loss = StepLoss() if loss is None else loss
        self.master = model.to(torch.bfloat16) if precision == "bf16" else model
        self.model = copy.deepcopy(self.master).to(torch.bfloat16) if precision == "fp32_master" else self.master
        self._pairs = [
            (pm, pw)
            for (_, pm), (_, pw) in zip(self.master.named_parameters(), self.model.named_parameters(), strict=True)
            if pm.requires_grad
        ]
        self.opt = optimizer.build([pm for pm, _ in self._pairs])

    def backward(self, batch: Mapping[str, torch.Tensor], keep_logp: bool = False) -> dict:
        """Gradients of the regime's loss (:class:`StepLoss`) on the analysed model; returns ``loss`` and
        ``bound_a`` (floats) and, with ``keep_logp``, the detached ``logp`` (N, L-1, V) and ``keep`` (N, L-1)
        of the forward."""
        self.model.zero_grad(set_to_none=True)
        fwd = self.loss(self.model, batch)
        fwd["loss"].backward()
        out: dict = {"loss": float(fwd["loss"].detach()), "bound_a": fwd["bound_a"]}
        if keep_logp:
            out.update(logp=fwd["logp"].detach(), keep=fwd["keep"])
        return out

    def update(self) -> None:
        """One optimizer step from the gradients of the last :meth:`backward` at ``spec.lr_at(step + 1)``."""
        self.step += 1
        for group in self.opt.param_groups:
            group["lr"] = self.spec.lr_at(self.step)
        if self.model is not self.master:
            for pm, pw in self._pairs:
                pm.grad = None if pw.grad is None else pw.grad.float()
        self.opt.step()
        if self.model is not self.master:
            with torch.no_grad():
                for pm, pw in self._pairs:
                    pw.copy_(pm)  # round-to-nearest-even cast of the master

    def flat(self, layout: ParamLayout, grad: bool = False) -> torch.Tensor:
        """The analysed model's selected values (or their gradients, 0 where None), (P,) stored dtype."""
        params = dict(self.model.named_parameters())
        parts = []
        for e in layout.entries:
            p = params[e.name]
            t = p.grad if grad else p
            parts.append(torch.zeros(e.numel, dtype=p.dtype) if t is None else t.detach().reshape(-1))
        return torch.cat(parts)

    def state_dict(self) -> dict:
        """Plain dict: ``step`` int, ``weights`` {name: tensor} of the master, ``optimizer`` torch's state."""
        return {
            "step": self.step,
            "weights": {n: p.detach().clone() for n, p in self.master.named_parameters()},
            "optimizer": copy.deepcopy(self.opt.state_dict()),
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


@dataclass(frozen=True)
class StepZeroStats:
    """Step-0 predictors: F, G, ρ (P,) from the stats stage of the start policy, and the seed of the
    random baselines."""

    F: np.ndarray
    G: np.ndarray
    rho: np.ndarray
    seed: int = 0


RANDOM_CHUNK = 1 << 24  # values drawn per call by random_values


def random_values(seed: int, P: int, index: np.ndarray | None = None) -> np.ndarray:
    """The random predictor's values, float32: ``np.random.default_rng([seed, 0]).random(P)`` at the columns
    ``index`` ((n,) int64, ascending; None: all P), drawn in chunks of RANDOM_CHUNK so that a shard of a large
    model never holds all P (numpy's stream does not depend on how the draws are split)."""
    rng = np.random.default_rng([seed, 0])
    if index is None:
        return rng.random(P, dtype=np.float32)
    out = np.empty(index.shape[0], dtype=np.float32)
    at = 0
    for lo in range(0, P, RANDOM_CHUNK):
        hi = min(P, lo + RANDOM_CHUNK)
        chunk = rng.random(hi - lo, dtype=np.float32)
        n = int(np.searchsorted(index, hi)) - at
        out[at : at + n] = chunk[index[at : at + n] - lo]
        at += n
    return out


def _ranked_values(
    stats: StepZeroStats | None, start: torch.Tensor, seed: int, P: int, index: np.ndarray | None
) -> dict[str, tuple[np.ndarray, bool]]:
    """Predictor name -> ((n,) values at the tracker's columns, largest first?) of the ranked predictors: |w|
    and the seeded random values in float32, the statistics (already at those columns) in their own floating
    dtype."""
    n = start.numel()
    out = {
        "smallw": (start.float().abs().numpy(), False),
        "random": (random_values(seed, P, index), True),
    }
    if stats is not None:
        for name, v in (("F", stats.F), ("absG", np.abs(stats.G)), ("absrho", np.abs(stats.rho))):
            values = np.asarray(v).reshape(-1)
            if values.shape != (n,) or values.dtype not in (np.float32, np.float64):
                raise ValueError(f"step-0 statistic {name} is {values.dtype} {values.shape}, expected float ({n},)")
            out[name] = (values, True)
    return out


def stable_ranks(values: np.ndarray, largest: bool = True) -> np.ndarray:
    """(n,) rank of every value in the order of ``covgrad.moments.topk.top_k_masks``: largest (or smallest) first,
    ties by the lowest index, NaN ranked worst (tied with −inf for the largest, +inf for the smallest), −0
    tied with +0; so ``ranks < k`` is exactly ``top_k_masks(values, [k], largest)``. int32 below 2**31
    values, else int64. ``values``: (n,) float32 or float64."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    key = np.where(np.isnan(v), np.inf, -v if largest else v)
    order = np.argsort(key, kind="stable")
    ranks = np.empty(v.shape[0], dtype=np.int32 if v.shape[0] < 2**31 else np.int64)
    ranks[order] = np.arange(v.shape[0], dtype=ranks.dtype)
    return ranks


def group_ranks(values: np.ndarray, largest: bool = True, groups: np.ndarray | None = None) -> np.ndarray:
    """:func:`stable_ranks` within each group: (n,) the rank of every value among the values of its group
    (``groups`` (n,) int, None: one group), the order of :func:`stable_ranks` (ties by the lowest index)."""
    if groups is None:
        return stable_ranks(values, largest)
    v = np.asarray(values).reshape(-1)
    order = np.argsort(groups, kind="stable")
    ranks = np.empty(v.shape[0], dtype=np.int32 if v.shape[0] < 2**31 else np.int64)
    bounds = np.flatnonzero(np.diff(groups[order])) + 1
    for part in np.split(order, bounds):
        ranks[part] = stable_ranks(v[part], largest)
    return ranks


def count_metrics(n_pred: int, n_true: int, n_both: int) -> dict[str, float]:
    """:func:`set_metrics` from the counts |pred|, |true| and |pred ∩ true|."""
    n_union = n_pred + n_true - n_both
    return {
        "precision": n_both / n_pred if n_pred else float("nan"),
        "recall": n_both / n_true if n_true else float("nan"),
        "jaccard": n_both / n_union if n_union else float("nan"),
        "size": n_pred,
    }


# (values (n,), largest first?, groups (n,) int or None) -> (n,) int rank of each value within its group over
# every tracker's columns (group_ranks of the whole layout at these columns)
Ranker = Callable[[np.ndarray, bool, "np.ndarray | None"], np.ndarray]


@dataclass(frozen=True)
class TrackerShard:
    """The columns one :class:`ChangeTracker` of several keeps (a rank's shard of the layout,
    ``covgrad.distributed.stepper``) and how the trackers combine: ``total`` sums an int64 array over all of
    them (every tracker calls it in the same order), ``ranks`` ranks values over all their columns.

    Attributes:
        index: (n,) int64 global columns of the layout's flat axis, ascending; None: all of them.
    """

    index: np.ndarray | None
    total: Callable[[np.ndarray], np.ndarray]
    ranks: Ranker


WHOLE_LAYOUT = TrackerShard(None, lambda counts: counts, group_ranks)  # one tracker keeps every column


class ChangeTracker:
    """The per-step record of a trajectory (see :meth:`record`).

    ``start``: (n,) the analysed model's selected values at step 0 at the tracker's columns (``shard``; None:
    all P), stored dtype. ``stats``: step-0 F, G, ρ at the same columns for the F / |G| / |ρ| predictors and
    the bound rule (None: those are left out). ``optimizer``: which absorption rule applies. ``bound``:
    whether the regime has a bound (False for ``sft_sampled``: no bound rule).

    The ranked predictors are fixed for the whole run, so they are ranked once (globally, within each tensor
    for per-tensor random, within each |w_0| decile; over every shard's columns with ``shard.ranks``): a top-k
    set is then ``ranks < k``. With several shards every count is summed over them (``shard.total``, twice a
    step), so each shard's record is the whole layout's. Memory per column: 4 or 8 bytes for each of the 5
    global, 1 per-tensor and 4 decile rank arrays, the tensor and decile of each column (5 B), plus F in
    float64 for the SGD bound rule.
    """

    def __init__(
        self,
        layout: ParamLayout,
        start: torch.Tensor,
        optimizer: OptimizerSpec,
        stats: StepZeroStats | None = None,
        bound: bool = True,
        shard: TrackerShard | None = None,
    ) -> None:
        self.shard = WHOLE_LAYOUT if shard is None else shard
        index = self.shard.index
        n = layout.P if index is None else index.shape[0]
        if start.shape != (n,):
            raise ValueError(f"start has shape {tuple(start.shape)}, expected ({n},)")
        self.layout, self.spec, self.stats = layout, optimizer, stats
        self.start, self.prev = start.clone(), start.clone()
        self.counts = torch.zeros(n, dtype=torch.int32)  # steps that changed each coordinate
        self.last = torch.zeros(n, dtype=torch.bool)  # the previous step's changed set
        self.steps = 0  # steps recorded
        seed = 0 if stats is None else stats.seed
        values = _ranked_values(stats, start, seed, layout.P, index)
        self.rules = ("absorb", "bound") if optimizer.name == "sgd" and stats is not None and bound else ("absorb",)
        self.union = {r: torch.zeros(n, dtype=torch.bool) for r in self.rules}
        self.F = (
            None if "bound" not in self.rules else torch.from_numpy(np.asarray(stats.F, dtype=np.float64).reshape(-1))
        )
        rank = self.shard.ranks
        self.ranks = {name: rank(*values[name], None) for name in RANKED if name in values}
        E = len(layout.entries)
        if index is None:  # (n,) the layout tensor of each column
            self.tensor_of = np.repeat(np.arange(E, dtype=np.int32), [e.numel for e in layout.entries])
        else:
            ends = np.asarray([e.offset + e.numel for e in layout.entries], dtype=np.int64)
            self.tensor_of = np.searchsorted(ends, index, side="right").astype(np.int32)
        self.tensor_ranks = rank(values["random"][0], True, self.tensor_of)
        small = rank(start.float().abs().numpy(), False, None)
        self.decile = (small.astype(np.int64) * N_DECILES // max(layout.P, 1)).astype(np.int8)  # (n,) |w_0| decile
        self.decile_idx = [np.flatnonzero(self.decile == d) for d in range(N_DECILES)]
        edges = -(-np.arange(N_DECILES + 1, dtype=np.int64) * layout.P // N_DECILES)  # ⌈d·P/10⌉
        self.decile_sizes = np.diff(edges)  # (N_DECILES,) columns of each decile over the whole layout
        self.decile_ranks = {}
        for name in DECILE_PREDICTORS:
            if name in values:
                within = rank(*values[name], self.decile)
                self.decile_ranks[name] = [within[idx] for idx in self.decile_idx]

    def state_dict(self) -> dict:
        """Plain dict of tensors and ints (steps, start, prev, counts, last set, rule unions)."""
        return {
            "steps": self.steps,
            "start": self.start.clone(),
            "prev": self.prev.clone(),
            "counts": self.counts.clone(),
            "last": self.last.clone(),
            "union": {r: u.clone() for r, u in self.union.items()},
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.start, self.prev = state["start"].clone(), state["prev"].clone()
        self.counts, self.last = state["counts"].clone(), state["last"].clone()
        self.steps = int(state["steps"])
        self.union = {r: state["union"][r].clone() for r in self.rules}

    def rule_masks(self, prev: torch.Tensor, grad: torch.Tensor, lr: float, adv_rms: float) -> dict[str, torch.Tensor]:
        """(n,) bool predicted step sets from the weights ``prev`` before the step and its gradient ``grad``:
        ``absorb`` SGD lr·|ĝ| ≥ h(w), Adam/AdamW lr·|ĝ|/(|ĝ| + eps) ≥ h(w) (their first step);
        ``bound`` (SGD) lr·adv_rms·√F ≥ h(w); h = :func:`half_spacing` in the stored dtype, float64."""
        h = half_spacing(prev)
        g = grad.double().abs()
        step = lr * g if self.spec.name == "sgd" else lr * g / (g + ADAM_EPS)
        masks = {"absorb": step >= h}
        if "bound" in self.rules:
            assert self.F is not None
            masks["bound"] = lr * adv_rms * self.F.clamp(min=0).sqrt() >= h
        return masks

    def record(self, now: torch.Tensor, grad: torch.Tensor | None, lr: float, adv_rms: float) -> dict:
        """The record of one step from ``now`` (n,) stored dtype, the weights after it at the tracker's
        columns, and ``grad`` (n,), the gradient it stepped on (None: no rule predictors). With several
        shards every shard calls it for the same step; each gets the whole layout's record.

        Keys: ``changed`` (n/8,) uint8 bit-packed step set at the tracker's columns (``np.packbits``); per
        scope s in (step, cum): ``n_changed_{s}``, ``n_above_{s}`` (len(THRESHOLDS),) counts of |Δ| > threshold,
        ``sign_flips_{s}``, ``per_tensor_{s}`` (E,) changed counts, ``{s}_{predictor}_{stat}`` set metrics of
        the ranked predictors (size k = n_changed_{s}) and rules, and ``decile_{s}_{predictor}_{stat}``
        (N_DECILES,) the same within |w| deciles (k = changed count within the decile); ``jaccard_prev``
        (Jaccard of this and the previous step's sets; NaN at step 1) and ``persist_hist`` (t + 1,) int64, the
        number of coordinates changed in exactly j of the first t steps.
        """
        if now.shape != self.prev.shape or now.dtype != self.prev.dtype:
            raise ValueError(f"weights {tuple(now.shape)} {now.dtype} differ from the start's layout or dtype")
        rules = self.rule_masks(self.prev, grad, lr, adv_rms) if grad is not None else {}
        sets = {"step": now != self.prev, "cum": now != self.start}
        true = {scope: sets[scope].numpy() for scope in SCOPES}
        by_decile = {scope: [true[scope][idx] for idx in self.decile_idx] for scope in SCOPES}
        for r, m in rules.items():
            self.union[r] |= m
        preds = {
            (scope, r): (m if scope == "step" else self.union[r]).numpy() for r, m in rules.items() for scope in SCOPES
        }
        self.counts += sets["step"].to(torch.int32)
        now32, E = now.float(), len(self.layout.entries)
        local: list[np.ndarray] = []  # the first sum's parts, in this order
        for scope, base in (("step", self.prev), ("cum", self.start)):
            base32 = base.float()
            delta = (now32 - base32).abs()
            local.append(np.asarray([count(sets[scope]), count(torch.sign(now32) != torch.sign(base32))]))
            local.append(np.asarray([count(delta > t) for t in THRESHOLDS]))
            local.append(np.bincount(self.tensor_of[true[scope]], minlength=E))
            local.append(np.asarray([np.count_nonzero(t) for t in by_decile[scope]]))
            local.extend(
                np.asarray([np.count_nonzero(preds[scope, r]), np.count_nonzero(preds[scope, r] & true[scope])])
                for r in rules
            )
        local.append(np.asarray([count(self.last), count(sets["step"] & self.last)]))
        local.append(np.bincount(self.counts.numpy(), minlength=self.steps + 2))
        sums = iter(self._split(self.shard.total(np.concatenate(local).astype(np.int64)), local))
        rec: dict = {"changed": np.packbits(true["step"])}
        tensor_k, decile_k, rule_counts = {}, {}, {}
        for scope in SCOPES:
            n_true, flips = (int(x) for x in next(sums))
            rec[f"n_changed_{scope}"] = n_true
            rec[f"n_above_{scope}"] = next(sums)
            rec[f"sign_flips_{scope}"] = flips
            rec[f"per_tensor_{scope}"] = tensor_k[scope] = next(sums)
            decile_k[scope] = next(sums)
            rule_counts[scope] = {r: [int(x) for x in next(sums)] for r in rules}
        n_last, both = (int(x) for x in next(sums))
        rec["jaccard_prev"] = (
            count_metrics(rec["n_changed_step"], n_last, both)["jaccard"] if self.steps else float("nan")
        )
        self.steps += 1
        rec["persist_hist"] = next(sums)[: self.steps + 1]
        ranked = [self._ranked(true[s], by_decile[s], rec[f"n_changed_{s}"], tensor_k[s], decile_k[s]) for s in SCOPES]
        for scope, part in zip(SCOPES, self._split(self.shard.total(np.concatenate(ranked)), ranked), strict=True):
            n_true = rec[f"n_changed_{scope}"]
            rec.update(self._metrics(scope, part, n_true, rule_counts[scope], decile_k[scope]))
        self.prev, self.last = now.clone(), sets["step"]
        return rec

    @staticmethod
    def _split(values: np.ndarray, like: list[np.ndarray]) -> list[np.ndarray]:
        """``values`` cut into pieces of the lengths of ``like``'s arrays."""
        return np.split(values, np.cumsum([len(x) for x in like])[:-1])

    def _ranked(
        self, true: np.ndarray, by_decile: list[np.ndarray], k: int, tensor_k: np.ndarray, decile_k: np.ndarray
    ) -> np.ndarray:
        """The tracker's |pred ∩ true| counts at the changed set ``true`` (n,) (``by_decile``: its parts in each
        decile): each ranked predictor's at k (tensor_random at each tensor's changed count ``tensor_k`` (E,)),
        then each decile predictor's at every decile's changed count ``decile_k`` (N_DECILES,); int64."""
        out = []
        for name in RANKED:
            if name == "tensor_random":
                out.append(np.count_nonzero(true & (self.tensor_ranks < tensor_k[self.tensor_of])))
            elif name in self.ranks:
                out.append(np.count_nonzero(self.ranks[name][true] < k))
        for ranks in self.decile_ranks.values():
            out.extend(np.count_nonzero(ranks[d][t] < decile_k[d]) for d, t in enumerate(by_decile))
        return np.asarray(out, dtype=np.int64)

    def _metrics(self, scope: str, both: np.ndarray, k: int, rules: dict[str, list[int]], decile_k: np.ndarray) -> dict:
        """One scope's set metrics: the ranked predictors' and the deciles' from the summed counts of
        :meth:`_ranked`, the rules' from their summed (|pred|, |pred ∩ true|) ``rules``."""
        rec: dict = {}
        names = [n for n in RANKED if n == "tensor_random" or n in self.ranks]
        for name, n_both in zip(names, both, strict=False):
            rec.update({f"{scope}_{name}_{s}": v for s, v in count_metrics(k, k, int(n_both)).items()})
        for r, (n_pred, n_both) in rules.items():
            rec.update({f"{scope}_{r}_{s}": v for s, v in count_metrics(n_pred, k, n_both).items()})
        at = len(names)
        for name in self.decile_ranks:
            table = np.full((len(SET_STATS), N_DECILES), np.nan)
            for d in np.flatnonzero(self.decile_sizes):
                m = count_metrics(int(decile_k[d]), int(decile_k[d]), int(both[at + d]))
                table[:, d] = [m[s] for s in SET_STATS]
            at += N_DECILES
            rec.update({f"decile_{scope}_{name}_{s}": table[i] for i, s in enumerate(SET_STATS)})
        return rec


def run_trajectory(
    stepper: Stepper,
    source: FixedBatches | OnPolicy,
    layout: ParamLayout,
    steps: int,
    tracker: ChangeTracker | None = None,
    reference: nn.Module | None = None,
) -> Iterator[dict]:
    """Step from ``stepper.step`` up to ``steps``, yielding after each step its record: ``step``, ``lr``,
    ``loss``, ``adv_rms`` (the regime's bound scalar a on the step's rows, :class:`StepLoss`: sqrt(mean A²)
    for rl), ``reward`` (mean, NaN for fixed data), ``kl`` (per token to
    ``reference``, the start model; NaN without one) and, with ``tracker``, its :meth:`ChangeTracker.record`.

    The stepper's and tracker's state after a yield is the state to store (:func:`trajectory_state`).
    """
    if steps < 0:
        raise ValueError(f"steps must be >= 0, got {steps}")
    while stepper.step < steps:
        t = stepper.step + 1
        batch = source.batch(t, stepper.model)
        out = stepper.backward(batch, keep_logp=reference is not None)
        kl = float("nan")
        if reference is not None:
            with torch.no_grad():
                rows = (batch["input_ids"], batch["attention_mask"], batch["response_mask"])
                ref_logp = _log_probs(reference, *rows)[1]
            kl = token_kl(out["logp"], ref_logp, out["keep"])
        rec = {
            "step": t,
            "lr": stepper.spec.lr_at(t),
            "loss": out["loss"],
            "adv_rms": out["bound_a"],
            "reward": float(batch["reward"].double().mean()) if "reward" in batch else float("nan"),
            "kl": kl,
        }
        grad = stepper.flat(layout, grad=True) if tracker is not None else None
        stepper.update()
        if tracker is not None:
            rec.update(tracker.record(stepper.flat(layout), grad, rec["lr"], rec["adv_rms"]))
        yield rec


def checkpoint_records(series: Iterable[tuple[int, torch.Tensor]], tracker: ChangeTracker) -> Iterator[dict]:
    """The records of an external run from its checkpoints after the first: ``series`` yields (trainer step,
    (P,) selected weights in the checkpoint's stored dtype) in step order, starting after the tracker's
    start. Each record is :meth:`ChangeTracker.record` (no rule predictors: the steps' gradients are
    unknown) with ``step`` the trainer's step and ``lr``, ``loss``, ``adv_rms``, ``reward``, ``kl`` NaN."""
    nan = float("nan")
    for step, flat in series:
        rec = {"step": int(step), "lr": nan, "loss": nan, "adv_rms": nan, "reward": nan, "kl": nan}
        rec.update(tracker.record(flat, None, nan, nan))
        yield rec


def persistence(records: Sequence[Mapping], P: int, ks: Sequence[int] = (1, 2, 4, 8)) -> dict[str, float]:
    """Persistence over the n = len(records) steps of a run: ``jaccard_prev_mean`` (mean Jaccard of
    consecutive steps' changed sets, steps 2..n), ``frac_ge_{k}`` (fraction of the P coordinates changed
    in at least k of the n steps, from the last ``persist_hist``), ``frac_step_mean`` (mean per-step changed
    fraction) and ``frac_cum`` (cumulative changed fraction after step n)."""
    if not records:
        raise ValueError("persistence needs at least one step record")
    hist = np.asarray(records[-1]["persist_hist"], dtype=np.int64)
    consecutive = [float(r["jaccard_prev"]) for r in records[1:]]
    out = {
        "jaccard_prev_mean": float(np.mean(consecutive)) if consecutive else float("nan"),
        "frac_step_mean": float(np.mean([r["n_changed_step"] for r in records])) / P,
        "frac_cum": records[-1]["n_changed_cum"] / P,
    }
    out.update({f"frac_ge_{k}": int(hist[k:].sum()) / P for k in ks})
    return out


def trajectory_state(stepper: Stepper, tracker: ChangeTracker | None, seed: int) -> dict:
    """Everything a resumed run needs, a plain dict of tensors and ints: ``step``, ``seed``, ``stepper``
    (weights, optimizer state) and ``tracker`` (None without one)."""
    return {
        "step": stepper.step,
        "seed": seed,
        "stepper": stepper.state_dict(),
        "tracker": None if tracker is None else tracker.state_dict(),
    }


def load_trajectory_state(state: Mapping, stepper: Stepper, tracker: ChangeTracker | None, seed: int) -> None:
    """Restore :func:`trajectory_state`'s output into a freshly built stepper (and tracker) of the same run."""
    if int(state["seed"]) != seed:
        raise ValueError(f"the stored trajectory state has seed {state['seed']}, this run has seed {seed}")
    stepper.load_state_dict(state["stepper"])
    if tracker is not None:
        tracker.load_state_dict(state["tracker"])


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


def checkpoint_steps(steps: int, ratio: float) -> list[int]:
    """The steps that get a Hugging Face checkpoint: floor(ratio**i) for i = 0, 1, … up to ``steps``, and
    ``steps`` itself (ratio 2: 1, 2, 4, 8, …, K); none for ratio 0."""
    if ratio == 0:
        return []
    out, i = {steps}, 0
    while ratio**i <= steps:
        out.add(int(ratio**i))
        i += 1
    return sorted(out)
