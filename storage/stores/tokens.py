"""The tokens store (``tokens.zarr``, declared in :mod:`storage.schema`) of the token-Fisher study.

Dims: sample, position (response position), param, batch, tensor.

- ``trace_{mode}`` (:func:`covgrad.tokens.study.trace_names`), ``entropy``, ``p_drawn``, ``covered_mass``
  (sample, position) float64 (0 beyond a row's response; ``covered_mass`` is the top-k mass, 1 without
  topk); ``score_sum_relerr`` (sample,) float64, ‖Σ_t s_t − s‖ / ‖s‖ per sample;
- batch rows (batch, param) float64, while the stage runs: ``rows_{name}`` for each name of
  :func:`covgrad.tokens.study.row_names` (the batch's Σ_n Σ_t f_{n,t} per mode or half, Σ_n s_n² as
  ``seq_sq`` and Σ_n Σ_t s_{n,t}² as ``tok_sq``). They are the resume state and the summary's input, and
  are dropped once the summary is written (8 B × P per row and batch, most of the store);
  ``batch_count`` (batch,) rows per batch; ``lm_head_relerr`` (batch,) closed form vs exact (NaN when not
  checked);
- ``fisher_{mode}`` (param,) = Σ f / N per mode and ``fisher_seq`` (param,) = mean(s²);
- ``batch_done`` progress; attrs: ``scalars`` (:func:`covgrad.tokens.study.summarize`, set last by the
  summary; the errors against F with their jackknife intervals, ``relerr_{mode}_vs_seq_lo``/``_hi``,
  which need the batch rows and so are computed before the rows are dropped), ``errors_vs_seq`` (rows
  of the three-N table), the tensor table, sampler, modes and main mode.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import zarr

from covgrad.layout import ParamLayout
from covgrad.tokens import POSITION_ARRAYS, BatchResult, StudyRecord, row_names, trace_names
from storage.artifacts import create_progress, mark_batch_done, pending_batches
from storage.schema import TOKENS, annotate, create, param_chunk


def summary_step(P: int) -> int:
    """Columns of the parameter axis the summary reads at a time: whole ``param`` chunks, about 4M."""
    return param_chunk(P) * max(1, (1 << 22) // param_chunk(P))


class TokensStore:
    """The tokens store of one artifact (zarr group ``g``, open for writing) of a study of ``modes``."""

    def __init__(self, g: zarr.Group, modes: list[str]) -> None:
        self.g = g
        self.modes = modes

    @classmethod
    def create(
        cls, g: zarr.Group, N: int, T: int, P: int, batches: list[tuple[int, int]], modes: list[str]
    ) -> TokensStore:
        """Create (or keep, on a resume) the per-sample and per-batch arrays and the progress of ``batches``
        ([lo, hi) sample ranges, the first one's length the chunk rows)."""
        rows = batches[0][1]
        for name in (*POSITION_ARRAYS, *trace_names(modes)):
            create(g, TOKENS, name, (N, T), rows=rows)
        create(g, TOKENS, "score_sum_relerr", (N,), rows=rows)
        for name in row_names(modes):
            create(g, TOKENS, f"rows_{name}", (len(batches), P))
        create(g, TOKENS, "batch_count", (len(batches),))
        create(g, TOKENS, "lm_head_relerr", (len(batches),))
        create_progress(g, TOKENS, len(batches))
        return cls(g, modes)

    def pending(self) -> list[int]:
        """Batches not yet marked done."""
        return pending_batches(self.g)

    def write_row(self, b: int, name: str, row: np.ndarray) -> None:
        """Batch ``b``'s (P,) float64 sum ``name`` (of :func:`~covgrad.tokens.study.row_names`)."""
        self.g[f"rows_{name}"][b] = row

    def write_batch(self, b: int, lo: int, hi: int, result: BatchResult) -> None:
        """Batch ``b``'s per-sample outputs (samples [lo, hi)), then its progress mark (written last)."""
        g = self.g
        for name, value in result.positions.items():
            g[name][lo:hi, : value.shape[1]] = value
        g["score_sum_relerr"][lo:hi] = result.score_sum_relerr
        g["batch_count"][b] = hi - lo
        g["lm_head_relerr"][b] = result.lm_head_relerr
        mark_batch_done(g, b)

    @property
    def summarized(self) -> bool:
        """Whether the summary is written (its scalars are set last)."""
        return "scalars" in self.g.attrs

    def summary_io(self, P: int, response_len: np.ndarray) -> tuple[StudyRecord, dict[str, zarr.Array]]:
        """The stored record of all batches (batch rows read lazily by column slices) with the samples'
        response lengths ``response_len`` (N,), and the (P,) Fisher arrays ``fisher_{mode}`` and
        ``fisher_seq``, created afresh, for :func:`~covgrad.tokens.study.summarize` to write."""
        g, modes = self.g, self.modes
        names = [*(f"fisher_{m}" for m in modes), "fisher_seq"]
        out = {name: create(g, TOKENS, name, (P,), overwrite=True) for name in names}
        record = StudyRecord(
            rows={name: g[f"rows_{name}"] for name in row_names(modes)},
            counts=g["batch_count"][:],
            positions={name: g[name][:] for name in (*POSITION_ARRAYS, *trace_names(modes))},
            score_sum_relerr=g["score_sum_relerr"][:],
            lm_head_relerr=g["lm_head_relerr"][:],
            response_len=response_len,
        )
        return record, out

    def write_summary(self, attrs: dict[str, Any]) -> None:
        """The summary's attributes; ``attrs["scalars"]`` marks the summary written."""
        self.g.attrs.update(attrs)

    def finish(self, layout: ParamLayout) -> dict[str, Any]:
        """Drop the batch rows (the summary holds all that is kept of them; a rerun after a kill drops the
        rest), write the tensor table; returns the scalars."""
        for name in row_names(self.modes):
            if f"rows_{name}" in self.g:
                del self.g[f"rows_{name}"]
        annotate(self.g, TOKENS, layout)
        return self.g.attrs["scalars"]
