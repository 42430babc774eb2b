"""The sampler distribution μ aligned with the policy's logits, for sampler-centered scores.

Rollouts keep μ per response position (``(B, T, V)`` full, or a top-k record); the score needs it
per logit position (``(B, L, V)``, index t = distribution of token t+1). Positions that are not
scored get the uniform distribution (their weight is 0, so they never enter the score).
"""

from __future__ import annotations

import torch
from torch import Tensor

from covgrad.sampling import mu_from_topk


def response_to_logit_index(prompt_len: Tensor, response_len: Tensor, T: int) -> tuple[Tensor, Tensor]:
    """Row and logit-position indices of every valid (sample n, response position j < response_len[n]).

    Returns two 1-D int64 tensors ``(rows, cols)``; the logit at ``cols = prompt_len[n] + j − 1``
    predicts response token j, so ``j = cols − prompt_len[rows] + 1``.
    """
    j = torch.arange(T, device=response_len.device).unsqueeze(0)  # (1, T)
    valid = j < response_len.unsqueeze(1)  # (B, T)
    rows, js = valid.nonzero(as_tuple=True)
    return rows, prompt_len[rows].long() + js - 1


def align_full_mu(mu_logp: Tensor, prompt_len: Tensor, response_len: Tensor, L: int) -> Tensor:
    """μ (B, L, V) float32 from per-response-position log μ (B, T, V)."""
    B, T, V = mu_logp.shape
    out = torch.full((B, L, V), 1.0 / V, dtype=torch.float32)
    rows, cols = response_to_logit_index(prompt_len, response_len, T)
    js = cols - prompt_len[rows].long() + 1
    out[rows, cols] = mu_logp[rows, js].double().exp().float()
    return out


def align_topk_mu(
    policy_logits: Tensor,
    topk_ids: Tensor,
    topk_logp: Tensor,
    tail: Tensor,
    prompt_len: Tensor,
    response_len: Tensor,
) -> Tensor:
    """μ (B, L, V) float32 from top-k records (B, T, k) by the tail rule, whose tail is spread in
    proportion to the policy probabilities softmax(policy_logits) (B, L, V)."""
    B, L, V = policy_logits.shape
    T = topk_ids.shape[1]
    out = torch.full((B, L, V), 1.0 / V, dtype=torch.float32, device=policy_logits.device)
    rows, cols = response_to_logit_index(prompt_len, response_len, T)
    js = cols - prompt_len[rows].long() + 1
    p = torch.softmax(policy_logits[rows, cols].double(), dim=-1)
    mu = mu_from_topk(topk_ids[rows, js], topk_logp[rows, js].double(), tail[rows, js].double(), p)
    out[rows, cols] = mu.float()
    return out


def mask_unscored(mu_logp_aligned: Tensor, response_mask: Tensor) -> Tensor:
    """μ (B, L, V) float32 from log μ aligned with the logits (e.g. ``recompute_sampler_logp``),
    uniform at positions that predict no response token."""
    B, L, V = mu_logp_aligned.shape
    scored = torch.zeros((B, L), dtype=torch.bool, device=mu_logp_aligned.device)
    scored[:, :-1] = response_mask[:, 1:].to(scored.device)
    out = mu_logp_aligned.double().exp().float()
    out[~scored] = 1.0 / V
    return out


def kl_sampler_policy(mu: Tensor, logits: Tensor, target_mask: Tensor) -> tuple[float, int]:
    """Σ over scored tokens of KL(μ_t ‖ p_t) in nats, and the number of scored tokens.

    ``mu`` and ``logits`` are (B, L, V) aligned as in the score (index t predicts token t+1);
    ``target_mask`` (B, L) marks scored response tokens, so logit position t counts when
    ``target_mask[:, t + 1]`` is set. Terms with μ_v = 0 contribute 0.
    """
    scored = target_mask[:, 1:].bool()
    m = mu[:, :-1][scored].double()
    logp = torch.log_softmax(logits[:, :-1][scored].double(), dim=-1)
    kl = torch.where(m > 0, m * (m.clamp_min(1e-300).log() - logp), torch.zeros_like(m)).sum()
    return float(kl), int(scored.sum())
