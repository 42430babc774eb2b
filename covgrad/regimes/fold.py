"""The gradient fold of a regime: its per-sample gradients g_n folded per prompt-group parity half beside the
score's moments (:class:`RegimeMoments`), and the LM head's token Fisher at the fold's rows
(:func:`head_token_fisher`), the F with which a full-distribution regime's bound holds in-sample exactly.

Shape notation: B samples in the batch, L sequence positions, V vocabulary, H the LM head's input width, P
parameter elements.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from covgrad.moments import GroupAccumulator
from covgrad.regimes.cotangents import RegimeGrad, ScoredRows
from covgrad.regimes.errors import clustered_mean_se

if TYPE_CHECKING:
    from covgrad.scores.engine import Cotangent, PerSampleGrads


class RegimeMoments:
    """One regime's per-sample gradients folded per parity half beside the score's moments, with its bound.

    The g_n are folded through :meth:`covgrad.scores.engine.PerSampleGrads.accumulate` (no B × P rows) by a
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
                :class:`covgrad.scores.engine.Cotangent`, other regimes' :meth:`cotangent`): one forward for all,
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
        from covgrad.scores.engine import Cotangent  # here: covgrad.scores.engine imports transformers

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

    def _clustered(self, halves: list[int] | None, cols: slice | None = None) -> tuple[np.ndarray, np.ndarray, float]:
        """:func:`clustered_mean_se` of the groups' sums of g_n over ``halves`` (None: all) at columns ``cols``
        (None: all P): the mean and standard error, each shape (columns,) float64, and the groups counted.

        Raises:
            ValueError: no samples folded in ``halves``.
        """
        hs = self._halves(halves)
        r = self.acc.rows(slice(None) if cols is None else cols)
        if r["count"][hs].sum() == 0:
            raise ValueError(f"no samples folded in halves {hs}")
        mean = r["mean_s"].astype(np.float64) + r.get("mean_s_lo", 0.0)
        c = r["c_as"][hs].astype(np.float64) if "c_as" in r else None
        return clustered_mean_se(r["count"][hs], r["mean_a"][hs], r["m2_a"][hs], mean[hs], r["m2_s"][hs], c)

    def gradient(self, halves: list[int] | None = None, cols: slice | None = None) -> np.ndarray:
        """G = mean of g_n over the samples of ``halves`` (None: all) at columns ``cols`` (None: all P; each
        column's G depends on that column's state alone): shape (columns,) float64."""
        return self._clustered(halves, cols)[0]

    def standard_error(self, halves: list[int] | None = None, cols: slice | None = None) -> np.ndarray:
        """The prompt-clustered standard error of :meth:`gradient` (:func:`clustered_mean_se`) at columns ``cols``
        (None: all P): shape (columns,) float64 (NaN with fewer than 2 groups)."""
        return self._clustered(halves, cols)[1]

    def bound_a2(self, halves: list[int] | None = None) -> float | None:
        """a² = mean of the bound scalar over the samples of ``halves`` (None when the regime has none)."""
        hs = self._halves(halves)
        count = self.bound_count[hs].sum()
        return None if count == 0 else float(self.bound_sum[hs].sum() / count)


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
    rows = ScoredRows.of(response_mask)
    for n in range(B):  # one sample's (T_n, V) float64 block at a time
        flat = rows.flat[rows.sample == n].to(logits.device)
        if flat.numel() == 0:
            continue
        t = flat - n * L
        p = torch.softmax(logits[n, t].to(torch.float64) / temperature, -1)
        a = p * (1 - p) / temperature**2  # (T_n, V)
        out[int(half[n])] += (a.T @ hidden[n, t].to(torch.float64).square()).reshape(-1)
    return out
