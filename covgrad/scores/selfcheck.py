"""The self-check of :class:`covgrad.scores.engine.PerSampleGrads`: every selected tensor's summed per-sample
gradient Σ_n s_n against the ordinary batched autograd gradient of the summed objective.

It catches a module whose forward a per-sample rule does not match (e.g. a Linear subclass that rescales its
weight) or a parameter used where no rule sees it. The sums are taken in column chunks as the blocks are folded,
so no (numel,) float64 copy of a sum or of the reference is made whole.
"""

from __future__ import annotations

import torch
from torch import Tensor

from covgrad.layout import ParamLayout, TensorEntry

# Elements per step of the self-check's comparison of one tensor (its float64 temporaries hold this many:
# B samples × _CHECK_COLUMNS / B columns of a block converted, then the sum and the reference's columns).
_CHECK_COLUMNS = 1 << 22

# Self-check tolerance on ‖Σ_n s_n − g‖ / ‖g‖ per tensor. Low-precision models get a looser bound
# because the batched reference gradient itself is accumulated in bf16/fp16.
_CHECK_RTOL = {torch.float64: 1e-4, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


class SelfCheck:
    """The self-check of one batch: Σ_n s_n of every selected tensor against the batched gradient.

    ``add(entry, at, cols)`` takes columns [at, at + n) of a tensor's (B, numel) float32 per-sample block and
    sums them over the samples in column chunks (in float64); ``close(entry)`` compares the tensor's sum with
    the reference within the dtype's tolerance and drops the reference (``compare``: both, for a whole block);
    ``raise_first`` raises the mismatches (one ValueError naming every mismatched parameter) once the batch is
    done. No (numel,) float64 copy of a sum or of the reference is made whole (1.3 GB for a 262k × 640
    embedding).

    Args:
        layout: the selected parameters.
        params: the model's parameter of each layout entry, in layout order.
        grads: the batched gradient of each (None where the parameter does not reach the logits).
    """

    def __init__(self, layout: ParamLayout, params: list[Tensor], grads: tuple[Tensor | None, ...]) -> None:
        # A tensor whose exact gradient is zero (a key bias: the softmax ignores a shift shared by all keys)
        # holds only rounding noise; it is compared against 1e-4 of the whole gradient's norm instead.
        self.floor = 1e-4 * float(sum(float(g.double().norm()) ** 2 for g in grads if g is not None) ** 0.5)
        self.refs = {e.name: (p.dtype, g) for e, p, g in zip(layout.entries, params, grads, strict=True)}
        self.sq: dict[str, Tensor] = {}  # per tensor: ‖summed − ref‖², ‖ref‖², ‖summed‖² so far
        self.errors: list[tuple[str, float]] = []  # (parameter, relative difference) of every mismatch
        self.rtol = 1e-4

    def add(self, entry: TensorEntry, at: int, cols: Tensor) -> None:
        """Columns [at, at + n) of ``entry``'s per-sample block, ``cols`` (B, n) float32 (of a row-cut tensor:
        columns of the entry's rows)."""
        g = self.refs[entry.name][1]
        ref = None if g is None else g.detach().reshape(entry.full_shape[0] if entry.shape else 1, -1)
        if ref is not None:
            ref = ref[entry.rows[0] : entry.rows[1]].reshape(-1)
        sq = self.sq.setdefault(entry.name, torch.zeros(3, dtype=torch.float64))
        step = max(1, _CHECK_COLUMNS // max(1, cols.shape[0]))
        for j in range(0, cols.shape[1], step):
            s = cols[:, j : j + step].sum(0, dtype=torch.float64)
            r = torch.zeros_like(s) if ref is None else ref[at + j : at + j + s.numel()].to(torch.float64)
            sq += torch.stack([(s - r).square().sum(), r.square().sum(), s.square().sum()]).cpu()

    def close(self, entry: TensorEntry) -> None:
        """Compare ``entry``'s summed per-sample gradient (every column added) with its reference."""
        dtype, _ = self.refs.pop(entry.name)
        sq = self.sq.pop(entry.name, torch.zeros(3, dtype=torch.float64))
        err, ref_norm, sum_norm = (float(v) for v in sq.sqrt())
        scale = max(ref_norm, sum_norm, self.floor)
        rtol = _CHECK_RTOL.get(dtype, 1e-4)
        if err > rtol * scale:
            self.errors.append((entry.name, err / scale))
            self.rtol = rtol

    def compare(self, entry: TensorEntry, block: Tensor) -> None:
        """Check ``entry``'s whole per-sample block (B, numel) float32 and drop its reference."""
        self.add(entry, 0, block)
        self.close(entry)

    def raise_first(self) -> None:
        """Raise one error naming every mismatch found (the first in full), if any."""
        if not self.errors:
            return
        (name, rel), rest = self.errors[0], self.errors[1:]
        also = "; also for " + ", ".join(f"{n!r} ({r:.3g})" for n, r in rest) if rest else ""
        raise ValueError(
            f"self-check failed for parameter {name!r}: the summed per-sample gradient differs from the "
            f"batched gradient by {rel:.3g} (relative, tolerance {self.rtol:g}); its module's forward does not "
            f"match the per-sample rule, or the parameter is used where no rule sees it{also}"
        )
