"""A plain hook for any trainer: "here is my model, my batch and its advantages; fold" (verl, OpenRLHF, a
hand-written loop, a Ray actor), thin over :class:`covgrad.integrations.inrun.InRunFolder` (one process) and
:class:`covgrad.integrations.ranks.RankInRunFolder` (the trainer's FSDP2 ranks).

One process::

    from covgrad.integrations.torch import InRunHook

    hook = InRunHook(model, "run/inrun", every_n=10)
    for step, batch in enumerate(loader):
        hook(step, batch)                       # before the step's update: the statistics of θ_t; None unless due
        loss = ...; loss.backward(); optimizer.step(); optimizer.zero_grad()

On FSDP2 ranks, the plan is taken before the trainer shards (:func:`covgrad.integrations.ranks.prepare_ranks`)::

    plan = prepare_ranks(model)
    ...                                         # the trainer's fully_shard
    hook = InRunHook(model, "run/inrun", every_n=10, plan=plan)
    hook(step, batch)                           # every rank, with its own rows; rank 0 writes

``batch`` is a mapping of tensors with the names a trainer's rollout batch usually has (verl's ``DataProto.batch``,
OpenRLHF's experience, a dict):

- ``input_ids``, ``attention_mask``: (B, L), prompt and response concatenated, any padding;
- ``response_mask``: (B, L) the loss weight of each token position, or (B, T) the last T positions' (verl's
  ``response_mask`` over its ``responses``, which end ``input_ids``);
- ``advantages``: (B,) sequence advantages, or (B, T) / (B, L) per-token advantages that are constant over each
  row's response tokens (GRPO, RLOO, REINFORCE++ in verl): the row's value is taken; a per-token advantage that
  varies within a row (GAE) is refused, since the in-run state is the sequence regime's (``rl``);
- ``position_ids`` (optional): (B, L);

and ``group`` (the rows' prompt groups, any hashable values: verl's ``uid`` strings) sets each row's accumulator
half (the groups numbered in order of first appearance, parity); None: one half.

Shape notation: B rows of L tokens, T response positions.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from covgrad.integrations.blocks import BLOCK
from covgrad.integrations.inrun import VECTORS, InRunFolder, InRunStep

# Relative spread of a row's per-token advantages over its response tokens still read as one sequence advantage.
CONSTANT_RTOL = 1e-6


def full_mask(response_mask: Tensor, L: int) -> Tensor:
    """A (B, T) mask of the last T of L positions as (B, L) (zeros before); a (B, L) mask as it is.

    Raises:
        ValueError: when T > L or the mask is not 2-D.
    """
    if response_mask.dim() != 2 or response_mask.shape[1] > L:
        raise ValueError(f"response_mask must be (B, T <= L = {L}); got {tuple(response_mask.shape)}")
    T = response_mask.shape[1]
    out = response_mask.new_zeros(response_mask.shape[0], L)
    out[:, L - T :] = response_mask
    return out


def sequence_advantages(advantages: Tensor | np.ndarray, mask: Tensor) -> Tensor:
    """(B,) float64 sequence advantages from (B,) ones, or from per-token (B, T) ones aligned with the last T
    positions of ``mask`` (B, L): each row's value over its response tokens (0 for a row without one).

    Raises:
        ValueError: when a row's per-token advantages vary over its response tokens by more than
            :data:`CONSTANT_RTOL` of the largest |advantage|, or the shape fits neither form.
    """
    a = torch.as_tensor(advantages).detach().double().cpu()
    if a.dim() == 1:
        return a
    if a.dim() != 2 or a.shape[0] != mask.shape[0]:
        raise ValueError(f"advantages must be (B,) or (B, T) for {mask.shape[0]} rows; got {tuple(a.shape)}")
    L, T = mask.shape[1], a.shape[1]
    if T > L:
        raise ValueError(f"per-token advantages must cover T <= L = {L} positions; got {tuple(a.shape)}")
    on = mask.detach().cpu()[:, L - T :] != 0  # (B, T): the rows' response tokens among the last T positions
    first = torch.where(on.any(1), on.long().argmax(1), 0)  # (B,) first response token of each row
    seq = torch.where(on.any(1), a.gather(1, first[:, None])[:, 0], 0.0)
    spread = ((a - seq[:, None]).abs() * on).amax() if a.numel() else torch.tensor(0.0)
    if spread > CONSTANT_RTOL * max(float(a.abs().amax()) if a.numel() else 0.0, 1e-300):
        raise ValueError(
            f"per-token advantages vary within a row (by up to {float(spread):.3g}); the in-run fold takes one "
            "advantage per sequence (pass (B,) advantages)"
        )
    return seq


def group_ids(group: Sequence[Any] | Tensor | np.ndarray) -> np.ndarray:
    """(B,) int64: each row's group numbered by first appearance (any hashable labels, e.g. verl's uids)."""
    labels = group.tolist() if isinstance(group, Tensor | np.ndarray) else list(group)
    seen: dict[Any, int] = {}
    return np.asarray([seen.setdefault(g, len(seen)) for g in labels], dtype=np.int64)


class InRunHook:
    """Fold a trainer's batch every ``every_n`` steps (see the module docstring).

    Args:
        model: the policy on its device (with ``plan``: sharded by the trainer's ``fully_shard``).
        out_dir: where the per-step files go (:class:`InRunFolder`'s; on ranks, rank 0 writes); None: none.
        every_n: fold the first call's step, then the first step at least ``every_n`` after the last fold.
        params: globs of the parameters to analyse; None: every trainable one (with ``plan``: the plan's).
        q: the fraction of the top sets.
        temperature: τ of the trainer's log-probabilities.
        vectors: the (P,) statistics written per step.
        plan: :func:`covgrad.integrations.ranks.prepare_ranks` of the model before sharding: fold on the ranks.
        shared_batch: on ranks, every rank passes the step's whole batch (else each its own rows).
        keep: the (P,) statistics the returned :class:`InRunStep` holds (a written one a read-only view of its npz
            member, one not written 8 B per parameter in host memory); None: the folder's default (one process:
            every statistic, :attr:`InRunFolder.STATISTICS`; on ranks: ``vectors``); () for the scalars and sets
            only, host memory O(block + k).
        block: columns of the state read and reduced at a time (≥ 1; on ranks, of each rank's own columns); the
            host holds a few hundred bytes per column of a block.

    Raises:
        ValueError: a sharded model without ``plan``, a plan with ``params``, block < 1, or a vector or kept
            statistic the folder does not compute.
    """

    def __init__(
        self,
        model: nn.Module,
        out_dir: str | Path | None = None,
        every_n: int = 10,
        params: Sequence[str] | None = None,
        *,
        q: float = 0.01,
        temperature: float = 1.0,
        vectors: Sequence[str] = VECTORS,
        plan: Any = None,
        shared_batch: bool = False,
        keep: Sequence[str] | None = None,
        block: int = BLOCK,
    ) -> None:
        kwargs: dict[str, Any] = {"q": q, "temperature": temperature, "vectors": vectors, "keep": keep, "block": block}
        if plan is not None:
            from covgrad.integrations.ranks import RankInRunFolder

            if params is not None:
                raise ValueError("the plan fixes the parameters; pass params to prepare_ranks")
            self.folder: InRunFolder = RankInRunFolder(
                model, plan, every_n, out_dir, shared_batch=shared_batch, **kwargs
            )
        elif any(hasattr(p, "to_local") for p in model.parameters()):
            raise ValueError("the model is sharded; pass plan=prepare_ranks(model) taken before fully_shard")
        else:
            self.folder = InRunFolder(model, params, every_n, out_dir, **kwargs)

    def due(self, step: int) -> bool:
        """Whether a call at ``step`` folds (:meth:`InRunFolder.due`)."""
        return self.folder.due(step)

    def __call__(
        self,
        step: int,
        batch: Mapping[str, Tensor],
        advantages: Tensor | np.ndarray | None = None,
        group: Sequence[Any] | Tensor | np.ndarray | None = None,
    ) -> InRunStep | None:
        """Fold ``batch`` at ``step`` when due (:meth:`InRunFolder.fold`; on ranks collective, every rank).

        Args:
            step: the trainer's step (optimizer steps taken before the batch).
            batch: ``input_ids``, ``attention_mask``, ``response_mask`` and (unless given here) ``advantages``;
                ``position_ids`` optional (module docstring).
            advantages: (B,) or per-token advantages, instead of ``batch["advantages"]``.
            group: (B,) prompt group labels of the rows; None: one accumulator half.

        Returns:
            the step's :class:`InRunStep` (rank 0), or None when not due (and on the other ranks).

        Raises:
            KeyError: naming a missing batch entry. ValueError: as :func:`sequence_advantages` and
            :meth:`InRunFolder.fold`.
        """
        if not self.folder.due(step):
            return None
        missing = [k for k in ("input_ids", "attention_mask", "response_mask") if k not in batch]
        if advantages is None and "advantages" not in batch:
            missing.append("advantages")
        if missing:
            raise KeyError(f"the batch has no {missing}; it holds {sorted(batch)}")
        ids = batch["input_ids"]
        mask = full_mask(batch["response_mask"], ids.shape[1])
        a = sequence_advantages(batch["advantages"] if advantages is None else advantages, mask)
        return self.folder.fold(
            step,
            ids,
            batch["attention_mask"],
            mask,
            a,
            position_ids=batch.get("position_ids"),
            group=None if group is None else group_ids(group),
        )
