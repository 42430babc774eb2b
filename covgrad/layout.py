"""The flat parameter axis: which parameters are analysed and where each one sits.

Every per-parameter array in covgrad (scores, moment rows, Fisher, covariance, masks) is a flat
vector of length P over the *selected* parameters, concatenated in ``named_parameters()`` order.
A parameter shared by several modules (tied embedding and LM head) appears once, under the first
name ``named_parameters()`` gives it.
"""

from __future__ import annotations

import fnmatch
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class TensorEntry:
    """One parameter tensor on the flat axis: elements ``[offset, offset + numel)``."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]
    dtype: str


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
        """JSON-serialisable table (name, offset, numel, shape, dtype) for storage attrs."""
        return [
            {"name": e.name, "offset": e.offset, "numel": e.numel, "shape": list(e.shape), "dtype": e.dtype}
            for e in self.entries
        ]

    @classmethod
    def from_records(cls, records: Sequence[dict]) -> ParamLayout:
        return cls(
            tuple(
                TensorEntry(r["name"], int(r["offset"]), int(r["numel"]), tuple(r["shape"]), r["dtype"])
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
    """Layout of the trainable parameters whose names match any glob in ``patterns`` (all if None).

    Raises ValueError naming the pattern when a pattern matches no trainable parameter.
    """
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if patterns:
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


def parameters_flat(model: nn.Module, layout: ParamLayout) -> torch.Tensor:
    """The model's current values of the selected parameters as one (P,) tensor (a copy)."""
    params = dict(model.named_parameters())
    return torch.cat([params[e.name].detach().reshape(-1) for e in layout.entries])


def split_blocks(layout: ParamLayout, n_blocks: int) -> list[ParamLayout]:
    """Split the layout into ``n_blocks`` contiguous runs of whole tensors of about P / n_blocks elements
    each; every block is re-based to offset 0 (its own flat axis of ``block.P`` elements).

    Block k ends at the tensor boundary nearest to (k + 1)·P / n_blocks (each block keeps at least one
    tensor), so the split depends only on the tensor sizes. The blocks concatenated in order are the
    layout's flat axis: block k starts at column ``sum(b.P for b in blocks[:k])``.

    Raises ValueError naming the count when it is below 1 or above the number of tensors.
    """
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
