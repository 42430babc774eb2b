"""Each regime's per-sample cotangent: rl, rl_token, distill, sft as logit-space cotangents (see docs/regimes.md).

Every regime is an objective J_n of one response n whose gradient ∇θ J_n = Σ_t J_tᵀ c_t (J_t = ∂z_t/∂θ) is
fixed by its logit-space cotangent c_t = ∂J_n/∂z_t. Pushed through the same per-sample hooks as the score
(:class:`covgrad.scores.engine.PerSampleGrads`, which takes any ``dlogits_fn``), c gives the regime's per-sample
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

Alignment is :func:`covgrad.scores.centering.score_logit_grad`'s: ``logits[:, t]`` predicts ``input_ids[:, t + 1]``;
token-aligned tensors (``response_mask``, per-token advantages, baselines, teacher log-probs of the drawn
tokens) have entry t for token t (entry 0 is never scored); distribution-aligned tensors (teacher or
reference logits, μ) are aligned like ``logits``. Cotangents are float32 (float64 for float64 logits),
zero at unscored positions and at position L − 1; sums over positions are float64.

Use: ``fn = RegimeGrad(Regime("distill_reverse_kl"), ids, response_mask, teacher_logits=zq)``, then
``PerSampleGrads(model, layout)(ids, attention_mask, fn, position_ids=pos)`` gives the (B, P) rows g_n and
``fn.bound_sq`` the (B,) bound scalars; :class:`covgrad.regimes.fold.RegimeMoments` folds them per parity half
instead.

Shape notation: B samples in the batch, L sequence positions (prompt, response and padding), V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from covgrad.choices import FULL_DISTRIBUTION_KINDS, LENGTH_NORMS, REGIME_KINDS, RegimeKind

if TYPE_CHECKING:
    from covgrad.config import RegimeSection


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
class ScoredRows:
    """The scored logit positions of a batch, n of them: logit position t of sample b is row b·L + t of the
    flattened (B·L, V) logits and predicts token-aligned entry b·L + t + 1."""

    B: int
    L: int
    flat: Tensor  # (n,) int64 row of each scored logit position
    sample: Tensor  # (n,) int64 sample of each
    weight: Tensor  # (n,) float64 response weight w_{t+1}

    @staticmethod
    def of(response_mask: Tensor) -> ScoredRows:
        B, L = response_mask.shape
        b, t = torch.nonzero(response_mask[:, 1:] != 0, as_tuple=True)
        return ScoredRows(B, L, b * L + t, b, response_mask[:, 1:][b, t].to(torch.float64))

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


def _drawn_logprobs(logits: Tensor, input_ids: Tensor, rows: ScoredRows, temperature: float) -> Tensor:
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
    rows = ScoredRows.of(response_mask)
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
    rows = ScoredRows.of(response_mask)
    coef = rows.tokens(_coefficients(advantages, response_mask, baseline))  # (n,)
    return rows.place(_advantage_rows(logits, input_ids, rows, coef, temperature), logits.shape[-1])


def _advantage_rows(logits: Tensor, input_ids: Tensor, rows: ScoredRows, coef: Tensor, temperature: float) -> Tensor:
    """Rows (n, V) of w (A − b)(e_y − p)/τ for the (n,) coefficients A − b."""
    p = torch.softmax(rows.take(logits, _dtype(logits)) / temperature, dim=-1)  # (n, V)
    d = p.neg_()
    d.scatter_add_(-1, rows.tokens(input_ids)[:, None].long().to(d.device), torch.ones_like(d[:, :1]))  # e_y − p
    return d.mul_((coef.to(d.device) * rows.weight.to(d.device) / temperature).to(d.dtype)[:, None])


def _reverse_kl_rows(
    logits: Tensor, teacher_logits: Tensor, rows: ScoredRows, temperature: float, teacher_temperature: float
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
    rows = ScoredRows.of(response_mask)
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
    rows = ScoredRows.of(response_mask)
    c = _reverse_kl_rows(logits, teacher_logits, rows, temperature, teacher_temperature)[0]
    return rows.place(c, logits.shape[-1])


def _probs_rows(name: str, q: Tensor, logits: Tensor, rows: ScoredRows) -> Tensor:
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


def _drift_rows(logits: Tensor, q: Tensor, logq: Tensor, rows: ScoredRows, temperature: float) -> tuple[Tensor, Tensor]:
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
    rows = ScoredRows.of(response_mask)
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
    rows = ScoredRows.of(response_mask)
    var = _reverse_kl_rows(logits, teacher_logits, rows, temperature, teacher_temperature)[2]
    return rows.per_sample(rows.weight.to(var.device) ** 2 * var.to(torch.float64))


def chi2_sums(logits: Tensor, q: Tensor, response_mask: Tensor, temperature: float = 1.0) -> Tensor:
    """Σ_t w_t² χ²(q_t‖p_t), χ² = Σ_v q_v²/p_v − 1 = Var_{v~p}(q_v/p_v), per sequence: shape (B,) float64.

    Computed as Σ_v p_v (q_v/p_v − 1)² with the ratio in log space, so tiny p_v do not overflow it and a
    near-policy q keeps its small χ² (no cancellation against the 1).
    """
    _check(logits, None, response_mask, temperature)
    rows = ScoredRows.of(response_mask)
    qr = _probs_rows("q", q, logits, rows)
    chi2 = _drift_rows(logits, qr, torch.log(qr), rows, temperature)[1]
    return rows.per_sample(rows.weight.to(chi2.device) ** 2 * chi2.to(torch.float64))


@dataclass(frozen=True)
class Regime:
    """One analysed objective and its options.

    Attributes:
        kind: one of :data:`covgrad.choices.REGIME_KINDS`.
        temperature: the policy's τ (p = softmax(z/τ)).
        teacher_temperature: τ_q of the teacher's logits (distill regimes).
        kl_beta: β of the KL penalty to a reference (``rl_token``; needs ``ref_logits``).
        kl_reward_to_go: sum the KL penalties from each token to the end of its response.
        length_norm: one of :data:`covgrad.choices.LENGTH_NORMS`, applied (``rl_token``) to the advantages after the KL
            penalty is added (GRPO normalises the whole per-token loss, its KL term included).
        max_length: the constant of ``length_norm="constant"``.
        baseline: ``distill_sampled``: subtract b_t = −KL(p_t‖q_t) (needs ``teacher_logits``).
    """

    kind: RegimeKind
    temperature: float = 1.0
    teacher_temperature: float = 1.0
    kl_beta: float = 0.0
    kl_reward_to_go: bool = False
    length_norm: str = "none"
    max_length: int | None = None
    baseline: bool = False

    def __post_init__(self) -> None:
        if self.kind not in REGIME_KINDS:
            raise ValueError(f"regime {self.kind!r} is not one of {REGIME_KINDS}")
        if self.length_norm not in LENGTH_NORMS:
            raise ValueError(f"length_norm {self.length_norm!r} is not one of {LENGTH_NORMS}")
        if self.length_norm == "constant" and (self.max_length is None or self.max_length < 1):
            raise ValueError(f"length_norm 'constant' needs max_length >= 1; got {self.max_length}")
        if not self.temperature > 0 or not self.teacher_temperature > 0:
            raise ValueError(f"temperatures must be > 0; got {self.temperature}, {self.teacher_temperature}")


class RegimeGrad:
    """The ``dlogits_fn`` of one regime on one batch, for :class:`covgrad.scores.engine.PerSampleGrads`.

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
        rows = ScoredRows.of(mask)
        if r.kind in FULL_DISTRIBUTION_KINDS:
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


def regime_of(r: RegimeSection) -> Regime:
    """The :class:`Regime` of a configured regime."""
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
