"""Scores with the model sharded over R ranks (torch.distributed FSDP2, ``fully_shard``), state sharded with it.

Each rank holds 1/R of every parameter: :func:`shard_model` applies ``fully_shard`` to every decoder layer
and then to the root (embeddings, final norm, LM head), so a layer's parameters are all-gathered just before
its forward and again before its backward, and freed after each. The per-sample rules of
:mod:`covgrad.scores.rules` run unchanged: during the backward they see the module's unsharded input and output
gradient (the layer is all-gathered), so every rank computes the full per-sample block of every selected
tensor, bit for bit the single-process block. Each rank then folds only the columns of its own FSDP shard
(rows [r·c, (r + 1)·c) of dim 0, c = ⌈d₀/R⌉: ``torch.chunk``'s split, the one FSDP2 uses) into its own
:class:`covgrad.moments.accum.MomentAccumulator` (:class:`ShardAccumulator`), so the moment state is 1/R per rank
too. The fold's arithmetic is column by column and its compiled switch depends on the whole selection's P
(``switch_P``), so the ranks' states placed side by side (:func:`merge_states`) are the single-process
state's bytes. :class:`RankCheckpoints` checkpoints each rank's state so that a rerun resumes every rank at the
same batch. The ranks themselves are started by :func:`covgrad.distributed.launch.launch_ranks`.

Shape notation: H halves (rows of the state), B samples, P selected parameter elements, P_r rank r's share.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from covgrad.distributed.launch import rank_device
from covgrad.layout import ParamLayout
from covgrad.moments.accum import MomentAccumulator
from covgrad.scores.engine import PerSampleGrads
from covgrad.scores.opgrads import Crossed


def shard_rows(rows: int, ranks: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s rows [lo, hi) of a dim 0 of ``rows`` split over ``ranks`` as ``torch.chunk`` (and FSDP2)
    split it: chunks of ⌈rows/ranks⌉, the last ones shorter or empty."""
    c = -(-rows // ranks)
    return min(rank * c, rows), min((rank + 1) * c, rows)


@dataclass(frozen=True)
class RankColumns:
    """The columns of a layout's flat axis that rank ``rank`` of ``ranks`` owns: per selected tensor, the
    elements of its dim-0 shard, one contiguous run each.

    Attributes:
        starts, stops: (runs,) global column bounds of the runs, ascending (empty shards have no run).
        local: (runs,) where each run starts on the rank's own axis (its accumulator's columns).
        P: the rank's column count P_r = Σ (stop − start).
    """

    rank: int
    ranks: int
    starts: tuple[int, ...]
    stops: tuple[int, ...]
    local: tuple[int, ...]
    P: int

    @classmethod
    def of(cls, layout: ParamLayout, ranks: int, rank: int) -> RankColumns:
        """The columns of rank ``rank`` of ``ranks`` under dim-0 sharding of every tensor of ``layout``."""
        if not 0 <= rank < ranks:
            raise ValueError(f"rank {rank} is not in [0, {ranks}); pass 0 <= rank < ranks")
        starts, stops, local, at = [], [], [], 0
        for e in layout.entries:
            rows = e.shape[0] if e.shape else 1
            row = e.numel // rows if rows else 0
            lo, hi = shard_rows(rows, ranks, rank)
            if hi > lo:
                starts.append(e.offset + lo * row)
                stops.append(e.offset + hi * row)
                local.append(at)
                at += (hi - lo) * row
        return cls(rank, ranks, tuple(starts), tuple(stops), tuple(local), at)

    def pieces(self, a: int, b: int) -> Iterator[tuple[int, int, int]]:
        """The parts of global columns [a, b) this rank owns: (start − a, stop − a, local start) per run."""
        i = max(0, bisect.bisect_right(self.starts, a) - 1)
        while i < len(self.starts) and self.starts[i] < b:
            lo, hi = max(a, self.starts[i]), min(b, self.stops[i])
            if hi > lo:
                yield lo - a, hi - a, self.local[i] + lo - self.starts[i]
            i += 1

    def index(self) -> np.ndarray:
        """(P_r,) int64: the global column of each of the rank's columns."""
        if not self.starts:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(a, b) for a, b in zip(self.starts, self.stops, strict=True)])


class ShardAccumulator:
    """A :class:`MomentAccumulator` over a layout's whole flat axis that keeps only one rank's columns.

    :meth:`PerSampleGrads.accumulate` folds every tensor's full block (B, n) at its global offset; this folds
    the parts inside the rank's runs into ``acc`` (P = ``columns.P``) at their local columns and drops the rest.
    A column's fold must see the same matrix products as in the unsharded fold, which runs one product per
    column tile of the block (``acc``'s tile width, from the block's first column): a BLAS product rounds
    the last columns of a call differently from the inner ones. So the rank's tiles that the tile grid keeps
    whole are folded in place, in one call from a tile boundary; a tile that a shard boundary cuts is folded
    whole into a scratch accumulator holding the rank's columns of it (the other columns' numbers are
    discarded), and the rank's columns are copied back.

    With ``aligned`` the engine forms row chunks on a grid that starts at each of the rank's shards
    (:meth:`row_spans`) instead of the unsharded grid, so every column of a chunked weight is formed by one
    rank only, and the rank's columns of any block are folded as they come (no whole tiles): the chunks'
    products and the fold's tiles are not the unsharded run's, so the merged state agrees with it to the
    rounding of the products (not byte for byte) and depends on R.

    Args:
        acc: the rank's accumulator, built with ``switch_P`` = the layout's P (the fold switches to its
            compiled kernel at the same batch as the single-process run).
        columns: the rank's columns.
        P: the layout's P (the global axis ``fold`` offsets refer to).
        aligned: row chunks on the rank's own grid (``scores.rank_chunks: aligned``).
    """

    def __init__(self, acc: MomentAccumulator, columns: RankColumns, P: int, aligned: bool = False) -> None:
        if acc.P != columns.P:
            raise ValueError(f"accumulator has P={acc.P}; rank {columns.rank}'s columns need P={columns.P}")
        self.acc, self.columns, self.P, self.aligned = acc, columns, P, aligned
        self.device, self.H = acc.device, acc.H
        self._batch: tuple[np.ndarray, np.ndarray] | None = None
        self._scratch: MomentAccumulator | None = None

    def begin_batch(self, advantages: Tensor | np.ndarray, half: Tensor | np.ndarray) -> None:
        """Start a batch (see :meth:`MomentAccumulator.begin_batch`)."""
        self.acc.begin_batch(advantages, half)
        self._batch = (np.asarray(torch.as_tensor(advantages).cpu()), np.asarray(torch.as_tensor(half).cpu()))

    def wants(self, offset: int, n: int) -> bool:
        """Whether the rank owns any of global columns [offset, offset + n) (else a block there need not be
        formed: :meth:`fold` would drop all of it)."""
        return next(self.columns.pieces(offset, offset + n), None) is not None

    def by_column(self) -> bool:
        """Whether the rank's folds compute every column on its own (:meth:`MomentAccumulator.by_column`)."""
        return self.acc.by_column()

    def row_spans(self, offset: int, first: int, end: int, row: int) -> list[tuple[int, int]] | None:
        """Rows [r0, r1) of a tensor's rows [first, end) (``row`` columns each, row ``first`` at global column
        ``offset``) that this rank owns, for the engine to form in row chunks starting at each r0; None
        unless ``aligned`` (the tensor's chunks then lie on the unsharded grid)."""
        if not self.aligned:
            return None
        return [
            (first + lo // row, first + hi // row)
            for lo, hi, _ in self.columns.pieces(offset, offset + (end - first) * row)
        ]

    def fold(self, offset: int, block: Tensor) -> None:
        """Fold the rank's columns of a block (B, n) that sits at global columns [offset, offset + n)."""
        B, n = block.shape[0], block[0].numel()
        block = block.reshape(B, n)
        if self.aligned:  # no byte identity to keep: the rank's columns are folded as they come
            for lo, hi, at in self.columns.pieces(offset, offset + n):
                self.acc.fold(at, block[:, lo:hi])
            return
        step = max(1, self.acc._fold_elements // B)  # the unsharded fold's column tiles: [j, j + step)
        for lo, hi, at in self.columns.pieces(offset, offset + n):
            a = -(-lo // step) * step  # the whole tiles of [lo, hi): [a, b)
            b = hi if hi == n else hi // step * step
            if a < b:
                self.acc.fold(at + a - lo, block[:, a:b])
            for c0, c1 in ((lo, a), (b, hi)) if a <= b else ((lo, hi),):  # the cut tiles' parts, one tile each
                if c1 > c0:
                    t0 = c0 // step * step
                    self._fold_cut(block[:, t0 : min(t0 + step, n)], c0 - t0, c1 - t0, at + c0 - lo)

    def _fold_cut(self, tile: Tensor, a: int, b: int, at: int) -> None:
        """Fold a whole tile (B, w) of which the rank owns columns [a, b), stored at its local column ``at``."""
        acc, w = self.acc, tile.shape[1]
        if self._scratch is None or w > self._scratch.P:
            self._scratch = MomentAccumulator(
                w, acc.device, acc.state_dtype, acc.H, switch_P=acc.switch_P, comoment=acc.comoment
            )
        tmp = self._scratch
        tmp._compile_from, tmp.fold_path = acc._compile_from, acc.fold_path
        for name in ("count", "mean_a", "m2_a"):
            getattr(tmp, name)[:] = getattr(acc, name)
        pairs = [
            (mine, theirs)
            for mine, theirs in ((tmp.mean, acc.mean), (tmp.m2, acc.m2), (tmp.c, acc.c), (tmp.mean_lo, acc.mean_lo))
            if mine is not None and theirs is not None
        ]
        for mine, theirs in pairs:
            mine[:, a:b] = theirs[:, at : at + b - a]
        tmp.begin_batch(*self._batch)
        try:
            tmp.fold(0, tile)
        finally:
            tmp.abort_batch()
        for mine, theirs in pairs:
            theirs[:, at : at + b - a] = mine[:, a:b]
        acc._compile_from, acc.fold_path = tmp._compile_from, tmp.fold_path

    def end_batch(self) -> None:
        """Commit the batch (see :meth:`MomentAccumulator.end_batch`)."""
        self.acc.end_batch()
        self._batch = None

    def abort_batch(self) -> None:
        """Forget a failed batch (see :meth:`MomentAccumulator.abort_batch`)."""
        self.acc.abort_batch()
        self._batch = None

    def rows(self, cols: slice = slice(None)) -> dict[str, np.ndarray]:
        """The rank's state (its local columns ``cols``), as :meth:`MomentAccumulator.rows`."""
        return self.acc.rows(cols)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The modules that ``fully_shard`` wraps one by one: those of a class in the Hugging Face model's
    ``_no_split_modules`` (its decoder layers), else the children of its longest ``nn.ModuleList``.

    Raises:
        ValueError: naming the model's class when it has neither.
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names]
    if found:
        return found
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise ValueError(
            f"{type(model).__name__} has no _no_split_modules and no ModuleList of layers to shard one by one; "
            "pass its decoder layers to shard_model(layers=...)"
        )
    return list(max(lists, key=len))


def shard_model(
    model: nn.Module,
    mesh: Any = None,
    layers: list[nn.Module] | None = None,
    train: bool = False,
    mp_policy: Any = None,
) -> list[nn.Module]:
    """``fully_shard`` every decoder layer of ``model`` and then the model itself (in place) over ``mesh``
    (default: the world of the initialised process group, on :func:`rank_device`'s type), with FSDP2's mixed
    precision ``mp_policy`` (None: the parameters' own dtype); the parameters become dim-0 sharded DTensors.
    Returns the FSDP modules, the root last.

    Without ``train`` the parameters are frozen first: the per-sample pass needs no batched weight gradient,
    and FSDP2's unsharded parameters take their ``requires_grad`` from the sharded ones. With ``train`` they
    keep it and the gradients are reduce-scattered as a plain sum (no division by the world size).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if mesh is None:
        if not dist.is_initialized():
            raise ValueError("shard_model needs an initialised process group; call dist.init_process_group first")
        mesh = init_device_mesh(rank_device().type, (dist.get_world_size(),))
    if not train:
        for p in model.parameters():
            p.requires_grad_(False)
    policy = MixedPrecisionPolicy() if mp_policy is None else mp_policy
    wrapped = []
    for layer in layers if layers is not None else decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
        wrapped.append(layer)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    wrapped.append(model)
    if train:
        for m in wrapped:
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    return wrapped


def weights_from_rank0(model: nn.Module, full: dict[str, Tensor], meta: bool) -> None:
    """Give every rank of a model that :func:`shard_model` sharded its shard of rank 0's weights ``full`` (rank
    0's state dict taken before sharding; ``{}`` on the other ranks) and rank 0's buffers (collective). ``meta``:
    this rank built the model on the meta device (its storage is allocated here)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if meta:
        model.to_empty(device=rank_device())
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    set_model_state_dict(model, full, options=options)
    for buffer in model.buffers():
        dist.broadcast(buffer, src=0)


def loads_weights() -> bool:
    """Whether this process loads a model's weights itself: not a rank other than 0 of an initialised process
    group, which builds the model on the meta device and takes its shard from rank 0 (:func:`shard_from_rank0`)."""
    return not (dist.is_initialized() and dist.get_rank() > 0)


def on_meta(model: nn.Module) -> bool:
    """Whether ``model`` holds tensors on the meta device (built without weights, :func:`shard_from_rank0`)."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


@dataclass(frozen=True)
class RankTrace:
    """The first call's trace of a model (:meth:`PerSampleGrads._trace`: where each selected parameter is
    used, and which flattened modules keep samples apart), by module name, so that it crosses processes:
    rank 0 traces its model and every rank binds the result to its own copy (the same module tree).

    Attributes:
        bindings: (module name, rule, local name → layout entry) of every hooked module, trace order.
        flat_ok: names of the modules verified to run on a flattened (B·L, …) batch sample by sample.
        outer: of those, the ones with outer-major rows.
        crossed: the modules whose batch is another dimension of their arguments, by name (their op-level taps
            probe every use's rows: :class:`covgrad.scores.opgrads.Crossed`).
    """

    bindings: list[tuple[str, Any, dict[str, Any]]]
    flat_ok: frozenset[str]
    outer: frozenset[str]
    crossed: dict[str, Crossed]

    @classmethod
    def of(cls, psg: PerSampleGrads) -> RankTrace:
        """The trace of ``psg`` after its first call on a batch of at least 2 rows.

        Raises:
            ValueError: when the trace did not verify the flattened modules (a batch of one row).
        """
        if not psg._verified:
            raise ValueError("the trace before sharding needs a batch of at least 2 rows; pass one as example")
        names = {id(m): n for n, m in psg.model.named_modules()}
        return cls(
            [(names[id(m)], rule, local) for m, rule, local in psg.bindings()],
            frozenset(names[i] for i in psg._flat_ok),
            frozenset(names[i] for i in psg._outer),
            {names[i]: c for i, c in psg._crossed.items()},
        )

    def bind(self, model: nn.Module) -> tuple[list[Any], set[int], set[int], dict[int, Crossed]]:
        """The bindings, verified, outer-major and crossed module ids of :class:`PerSampleGrads` on ``model``."""
        modules = dict(model.named_modules())
        return (
            [(modules[name], rule, local) for name, rule, local in self.bindings],
            {id(modules[n]) for n in self.flat_ok},
            {id(modules[n]) for n in self.outer},
            {id(modules[n]): c for n, c in self.crossed.items()},
        )


def trace_on_rank0(model: nn.Module, layout: ParamLayout, example: dict[str, Tensor | None]) -> RankTrace:
    """:func:`trace_unsharded` on rank 0 (which holds the weights), broadcast to every rank (collective).

    Raises:
        ValueError: on every rank, with rank 0's message, when the trace refuses the model.
    """
    box: list[RankTrace | str | None] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = RankTrace.of(trace_unsharded(model, layout, example))
        except ValueError as exc:
            box[0] = str(exc)
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], str):
        raise ValueError(box[0])
    assert isinstance(box[0], RankTrace)
    return box[0]


def shard_from_rank0(
    model: nn.Module, layout: ParamLayout, example: dict[str, Tensor | None], mesh: Any = None
) -> tuple[RankTrace, list[nn.Module]]:
    """Trace ``model`` on rank 0 (:func:`trace_on_rank0`), shard it (:func:`shard_model`) and give every rank
    its shard of rank 0's weights and rank 0's buffers (collective).

    Only rank 0 needs the weights: another rank may hold the model on the meta device (``storage.models``'s
    ``load_model(meta=True)``), so a machine holds one copy of the unsharded model, not one per rank. Rank 0's
    model may sit in host memory (``storage.models.load_rank_policy``): it is traced there, and FSDP2's
    ``fully_shard`` moves each module's parameters to the mesh's device as it shards them, so the device holds
    one module whole at most. The shards go out one tensor at a time (``set_model_state_dict`` with
    ``broadcast_from_rank0``, from rank 0's host copy), the buffers (rotary frequencies and other
    non-persistent ones included) by broadcast.

    Raises:
        ValueError: when rank 0's model is on the meta device, or the trace refuses the model.
    """
    rank, meta = dist.get_rank(), on_meta(model)
    if rank == 0 and meta:
        raise ValueError("rank 0 holds the model on the meta device; load its weights there (the others may not)")
    trace = trace_on_rank0(model, layout, example)
    full = model.state_dict() if rank == 0 else {}
    modules = shard_model(model, mesh)
    weights_from_rank0(model, full, meta)
    return trace, modules


class ShardedPerSampleGrads(PerSampleGrads):
    """:class:`PerSampleGrads` of a model sharded by :func:`shard_model`, with the first call's trace taken
    on the model before sharding (:meth:`PerSampleGrads._trace` backpropagates from modules inside the
    layers, which FSDP2 does not all-gather for: its pre-backward hooks sit on the layers' outputs).

    Args:
        trace: the model's trace before sharding (:func:`shard_from_rank0`): its bindings, moves and verified
            flattened modules are taken over.
        modules: the FSDP modules :func:`shard_model` returned. They are all-gathered one at a time to
            collect FSDP2's unsharded parameters (the tensors the forwards use; FSDP2 keeps the objects and
            frees only their storage), which the self-check's reference gradient is taken with respect to; []
            for a model that is not sharded (every rank holds it whole: its parameters are those tensors).
    """

    def __init__(
        self,
        model: nn.Module,
        layout: ParamLayout,
        trace: RankTrace,
        modules: list[nn.Module],
        check: bool = True,
        chunk_bytes: int | None = None,
    ) -> None:
        super().__init__(model, layout, check=check, chunk_bytes=chunk_bytes)
        self._bindings, self._flat_ok, self._outer, self._crossed = trace.bind(model)
        self._traced, self._verified = True, True
        unsharded: dict[str, Tensor] = {} if modules else dict(model.named_parameters())
        for m in modules:
            m.unshard()
            try:
                unsharded.update((n, p) for n, p in model.named_parameters() if not hasattr(p, "to_local"))
            finally:
                m.reshard()
        self._params = [unsharded[e.name] for e in layout.entries]

    def _reference(self, inputs: dict[str, Tensor | None], dlogits_fn: Callable[[Tensor], Tensor]) -> Any:
        """The self-check's batched gradient, with the parameters thawed for its one backward (FSDP2 gives the
        unsharded parameters the sharded ones' ``requires_grad`` when it all-gathers them)."""
        params = [*self.model.parameters(), *self._params]
        for p in params:
            p.requires_grad_(True)
        try:
            return super()._reference(inputs, dlogits_fn)
        finally:
            for p in params:
                p.requires_grad_(False)


def trace_unsharded(model: nn.Module, layout: ParamLayout, example: dict[str, Tensor | None]) -> PerSampleGrads:
    """The first call's trace (:meth:`PerSampleGrads._trace`) of ``model`` before sharding, on ``example``
    (``input_ids``, ``attention_mask``, ``position_ids`` of a batch of at least 2 rows, moved to the model's
    device; the trace keeps its first 2 rows and last 16 positions), with the parameters frozen as in the
    per-sample pass."""
    psg = PerSampleGrads(model, layout, check=False)
    at = next(model.parameters()).device  # rank 0's unsharded model may sit in host memory, the batch on its device
    example = {k: v.to(at) if isinstance(v, Tensor) else v for k, v in example.items()}
    inputs = psg._checked_inputs(example["input_ids"], example["attention_mask"], example.get("position_ids"))
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        psg._trace(inputs)
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
    return psg


@dataclass
class RankScores:
    """One rank's share of a sharded scores run: the sharded model's per-sample gradients (``psg``), the
    rank's accumulator (``acc``, P_r columns) and the layout-wide view of it that ``psg`` folds into
    (``shard``, pass it as the accumulator of :func:`covgrad.scores.fold.fold_batches`)."""

    psg: ShardedPerSampleGrads
    acc: MomentAccumulator
    shard: ShardAccumulator
    columns: RankColumns


def rank_scores(
    model: nn.Module,
    layout: ParamLayout,
    example: dict[str, Tensor | None],
    state_dtype: str = "float64",
    *,
    check: bool = True,
    chunk_bytes: int | None = None,
    compiled: bool | None = None,
    switch_P: int | None = None,
    mesh: Any = None,
    aligned: bool = False,
) -> RankScores:
    """Trace ``model`` on the batch ``example``, shard it over the process group with rank 0's weights
    (:func:`shard_from_rank0`: the other ranks may hold it on the meta device) and set up this rank's fold of
    ``layout`` (built from the unsharded model: the names and global shapes; a parameter block of a selection
    passes the selection's P as ``switch_P``, as :class:`MomentAccumulator` takes it) in ``state_dtype``;
    ``aligned``: row chunks on the rank's own grid (:class:`ShardAccumulator`).

    Raises:
        ValueError: when the model's shards are not the dim-0 chunks :class:`RankColumns` expects (a
            sharding other than FSDP2's default).
    """
    rank, ranks = dist.get_rank(), dist.get_world_size()
    trace, modules = shard_from_rank0(model, layout, example, mesh)
    columns = RankColumns.of(layout, ranks, rank)
    params = dict(model.named_parameters())
    for e in layout.entries:
        local = params[e.name].to_local() if hasattr(params[e.name], "to_local") else params[e.name]
        rows = e.shape[0] if e.shape else 1
        lo, hi = shard_rows(rows, ranks, rank)
        if local.numel() != (hi - lo) * (e.numel // max(rows, 1)):
            raise ValueError(
                f"rank {rank}'s shard of {e.name!r} has {local.numel()} elements, not rows [{lo}, {hi}) of "
                f"{tuple(e.shape)}; shard_model must shard dim 0 with torch.chunk's split"
            )
    device = next(model.parameters()).device
    acc = MomentAccumulator(columns.P, device, state_dtype, compiled=compiled, switch_P=switch_P or layout.P)
    psg = ShardedPerSampleGrads(model, layout, trace, modules, check=check, chunk_bytes=chunk_bytes)
    return RankScores(psg, acc, ShardAccumulator(acc, columns, layout.P, aligned), columns)


def merge_states(parts: list[dict[str, np.ndarray]], columns: list[RankColumns], P: int) -> dict[str, np.ndarray]:
    """The layout-wide state from every rank's :meth:`MomentAccumulator.rows` (``parts``, rank order) and
    their ``columns``: each rank's columns copied into place, the scalars (H,) from rank 0 (every rank
    folds the same samples).

    Raises:
        ValueError: when the ranks' columns do not tile [0, P) or their scalars differ.
    """
    owned = np.zeros(P, dtype=np.int64)
    for cols in columns:
        owned[cols.index()] += 1
    if P and (owned.min() != 1 or owned.max() != 1):
        raise ValueError(f"the ranks' columns cover {int((owned > 0).sum())} of P={P} columns, some more than once")
    first = parts[0]
    out: dict[str, np.ndarray] = {}
    for name, value in first.items():
        if value.ndim == 1:
            for r, part in enumerate(parts[1:], 1):
                if not np.array_equal(part[name], value):
                    raise ValueError(f"rank {r}'s {name} differs from rank 0's; the ranks folded different samples")
            out[name] = value.copy()
            continue
        merged = np.empty((value.shape[0], P), dtype=value.dtype)
        for part, cols in zip(parts, columns, strict=True):
            for a, b, at in zip(cols.starts, cols.stops, cols.local, strict=True):
                merged[:, a:b] = part[name][:, at : at + b - a]
        out[name] = merged
    return out


class RankCheckpoints:
    """Checkpoints of this rank's state under ``root/rank{r}/``: ``n{c}.npz`` holds the state of the first c
    batches, written under a temporary name and renamed (so a file is complete or absent), and ``final.npz``
    the state after the last batch. The ranks fold every batch together (FSDP2's all-gathers are
    collective), so they checkpoint at the same batch counts and resume from the same one: an older
    checkpoint is deleted only once every rank has written the newer one (a barrier), and
    :meth:`restore` loads the newest count every rank holds.

    Args:
        root: the run's checkpoint folder (shared by the ranks).
        acc: this rank's accumulator.
    """

    def __init__(self, root: str | os.PathLike, acc: MomentAccumulator) -> None:
        self.dir = os.path.join(os.fspath(root), f"rank{dist.get_rank()}")
        os.makedirs(self.dir, exist_ok=True)
        self.acc = acc

    def _counts(self) -> list[int]:
        return sorted(int(n[1:-4]) for n in os.listdir(self.dir) if n.startswith("n") and n.endswith(".npz"))

    def restore(self) -> int:
        """Load the newest checkpoint that every rank holds into the accumulator; return its batch count
        (0, and nothing loaded, when some rank has none)."""
        mine = self._counts()
        newest = torch.tensor([mine[-1] if mine else 0], device=self.acc.device)  # nccl reduces on the device
        dist.all_reduce(newest, op=dist.ReduceOp.MIN)
        common = int(newest)
        if common > 0:
            with np.load(os.path.join(self.dir, f"n{common}.npz")) as f:
                self.acc.load({k: f[k] for k in f.files})
        return common

    def save(self, folded: int, final: bool) -> None:
        """Write the state of ``folded`` batches (also as ``final.npz`` when ``final``); then, once every rank
        has written it, delete this rank's older checkpoints."""
        name = os.path.join(self.dir, f"n{folded}.npz")
        tmp = name + ".tmp.npz"
        np.savez(tmp, **self.acc.rows())
        os.replace(tmp, name)
        if final:
            os.replace(name, os.path.join(self.dir, "final.npz"))
        dist.barrier()
        for c in self._counts():
            if c < folded or final:
                os.remove(os.path.join(self.dir, f"n{c}.npz"))

    def final(self) -> dict[str, np.ndarray] | None:
        """This rank's final state, or None before the last batch is checkpointed."""
        path = os.path.join(self.dir, "final.npz")
        if not os.path.exists(path):
            return None
        with np.load(path) as f:
            return {k: f[k] for k in f.files}
