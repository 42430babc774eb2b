"""Trajectories with the model sharded over R ranks (torch.distributed FSDP2): the stepper, the change tracker's
shard and the step's changed set, each rank's weights, optimizer state and record equal to the single-process run's.

Every rank runs every row of a step, as the scores stage does (:mod:`covgrad.distributed.fsdp`): the model is
``fully_shard``-ed
per decoder layer, each forward and backward all-gathers the layer it runs, and only rank 0's loss reaches the
gradients (the other ranks backpropagate their loss times zero) through a reduce-scatter set to a plain sum, so the
gradient shard a rank holds is rank 0's unsharded gradient at its rows: the single-process gradient, bit for bit.
torch.optim then steps each rank's shard element by element (SGD, Adam and AdamW on DTensors). Precision regimes
(:mod:`covgrad.updates.trajectory`):

- ``fp32``, ``bf16``: the parameters, gradients and optimizer state in that dtype, sharded;
- ``fp32_master``: float32 sharded master weights under FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=float32)``: the all-gather casts the master to bf16 (round to nearest even, the single-process
  copy's cast), the gradient is reduced in float32 (the bf16 gradient's exact upcast), and the floating buffers
  (rotary frequencies) are cast to bf16 as the single-process bf16 copy casts them.

The change tracker of a rank keeps its shard's columns (:class:`covgrad.distributed.fsdp.RankColumns`: the dim-0 rows
of every
selected tensor that FSDP2 gives it): :func:`rank_shard` ranks the step-0 predictors over every rank's columns
(:func:`distributed_ranks`) and sums the tracker's counts with an all-reduce, so every rank's record is the
whole layout's; :func:`gather_changed` assembles the step's changed set on rank 0. The cost of exactness is
compute: every rank runs the whole batch (R-fold the arithmetic of one process, 1/R of its memory).

Shapes: P the layout's columns, P_r a rank's share.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from covgrad.distributed.fsdp import RankColumns, on_meta, shard_model, weights_from_rank0
from covgrad.layout import ParamLayout
from covgrad.updates.stepping import OptimizerSpec, StepLoss, Stepper, stored_dtype
from covgrad.updates.tracking import Ranker, TrackerShard


def _before(mine: tuple[np.ndarray, ...], peer: tuple[np.ndarray, ...]) -> np.ndarray:
    """(n,) int64: for each of ``mine``'s n (group, key, column) triples, how many of ``peer``'s come before it
    in lexicographic order (a triple equal to one of mine, as when ``peer`` is ``mine``, does not)."""
    n = mine[0].shape[0]
    group, key, column = (np.concatenate([a, b]) for a, b in zip(mine, peer, strict=True))
    order = np.lexsort((column, key, group))  # stable: of two equal triples, mine (first) comes first
    is_peer = order >= n
    before = np.cumsum(is_peer) - is_peer
    out = np.empty(n, dtype=np.int64)
    out[order[~is_peer]] = before[~is_peer]
    return out


def _sum(counts: np.ndarray, op: dist.ReduceOp = dist.ReduceOp.SUM) -> np.ndarray:
    """``counts`` (int64) reduced over the ranks with ``op`` (collective)."""
    t = torch.from_numpy(np.ascontiguousarray(counts, dtype=np.int64))
    dist.all_reduce(t, op=op)
    return t.numpy()


def distributed_ranks(index: np.ndarray) -> Ranker:
    """The :data:`covgrad.updates.tracking.Ranker` of a rank that holds the columns ``index`` (P_r,) of a layout whose
    columns the ranks share: the rank of each of its values among every rank's values of the same group, in
    :func:`covgrad.updates.tracking.group_ranks`'s order (largest or smallest first, NaN last, −0 tied with +0, ties
    by the lowest column), so it equals ``group_ranks`` of the whole layout at ``index``.

    Collective: each rank in turn broadcasts its (group, key, column) triples and every rank counts those below
    its own (:func:`_before`): R rounds of a P_r-element broadcast and an O(P_r log P_r) merge each; within
    groups, less the triples of lower groups (an all-reduce of the group sizes).
    """

    def ranks(values: np.ndarray, largest: bool, groups: np.ndarray | None) -> np.ndarray:
        v = np.asarray(values, dtype=np.float64).reshape(-1)
        key = np.where(np.isnan(v), np.inf, -v if largest else v)
        group = np.zeros(v.shape[0], dtype=np.int64) if groups is None else np.asarray(groups, dtype=np.int64)
        mine = (group, key, index.astype(np.int64))
        sizes = torch.zeros(dist.get_world_size(), dtype=torch.int64)
        sizes[dist.get_rank()] = v.shape[0]
        dist.all_reduce(sizes)
        out = np.zeros(v.shape[0], dtype=np.int64)
        for src, n in enumerate(sizes.tolist()):
            if src == dist.get_rank():
                parts = [torch.from_numpy(np.ascontiguousarray(a)) for a in mine]
            else:
                parts = [torch.empty(n, dtype=torch.int64), torch.empty(n, dtype=torch.float64)]
                parts.append(torch.empty(n, dtype=torch.int64))
            for t in parts:
                dist.broadcast(t, src=src)
            out += _before(mine, tuple(t.numpy() for t in parts))
        if groups is not None:
            top = int(_sum(np.asarray([group.max(initial=-1)]), dist.ReduceOp.MAX)[0])
            per = _sum(np.bincount(group, minlength=top + 1))
            out -= (np.cumsum(per) - per)[group]
        total = int(sizes.sum())
        return out.astype(np.int32) if total < 2**31 else out

    return ranks


def rank_columns(layout: ParamLayout) -> RankColumns:
    """This rank's columns of ``layout`` in the initialised process group."""
    return RankColumns.of(layout, dist.get_world_size(), dist.get_rank())


def rank_shard(layout: ParamLayout) -> TrackerShard:
    """The :class:`covgrad.updates.tracking.TrackerShard` of this rank: its FSDP2 shard's columns, counts summed with
    an
    all-reduce, ranks over every rank (:func:`distributed_ranks`)."""
    index = rank_columns(layout).index()
    return TrackerShard(index, _sum, distributed_ranks(index))


def gather_changed(packed: np.ndarray, layout: ParamLayout) -> np.ndarray | None:
    """The step's changed set of the whole layout, bit-packed (⌈P/8⌉,) uint8 (``np.packbits`` over the flat
    axis), on rank 0 (None on the others), from every rank's ``packed`` (⌈P_r/8⌉,) uint8 bits of its own columns
    (collective; rank 0 holds P bytes while it assembles them)."""
    R, rank = dist.get_world_size(), dist.get_rank()
    columns = [RankColumns.of(layout, R, r) for r in range(R)]
    width = max(-(-c.P // 8) for c in columns)
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[: packed.shape[0]] = torch.from_numpy(packed)
    parts = [torch.empty(width, dtype=torch.uint8) for _ in range(R)] if rank == 0 else None
    dist.gather(mine, parts, dst=0)
    if parts is None:
        return None
    bits = np.zeros(layout.P, dtype=bool)
    for part, cols in zip(parts, columns, strict=True):
        local = np.unpackbits(part.numpy(), count=cols.P).astype(bool)
        for a, b, at in zip(cols.starts, cols.stops, cols.local, strict=True):
            bits[a:b] = local[at : at + b - a]
    return np.packbits(bits)


def gather_changed_values(values: np.ndarray, packed: np.ndarray, layout: ParamLayout) -> np.ndarray | None:
    """The new values of the step's changed set over the whole layout, in flat index order, on rank 0 (None on
    the others), from every rank's ``values`` (n_r,) uint16/uint32 stored-dtype bits of its changed columns in
    its own order and ``packed`` (⌈P_r/8⌉,) its bit-packed changed set (collective)."""
    R, rank = dist.get_world_size(), dist.get_rank()
    counts = [torch.zeros(1, dtype=torch.int64) for _ in range(R)]
    dist.all_gather(counts, torch.tensor([values.shape[0]], dtype=torch.int64))
    width = max(int(c) for c in counts)
    mine = torch.zeros(width, dtype=torch.int64)
    mine[: values.shape[0]] = torch.from_numpy(values.astype(np.int64))
    parts = [torch.empty(width, dtype=torch.int64) for _ in range(R)] if rank == 0 else None
    dist.gather(mine, parts, dst=0)
    packed_parts = [torch.zeros(-(-layout.P // 8), dtype=torch.uint8) for _ in range(R)] if rank == 0 else None
    own = torch.zeros(-(-layout.P // 8), dtype=torch.uint8)
    own[: packed.shape[0]] = torch.from_numpy(packed)
    dist.gather(own, packed_parts, dst=0)
    if parts is None or packed_parts is None:
        return None
    index, bits = [], []
    for r, cols in enumerate(RankColumns.of(layout, R, q) for q in range(R)):
        local = np.flatnonzero(np.unpackbits(packed_parts[r].numpy(), count=cols.P))
        spans = np.asarray(cols.local, dtype=np.int64)
        span = np.searchsorted(spans, local, side="right") - 1
        index.append(np.asarray(cols.starts, dtype=np.int64)[span] + local - spans[span])
        bits.append(parts[r][: int(counts[r])].numpy())
    order = np.argsort(np.concatenate(index), kind="stable")
    return np.concatenate(bits)[order].astype(values.dtype)


def shard_frozen(model: nn.Module) -> nn.Module:
    """A fixed model (a teacher, a reference) sharded for forwards only, its weights rank 0's (collective; the
    other ranks may hold it on the meta device)."""
    full = model.state_dict() if dist.get_rank() == 0 else {}
    meta = on_meta(model)
    shard_model(model)
    weights_from_rank0(model, full, meta)
    return model.eval()


def _cast_buffers(model: nn.Module, dtype: torch.dtype) -> None:
    """Every floating buffer of ``model`` cast to ``dtype`` in place (as ``model.to(dtype)`` casts them)."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                module._buffers[name] = buffer.to(dtype)


def _to_local(value: object) -> object:
    """A copy of a DTensor's local shard, or of a tensor (Adam's ``step`` is stepped in place); other values as
    they are."""
    if hasattr(value, "to_local"):
        return value.to_local().clone()
    return value.clone() if isinstance(value, torch.Tensor) else value


class ShardedStepper(Stepper):
    """:class:`covgrad.updates.stepping.Stepper` over a model sharded across the process group's ranks (collective:
    every rank builds one and calls each method for the same step).

    ``model``: the start on every rank (already on the grid the caller wants); rank 0 must hold its weights, the
    others may hold it on the meta device (they get rank 0's). It is taken over and sharded; :attr:`model` is
    the sharded module, whose forward is the analysed model's (bf16 under ``fp32_master``). :meth:`flat` and
    :meth:`state_dict` are this rank's shard (columns :func:`rank_columns`).
    """

    def __init__(
        self, model: nn.Module, optimizer: OptimizerSpec, precision: str, loss: StepLoss | None = None
    ) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        if optimizer.max_grad_norm is not None:
            raise ValueError(
                "trajectory.max_grad_norm runs in one process; unset scores.ranks (or max_grad_norm) for this run"
            )
        self.spec, self.precision, self.step, self.minibatches = optimizer, precision, 0, 1
        self.loss = StepLoss() if loss is None else loss
        dtype = stored_dtype(precision)
        meta = on_meta(model)
        if precision == "bf16":
            model.to(torch.bfloat16)
        policy = None
        if precision == "fp32_master":
            _cast_buffers(model, torch.bfloat16)
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        full = model.state_dict() if dist.get_rank() == 0 else {}
        self._fsdp = shard_model(model, train=True, mp_policy=policy)
        weights_from_rank0(model, full, meta)
        del full
        self.master = self.model = model
        self.dtype = dtype
        self._params = [p for p in model.parameters() if p.requires_grad]
        self.opt = optimizer.build(self._params)

    def backward(self, batch: Mapping[str, torch.Tensor], keep_logp: bool = False) -> dict:
        """As :meth:`Stepper.backward`; only rank 0's loss reaches the gradients."""
        self._reshard()
        self.model.zero_grad(set_to_none=True)
        fwd = self.loss(self.model, batch)
        (fwd["loss"] * (1.0 if dist.get_rank() == 0 else 0.0)).backward()
        out: dict = {"loss": float(fwd["loss"].detach()), "bound_a": fwd["bound_a"]}
        if keep_logp:
            out.update(logp=fwd["logp"].detach(), keep=fwd["keep"])
        return out

    def clip(self) -> float:
        """No clipping on ranks (the gradient norm is left NaN); a spec with ``max_grad_norm`` is refused when the
        stepper is built."""
        return float("nan")

    def update(self) -> None:
        """One optimizer step of every rank's shard at ``spec.lr_at(step + 1)``; the next forward all-gathers the
        stepped shards."""
        self.step += 1
        for group in self.opt.param_groups:
            group["lr"] = self.spec.lr_at(self.step)
        self.opt.step()
        self._reshard()

    def _reshard(self) -> None:
        """Free every all-gathered layer. A forward without gradients (sampling, the KL) leaves the root module
        all-gathered: stale once the shards step, and without FSDP2's gradient hooks for a backward."""
        for module in self._fsdp:
            module.reshard()

    def flat(self, layout: ParamLayout, grad: bool = False) -> torch.Tensor:
        """This rank's shard of the analysed model's selected values (or their gradients, 0 where None), (P_r,)
        in the stored dtype, in the order of :func:`rank_columns`."""
        params = dict(self.model.named_parameters())
        parts = []
        for e in layout.entries:
            p = params[e.name]
            if not grad:
                t = p.to_local()
            else:
                t = torch.zeros_like(p.to_local()) if p.grad is None else p.grad.to_local()
            parts.append(t.detach().reshape(-1).to(self.dtype))
        return torch.cat(parts)

    def state_dict(self) -> dict:
        """This rank's shard: ``step``, ``weights`` {name: local tensor}, ``optimizer`` torch's state with every
        DTensor replaced by its local shard."""
        opt = self.opt.state_dict()
        state = {i: {k: _to_local(v) for k, v in s.items()} for i, s in opt["state"].items()}
        return {
            "step": self.step,
            "weights": {n: p.to_local().detach().clone() for n, p in self.master.named_parameters()},
            "optimizer": {"state": state, "param_groups": copy.deepcopy(opt["param_groups"])},
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore this rank's :meth:`state_dict` (the local shards put back into their DTensors)."""
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            for n, p in self.master.named_parameters():
                p.to_local().copy_(state["weights"][n])
        opt = copy.deepcopy(state["optimizer"])
        for i, s in opt["state"].items():
            p = self._params[int(i)]
            for k, v in s.items():
                if isinstance(v, torch.Tensor) and v.dim() and v.shape == p.to_local().shape:
                    s[k] = DTensor.from_local(v, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
        self.opt.load_state_dict(opt)
        self.step = int(state["step"])
