"""Which parameters changed between two checkpoints, in the two metrics of Mukherjee et al. 2025.

``diff_state_dicts`` compares two state dicts tensor by tensor: exact inequality in the stored dtype
(bf16 against bf16, as their ``check_sparsity.py`` does) and ``|Δ| > atol`` with Δ taken in float32.
Checkpoints of different floating dtypes are one model: each tensor is compared in the *after* checkpoint's
stored dtype, the before tensor rounded to it (a bf16 checkpoint against a float32 start: changed means
bf16(start) != checkpoint). Unlike that script it weights global fractions by numel and lists every tensor it
cannot compare (present on one side only, of another shape, or not floating in another dtype) instead of
skipping it.

Optionally it measures how well predicted masks on the flat parameter axis (``covgrad.layout``)
match the changed set: precision, recall and Jaccard of each mask against the changed parameters.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from covgrad.layout import ParamLayout
from covgrad.updates.check import set_metrics
from covgrad.updates.tracking import count

CHUNK = 1 << 24  # elements per comparison block: bounds the float32 copies of a large tensor


def diff_state_dicts(
    before: Mapping[str, torch.Tensor],
    after: Mapping[str, torch.Tensor],
    atol: float = 1e-5,
    masks: Mapping[str, np.ndarray] | None = None,
    layout: ParamLayout | None = None,
) -> dict:
    """Per-tensor and global changed counts between two state dicts.

    A tensor is *comparable* when both sides hold it with the same shape and either the same dtype or two
    floating dtypes (then compared in the after side's dtype, the before tensor rounded to it); every other
    name is listed in ``mismatched`` (name, before_shape, after_shape, before_dtype, after_dtype; None for a
    missing side). Two checkpoints of different architectures (fewer than half of all names comparable,
    e.g. no common names) raise ValueError naming the first mismatched tensor.

    Returns ``tensors`` (one row per comparable tensor, in ``before`` order: name, shape, dtype (the dtype
    compared in: the after side's), before_dtype, numel, changed_exact, changed_abs, frac_exact, frac_abs),
    the global numel-weighted ``numel``,
    ``changed_exact``, ``changed_abs``, ``frac_exact``, ``frac_abs``, ``atol`` and ``mismatched``.
    With ``masks`` (name -> bool array of shape (P,)) and ``layout``, also ``overlap``:
    mask name -> {"exact": set_metrics(mask, changed), "abs": ...} over the layout's P parameters.
    """
    if not (math.isfinite(atol) and atol >= 0):
        raise ValueError(f"atol {atol!r} must be a finite number >= 0")
    if masks is not None and layout is None:
        raise ValueError("masks need the layout they are defined on; pass layout=")
    names = list(before) + [n for n in after if n not in before]
    if not names:
        raise ValueError("both state dicts are empty; nothing to compare")
    for side, sd in (("before", before), ("after", after)):
        for name, t in sd.items():
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{side}[{name!r}] is a {type(t).__name__}, not a tensor")

    comparable = [n for n in names if n in before and n in after and _same_kind(before[n], after[n])]
    comparable_set = set(comparable)
    mismatched = [_mismatch_row(n, before.get(n), after.get(n)) for n in names if n not in comparable_set]
    if 2 * len(comparable) < len(names):
        first = mismatched[0]
        raise ValueError(
            f"the checkpoints look like different architectures: only {len(comparable)} of {len(names)} "
            f"tensors are comparable (one name and shape, floating or one dtype); first mismatch {first['name']!r}: "
            f"before {first['before_shape']} {first['before_dtype']}, "
            f"after {first['after_shape']} {first['after_dtype']}"
        )

    rows = []
    changed_masks: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    layout_names = {e.name for e in layout.entries} if masks is not None and layout is not None else set()
    for name in comparable:
        exact, absolute = _changed(before[name], after[name], atol)
        numel = before[name].numel()
        n_exact, n_abs = count(exact), count(absolute)
        rows.append(
            {
                "name": name,
                "shape": tuple(before[name].shape),
                "dtype": str(after[name].dtype).removeprefix("torch."),
                "before_dtype": str(before[name].dtype).removeprefix("torch."),
                "numel": numel,
                "changed_exact": n_exact,
                "changed_abs": n_abs,
                "frac_exact": n_exact / numel if numel else float("nan"),
                "frac_abs": n_abs / numel if numel else float("nan"),
            }
        )
        if name in layout_names:
            changed_masks[name] = (exact, absolute)

    numel = sum(r["numel"] for r in rows)
    changed_exact = sum(r["changed_exact"] for r in rows)
    changed_abs = sum(r["changed_abs"] for r in rows)
    out = {
        "tensors": rows,
        "numel": numel,
        "changed_exact": changed_exact,
        "changed_abs": changed_abs,
        "frac_exact": changed_exact / numel if numel else float("nan"),
        "frac_abs": changed_abs / numel if numel else float("nan"),
        "atol": atol,
        "mismatched": mismatched,
    }
    if masks is not None and layout is not None:
        out["overlap"] = _overlap(masks, layout, changed_masks)
    return out


def _same_kind(a: torch.Tensor, b: torch.Tensor) -> bool:
    """One shape, and one dtype or two floating ones (compared in the after side's)."""
    return a.shape == b.shape and (a.dtype == b.dtype or (a.is_floating_point() and b.is_floating_point()))


def _mismatch_row(name: str, b: torch.Tensor | None, a: torch.Tensor | None) -> dict:
    return {
        "name": name,
        "before_shape": None if b is None else tuple(b.shape),
        "after_shape": None if a is None else tuple(a.shape),
        "before_dtype": None if b is None else str(b.dtype).removeprefix("torch."),
        "after_dtype": None if a is None else str(a.dtype).removeprefix("torch."),
    }


def _changed(b: torch.Tensor, a: torch.Tensor, atol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat bool masks (numel,): a != b in a's stored dtype (b rounded to it), and |float32(a) - float32(b')| >
    atol with b' that rounding of b."""
    b_flat, a_flat = b.detach().reshape(-1), a.detach().reshape(-1)
    exact = torch.empty(b_flat.numel(), dtype=torch.bool)
    absolute = torch.empty(b_flat.numel(), dtype=torch.bool)
    for lo in range(0, b_flat.numel(), CHUNK):
        bs, as_ = b_flat[lo : lo + CHUNK].to(a_flat.dtype), a_flat[lo : lo + CHUNK]
        exact[lo : lo + CHUNK] = as_ != bs
        absolute[lo : lo + CHUNK] = (as_.float() - bs.float()).abs() > atol
    return exact, absolute


def _overlap(
    masks: Mapping[str, np.ndarray],
    layout: ParamLayout,
    changed: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
) -> dict[str, dict[str, dict[str, float]]]:
    """set_metrics of every (P,) mask against the changed sets flattened in layout order."""
    for e in layout.entries:
        if e.name not in changed:
            raise ValueError(f"layout tensor {e.name!r} is not comparable in both checkpoints; masks cannot be scored")
        if changed[e.name][0].numel() != e.numel:
            raise ValueError(f"layout tensor {e.name!r} has {e.numel} elements, the checkpoints have another count")
    exact = torch.cat([changed[e.name][0] for e in layout.entries])
    absolute = torch.cat([changed[e.name][1] for e in layout.entries])
    out = {}
    for name, mask in masks.items():
        if mask.dtype != np.bool_ or mask.shape != (layout.P,):
            raise ValueError(
                f"mask {name!r} is {mask.dtype} of shape {mask.shape}; it must be bool of shape ({layout.P},)"
            )
        pred = torch.from_numpy(np.ascontiguousarray(mask))
        out[name] = {"exact": set_metrics(pred, exact), "abs": set_metrics(pred, absolute)}
    return out
