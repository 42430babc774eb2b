"""In-run statistics on a trainer's own ranks, with the policy FSDP2-sharded (``fully_shard``) under the trainer's
process group, or replicated on every rank (data parallel, e.g. DDP): each rank folds only its own shard's columns
(for a replicated policy, the columns its dim-0 shard would hold), as the scores stage's ranks do
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
:class:`InRunFolder`'s bytes. Each rank reads its columns' statistics off its state ``block`` columns at a time
(every estimator is column by column: :mod:`covgrad.integrations.blocks`), in lockstep: after each block, rank 0
receives every rank's block of the written and kept vectors (point to point, at most ``chunk`` elements per
message) and puts it at its global columns. Each rank streams its own top ceil(q·P) of each set's values over its
blocks (:class:`covgrad.moments.topk.StreamingTopK`, ties to the lowest global column); then rank 0 receives each
rank's candidates, ``chunk`` at a time, into its own stream of the global top-k (the global top-k is among the union
of the ranks' top-k under the same order): exactly :func:`covgrad.moments.topk.topk_indices` over the whole axis.

Memory: each rank 48 B per column of its shard for the state (P_r = P/R) on its device; on the host one block's
statistics and up to 3·2k candidates (16 B each); rank 0 also one other rank's block of the gathered vectors at a
time, and the step's vectors go to disk block by block (a kept vector that is written is a view of its npz member;
one that is not, 8 B per selected parameter in memory). Activations: one rank's batch at a time.

Shape notation: B rows of L tokens, P selected parameter elements, P_r a rank's share, R ranks, k = ceil(q·P).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Mapping, Sequence
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
from covgrad.integrations.blocks import BLOCK, StepVectors, column_blocks, merge_scalars
from covgrad.integrations.inrun import METRICS, VECTORS, Batch, InRunFolder
from covgrad.layout import ParamLayout, select_parameters
from covgrad.moments.accum import MomentAccumulator
from covgrad.moments.topk import StreamingTopK, count_for_fraction

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
    """The modules of ``model`` that ``fully_shard`` wrapped (``FSDPModule``), the root included; [] for a model
    that is not sharded (replicated on every rank)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


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


def local_runs(columns: RankColumns, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
    """The runs of a rank's local columns [lo, hi) on the global axis: (global start, global stop, their offset
    in [lo, hi)) per run, ascending."""
    i = max(0, bisect.bisect_right(columns.local, lo) - 1)
    at = lo
    while at < hi:
        end = min(hi, columns.local[i] + columns.stops[i] - columns.starts[i])
        if end > at:
            start = columns.starts[i] + at - columns.local[i]
            yield start, start + end - at, at - lo
            at = end
        i += 1


def send_to0(values: np.ndarray, chunk: int) -> None:
    """Send 1-D ``values`` to rank 0 in messages of at most ``chunk`` elements (point to point; rank 0 takes them
    with :func:`recv_from`, knowing their count and dtype)."""
    device = rank_device()
    flat = torch.from_numpy(np.ascontiguousarray(values))
    for lo in range(0, flat.shape[0], chunk):
        dist.send(flat[lo : lo + chunk].to(device), dst=0)


def recv_from(src: int, n: int, dtype: type[np.generic], chunk: int) -> np.ndarray:
    """On rank 0: the (n,) array of ``dtype`` that rank ``src`` sends with :func:`send_to0`."""
    device = rank_device()
    out = np.empty(n, dtype=dtype)
    kind = torch.from_numpy(out[:0]).dtype
    for lo in range(0, n, chunk):
        piece = torch.empty(min(chunk, n - lo), dtype=kind, device=device)
        dist.recv(piece, src=src)
        out[lo : lo + piece.shape[0]] = piece.cpu().numpy()
    return out


class RankInRunFolder(InRunFolder):
    """:class:`InRunFolder` on the ranks of a trainer whose policy is sharded with ``fully_shard`` or replicated
    (see the module docstring). Every rank builds one and calls :meth:`fold` at every step with its own rows;
    rank 0 writes the files and gets the :class:`covgrad.integrations.inrun.InRunStep` (its ``stats``: the scalars
    and the gathered ``keep`` statistics), the other ranks get None. A replicated policy's ranks each run the
    per-sample passes of every rank's rows on their whole model and fold their share of the columns: the same
    files as the sharded policy's.

    Args:
        model: the sharded policy (the module ``fully_shard`` was applied to last), or the replicated one (the
            module a data-parallel wrapper holds, with every rank's weights equal).
        plan: :func:`prepare_ranks` of the model before sharding.
        every_n, out_dir, q, temperature, vectors, state_dtype, check, block: as :class:`InRunFolder` (only rank 0
            writes ``out_dir``; ``block``: columns of each rank's own axis at a time).
        keep: the (P,) statistics rank 0's :class:`InRunStep` holds; None: ``vectors`` (views of the npz when
            ``out_dir`` is given, else in memory).
        shared_batch: every rank passes the step's whole batch (one pass); False: each rank passes its own rows
            and the step's batch is theirs in rank order (one pass per rank).
        chunk: elements per point-to-point message to rank 0.

    Raises:
        ValueError: when a sharded model's shards are not ``fully_shard``'s dim-0 rows, or the plan's selection
            is not the model's.
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
        keep: Sequence[str] | None = None,
        block: int = BLOCK,
        shared_batch: bool = False,
        chunk: int = CHUNK,
    ) -> None:
        self.rank, self.ranks = dist.get_rank(), dist.get_world_size()
        kept = tuple(vectors) if keep is None else tuple(keep)
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
            keep=kept if self.rank == 0 else (),
            block=block,
        )
        if self.layout != plan.layout:
            raise ValueError("the model's selection differs from the plan's; prepare_ranks the same model")
        self.modules = fsdp_modules(model)
        if self.modules:
            check_shards(model, self.layout, self.ranks, self.rank)
        self.plan, self.shared_batch, self.chunk = plan, shared_batch, chunk
        self.all_columns = [RankColumns.of(self.layout, self.ranks, r) for r in range(self.ranks)]
        self.columns = self.all_columns[self.rank]
        # the statistics rank 0 gathers, in the order every rank sends them: the written and the kept ones (whether
        # or not a rank other than 0 was given out_dir)
        self.gathered = tuple(dict.fromkeys((*self.vectors, *kept)))

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

    def _reduce(self, state: Any, vectors: StepVectors) -> tuple[dict[str, Any] | None, dict[str, np.ndarray] | None]:
        """This rank's columns' statistics block by block, the ranks in lockstep; on rank 0 the scalars, the
        gathered statistics put into ``vectors`` and the global top sets (collective)."""
        k = count_for_fraction(self.q, self.layout.P)
        tops = {name: StreamingTopK(k) for name in METRICS}
        blocks = [column_blocks(c.P, self.block) for c in self.all_columns]
        scalars = None
        for j in range(max(len(b) for b in blocks)):
            if j < len(blocks[self.rank]):
                stats = self._own_block(state, vectors, tops, *blocks[self.rank][j])
                scalars = merge_scalars(scalars, stats, self._scalar_names())
            for src in range(1, self.ranks) if self.rank == 0 else ():
                if j < len(blocks[src]):
                    lo, hi = blocks[src][j]
                    got = {v: recv_from(src, hi - lo, np.float64, self.chunk) for v in self.gathered}
                    self._put(vectors, local_runs(self.all_columns[src], lo, hi), got)
        assert scalars is not None  # every rank has a block
        violations = torch.tensor([int(scalars["bound_violations"])], dtype=torch.int64, device=rank_device())
        dist.all_reduce(violations)
        top = {name: self._candidates(stream) for name, stream in tops.items()}
        if self.rank != 0:
            return None, None
        scalars["bound_violations"] = np.int64(violations.item())
        return scalars, top

    def _own_block(
        self, state: Any, vectors: StepVectors, tops: dict[str, StreamingTopK], lo: int, hi: int
    ) -> dict[str, Any]:
        """This rank's statistics of its local columns [lo, hi) (returned): their values pushed into its top-k
        ``tops`` at their global columns, the gathered ones put into ``vectors`` on rank 0, sent there from the
        other ranks."""
        stats = self._block(state, lo, hi)
        runs = list(local_runs(self.columns, lo, hi))
        index = np.concatenate([np.zeros(0, np.int64), *(np.arange(a, b, dtype=np.int64) for a, b, _ in runs)])
        for name, src in METRICS.items():
            tops[name].push(np.abs(stats[src]), index)
        if self.rank == 0:
            self._put(vectors, runs, stats)
        else:
            for v in self.gathered:
                send_to0(np.asarray(stats[v], dtype=np.float64), self.chunk)
        return stats

    @staticmethod
    def _put(vectors: StepVectors, runs: Iterable[tuple[int, int, int]], stats: Mapping[str, Any]) -> None:
        """A block's statistics (each (b,)) into ``vectors`` at the global columns of its ``runs``
        (:func:`local_runs`)."""
        for start, stop, at in runs:
            vectors.put(start, {v: stats[v][at : at + stop - start] for v in vectors.names})

    def _candidates(self, stream: StreamingTopK) -> np.ndarray:
        """Every rank's top-k candidates into rank 0's ``stream``, ``chunk`` at a time (collective): the sorted
        global top-k on rank 0, this rank's own on the others."""
        device = rank_device()
        if self.rank != 0:
            index, values = stream.result()
            dist.send(torch.tensor([index.shape[0]], dtype=torch.int64, device=device), dst=0)
            for lo in range(0, index.shape[0], self.chunk):
                send_to0(values[lo : lo + self.chunk], self.chunk)
                send_to0(index[lo : lo + self.chunk], self.chunk)
            return index
        for src in range(1, self.ranks):
            n = torch.zeros(1, dtype=torch.int64, device=device)
            dist.recv(n, src=src)
            for lo in range(0, int(n.item()), self.chunk):
                size = min(self.chunk, int(n.item()) - lo)
                values = recv_from(src, size, np.float64, self.chunk)
                stream.push(values, recv_from(src, size, np.int64, self.chunk))
        return stream.result()[0]
