"""The flat parameter axis: which parameters are analysed and where each one sits.

Every per-parameter array in covgrad (scores, moment rows, Fisher, covariance, masks) is a flat
vector of length P over the *selected* parameters, concatenated in ``named_parameters()`` order.
A parameter shared by several modules (tied embedding and LM head) appears once, under the first
name ``named_parameters()`` gives it. A parameter block (:func:`split_blocks`) may hold only some rows
(a range along dim 0) of a tensor: its entry says which (``row0``, ``full_rows``).
"""

from __future__ import annotations

import bisect
import fnmatch
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TensorEntry:
    """One parameter tensor on the flat axis: elements ``[offset, offset + numel)``.

    A whole tensor has ``full_rows`` None. A part of one (a row-cut parameter block) holds rows
    ``[row0, row0 + shape[0])`` of the tensor's ``full_rows`` along dim 0: ``shape`` and ``numel`` are the
    part's, its elements the tensor's flat elements ``[row0 · row_size, (row0 + shape[0]) · row_size)``.
    """

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]
    dtype: str
    row0: int = 0
    full_rows: int | None = None

    @property
    def is_part(self) -> bool:
        """Whether the entry holds only some rows of its tensor."""
        return self.full_rows is not None

    @property
    def full_shape(self) -> tuple[int, ...]:
        """The whole tensor's shape (the parameter's ``shape``)."""
        return self.shape if self.full_rows is None else (self.full_rows, *self.shape[1:])

    @property
    def row_size(self) -> int:
        """Elements per row along dim 0 (numel of a 0-d tensor)."""
        return self.numel // self.shape[0] if self.shape and self.shape[0] else self.numel

    @property
    def rows(self) -> tuple[int, int]:
        """The rows ``[r0, r1)`` of the tensor along dim 0 that the entry holds (all of them when whole)."""
        n = self.shape[0] if self.shape else 1
        return self.row0, self.row0 + n


@dataclass(frozen=True)
class ParamLayout:
    """Ordered table of the selected parameter tensors; ``P`` is the total element count."""

    entries: tuple[TensorEntry, ...]

    @property
    def P(self) -> int:
        """Total number of selected parameter elements."""
        last = self.entries[-1]
        return last.offset + last.numel

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def entry(self, name: str) -> TensorEntry:
        """The entry for parameter ``name``; KeyError naming it when it is not selected."""
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(f"parameter {name!r} is not in the layout; selected: {self.names[:5]}...")

    def to_records(self) -> list[dict]:
        """JSON-serialisable table (name, offset, numel, shape, dtype; ``row0``, ``full_rows`` for a part of
        a tensor only) for storage attrs."""
        out = []
        for e in self.entries:
            r = {"name": e.name, "offset": e.offset, "numel": e.numel, "shape": list(e.shape), "dtype": e.dtype}
            if e.is_part:
                r.update(row0=e.row0, full_rows=e.full_rows)
            out.append(r)
        return out

    @classmethod
    def from_records(cls, records: Sequence[dict]) -> ParamLayout:
        return cls(
            tuple(
                TensorEntry(
                    r["name"],
                    int(r["offset"]),
                    int(r["numel"]),
                    tuple(r["shape"]),
                    r["dtype"],
                    int(r.get("row0", 0)),
                    None if r.get("full_rows") is None else int(r["full_rows"]),
                )
                for r in records
            )
        )

    def tensor_ids(self) -> torch.Tensor:
        """Tensor index of every flat element, shape (P,), int32 (for per-tensor grouping)."""
        return torch.repeat_interleave(
            torch.arange(len(self.entries), dtype=torch.int32),
            torch.tensor([e.numel for e in self.entries]),
        )


def select_parameters(model: nn.Module, patterns: Sequence[str] | None = None) -> ParamLayout:
    """Layout of the trainable parameters whose names match any glob in ``patterns`` (if None: every one of
    the language model, :func:`language_parameters`).

    Raises ValueError naming the pattern when a pattern matches no trainable parameter.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not patterns:
        named = language_parameters(model, named)
    else:
        for pat in patterns:
            if not any(fnmatch.fnmatchcase(n, pat) for n, _ in named):
                raise ValueError(
                    f"parameter pattern {pat!r} matches no trainable parameter; "
                    f"names look like {[n for n, _ in named[:3]]}"
                )
        named = [(n, p) for n, p in named if any(fnmatch.fnmatchcase(n, pat) for pat in patterns)]
    if not named:
        raise ValueError("the model has no trainable parameters to analyse")
    entries = []
    offset = 0
    for name, p in named:
        entries.append(TensorEntry(name, offset, p.numel(), tuple(p.shape), str(p.dtype).removeprefix("torch.")))
        offset += p.numel()
    return ParamLayout(tuple(entries))


def language_parameters(model: nn.Module, named: list[tuple[str, nn.Parameter]]) -> list[tuple[str, nn.Parameter]]:
    """The (name, parameter) pairs of ``named`` that a text-only forward of ``model`` uses: for a multimodal
    model (a config whose ``get_text_config()`` is a sub-config: Gemma 3 ``Gemma3ForConditionalGeneration``,
    Gemma 3n, Gemma 4), those of its language model (``get_decoder()``) and output embedding, not its vision or
    audio towers and projectors (no gradient without images or audio); ``named`` itself for any other model."""
    config = getattr(model, "config", None)
    text_config = getattr(config, "get_text_config", None)
    if text_config is None or text_config() is config or not hasattr(model, "get_decoder"):
        return named
    modules = [model.get_decoder(), model.get_output_embeddings()]
    language = {id(p) for m in modules if m is not None for p in m.parameters()}
    return [(n, p) for n, p in named if id(p) in language] or named


def parameters_flat(model: nn.Module, layout: ParamLayout) -> torch.Tensor:
    """The model's current values of the selected parameters as one (P,) tensor (a copy)."""
    params = dict(model.named_parameters())
    return torch.cat([params[e.name].detach().reshape(-1) for e in layout.entries])


def split_blocks(layout: ParamLayout, n_blocks: int, cut: bool = False) -> list[ParamLayout]:
    """Split the layout into ``n_blocks`` contiguous runs of about P / n_blocks elements each; every block
    is re-based to offset 0 (its own flat axis of ``block.P`` elements).

    Without ``cut``, blocks hold whole tensors: block k ends at the tensor boundary nearest to
    (k + 1)·P / n_blocks (each block keeps at least one tensor). With ``cut``, a block may end inside a
    tensor of two or more dimensions, at the row boundary (along dim 0) nearest to (k + 1)·P / n_blocks,
    so a tensor larger than P / n_blocks is spread over several blocks as row ranges (entries with
    ``full_rows``); 1-d tensors stay whole. Either way the split depends only on the tensor sizes, and
    the blocks concatenated in order are the layout's flat axis: block k starts at column
    ``sum(b.P for b in blocks[:k])``.

    Raises ValueError naming the count when it is below 1, or above the number of tensors (without
    ``cut``) or of places to end a block (with it).
    """
    if not cut:
        return _split_whole(layout, n_blocks)
    ends = _cut_points(layout)  # (places,) flat columns where a block may end, increasing, the last = P
    if not 1 <= n_blocks <= len(ends):
        raise ValueError(
            f"{n_blocks} parameter blocks cannot be made from {len(ends)} places to cut the selected tensors "
            f"at; use between 1 and {len(ends)} blocks"
        )
    cuts, lo = [], -1
    for k in range(1, n_blocks):
        target = k * layout.P / n_blocks
        hi = len(ends) - 1 - (n_blocks - k)  # keep one place for each block still to come
        near = bisect.bisect_left(ends, target, lo + 1, hi + 1)  # the places on either side of the target
        at = min((i for i in (near - 1, near) if lo < i <= hi), key=lambda i: (abs(ends[i] - target), i))
        cuts.append(ends[at])
        lo = at
    bounds = [0, *cuts, layout.P]
    return [_columns(layout, a, b) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def _cut_points(layout: ParamLayout) -> list[int]:
    """Every flat column where a row-cut block may end: each tensor's end, and each row boundary inside a
    tensor of two or more dimensions."""
    out: list[int] = []
    for e in layout.entries:
        if len(e.shape) >= 2 and e.shape[0] > 1:
            out.extend(range(e.offset + e.row_size, e.offset + e.numel, e.row_size))
        out.append(e.offset + e.numel)
    return out


def _columns(layout: ParamLayout, a: int, b: int) -> ParamLayout:
    """The layout's columns [a, b) as a layout of its own (offset 0): whole tensors and, where a or b falls
    inside a tensor (at a row boundary), the part of its rows that lies inside."""
    entries = []
    for e in layout.entries:
        lo, hi = max(a, e.offset), min(b, e.offset + e.numel)
        if lo >= hi:
            continue
        if (lo, hi) == (e.offset, e.offset + e.numel):
            entries.append(TensorEntry(e.name, lo - a, e.numel, e.shape, e.dtype, e.row0, e.full_rows))
            continue
        size = e.row_size
        r0, r1 = (lo - e.offset) // size, (hi - e.offset) // size
        full = e.full_rows if e.is_part else e.shape[0]
        shape = (r1 - r0, *e.shape[1:])
        entries.append(TensorEntry(e.name, lo - a, hi - lo, shape, e.dtype, e.row0 + r0, full))
    return ParamLayout(tuple(entries))


def _split_whole(layout: ParamLayout, n_blocks: int) -> list[ParamLayout]:
    """:func:`split_blocks` into runs of whole tensors."""
    entries = layout.entries
    if not 1 <= n_blocks <= len(entries):
        raise ValueError(
            f"{n_blocks} parameter blocks cannot be made from {len(entries)} selected tensors; "
            f"use between 1 and {len(entries)} blocks"
        )
    ends = [e.offset + e.numel for e in entries]  # (tensors,) column where each tensor ends
    cuts, lo = [], 0
    for k in range(1, n_blocks):
        target = k * layout.P / n_blocks
        # the first tensor after the previous cut, and keep one tensor for each block still to come
        hi = len(entries) - (n_blocks - k)
        cut = min(range(lo + 1, hi + 1), key=lambda t: (abs(ends[t - 1] - target), t))
        cuts.append(cut)
        lo = cut
    bounds = [0, *cuts, len(entries)]
    blocks = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        base = entries[a].offset
        blocks.append(
            ParamLayout(tuple(TensorEntry(e.name, e.offset - base, e.numel, e.shape, e.dtype) for e in entries[a:b]))
        )
    return blocks


def check_layout(layout: ParamLayout, stats_layout: ParamLayout, stage: str) -> None:
    """ValueError naming the first differing tensor when the model's selected parameters (``layout``) are not
    the stats store's flat axis (``stats_layout``), which ``stage`` steps against."""
    mine = [(e.name, e.offset, e.numel, e.shape) for e in layout.entries]
    theirs = [(e.name, e.offset, e.numel, e.shape) for e in stats_layout.entries]
    for a, b in itertools.zip_longest(mine, theirs):
        if a != b:
            raise ValueError(
                f"the policy's selected parameters do not match the stats store's tensor table (model {a} vs "
                f"stats {b}); run {stage} with the model.params that produced the stats"
            )
