"""Post-training regimes as logit-space cotangents: rl, rl_token, distill, sft (see docs/regimes.md).

Every regime is an objective J_n of one response n whose gradient ∇θ J_n = Σ_t J_tᵀ c_t (J_t = ∂z_t/∂θ) is
fixed by its logit-space cotangent c_t = ∂J_n/∂z_t. Pushed through the same per-sample hooks as the score
(:class:`covgrad.scores.persample.PerSampleGrads`, which takes any ``dlogits_fn``), c gives the regime's per-sample
gradient g_n; the regime's G = mean_n g_n is the ascent direction of its objective (a training step follows
+G). For distillation J = −Σ_t KL, so G points towards the teacher. The cotangents (p = softmax(z/τ),
e_y the drawn token's indicator, w_t the response weight, all divided by τ like the score):

============================  ==========================================  ==============================
regime                        J_n (advantages and baselines stop-grad)    c_t (before the factor w_t/τ)
============================  ==========================================  ==============================
``rl``                        A_n Σ_t log p(y_t)                          A_n (e_y − p)
``rl_token``                  Σ_t (A_t − b_t) log p(y_t)                  (A_t − b_t)(e_y − p)
``distill_sampled``           rl_token, A_t = log q(y_t) − log p(y_t)     (A_t − b_t)(e_y − p)
``distill_reverse_kl``        −Σ_t KL(p_t‖q_t)                            −p ⊙ (ℓ − KL_t), ℓ = log p − log q
``distill_forward_kl``        −Σ_t KL(q_t‖p_t)                            q − p
``sft_drift``                 Σ_t Σ_v μ_v log p_v (μ known)               μ − p
``sft_sampled``               Σ_t log p(y_t), y ~ μ                       e_y − p
============================  ==========================================  ==============================

Each regime also has a bound scalar per sequence, c²_n, with |G_i| ≤ √(mean_n c²_n)·√F_i in expectation,
F_i = E Σ_t f_{t,i} the token Fisher summed at the regime's prefixes (the policy's F on its own samples; on
SFT data from μ, the token Fisher at μ's prefixes, not the score's second moment there). The scalars:
Σ_t (A_t − b_t)² (rl_token, distill_sampled; Σ_t A_n² for rl, whose own R1 bound std(A)·√F is tighter by up
to √T), Σ_t Var_{p_t}(ℓ) (reverse KL), Σ_t χ²(q_t‖p_t) (forward KL), Σ_t χ²(μ_t‖p_t) (sft_drift); none for
sft_sampled (μ unknown).

Alignment is :func:`covgrad.scores.persample.score_logit_grad`'s: ``logits[:, t]`` predicts ``input_ids[:, t + 1]``;
token-aligned tensors (``response_mask``, per-token advantages, baselines, teacher log-probs of the drawn
tokens) have entry t for token t (entry 0 is never scored); distribution-aligned tensors (teacher or
reference logits, μ) are aligned like ``logits``. Cotangents are float32 (float64 for float64 logits),
zero at unscored positions and at position L − 1; sums over positions are float64.

Use: ``fn = RegimeGrad(Regime("distill_reverse_kl"), ids, response_mask, teacher_logits=zq)``, then
``PerSampleGrads(model, layout)(ids, attention_mask, fn, position_ids=pos)`` gives the (B, P) rows g_n and
``fn.bound_sq`` the (B,) bound scalars; :class:`RegimeMoments` folds them per parity half instead.

Shape notation: B samples in the batch, L sequence positions (prompt, response and padding), V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch
from torch import Tensor

from covgrad.moments.accum import GroupAccumulator

if TYPE_CHECKING:
    from collections.abc import Sequence

    from covgrad.config import RegimeSection
    from covgrad.scores.persample import Cotangent, PerSampleGrads

REGIMES = (
    "rl",
    "rl_token",
    "distill_sampled",
    "distill_reverse_kl",
    "distill_forward_kl",
    "sft_drift",
    "sft_sampled",
)
LENGTH_NORMS = ("none", "response_length", "constant")


def _dtype(logits: Tensor) -> torch.dtype:
    """Compute dtype: float64 for float64 logits, else float32."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _check(logits: Tensor, input_ids: Tensor | None, response_mask: Tensor, temperature: float) -> None:
    """The common argument checks of every cotangent (shapes, first position unscored, ids, τ)."""
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape (B, L, V); got {tuple(logits.shape)}")
    B, L, V = logits.shape
    if response_mask.shape != (B, L):
        raise ValueError(f"response_mask {tuple(response_mask.shape)} must have the logits' (B, L) = {(B, L)}")
    if input_ids is not None:
        if input_ids.shape != (B, L):
            raise ValueError(f"input_ids {tuple(input_ids.shape)} must have the logits' (B, L) = {(B, L)}")
        if int(input_ids.min()) < 0 or int(input_ids.max()) >= V:
            raise ValueError(f"input_ids must lie in [0, {V}); got [{int(input_ids.min())}, {int(input_ids.max())}]")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    if bool((response_mask[:, 0] != 0).any()):
        raise ValueError("response_mask[:, 0] must be 0 (no logit predicts the first token); shift the mask")


def _same_shape(name: str, t: Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}; got {tuple(t.shape)}")


@dataclass(frozen=True)
class _Rows:
    """The scored logit positions of a batch, n of them: logit position t of sample b is row b·L + t of the
    flattened (B·L, V) logits and predicts token-aligned entry b·L + t + 1."""

    B: int
    L: int
    flat: Tensor  # (n,) int64 row of each scored logit position
    sample: Tensor  # (n,) int64 sample of each
    weight: Tensor  # (n,) float64 response weight w_{t+1}

    @staticmethod
    def of(response_mask: Tensor) -> _Rows:
        B, L = response_mask.shape
        b, t = torch.nonzero(response_mask[:, 1:] != 0, as_tuple=True)
        return _Rows(B, L, b * L + t, b, response_mask[:, 1:][b, t].to(torch.float64))

    def take(self, x: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """Rows (n, V) of a (B, L, V) tensor aligned like the logits (a copy, in ``dtype``)."""
        # advanced indexing copies whole rows; index_select was 3-30x slower on a CPU for (n, 49152) rows
        rows = x.reshape(self.B * self.L, x.shape[-1])[self.flat.to(x.device)]
        return rows if dtype is None else rows.to(dtype)

    def tokens(self, x: Tensor) -> Tensor:
        """The (n,) entries of a token-aligned (B, L) tensor at the tokens the rows predict."""
        return x.reshape(-1)[(self.flat + 1).to(x.device)]

    def place(self, rows: Tensor, V: int) -> Tensor:
        """A (B, L, V) tensor, zero but for ``rows`` (n, V) at the scored logit positions."""
        out = torch.zeros(self.B * self.L, V, dtype=rows.dtype, device=rows.device)
        out.index_copy_(0, self.flat.to(rows.device), rows)
        return out.view(self.B, self.L, V)

    def place_tokens(self, values: Tensor) -> Tensor:
        """A token-aligned (B, L) float64 tensor, zero but for ``values`` (n,) at the scored tokens."""
        out = torch.zeros(self.B * self.L, dtype=torch.float64, device=values.device)
        out.index_copy_(0, (self.flat + 1).to(values.device), values.to(torch.float64))
        return out.view(self.B, self.L)

    def per_sample(self, values: Tensor) -> Tensor:
        """Σ over each sample's rows of ``values`` (n,): shape (B,) float64."""
        out = torch.zeros(self.B, dtype=torch.float64, device=values.device)
        return out.index_add_(0, self.sample.to(values.device), values.to(torch.float64))


def _drawn_logprobs(logits: Tensor, input_ids: Tensor, rows: _Rows, temperature: float) -> Tensor:
    """log softmax(z/τ) of the drawn token at every scored row: shape (n,), the compute dtype."""
    logp = torch.log_softmax(rows.take(logits, _dtype(logits)) / temperature, dim=-1)  # (n, V)
    return logp.gather(-1, rows.tokens(input_ids)[:, None].long().to(logp.device))[:, 0]


def token_advantages(advantages: Tensor, response_mask: Tensor) -> Tensor:
    """Per-token advantages (B, L) from a sequence advantage (B,) (broadcast over scored tokens) or a
    token-aligned (B, L) tensor (returned masked), float64."""
    B, L = response_mask.shape
    a = torch.as_tensor(advantages).to(torch.float64)
    scored = response_mask != 0
    if a.shape == (B,):
        return a[:, None] * scored
    _same_shape("advantages", a, (B, L))
    return a * scored


def kl_penalty(
    logits: Tensor,
    ref_logits: Tensor,
    input_ids: Tensor,
    response_mask: Tensor,
    beta: float,
    temperature: float = 1.0,
    reward_to_go: bool = False,
) -> Tensor:
    """Per-token KL-penalty advantages −β·(log p(y_t) − log p_ref(y_t)), token-aligned (B, L) float64.

    Both distributions are taken at temperature τ. With ``reward_to_go`` token t gets the sum of the
    penalties of tokens t, t+1, … of its response (the REINFORCE return of a per-token reward); otherwise
    its own (the per-token estimator k1 of KL(p‖p_ref), as PPO-style per-token rewards use it).
    """
    _check(logits, input_ids, response_mask, temperature)
    _same_shape("ref_logits", ref_logits, tuple(logits.shape))
    rows = _Rows.of(response_mask)
    k = _drawn_logprobs(logits, input_ids, rows, temperature) - _drawn_logprobs(
        ref_logits, input_ids, rows, temperature
    )
    pen = rows.place_tokens(-beta * k.to(torch.float64))  # (B, L)
    if reward_to_go:
        pen = pen.flip(1).cumsum(1).flip(1) * (response_mask != 0)
    return pen


def length_normalise(
    advantages: Tensor, response_mask: Tensor, mode: str = "none", max_length: int | None = None
) -> Tensor:
    """GRPO length normalisations of token-aligned advantages (B, L), float64.

    ``"response_length"``: divide each response's advantages by its number of scored tokens (GRPO's
    per-sequence token mean); ``"constant"``: divide by ``max_length`` (Dr. GRPO's constant normaliser);
    ``"none"``: unchanged.
    """
    if mode not in LENGTH_NORMS:
        raise ValueError(f"length normalisation {mode!r} is not one of {LENGTH_NORMS}")
    a = advantages.to(torch.float64)
    if mode == "response_length":
        n = (response_mask != 0).sum(1, dtype=torch.float64).clamp(min=1)  # (B,)
        return a / n[:, None]
    if mode == "constant":
        if max_length is None or max_length < 1:
            raise ValueError(f"length normalisation 'constant' needs max_length >= 1; got {max_length}")
        return a / max_length
    return a


def _coefficients(advantages: Tensor, response_mask: Tensor, baseline: Tensor | None) -> Tensor:
    """(A_t − b_t) masked, token-aligned (B, L) float64."""
    coef = token_advantages(advantages, response_mask)
    if baseline is not None:
        _same_shape("baseline", baseline, tuple(response_mask.shape))
        coef = coef - torch.as_tensor(baseline).to(coef.device, torch.float64) * (response_mask != 0)
    return coef


def token_advantage_logit_grad(
    logits: Tensor,
    input_ids: Tensor,
    response_mask: Tensor,
    advantages: Tensor,
    baseline: Tensor | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """Cotangent of J_n = Σ_t w_t (A_t − b_t) log p(y_t) (A, b held constant): w (A_t − b_t)(e_y − p)/τ.

    Args:
        logits: shape (B, L, V); ``logits[:, t]`` predicts ``input_ids[:, t + 1]``.
        input_ids: shape (B, L) token ids.
        response_mask: shape (B, L) token weights w_t (0 on prompt and padding, entry 0 is 0).
        advantages: shape (B,) sequence advantages (regime ``rl``) or (B, L) token-aligned A_t.
        baseline: shape (B, L) token-aligned b_t, a function of the prefix only (None: 0).
        temperature: τ > 0 that divides the logits.

    Returns:
        shape (B, L, V) cotangent, zero at position L − 1 and unscored positions.
    """
    _check(logits, input_ids, response_mask, temperature)
    rows = _Rows.of(response_mask)
    coef = rows.tokens(_coefficients(advantages, response_mask, baseline))  # (n,)
    return rows.place(_advantage_rows(logits, input_ids, rows, coef, temperature), logits.shape[-1])


def _advantage_rows(logits: Tensor, input_ids: Tensor, rows: _Rows, coef: Tensor, temperature: float) -> Tensor:
    """Rows (n, V) of w (A − b)(e_y − p)/τ for the (n,) coefficients A − b."""
    p = torch.softmax(rows.take(logits, _dtype(logits)) / temperature, dim=-1)  # (n, V)
    d = p.neg_()
    d.scatter_add_(-1, rows.tokens(input_ids)[:, None].long().to(d.device), torch.ones_like(d[:, :1]))  # e_y − p
    return d.mul_((coef.to(d.device) * rows.weight.to(d.device) / temperature).to(d.dtype)[:, None])


def _reverse_kl_rows(
    logits: Tensor, teacher_logits: Tensor, rows: _Rows, temperature: float, teacher_temperature: float
) -> tuple[Tensor, Tensor, Tensor]:
    """At the scored rows: the cotangent −w p⊙(ℓ − KL)/τ (n, V), KL(p‖q) (n,) and Var_p(ℓ) (n,)."""
    dtype = _dtype(logits)
    logp = torch.log_softmax(rows.take(logits, dtype) / temperature, dim=-1)  # (n, V)
    ell = logp - torch.log_softmax(rows.take(teacher_logits, dtype) / teacher_temperature, dim=-1)  # ℓ
    p = logp.exp_()
    kl = torch.linalg.vecdot(p, ell)  # (n,)
    if not bool(torch.isfinite(kl).all()):  # −inf logits: a token p never emits contributes 0
        ell = torch.where(p > 0, ell, torch.zeros_like(ell))
        kl = torch.linalg.vecdot(p, ell)
        if not bool(torch.isfinite(kl).all()):
            raise ValueError("the teacher gives probability 0 to a token the policy can emit: KL(p‖q) is infinite")
    d = ell.sub_(kl[:, None])  # ℓ − KL
    c = p.mul_(d)  # p⊙(ℓ − KL)
    var = torch.linalg.vecdot(c, d)  # Σ_v p_v (ℓ_v − KL)²
    c.mul_((-rows.weight.to(c.device) / temperature).to(c.dtype)[:, None])
    return c, kl, var


def distill_sampled_advantages(
    logits: Tensor,
    input_ids: Tensor,
    response_mask: Tensor,
    teacher_logits: Tensor | None = None,
    teacher_logprobs: Tensor | None = None,
    temperature: float = 1.0,
    teacher_temperature: float = 1.0,
    baseline: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Sampled-token distillation advantages A_t = log q(y_t) − log p(y_t) and the baseline −KL(p_t‖q_t).

    Args:
        logits, input_ids, response_mask: as :func:`token_advantage_logit_grad`.
        teacher_logits: shape (B, L, V) aligned like ``logits`` (q = softmax(z_q / τ_q)), or None.
        teacher_logprobs: shape (B, L) token-aligned log q(y_t) (an imported ``teacher_logprobs`` field),
            used when ``teacher_logits`` is None.
        temperature: the policy's τ; teacher_temperature: the teacher's τ_q.
        baseline: also return b_t = −KL(p_t‖q_t) (needs ``teacher_logits``).

    Returns:
        (A, b): token-aligned (B, L) float64 tensors, zero at unscored tokens; b is None unless asked for.
    """
    _check(logits, input_ids, response_mask, temperature)
    rows = _Rows.of(response_mask)
    if teacher_logits is not None:
        _same_shape("teacher_logits", teacher_logits, tuple(logits.shape))
        logq = _drawn_logprobs(teacher_logits, input_ids, rows, teacher_temperature)
    elif teacher_logprobs is not None:
        _same_shape("teacher_logprobs", teacher_logprobs, tuple(response_mask.shape))
        logq = rows.tokens(teacher_logprobs)
    else:
        raise ValueError("sampled-token distillation needs teacher_logits or teacher_logprobs")
    logp = _drawn_logprobs(logits, input_ids, rows, temperature)
    adv = rows.place_tokens(logq.to(logp.device, torch.float64) - logp.to(torch.float64))
    if not baseline:
        return adv, None
    if teacher_logits is None:
        raise ValueError("the baseline −KL(p_t‖q_t) needs the teacher's full distribution (teacher_logits)")
    kl = _reverse_kl_rows(logits, teacher_logits, rows, temperature, teacher_temperature)[1]
    return adv, rows.place_tokens(-kl)


def reverse_kl_logit_grad(
    logits: Tensor,
    teacher_logits: Tensor,
    response_mask: Tensor,
    temperature: float = 1.0,
    teacher_temperature: float = 1.0,
) -> Tensor:
    """Cotangent of J_n = −Σ_t w_t KL(p_t‖q_t) (q constant): −w p ⊙ (ℓ − KL_t)/τ, ℓ = log p − log q.

    Args:
        logits: shape (B, L, V) of the policy (p = softmax(z/τ)).
        teacher_logits: shape (B, L, V) aligned like ``logits`` (q = softmax(z_q/τ_q)).
        response_mask: shape (B, L) token weights (entry 0 is 0).

    Returns:
        shape (B, L, V) cotangent, zero at position L − 1 and unscored positions.

    Raises:
        ValueError: on mismatched shapes, or when q_v = 0 where p_v > 0 (infinite KL).
    """
    _check(logits, None, response_mask, temperature)
    _same_shape("teacher_logits", teacher_logits, tuple(logits.shape))
    rows = _Rows.of(response_mask)
    c = _reverse_kl_rows(logits, teacher_logits, rows, temperature, teacher_temperature)[0]
    return rows.place(c, logits.shape[-1])


def _probs_rows(name: str, q: Tensor, logits: Tensor, rows: _Rows) -> Tensor:
    """Validated distribution rows (n, V) of ``q`` (aligned like the logits) at the scored rows."""
    _same_shape(name, q, tuple(logits.shape))
    qr = rows.take(q, _dtype(logits))
    sums = qr.sum(-1)
    if qr.shape[0] and (bool((qr < 0).any()) or bool(((sums - 1).abs() > 1e-3).any())):
        raise ValueError(
            f"{name} rows at scored positions must be probability vectors (non-negative, summing to 1); got "
            f"sums in [{float(sums.min()):.4g}, {float(sums.max()):.4g}]"
        )
    return qr


def _drift_rows(logits: Tensor, q: Tensor, logq: Tensor, rows: _Rows, temperature: float) -> tuple[Tensor, Tensor]:
    """At the scored rows, for q (n, V) and its log: the cotangent w (q − p)/τ (n, V) and χ²(q‖p) (n,),
    computed as Σ_v p_v expm1(log q_v − log p_v)² (accurate when q is near p; q_v = 0 gives p_v)."""
    logp = torch.log_softmax(rows.take(logits, q.dtype) / temperature, dim=-1)  # (n, V)
    r = torch.expm1(logq - logp)  # q/p − 1
    p = logp.exp_()
    chi2 = torch.linalg.vecdot(p * r, r)
    c = q - p
    return c.mul_((rows.weight.to(c.device) / temperature).to(c.dtype)[:, None]), chi2


def drift_logit_grad(logits: Tensor, q: Tensor, response_mask: Tensor, temperature: float = 1.0) -> Tensor:
    """Cotangent of J_n = Σ_t w_t Σ_v q_v log p_v (q constant): w (q − p)/τ.

    With q the teacher this is forward-KL distillation (−KL(q‖p) differs by q's entropy, a constant);
    with q = μ, the known distribution of SFT data, it is the SFT drift.

    Args:
        logits: shape (B, L, V) of the policy.
        q: shape (B, L, V) probabilities aligned like ``logits``.
        response_mask: shape (B, L) token weights (entry 0 is 0).

    Returns:
        shape (B, L, V) cotangent, zero at position L − 1 and unscored positions.

    Raises:
        ValueError: on mismatched shapes, or rows of q at scored positions that are not probabilities.
    """
    _check(logits, None, response_mask, temperature)
    rows = _Rows.of(response_mask)
    qr = _probs_rows("q", q, logits, rows)
    p = torch.softmax(rows.take(logits, qr.dtype) / temperature, dim=-1)
    c = qr.sub_(p).mul_((rows.weight.to(p.device) / temperature).to(p.dtype)[:, None])
    return rows.place(c, logits.shape[-1])


def advantage_sq_sums(advantages: Tensor, response_mask: Tensor, baseline: Tensor | None = None) -> Tensor:
    """Σ_t (w_t (A_t − b_t))² per sequence: shape (B,) float64 (the rl_token bound's a² = its mean)."""
    coef = _coefficients(advantages, response_mask, baseline) * response_mask.to(torch.float64)
    return (coef * coef)[:, 1:].sum(1)


def reverse_kl_var_sums(
    logits: Tensor,
    teacher_logits: Tensor,
    response_mask: Tensor,
    temperature: float = 1.0,
    teacher_temperature: float = 1.0,
) -> Tensor:
    """Σ_t w_t² Var_{v~p_t}(ℓ_v), ℓ = log p − log q, per sequence: shape (B,) float64."""
    _check(logits, None, response_mask, temperature)
    _same_shape("teacher_logits", teacher_logits, tuple(logits.shape))
    rows = _Rows.of(response_mask)
    var = _reverse_kl_rows(logits, teacher_logits, rows, temperature, teacher_temperature)[2]
    return rows.per_sample(rows.weight.to(var.device) ** 2 * var.to(torch.float64))


def chi2_sums(logits: Tensor, q: Tensor, response_mask: Tensor, temperature: float = 1.0) -> Tensor:
    """Σ_t w_t² χ²(q_t‖p_t), χ² = Σ_v q_v²/p_v − 1 = Var_{v~p}(q_v/p_v), per sequence: shape (B,) float64.

    Computed as Σ_v p_v (q_v/p_v − 1)² with the ratio in log space, so tiny p_v do not overflow it and a
    near-policy q keeps its small χ² (no cancellation against the 1).
    """
    _check(logits, None, response_mask, temperature)
    rows = _Rows.of(response_mask)
    qr = _probs_rows("q", q, logits, rows)
    chi2 = _drift_rows(logits, qr, torch.log(qr), rows, temperature)[1]
    return rows.per_sample(rows.weight.to(chi2.device) ** 2 * chi2.to(torch.float64))


@dataclass(frozen=True)
class Regime:
    """One analysed objective and its options.

    Attributes:
        kind: one of :data:`REGIMES`.
        temperature: the policy's τ (p = softmax(z/τ)).
        teacher_temperature: τ_q of the teacher's logits (distill regimes).
        kl_beta: β of the KL penalty to a reference (``rl_token``; needs ``ref_logits``).
        kl_reward_to_go: sum the KL penalties from each token to the end of its response.
        length_norm: one of :data:`LENGTH_NORMS`, applied (``rl_token``) to the advantages after the KL
            penalty is added (GRPO normalises the whole per-token loss, its KL term included).
        max_length: the constant of ``length_norm="constant"``.
        baseline: ``distill_sampled``: subtract b_t = −KL(p_t‖q_t) (needs ``teacher_logits``).
    """

    kind: Literal[
        "rl", "rl_token", "distill_sampled", "distill_reverse_kl", "distill_forward_kl", "sft_drift", "sft_sampled"
    ]
    temperature: float = 1.0
    teacher_temperature: float = 1.0
    kl_beta: float = 0.0
    kl_reward_to_go: bool = False
    length_norm: str = "none"
    max_length: int | None = None
    baseline: bool = False

    def __post_init__(self) -> None:
        if self.kind not in REGIMES:
            raise ValueError(f"regime {self.kind!r} is not one of {REGIMES}")
        if self.length_norm not in LENGTH_NORMS:
            raise ValueError(f"length_norm {self.length_norm!r} is not one of {LENGTH_NORMS}")
        if self.length_norm == "constant" and (self.max_length is None or self.max_length < 1):
            raise ValueError(f"length_norm 'constant' needs max_length >= 1; got {self.max_length}")
        if not self.temperature > 0 or not self.teacher_temperature > 0:
            raise ValueError(f"temperatures must be > 0; got {self.temperature}, {self.teacher_temperature}")


class RegimeGrad:
    """The ``dlogits_fn`` of one regime on one batch, for :class:`covgrad.scores.persample.PerSampleGrads`.

    Called with the batch's detached logits (B, L, V) it returns the regime's cotangent and records, from
    the same logits, ``bound_sq`` (B,) float64: the regime's bound scalar per sequence (None for
    ``sft_sampled``), and ``token_adv`` (B, L) float64: the effective A_t − b_t (the rl-type regimes).

    Args:
        regime: the objective.
        input_ids: shape (B, L) token ids; response_mask: shape (B, L) token weights (entry 0 is 0).
        advantages: (B,) sequence advantages (``rl``; ``rl_token`` broadcasts them) or (B, L) token-aligned
            (``rl_token``: an imported ``advantages`` field); None in ``rl_token`` means 0 (KL penalty only).
        baseline: (B, L) token-aligned prefix-only b_t (``rl_token``), or None.
        teacher_logits: (B, L, V) aligned like the logits (distill regimes; also ``sft_drift``'s μ when
            ``mu`` is None).
        teacher_logprobs: (B, L) token-aligned log q(y_t) (``distill_sampled`` without teacher logits).
        ref_logits: (B, L, V) of the KL-penalty reference (``rl_token`` with ``kl_beta``).
        mu: (B, L, V) probabilities of the SFT data distribution (``sft_drift``).
    """

    def __init__(
        self,
        regime: Regime,
        input_ids: Tensor,
        response_mask: Tensor,
        *,
        advantages: Tensor | None = None,
        baseline: Tensor | None = None,
        teacher_logits: Tensor | None = None,
        teacher_logprobs: Tensor | None = None,
        ref_logits: Tensor | None = None,
        mu: Tensor | None = None,
    ) -> None:
        r = regime
        need = {
            "rl": [("advantages", advantages)],
            "rl_token": [("ref_logits", ref_logits)] if r.kl_beta else [],
            "distill_sampled": [
                ("teacher_logits or teacher_logprobs", teacher_logits if teacher_logprobs is None else teacher_logprobs)
            ],
            "distill_reverse_kl": [("teacher_logits", teacher_logits)],
            "distill_forward_kl": [("teacher_logits", teacher_logits)],
            "sft_drift": [("mu or teacher_logits", mu if mu is not None else teacher_logits)],
            "sft_sampled": [],
        }[r.kind]
        missing = [name for name, value in need if value is None]
        if missing:
            raise ValueError(f"regime {r.kind!r} needs {', '.join(missing)}")
        if r.kind == "distill_sampled" and r.baseline and teacher_logits is None:
            raise ValueError("distill_sampled with baseline needs teacher_logits (the baseline is −KL(p_t‖q_t))")
        if r.kind == "rl" and torch.as_tensor(advantages).dim() != 1:
            raise ValueError("regime 'rl' takes sequence advantages (B,); use 'rl_token' for per-token ones")
        self.regime = r
        self.input_ids, self.response_mask = input_ids, response_mask
        self.advantages, self.baseline = advantages, baseline
        self.teacher_logits, self.teacher_logprobs = teacher_logits, teacher_logprobs
        self.ref_logits, self.mu = ref_logits, mu
        self.bound_sq: Tensor | None = None
        self.token_adv: Tensor | None = None

    def __call__(self, logits: Tensor) -> Tensor:
        """The cotangent (B, L, V) of the regime's objective at ``logits``; sets ``bound_sq``, ``token_adv``."""
        r, dev = self.regime, logits.device
        ids, mask = self.input_ids.to(dev), self.response_mask.to(dev)
        z, tau, V = logits.detach(), r.temperature, logits.shape[-1]
        _check(z, ids, mask, tau)
        rows = _Rows.of(mask)
        if r.kind in ("distill_reverse_kl", "distill_forward_kl", "sft_drift"):
            for name, t in (("teacher_logits", self.teacher_logits), ("mu", self.mu)):
                if t is not None:
                    _same_shape(name, t, tuple(z.shape))
            if r.kind == "distill_reverse_kl":
                c, _, scalar = _reverse_kl_rows(z, self.teacher_logits.to(dev), rows, tau, r.teacher_temperature)
            else:
                if r.kind == "sft_drift" and self.mu is not None:
                    q = _probs_rows("mu", self.mu.to(dev), z, rows)
                    logq = torch.log(q)
                else:
                    logq = torch.log_softmax(
                        rows.take(self.teacher_logits.to(dev), _dtype(z)) / r.teacher_temperature, -1
                    )
                    q = logq.exp()
                c, scalar = _drift_rows(z, q, logq, rows, tau)
            self.bound_sq = rows.per_sample(rows.weight.to(dev) ** 2 * scalar.to(torch.float64))
            return rows.place(c, V)
        if r.kind == "sft_sampled":  # the plain score at μ's samples; μ unknown, so no bound scalar
            self.bound_sq = None
            ones = torch.ones(rows.flat.shape[0], dtype=torch.float64, device=dev)
            return rows.place(_advantage_rows(z, ids, rows, ones, tau), V)
        b = None
        if r.kind == "rl":
            adv = token_advantages(torch.as_tensor(self.advantages).to(dev), mask)
        elif r.kind == "rl_token":
            if self.advantages is None:
                adv = torch.zeros(mask.shape, dtype=torch.float64, device=dev)
            else:
                adv = token_advantages(torch.as_tensor(self.advantages).to(dev), mask)
            if r.kl_beta:
                adv = adv + kl_penalty(z, self.ref_logits.to(dev), ids, mask, r.kl_beta, tau, r.kl_reward_to_go)
            adv = length_normalise(adv, mask, r.length_norm, r.max_length)
            b = None if self.baseline is None else torch.as_tensor(self.baseline).to(dev)
        else:
            adv, b = distill_sampled_advantages(
                z,
                ids,
                mask,
                None if self.teacher_logits is None else self.teacher_logits.to(dev),
                None if self.teacher_logprobs is None else self.teacher_logprobs.to(dev),
                tau,
                r.teacher_temperature,
                baseline=r.baseline,
            )
        coef = _coefficients(adv, mask, b)  # (B, L)
        self.token_adv = coef
        self.bound_sq = advantage_sq_sums(coef, mask)
        return rows.place(_advantage_rows(z, ids, rows, rows.tokens(coef), tau), V)


class RegimeMoments:
    """One regime's per-sample gradients folded per parity half beside the score's moments, with its bound.

    The g_n are folded through :meth:`covgrad.scores.persample.PerSampleGrads.accumulate` (no B × P rows) by a
    :class:`covgrad.moments.accum.GroupAccumulator` of their own: each prompt group's sum as one row, from which
    :meth:`gradient` (G) and :meth:`standard_error` (prompt-clustered) follow.
    The bound scalar ``bound_sq`` of each batch's :class:`RegimeGrad` is summed per half in float64.

    Args:
        P: parameter elements (the layout's flat axis); device: where the (H, P) state lives.
        state_dtype, halves, compiled: as :class:`covgrad.moments.accum.MomentAccumulator`.
        group_comoment: prompt groups of several sizes (the accumulator's ``comoment``).

    Attributes:
        acc: the moments of the groups' sums of g_n.
        bound_sum, bound_count: shape (H,) float64 numpy, Σ_n bound_sq and the samples that had one.
    """

    def __init__(
        self,
        P: int,
        device: torch.device | str,
        state_dtype: str = "float64",
        halves: int = 2,
        compiled: bool | None = None,
        group_comoment: bool = False,
    ) -> None:
        self.acc = GroupAccumulator(P, device, state_dtype, halves, compiled, comoment=group_comoment)
        self.bound_sum = np.zeros(halves)
        self.bound_count = np.zeros(halves)

    def fold(
        self,
        psg: PerSampleGrads,
        input_ids: Tensor,
        attention_mask: Tensor,
        fn: RegimeGrad,
        half: Tensor | np.ndarray,
        position_ids: Tensor | None = None,
        *,
        group: Tensor | np.ndarray | None = None,
        out: Tensor | None = None,
        also: Sequence[Cotangent] = (),
    ) -> None:
        """Fold one batch: g_n of ``fn``'s regime (one per-sample backward) and its bound scalars.

        Args:
            psg: the per-sample hooks of the policy (the same instance as the score's is fine).
            input_ids, attention_mask, position_ids: the batch, as :meth:`PerSampleGrads.accumulate`.
            fn: the batch's :class:`RegimeGrad`.
            half: shape (B,) integers in [0, H), each sample's half.
            group: shape (B,) each sample's prompt group (None: every sample a group of its own).
            out: optional (B, P) float32 buffer that also receives the g_n rows.
            also: other objectives of the same batch folded in the same pass, before this one (the score's
                :class:`covgrad.scores.persample.Cotangent`, other regimes' :meth:`cotangent`): one forward for all,
                each accumulator getting the same bytes as its own pass
                (:meth:`PerSampleGrads.accumulate_many`).
        """
        cotangent = self.cotangent(fn, half, group=group, out=out)
        psg.accumulate_many(input_ids, attention_mask, [*also, cotangent], position_ids)

    def cotangent(
        self,
        fn: RegimeGrad,
        half: Tensor | np.ndarray,
        *,
        group: Tensor | np.ndarray | None = None,
        out: Tensor | None = None,
    ) -> Cotangent:
        """This regime's objective on one batch for :meth:`PerSampleGrads.accumulate_many`: g_n folded into
        :attr:`acc` with zero advantages, and (once the pass is done) ``fn``'s bound scalars per half. Make
        it just before the pass that folds it (it gives :attr:`acc` the batch's groups).

        Args:
            fn: the batch's :class:`RegimeGrad`; half: shape (B,) integers in [0, H), each sample's half.
            group: shape (B,) each sample's prompt group (None: every sample a group of its own).
            out: optional (B, P) float32 buffer that also receives the g_n rows.
        """
        from covgrad.scores.persample import Cotangent  # here: covgrad.scores.persample imports transformers

        B = fn.input_ids.shape[0]
        self.acc.set_groups(np.arange(B) if group is None else group)
        return Cotangent(fn, self.acc, np.zeros(B), half, out, done=lambda: self._bounds(fn, half))

    def _bounds(self, fn: RegimeGrad, half: Tensor | np.ndarray) -> None:
        """Add a folded batch's bound scalars (``fn.bound_sq``, when the regime has them) to their halves."""
        if fn.bound_sq is not None:
            h = np.asarray(torch.as_tensor(half).cpu(), dtype=np.int64)
            np.add.at(self.bound_sum, h, fn.bound_sq.detach().cpu().numpy())
            np.add.at(self.bound_count, h, 1.0)

    def _halves(self, halves: list[int] | None) -> list[int]:
        return list(range(self.acc.H)) if halves is None else halves

    def _clustered(self, halves: list[int] | None) -> tuple[np.ndarray, np.ndarray, float]:
        hs = self._halves(halves)
        r = self.acc.rows()
        if r["count"][hs].sum() == 0:
            raise ValueError(f"no samples folded in halves {hs}")
        mean = r["mean_s"].astype(np.float64) + r.get("mean_s_lo", 0.0)
        c = r["c_as"][hs].astype(np.float64) if "c_as" in r else None
        return clustered_mean_se(r["count"][hs], r["mean_a"][hs], r["m2_a"][hs], mean[hs], r["m2_s"][hs], c)

    def gradient(self, halves: list[int] | None = None) -> np.ndarray:
        """G = mean of g_n over the samples of ``halves`` (None: all): shape (P,) float64."""
        return self._clustered(halves)[0]

    def standard_error(self, halves: list[int] | None = None) -> np.ndarray:
        """The prompt-clustered standard error of :meth:`gradient` (:func:`clustered_mean_se`): shape (P,)
        float64 (NaN with fewer than 2 groups)."""
        return self._clustered(halves)[1]

    def bound_a2(self, halves: list[int] | None = None) -> float | None:
        """a² = mean of the bound scalar over the samples of ``halves`` (None when the regime has none)."""
        hs = self._halves(halves)
        count = self.bound_count[hs].sum()
        return None if count == 0 else float(self.bound_sum[hs].sum() / count)


def moment_mean_se(count: np.ndarray, mean: np.ndarray, m2: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """Chan-merge moment rows into G = mean g, its standard error √(Σ(g − G)²/(N(N − 1))) and N.

    Args:
        count: shape (R,) samples per row (rows with 0 are skipped); mean, m2: shape (R, b) float64.

    Returns:
        G (b,), se (b,) float64 (NaN for N < 2) and N.
    """
    n, g, s = 0.0, np.zeros(mean.shape[1]), np.zeros(mean.shape[1])
    for c, mu, q in zip(count, mean, m2, strict=True):
        if c == 0:
            continue
        tot = n + c
        d = mu - g
        g = g + d * (c / tot)
        s = s + q + d * d * (n * c / tot)
        n = tot
    se = np.sqrt(s / (n * (n - 1))) if n >= 2 else np.full_like(g, np.nan)
    return g, se, n


def _ratio(num: np.ndarray, den: np.ndarray) -> np.ndarray:
    ok = den > 0
    return np.where(ok, num / np.where(ok, den, 1.0), np.nan)


def clustered_mean_se(
    count: np.ndarray,
    mean_a: np.ndarray,
    m2_a: np.ndarray,
    mean: np.ndarray,
    m2: np.ndarray,
    c: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, float]:
    """G = Σ_c S_c / Σ_c n_c and its prompt-clustered standard error, from the group moment rows of a
    :class:`covgrad.moments.accum.GroupAccumulator` (each prompt group's sum S_c of g_n folded as one sample whose
    advantage is its size n_c): se² = C/(C − 1)·Σ_c (S_c − n_c G)²/n², with
    Σ_c (S_c − n_c G)² = m2_S − 2G·c_nS + G²·m2_n after Chan-merging the rows (as :func:`moment_mean_se`,
    with the co-moment).

    Args:
        count, mean_a, m2_a: shape (R,) groups, mean group size and Σ(n_c − n̄)² per row (rows with 0 skipped).
        mean, m2: shape (R, b) float64: mean(S_c) and Σ(S_c − mean)² per row; c: Σ(n_c − n̄)(S_c − mean),
            None for groups of one size (then 0).

    Returns:
        G (b,), se (b,) float64 (NaN for fewer than 2 groups) and C, the number of groups.
    """
    C, nbar, m2_n = 0.0, 0.0, 0.0
    mS, m2S, cnS = (np.zeros(mean.shape[1]) for _ in range(3))
    for k in np.flatnonzero(count > 0):  # Chan's merge of the rows, the co-moment included
        tot = C + count[k]
        f = C * count[k] / tot
        d_n, d_S = mean_a[k] - nbar, mean[k] - mS
        m2S = m2S + m2[k] + d_S * d_S * f
        if c is not None:
            cnS = cnS + c[k] + d_n * d_S * f
        m2_n += m2_a[k] + d_n * d_n * f
        nbar += d_n * count[k] / tot
        mS = mS + d_S * (count[k] / tot)
        C = tot
    if C == 0:
        nan = np.full(mean.shape[1], np.nan)
        return nan, nan, 0.0
    G = mS / nbar
    resid = np.maximum(m2S - 2 * G * cnS + G * G * m2_n, 0.0)
    se = np.sqrt(C / (C - 1) * resid) / (C * nbar) if C >= 2 else np.full_like(G, np.nan)
    return G, se, C


def regime_block_stats(
    G: np.ndarray,
    se: np.ndarray,
    F: np.ndarray,
    a2: float,
    G_h: np.ndarray,
    se_h: np.ndarray,
    F_h: np.ndarray,
    a2_h: np.ndarray,
    z: float = 3.0,
) -> dict[str, Any]:
    """A regime's bound statistics on one block of b parameters (docs/regimes.md, "Statistics").

    The bound is a·√F_i with a² = mean c²_n and F the policy's Fisher; outside ``rl`` on its own rollouts it
    holds in expectation, so a violation counts against a sampling allowance: |G_i| > a√F_i + z·se_i, se the
    prompt-clustered standard error (:func:`clustered_mean_se`). The cross-fit takes G and a² from half h and F
    from half 1 − h.

    Args:
        G, se, F: shape (b,) float64: the regime's gradient, its standard error, the policy's F.
        a2: the bound's a² (NaN: no bound, sft_sampled).
        G_h, se_h, F_h: shape (2, b) float64, the same per prompt-group parity half.
        a2_h: shape (2,) a² per half.
        z: standard errors of the sampling allowance.

    Returns:
        ``bound``, ``rho``, ``crossfit_ratio`` (b,) arrays (cross-fit: G even, F odd) and counts
        ``violations`` (|G| > bound·(1 + 1e-6)), ``violations_beyond`` (beyond the allowance),
        ``crossfit_exceed`` and ``crossfit_exceed_beyond`` (2,) (G from half h), ``crossfit_defined`` (2,),
        ``max_abs_rho`` (NaN when undefined).
    """
    bound = np.sqrt(a2 * F) if a2 == a2 else np.full_like(G, np.nan)
    rho = _ratio(G, bound)
    out: dict[str, Any] = {"bound": bound, "rho": rho}
    absG = np.abs(G)
    out["violations"] = int(np.count_nonzero(absG > bound * (1 + 1e-6)))
    out["violations_beyond"] = int(np.count_nonzero(absG > bound + z * se))
    ex, exb, defined = (np.zeros(2, np.int64) for _ in range(3))
    ratios = []
    for h in (0, 1):
        b_cf = np.sqrt(a2_h[h] * F_h[1 - h]) if a2_h[h] == a2_h[h] else np.full_like(G, np.nan)
        r = _ratio(np.abs(G_h[h]), b_cf)
        ratios.append(r)
        ok = r == r
        defined[h] = int(np.count_nonzero(ok))
        ex[h] = int(np.count_nonzero(r[ok] > 1))
        exb[h] = int(np.count_nonzero(np.abs(G_h[h]) > b_cf + z * se_h[h]))
    out["crossfit_ratio"] = ratios[0]
    out["crossfit_exceed"], out["crossfit_exceed_beyond"], out["crossfit_defined"] = ex, exb, defined
    finite = np.abs(rho[rho == rho])
    out["max_abs_rho"] = float(finite.max()) if finite.size else float("nan")
    return out


FULL_DISTRIBUTION_KINDS = ("distill_reverse_kl", "distill_forward_kl", "sft_drift")
"""Regimes whose per-position gradient is a covariance over the vocabulary, Cov_{v~p_t}(c_t, J_t): their bound
holds in-sample exactly with the token Fisher Σ_t f_t at the rows' own prefixes (:func:`head_token_fisher`)."""


def head_token_fisher(
    hidden: Tensor, logits: Tensor, response_mask: Tensor, half: Tensor, temperature: float, halves: int = 2
) -> Tensor:
    """Σ over each half's samples and scored positions of the token Fisher f_t of an untied LM head weight W,
    z = W h: f_{t,(u,j)} = p_u (1 − p_u) h_j² / τ² with p = softmax(z_t / τ) (the score's J_t is ∂(z_t/τ)/∂W).

    By Cauchy–Schwarz over (sample, position), a full-distribution regime's gradient (a weighted sum over
    positions of Cov_{p_t}(c_t, J_t)) then satisfies |G_i| ≤ √(mean_n Σ_t w_t² Var_{p_t}(c_t)) · √(F_tok_i)
    with F_tok = this sum / N, in-sample and exactly, at whatever prefixes the rows hold (the policy's, or
    μ's for SFT on a teacher's samples).

    Args:
        hidden: (B, L, H) the head's input; logits: (B, L, V) its output (``covgrad.tokens.fisher.head_forward``).
        response_mask: (B, L) token-aligned weights (entry 0 is 0); logit row t is scored when entry t + 1 is
            non-zero (unweighted: the weights go with the regime's bound scalar).
        half: (B,) int prompt-group parity of each sample, in [0, halves).
        temperature: the policy's τ.

    Returns:
        (halves, V·H) float64 sums, in the head weight's row-major layout.
    """
    B, L, V = logits.shape
    if hidden.shape[:2] != (B, L) or response_mask.shape != (B, L) or tuple(half.shape) != (B,):
        raise ValueError(
            f"need hidden (B, L, H), logits (B, L, V), response_mask (B, L), half (B,); got {tuple(hidden.shape)}, "
            f"{tuple(logits.shape)}, {tuple(response_mask.shape)}, {tuple(half.shape)}"
        )
    out = torch.zeros(halves, V * hidden.shape[-1], dtype=torch.float64, device=logits.device)
    rows = _Rows.of(response_mask)
    for n in range(B):  # one sample's (T_n, V) float64 block at a time
        flat = rows.flat[rows.sample == n].to(logits.device)
        if flat.numel() == 0:
            continue
        t = flat - n * L
        p = torch.softmax(logits[n, t].to(torch.float64) / temperature, -1)
        a = p * (1 - p) / temperature**2  # (T_n, V)
        out[int(half[n])] += (a.T @ hidden[n, t].to(torch.float64).square()).reshape(-1)
    return out


@dataclass(frozen=True)
class PrefixedBatch:
    """The teacher's rows for context distillation: each sample's teacher prompt, then the sample's response
    tokens, right-padded (a padding query that sees no key gives NaN in eager attention, and 0·NaN would carry
    it into the rows of a left-padded batch).

    Attributes:
        input_ids: shape (B, Lq) int64; attention_mask: (B, Lq) int64, 1 on prompt and response tokens;
        position_ids: (B, Lq) int64, 0..Lq−1;
        start: shape (B,) int64, the column of each row's first response token (its teacher prompt's length).
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    start: Tensor


def prefixed_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int) -> PrefixedBatch:
    """Rows [teacher prompt b, response b, pad …] (B = len(prompts); each teacher prompt non-empty)."""
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} teacher prompts for {len(responses)} responses")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("a teacher prompt is empty: its first response token would have no logit predicting it")
    Lq = max(len(p) + len(r) for p, r in zip(prompts, responses, strict=True))
    ids = torch.full((len(prompts), Lq), pad_id, dtype=torch.long)
    attn = torch.zeros((len(prompts), Lq), dtype=torch.long)
    for b, (p, r) in enumerate(zip(prompts, responses, strict=True)):
        ids[b, : len(p) + len(r)] = torch.as_tensor([*p, *r], dtype=torch.long)
        attn[b, : len(p) + len(r)] = 1
    start = torch.as_tensor([len(p) for p in prompts], dtype=torch.long)
    return PrefixedBatch(ids, attn, torch.arange(Lq).expand_as(ids), start)


def align_prefixed_logits(
    teacher_logits: Tensor, teacher_start: Tensor, policy_start: Tensor, response_len: Tensor, L: int
) -> Tensor:
    """The teacher's logits on its own rows moved to the policy rows' positions (response tokens identical).

    Row b's response occupies columns [s_b, s_b + rl_b) of the policy's row (s_b = ``policy_start``) and
    [s′_b, s′_b + rl_b) of the teacher's (s′_b = ``teacher_start``); the logit that predicts response token j
    sits at column s_b − 1 + j and s′_b − 1 + j. Either side may be left- or right-padded.

    Args:
        teacher_logits: shape (B, Lq, V) of the teacher on its rows (:func:`prefixed_batch`).
        teacher_start, policy_start, response_len: shape (B,) integers.
        L: the policy rows' width.

    Returns:
        shape (B, L, V), aligned like the policy's logits (``logits[:, t]`` predicts token t + 1): the teacher's
        logits at the positions that predict response tokens, zero elsewhere.
    """
    B, Lq, V = teacher_logits.shape
    sq, sp, rl = (torch.as_tensor(x).long().cpu() for x in (teacher_start, policy_start, response_len))
    if int((sp + rl).max()) > L or int((sq + rl).max()) > Lq or int(torch.minimum(sp, sq).min()) < 1:
        raise ValueError(
            f"responses of lengths {rl.tolist()} at policy columns {sp.tolist()} and teacher columns {sq.tolist()} "
            f"do not fit L = {L}, Lq = {Lq} (each start >= 1)"
        )
    b = torch.repeat_interleave(torch.arange(B), rl)
    j = torch.arange(int(rl.sum())) - torch.repeat_interleave(rl.cumsum(0) - rl, rl)
    dst = b * L + sp[b] - 1 + j
    src = b * Lq + sq[b] - 1 + j
    out = torch.zeros(B * L, V, dtype=teacher_logits.dtype, device=teacher_logits.device)
    out.index_copy_(0, dst.to(out.device), teacher_logits.reshape(B * Lq, V)[src.to(out.device)])
    return out.view(B, L, V)


def regime_of(r: RegimeSection) -> Regime:
    """The :class:`covgrad.regimes.objectives.Regime` of a configured regime."""
    return Regime(
        kind=r.kind,
        temperature=r.temperature,
        teacher_temperature=r.teacher_temperature,
        kl_beta=r.kl_beta,
        kl_reward_to_go=r.kl_reward_to_go,
        length_norm=r.length_norm,
        max_length=r.max_length,
        baseline=r.baseline,
    )
