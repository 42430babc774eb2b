"""The self-check of :class:`covgrad.scores.engine.PerSampleGrads`: every selected tensor's summed per-sample
gradient Σ_n s_n against the ordinary batched autograd gradient of the summed objective, one random sample's
rows against the gradient of its own objective, and the whole model's separation of the samples.

The sums catch a module whose forward a per-sample rule does not match (e.g. a Linear subclass that rescales its
weight) or a parameter used where no rule sees it. They cannot see a model that mixes samples (a module that
reshapes over the flattened batch, so that tokens of different samples meet): every tensor upstream of it gets
rows that take other samples' objectives, whose sum is still the batched gradient. Two probes see it, in the same
checked pass: sample j's rows of every tensor against the gradient of sample j's objective alone (one more
backward of the reference's graph), and :func:`separation`, one forward with sample j's tokens replaced, after
which no other sample's logits may move (:func:`covgrad.scores.tracing.locate_mixing` then names the tensors
whose gradient flows through the mixing). The sums are taken in column chunks as the blocks are folded, so no
(numel,) float64 copy of a sum or of the reference is made whole.

Shape notation: B samples in the batch, L sequence positions, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from covgrad.layout import ParamLayout, TensorEntry

# Elements per step of the self-check's comparison of one tensor (its float64 temporaries hold this many:
# B samples × _CHECK_COLUMNS / B columns of a block converted, then the sum and the reference's columns).
_CHECK_COLUMNS = 1 << 22

# Self-check tolerance on ‖Σ_n s_n − g‖ / ‖g‖ per tensor. Low-precision models get a looser bound
# because the batched reference gradient itself is accumulated in bf16/fp16.
_CHECK_RTOL = {torch.float64: 1e-4, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-2}


@dataclass(frozen=True)
class Mixing:
    """What :func:`separation` found: replacing sample ``j``'s tokens moved the logits of the samples ``targets``
    by up to ``rel`` of their largest magnitude."""

    j: int
    targets: list[int]
    rel: float


def probe_sample(B: int) -> int:
    """The sample the separation probe perturbs and whose rows it checks: random (a generator seeded 0) in [0, B)."""
    return int(torch.randint(B, (1,), generator=torch.Generator().manual_seed(0)))


def separation(model: nn.Module, inputs: dict[str, Tensor | None], logits: Tensor, j: int) -> Mixing | None:
    """Whether any sample's logits depend on sample ``j``'s tokens: one forward (no graph) of the batch with sample j's
    real tokens replaced by tokens drawn from the batch's own (a generator seeded 1), against ``logits`` (B, L, V), the
    batch's own. Another sample's logits at its real positions must not move by more than the dtype's self-check
    tolerance of their largest magnitude (a model that keeps the samples apart keeps them bit for bit, up to sums
    reordered when another sample's routing resizes an expert's group).

    Returns:
        None, or the samples whose logits moved (:class:`Mixing`).
    """
    ids, mask = inputs["input_ids"], inputs["attention_mask"]
    assert ids is not None and mask is not None
    real = mask.bool()
    pool = ids[real]
    pick = torch.randint(pool.numel(), (int(real[j].sum()),), generator=torch.Generator().manual_seed(1))
    other = ids.clone()
    other[j, real[j]] = pool[pick.to(pool.device)]
    with torch.no_grad():
        moved = model(**{**inputs, "input_ids": other}, use_cache=False).logits
    keep = real[..., None].float()
    change = ((moved.float() - logits.float()).abs() * keep).nan_to_num(0.0, 0.0, 0.0).flatten(1).amax(1)
    scale = (logits.float().abs() * keep).nan_to_num(0.0, 0.0, 0.0).flatten(1).amax(1).clamp(min=1e-30)
    rel = (change / scale).cpu()
    rel[j] = 0.0
    targets = [int(i) for i in torch.nonzero(rel > _CHECK_RTOL.get(logits.dtype, 1e-4)).flatten()]
    return Mixing(j, targets, float(rel.max())) if targets else None


class SelfCheck:
    """The self-check of one batch: Σ_n s_n of every selected tensor against the batched gradient.

    ``add(entry, at, cols)`` takes columns [at, at + n) of a tensor's (B, numel) float32 per-sample block and
    sums them over the samples in column chunks (in float64); ``close(entry)`` compares the tensor's sum with
    the reference within the dtype's tolerance and drops the reference (``compare``: both, for a whole block);
    ``raise_first`` raises the mismatches (one ValueError naming every mismatched parameter) once the batch is
    done. With ``own``, sample j's row of each tensor is compared the same way with the gradient of sample j's
    objective alone. No (numel,) float64 copy of a sum or of the reference is made whole (1.3 GB for a 262k × 640
    embedding).

    Args:
        layout: the selected parameters.
        params: the model's parameter of each layout entry, in layout order.
        grads: the batched gradient of each (None where the parameter does not reach the logits).
        own: None, or (j, the gradient of sample j's objective alone of each parameter).
    """

    def __init__(
        self,
        layout: ParamLayout,
        params: list[Tensor],
        grads: tuple[Tensor | None, ...],
        own: tuple[int, tuple[Tensor | None, ...]] | None = None,
    ) -> None:
        # A tensor whose exact gradient is zero (a key bias: the softmax ignores a shift shared by all keys)
        # holds only rounding noise; it is compared against 1e-4 of the whole gradient's norm instead.
        self.floor = 1e-4 * float(sum(float(g.double().norm()) ** 2 for g in grads if g is not None) ** 0.5)
        self.refs = {e.name: (p.dtype, g) for e, p, g in zip(layout.entries, params, grads, strict=True)}
        self.sq: dict[str, Tensor] = {}  # per tensor: ‖summed − ref‖², ‖ref‖², ‖summed‖² so far
        self.errors: list[tuple[str, float]] = []  # (parameter, relative difference) of every mismatch
        self.rtol = 1e-4
        self.j = -1 if own is None else own[0]
        self.own = {} if own is None else {e.name: g for e, g in zip(layout.entries, own[1], strict=True)}
        self.row_errors: list[tuple[str, float]] = []  # the same, of sample j's row against its own gradient

    def add(self, entry: TensorEntry, at: int, cols: Tensor) -> None:
        """Columns [at, at + n) of ``entry``'s per-sample block, ``cols`` (B, n) float32 (of a row-cut tensor:
        columns of the entry's rows)."""
        ref = _entry_columns(entry, self.refs[entry.name][1])
        own = _entry_columns(entry, self.own.get(entry.name)) if self.j >= 0 else None
        sq = self.sq.setdefault(entry.name, torch.zeros(6, dtype=torch.float64))
        step = max(1, _CHECK_COLUMNS // max(1, cols.shape[0]))
        for k in range(0, cols.shape[1], step):
            s = cols[:, k : k + step].sum(0, dtype=torch.float64)
            r = torch.zeros_like(s) if ref is None else ref[at + k : at + k + s.numel()].to(torch.float64)
            parts = [(s - r).square().sum(), r.square().sum(), s.square().sum()]
            if self.j >= 0:
                row = cols[self.j, k : k + step].to(torch.float64)
                o = torch.zeros_like(row) if own is None else own[at + k : at + k + row.numel()].to(torch.float64)
                parts += [(row - o).square().sum(), o.square().sum(), row.square().sum()]
            sq[: len(parts)] += torch.stack(parts).cpu()

    def close(self, entry: TensorEntry) -> None:
        """Compare ``entry``'s summed per-sample gradient (every column added) with its reference, and sample j's
        row with the gradient of its own objective."""
        dtype, _ = self.refs.pop(entry.name)
        self.own.pop(entry.name, None)
        sq = self.sq.pop(entry.name, torch.zeros(6, dtype=torch.float64)).sqrt()
        rtol = _CHECK_RTOL.get(dtype, 1e-4)
        for found, (err, ref_norm, got_norm) in ((self.errors, sq[:3]), (self.row_errors, sq[3:])):
            scale = max(float(ref_norm), float(got_norm), self.floor)
            if float(err) > rtol * scale:
                found.append((entry.name, float(err) / scale))
                self.rtol = rtol

    def compare(self, entry: TensorEntry, block: Tensor) -> None:
        """Check ``entry``'s whole per-sample block (B, numel) float32 and drop its reference."""
        self.add(entry, 0, block)
        self.close(entry)

    def raise_first(self) -> None:
        """Raise one error naming every mismatch found (the first in full), if any: of the sums, else of sample j's
        rows."""
        if self.errors:
            (name, rel), rest = self.errors[0], self.errors[1:]
            what = (
                "the summed per-sample gradient differs from the batched gradient",
                "its module's forward does not match the per-sample rule, or the parameter is used where no rule "
                "sees it",
            )
        elif self.row_errors:
            (name, rel), rest = self.row_errors[0], self.row_errors[1:]
            what = (
                f"sample {self.j}'s per-sample row differs from the gradient of its own objective",
                "another sample's objective reaches its row (the samples mix where no probe located it) or its "
                "module's forward does not match the per-sample rule",
            )
        else:
            return
        also = "; also for " + ", ".join(f"{n!r} ({r:.3g})" for n, r in rest) if rest else ""
        raise ValueError(
            f"self-check failed for parameter {name!r}: {what[0]} by {rel:.3g} (relative, tolerance "
            f"{self.rtol:g}); {what[1]}{also}"
        )


def _entry_columns(entry: TensorEntry, g: Tensor | None) -> Tensor | None:
    """The flat columns of a whole-tensor gradient ``g`` that ``entry`` holds (its rows of a row-cut tensor)."""
    if g is None:
        return None
    flat = g.detach().reshape(entry.full_shape[0] if entry.shape else 1, -1)
    return flat[entry.rows[0] : entry.rows[1]].reshape(-1)
