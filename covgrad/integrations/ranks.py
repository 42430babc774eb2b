"""In-run statistics on a trainer's own ranks, with the policy FSDP2-sharded (``fully_shard``) under the trainer's
process group: each rank folds only its own shard's columns, as the scores stage's ranks do
(:mod:`covgrad.distributed.fsdp`), and rank 0 writes the step's files.

The trainer calls two things, in this order::

    plan = prepare_ranks(model, params=None)          # collective, before the trainer's fully_shard
    for layer in model.model.layers:                  # the trainer's own sharding
        fully_shard(layer)
    fully_shard(model)
    folder = RankInRunFolder(model, plan, every_n=10, out_dir="run/inrun")
    for step, batch in enumerate(loader):             # every rank, every step (the fold is collective)
        folder.fold(step, batch.input_ids, batch.attention_mask, batch.response_mask, batch.advantages)
        ...                                           # the trainer's forward, backward, optimizer step

:func:`prepare_ranks` takes the engine's first-call trace (which parameter each hooked module uses, which modules
keep the samples apart on a flattened batch) on rank 0's model before it is sharded and broadcasts it
(:func:`covgrad.distributed.fsdp.trace_on_rank0`): the trace backpropagates from inside the decoder layers, where
FSDP2 all-gathers nothing. Rank 0 must hold the weights then (as the trainer loads them before sharding); the
other ranks may hold the model on the meta device. No copy of the model is made on any rank.

A due step (:meth:`InRunFolder.due`) runs, on every rank, one engine pass per rank's rows: rank s's batch (its
data-parallel share of the step: ids, masks, advantages, groups) is broadcast from s, every rank runs its forward
and per-sample backward on the sharded model (FSDP2 all-gathers one layer at a time, as in training) and folds
the columns of its own shard (:class:`covgrad.distributed.fsdp.ShardAccumulator`: the dim-0 rows FSDP2 gave it)
into its own float64 moment state; so the step's state is that of the R batches folded one after the other
(Chan merges), 1/R of it on each rank. With ``shared_batch`` every rank already holds the step's whole batch and
the ranks fold it in one pass: the state, the statistics and the sets are then the single-process
:class:`InRunFolder`'s bytes. Each rank reads its columns' statistics off its state (every estimator is column by
column) and its own top ceil(q·P) of each set's values, ties to the lowest index; rank 0 receives, point to point
in rounds of at most ``chunk`` elements per message, each rank's candidates (the global top-k is among the
union of the ranks' top-k under the same order) and its columns of ``vectors``, and keeps the global top-k of the
candidates, exactly :func:`covgrad.moments.topk.topk_indices` over the whole axis.

Memory: each rank 48 B per column of its shard for the state (P_r = P/R); rank 0 holds the gathered
``vectors`` (8 B per selected parameter each) and R·k candidates per set (16 B each); the others 16 B per
candidate. Activations: one rank's batch at a time.

Shape notation: B rows of L tokens, P selected parameter elements, P_r a rank's share, R ranks, k = ceil(q·P).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from covgrad.distributed.fsdp import (
    RankColumns,
    RankTrace,
    ShardAccumulator,
    ShardedPerSampleGrads,
    shard_rows,
    trace_on_rank0,
)
from covgrad.distributed.launch import rank_device
from covgrad.integrations.inrun import METRICS, VECTORS, Batch, InRunFolder, statistics
from covgrad.layout import ParamLayout, select_parameters
from covgrad.moments.accum import MomentAccumulator
from covgrad.moments.topk import count_for_fraction, topk_indices

# Elements of one point-to-point message to rank 0 (8 MiB of float64).
CHUNK = 1 << 20


@dataclass(frozen=True)
class RankPlan:
    """What :func:`prepare_ranks` takes from the unsharded model: the selection's layout (global names, shapes
    and offsets) and the engine's first-call trace by module name."""

    layout: ParamLayout
    trace: RankTrace


def _example(model: nn.Module) -> dict[str, Tensor | None]:
    """A 2-row, 8-token batch without padding, ids within the model's vocabulary (the trace needs 2 rows)."""
    vocab = model.get_input_embeddings().num_embeddings
    ids = (torch.arange(16).reshape(2, 8) * 7 + 3) % vocab
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "position_ids": torch.arange(8).expand(2, 8)}


def prepare_ranks(
    model: nn.Module, params: Sequence[str] | None = None, example: dict[str, Tensor | None] | None = None
) -> RankPlan:
    """The layout of ``params`` and the engine's trace of ``model``, before the trainer shards it (collective:
    rank 0 traces on its weights, every rank receives the trace).

    Args:
        model: the policy, unsharded; rank 0 holds its weights, another rank may hold it on the meta device.
        params: globs of the parameters to analyse (:func:`covgrad.layout.select_parameters`); None: every
            trainable one.
        example: ``input_ids``, ``attention_mask``, ``position_ids`` (2+, L) of any batch the model takes; None:
            2 rows of 8 tokens.

    Raises:
        ValueError: on every rank, when the process group is not initialised, rank 0's model is on the meta
            device, or the trace refuses a parameter (rank 0's message).
    """
    if not dist.is_initialized():
        raise ValueError("prepare_ranks needs the trainer's process group; call dist.init_process_group first")
    if dist.get_rank() == 0 and any(p.is_meta for p in model.parameters()):
        raise ValueError("rank 0 holds the model on the meta device; load its weights there before prepare_ranks")
    layout = select_parameters(model, params)
    return RankPlan(layout, trace_on_rank0(model, layout, example or _example(model)))


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that ``fully_shard`` wrapped (``FSDPModule``), the root included.

    Raises:
        ValueError: when ``model`` is not sharded with ``fully_shard``.
    """
    from torch.distributed.fsdp import FSDPModule

    found = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not found:
        raise ValueError(f"{type(model).__name__} is not sharded; apply fully_shard before RankInRunFolder")
    return found


def check_shards(model: nn.Module, layout: ParamLayout, ranks: int, rank: int) -> None:
    """Refuse a model whose local shards are not FSDP2's default dim-0 ``torch.chunk`` rows (the columns
    :class:`RankColumns` assigns to each rank).

    Raises:
        ValueError: naming the first tensor whose shard differs.
    """
    params = dict(model.named_parameters())
    for e in layout.entries:
        p = params[e.name]
        local = p.to_local() if hasattr(p, "to_local") else p
        rows = e.shape[0] if e.shape else 1
        lo, hi = shard_rows(rows, ranks, rank)
        if local.numel() != (hi - lo) * (e.numel // max(rows, 1)):
            raise ValueError(
                f"rank {rank}'s shard of {e.name!r} has {local.numel()} elements, not rows [{lo}, {hi}) of "
                f"{tuple(e.shape)}; shard with fully_shard's default dim-0 placement"
            )


def broadcast_batch(batch: Batch | None, src: int, device: torch.device) -> Batch:
    """Rank ``src``'s batch (:data:`covgrad.integrations.inrun.Batch`; None on the other ranks) on every rank, ids,
    masks and positions as int64 (collective; on ``device`` for the transfer, advantages and rows back on the
    CPU)."""
    mine = dist.get_rank() == src
    shape = torch.tensor(batch[0].shape if mine and batch is not None else (0, 0), dtype=torch.int64, device=device)
    dist.broadcast(shape, src=src)
    B, L = (int(x) for x in shape.tolist())
    specs = [((B, L), torch.int64), ((B, L), torch.int64), ((B, L), torch.int64), ((B, L), torch.float32)]
    specs += [((B,), torch.float64), ((B,), torch.int64)]
    out = []
    for i, (size, dtype) in enumerate(specs):
        if mine and batch is not None:
            t = batch[i].to(device=device, dtype=dtype).contiguous()
        else:
            t = torch.empty(size, dtype=dtype, device=device)
        dist.broadcast(t, src=src)
        out.append(t)
    ids, mask, pos, w, a, half = out
    return ids, mask, pos, w, a.cpu(), half.cpu()


def gather_to0(local: np.ndarray, chunk: int = CHUNK) -> list[np.ndarray] | None:
    """Every rank's 1-D array ``local`` on rank 0, in rank order (None on the others): each rank in turn sends
    its length, then its values in messages of at most ``chunk`` elements (point to point, collective)."""
    device = rank_device()
    rank, R = dist.get_rank(), dist.get_world_size()
    if rank != 0:
        dist.send(torch.tensor([local.shape[0]], dtype=torch.int64, device=device), dst=0)
        flat = torch.from_numpy(np.ascontiguousarray(local))
        for lo in range(0, flat.shape[0], chunk):
            dist.send(flat[lo : lo + chunk].to(device), dst=0)
        return None
    parts = [local]
    for src in range(1, R):
        n = torch.zeros(1, dtype=torch.int64, device=device)
        dist.recv(n, src=src)
        buf = np.empty(int(n.item()), dtype=local.dtype)
        for lo in range(0, buf.shape[0], chunk):
            piece = torch.empty(min(chunk, buf.shape[0] - lo), dtype=torch.from_numpy(buf[:0]).dtype, device=device)
            dist.recv(piece, src=src)
            buf[lo : lo + piece.shape[0]] = piece.cpu().numpy()
        parts.append(buf)
    return parts


class RankInRunFolder(InRunFolder):
    """:class:`InRunFolder` on the ranks of a trainer whose policy is sharded with ``fully_shard`` (see the
    module docstring). Every rank builds one and calls :meth:`fold` at every step with its own rows; rank 0
    writes the files and gets the :class:`covgrad.integrations.inrun.InRunStep` (its ``stats``: the scalars and
    the gathered ``vectors``), the other ranks get None.

    Args:
        model: the sharded policy (the module ``fully_shard`` was applied to last).
        plan: :func:`prepare_ranks` of the model before sharding.
        every_n, out_dir, q, temperature, vectors, state_dtype, check: as :class:`InRunFolder` (only rank 0
            writes ``out_dir``).
        shared_batch: every rank passes the step's whole batch (one pass); False: each rank passes its own rows
            and the step's batch is theirs in rank order (one pass per rank).
        chunk: elements per point-to-point message to rank 0.

    Raises:
        ValueError: when the model is not sharded by ``fully_shard`` along dim 0, or the plan's selection is not
            the sharded model's.
    """

    def __init__(
        self,
        model: nn.Module,
        plan: RankPlan,
        every_n: int = 1,
        out_dir: str | Path | None = None,
        *,
        q: float = 0.01,
        temperature: float = 1.0,
        vectors: Sequence[str] = VECTORS,
        state_dtype: str = "float64",
        check: bool = False,
        shared_batch: bool = False,
        chunk: int = CHUNK,
    ) -> None:
        self.rank, self.ranks = dist.get_rank(), dist.get_world_size()
        super().__init__(
            model,
            plan.layout.names,
            every_n,
            out_dir if self.rank == 0 else None,
            q=q,
            temperature=temperature,
            vectors=vectors,
            state_dtype=state_dtype,
            check=check,
        )
        if self.layout != plan.layout:
            raise ValueError("the sharded model's selection differs from the plan's; prepare_ranks the same model")
        self.modules = fsdp_modules(model)
        check_shards(model, self.layout, self.ranks, self.rank)
        self.plan, self.shared_batch, self.chunk = plan, shared_batch, chunk
        self.columns = RankColumns.of(self.layout, self.ranks, self.rank)

    def _fold(self, ids: Tensor, mask: Tensor, position_ids: Tensor, w: Tensor, a: Tensor, half: Tensor) -> Any:
        """This rank's columns of the step's batch: one pass per rank's rows (or one of the shared batch)."""
        if self._psg is None:
            self._psg = ShardedPerSampleGrads(self.model, self.layout, self.plan.trace, self.modules, check=self.check)
        device = self._device()
        acc = MomentAccumulator(self.columns.P, device, self.state_dtype, halves=2, switch_P=self.layout.P)
        shard = ShardAccumulator(acc, self.columns, self.layout.P)
        mine: Batch = (ids, mask, position_ids, w, a, half)
        transfer = rank_device()
        for src in [self.rank] if self.shared_batch else range(self.ranks):
            batch = mine if self.shared_batch else broadcast_batch(mine if src == self.rank else None, src, transfer)
            self._pass(self._psg, shard, tuple(t.to(device) if t.dim() == 2 else t for t in batch))
        return acc

    def _reduce(self, acc: Any) -> tuple[dict[str, Any] | None, dict[str, np.ndarray] | None]:
        """This rank's columns' statistics; on rank 0 the scalars, the gathered ``vectors`` and the global top
        sets (collective)."""
        local = statistics(acc.rows())
        violations = torch.tensor([int(local["bound_violations"])], dtype=torch.int64, device=rank_device())
        dist.all_reduce(violations)
        k = count_for_fraction(self.q, self.layout.P)
        index = self.columns.index()  # (P_r,) ascending global columns
        top: dict[str, np.ndarray] = {}
        for name, src in METRICS.items():
            values = np.abs(local[src])
            picked = topk_indices(values, min(k, values.shape[0]))  # this rank's top, ties to the lowest column
            got_values, got_index = gather_to0(values[picked], self.chunk), gather_to0(index[picked], self.chunk)
            if got_values is not None and got_index is not None:
                cand, where = np.concatenate(got_values), np.concatenate(got_index)
                order = np.argsort(where, kind="stable")  # candidates by global column: ties to the lowest
                top[name] = where[order][topk_indices(cand[order], min(k, cand.shape[0]))]
        gathered = {v: self._gather_columns(local[v]) for v in self.vectors}
        if self.rank != 0:
            return None, None
        stats: dict[str, Any] = {s: local[s] for s in ("N", "mean_A", "std_A", "rho_undefined")}
        stats["bound_violations"] = np.int64(violations.item())
        stats.update(gathered)
        return stats, top

    def _gather_columns(self, values: np.ndarray) -> np.ndarray | None:
        """A (P_r,) statistic of every rank assembled into the layout's (P,) on rank 0 (None on the others)."""
        parts = gather_to0(np.ascontiguousarray(values, dtype=np.float64), self.chunk)
        if parts is None:
            return None
        out = np.empty(self.layout.P, dtype=np.float64)
        for r, part in enumerate(parts):
            cols = RankColumns.of(self.layout, self.ranks, r)
            for a, b, at in zip(cols.starts, cols.stops, cols.local, strict=True):
                out[a:b] = part[at : at + b - a]
        return out
