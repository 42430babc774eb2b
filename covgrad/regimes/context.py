"""The teacher context of context distillation: a teacher that reads its own prompt, then the policy's response
tokens (:func:`prefixed_batch`), its logits moved back to the policy rows' positions (:func:`align_prefixed_logits`),
where the regimes' cotangents expect them.

Shape notation: B samples, L the policy rows' width, Lq the teacher rows' width, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


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
