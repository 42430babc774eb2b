"""Token-level Fisher: how much Fisher information each response position carries.

At a response position t with logits z_t and policy p = softmax(z_t), the centered logit sensitivity
of vocabulary entry v is g_{t,v} = ∂z_{t,v} − Σ_u p_u ∂z_{t,u} (a vector over the selected
parameters), and the token score of the drawn token y_t is s_t = g_{t,y_t}. The token Fisher is the
variance of the logit sensitivities under p, elementwise over parameters:

    f_t = Σ_v p_v (∂z_{t,v})² − (Σ_v p_v ∂z_{t,v})² = Σ_v p_v g_{t,v}² = E_{y~p}[s_t²].

Summed over positions and samples and divided by N it estimates the sequence Fisher F = mean(s²),
because the cross-terms E[s_t s_t'] (t ≠ t') vanish in expectation on the policy's own samples;
``cross_term_ratio`` measures how far they are from vanishing in a finite sample.

One backward pass of the batch gives one centered sensitivity g_{t,v} per sample (the row's logit
gradient is the one-hot of v minus p at that position), so the cost is T·C batched forward and
backward passes for C candidates per position: all V (``exact``), the k most likely (``topk``) or
k draws from p (``mc``).

Rows are right-padded (prompt, response, padding). Response position j of sample n is the token at
full index ``prompt_len[n] + j``; its distribution is the logit row at ``prompt_len[n] + j - 1``.

Shape notation: B samples in the batch, L padded sequence length, T = max(response_len) response
positions, V vocabulary, H hidden size, P selected parameter elements.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import nn

from covgrad.layout import ParamLayout
from covgrad.persample import PerSampleGrads

Mode = Literal["exact", "topk", "mc"]
PerSampleFn = Callable[[torch.Tensor, torch.Tensor, Callable[[torch.Tensor], torch.Tensor]], torch.Tensor]


class _CenteredOneHot:
    """Logit gradient of one position per row: one-hot of a candidate minus p, zero elsewhere.

    ``cols``, ``cand`` and ``active`` have shape (B,): logit row index, candidate token and whether the
    row has a response token at this position. p is taken from the logits being differentiated, so the
    centering is exactly that of the graph.
    """

    def __init__(self, cols: torch.Tensor, cand: torch.Tensor, active: torch.Tensor) -> None:
        self.rows = torch.arange(cols.shape[0], device=cols.device)
        self.cols = cols
        self.cand = cand
        self.active = active

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        z = logits[self.rows, self.cols].detach()  # (B, V)
        g = -torch.softmax(z.float(), dim=-1).to(logits.dtype)  # (B, V)
        g[self.rows, self.cand] += 1
        g[~self.active] = 0
        d = torch.zeros_like(logits)  # (B, L, V)
        d[self.rows, self.cols] = g
        return d


def _check_rows(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: torch.Tensor,
    response_len: torch.Tensor,
) -> None:
    """Raise ValueError when the row layout cannot be right-padded prompt + response."""
    if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"input_ids {tuple(input_ids.shape)} and attention_mask {tuple(attention_mask.shape)} "
            "must both have shape (B, L)"
        )
    B, L = input_ids.shape
    if prompt_len.shape != (B,) or response_len.shape != (B,):
        raise ValueError(
            f"prompt_len {tuple(prompt_len.shape)} and response_len {tuple(response_len.shape)} "
            f"must both have shape ({B},), one entry per row"
        )
    if bool((prompt_len < 1).any()):
        raise ValueError(
            f"prompt_len must be >= 1 (the first response token needs a logit row); got {prompt_len.tolist()}"
        )
    if bool((response_len < 0).any()):
        raise ValueError(f"response_len must be >= 0; got {response_len.tolist()}")
    end = prompt_len + response_len
    if bool((end > L).any()):
        raise ValueError(f"prompt_len + response_len = {end.tolist()} exceeds the row length L = {L}")
    inside = torch.arange(L, device=end.device)[None, :] < end[:, None]  # (B, L): prompt and response tokens
    if bool((attention_mask[inside] == 0).any()):
        raise ValueError("attention_mask is 0 on a prompt or response token; rows must be prompt, response, padding")


def _response_positions(
    input_ids: torch.Tensor, prompt_len: torch.Tensor, response_len: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Logit row index, active mask and response token of every response position, each (B, T).

    Inactive positions (beyond a row's response_len) get row index 0 and token ``input_ids[:, 0]``.
    """
    T = int(response_len.max()) if response_len.numel() else 0
    j = torch.arange(T, device=input_ids.device)
    active = j[None, :] < response_len[:, None]  # (B, T)
    cols = torch.where(active, prompt_len[:, None] + j[None, :] - 1, 0)  # (B, T)
    drawn = input_ids.gather(1, torch.where(active, cols + 1, 0))  # (B, T)
    return cols, active, drawn


def _policy_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=attention_mask).logits


def _candidates(
    p: torch.Tensor, mode: Mode, k: int, seed: int, exact_vocab_limit: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Candidate tokens (B, T, C), their weights (B, T, C) float64 and the covered mass (B, T).

    ``p`` is the float64 policy at the response positions, shape (B, T, V).
    """
    B, T, V = p.shape
    if mode == "exact":
        if exact_vocab_limit < V:
            raise ValueError(
                f"mode='exact' needs V = {V} backward passes per position, above exact_vocab_limit = "
                f"{exact_vocab_limit}; use mode='topk' or mode='mc', or raise the limit"
            )
        cand = torch.arange(V, device=p.device).expand(B, T, V)
        return cand, p, torch.ones_like(p[..., 0])
    if mode == "topk":
        if not 1 <= k <= V:
            raise ValueError(f"mode='topk' needs 1 <= k <= V; got k = {k}, V = {V}")
        # stable descending sort: ties go to the lowest token id
        cand = torch.argsort(p, dim=-1, descending=True, stable=True)[..., :k]  # (B, T, k)
        pk = p.gather(-1, cand)
        mass = pk.sum(-1)  # (B, T)
        return cand, pk / mass[..., None], mass
    if mode == "mc":
        if k < 1:
            raise ValueError(f"mode='mc' needs k >= 1 draws per position; got k = {k} (V = {V})")
        # drawn on the CPU so that a seed gives the same candidates on every device
        gen = torch.Generator().manual_seed(seed)
        flat = p.reshape(B * T, V).cpu()
        cand = torch.multinomial(flat, k, replacement=True, generator=gen).reshape(B, T, k).to(p.device)
        return (
            cand,
            torch.full((B, T, k), 1.0 / k, dtype=torch.float64, device=p.device),
            torch.ones_like(p[..., 0]),
        )
    raise ValueError(f"mode must be 'exact', 'topk' or 'mc'; got {mode!r}")


def token_fisher(
    model: nn.Module,
    layout: ParamLayout,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: torch.Tensor,
    response_len: torch.Tensor,
    mode: Mode,
    k: int = 0,
    seed: int = 0,
    per_sample_grads: PerSampleFn | None = None,
    exact_vocab_limit: int = 4096,
) -> dict[str, torch.Tensor]:
    """Token Fisher f_t = Σ_v p_v g_{t,v}² of every response position, summed, with per-position diagnostics.

    The estimate replaces Σ_v p_v g_v² by a weighted sum over candidates v_c with weights w_c:
    ``exact``: all V tokens, w = p_v. ``topk``: the k most likely tokens (ties to the lowest id),
    w = p_v / covered mass, i.e. the Fisher conditioned on the top-k set; the sensitivities stay
    centered by the full p, so k = V is exact. ``mc``: k tokens drawn from p with replacement
    (``torch.Generator`` seeded with ``seed``), w = 1/k, an unbiased estimate.

    Cost: T·C batched forward and backward passes, C = V (exact) or k (topk, mc), plus one forward.

    Args:
        model: causal LM returning ``.logits`` (B, L, V); put it in ``eval()`` first.
        layout: the selected parameters (the P axis).
        input_ids: token ids, shape (B, L), right-padded rows.
        attention_mask: shape (B, L), 1 on prompt and response tokens.
        prompt_len: prompt tokens per row, shape (B,), each >= 1.
        response_len: response tokens per row, shape (B,); T = max(response_len).
        mode: ``"exact"``, ``"topk"`` or ``"mc"``.
        k: candidates per position for topk and mc (ignored by exact).
        seed: seed of the mc draws.
        per_sample_grads: callable ``(input_ids, attention_mask, dlogits_fn) -> (B, P)`` returning each
            row's parameter gradient for the logit gradient ``dlogits_fn(logits)``; default
            ``PerSampleGrads(model, layout)``.
        exact_vocab_limit: largest V that mode ``"exact"`` accepts.

    Returns:
        ``fisher_sum``: shape (P,) float64, Σ_{n,t} f_{n,t} (divide by N for the token estimate of F).
        ``trace``: shape (B, T) float64, Σ_i f_{t,i} over the selected parameters per position.
        ``entropy``: shape (B, T) float64, entropy of p in nats.
        ``p_drawn``: shape (B, T) float64, probability of the response token.
        ``covered_mass``: shape (B, T) float64, p-mass of the candidates (1 for exact and mc).
        Entries of the (B, T) arrays beyond a row's response_len are 0.

    Raises:
        ValueError: on a bad mode, k, vocabulary size above ``exact_vocab_limit`` or row layout.
    """
    _check_rows(input_ids, attention_mask, prompt_len, response_len)
    dev = input_ids.device
    prompt_len, response_len = prompt_len.to(dev), response_len.to(dev)
    cols, active, drawn = _response_positions(input_ids, prompt_len, response_len)  # (B, T)
    B, T = cols.shape
    rows = torch.arange(B, device=dev)[:, None]
    logits = _policy_logits(model, input_ids, attention_mask)
    logp = torch.log_softmax(logits[rows, cols].double(), dim=-1)  # (B, T, V)
    p = logp.exp()
    cand, weight, covered = _candidates(p, mode, k, seed, exact_vocab_limit)
    weight = weight * active[..., None]  # (B, T, C)

    out = {
        "fisher_sum": torch.zeros(layout.P, dtype=torch.float64, device=dev),
        "trace": torch.zeros(B, T, dtype=torch.float64, device=dev),
        "entropy": torch.where(active, -(p * logp).sum(-1), 0.0),
        "p_drawn": torch.where(active, p.gather(-1, drawn[..., None])[..., 0], 0.0),
        "covered_mass": torch.where(active, covered, 0.0),
    }
    psg = per_sample_grads if per_sample_grads is not None else PerSampleGrads(model, layout)
    for j in range(T):
        for c in range(cand.shape[-1]):
            g = psg(input_ids, attention_mask, _CenteredOneHot(cols[:, j], cand[:, j, c], active[:, j]))
            sq = g.double().square()  # (B, P)
            w = weight[:, j, c]  # (B,)
            out["fisher_sum"] += w @ sq  # (P,)
            out["trace"][:, j] += w * sq.sum(1)
    return out


def token_scores(
    model: nn.Module,
    layout: ParamLayout,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: torch.Tensor,
    response_len: torch.Tensor,
    per_sample_grads: PerSampleFn | None = None,
) -> torch.Tensor:
    """Per-position token scores s_t = ∇θ log p(y_t | prefix) of a small batch, one backward per position.

    Σ_t s_t over a row is that row's sequence score. Memory is B·T·P floats; use it on small batches.

    Args:
        model: causal LM returning ``.logits`` (B, L, V), in ``eval()``.
        layout: the selected parameters (the P axis).
        input_ids: shape (B, L), right-padded rows.
        attention_mask: shape (B, L).
        prompt_len: shape (B,), each >= 1.
        response_len: shape (B,); T = max(response_len).
        per_sample_grads: as in ``token_fisher``; default ``PerSampleGrads(model, layout)``.

    Returns:
        Shape (B, T, P) float32; zero beyond a row's response_len.

    Raises:
        ValueError: when the row layout is not right-padded prompt + response.
    """
    _check_rows(input_ids, attention_mask, prompt_len, response_len)
    dev = input_ids.device
    prompt_len, response_len = prompt_len.to(dev), response_len.to(dev)
    cols, active, drawn = _response_positions(input_ids, prompt_len, response_len)  # (B, T)
    B, T = cols.shape
    psg = per_sample_grads if per_sample_grads is not None else PerSampleGrads(model, layout)
    out = torch.zeros(B, T, layout.P, dtype=torch.float32, device=dev)
    for j in range(T):
        out[:, j] = psg(input_ids, attention_mask, _CenteredOneHot(cols[:, j], drawn[:, j], active[:, j]))
    return out


def lm_head_token_fisher(hidden: torch.Tensor, probs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Closed-form token Fisher Σ_{n,t} w_{n,t} p_u (1 − p_u) h_j² of an untied LM head weight.

    For z = W h the centered sensitivity of entry W_{u,j} is (δ_{vu} − p_u) h_j, whose p-weighted
    second moment over v is p_u (1 − p_u) h_j². Only valid when W is not shared with the input
    embedding (for a tied weight the embedding path adds to the gradient).

    Args:
        hidden: LM head inputs (after the final norm), shape (B, L, H).
        probs: policy at the same positions, shape (B, L, V).
        weights: per-position weights, shape (B, L), e.g. 1 on the logit rows of response tokens.

    Returns:
        Shape (V, H) float64, in the LM head weight's layout.

    Raises:
        ValueError: when the shapes do not agree.
    """
    if hidden.dim() != 3 or probs.shape[:2] != hidden.shape[:2] or weights.shape != hidden.shape[:2]:
        raise ValueError(
            f"need hidden (B, L, H), probs (B, L, V), weights (B, L); got {tuple(hidden.shape)}, "
            f"{tuple(probs.shape)}, {tuple(weights.shape)}"
        )
    p = probs.double()
    a = weights.double()[..., None] * p * (1 - p)  # (B, L, V)
    return torch.einsum("blv,blh->vh", a, hidden.double().square())


def cross_term_ratio(seq_scores: torch.Tensor, token_scores_sq_sum: torch.Tensor) -> float:
    """Size of the cross-position terms in the sequence Fisher: ‖mean(s² − Σ_t s_t²)‖ / ‖mean(s²)‖.

    s² − Σ_t s_t² = Σ_{t≠t'} s_t s_t' elementwise, which is zero in expectation on-policy; the ratio is
    0 when the token Fisher sum reproduces the sequence Fisher exactly. Norms are Euclidean over P,
    computed in float64.

    Args:
        seq_scores: sequence scores s_n, shape (N, P).
        token_scores_sq_sum: Σ_t s_{n,t}² per sample, shape (N, P).

    Returns:
        The ratio (a float >= 0).

    Raises:
        ValueError: when the shapes differ, N = 0, or mean(s²) is zero.
    """
    if seq_scores.dim() != 2 or token_scores_sq_sum.shape != seq_scores.shape or seq_scores.shape[0] == 0:
        raise ValueError(
            f"seq_scores {tuple(seq_scores.shape)} and token_scores_sq_sum "
            f"{tuple(token_scores_sq_sum.shape)} must both have shape (N, P) with N >= 1"
        )
    s2 = seq_scores.double().square().mean(0)  # (P,)
    denom = torch.linalg.vector_norm(s2)
    if denom == 0:
        raise ValueError("mean(s²) is zero for every parameter; the ratio is undefined (are the scores all zero?)")
    cross = s2 - token_scores_sq_sum.double().mean(0)  # (P,)
    return float(torch.linalg.vector_norm(cross) / denom)
