"""Real optimizer steps against predicted update masks: the math of the update_check stage.

A *cell* trains a fresh copy of the model for a few REINFORCE steps on the loss
``-mean_n(A_n · log p(y_n))`` with one optimizer (SGD, Adam, AdamW) in one precision regime and
records which parameters changed, in the two metrics of Mukherjee et al. 2025: the bf16 value differs
from the bf16 start (exact), and ``|Δ| > 1e-5`` (float32). The changed sets are then compared with

- top-k sets by F, |G|, |ρ|, a seeded random set and the k smallest |w| (k = number changed, per metric);
- rule sets: the bf16 absorption rule (a step changes a bf16 weight only when it reaches half the bf16
  gap at w) with the step Adam or SGD would take, and, for SGD, the bound rule that replaces |G| by its
  Cauchy–Schwarz bound sqrt(mean A²)·sqrt(F). After one SGD step in fp32 arithmetic on the batch the
  statistics came from, the bound set contains every parameter whose bf16 value changed.

Every cell starts from the bf16 rounding of ``model_fn()``'s weights, in all three precision regimes: the
start is the same point for every cell, as a bf16 checkpoint loaded into each regime would be, and the
absorption rule is exact for a weight that lies on the bf16 grid.

Shapes: N samples per batch, L row length, V vocabulary, P selected parameter elements (``layout.P``).
Rows are right-padded (prompt, response, pad); logit position t predicts token t + 1.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from covgrad.devices import release_free_memory
from covgrad.layout import ParamLayout, parameters_flat
from covgrad.moments.topk import top_k_masks
from covgrad.updates.stepping import (
    ADAM_EPS,
    OPTIMIZERS,
    PRECISIONS,
    FixedBatches,
    OptimizerSpec,
    StepLoss,
    Stepper,
    bf16_rounded,
)
from covgrad.updates.stepping import BATCH_KEYS as BATCH_KEYS
from covgrad.updates.stepping import sequence_logp as sequence_logp
from covgrad.updates.tracking import bf16_half_spacing as bf16_half_spacing
from covgrad.updates.tracking import count, count_metrics
from covgrad.updates.tracking import set_metrics as set_metrics

ABS_THRESHOLD = 1e-5  # the |Δ| metric of Mukherjee et al. 2025
RANKED_PREDICTORS = ("F", "absG", "absrho", "random", "smallw")
METRICS = ("bf16", "abs")
# the grid columns of the markdown table, after "regime" when the grid has regime cells
GRID_MD_COLUMNS = (
    "optimizer",
    "precision",
    "lr",
    "steps",
    "frac_changed_bf16",
    "frac_changed_abs",
    *(f"bf16_{p}_jaccard" for p in RANKED_PREDICTORS),
    "bf16_absorb_recall",
    "bf16_absorb_precision",
    "bf16_bound_recall",
    "bf16_bound_precision",
)
RULES = ("absorb", "bound")
CHUNK = 1 << 24  # parameters per elementwise step over the flat axis: bounds the float64 temporaries
SET_STATS = ("precision", "recall", "jaccard", "size")

# A (P,) statistic, or a function that loads it: update_grid loads each one when a predictor needs it and
# drops it after, so a large P holds at most one statistic at a time.
Stat = torch.Tensor | Callable[[], torch.Tensor]


def mask_from_order(order: torch.Tensor, k: int) -> torch.Tensor:
    """(P,) bool mask of the first ``k`` indices of ``order``."""
    mask = torch.zeros(order.numel(), dtype=torch.bool)
    mask[order[:k]] = True
    return mask


def rule_masks(
    start: torch.Tensor,
    F: torch.Tensor,
    G: torch.Tensor,
    adv_rms: float,
    optimizer: str,
    lr: float,
    steps: int,
) -> dict[str, torch.Tensor]:
    """Rule-based predicted changed sets, (P,) bool each, for weights ``start`` on the bf16 grid.

    A parameter is predicted to change when ``steps`` times its first-step size reaches
    ``bf16_half_spacing(start)``. First-step sizes: Adam/AdamW ``lr·|G|/(|G| + eps)`` (bias-corrected
    first step; AdamW's decay ``lr·wd·|w|`` is far below the bf16 gap and is left out); SGD ``lr·|G|``
    ("absorb") and the bound ``lr·adv_rms·sqrt(F)`` ("bound", SGD only), where ``adv_rms`` is
    sqrt(mean A²) of the samples F = mean(s²) and G = mean(A·s) were estimated on (std(A) for centred
    advantages), so ``|G| <= adv_rms·sqrt(F)``. Scaling by ``steps`` assumes a constant gradient; it is
    exact only for ``steps == 1``.
    """
    _check_optimizer(optimizer)
    masks = {"absorb": _rule_mask("absorb", start, G, adv_rms, optimizer, lr, steps)}
    if optimizer == "sgd":
        masks["bound"] = _rule_mask("bound", start, F, adv_rms, optimizer, lr, steps)
    return masks


def _rule_mask(
    rule: str, start: torch.Tensor, stat: torch.Tensor, adv_rms: float, optimizer: str, lr: float, steps: int
) -> torch.Tensor:
    """One rule of :func:`rule_masks` from the one statistic it reads: G for ``absorb``, F for ``bound``."""
    half = bf16_half_spacing(start).double()
    if rule == "bound":
        return steps * (lr * adv_rms * stat.double().clamp(min=0).sqrt()) >= half
    absG = stat.double().abs()
    if optimizer == "sgd":
        return steps * lr * absG >= half
    return steps * lr * absG / (absG + ADAM_EPS) >= half


def matched_sgd_lr(start: torch.Tensor, G: torch.Tensor, adam_lr: float) -> float:
    """The SGD lr whose absorption rule predicts as many changed parameters as Adam's does at ``adam_lr``.

    With ratios r_i = half_spacing_i / |G_i|, SGD's rule predicts {i : r_i <= lr}; the result is the k-th
    smallest r_i, k = the Adam rule's count for one step (at least 1). ``start`` and ``G`` are (P,).
    """
    absG = G.double().abs()
    if not bool((absG > 0).any()):
        raise ValueError("matched_sgd_lr: G is zero everywhere, so no SGD learning rate changes a parameter")
    half = bf16_half_spacing(start).double()
    k = count(adam_lr * absG / (absG + ADAM_EPS) >= half)
    ratios = (half / absG)[absG > 0]
    return float(torch.kthvalue(ratios, min(max(k, 1), ratios.numel())).values)


def run_update_cell(
    model_fn: Callable[[], nn.Module],
    layout: ParamLayout,
    batches: Sequence[Mapping[str, torch.Tensor]],
    optimizer: str,
    precision: str,
    lr: float,
    steps: int,
    fresh_minibatches: bool,
    loss: StepLoss | None = None,
) -> dict:
    """Train a fresh model for ``steps`` steps of ``loss`` (None: the rl REINFORCE loss) and report which
    selected parameters changed.

    ``model_fn`` builds the model (deterministically); its weights are rounded to bf16 to make the start.
    ``batches``: dicts with ``input_ids``, ``attention_mask``, ``response_mask`` (N, L) and
    ``advantages`` (N,). Step i (from 0) uses ``batches[i % len(batches)]`` when ``fresh_minibatches``,
    else ``batches[0]``. Loss: ``-mean_n(A_n · log p(y_n))``.

    Precision regimes: ``bf16`` parameters, gradients and optimizer state in bf16; ``fp32_master``
    forward and backward on a bf16 copy, gradients cast to float32, the optimizer steps float32 master
    weights, and the analysed model is the master cast to bf16; ``fp32`` everything in float32.

    Returns ``start`` and ``end`` (P,) float32 (the analysed model's values), ``changed_bf16``
    (bf16(end) != bf16(start)) and ``changed_abs`` (|end - start| > 1e-5 in float32), (P,) bool, and
    ``per_tensor``: one dict per layout entry with name, numel, changed_bf16, changed_abs counts.
    """
    snapshots = _train(model_fn, layout, batches, optimizer, precision, lr, (steps,), fresh_minibatches, loss)
    start = parameters_flat(next(snapshots)[1], layout).float()
    end = parameters_flat(next(snapshots)[1], layout).float()
    return {"start": start, "end": end, **changed_sets(layout, start, end)}


def changed_sets(layout: ParamLayout, start: torch.Tensor, end: torch.Tensor) -> dict:
    """The changed masks of (P,) values ``start`` -> ``end`` and per-tensor counts (see run_update_cell)."""
    changed_bf16 = start.to(torch.bfloat16) != end.to(torch.bfloat16)
    changed_abs = (end.float() - start.float()).abs() > ABS_THRESHOLD
    per_tensor = [
        {
            "name": e.name,
            "numel": e.numel,
            "changed_bf16": count(changed_bf16[e.offset : e.offset + e.numel]),
            "changed_abs": count(changed_abs[e.offset : e.offset + e.numel]),
        }
        for e in layout.entries
    ]
    return {"changed_bf16": changed_bf16, "changed_abs": changed_abs, "per_tensor": per_tensor}


def update_grid(
    model_fn: Callable[[], nn.Module],
    layout: ParamLayout,
    batches: Sequence[Mapping[str, torch.Tensor]],
    F: Stat,
    G: Stat,
    rho: Stat,
    adv_rms: float,
    *,
    optimizers: Sequence[str] = ("adam", "sgd"),
    precisions: Sequence[str] = PRECISIONS,
    adam_lrs: Sequence[float] = (1e-6, 1e-5),
    sgd_lrs: Sequence[float] | None = None,
    steps: Sequence[int] = (1, 4, 16),
    fresh_minibatches: bool = True,
    seed: int = 0,
    loss: StepLoss | None = None,
) -> list[dict]:
    """Run every (optimizer, precision, lr) cell once for max(steps) steps, snapshotting at each of ``steps``.

    ``F``, ``G``, ``rho``: (P,) statistics from the stats stage (F = mean(s²), G = mean(A·s), ρ), each a
    tensor or a function that loads it; ``adv_rms``: sqrt(mean A²) of the samples they came from. Adam and
    AdamW use ``adam_lrs``; SGD uses ``sgd_lrs`` or, when None, ``matched_sgd_lr`` of each Adam lr (a
    comparable changed fraction). ``loss``: the regime's loss every cell steps (None: rl's REINFORCE loss);
    for another regime, G and ρ are that regime's and ``adv_rms`` its bound scalar a (NaN: no bound rule).

    Memory (P = 134.5M in float32 is 0.54 GB per (P,) float32 vector): every cell trains first, keeping
    only its changed sets, bit-packed (P/8 bytes each); the predictors are evaluated after, one at a time
    (one statistic loaded, exact top-k sets by ``covgrad.moments.topk.top_k_masks``), and the rules in chunks of
    the flat axis, so no (P,) int64 order and no two statistics are held at once.

    Returns one flat row per (optimizer, precision, lr, steps): the cell parameters, ``P``,
    ``n_changed_{m}`` and ``frac_changed_{m}`` (global, i.e. numel-weighted) for m in (bf16, abs), and
    ``{m}_{predictor}_{precision|recall|jaccard|size}`` for the ranked predictors F, absG, absrho,
    random, smallw (each of size k = n_changed_{m}) and the rules absorb and, for SGD, bound.
    """
    for opt in optimizers:
        _check_optimizer(opt)
    if not steps or min(steps) < 1:
        raise ValueError(f"update_grid: steps must be a non-empty list of positive step counts, got {list(steps)}")
    start = _bf16_start(model_fn, layout)
    if sgd_lrs is None:
        G_values = _stat("G", G, layout.P)
        sgd_lrs = [matched_sgd_lr(start, G_values, lr) for lr in adam_lrs]
        del G_values
    rows: list[dict] = []
    changed: list[dict[str, np.ndarray]] = []  # per row: metric -> packed (P,) changed mask
    for optimizer, precision in itertools.product(optimizers, precisions):
        for lr in sgd_lrs if optimizer == "sgd" else adam_lrs:
            snapshots = _train(model_fn, layout, batches, optimizer, precision, lr, steps, fresh_minibatches, loss)
            if not _equal_on_layout(next(snapshots)[1], layout, start):
                raise ValueError("update_grid: model_fn built different weights on two calls; seed it inside model_fn")
            for n_steps, work in snapshots:
                masks = _changed_masks(work, layout, start)
                row = {
                    "optimizer": optimizer,
                    "precision": precision,
                    "lr": lr,
                    "steps": n_steps,
                    "fresh_minibatches": fresh_minibatches,
                    "P": layout.P,
                }
                for metric in METRICS:
                    k = count(masks[metric])
                    row[f"n_changed_{metric}"] = k
                    row[f"frac_changed_{metric}"] = k / layout.P
                    names = (*RANKED_PREDICTORS, *(RULES if optimizer == "sgd" and adv_rms == adv_rms else RULES[:1]))
                    row.update({f"{metric}_{name}_{stat}": None for name in names for stat in SET_STATS})
                rows.append(row)
                changed.append({m: np.packbits(masks[m].numpy()) for m in METRICS})
            del snapshots, work, masks
            release_free_memory()  # the cell's model, gradients and optimizer state, before the next cell
    _score_ranked(rows, changed, start, F, G, rho, seed, layout.P)
    _score_rules(rows, changed, start, F, G, adv_rms, layout.P)
    return rows


def rl_minibatches(batches: Sequence[Mapping[str, torch.Tensor]]) -> tuple[list[Mapping[str, torch.Tensor]], list[int]]:
    """The minibatches the rl cells step: those whose ``advantages`` are not all zero, and the indices of
    the others (the rl loss ``-mean_n(A_n · log p(y_n))`` of a minibatch with A ≡ 0 has gradient exactly 0,
    so a step on it is no update, as DAPO's dynamic sampling drops prompt groups with equal rewards).

    Returns:
        (kept minibatches in their order, dropped indices); every minibatch when all have A ≡ 0 (the stats
        stage reports that run as degenerate).
    """
    dropped = [i for i, b in enumerate(batches) if not bool(torch.as_tensor(b["advantages"]).ne(0).any())]
    if len(dropped) == len(batches):
        return list(batches), []
    skip = set(dropped)
    return [b for i, b in enumerate(batches) if i not in skip], dropped


def _stat(name: str, stat: Stat, P: int) -> torch.Tensor:
    """The (P,) statistic ``stat`` (loaded when it is a function)."""
    values = stat() if callable(stat) else stat
    if values.shape != (P,):
        raise ValueError(f"update_grid: {name} has shape {tuple(values.shape)}, expected ({P},) = layout.P")
    return values


def _unpacked(packed: np.ndarray, P: int) -> torch.Tensor:
    """A (P,) bool mask from its ``np.packbits`` form."""
    return torch.from_numpy(np.unpackbits(packed, count=P).view(np.bool_))


def _score_ranked(
    rows: list[dict],
    changed: list[dict[str, np.ndarray]],
    start: torch.Tensor,
    F: Stat,
    G: Stat,
    rho: Stat,
    seed: int,
    P: int,
) -> None:
    """Fill the ranked predictors' set metrics of every row and metric: the top-k sets by F, |G|, |ρ|
    (descending), a seeded random permutation and |w| ascending, k = the row's changed count."""
    cases = [(i, m) for i in range(len(rows)) for m in METRICS]
    ks = [rows[i][f"n_changed_{m}"] for i, m in cases]

    def masks(name: str) -> Iterator[torch.Tensor]:  # owns its predictor's values: freed when exhausted
        if name == "random":
            order = torch.randperm(P, generator=torch.Generator().manual_seed(seed))
            yield from (mask_from_order(order, k) for k in ks)
            return
        if name == "smallw":
            values, largest = start.abs(), False
        elif name == "F":
            values, largest = _stat("F", F, P), True
        else:
            stat = G if name == "absG" else rho
            values, largest = _stat(name[3:], stat, P), True
            values = values.abs_() if callable(stat) else values.abs()  # a loaded statistic is ours to overwrite
        yield from (torch.from_numpy(m) for m in top_k_masks(values.numpy(), ks, largest))

    for name in RANKED_PREDICTORS:
        for (i, metric), pred in zip(cases, masks(name), strict=True):
            true = _unpacked(changed[i][metric], P)
            for stat, value in set_metrics(pred, true).items():
                rows[i][f"{metric}_{name}_{stat}"] = value


def _score_rules(
    rows: list[dict],
    changed: list[dict[str, np.ndarray]],
    start: torch.Tensor,
    F: Stat,
    G: Stat,
    adv_rms: float,
    P: int,
) -> None:
    """Fill the rules' set metrics of every row (:func:`rule_masks`, rule by rule with the one statistic
    each reads loaded): the rule's mask and the changed masks are built and counted in chunks of the flat
    axis, so no (P,) mask is held."""
    for rule, name, stat in (("absorb", "G", G), ("bound", "F", F)):
        values = _stat(name, stat, P)
        for row, packed in zip(rows, changed, strict=True):
            if rule == "bound" and (row["optimizer"] != "sgd" or adv_rms != adv_rms):
                continue
            args = (adv_rms, row["optimizer"], row["lr"], row["steps"])
            n_pred, n_true, n_both = 0, dict.fromkeys(METRICS, 0), dict.fromkeys(METRICS, 0)
            for lo in range(0, P, CHUNK):  # CHUNK is a multiple of 8: each chunk starts on a packed byte
                c = slice(lo, min(lo + CHUNK, P))
                pred = _rule_mask(rule, start[c], values[c], *args)
                n_pred += count(pred)
                for metric in METRICS:
                    true = _unpacked(packed[metric][lo // 8 : (c.stop + 7) // 8], c.stop - lo)
                    n_true[metric] += count(true)
                    n_both[metric] += count(pred & true)
            for metric in METRICS:
                for key, value in count_metrics(n_pred, n_true[metric], n_both[metric]).items():
                    row[f"{metric}_{rule}_{key}"] = value
        del values


def _equal_on_layout(model: nn.Module, layout: ParamLayout, values: torch.Tensor) -> bool:
    """Whether the model's selected parameters, as float32, equal the (P,) float32 ``values``."""
    params = dict(model.named_parameters())
    return all(
        torch.equal(params[e.name].detach().reshape(-1).float(), values[e.offset : e.offset + e.numel])
        for e in layout.entries
    )


def _changed_masks(model: nn.Module, layout: ParamLayout, start: torch.Tensor) -> dict[str, torch.Tensor]:
    """``changed_sets``' masks of (P,) ``start`` -> the model's selected parameters, filled in chunks of at
    most CHUNK elements of each tensor (no (P,) or whole-tensor float32 copy): metric -> (P,) bool."""
    params = dict(model.named_parameters())
    masks = {m: torch.empty(layout.P, dtype=torch.bool) for m in METRICS}
    for e in layout.entries:
        flat = params[e.name].detach().reshape(-1)
        for lo in range(0, e.numel, CHUNK):
            cols = slice(e.offset + lo, e.offset + min(lo + CHUNK, e.numel))
            end = flat[lo : lo + CHUNK].float()
            torch.ne(start[cols].to(torch.bfloat16), end.to(torch.bfloat16), out=masks["bf16"][cols])
            torch.gt((end - start[cols]).abs_(), ABS_THRESHOLD, out=masks["abs"][cols])
    return masks


def _train(
    model_fn: Callable[[], nn.Module],
    layout: ParamLayout,
    batches: Sequence[Mapping[str, torch.Tensor]],
    optimizer: str,
    precision: str,
    lr: float,
    snapshots: Sequence[int],
    fresh_minibatches: bool,
    loss: StepLoss | None = None,
) -> Iterator[tuple[int, nn.Module]]:
    """One run of max(snapshots) steps of ``loss`` on fixed batches (``covgrad.updates.stepping.Stepper`` with
    ``FixedBatches``): yields (0, model) at the start, then (n, model) after each snapshot step n, in
    order; the model is the analysed one (its parameters change once the generator resumes)."""
    _check_optimizer(optimizer)
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {PRECISIONS}")
    if not lr > 0:
        raise ValueError(f"learning rate {lr!r} must be positive")
    if not snapshots or min(snapshots) < 1:
        raise ValueError(f"step counts must be positive integers, got {list(snapshots)}")
    loss = StepLoss() if loss is None else loss
    source = FixedBatches(batches, fresh_minibatches, loss.needs)
    stepper = Stepper(_bf16_rounded_model(model_fn, layout), OptimizerSpec(optimizer, lr), precision, loss)
    yield 0, stepper.model
    for step in range(1, max(snapshots) + 1):
        stepper.backward(source.batch(step, stepper.model))
        stepper.update()
        if step in snapshots:
            yield step, stepper.model


def _bf16_rounded_model(model_fn: Callable[[], nn.Module], layout: ParamLayout) -> nn.Module:
    """``model_fn()`` in eval mode, every parameter rounded to bf16 (dtype kept); checks the layout fits."""
    return bf16_rounded(model_fn(), layout)


def _bf16_start(model_fn: Callable[[], nn.Module], layout: ParamLayout) -> torch.Tensor:
    """The common (P,) float32 start of every cell: bf16(model_fn()) on the layout."""
    return parameters_flat(_bf16_rounded_model(model_fn, layout), layout).float()


def _check_optimizer(optimizer: str) -> None:
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer {optimizer!r} is not one of {OPTIMIZERS}")


def summarize(rows: list[dict[str, Any]], one_batch: bool) -> dict[str, Any]:
    """The update check's summary of its grid ``rows``, per cell at one step: changed fraction (bf16 metric),
    best ranked predictor against random, rule recall."""
    cells = []
    for r in rows:
        if r["steps"] != 1:
            continue
        ranked = {p: r[f"bf16_{p}_jaccard"] for p in RANKED_PREDICTORS if p != "random"}
        finite = {p: v for p, v in ranked.items() if not math.isnan(v)}
        best = max(finite, key=lambda p: finite[p]) if finite else None
        cell = {"regime": r["regime"]} if "regime" in r else {}
        cell |= {
            "optimizer": r["optimizer"],
            "precision": r["precision"],
            "lr": r["lr"],
            "frac_changed_bf16": r["frac_changed_bf16"],
            "frac_changed_abs": r["frac_changed_abs"],
            "best_predictor": best,
            "best_jaccard": finite[best] if best else float("nan"),
            "random_jaccard": r["bf16_random_jaccard"],
            "absorb_recall": r["bf16_absorb_recall"],
            "absorb_precision": r["bf16_absorb_precision"],
        }
        if r["optimizer"] == "sgd":
            cell["bound_recall"] = r["bf16_bound_recall"]
            cell["bound_precision"] = r["bf16_bound_precision"]
        cells.append(cell)
    return {"one_minibatch_holds_all_samples": one_batch, "cells_at_one_step": cells}
