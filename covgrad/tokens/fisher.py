"""Token-level Fisher: how much Fisher information each response position carries.

At a response position t with logits z_t and policy p = softmax(z_t), the centered logit sensitivity
of vocabulary entry v is g_{t,v} = ∂z_{t,v} − Σ_u p_u ∂z_{t,u} (a vector over the selected
parameters), and the token score of the drawn token y_t is s_t = g_{t,y_t}. The token Fisher is the
variance of the logit sensitivities under p, elementwise over parameters:

    f_t = Σ_v p_v (∂z_{t,v})² − (Σ_v p_v ∂z_{t,v})² = Σ_v p_v g_{t,v}² = E_{y~p}[s_t²].

Summed over positions and samples and divided by N it estimates the sequence Fisher F = mean(s²),
because the cross-terms E[s_t s_t'] (t ≠ t') vanish in expectation on the policy's own samples;
``cross_term_ratio`` measures how far they are from vanishing in a finite sample.

How: one forward of the batch with per-sample hooks, then backward passes of *batched* logit cotangents, a
block of R cotangent rows giving R·B per-sample gradient rows (:class:`covgrad.tokens.backward.TokenBackward`).
Every row costs one per-sample backward of the body; the forward is shared by all rows of all modes (and the
stage's token and sequence scores). Mode ``exact`` can weight its rows several ways at once (``also=``): its rows
cover every candidate, so topk, mc and Σ_t s_t² cost one more matrix column each instead of their own rows. Rows
come in blocks of about ``row_bytes``.

The cotangent rows of each mode, per sample and response position t (p = p_t):

- ``exact``: e_v − p for all V tokens v, weight p_v: T·V rows, refused above a budget.
- ``topk``: e_v − p for the k most likely v (ties to the lowest id), weight p_v / covered mass (the
  Fisher conditioned on the top-k set; the sensitivities stay centered by the full p, so k = V is exact).
- ``mc``: e_v − p for k draws v ~ p with replacement, weight 1/k (unbiased).
- ``probe``: k Rademacher probes u = ε ⊙ √p − p (εᵀ√p), ε ∈ {±1}^V, weight 1/k. The per-sample
  gradient h = Jᵀu has E_ε[h²] = diag(Jᵀ(diag p − p pᵀ)J) = f_t elementwise, since
  E[u uᵀ] = diag(√p)diag(√p) − 2 p pᵀ + p pᵀ = diag(p) − p pᵀ. Unbiased, T·k rows.
- ``probe_seq``: k rows per *sequence*, each the sum over positions of probes with independent ε per
  position; E[h²] = Σ_t f_t because the cross-position terms have zero mean. k rows, but no
  per-position trace.

The LM head weight, when it is an untied ``nn.Linear`` whose output is the logits, is never taken from
the backward in these modes: its sensitivity at (u, j) is (δ_{vu} − p_u) h_j, so the weighted second
moment over candidates is a_u h_j² with a_u = W_u (1 − 2 p_u) + p_u² Σ_c w_c (W_u = weight on candidate
u), which is p_u (1 − p_u) for ``exact`` and both probe modes (the probes' expectation, exactly).

Rows are right-padded (prompt, response, padding). Response position j of sample n is the token at
full index ``prompt_len[n] + j``; its distribution is the logit row at ``prompt_len[n] + j - 1``.

Shape notation: B samples in the batch, L padded sequence length, T = max(response_len) response
positions, V vocabulary, H hidden size, P selected parameter elements, R cotangent rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, get_args

import torch
from torch import Tensor, nn

from covgrad.choices import TOKENS_EXACT_BUDGET
from covgrad.choices import TokenMode as Mode
from covgrad.layout import ParamLayout
from covgrad.tokens.backward import DEFAULT_ROW_BYTES, TokenBackward

MODES: tuple[str, ...] = get_args(Mode)
DEFAULT_EXACT_BUDGET: int = TOKENS_EXACT_BUDGET  # most T·V rows "exact" accepts


def exact_rows(T: int, V: int) -> int:
    """Cotangent rows per sample of mode ``exact``: T·V."""
    return T * V


def default_mode(T: int, V: int, exact_budget: int = DEFAULT_EXACT_BUDGET) -> str:
    """``exact`` when its T·V rows per sample fit ``exact_budget``, else ``probe``."""
    return "exact" if exact_rows(T, V) <= exact_budget else "probe"


def check_exact_budget(T: int, V: int, exact_budget: int) -> None:
    """Raise a one-line ValueError when mode ``exact`` (T·V rows per sample) exceeds ``exact_budget``."""
    if exact_rows(T, V) > exact_budget:
        raise ValueError(
            f"mode='exact' needs T·V = {T}·{V} = {T * V} backward rows per sample, above the exact budget "
            f"{exact_budget}; use mode='probe' (T·k rows, unbiased), 'probe_seq' (k rows, no per-position trace), "
            f"'mc' or 'topk' (T·k rows), or raise the budget"
        )


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


def response_positions(
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


def candidates(
    p: torch.Tensor, mode: str, k: int, seed: int, exact_budget: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Candidate tokens (B, T, C), their weights (B, T, C) float64 and the covered mass (B, T).

    ``p`` is the float64 policy at the response positions, shape (B, T, V).
    """
    B, T, V = p.shape
    if mode == "exact":
        check_exact_budget(T, V, exact_budget)
        cand = torch.arange(V, device=p.device).expand(B, T, V)
        return cand, p, torch.ones_like(p[..., 0])
    if mode == "topk":
        # stable descending sort: ties go to the lowest token id
        cand = torch.argsort(p, dim=-1, descending=True, stable=True)[..., :k]  # (B, T, k)
        pk = p.gather(-1, cand)
        mass = pk.sum(-1)  # (B, T)
        return cand, pk / mass[..., None], mass
    # mc: drawn on the CPU so that a seed gives the same candidates on every device
    gen = torch.Generator().manual_seed(seed)
    flat = p.reshape(B * T, V).cpu()
    cand = torch.multinomial(flat, k, replacement=True, generator=gen).reshape(B, T, k).to(p.device)
    return cand, torch.full((B, T, k), 1.0 / k, dtype=torch.float64, device=p.device), torch.ones_like(p[..., 0])


def _blocks(n: int, size: int) -> Iterator[slice]:
    for lo in range(0, n, size):
        yield slice(lo, min(lo + size, n))


def _candidate_pass(
    eng: TokenBackward, cols: Tensor, active: Tensor, p32: Tensor, cand: Tensor, weight: Tensor, row_bytes: int
) -> tuple[Tensor, Tensor]:
    """Fisher sums (n, P) and traces (n, B, T) float64 of n weightings of the same candidate rows.

    Row (j, c) has the cotangent e_{cand[b, j, c]} − p32[b, j] at sample b's logit row ``cols[b, j]`` (0 at
    inactive positions); ``cand`` (B, T, C), ``weight`` (n, B, T, C). The LM head weight is left out when
    it is in closed form (see :func:`_head_closed_form`).
    """
    dev = cols.device
    (B, T), n, C = cols.shape, weight.shape[0], cand.shape[-1]
    fisher = torch.zeros(n, eng.width, dtype=torch.float64, device=dev)
    trace = torch.zeros(n, B, T, dtype=torch.float64, device=dev)
    js = torch.arange(T, device=dev).repeat_interleave(C)  # row r = (position j, candidate c)
    cs = torch.arange(C, device=dev).repeat(T)
    for sl in _blocks(T * C, eng.rows_per_block(row_bytes)):
        jr, cr = js[sl], cs[sl]
        R = jr.shape[0]
        rr = torch.arange(R, device=dev)[:, None].expand(R, B)
        bb = torch.arange(B, device=dev)[None, :].expand(R, B)
        val = -p32[:, jr].transpose(0, 1)  # (R, B, V)
        val[rr, bb, cand[:, jr, cr].T] += 1
        val *= active[:, jr].T[..., None]
        cot = torch.zeros(R, B, *eng.logits.shape[1:], dtype=torch.float32, device=dev)
        cot[rr, bb, cols[:, jr].T] = val
        w = weight[:, :, jr, cr].permute(2, 1, 0)  # (R, B, n)
        norms = eng.square_sums_(cot, w, fisher, head=False)
        for i in range(n):
            trace[i].index_add_(1, jr, (w[..., i] * norms).T)
    return fisher, trace


def _head_closed_form(eng: TokenBackward, cols: Tensor, a: Tensor, fisher: Tensor, trace: Tensor) -> None:
    """Add the LM head weight's Σ_{b,t} a[b, t, u] h_{b,t,j}² to ``fisher`` (width,) and Σ_u a ‖h‖² to ``trace``
    (B, T) when the head is in closed form; ``a`` (B, T, V) float64 (see the module docstring). The (V, H)
    product is formed whole (with ``columns`` too: the rank adds its rows of it)."""
    if eng.head_entry is None:
        return
    e = eng.head_entry
    B = cols.shape[0]
    h2 = eng.hidden.detach()[torch.arange(B, device=cols.device)[:, None], cols].double().square()  # (B, T, H)
    eng.add_columns_(fisher[None], e.offset, torch.einsum("btv,bth->vh", a, h2).reshape(1, -1))
    trace += a.sum(-1) * h2.sum(-1)


def response_policy(
    engine: TokenBackward, input_ids: Tensor, prompt_len: Tensor, response_len: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The policy p (B, T, V) float64 at the response positions of the engine's forward, the active mask
    (B, T) bool and the response tokens (B, T)."""
    dev = input_ids.device
    cols, active, drawn = response_positions(input_ids, prompt_len.to(dev), response_len.to(dev))
    z = engine.logits.detach()[torch.arange(cols.shape[0], device=dev)[:, None], cols]
    return torch.softmax(z.double(), dim=-1), active, drawn


def candidate_weights(
    p: Tensor, active: Tensor, mode: str, k: int = 0, seed: int = 0, exact_budget: int = DEFAULT_EXACT_BUDGET
) -> tuple[Tensor, Tensor]:
    """A candidate mode as weights over the whole vocabulary, for ``token_fisher(..., also=...)``.

    Args:
        p: policy at the response positions, (B, T, V) float64 (``token_fisher``'s ``p``).
        active: (B, T) bool, response positions.
        mode: ``exact``, ``topk`` or ``mc``; k and seed as in :func:`token_fisher`.

    Returns:
        Weights (B, T, V) float64 (0 at inactive positions) and the covered mass (B, T).
    """
    cand, weight, covered = candidates(p, mode, k, seed, exact_budget)
    full = torch.zeros_like(p).scatter_add_(-1, cand, weight * active[..., None])
    return full, torch.where(active, covered, 0.0)


def _probes(gen: torch.Generator, shape: tuple[int, ...], sqrt_p: Tensor, p: Tensor) -> Tensor:
    """Rademacher probes u = ε ⊙ √p − p (εᵀ√p) of shape ``shape`` + (V,), float64; ε drawn on the CPU."""
    eps = (torch.randint(0, 2, (*shape, p.shape[-1]), generator=gen, dtype=torch.int8) * 2 - 1).to(p.device)
    es = eps * sqrt_p
    return es - p * es.sum(-1, keepdim=True)


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
    exact_budget: int = DEFAULT_EXACT_BUDGET,
    engine: TokenBackward | None = None,
    row_bytes: int = DEFAULT_ROW_BYTES,
    closed_form_head: bool = True,
    also: dict[str, Tensor] | None = None,
) -> dict[str, Any]:
    """Token Fisher f_t of every response position, summed, with per-position diagnostics.

    See the module docstring for the modes; ``mc`` draws with a ``torch.Generator`` seeded with ``seed``
    on the CPU, the probe modes draw ε the same way. Cost: one forward (shared through ``engine``) and
    the mode's cotangent rows per sample (exact T·V, topk/mc/probe T·k, probe_seq k), in blocks of
    ``row_bytes``.

    Args:
        model: causal LM returning ``.logits`` (B, L, V); put it in ``eval()`` first.
        layout: the selected parameters (the P axis).
        input_ids: token ids, shape (B, L), right-padded rows.
        attention_mask: shape (B, L), 1 on prompt and response tokens.
        prompt_len: prompt tokens per row, shape (B,), each >= 1.
        response_len: response tokens per row, shape (B,); T = max(response_len).
        mode: one of ``MODES``.
        k: candidates (topk, mc) or probes (probe, probe_seq) per position or sequence; ignored by exact.
        seed: seed of the mc draws and the probes.
        exact_budget: most T·V rows per sample that ``exact`` accepts.
        engine: a :class:`TokenBackward` of these rows to reuse its forward; default builds one.
        row_bytes: memory aimed at per block of cotangent rows.
        closed_form_head: as in :class:`TokenBackward` (used when ``engine`` is None).
        also: mode ``exact`` only: more weightings of its rows, name -> (B, T, V) float64 weights (e.g.
            :func:`candidate_weights` of topk or mc, or the one-hot of the drawn tokens for Σ_t s_t²),
            estimated from the same backward passes at the cost of one more matrix column each.

    Returns:
        ``fisher_sum``: shape (width,) float64 (the engine's columns: P without ranks), Σ_{n,t} f_{n,t}
        (divide by N for the token estimate of F).
        ``trace``: shape (B, T) float64, Σ_i f_{t,i} over the selected parameters per position (NaN at
        response positions for ``probe_seq``, which has no per-position estimate).
        ``entropy``: shape (B, T) float64, entropy of p in nats.
        ``p_drawn``: shape (B, T) float64, probability of the response token.
        ``covered_mass``: shape (B, T) float64, p-mass of the candidates (1 except for topk).
        Entries of the (B, T) arrays beyond a row's response_len are 0.
        ``also`` (only when given): name -> {``fisher_sum``, ``trace``} of each extra weighting.
        ``p``: the policy at the response positions, (B, T, V) float64; ``active``: (B, T) bool.

    Raises:
        ValueError: on a bad mode or k, ``exact`` above the budget, or a bad row layout.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}; got {mode!r}")
    _check_rows(input_ids, attention_mask, prompt_len, response_len)
    dev = input_ids.device
    prompt_len, response_len = prompt_len.to(dev), response_len.to(dev)
    cols, active, drawn = response_positions(input_ids, prompt_len, response_len)  # (B, T)
    B, T = cols.shape
    eng = engine or TokenBackward(model, layout, input_ids, attention_mask, closed_form_head=closed_form_head)
    z = eng.logits.detach()[torch.arange(B, device=dev)[:, None], cols]  # (B, T, V)
    logp = torch.log_softmax(z.double(), dim=-1)  # (B, T, V)
    p = logp.exp()
    if mode != "exact" and not 1 <= k <= (p.shape[-1] if mode == "topk" else k):
        raise ValueError(
            f"mode={mode!r} needs 1 <= k{' <= V' if mode == 'topk' else ''}; got k = {k}, V = {p.shape[-1]}"
        )
    fisher = torch.zeros(eng.width, dtype=torch.float64, device=dev)
    trace = torch.zeros(B, T, dtype=torch.float64, device=dev)
    covered = torch.ones_like(trace)
    block = eng.rows_per_block(row_bytes)
    extra: dict[str, dict[str, Tensor]] = {}
    if mode in ("exact", "topk", "mc"):
        fisher, trace, covered, a = _candidate_modes(
            eng, cols, active, z, p, mode, k, seed, exact_budget, row_bytes, also, extra
        )
    else:
        _probe_modes(eng, cols, active, p, mode, k, seed, block, fisher, trace)
        a = p * (1 - p) * active[..., None]
    _head_closed_form(eng, cols, a, fisher, trace)
    if mode == "probe_seq":
        trace = torch.where(active, torch.full_like(trace, float("nan")), 0.0)
    return {
        "fisher_sum": fisher,
        "trace": trace,
        "entropy": torch.where(active, -(p * logp).sum(-1), 0.0),
        "p_drawn": torch.where(active, p.gather(-1, drawn[..., None])[..., 0], 0.0),
        "covered_mass": torch.where(active, covered, 0.0),
        "p": p,
        "active": active,
        **({"also": extra} if also else {}),
    }


def _candidate_modes(
    eng: TokenBackward,
    cols: Tensor,
    active: Tensor,
    z: Tensor,
    p: Tensor,
    mode: str,
    k: int,
    seed: int,
    exact_budget: int,
    row_bytes: int,
    also: dict[str, Tensor] | None,
    extra: dict[str, dict[str, Tensor]],
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The candidate modes (exact, topk, mc) of :func:`token_fisher`: Σ f (width,) and the traces (B, T) float64
    of the mode's weighting, the covered mass (B, T) and the LM head's closed-form coefficients a (B, T, V)
    float64 (see the module docstring). Each ``also`` weighting's ``fisher_sum`` and ``trace`` (its head's
    closed form added) go into ``extra``. ``z``: the logits (B, T, V) at the response positions, ``p`` their
    float64 policy."""
    cand, weight, covered = candidates(p, mode, k, seed, exact_budget)
    weight = (weight * active[..., None])[None]  # (1, B, T, C)
    if also:
        if mode != "exact":
            raise ValueError(f"also= needs mode='exact' (its rows cover every candidate); got mode={mode!r}")
        weight = torch.cat([weight, torch.stack([w * active[..., None] for w in also.values()])])
    p32 = torch.softmax(z.float(), dim=-1)  # the centering the graph's own softmax would use
    fishers, traces = _candidate_pass(eng, cols, active, p32, cand, weight, row_bytes)
    fisher, trace = fishers[0], traces[0]
    for i, name in enumerate(also or {}, start=1):
        extra[name] = {"fisher_sum": fishers[i], "trace": traces[i]}
        w_i = weight[i]  # (B, T, V): the candidates of exact are the whole vocabulary in order
        _head_closed_form(eng, cols, w_i * (1 - 2 * p) + p.square() * w_i.sum(-1, keepdim=True), fishers[i], traces[i])
    on_cand = torch.zeros_like(p).scatter_add_(-1, cand, weight[0])  # W_u (B, T, V)
    a = on_cand * (1 - 2 * p) + p.square() * weight[0].sum(-1, keepdim=True)  # (B, T, V)
    return fisher, trace, covered, a


def _probe_modes(
    eng: TokenBackward,
    cols: Tensor,
    active: Tensor,
    p: Tensor,
    mode: str,
    k: int,
    seed: int,
    block: int,
    fisher: Tensor,
    trace: Tensor,
) -> None:
    """The probe modes (probe, probe_seq) of :func:`token_fisher`: add Σ f to ``fisher`` (width,) and, for
    ``probe``, each position's Σ_i f_{t,i} to ``trace`` (B, T), both float64, from k probes per position (per
    sequence for probe_seq) in blocks of ``block`` cotangent rows; ε drawn on the CPU from ``seed``."""
    dev = cols.device
    B, T = cols.shape
    gen = torch.Generator().manual_seed(seed)
    sqrt_p = p.sqrt()
    if mode == "probe":
        js = torch.arange(T, device=dev).repeat_interleave(k)  # row r = (position j, probe)
        for sl in _blocks(T * k, block):
            jr = js[sl]
            R = jr.shape[0]
            rr = torch.arange(R, device=dev)[:, None].expand(R, B)
            bb = torch.arange(B, device=dev)[None, :].expand(R, B)
            u = _probes(gen, (R, B), sqrt_p[:, jr].transpose(0, 1), p[:, jr].transpose(0, 1))  # (R, B, V)
            u *= active[:, jr].T[..., None]
            cot = torch.zeros(R, B, *eng.logits.shape[1:], dtype=torch.float32, device=dev)
            cot[rr, bb, cols[:, jr].T] = u.float()
            w = torch.full((R, B), 1.0 / k, dtype=torch.float64, device=dev)
            norms = eng.square_sums_(cot, w[..., None], fisher[None], head=False)
            trace.index_add_(1, jr, (w * norms).T)
    else:
        bt = torch.arange(B, device=dev)[:, None].expand(B, T)
        for sl in _blocks(k, block):
            R = sl.stop - sl.start
            u = _probes(gen, (R, B, T), sqrt_p, p) * active[..., None]  # (R, B, T, V)
            cot = torch.zeros(R, B, *eng.logits.shape[1:], dtype=torch.float32, device=dev)
            cot[:, bt, cols] = u.float()
            w = torch.full((R, B), 1.0 / k, dtype=torch.float64, device=dev)
            eng.square_sums_(cot, w[..., None], fisher[None], head=False)


def token_score_squares(
    engine: TokenBackward,
    input_ids: torch.Tensor,
    prompt_len: torch.Tensor,
    response_len: torch.Tensor,
    row_bytes: int = DEFAULT_ROW_BYTES,
) -> torch.Tensor:
    """Σ_{n,t} s_{n,t}² (width,) float64 (the engine's columns) without holding the (B, T, P) token scores: T
    cotangent rows whose squares are accumulated as they come (the LM head in closed form when the engine has
    it: (δ_{yu} − p_u)² h_j²)."""
    dev = input_ids.device
    cols, active, drawn = response_positions(input_ids, prompt_len.to(dev), response_len.to(dev))
    z = engine.logits.detach()[torch.arange(cols.shape[0], device=dev)[:, None], cols]  # (B, T, V)
    ones = active[None, ..., None].double()  # (1, B, T, 1): weight 1 on the drawn token
    fisher, trace = _candidate_pass(
        engine, cols, active, torch.softmax(z.float(), -1), drawn[..., None], ones, row_bytes
    )
    p = torch.softmax(z.double(), -1)
    onehot = torch.zeros_like(p).scatter_(-1, drawn[..., None], 1.0) * active[..., None]
    _head_closed_form(engine, cols, onehot * (1 - 2 * p) + p.square() * active[..., None], fisher[0], trace[0])
    return fisher[0]


def token_scores(
    model: nn.Module,
    layout: ParamLayout,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_len: torch.Tensor,
    response_len: torch.Tensor,
    engine: TokenBackward | None = None,
    row_bytes: int = DEFAULT_ROW_BYTES,
) -> torch.Tensor:
    """Per-position token scores s_t = ∇θ log p(y_t | prefix) of a small batch: T cotangent rows, one forward.

    Σ_t s_t over a row is that row's sequence score. Memory is B·T·P floats; use it on small batches.

    Args:
        model: causal LM returning ``.logits`` (B, L, V), in ``eval()``.
        layout: the selected parameters (the P axis).
        input_ids: shape (B, L), right-padded rows.
        attention_mask: shape (B, L).
        prompt_len: shape (B,), each >= 1.
        response_len: shape (B,); T = max(response_len).
        engine: a :class:`TokenBackward` of these rows to reuse its forward; default builds one.
        row_bytes: memory aimed at per block of cotangent rows.

    Returns:
        Shape (B, T, P) float32; zero beyond a row's response_len.

    Raises:
        ValueError: when the row layout is not right-padded prompt + response.
    """
    _check_rows(input_ids, attention_mask, prompt_len, response_len)
    dev = input_ids.device
    prompt_len, response_len = prompt_len.to(dev), response_len.to(dev)
    cols, active, drawn = response_positions(input_ids, prompt_len, response_len)  # (B, T)
    B, T = cols.shape
    eng = engine if engine is not None else TokenBackward(model, layout, input_ids, attention_mask)
    p32 = torch.softmax(eng.logits.detach()[torch.arange(B, device=dev)[:, None], cols].float(), dim=-1)
    out = torch.zeros(B, T, layout.P, dtype=torch.float32, device=dev)
    js = torch.arange(T, device=dev)
    for sl in _blocks(T, eng.rows_per_block(row_bytes)):
        jr = js[sl]
        R = jr.shape[0]
        rr = torch.arange(R, device=dev)[:, None].expand(R, B)
        bb = torch.arange(B, device=dev)[None, :].expand(R, B)
        val = -p32[:, jr].transpose(0, 1)  # (R, B, V)
        val[rr, bb, drawn[:, jr].T] += 1
        val *= active[:, jr].T[..., None]
        cot = torch.zeros(R, B, *eng.logits.shape[1:], dtype=torch.float32, device=dev)
        cot[rr, bb, cols[:, jr].T] = val
        out[:, sl] = eng.grads(cot).transpose(0, 1)
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


def head_forward(
    model: nn.Module, input_ids: Tensor, attention_mask: Tensor, position_ids: Tensor | None = None
) -> tuple[str, Tensor, Tensor] | None:
    """One no-grad forward of the batch that also keeps the LM head's input, when the head's token Fisher has
    the closed form of :func:`lm_head_token_fisher`: an untied ``nn.Linear`` called once whose output is the
    logits the model returns (no soft-capping or scaling after it).

    Returns:
        (the head weight's parameter name, hidden (B, L, H), logits (B, L, V)), or None when the head is tied
        to the input embedding, is not an ``nn.Linear``, runs more or less than once, or its output is not the
        logits.
    """
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    if not isinstance(head, nn.Linear) or (embed is not None and head.weight is embed.weight):
        return None
    name = next((n for n, p in model.named_parameters() if p is head.weight), None)
    seen: list[tuple[Tensor, Tensor]] = []
    handle = head.register_forward_hook(lambda _m, args, out: seen.append((args[0].detach(), out)))
    try:
        with torch.no_grad():
            logits = model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).logits
    finally:
        handle.remove()
    if name is None or len(seen) != 1 or seen[0][1] is not logits:
        return None
    return name, seen[0][0], logits.detach()
