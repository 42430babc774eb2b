"""The logit-gradient functions of the scores (:func:`score_logit_grad`): policy-centered, or centered by the
sampler distribution μ aligned with the policy's logits.

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

LogitGrad = Callable[[Tensor], Tensor]  # logits (B, L, V) -> the (B, L, V) gradient the score backpropagates


def score_logit_grad(
    logits: Tensor,
    input_ids: Tensor,
    target_mask: Tensor,
    mu: Tensor | None = None,
    temperature: float = 1.0,
) -> Tensor:
    """Gradient of every sample's score objective with respect to its logits.

    The objective of sample n is Σ_t w_t [z_{t-1,y_t} − Σ_v q_v z_{t-1,v}] / τ, where position t-1's
    logits predict token t. With ``mu=None``, q = softmax(z/τ) and this is exactly ∇ log p (policy
    centering); otherwise q = mu, a constant (sampler centering, stop-gradient on the sampler).

    Args:
        logits: shape (B, L, V), any float dtype; ``logits[:, t]`` predicts ``input_ids[:, t + 1]``.
        input_ids: shape (B, L), integer token ids.
        target_mask: shape (B, L), bool or float; weight w_t of token position t as a scored response
            token (prompt and padding positions 0; position 0 must be 0, nothing predicts it).
        mu: shape (B, L, V) sampler probabilities aligned like ``logits`` (``mu[:, t - 1]`` is the
            sampler's distribution for token t), or None for policy centering.
        temperature: τ > 0 that divides the logits.

    Returns:
        shape (B, L, V) float32: w_{t+1} (e_{y_{t+1}} − q_t) / τ at position t, zero at position L-1.

    Raises:
        ValueError: on mismatched shapes, τ ≤ 0, a scored first position, token ids outside the
            vocabulary, or sampler rows that are not probabilities.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must have shape (B, L, V); got {tuple(logits.shape)}")
    B, L, V = logits.shape
    if input_ids.shape != (B, L) or target_mask.shape != (B, L):
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and target_mask {tuple(target_mask.shape)} must both "
            f"have the logits' (B, L) = {(B, L)}"
        )
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0; got {temperature}")
    w = target_mask.to(torch.float32)
    if bool((w[:, 0] != 0).any()):
        raise ValueError("target_mask[:, 0] must be 0 (no logit predicts the first token); shift the mask")
    if int(input_ids.min()) < 0 or int(input_ids.max()) >= V:
        raise ValueError(f"input_ids must lie in [0, {V}); got range [{int(input_ids.min())}, {int(input_ids.max())}]")
    if mu is None:
        q = torch.softmax(logits[:, :-1].to(torch.float32) / temperature, dim=-1)  # (B, L-1, V)
    else:
        if mu.shape != logits.shape:
            raise ValueError(f"mu must have the logits' shape {tuple(logits.shape)}; got {tuple(mu.shape)}")
        q = mu[:, :-1].to(torch.float32)
        scored = w[:, 1:] != 0
        row_sums = q.sum(-1)[scored]
        if bool((q[scored] < 0).any()) or bool(((row_sums - 1).abs() > 1e-3).any()):
            raise ValueError(
                "mu rows at scored positions must be probability vectors (non-negative, summing to 1); "
                "got sums in "
                f"[{float(row_sums.min()):.4g}, {float(row_sums.max()):.4g}]"
            )
    dlogits = torch.zeros(B, L, V, dtype=torch.float32, device=logits.device)
    d = dlogits[:, :-1]
    torch.neg(q, out=d)
    d.scatter_add_(-1, input_ids[:, 1:, None].long(), torch.ones_like(d[..., :1]))  # e_y − q
    d.mul_((w[:, 1:] / temperature)[..., None])
    return dlogits


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
