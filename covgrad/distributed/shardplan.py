"""Shard planning: how the scores stage splits into (sample shard × parameter block) jobs, what each job
needs in device memory, and what the store will hold, computed before anything runs.

The memory model is the README's ("Memory and state dtype"), per worker running one job of block k:

    weights      P_model × dtype bytes (every worker holds the whole frozen model: the forward needs it)
    activations  layers × B·L·((8·H + 4·I)·dtype + heads·L·(dtype + 4))  (saved for one backward:
                 norms, q/k/v/o and MLP inputs and outputs, the eager attention probabilities)
    logits       B·L·V·(dtype + 8)  (logits, their float32 gradient and softmax)
    in flight    B·4·numel of the block's largest tensor (of a row-cut tensor: its rows, or the whole tensor
                 where its rule writes whole tensors), where a weight folded in row chunks (a Linear/Conv1D
                 weight or an embedding with one module, a tied embedding whose LM head is a Linear:
                 ``covgrad.scores.binding.folds_in_row_chunks``) counts one row chunk
                 (``covgrad.scores.blocks.default_chunk_bytes``, at least one row) instead of its whole block (any
                 other tied embedding's block: B·4·(embedding + the largest other tensor), an upper bound)
    workspace    min(2^26 on cuda or 2^17 on cpu, B·largest) × (1 + 3·2/B) × state element bytes
    state        (48 float64 | 32 float32) × P_k   (2 halves × mean, M2, co-moment [, mean low part])
    rows         B·P_k·4 when per-sample rows are kept (one block only)
    self-check   first batch only (``model.self_check``): the batched reference gradient of every tensor the
                 block touches, whole (dtype bytes each; a tied embedding twice: autograd sums its two
                 contributions), the largest tensor's (numel,) float64 sum of per-sample gradients and the
                 comparison's float64 column temporaries, and the trace (two samples × 16 positions of logits)

A job fits a device when the total is at most ``HEADROOM`` of its memory (the rest: CUDA context,
allocator fragmentation). Store bytes: the final state of every sample shard, (48 | 32)·P each, plus one
checkpoint per running job at the peak, plus N·P·4 per-sample rows when kept.

Shape notation: B samples per batch, L tokens per sample, V vocabulary, H hidden size, I intermediate
size, P selected parameter elements, P_k those of block k, N samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from torch import nn

from covgrad.layout import ParamLayout, split_blocks
from covgrad.moments.accum import FOLD_ELEMENTS, state_bytes_per_param
from covgrad.scores.binding import folds_in_row_chunks, writes_row_parts
from covgrad.scores.blocks import default_chunk_bytes

HEADROOM = 0.9

# The most row-cut blocks "auto" tries.
_MAX_AUTO_CUT = 256


def keeps_rows(N: int, P: int, byte_budget: int, blocks: int, equal_batches: bool) -> bool:
    """Whether the scores store keeps the per-sample rows (N, P) float32: with one parameter block, when
    their N·P·4 bytes fit ``byte_budget`` and every batch but the last has the same size (the rows are
    chunked one batch per chunk)."""
    return blocks == 1 and equal_batches and byte_budget >= N * P * 4


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs of the model beyond the selected layout."""

    n_params: int  # every parameter element of the model (weights held by each worker)
    dtype_bytes: int  # 2 (bf16) or 4 (fp32)
    hidden: int
    intermediate: int
    layers: int
    heads: int
    vocab: int
    tied_embedding: str | None  # the layout name of a tied input embedding / LM head, else None
    chunked: frozenset[str]  # weights whose per-sample blocks are written and folded in row chunks
    row_parts: frozenset[str] = frozenset()  # tensors whose rules write only a row-cut block's rows

    @classmethod
    def of(cls, model: nn.Module) -> ModelShape:
        """Read the shape of a Hugging Face causal LM (weights may live on the meta device): a multimodal model's
        sizes are its text model's (``get_text_config()``); a model without attention (state-space) has 0 heads."""
        c = model.config.get_text_config()
        params = list(model.parameters())
        emb = model.get_input_embeddings().weight
        out = model.get_output_embeddings()
        tied = out is not None and out.weight is emb
        name = next((n for n, p in model.named_parameters() if p is emb), None) if tied else None
        owners: dict[int, list[nn.Module]] = {}  # modules owning each parameter (two for a tied one)
        for m in model.modules():
            for p in m.parameters(recurse=False):
                owners.setdefault(id(p), []).append(m)
        chunked = frozenset(
            n for n, p in model.named_parameters() if n.endswith("weight") and folds_in_row_chunks(owners[id(p)])
        )
        row_parts = frozenset(
            n
            for n, p in model.named_parameters()
            if n.endswith("weight") and all(writes_row_parts(m) for m in owners[id(p)])
        )
        return cls(
            n_params=sum(p.numel() for p in params),
            dtype_bytes=params[0].element_size(),
            hidden=c.hidden_size,
            intermediate=getattr(c, "intermediate_size", 4 * c.hidden_size),
            layers=c.num_hidden_layers,
            heads=getattr(c, "num_attention_heads", 0),
            vocab=c.vocab_size,
            tied_embedding=name,
            chunked=chunked,
            row_parts=row_parts,
        )


@dataclass(frozen=True)
class Workload:
    """The run's sizes: B samples per batch, L tokens per sample, N samples in ``n_batches`` batches."""

    B: int
    L: int
    N: int
    n_batches: int
    state_dtype: str  # "float64" | "float32"
    device: str  # "cuda" | "cpu"
    byte_budget: int  # scores.byte_budget: the most bytes of per-sample rows (N, P) float32 to keep
    equal_batches: bool  # every batch but the last holds B samples
    self_check: bool = True  # model.self_check: the first batch also holds the reference gradient


@dataclass(frozen=True)
class BlockNeed:
    """Device bytes of one job of a parameter block, by item of the memory model."""

    tensors: int
    P: int
    fixed: int  # weights + activations + logits: the same for every block
    in_flight: int
    workspace: int
    state: int
    rows: int
    check: int = 0  # the first batch's self-check and trace, on top of the rest

    @property
    def total(self) -> int:
        return self.fixed + self.in_flight + self.workspace + self.state + self.rows + self.check


@dataclass(frozen=True)
class ShardPlan:
    """``samples`` × ``blocks`` jobs on ``workers`` workers of ``device_bytes`` each."""

    samples: int
    blocks: int
    needs: tuple[BlockNeed, ...]  # (blocks,)
    workers: int
    device_bytes: int
    store_bytes: int  # the finished store
    peak_store_bytes: int  # while jobs run: plus two checkpoints per running job

    @property
    def need(self) -> int:
        """The most device bytes any job needs."""
        return max(n.total for n in self.needs)

    @property
    def fits(self) -> bool:
        return self.need <= HEADROOM * self.device_bytes

    def lines(self) -> list[str]:
        """The plan as printable lines (sizes in GB = 1e9 bytes)."""
        jobs = self.samples * self.blocks
        big = max(self.needs, key=lambda n: n.total)
        out = [
            f"shards: {self.samples} sample shards x {self.blocks} parameter blocks = {jobs} jobs "
            f"on {self.workers} workers (rounds: {-(-jobs // self.workers)})",
            f"per-worker device memory: {gb(self.need)} GB needed of {gb(self.device_bytes)} GB "
            f"({'fits' if self.fits else 'does NOT fit'}, {HEADROOM:.0%} usable)",
            f"  largest job: weights+activations+logits {gb(big.fixed)}, block in flight {gb(big.in_flight)}, "
            f"fold workspace {gb(big.workspace)}, state {gb(big.state)}, per-sample rows {gb(big.rows)}, "
            f"first batch's self-check and trace {gb(big.check)} GB",
            "  block  tensors  parameters  state GB  total GB",
        ]
        for k, n in enumerate(self.needs):
            out.append(f"  {k:5d}  {n.tensors:7d}  {n.P:10.4g}  {gb(n.state):>8}  {gb(n.total):>8}")
        out.append(
            f"store: {gb(self.store_bytes)} GB when complete, {gb(self.peak_store_bytes)} GB at most while running"
        )
        return out


def gb(n: float) -> str:
    return f"{n / 1e9:.1f}"


def block_needs(
    layout: ParamLayout, shape: ModelShape, work: Workload, n_blocks: int, cut: bool = False
) -> tuple[BlockNeed, ...]:
    """Device bytes of a job of each of the ``n_blocks`` blocks of :func:`covgrad.layout.split_blocks`
    (``cut``: blocks that cut tensors at rows)."""
    B, L, d = work.B, work.L, shape.dtype_bytes
    act = shape.layers * B * L * ((8 * shape.hidden + 4 * shape.intermediate) * d + shape.heads * L * (d + 4))
    fixed = shape.n_params * d + act + B * L * shape.vocab * (d + 8)
    elem = 8 if work.state_dtype == "float64" else 4
    needs = []
    chunk = default_chunk_bytes(work.device) // (4 * B)  # elements of a sample's chunk
    for block in split_blocks(layout, n_blocks, cut=cut):
        sizes = sorted((e.numel for e in block.entries), reverse=True)
        made = [  # elements per sample of each tensor's block at once (a part: its rows, or the whole tensor)
            min(e.numel, max(chunk, e.row_size))
            if e.name in shape.chunked
            else e.numel
            if not e.is_part or e.name in shape.row_parts
            else e.numel // e.shape[0] * e.full_shape[0]
            for e in block.entries
        ]
        in_flight = max(made)
        if shape.tied_embedding in block.names and shape.tied_embedding not in shape.chunked:
            tied = block.entry(shape.tied_embedding).numel
            in_flight = tied + max((s for s in made if s != tied), default=0)
        columns = min(FOLD_ELEMENTS[work.device], B * sizes[0])
        rows = B * block.P * 4 if keeps_rows(work.N, layout.P, work.byte_budget, n_blocks, work.equal_batches) else 0
        check = 0
        if work.self_check:
            whole = [math.prod(e.full_shape) for e in block.entries]
            tied = block.entry(shape.tied_embedding).numel if shape.tied_embedding in block.names else 0
            full_tied = whole[block.names.index(shape.tied_embedding)] if tied else 0
            check = (sum(whole) + full_tied) * d + sizes[0] * 8 + 2 * 8 * min(sizes[0], 1 << 22)
            check += 2 * min(L, 16) * shape.vocab * (d + 8)
        needs.append(
            BlockNeed(
                tensors=len(block.entries),
                P=block.P,
                fixed=fixed,
                in_flight=B * 4 * in_flight,
                workspace=int(columns * (1 + 6 / B) * elem),
                state=state_bytes_per_param(work.state_dtype) * block.P,
                rows=rows,
                check=check,
            )
        )
    return tuple(needs)


def make_plan(
    layout: ParamLayout,
    shape: ModelShape,
    work: Workload,
    shards: tuple[int, int | str],
    workers: int,
    device_bytes: int,
    cut: bool = False,
) -> ShardPlan:
    """The plan for ``shards`` = (sample shards, parameter blocks); blocks ``"auto"``: the fewest whose
    jobs fit a device. ``cut`` (``scores.cut_tensors``): blocks cut tensors at rows, balanced by parameter
    count, so "auto" may spread one tensor over several blocks.

    Raises ValueError naming the values when ``"auto"`` finds no fitting split (one tensor, or with ``cut``
    the fixed part of a job, too large).
    """
    if workers < 1 or device_bytes <= 0:
        raise ValueError(f"workers ({workers}) and device memory ({device_bytes} bytes) must be positive")
    samples, blocks = shards
    if blocks != "auto":
        needs = block_needs(layout, shape, work, blocks, cut)
        return _plan(layout, work, samples, blocks, needs, workers, device_bytes)
    most = min(_MAX_AUTO_CUT, layout.P) if cut else len(layout.entries)
    for k in range(1, most + 1):
        needs = block_needs(layout, shape, work, k, cut)
        if max(n.total for n in needs) <= HEADROOM * device_bytes:
            return _plan(layout, work, samples, k, needs, workers, device_bytes)
        if cut and min(n.total - n.state - n.in_flight - n.workspace for n in needs) > HEADROOM * device_bytes:
            break  # what every job holds whatever its block (weights, activations, logits) does not fit
    need = max(n.total for n in needs)
    smaller = "scores.state_dtype=float32, " if work.state_dtype == "float64" else ""
    what = f"{k} row-cut blocks" if cut else "one tensor per block"
    hint = "" if cut else "scores.cut_tensors=true, "
    raise ValueError(
        f"scores.shards=[{samples}, auto]: even {what} needs {gb(need)} GB per worker, more than "
        f"{HEADROOM:.0%} of {gb(device_bytes)} GB; use {hint}{smaller}fewer parameters (model.params) or a smaller "
        "batch (scores.groups_per_batch)"
    )


def _plan(
    layout: ParamLayout,
    work: Workload,
    samples: int,
    blocks: int,
    needs: tuple[BlockNeed, ...],
    workers: int,
    device_bytes: int,
) -> ShardPlan:
    state = state_bytes_per_param(work.state_dtype) * layout.P
    rows = work.N * layout.P * 4 if keeps_rows(work.N, layout.P, work.byte_budget, blocks, work.equal_batches) else 0
    # checkpoints held at once: per running job its newest one and the one being written
    ckpt = 2 * min(workers, samples * blocks) * max(n.state for n in needs)
    return ShardPlan(
        samples=samples,
        blocks=blocks,
        needs=needs,
        workers=workers,
        device_bytes=device_bytes,
        store_bytes=samples * state + rows,
        peak_store_bytes=samples * state + rows + ckpt,
    )


def resolve_shards(job: Any, workers: int, device_bytes: int) -> tuple[int, int]:
    """The (sample shards, parameter blocks) of a scores job (``tasks.scores.ScoresJob``: its spec, model,
    layout, rollouts and batches) with its blocks resolved (``"auto"``: the fewest whose job fits one device of
    ``device_bytes``, like the job's) on ``workers`` such devices."""
    spec = job.spec
    work = Workload(
        B=job.B,
        L=int(job.ro["tokens"].shape[1]),
        N=job.N,
        n_batches=len(job.batches),
        state_dtype=spec.state_dtype,
        device=job.device.type,
        byte_budget=spec.byte_budget,
        equal_batches=job.equal,
        self_check=spec.self_check,
    )
    shards = (spec.sample_shards, spec.blocks)
    model = ModelShape.of(job.model)
    chosen = make_plan(job.layout, model, work, shards, workers, device_bytes, cut=spec.cut_tensors)
    return chosen.samples, chosen.blocks
