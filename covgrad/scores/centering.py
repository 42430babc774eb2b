"""The logit-gradient functions of the scores: policy-centered, or centered by the sampler distribution μ
aligned with the policy's logits.

Rollouts keep μ per response position (``(B, T, V)`` full, or a top-k record), or nothing (μ is then
recomputed by the sampler model); the score needs it per logit position (``(B, L, V)``, index t =
distribution of token t+1). Positions that are not scored get the uniform distribution (their weight is
0, so they never enter the score).

Shape notation: B rows of L tokens, T response positions, V vocabulary, k recorded tokens per position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor, nn

from covgrad.rollouts.batch import RolloutBatch
from covgrad.rollouts.sampling import SamplerSpec, mu_from_topk, recompute_sampler_logp
from covgrad.scores.persample import score_logit_grad

LogitGrad = Callable[[Tensor], Tensor]  # logits (B, L, V) -> the (B, L, V) gradient the score backpropagates


@dataclass(frozen=True)
class MuRecord:
    """What the rollouts hold about μ for one batch: the full log μ, a top-k record, or neither."""

    logp: Tensor | None = None  # (B, T, V) float32: log μ at each response position
    topk_ids: Tensor | None = None  # (B, T, k) int32: the recorded tokens
    topk_logp: Tensor | None = None  # (B, T, k) float32: their log μ
    tail: Tensor | None = None  # (B, T) float32: μ's mass outside the recorded tokens


def policy_logit_grad(batch: RolloutBatch, device: torch.device) -> LogitGrad:
    """The logit-gradient function of ∇ log p of ``batch``'s response tokens (policy centering), on ``device``."""
    return partial(score_logit_grad, input_ids=batch.input_ids.to(device), target_mask=batch.response_mask.to(device))


class SamplerCentering:
    """Logit-gradient functions of sampler-centered scores, batch by batch.

    μ comes from the batch's :class:`MuRecord` (full log μ; or a top-k record, its tail spread in
    proportion to the policy) or, for rollouts without one, from ``model`` (the sampler, with the
    sampling settings ``spec``) by one teacher-forced forward on the CPU. Each call of a batch's function
    sets ``kl``: the batch's Σ KL(μ‖p) over scored tokens (nats) and their number.
    """

    def __init__(self, spec: SamplerSpec, model: nn.Module | None = None) -> None:
        self.spec, self.model = spec, model
        self.kl: tuple[float, int] = (0.0, 0)

    def logit_grad(self, batch: RolloutBatch, mu: MuRecord) -> LogitGrad:
        """The logit-gradient function of ``batch`` (CPU tensors) centered by its μ record ``mu``."""
        tokens, pl, rl, target = batch.input_ids, batch.prompt_len, batch.response_len, batch.response_mask
        fixed = None
        if mu.logp is not None:
            fixed = align_full_mu(mu.logp, pl, rl, tokens.shape[1])
        elif mu.topk_ids is None:
            if self.model is None:
                raise ValueError("these rollouts hold no record of μ; sampler centering needs the sampler model")
            fixed = mask_unscored(recompute_sampler_logp(self.model, tokens, pl, rl, self.spec), target.bool())

        def fn(logits: Tensor) -> Tensor:
            # everything on the logits' device: no (B, L, V) tensor crosses to the host per batch
            dev, z = logits.device, logits.detach()
            if fixed is None:
                mu_t = align_topk_mu(z.float(), *(t.to(dev) for t in (mu.topk_ids, mu.topk_logp, mu.tail, pl, rl)))
            else:
                mu_t = fixed.to(dev)
            tgt = target.to(dev)
            self.kl = kl_sampler_policy(mu_t, z, tgt)
            return score_logit_grad(logits, tokens.to(dev), tgt, mu=mu_t)

        return fn


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


def sampled_token_logp(
    model: nn.Module, tokens: Tensor, prompt_len: Tensor, response_len: Tensor, spec: SamplerSpec, batch_size: int = 8
) -> Tensor:
    """log-probabilities (N, T) float64 that ``model`` (with the sampling settings ``spec``) gives the stored
    response tokens, T = max response_len, 0 after each response's end; teacher-forced, ``batch_size`` rows
    at a time (each batch holds one (batch_size, L, V) float32 tensor).

    Args:
        tokens: (N, L) int right-padded rows, prompt then response.
        prompt_len, response_len: (N,) int.
    """
    N = tokens.shape[0]
    T = int(response_len.max()) if N else 0
    out = torch.zeros((N, T), dtype=torch.float64)
    for lo in range(0, N, batch_size):
        sl = slice(lo, lo + batch_size)
        pl, rl = prompt_len[sl].long(), response_len[sl].long()
        L = int((pl + rl).max())
        log_mu = recompute_sampler_logp(model, tokens[sl, :L], pl, rl, spec)  # (b, L, V)
        rows, cols = response_to_logit_index(pl, rl, T)
        js = cols - pl[rows] + 1
        out[lo + rows, js] = log_mu[rows, cols, tokens[sl][rows, cols + 1].long()].double()
    return out
