"""Sampler distributions, rollout generation, and advantages.

The sampler μ is defined once, by :func:`sampler_log_probs`: temperature, then top-k, then top-p
truncation, renormalised over the kept tokens. :func:`generate` draws from it and
:func:`recompute_sampler_logp` rebuilds it by one teacher-forced forward pass, so the μ that centres
the score (DESIGN.md §1) is the μ the tokens were drawn from.

Sequence layout: token rows are right-padded, ``prompt_len[n]`` prompt tokens, then ``response_len[n]``
response tokens (EOS included when it was drawn), then ``pad_id``. Logit position t predicts token t+1.
Arrays over the response use a ``position`` axis of length T; response token j of sample n sits at
full index ``prompt_len[n] + j``. Samples are ordered prompt-major: n = p·G + g.

Randomness: the draw for (prompt p, sample g, step j) is the inverse CDF of μ at the uniform
``sample_uniforms(seed, prompt_ids[p], g, T)[j]``, so rollouts do not depend on the batch size.

Shape notation: N samples, L full row length, T response positions (max_new_tokens), V vocabulary,
k kept top-k entries, G samples per prompt.
"""

from __future__ import annotations

import hashlib
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, get_args

import numpy as np
import torch
from torch import Tensor, nn

from covgrad.choices import Advantage as AdvantageKind
from covgrad.choices import MuStore as MuMode

if TYPE_CHECKING:  # the GPU image imports this module without pydantic
    from covgrad.config import SamplerSection

_MU_MODES = get_args(MuMode)
_ADVANTAGE_KINDS = get_args(AdvantageKind)


@dataclass(frozen=True)
class SamplerSpec:
    """How responses are drawn; together with the sampler model it fixes μ."""

    temperature: float = 1.0  # logits are divided by this before the softmax; > 0
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1 disables top-p
    top_k: int = 0  # keep the k most likely tokens; 0 disables top-k
    max_new_tokens: int = 8  # T, the length of the position axis

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0; got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}. Use 1.0 to disable top-p")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0; got {self.top_k!r}. Use 0 to disable top-k")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an int >= 1; got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1; got {self.max_new_tokens}")

    @classmethod
    def of(cls, s: SamplerSection) -> SamplerSpec:
        """The sampling settings of a config sampler section."""
        return cls(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_new_tokens=s.max_new_tokens)


def sampler_log_probs(logits: Tensor, spec: SamplerSpec) -> Tensor:
    """Log-probabilities log μ of the sampler's next-token distribution.

    μ = softmax(z / temperature), truncated to the ``top_k`` most likely tokens, then to the smallest
    set of most likely tokens whose mass (renormalised after top-k) is ≥ ``top_p``, then renormalised
    over the kept set. The most likely token is always kept. Ties in probability are ordered by lowest
    token id, so exactly ``top_k`` tokens are kept and the top-p boundary is deterministic. Computed in
    float64 so the truncation decisions do not depend on float32 rounding.

    Args:
        logits: shape (..., V), any float dtype; the raw logits z.
        spec: temperature, top_p and top_k of the sampler.

    Returns:
        shape (..., V) float32: log μ, ``-inf`` outside the kept set.
    """
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have a non-empty last (vocab) axis; got shape {tuple(logits.shape)}")
    z = logits.to(torch.float64) / spec.temperature
    V = z.shape[-1]
    use_top_k = 0 < spec.top_k < V
    if not use_top_k and spec.top_p == 1.0:
        return torch.log_softmax(z, dim=-1).to(torch.float32)
    # stable descending sort: equal logits keep ascending token id order
    sorted_z, order = torch.sort(z, dim=-1, descending=True, stable=True)  # (..., V)
    keep_sorted = torch.ones_like(sorted_z, dtype=torch.bool)
    if use_top_k:
        keep_sorted[..., spec.top_k :] = False
    if spec.top_p < 1.0:
        probs = torch.softmax(sorted_z.masked_fill(~keep_sorted, -math.inf), dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # mass of strictly more likely tokens
        mass_before[..., 0] = 0.0
        keep_sorted &= mass_before < spec.top_p
    keep = torch.empty_like(keep_sorted).scatter_(-1, order, keep_sorted)
    return torch.log_softmax(z.masked_fill(~keep, -math.inf), dim=-1).to(torch.float32)


def sample_uniforms(seed: int, prompt_id: int, sample: int, num_steps: int) -> Tensor:
    """The uniforms that drive the draws of one sample.

    Args:
        seed: run seed.
        prompt_id: stable identifier of the prompt (not its position in a batch).
        sample: index g of the sample within its prompt group.
        num_steps: T, the number of uniforms.

    Returns:
        shape (T,) float64 in [0, 1); entry j drives response step j.
    """
    digest = hashlib.sha256(f"covgrad.sampling:{seed}:{prompt_id}:{sample}".encode()).digest()
    gen = torch.Generator(device="cpu")
    gen.manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return torch.rand(num_steps, generator=gen, dtype=torch.float64)


def draw_tokens(log_mu: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draws: the smallest token id v with Σ_{w ≤ v} μ_w > u · Σ_w μ_w.

    Args:
        log_mu: shape (B, V), log μ (``-inf`` tokens are never drawn).
        u: shape (B,), uniforms in [0, 1).

    Returns:
        shape (B,) int64 token ids.
    """
    cdf = torch.cumsum(log_mu.to(torch.float64).exp(), dim=-1)  # (B, V)
    target = (u.to(torch.float64) * cdf[:, -1]).unsqueeze(-1)  # (B, 1)
    ids = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return ids.clamp_max(log_mu.shape[-1] - 1)


def _topk_record(log_mu: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """Top-k of μ (ties by lowest id): ids (B, k) int32, log μ (B, k) float32, tail (B,) float32."""
    vals, ids = torch.sort(log_mu, dim=-1, descending=True, stable=True)
    vals, ids = vals[:, :k], ids[:, :k]
    tail = (1.0 - vals.to(torch.float64).exp().sum(-1)).clamp_min(0.0)
    return ids.to(torch.int32), vals, tail.to(torch.float32)


def _cache_name(model: nn.Module) -> str:
    """The KV-cache keyword of ``model.forward``: ``cache`` (transformers ≥ 5.x), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _model_vocab(model: nn.Module) -> int:
    return int(model.get_input_embeddings().num_embeddings)


def _validate_prompts(prompts: Sequence[Sequence[int]], prompt_ids: Sequence[int], vocab: int) -> None:
    if len(prompts) == 0:
        raise ValueError("prompts is empty; give at least one prompt")
    if len(prompt_ids) != len(prompts):
        raise ValueError(f"prompt_ids has {len(prompt_ids)} entries but there are {len(prompts)} prompts")
    seen: set[int] = set()
    for p, (prompt, pid) in enumerate(zip(prompts, prompt_ids, strict=True)):
        if pid in seen:
            raise ValueError(f"prompt_ids[{p}] = {pid!r} repeats an earlier id; prompt ids must be unique")
        seen.add(pid)
        if len(prompt) == 0:
            raise ValueError(f"prompt {p} is empty; every prompt needs at least one token")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {p} has token id {bad[0]} outside [0, {vocab})")


def _generate_batch(
    model: nn.Module,
    prompts: list[list[int]],
    uniforms: Tensor,
    spec: SamplerSpec,
    eos_id: int,
    pad_id: int,
    mu_mode: MuMode,
    mu_topk: int,
) -> dict[str, Tensor]:
    """Sample one batch with a KV cache; prompts are left-padded. Arrays over (B, T)."""
    device = next(model.parameters()).device
    B, T = uniforms.shape
    width = max(len(p) for p in prompts)
    input_ids = torch.full((B, width), pad_id, dtype=torch.long)
    attn = torch.zeros((B, width), dtype=torch.long)
    for b, prompt in enumerate(prompts):
        input_ids[b, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attn[b, width - len(prompt) :] = 1
    position_ids = (attn.cumsum(-1) - 1).clamp_min(0)
    next_pos = attn.sum(-1, keepdim=True)  # (B, 1)
    input_ids, attn, position_ids, next_pos = (x.to(device) for x in (input_ids, attn, position_ids, next_pos))

    cache_name = _cache_name(model)
    out = model(input_ids=input_ids, attention_mask=attn, position_ids=position_ids, use_cache=True, logits_to_keep=1)
    response = torch.full((B, T), pad_id, dtype=torch.long)
    logp = torch.zeros((B, T), dtype=torch.float32)
    length = torch.zeros(B, dtype=torch.long)
    done = torch.zeros(B, dtype=torch.bool)
    V = out.logits.shape[-1]
    res: dict[str, Tensor] = {}
    if mu_mode == "full":
        res["mu_logp"] = torch.zeros((B, T, V), dtype=torch.float32)
    elif mu_mode == "topk":
        res["mu_topk_ids"] = torch.zeros((B, T, mu_topk), dtype=torch.int32)
        res["mu_topk_logp"] = torch.zeros((B, T, mu_topk), dtype=torch.float32)
        res["mu_tail"] = torch.zeros((B, T), dtype=torch.float32)
    for j in range(T):
        log_mu = sampler_log_probs(out.logits[:, -1, :], spec).cpu()  # (B, V)
        y = draw_tokens(log_mu, uniforms[:, j])
        live = ~done
        response[live, j] = y[live]
        logp[live, j] = log_mu.gather(-1, y.unsqueeze(-1)).squeeze(-1)[live]
        if mu_mode == "full":
            res["mu_logp"][live, j] = log_mu[live]
        elif mu_mode == "topk":
            ids, vals, tail = _topk_record(log_mu, mu_topk)
            res["mu_topk_ids"][live, j] = ids[live]
            res["mu_topk_logp"][live, j] = vals[live]
            res["mu_tail"][live, j] = tail[live]
        length += live.long()
        done |= y == eos_id
        if bool(done.all()) or j == T - 1:
            break
        feed = torch.where(done, pad_id, y).unsqueeze(-1).to(device)  # finished rows are fed pad
        attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=device)], dim=-1)
        out = model(
            input_ids=feed,
            attention_mask=attn,
            position_ids=next_pos,
            use_cache=True,
            **{cache_name: getattr(out, cache_name)},
        )
        next_pos = next_pos + 1
    res.update(response=response, response_len=length, sampler_logp=logp)
    return res


def generate(
    model: nn.Module,
    prompts: list[list[int]],
    prompt_ids: Sequence[int],
    group_size: int,
    spec: SamplerSpec,
    seed: int,
    batch_size: int,
    eos_id: int,
    pad_id: int,
    progress: Callable[[int], None] | None = None,
    mu_mode: MuMode = "none",
    mu_topk: int = 0,
) -> dict[str, Tensor]:
    """Draw G responses per prompt from μ (:func:`sampler_log_probs`), batched with a KV cache.

    A row stops after it draws ``eos_id`` or after T = ``spec.max_new_tokens`` tokens. The draw for
    (prompt p, sample g, step j) uses only ``sample_uniforms(seed, prompt_ids[p], g, T)[j]`` and μ, so
    the output does not depend on ``batch_size`` (up to logits rounding that would have to move a
    cumulative probability across the uniform). The model runs in eval mode under ``torch.no_grad``;
    its training flag is restored afterwards.

    Args:
        model: Hugging Face causal LM (the sampler).
        prompts: P prompts, each a non-empty list of token ids.
        prompt_ids: P unique stable prompt identifiers, used for the random streams.
        group_size: G ≥ 1 samples per prompt.
        spec: sampler settings; T = ``spec.max_new_tokens``.
        seed: run seed.
        batch_size: rows per forward pass (≥ 1); does not change the result.
        eos_id: token that ends a response (kept in the response).
        pad_id: fill value for token rows.
        progress: called with the number of samples finished after each batch.
        mu_mode: "none", "full" (store μ at every response position) or "topk" (store its top-k).
        mu_topk: k for ``mu_mode="topk"``, in [1, V].

    Returns:
        N = P·G rows, prompt-major:
        ``tokens`` (N, L) int32 right-padded with ``pad_id``, L = max(prompt_len + response_len);
        ``prompt_len``, ``response_len``, ``prompt_index``, ``sample_index`` (N,) int64;
        ``response_mask`` (N, L) bool, True at response tokens;
        ``sampler_logp`` (N, T) float32, log μ of each drawn token, 0 after the end;
        with "full": ``mu_logp`` (N, T, V) float32 log μ;
        with "topk": ``mu_topk_ids`` (N, T, k) int32 and ``mu_topk_logp`` (N, T, k) float32, sorted by
        decreasing μ (ties by lowest id), and ``mu_tail`` (N, T) float32 = max(0, 1 − Σ exp(top-k logp)).
        Entries of the μ arrays after a row's end are 0.
    """
    vocab = _model_vocab(model)
    _validate_prompts(prompts, prompt_ids, vocab)
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1; got {group_size}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1; got {batch_size}")
    if mu_mode not in _MU_MODES:
        raise ValueError(f"mu_mode must be one of {_MU_MODES}; got {mu_mode!r}")
    if mu_mode == "topk" and not 1 <= mu_topk <= vocab:
        raise ValueError(f"mu_topk must be in [1, {vocab}] with mu_mode='topk'; got {mu_topk}")
    T = spec.max_new_tokens
    rows = [(p, g) for p in range(len(prompts)) for g in range(group_size)]
    parts: list[dict[str, Tensor]] = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for start in range(0, len(rows), batch_size):
                batch = rows[start : start + batch_size]
                uniforms = torch.stack([sample_uniforms(seed, prompt_ids[p], g, T) for p, g in batch])
                batch_prompts = [list(prompts[p]) for p, _ in batch]
                parts.append(_generate_batch(model, batch_prompts, uniforms, spec, eos_id, pad_id, mu_mode, mu_topk))
                if progress is not None:
                    progress(len(batch))
    finally:
        model.train(was_training)

    out = {key: torch.cat([part[key] for part in parts]) for key in parts[0]}
    response, response_len = out.pop("response"), out["response_len"]
    prompt_len = torch.tensor([len(prompts[p]) for p, _ in rows], dtype=torch.long)
    L = int((prompt_len + response_len).max())
    tokens = torch.full((len(rows), L), pad_id, dtype=torch.int32)
    response_mask = torch.zeros((len(rows), L), dtype=torch.bool)
    for n, (p, _) in enumerate(rows):
        lp, lr = int(prompt_len[n]), int(response_len[n])
        tokens[n, :lp] = torch.tensor(prompts[p], dtype=torch.int32)
        tokens[n, lp : lp + lr] = response[n, :lr].to(torch.int32)
        response_mask[n, lp : lp + lr] = True
    out.update(
        tokens=tokens,
        prompt_len=prompt_len,
        response_mask=response_mask,
        prompt_index=torch.tensor([p for p, _ in rows], dtype=torch.long),
        sample_index=torch.tensor([g for _, g in rows], dtype=torch.long),
    )
    return out


def recompute_sampler_logp(
    model: nn.Module, tokens: Tensor, prompt_len: Tensor, response_len: Tensor, spec: SamplerSpec
) -> Tensor:
    """log μ at every position of stored rows, from one teacher-forced forward pass of the sampler.

    Args:
        model: the sampler model (the one :func:`generate` drew from).
        tokens: shape (N, L) int, right-padded rows.
        prompt_len: shape (N,) int, ≥ 1.
        response_len: shape (N,) int, ≥ 0, with prompt_len + response_len ≤ L.
        spec: the sampler settings used for generation.

    Returns:
        shape (N, L, V) float32; index t is log μ of the token at t+1 (aligned with the logits), so
        response token j of row n has log-probability ``out[n, prompt_len[n] + j - 1, token]``.
        Positions past the end of a row (padding) are 0.
    """
    if tokens.dim() != 2:
        raise ValueError(f"tokens must be (N, L); got shape {tuple(tokens.shape)}")
    N, L = tokens.shape
    if prompt_len.shape != (N,) or response_len.shape != (N,):
        raise ValueError(
            f"prompt_len and response_len must be ({N},); got {tuple(prompt_len.shape)} and {tuple(response_len.shape)}"
        )
    total = (prompt_len + response_len).long()
    if bool((prompt_len < 1).any()) or bool((response_len < 0).any()) or bool((total > L).any()):
        n = int(torch.nonzero((prompt_len < 1) | (response_len < 0) | (total > L))[0, 0])
        raise ValueError(
            f"row {n}: prompt_len={int(prompt_len[n])}, response_len={int(response_len[n])} do not fit "
            f"a row of length {L} (need prompt_len >= 1, response_len >= 0, sum <= L)"
        )
    device = next(model.parameters()).device
    attn = (torch.arange(L).unsqueeze(0) < total.unsqueeze(1)).long()  # (N, L)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=tokens.long().to(device), attention_mask=attn.to(device)).logits
    finally:
        model.train(was_training)
    log_mu = sampler_log_probs(logits, spec).cpu()  # (N, L, V)
    return log_mu.masked_fill(~attn.bool().unsqueeze(-1), 0.0)


def mu_from_topk(topk_ids: Tensor, topk_logp: Tensor, tail: Tensor, policy_probs: Tensor) -> Tensor:
    """The full sampler distribution μ from a top-k record, by the tail rule.

    The k recorded tokens get exp(topk_logp); the tail mass is spread over the other V − k tokens in
    proportion to the policy's probabilities p renormalised over them (uniformly where p puts no mass
    there); the result is renormalised to sum to 1 (an engine's top-k log-probs can sum slightly above
    1). Duplicate ids contribute their summed probability. Approximation bound: when ``tail`` is the
    true mass outside the top-k, the reconstruction agrees with μ on the top-k and puts the same mass
    on the rest, so the total-variation distance to the true μ is at most ``tail`` and the error of a
    μ-expectation Σ_v μ_v x_v is at most ``tail`` · (max − min of x over the tail tokens).

    Args:
        topk_ids: shape (..., k) int, token ids in [0, V).
        topk_logp: shape (..., k) float, log μ of those tokens (``-inf`` allowed).
        tail: shape (...,) float, mass of μ outside the top-k, ≥ 0.
        policy_probs: shape (..., V) float, the policy's next-token probabilities.

    Returns:
        shape (..., V) float64 probabilities μ that sum to 1 over the last axis.
    """
    lead = tuple(policy_probs.shape[:-1])
    if tuple(topk_ids.shape) != tuple(topk_logp.shape) or tuple(topk_ids.shape[:-1]) != lead:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} and topk_logp {tuple(topk_logp.shape)} must both be "
            f"(*{lead}, k) to match policy_probs {tuple(policy_probs.shape)}"
        )
    if tuple(tail.shape) != lead:
        raise ValueError(f"tail must have shape {lead}; got {tuple(tail.shape)}")
    V = policy_probs.shape[-1]
    ids = topk_ids.long()
    if bool(((ids < 0) | (ids >= V)).any()):
        raise ValueError(f"topk_ids must lie in [0, {V}); found {int(ids[(ids < 0) | (ids >= V)][0])}")
    p = policy_probs.to(torch.float64)
    head = torch.zeros_like(p).scatter_add_(-1, ids, topk_logp.to(torch.float64).exp())  # (..., V)
    outside = torch.ones_like(p, dtype=torch.bool).scatter_(-1, ids, False)  # (..., V)
    p_out = torch.where(outside, p, 0.0)
    p_sum = p_out.sum(-1, keepdim=True)
    uniform = outside.to(torch.float64) / outside.sum(-1, keepdim=True).clamp_min(1)
    spread = torch.where(p_sum > 0, p_out / p_sum.clamp_min(torch.finfo(torch.float64).tiny), uniform)
    mu = head + tail.to(torch.float64).unsqueeze(-1) * spread
    return mu / mu.sum(-1, keepdim=True)


def check_rewards(rewards: np.ndarray) -> None:
    """Raise ValueError naming the first index whose reward is NaN or ±inf."""
    bad = np.flatnonzero(~np.isfinite(np.asarray(rewards, dtype=np.float64)))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"reward[{i}] = {rewards[i]} is not finite; fix the reward function for that sample")


def check_sampler_logp(logp: np.ndarray, where: str) -> None:
    """ValueError naming ``where`` (the sampler), the first sample and position whose log μ is NaN or ±inf and how
    many are, unless every entry of ``logp`` (N, T) float, the sampler's log-probability of each drawn token in nats
    (0 after a response's end), is finite: a non-finite μ would centre every score on NaN."""
    bad = ~np.isfinite(np.asarray(logp))  # (N, T)
    if bad.any():
        n, t = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"{where}: the sampler's log-probability of sample {n}, token {t} is {logp[n, t]} ({int(bad.sum())} "
            "non-finite of the drawn tokens' log-probs); fix the sampler's weights or settings, or the imported "
            "logprobs"
        )


ADVANTAGE_EPS = 1e-4
"""The eps that TRL's GRPOTrainer adds to the reward std before dividing (``advantages / (std_rewards + 1e-4)`` in
``trl/trainer/grpo_trainer.py``, TRL 1.16), the default of :func:`compute_advantages`."""


def compute_advantages(
    rewards: np.ndarray, group: np.ndarray, kind: AdvantageKind, eps: float = ADVANTAGE_EPS
) -> np.ndarray:
    """Advantages A_n from rewards r (DESIGN.md §1), named as the trainers name them (docs/regimes.md).

    With n the size of sample n's group, m its group mean Σ r / n and s_{n−1} the group's sample std
    √(Σ (r − m)² / n · n / (n − 1)) (TRL's ``nanstd``, Bessel-corrected):

    - ``group_mean``: r − m (TRL ``scale_rewards="none"``).
    - ``group_zscore``: (r − m) / (s_{n−1} + eps) (TRL's default ``scale_rewards="group"``; eps is added to the
      std, not to the variance).
    - ``batch_zscore``: (r − m) / (S_{N−1} + eps), S_{N−1} the sample std of all N rewards about their global
      mean (TRL ``scale_rewards="batch"``: TRL takes it over one generation batch, so N rewards of one generation
      batch give TRL's values).
    - ``rloo``: r − (Σ_group r − r) / (n − 1), the mean of the other n − 1 rewards of the group as baseline (TRL
      RLOOTrainer). It is n / (n − 1) · (r − m), so with groups of one size n, group_mean's G = mean(A·s) is
      (n − 1)/n of RLOO's.
    - ``global_mean``: r − mean(r). ``none``: r.

    In ``group_zscore``, ``batch_zscore`` and ``rloo`` a group whose rewards are all equal (a group of one
    included) gets advantage exactly 0; TRL gives the same up to its rounding of the mean of equal rewards,
    (r − m) / eps ≤ ulp(r) / eps, and 0 for a group of one (its NaN std, zeroed).

    Args:
        rewards: shape (N,) float, finite.
        group: shape (N,) int, group label of each sample (any integers).
        kind: one of the rules above.
        eps: > 0, added to the std of ``group_zscore`` and ``batch_zscore``.

    Returns:
        shape (N,) float64.
    """
    r = np.asarray(rewards, dtype=np.float64)
    g = np.asarray(group)
    if r.ndim != 1 or g.shape != r.shape:
        raise ValueError(f"rewards and group must both be (N,); got {r.shape} and {g.shape}")
    if kind not in _ADVANTAGE_KINDS:
        raise ValueError(f"advantage kind must be one of {_ADVANTAGE_KINDS}; got {kind!r}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0; got {eps}")
    check_rewards(r)
    if kind == "none":
        return r.copy()
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        if kind == "global_mean":
            return _finite_advantages(r - r.mean(), r, g)
        _, inv = np.unique(g, return_inverse=True)
        counts = np.bincount(inv).astype(np.float64)
        sums = np.bincount(inv, weights=r)
        centred = _finite_advantages(r - (sums / counts)[inv], r, g)
        if kind == "group_mean":
            return centred
        n = counts[inv]
        if kind == "rloo":
            adv = r - (sums[inv] - r) / np.maximum(n - 1, 1)
        else:
            if kind == "group_zscore":
                std = np.sqrt(np.bincount(inv, weights=centred**2) / counts * (counts / (counts - 1)))[inv]
            else:
                std = np.full_like(r, _sample_std(r))
            adv = centred / (_finite_advantages(np.where(n > 1, std, 0.0), r, g) + eps)
        adv = _finite_advantages(adv, r, g)
    r_max = np.full(counts.shape, -np.inf)
    r_min = np.full(counts.shape, np.inf)
    np.maximum.at(r_max, inv, r)
    np.minimum.at(r_min, inv, r)
    constant = (r_max == r_min)[inv]  # exact test: a float std of equal values need not be 0
    return np.where(constant, 0.0, adv)


def _sample_std(r: np.ndarray) -> float:
    """TRL's ``nanstd`` of all N rewards ``r`` (N,): √(mean((r − mean r)²) · N / (N − 1)); 0 when N = 1 (TRL's
    batch std of a single reward)."""
    if r.size < 2:
        return 0.0
    return float(np.sqrt(np.mean((r - r.mean()) ** 2) * (r.size / (r.size - 1))))


def _finite_advantages(values: np.ndarray, rewards: np.ndarray, group: np.ndarray) -> np.ndarray:
    """``values`` (N,) when every entry is finite; else ValueError naming the first sample, its group and
    its reward (rewards so large that float64 arithmetic on them overflows)."""
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        i = int(bad[0])
        raise ValueError(
            f"the advantage of sample {i} (group {group[i]}, reward {float(rewards[i])!r}) overflows float64; "
            "rescale the reward to moderate values"
        )
    return values
