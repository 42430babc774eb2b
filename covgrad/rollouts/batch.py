"""The rollout batch every engine consumes: one typed set of (B, L) rows built in one place.

Rows are right-padded (prompt, then response, then padding), so ``position_ids`` are 0..L−1 on every row
and ``attention_mask`` marks the first ``prompt_len + response_len`` tokens. Batches hold whole prompt
groups (:func:`group_batches`), so group-relative advantages and the parity split stay exact.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch


@dataclass(frozen=True)
class RolloutBatch:
    """B rollouts of one batch (whole prompt groups), as torch tensors on one device."""

    input_ids: torch.Tensor  # (B, L) int64: prompt then response token ids, right-padded with 0
    attention_mask: torch.Tensor  # (B, L) int64: 1 on the prompt and response tokens, 0 on padding
    position_ids: torch.Tensor  # (B, L) int64: 0..L−1 on every row (right padding)
    response_mask: torch.Tensor  # (B, L) float32: 1 at the scored response tokens
    prompt_len: torch.Tensor  # (B,) int64: prompt tokens of each row
    response_len: torch.Tensor  # (B,) int64: response tokens of each row
    advantages: torch.Tensor  # (B,) float64: the sequence advantage A of each row
    group: torch.Tensor  # (B,) int64: prompt group of each row

    @classmethod
    def from_arrays(
        cls,
        tokens: np.ndarray,
        prompt_len: np.ndarray,
        response_len: np.ndarray,
        response_mask: np.ndarray,
        advantage: np.ndarray,
        group: np.ndarray,
        trim: bool,
    ) -> RolloutBatch:
        """The batch of the rollouts store's rows: ``tokens``, ``response_mask`` (B, W); ``prompt_len``,
        ``response_len``, ``advantage``, ``group`` (B,). ``trim`` drops the columns past the longest row
        (L = max(prompt_len + response_len)); otherwise L = W, the store's padded width."""
        pl = torch.from_numpy(np.asarray(prompt_len)).long()
        rl = torch.from_numpy(np.asarray(response_len)).long()
        L = int((pl + rl).max()) if trim else tokens.shape[1]
        ids = torch.from_numpy(np.asarray(tokens[:, :L])).long()
        return cls(
            input_ids=ids,
            attention_mask=(torch.arange(L)[None, :] < (pl + rl)[:, None]).long(),
            position_ids=torch.arange(L).expand_as(ids),
            response_mask=torch.from_numpy(np.asarray(response_mask[:, :L])).float(),
            prompt_len=pl,
            response_len=rl,
            advantages=torch.from_numpy(np.asarray(advantage, dtype=np.float64)),
            group=torch.from_numpy(np.asarray(group)).long(),
        )

    @property
    def size(self) -> int:
        """B, the number of rollouts."""
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> RolloutBatch:
        """The same batch with every tensor on ``device``."""
        return RolloutBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})


def group_batches(group: np.ndarray, groups_per_batch: int) -> list[tuple[int, int]]:
    """[lo, hi) sample ranges, each holding ``groups_per_batch`` whole consecutive groups of ``group`` (N,)."""
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    bounds = [*starts[::groups_per_batch].tolist(), len(group)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))
