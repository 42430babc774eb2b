"""Which parameters each step of a trajectory changes, and how well step-0 predictors said so.

:class:`ChangeTracker` records per step the changed set in the stored dtype (exact inequality, bit-packed) and
its new values, counts at |Δ| thresholds, sign flips, and how well step-0 predictors (top-k by F, |G|, |ρ|, the
Adam drift c/h, smallest |w|, random, per-tensor random; the absorption, bound and drift rules) match the
per-step and cumulative changed sets, globally and within |w_0| deciles. With several trackers (a model sharded
over ranks, :class:`TrackerShard`) each keeps its columns and every count is summed over them.

Shapes: P selected parameter elements (``layout.P``), n the tracker's columns, E layout tensors.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch

from covgrad.layout import ParamLayout
from covgrad.updates.stepping import ADAM_EPS, OptimizerSpec

THRESHOLDS = (0.0, 1e-8, 1e-6, 1e-5, 1e-4)  # |Δ| > threshold counts, Δ in float32


SCOPES = ("step", "cum")  # the step's changed set (w_t != w_{t-1}) and the cumulative one (w_t != w_0)


RANKED = ("F", "absG", "absrho", "drift", "smallw", "random", "tensor_random")


DECILE_PREDICTORS = ("F", "absG", "absrho", "drift", "random")


RULES = ("absorb", "bound", "drift")


SET_STATS = ("precision", "recall", "jaccard", "size")


N_DECILES = 10


def bf16_half_spacing(w: torch.Tensor) -> torch.Tensor:
    """Half the gap from ``bf16(w)`` to its nearest bf16 neighbour, float32, same shape as ``w``.

    A step smaller than this cannot change a bf16 value under round-to-nearest-even; a step of at
    least this much can (toward the nearer neighbour). Exact, from the bf16 bit pattern:

    - normal, ``2**e <= |w| < 2**(e+1)``: the spacing is ``2**(e-7)``, half of it ``2**(e-8)``;
      at an exact power of two above the smallest normal the gap toward zero is half the gap away
      from zero, so the result there is ``2**(e-9)``;
    - zero, subnormals and the smallest normal ``2**-126``: the spacing is ``2**-133``, half ``2**-134``.

    ``w`` is any floating tensor; it is first rounded to bf16 (round-to-nearest-even).
    """
    if not w.is_floating_point():
        raise ValueError(f"bf16_half_spacing needs a floating tensor, got dtype {w.dtype}")
    wb = w.detach().to(torch.bfloat16)
    if not torch.isfinite(wb).all():
        raise ValueError("bf16_half_spacing: bf16(w) has inf or NaN entries; pass finite weights within bf16 range")
    bits = wb.view(torch.int16).to(torch.int32) & 0x7FFF  # magnitude bits: 8 exponent, 7 mantissa
    biased = bits >> 7
    mantissa = bits & 0x7F
    exponent = biased.clamp(min=1) - 127 - 8  # half of the binade spacing 2**(e - 7)
    exponent = exponent - ((mantissa == 0) & (biased >= 2)).to(torch.int32)
    return torch.exp2(exponent.to(torch.float64)).to(torch.float32)


def half_spacing(w: torch.Tensor) -> torch.Tensor:
    """Half the gap from ``w`` to its nearest neighbour in ``w``'s own dtype (bf16 or float32), float64.

    bf16: :func:`bf16_half_spacing`. float32: ``min(nextafter(w, +inf) - w, w - nextafter(w, -inf)) / 2``.
    """
    if w.dtype == torch.bfloat16:
        return bf16_half_spacing(w).double()
    if w.dtype != torch.float32:
        raise ValueError(f"half_spacing handles bf16 and float32 weights, got {w.dtype}")
    up = torch.nextafter(w, torch.tensor(math.inf)).double() - w.double()
    down = w.double() - torch.nextafter(w, torch.tensor(-math.inf)).double()
    return torch.minimum(up, down) / 2


def value_bits(values: torch.Tensor) -> np.ndarray:
    """(n,) the raw bits of bf16 (uint16) or float32 (uint32) values: stored-dtype values compared and saved
    exactly (numpy has no bfloat16)."""
    if values.dtype == torch.bfloat16:
        return values.view(torch.int16).numpy().view(np.uint16)
    if values.dtype == torch.float32:
        return values.view(torch.int32).numpy().view(np.uint32)
    raise ValueError(f"value_bits handles bf16 and float32 weights, got {values.dtype}")


def count(mask: torch.Tensor) -> int:
    """The True elements of a bool tensor, without the int64 copy of the whole mask that ``mask.sum()`` makes
    (8 bytes per element: 2.1 GB for a (P,) mask of Gemma 3 270M)."""
    return int(torch.count_nonzero(mask))


def set_metrics(pred: torch.Tensor, true: torch.Tensor) -> dict[str, float]:
    """Precision |pred ∩ true|/|pred|, recall |pred ∩ true|/|true|, Jaccard |∩|/|∪| and size |pred|.

    ``pred`` and ``true`` are bool tensors of one shape. A ratio whose denominator is 0 is NaN.
    """
    if pred.dtype != torch.bool or true.dtype != torch.bool:
        raise ValueError(f"set_metrics needs bool masks, got {pred.dtype} and {true.dtype}")
    if pred.shape != true.shape:
        raise ValueError(f"set_metrics: mask shapes differ, pred {tuple(pred.shape)} vs true {tuple(true.shape)}")
    return count_metrics(count(pred), count(true), count(pred & true))


@dataclass(frozen=True)
class StepZeroStats:
    """Step-0 predictors: F, G, ρ (P,) from the stats stage of the start policy, the seed of the random
    baselines, and B = ``samples_per_step``, the rows each optimizer step averages over (0: unknown; the
    Adam drift predictor, :func:`sign_consistency`, needs it)."""

    F: np.ndarray
    G: np.ndarray
    rho: np.ndarray
    seed: int = 0
    samples_per_step: int = 0


MAX_CROSSINGS = float(1 << 30)  # the drift model's crossing count saturates here (weights of 0 have h ≈ 1e-40)
RANDOM_CHUNK = 1 << 24  # values drawn per call by random_values


def random_values(seed: int, P: int, index: np.ndarray | None = None) -> np.ndarray:
    """The random predictor's values, float32: ``np.random.default_rng([seed, 0]).random(P)`` at the columns
    ``index`` ((n,) int64, ascending; None: all P), drawn in chunks of RANDOM_CHUNK so that a shard of a large
    model never holds all P (numpy's stream does not depend on how the draws are split)."""
    rng = np.random.default_rng([seed, 0])
    if index is None:
        return rng.random(P, dtype=np.float32)
    out = np.empty(index.shape[0], dtype=np.float32)
    at = 0
    for lo in range(0, P, RANDOM_CHUNK):
        hi = min(P, lo + RANDOM_CHUNK)
        chunk = rng.random(hi - lo, dtype=np.float32)
        n = int(np.searchsorted(index, hi)) - at
        out[at : at + n] = chunk[index[at : at + n] - lo]
        at += n
    return out


def _ranked_values(
    stats: StepZeroStats | None, start: torch.Tensor, seed: int, P: int, index: np.ndarray | None
) -> dict[str, tuple[np.ndarray, bool]]:
    """Predictor name -> ((n,) values at the tracker's columns, largest first?) of the ranked predictors: |w|
    and the seeded random values in float32, the statistics (already at those columns) in their own floating
    dtype."""
    n = start.numel()
    out = {
        "smallw": (start.float().abs().numpy(), False),
        "random": (random_values(seed, P, index), True),
    }
    if stats is not None:
        for name, v in (("F", stats.F), ("absG", np.abs(stats.G)), ("absrho", np.abs(stats.rho))):
            values = np.asarray(v).reshape(-1)
            if values.shape != (n,) or values.dtype not in (np.float32, np.float64):
                raise ValueError(f"step-0 statistic {name} is {values.dtype} {values.shape}, expected float ({n},)")
            out[name] = (values, True)
    return out


def sign_consistency(rho: np.ndarray, samples: int) -> np.ndarray:
    """(n,) float64 c_i = E[ĝ_i] / √E[ĝ_i²] of a B-sample minibatch gradient ĝ, in [0, 1], from the step-0
    alignment ρ_i = G_i / (a·√F_i) (``rho`` (n,)) and B = ``samples``: with E[ĝ] = G, Var(ĝ) = Var(A·s_i)/B and
    Var(A·s_i) ≈ a²F_i − G_i² (A² and s_i² uncorrelated), c_i = |ρ_i| / √(ρ_i²(1 − 1/B) + 1/B). Adam's
    update m̂/√v̂ tends to c_i·sign(G_i) per step (docs/trajectory.md derives it). NaN ρ counts as 0."""
    if samples < 1:
        raise ValueError(f"the Adam drift predictor needs the samples per step (>= 1), got {samples}")
    r2 = np.nan_to_num(np.asarray(rho, dtype=np.float64).reshape(-1), nan=0.0) ** 2
    r2 = np.minimum(r2, 1.0)
    return np.sqrt(r2 / (r2 * (1.0 - 1.0 / samples) + 1.0 / samples))


def drift_reach(c: torch.Tensor, lr_sum: float, lr_sq_sum: float) -> torch.Tensor:
    """(n,) float64 the expected net displacement of an Adam coordinate after the steps so far, in weight
    units: √((Σ_j lr_j · c)² + Σ_j lr_j² · (1 − c²)), a drift of lr_j·c per step plus the random walk of
    the rest of the unit-variance update m̂/√v̂ (``c`` (n,) :func:`sign_consistency`)."""
    c = c.double()
    return torch.sqrt((lr_sum * c) ** 2 + lr_sq_sum * (1.0 - c * c))


def stable_ranks(values: np.ndarray, largest: bool = True) -> np.ndarray:
    """(n,) rank of every value in the order of ``covgrad.moments.topk.top_k_masks``: largest (or smallest) first,
    ties by the lowest index, NaN ranked worst (tied with −inf for the largest, +inf for the smallest), −0
    tied with +0; so ``ranks < k`` is exactly ``top_k_masks(values, [k], largest)``. int32 below 2**31
    values, else int64. ``values``: (n,) float32 or float64."""
    v = np.asarray(values, dtype=np.float64).reshape(-1)
    key = np.where(np.isnan(v), np.inf, -v if largest else v)
    order = np.argsort(key, kind="stable")
    ranks = np.empty(v.shape[0], dtype=np.int32 if v.shape[0] < 2**31 else np.int64)
    ranks[order] = np.arange(v.shape[0], dtype=ranks.dtype)
    return ranks


def group_ranks(values: np.ndarray, largest: bool = True, groups: np.ndarray | None = None) -> np.ndarray:
    """:func:`stable_ranks` within each group: (n,) the rank of every value among the values of its group
    (``groups`` (n,) int, None: one group), the order of :func:`stable_ranks` (ties by the lowest index)."""
    if groups is None:
        return stable_ranks(values, largest)
    v = np.asarray(values).reshape(-1)
    order = np.argsort(groups, kind="stable")
    ranks = np.empty(v.shape[0], dtype=np.int32 if v.shape[0] < 2**31 else np.int64)
    bounds = np.flatnonzero(np.diff(groups[order])) + 1
    for part in np.split(order, bounds):
        ranks[part] = stable_ranks(v[part], largest)
    return ranks


def count_metrics(n_pred: int, n_true: int, n_both: int) -> dict[str, float]:
    """:func:`set_metrics` from the counts |pred|, |true| and |pred ∩ true|."""
    n_union = n_pred + n_true - n_both
    return {
        "precision": n_both / n_pred if n_pred else float("nan"),
        "recall": n_both / n_true if n_true else float("nan"),
        "jaccard": n_both / n_union if n_union else float("nan"),
        "size": n_pred,
    }


# (values (n,), largest first?, groups (n,) int or None) -> (n,) int rank of each value within its group over
# every tracker's columns (group_ranks of the whole layout at these columns)
Ranker = Callable[[np.ndarray, bool, "np.ndarray | None"], np.ndarray]


@dataclass(frozen=True)
class TrackerShard:
    """The columns one :class:`ChangeTracker` of several keeps (a rank's shard of the layout,
    ``covgrad.distributed.stepper``) and how the trackers combine: ``total`` sums an int64 array over all of
    them (every tracker calls it in the same order), ``ranks`` ranks values over all their columns.

    Attributes:
        index: (n,) int64 global columns of the layout's flat axis, ascending; None: all of them.
    """

    index: np.ndarray | None
    total: Callable[[np.ndarray], np.ndarray]
    ranks: Ranker


WHOLE_LAYOUT = TrackerShard(None, lambda counts: counts, group_ranks)  # one tracker keeps every column


class ChangeTracker:
    """The per-step record of a trajectory (see :meth:`record`).

    ``start``: (n,) the analysed model's selected values at step 0 at the tracker's columns (``shard``; None:
    all P), stored dtype. ``stats``: step-0 F, G, ρ at the same columns for the F / |G| / |ρ| predictors and
    the bound rule (None: those are left out). ``optimizer``: which absorption rule applies. ``bound``:
    whether the regime has a bound (False for ``sft_sampled``: no bound rule).

    The ranked predictors are fixed for the whole run, so they are ranked once (globally, within each tensor
    for per-tensor random, within each |w_0| decile; over every shard's columns with ``shard.ranks``): a top-k
    set is then ``ranks < k``. With several shards every count is summed over them (``shard.total``, twice a
    step), so each shard's record is the whole layout's. Memory per column: 4 or 8 bytes for each of the 5
    global, 1 per-tensor and 4 decile rank arrays, the tensor and decile of each column (5 B), plus F in
    float64 for the SGD bound rule.
    """

    def __init__(
        self,
        layout: ParamLayout,
        start: torch.Tensor,
        optimizer: OptimizerSpec,
        stats: StepZeroStats | None = None,
        bound: bool = True,
        shard: TrackerShard | None = None,
    ) -> None:
        self.shard = WHOLE_LAYOUT if shard is None else shard
        index = self.shard.index
        n = layout.P if index is None else index.shape[0]
        if start.shape != (n,):
            raise ValueError(f"start has shape {tuple(start.shape)}, expected ({n},)")
        self.layout, self.spec, self.stats = layout, optimizer, stats
        self.start, self.prev = start.clone(), start.clone()
        self.counts = torch.zeros(n, dtype=torch.int32)  # steps that changed each coordinate
        self.last = torch.zeros(n, dtype=torch.bool)  # the previous step's changed set
        self.steps = 0  # steps recorded
        seed = 0 if stats is None else stats.seed
        values = _ranked_values(stats, start, seed, layout.P, index)
        self.rules = ("absorb", "bound") if optimizer.name == "sgd" and stats is not None and bound else ("absorb",)
        self.lr_sum, self.lr_sq_sum = 0.0, 0.0  # Σ lr_j and Σ lr_j² over the steps recorded
        self.drift_c: torch.Tensor | None = None
        if optimizer.name != "sgd" and stats is not None and stats.samples_per_step > 0:
            c = sign_consistency(stats.rho, stats.samples_per_step)
            h0 = half_spacing(start)
            values["drift"] = (c / h0.numpy(), True)
            self.drift_c, self.h0 = torch.from_numpy(c.astype(np.float32)), h0.float()
            self.crossings = torch.zeros(n, dtype=torch.int32)  # half-gap crossings of the drift model so far
            self.rules = (*self.rules, "drift")
        self.union = {r: torch.zeros(n, dtype=torch.bool) for r in self.rules}
        self.F = (
            None if "bound" not in self.rules else torch.from_numpy(np.asarray(stats.F, dtype=np.float64).reshape(-1))
        )
        rank = self.shard.ranks
        self.ranks = {name: rank(*values[name], None) for name in RANKED if name in values}
        E = len(layout.entries)
        if index is None:  # (n,) the layout tensor of each column
            self.tensor_of = np.repeat(np.arange(E, dtype=np.int32), [e.numel for e in layout.entries])
        else:
            ends = np.asarray([e.offset + e.numel for e in layout.entries], dtype=np.int64)
            self.tensor_of = np.searchsorted(ends, index, side="right").astype(np.int32)
        self.tensor_ranks = rank(values["random"][0], True, self.tensor_of)
        small = rank(start.float().abs().numpy(), False, None)
        self.decile = (small.astype(np.int64) * N_DECILES // max(layout.P, 1)).astype(np.int8)  # (n,) |w_0| decile
        self.decile_idx = [np.flatnonzero(self.decile == d).astype(np.int32) for d in range(N_DECILES)]
        edges = -(-np.arange(N_DECILES + 1, dtype=np.int64) * layout.P // N_DECILES)  # ⌈d·P/10⌉
        self.decile_sizes = np.diff(edges)  # (N_DECILES,) columns of each decile over the whole layout
        self.decile_ranks = {}
        for name in DECILE_PREDICTORS:
            if name in values:
                within = rank(*values[name], self.decile)
                self.decile_ranks[name] = [within[idx] for idx in self.decile_idx]

    def state_dict(self) -> dict:
        """Plain dict of tensors, ints and floats (steps, start, prev, counts, last set, rule unions, the
        learning-rate sums and the drift model's crossings)."""
        out = {
            "steps": self.steps,
            "start": self.start.clone(),
            "prev": self.prev.clone(),
            "counts": self.counts.clone(),
            "last": self.last.clone(),
            "union": {r: u.clone() for r, u in self.union.items()},
            "lr_sum": self.lr_sum,
            "lr_sq_sum": self.lr_sq_sum,
        }
        if self.drift_c is not None:
            out["crossings"] = self.crossings.clone()
        return out

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.start, self.prev = state["start"].clone(), state["prev"].clone()
        self.counts, self.last = state["counts"].clone(), state["last"].clone()
        self.steps = int(state["steps"])
        self.union = {r: state["union"][r].clone() for r in self.rules}
        self.lr_sum, self.lr_sq_sum = float(state["lr_sum"]), float(state["lr_sq_sum"])
        if self.drift_c is not None:
            self.crossings = state["crossings"].clone()

    def rule_masks(self, prev: torch.Tensor, grad: torch.Tensor, lr: float, adv_rms: float) -> dict[str, torch.Tensor]:
        """(n,) bool predicted step sets from the weights ``prev`` before the step and its gradient ``grad``:
        ``absorb`` SGD lr·|ĝ| ≥ h(w), Adam/AdamW lr·|ĝ|/(|ĝ| + eps) ≥ h(w) (their first step);
        ``bound`` (SGD) lr·adv_rms·√F ≥ h(w); ``drift`` (Adam/AdamW) the step at which the drift model's reach
        (:func:`drift_reach` at the learning-rate sums including this step's) crosses w_0 ± h, ± 3h, … (its
        cumulative set: reach ≥ h(w_0)); h = :func:`half_spacing` in the stored dtype, float64."""
        h = half_spacing(prev)
        g = grad.double().abs()
        step = lr * g if self.spec.name == "sgd" else lr * g / (g + ADAM_EPS)
        masks = {"absorb": step >= h}
        if "bound" in self.rules:
            assert self.F is not None
            masks["bound"] = lr * adv_rms * self.F.clamp(min=0).sqrt() >= h
        if "drift" in self.rules:
            assert self.drift_c is not None
            reach = drift_reach(self.drift_c, self.lr_sum + lr, self.lr_sq_sum + lr * lr)
            crossings = torch.floor(((reach / self.h0 + 1.0) / 2.0).clamp(max=MAX_CROSSINGS)).to(torch.int32)
            masks["drift"] = crossings > self.crossings
            self.crossings = crossings
        return masks

    def record(self, now: torch.Tensor, grad: torch.Tensor | None, lr: float, adv_rms: float) -> dict:
        """The record of one step from ``now`` (n,) stored dtype, the weights after it at the tracker's
        columns, and ``grad`` (n,), the gradient it stepped on (None: no rule predictors). With several
        shards every shard calls it for the same step; each gets the whole layout's record.

        Keys: ``changed`` (n/8,) uint8 bit-packed step set at the tracker's columns (``np.packbits``);
        ``changed_values`` (|set|,) the new values at those columns in index order, as bits (:func:`value_bits`); per
        scope s in (step, cum): ``n_changed_{s}``, ``n_above_{s}`` (len(THRESHOLDS),) counts of |Δ| > threshold,
        ``sign_flips_{s}``, ``per_tensor_{s}`` (E,) changed counts, ``{s}_{predictor}_{stat}`` set metrics of
        the ranked predictors (size k = n_changed_{s}) and rules, and ``decile_{s}_{predictor}_{stat}``
        (N_DECILES,) the same within |w| deciles (k = changed count within the decile); ``jaccard_prev``
        (Jaccard of this and the previous step's sets; NaN at step 1) and ``persist_hist`` (t + 1,) int64, the
        number of coordinates changed in exactly j of the first t steps.
        """
        if now.shape != self.prev.shape or now.dtype != self.prev.dtype:
            raise ValueError(f"weights {tuple(now.shape)} {now.dtype} differ from the start's layout or dtype")
        rules = self.rule_masks(self.prev, grad, lr, adv_rms) if grad is not None else {}
        if grad is not None:
            self.lr_sum, self.lr_sq_sum = self.lr_sum + lr, self.lr_sq_sum + lr * lr
        sets = {"step": now != self.prev, "cum": now != self.start}
        true = {scope: sets[scope].numpy() for scope in SCOPES}
        by_decile = {scope: [true[scope][idx] for idx in self.decile_idx] for scope in SCOPES}
        for r, m in rules.items():
            self.union[r] |= m
        preds = {
            (scope, r): (m if scope == "step" else self.union[r]).numpy() for r, m in rules.items() for scope in SCOPES
        }
        self.counts += sets["step"].to(torch.int32)
        now32, E = now.float(), len(self.layout.entries)
        local: list[np.ndarray] = []  # the first sum's parts, in this order
        for scope, base in (("step", self.prev), ("cum", self.start)):
            base32 = base.float()
            delta = (now32 - base32).abs()
            local.append(np.asarray([count(sets[scope]), count(torch.sign(now32) != torch.sign(base32))]))
            local.append(np.asarray([count(delta > t) for t in THRESHOLDS]))
            local.append(np.bincount(self.tensor_of[true[scope]], minlength=E))
            local.append(np.asarray([np.count_nonzero(t) for t in by_decile[scope]]))
            local.extend(
                np.asarray([np.count_nonzero(preds[scope, r]), np.count_nonzero(preds[scope, r] & true[scope])])
                for r in rules
            )
        local.append(np.asarray([count(self.last), count(sets["step"] & self.last)]))
        local.append(np.bincount(self.counts.numpy(), minlength=self.steps + 2))
        sums = iter(self._split(self.shard.total(np.concatenate(local).astype(np.int64)), local))
        rec: dict = {"changed": np.packbits(true["step"]), "changed_values": value_bits(now[sets["step"]])}
        tensor_k, decile_k, rule_counts = {}, {}, {}
        for scope in SCOPES:
            n_true, flips = (int(x) for x in next(sums))
            rec[f"n_changed_{scope}"] = n_true
            rec[f"n_above_{scope}"] = next(sums)
            rec[f"sign_flips_{scope}"] = flips
            rec[f"per_tensor_{scope}"] = tensor_k[scope] = next(sums)
            decile_k[scope] = next(sums)
            rule_counts[scope] = {r: [int(x) for x in next(sums)] for r in rules}
        n_last, both = (int(x) for x in next(sums))
        rec["jaccard_prev"] = (
            count_metrics(rec["n_changed_step"], n_last, both)["jaccard"] if self.steps else float("nan")
        )
        self.steps += 1
        rec["persist_hist"] = next(sums)[: self.steps + 1]
        ranked = [self._ranked(true[s], by_decile[s], rec[f"n_changed_{s}"], tensor_k[s], decile_k[s]) for s in SCOPES]
        for scope, part in zip(SCOPES, self._split(self.shard.total(np.concatenate(ranked)), ranked), strict=True):
            n_true = rec[f"n_changed_{scope}"]
            rec.update(self._metrics(scope, part, n_true, rule_counts[scope], decile_k[scope]))
        self.prev, self.last = now.clone(), sets["step"]
        return rec

    @staticmethod
    def _split(values: np.ndarray, like: list[np.ndarray]) -> list[np.ndarray]:
        """``values`` cut into pieces of the lengths of ``like``'s arrays."""
        return np.split(values, np.cumsum([len(x) for x in like])[:-1])

    def _ranked(
        self, true: np.ndarray, by_decile: list[np.ndarray], k: int, tensor_k: np.ndarray, decile_k: np.ndarray
    ) -> np.ndarray:
        """The tracker's |pred ∩ true| counts at the changed set ``true`` (n,) (``by_decile``: its parts in each
        decile): each ranked predictor's at k (tensor_random at each tensor's changed count ``tensor_k`` (E,)),
        then each decile predictor's at every decile's changed count ``decile_k`` (N_DECILES,); int64."""
        out = []
        for name in RANKED:
            if name == "tensor_random":
                out.append(np.count_nonzero(true & (self.tensor_ranks < tensor_k[self.tensor_of])))
            elif name in self.ranks:
                out.append(np.count_nonzero(self.ranks[name][true] < k))
        for ranks in self.decile_ranks.values():
            out.extend(np.count_nonzero(ranks[d][t] < decile_k[d]) for d, t in enumerate(by_decile))
        return np.asarray(out, dtype=np.int64)

    def _metrics(self, scope: str, both: np.ndarray, k: int, rules: dict[str, list[int]], decile_k: np.ndarray) -> dict:
        """One scope's set metrics: the ranked predictors' and the deciles' from the summed counts of
        :meth:`_ranked`, the rules' from their summed (|pred|, |pred ∩ true|) ``rules``."""
        rec: dict = {}
        names = [n for n in RANKED if n == "tensor_random" or n in self.ranks]
        for name, n_both in zip(names, both, strict=False):
            rec.update({f"{scope}_{name}_{s}": v for s, v in count_metrics(k, k, int(n_both)).items()})
        for r, (n_pred, n_both) in rules.items():
            rec.update({f"{scope}_{r}_{s}": v for s, v in count_metrics(n_pred, k, n_both).items()})
        at = len(names)
        for name in self.decile_ranks:
            table = np.full((len(SET_STATS), N_DECILES), np.nan)
            for d in np.flatnonzero(self.decile_sizes):
                m = count_metrics(int(decile_k[d]), int(decile_k[d]), int(both[at + d]))
                table[:, d] = [m[s] for s in SET_STATS]
            at += N_DECILES
            rec.update({f"decile_{scope}_{name}_{s}": table[i] for i, s in enumerate(SET_STATS)})
        return rec
