"""The sampler distribution μ given on a per-position token set, and the centering error it leaves.

An engine can return log μ on a chosen set S_t of tokens at every response position (vLLM's
``logprob_token_ids``, up to 128 ids, or fixed-token prefill scoring), besides the sampled token y_t.
The record is ``(B, T, k)`` ids and log-probs, padded (as ``covgrad.rollouts.imports`` pads top-k
records) with a repeated id at log-prob ``-inf``. μ̂ is built by the tail rule of
:func:`covgrad.rollouts.sampling.mu_from_topk`, which works for any set: μ̂_v = μ_v on S_t, and the mass
τ_t = 1 − Σ_{v∈S_t} μ_v outside S_t spread in proportion to the policy p over the tokens outside S_t.
When S_t is the whole vocabulary τ_t = 0 and μ̂ = μ.

**The bound.** The sampler-centred token score is c_t = J_tᵀ(e_{y_t} − μ_t) with J_t = ∂z_t/∂θ (V × P),
so the score built from μ̂ differs by ĉ_t − c_t = J_tᵀ(μ_t − μ̂_t): a logit-space cotangent difference
δ_t = μ̂_t − μ_t pushed through J_t. When the support log-probs are μ's own, δ_t vanishes on S_t and
sums to 0 outside it (both μ and μ̂ put mass τ_t there), so

- ‖δ_t‖₁ ≤ 2τ_t (total variation ≤ τ_t), and
- for every parameter i, |ĉ_{t,i} − c_{t,i}| = |Σ_{v∉S_t} δ_{t,v} (J_{t,v,i} − m)| ≤ τ_t · R_{t,i}, with
  R_{t,i} = max − min over v ∉ S_t of J_{t,v,i} (take m the midrange) ≤ 2 max_v |J_{t,v,i}|.

Summed over a response, |ĉ_{n,i} − c_{n,i}| ≤ Σ_t τ_{n,t} R_{n,t,i} ≤ (Σ_t τ_{n,t}) · max_t R_{n,t,i}:
:func:`support_tail` returns τ (the reported bound factor), :func:`centering_error_bound` the bound for
given sensitivity ranges. For the LM-head row of token u (J_{t,v,(u,j)} = [v = u] h_{t,j}),
R_{t,(u,j)} = |h_{t,j}| when u ∉ S_t and |V∖S_t| > 1, else 0. The bound assumes the support log-probs
are those of the distribution the engine sampled from (an engine that rounds them, summing above 1,
is renormalised and the bound holds up to that rounding).
"""

from __future__ import annotations

import torch
from torch import Tensor

from covgrad.rollouts.sampling import mu_from_topk
from covgrad.scores.centering import response_to_logit_index


def add_sampled_token(support_ids: Tensor, support_logp: Tensor, sampled_ids: Tensor, sampled_logp: Tensor):
    """S_t ∪ {y_t}: append the sampled token where the engine's set lacks it.

    Args:
        support_ids: (B, T, k) int token ids returned by the engine (padding repeats an id at ``-inf``).
        support_logp: (B, T, k) float log μ of those ids.
        sampled_ids: (B, T) int sampled tokens y_t.
        sampled_logp: (B, T) float log μ(y_t) (the rollouts' ``sampler_logp``).

    Returns:
        ``(ids, logp)`` of shape (B, T, k + 1): the engine's entries, then y_t with log μ(y_t) where y_t
        was missing, else padding (the first id at ``-inf``).
    """
    present = ((support_ids == sampled_ids.unsqueeze(-1)) & (support_logp > -torch.inf)).any(-1)  # (B, T)
    extra_id = torch.where(present, support_ids[..., 0], sampled_ids.to(support_ids.dtype))
    extra_lp = torch.where(present, torch.full_like(sampled_logp, -torch.inf), sampled_logp).to(support_logp.dtype)
    return torch.cat([support_ids, extra_id.unsqueeze(-1)], -1), torch.cat([support_logp, extra_lp.unsqueeze(-1)], -1)


def support_tail(support_logp: Tensor) -> Tensor:
    """τ = max(0, 1 − Σ_{v∈S} μ_v) (...,) float64 from the support's log μ (..., k): the μ-mass outside it.

    The ids must not repeat except as padding at ``-inf`` (zero mass), as ``covgrad.rollouts.imports``
    and :func:`add_sampled_token` produce them.
    """
    return (1.0 - support_logp.double().exp().sum(-1)).clamp_min(0.0)


def mu_on_support(support_ids: Tensor, support_logp: Tensor, policy_probs: Tensor) -> tuple[Tensor, Tensor]:
    """μ̂ (..., V) float64 from μ on S (..., k) with the tail spread by ``policy_probs`` (..., V).

    Returns:
        ``(mu, tail)``: μ̂ summing to 1 over the last axis, and τ (...,) float64 from :func:`support_tail`.
    """
    tail = support_tail(support_logp)
    return mu_from_topk(support_ids, support_logp, tail, policy_probs), tail


def align_support_mu(
    policy_logits: Tensor,
    support_ids: Tensor,
    support_logp: Tensor,
    prompt_len: Tensor,
    response_len: Tensor,
) -> tuple[Tensor, Tensor]:
    """μ̂ aligned with the logits, for ``covgrad.scores.centering.score_logit_grad(mu=...)``.

    Args:
        policy_logits: (B, L, V) logits; ``policy_logits[:, t]`` predicts token t + 1.
        support_ids, support_logp: (B, T, k) μ on S_t per response position (see the module docstring).
        prompt_len, response_len: (B,) int.

    Returns:
        ``(mu, tail)``: μ̂ (B, L, V) float32 (uniform at positions that predict no response token, as
        ``covgrad.scores.centering.align_topk_mu``) and τ (B, T) float64, 0 after each response's end.
    """
    B, L, V = policy_logits.shape
    T = support_ids.shape[1]
    out = torch.full((B, L, V), 1.0 / V, dtype=torch.float32, device=policy_logits.device)
    rows, cols = response_to_logit_index(prompt_len, response_len, T)
    js = cols - prompt_len[rows].long() + 1
    p = torch.softmax(policy_logits[rows, cols].double(), dim=-1)
    mu, tail = mu_on_support(support_ids[rows, js], support_logp[rows, js], p)
    out[rows, cols] = mu.float()
    tails = torch.zeros((B, T), dtype=torch.float64, device=policy_logits.device)
    tails[rows, js] = tail
    return out, tails


def outside_range(sensitivity: Tensor, support_ids: Tensor, support_logp: Tensor) -> Tensor:
    """R = max − min over tokens outside the support of a logit sensitivity.

    Args:
        sensitivity: (..., V, P) ∂z_v/∂θ_i for the P parameters of interest.
        support_ids, support_logp: (..., k) the support (entries at ``-inf`` are padding, not members).

    Returns:
        (..., P) float64; 0 where at most one token lies outside the support.
    """
    V = sensitivity.shape[-2]
    member = torch.zeros(sensitivity.shape[:-1], dtype=torch.bool, device=sensitivity.device)
    member.scatter_(-1, support_ids.long(), support_logp > -torch.inf)
    x = sensitivity.double()
    hi = torch.where(member.unsqueeze(-1), -torch.inf, x).amax(-2)
    lo = torch.where(member.unsqueeze(-1), torch.inf, x).amin(-2)
    few = (V - member.sum(-1)).unsqueeze(-1) <= 1
    return torch.where(few, 0.0, hi - lo)


def centering_error_bound(tail: Tensor, sensitivity_range: Tensor) -> Tensor:
    """Bound Σ_t τ_t R_{t,i} (B, P) float64 on |ĉ_{n,i} − c_{n,i}| of each response's centred score.

    Args:
        tail: (B, T) τ from :func:`align_support_mu` (0 after the end).
        sensitivity_range: (B, T, P) R from :func:`outside_range`, or any upper bound on it such as
            2 max_v |∂z_{t,v}/∂θ_i|.
    """
    return (tail.double().unsqueeze(-1) * sensitivity_range.double()).sum(1)


def tail_summary(tail: Tensor, response_len: Tensor) -> dict[str, float]:
    """Scalars for a report: mean and max τ over scored positions, and max over responses of Σ_t τ_t
    (the factor that multiplies the largest sensitivity range in the bound)."""
    T = tail.shape[1]
    live = torch.arange(T, device=tail.device).unsqueeze(0) < response_len.unsqueeze(1)
    scored = tail[live].double()
    return {
        "support_tail_mean": float(scored.mean()) if scored.numel() else 0.0,
        "support_tail_max": float(scored.max()) if scored.numel() else 0.0,
        "support_tail_seq_max": float(torch.where(live, tail.double(), 0.0).sum(1).max()),
    }


def gradient_error_factor(tail: Tensor, advantage: Tensor) -> float:
    """β = mean_n |A_n| Σ_t τ_{n,t}: the factor of the bound on the sampler-centred gradient G = mean_n A_n c_n,

        |Ĝ_i − G_i| ≤ mean_n |A_n| Σ_t τ_{n,t} R_{n,t,i} ≤ β · max_{n,t} R_{n,t,i},

    with R the outside-support sensitivity range of :func:`outside_range` (≤ 2 max_v |∂z_v/∂θ_i|; for an
    LM-head weight (u, j), |h_{t,j}|).

    Args:
        tail: (N, T) τ per response position (0 after each response's end), e.g. the rollouts' ``mu_tail``.
        advantage: (N,) A_n.
    """
    return float((advantage.double().abs() * tail.double().sum(1)).mean())
