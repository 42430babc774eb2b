"""The memory plan of a scores run with the model sharded over R ranks (:mod:`covgrad.distributed.fsdp`), before
anything runs.

Per rank, for one parameter block of the selection (K blocks run one after another, each a pass over the
data; K = 1 unless the state does not fit otherwise), in bytes (docs/fsdp.md):

    weights      Σ over every parameter of rank 0's dim-0 shard (⌈d₀/R⌉ rows) × dtype bytes  (≈ P_model·d/R)
    gathered     the unsharded parameters FSDP2 holds at once: the root's (embeddings, LM head, final norm:
                 kept through forward and backward) + 2 decoder layers (the one running and the one prefetched)
    activations  layers × B·L × ((8·H + 4·I)·d + attention), attention = heads·L·(d + 4) (eager: the
                 probabilities) or heads·4 (sdpa: the log-sum-exp); every rank runs the whole batch
    logits       B·L·V·(d + 8)  (logits, their float32 gradient and softmax)
    in flight    B·4·numel of the block's largest per-sample tensor block, whole on every rank (the rules
                 see unsharded activations), a row chunk for a projection, the LM head and the embedding
                 (tied or not; as :mod:`covgrad.distributed.shardplan`)
    workspace    the fold's tile buffers (as :mod:`covgrad.distributed.shardplan`) + one cut tile's scratch state
    state        (48 float64 | 32 float32) × rank 0's columns of the block (its FSDP shard of every tensor)

A rank fits when the total is at most ``HEADROOM`` of its device. Store: the final state (48 | 32)·P once,
plus at the peak two checkpoints of every rank's state (its newest and the one being written).

Shape notation: B samples per batch, L tokens per sample, V vocabulary, H hidden size, I intermediate
size, P selected parameter elements, R ranks, K parameter blocks.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass

from covgrad.distributed.fsdp import shard_rows
from covgrad.distributed.shardplan import HEADROOM, gb
from covgrad.layout import ParamLayout, TensorEntry, split_blocks
from covgrad.moments.accum import FOLD_ELEMENTS, state_bytes_per_param
from covgrad.scores.blocks import chunk_rows, default_chunk_bytes, fits_one_chunk


@dataclass(frozen=True)
class LmShape:
    """A Llama-style causal LM's sizes (Llama, Qwen2): enough to list its parameters in Hugging Face names."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    qkv_bias: bool = False
    tied: bool = False
    dtype_bytes: int = 2  # bf16

    def parameters(self) -> list[tuple[str, tuple[int, ...]]]:
        """(name, shape) of every parameter, in ``named_parameters`` order."""
        H, hd = self.hidden, self.hidden // self.heads
        kv = self.kv_heads * hd
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab, H))]
        for i in range(self.layers):
            p = f"model.layers.{i}"
            for name, rows in (("q_proj", H), ("k_proj", kv), ("v_proj", kv)):
                out.append((f"{p}.self_attn.{name}.weight", (rows, H)))
                if self.qkv_bias:
                    out.append((f"{p}.self_attn.{name}.bias", (rows,)))
            out.append((f"{p}.self_attn.o_proj.weight", (H, H)))
            out += [
                (f"{p}.mlp.gate_proj.weight", (self.intermediate, H)),
                (f"{p}.mlp.up_proj.weight", (self.intermediate, H)),
                (f"{p}.mlp.down_proj.weight", (H, self.intermediate)),
                (f"{p}.input_layernorm.weight", (H,)),
                (f"{p}.post_attention_layernorm.weight", (H,)),
            ]
        out.append(("model.norm.weight", (H,)))
        if not self.tied:
            out.append(("lm_head.weight", (self.vocab, H)))
        return out

    def layout(self, patterns: Sequence[str] | None = None) -> ParamLayout:
        """The layout of the parameters matching any glob of ``patterns`` (all if None), as
        :func:`covgrad.layout.select_parameters` builds it from the model.

        Raises:
            ValueError: naming a pattern that matches no parameter.
        """
        named = self.parameters()
        for pat in patterns or ():
            if not any(fnmatch.fnmatchcase(n, pat) for n, _ in named):
                raise ValueError(f"parameter pattern {pat!r} matches no parameter; names look like {named[1][0]!r}")
        entries, at = [], 0
        for name, shape in named:
            if patterns and not any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
                continue
            numel = _numel(shape)
            entries.append(TensorEntry(name, at, numel, shape, "bfloat16" if self.dtype_bytes == 2 else "float32"))
            at += numel
        return ParamLayout(tuple(entries))


# Llama-3-70B and Qwen2.5-72B (their Hugging Face configs' sizes)
SHAPES = {
    "llama-3-70b": LmShape(vocab=128256, hidden=8192, intermediate=28672, layers=80, heads=64, kv_heads=8),
    "qwen2.5-72b": LmShape(
        vocab=152064, hidden=8192, intermediate=29568, layers=80, heads=64, kv_heads=8, qkv_bias=True
    ),
}

# Typical selections (model.params globs); None: every parameter
SELECTIONS: dict[str, list[str] | None] = {
    "all": None,
    "attention": ["model.layers.*.self_attn.*"],
    "mlp": ["model.layers.*.mlp.*"],
    "last 8 layers": ["model.layers.7[2-9].*"],
}

# Typical machines: (ranks, bytes per device)
MACHINES = {"8 x 141 GB": (8, 141_000_000_000), "16 x 80 GB": (16, 80_000_000_000)}


@dataclass(frozen=True)
class FsdpWork:
    """The run's sizes: B samples per batch of L tokens, N samples, the state dtype, the device type and the
    attention implementation ("sdpa" or "eager") the activations are counted for."""

    B: int
    L: int
    N: int
    state_dtype: str = "float32"
    device: str = "cuda"
    attention: str = "sdpa"


@dataclass(frozen=True)
class RankNeed:
    """Device bytes of one rank, by item of the memory model (one parameter block: the largest)."""

    weights: int
    gathered: int
    activations: int
    logits: int
    in_flight: int
    workspace: int
    state: int

    @property
    def total(self) -> int:
        fixed = self.weights + self.gathered + self.activations + self.logits
        return fixed + self.in_flight + self.workspace + self.state


@dataclass(frozen=True)
class FsdpPlan:
    """A model-sharded scores run: ``ranks`` devices of ``device_bytes`` each, ``blocks`` rounds."""

    ranks: int
    blocks: int
    device_bytes: int
    need: RankNeed
    P: int
    tensors: int
    store_bytes: int
    peak_store_bytes: int
    host_bytes: int  # rank 0's while the unsharded model is loaded and traced (the other ranks' are on meta)
    formed: float  # per-sample columns formed per batch over all ranks, / P (formed_columns)
    formed_aligned: float  # the same with scores.rank_chunks: aligned

    @property
    def fits(self) -> bool:
        return self.need.total <= HEADROOM * self.device_bytes

    def reason(self) -> str:
        """Why the plan does not fit (the largest item and what would shrink it); '' when it fits."""
        if self.fits:
            return ""
        n = self.need
        items = {
            "weights/R": n.weights,
            "gathered layers": n.gathered,
            "activations": n.activations,
            "logits": n.logits,
            "block in flight": n.in_flight,
            "state/R": n.state,
        }
        big = max(items, key=items.get)
        fix = {
            "weights/R": "more ranks",
            "gathered layers": "devices with more memory",
            "activations": "a smaller batch (scores.groups_per_batch) or shorter responses",
            "logits": "a smaller batch (scores.groups_per_batch)",
            "block in flight": "a smaller batch (scores.groups_per_batch)",
            "state/R": "more ranks, scores.state_dtype=float32 or fewer parameters (model.params)",
        }[big]
        return (
            f"does not fit: {gb(n.total)} GB per rank of {gb(HEADROOM * self.device_bytes)} GB usable, "
            f"{big} alone {gb(items[big])} GB; use {fix}"
        )

    def lines(self) -> list[str]:
        """The plan as printable lines (sizes in GB = 1e9 bytes)."""
        n = self.need
        verdict = "fits" if self.fits else "does NOT fit"
        return [
            f"fsdp: {self.ranks} ranks, P = {self.P:.4g} selected in {self.tensors} tensors, "
            f"{self.blocks} parameter block{'s' if self.blocks > 1 else ''} (rounds over the data)",
            f"per-rank device memory: {gb(n.total)} GB needed of {gb(self.device_bytes)} GB "
            f"({verdict}, {HEADROOM:.0%} usable)",
            f"  weights/R {gb(n.weights)}, gathered layers {gb(n.gathered)}, activations {gb(n.activations)}, "
            f"logits {gb(n.logits)}, block in flight {gb(n.in_flight)}, workspace {gb(n.workspace)}, "
            f"state/R {gb(n.state)} GB",
            f"store: {gb(self.store_bytes)} GB when complete, {gb(self.peak_store_bytes)} GB at most while running",
            f"host memory before sharding: {gb(self.host_bytes)} GB on rank 0 (the unsharded model, loaded and "
            "traced), none on the other ranks (meta device; rank 0 sends each its shard)",
            f"per-sample products: the ranks form {self.formed:.2f} × P columns per batch in all (1.00: each "
            f"column once; {self.ranks}.00: every rank all of them), a rank forming every row chunk that holds "
            f"one of its rows; {self.formed_aligned:.2f} × P with scores.rank_chunks=aligned",
        ]


def fixed_need(shape: LmShape, work: FsdpWork, ranks: int) -> RankNeed:
    """The items of rank 0's device bytes that do not depend on the parameter block (in flight, workspace
    and state 0): its weight shards, the gathered parameters, activations and logits."""
    B, L, d = work.B, work.L, shape.dtype_bytes
    params = shape.parameters()
    layer = sum(_numel(s) for n, s in params if n.startswith("model.layers.0."))
    root = sum(_numel(s) for n, s in params if not n.startswith("model.layers."))
    attention = shape.heads * L * (d + 4) if work.attention == "eager" else shape.heads * 4
    return RankNeed(
        weights=sum(_shard_numel(s, ranks) for _, s in params) * d,
        gathered=(root + 2 * layer) * d,
        activations=shape.layers * B * L * ((8 * shape.hidden + 4 * shape.intermediate) * d + attention),
        logits=B * L * shape.vocab * (d + 8),
        in_flight=0,
        workspace=0,
        state=0,
    )


def rank_need(
    shape: LmShape, block: ParamLayout, work: FsdpWork, ranks: int, fixed: RankNeed | None = None
) -> RankNeed:
    """Device bytes of rank 0 (the largest shards) folding ``block`` of ``shape`` with ``ranks`` ranks
    (``fixed``: :func:`fixed_need`, computed when not given)."""
    fixed = fixed or fixed_need(shape, work, ranks)
    B = work.B
    chunk = default_chunk_bytes(work.device) // (4 * B)
    made = [  # elements per sample of each tensor's block at once; weights in row chunks
        min(e.numel, max(chunk, e.numel // e.shape[0])) if _chunked(e.name) else e.numel for e in block.entries
    ]
    in_flight = max(made)
    elem = 8 if work.state_dtype == "float64" else 4
    columns = min(FOLD_ELEMENTS[work.device], B * max(e.numel for e in block.entries))
    scratch = FOLD_ELEMENTS[work.device] // B * state_bytes_per_param(work.state_dtype)
    state = sum(_shard_numel(e.shape, ranks) for e in block.entries) * state_bytes_per_param(work.state_dtype)
    return RankNeed(
        weights=fixed.weights,
        gathered=fixed.gathered,
        activations=fixed.activations,
        logits=fixed.logits,
        in_flight=B * 4 * in_flight,
        workspace=int(columns * (1 + 6 / B) * elem) + scratch,
        state=state,
    )


def fsdp_plan(
    shape: LmShape, layout: ParamLayout, work: FsdpWork, ranks: int, device_bytes: int, blocks: int | str = "auto"
) -> FsdpPlan:
    """The plan of ``layout`` (a selection of ``shape``) on ``ranks`` devices of ``device_bytes`` each, in
    ``blocks`` parameter blocks ("auto": the fewest whose ranks fit; one tensor per block, not fitting, when
    none does; one block, not fitting, when the block-independent items alone do not fit).

    Raises:
        ValueError: naming the value when ranks, device memory or blocks are out of range.
    """
    if ranks < 1 or device_bytes <= 0:
        raise ValueError(f"ranks ({ranks}) and device memory ({device_bytes} bytes) must be positive")
    if blocks != "auto" and not 1 <= int(blocks) <= len(layout.entries):
        raise ValueError(f"blocks={blocks} must lie in [1, {len(layout.entries)}] (the selected tensors)")
    usable = HEADROOM * device_bytes
    fixed = fixed_need(shape, work, ranks)

    def need(k: int) -> RankNeed:
        return max((rank_need(shape, b, work, ranks, fixed) for b in split_blocks(layout, k)), key=lambda n: n.total)

    if blocks != "auto":
        k, chosen = int(blocks), need(int(blocks))
    else:
        k, chosen = 1, need(1)
        if chosen.total > usable and fixed.total < usable:
            lo, hi = 1, len(layout.entries)  # the fewest blocks that fit: bisect (more blocks never need more)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if need(mid).total <= usable else (mid, hi)
            k, chosen = hi, need(hi)  # one tensor per block when none fits: its reason is the block's own
    state = state_bytes_per_param(work.state_dtype)
    store = state * layout.P
    return FsdpPlan(
        ranks=ranks,
        blocks=k,
        device_bytes=device_bytes,
        need=chosen,
        P=layout.P,
        tensors=len(layout.entries),
        store_bytes=store,
        peak_store_bytes=store + 2 * ranks * chosen.state,
        host_bytes=sum(_numel(s) for _, s in shape.parameters()) * shape.dtype_bytes,
        formed=sum(formed_columns(layout, ranks, work.B, default_chunk_bytes(work.device))) / layout.P,
        formed_aligned=sum(formed_columns(layout, ranks, work.B, 0, aligned=True)) / layout.P,
    )


def formed_columns(layout: ParamLayout, ranks: int, B: int, chunk_bytes: int, aligned: bool = False) -> list[int]:
    """Per rank, the per-sample columns it forms per batch under FSDP2 (``covgrad.scores.blocks``' row chunks).

    A weight folded in row chunks (:func:`_chunked`) is cut into chunks of ``max(1, chunk_bytes // (B·row·4))``
    rows on the unsharded grid (so that every formed chunk is the unsharded run's); a rank forms each chunk
    that holds one of its dim-0 shard's rows, the chunk's rows within the tensor. With ``aligned``
    (``scores.rank_chunks``) the chunks start at the rank's shard, so it forms its shard's rows only. Any other
    tensor is formed whole by every rank. A selection whose (B, P) block fits one chunk is that one chunk, formed
    whole by every rank (unless aligned). Sum over ranks / P is 1 when no column is formed twice.

    Args:
        layout: whole tensors (``TensorEntry.rows`` covering dim 0); ranks: R; B: samples per batch;
            chunk_bytes: bytes of one row chunk (``default_chunk_bytes`` of the device; unused when aligned).
        aligned: row chunks on each rank's own grid.

    Returns:
        R integers, the columns rank r forms.
    """
    if not aligned and fits_one_chunk(B, layout.P, chunk_bytes):
        return [layout.P] * ranks
    out = [0] * ranks
    for e in layout.entries:
        rows = e.shape[0] if e.shape else 1
        row = e.numel // max(rows, 1)
        per = chunk_rows(chunk_bytes, B, row)
        for r in range(ranks):
            if not _chunked(e.name):
                out[r] += e.numel
                continue
            lo, hi = shard_rows(rows, ranks, r)
            if aligned:
                out[r] += (hi - lo) * row
            elif lo < hi:
                out[r] += sum(min(rows, c + per) - c for c in range(lo // per * per, hi, per)) * row
    return out


def table(work: FsdpWork) -> list[str]:
    """A markdown table of every shape × machine × selection of this module (docs/fsdp.md)."""
    out = [
        "| model | machine | selection | P | blocks | weights/R | gathered | activations | in flight | state/R "
        "| per rank | fits | store | formed / P | aligned / P |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, shape in SHAPES.items():
        for machine, (ranks, memory) in MACHINES.items():
            for sel, patterns in SELECTIONS.items():
                layout = shape.layout(patterns)
                p = fsdp_plan(shape, layout, work, ranks, memory)
                n = p.need
                out.append(
                    f"| {name} | {machine} | {sel} | {p.P / 1e9:.2f}e9 | {p.blocks} | {gb(n.weights)} | "
                    f"{gb(n.gathered)} | {gb(n.activations)} | {gb(n.in_flight)} | {gb(n.state)} | {gb(n.total)} | "
                    f"{'yes' if p.fits else 'no'} | {gb(p.store_bytes)} | {p.formed:.2f} | {p.formed_aligned:.2f} |"
                )
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _shard_numel(shape: tuple[int, ...], ranks: int) -> int:
    """Elements of rank 0's dim-0 shard (the largest) of a tensor of ``shape``."""
    lo, hi = shard_rows(shape[0], ranks, 0)
    return (hi - lo) * (_numel(shape) // shape[0])


def _chunked(name: str) -> bool:
    """Whether the per-sample block of ``name`` is written and folded in row chunks: every projection, the LM
    head and the input embedding, tied or not (``covgrad.scores.binding.folds_in_row_chunks``)."""
    return name.endswith("_proj.weight") or name in ("lm_head.weight", "model.embed_tokens.weight")


def main() -> None:
    """Print :func:`table` (``python -m covgrad.distributed.plan --batch 2 --tokens 512``)."""
    import argparse

    parser = argparse.ArgumentParser(description="Per-rank plans of the 70B shapes on 8 x 141 GB and 16 x 80 GB")
    parser.add_argument("--batch", type=int, default=2, help="B, samples per batch")
    parser.add_argument("--tokens", type=int, default=512, help="L, tokens per sample")
    parser.add_argument("--state-dtype", default="float32", choices=["float32", "float64"])
    args = parser.parse_args()
    print("\n".join(table(FsdpWork(B=args.batch, L=args.tokens, N=4096, state_dtype=args.state_dtype))))


if __name__ == "__main__":
    main()
