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
from covgrad.updates.columns import CHUNK, ColumnFiles, Ranker, Ranking
from covgrad.updates.stepping import ADAM_EPS, OptimizerSpec

THRESHOLDS = (0.0, 1e-8, 1e-6, 1e-5, 1e-4)  # |Δ| > threshold counts, Δ in float32


SCOPES = ("step", "cum")  # the step's changed set (w_t != w_{t-1}) and the cumulative one (w_t != w_0)


RANKED = ("F", "absG", "absrho", "drift", "smallw", "random", "tensor_random")


DECILE_PREDICTORS = ("F", "absG", "absrho", "drift", "random")


RULES = ("absorb", "bound", "drift_rule")


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


_BF16_HALF: np.ndarray | None = None


def _bf16_half_table() -> np.ndarray:
    """(65536,) float64 :func:`bf16_half_spacing` of every bf16 bit pattern (NaN for inf and NaN), built once."""
    global _BF16_HALF
    if _BF16_HALF is None:
        patterns = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
        finite = torch.isfinite(patterns)
        table = torch.full((1 << 16,), math.nan, dtype=torch.float64)
        table[finite] = bf16_half_spacing(patterns[finite]).double()
        _BF16_HALF = table.numpy()
    return _BF16_HALF


_NON_FINITE = "bf16_half_spacing: bf16(w) has inf or NaN entries; pass finite weights within bf16 range"


def half_spacing_fast(w: torch.Tensor) -> torch.Tensor:
    """:func:`half_spacing` (float64, same values): for bf16 a lookup of the 65,536 bit patterns' half gaps
    (:func:`bf16_half_spacing` of each, built once), one gather instead of the bit arithmetic; ValueError for
    inf or NaN entries."""
    if w.dtype != torch.bfloat16:
        return half_spacing(w)
    h = _bf16_half_table()[w.view(torch.int16).numpy().view(np.uint16)]
    if np.isnan(h).any():
        raise ValueError(_NON_FINITE)
    return torch.from_numpy(h)


def half_spacing_at_most(w: torch.Tensor, bound: float) -> np.ndarray:
    """(n,) bool ``half_spacing_fast(w) <= bound`` for ``w`` (n,) without forming the float64 gaps: for bf16 a
    one-byte lookup of the 65,536 bit patterns' answers; ValueError for inf or NaN entries."""
    if w.dtype != torch.bfloat16:
        return (half_spacing(w) <= bound).numpy()
    table = _bf16_half_table()
    answer = np.where(np.isnan(table), 2, table <= bound).astype(np.uint8)  # 2: not finite
    got = answer[w.view(torch.int16).numpy().view(np.uint16)]
    if np.any(got == 2):
        raise ValueError(_NON_FINITE)
    return got.view(np.bool_)


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
    """Step-0 predictors: F, G, ρ (P,) from the stats stage of the start policy (arrays, or readers that return
    them, so that a tracker holds one at a time), the seed of the random
    baselines, and B = ``samples_per_step``, the rows each optimizer step averages over (0: unknown; the
    Adam drift predictor, :func:`sign_consistency`, needs it)."""

    F: np.ndarray | Callable[[], np.ndarray]
    G: np.ndarray | Callable[[], np.ndarray]
    rho: np.ndarray | Callable[[], np.ndarray]
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


@dataclass(frozen=True)
class TrackerShard:
    """The columns one :class:`ChangeTracker` of several keeps (a rank's shard of the layout,
    ``covgrad.distributed.stepper``) and how the trackers combine: ``total`` sums an int64 array over all of
    them (every tracker calls it in the same order), ``ranks`` ranks values over all their columns (None: the
    tracker keeps every column and ranks them itself).

    Attributes:
        index: (n,) int64 global columns of the layout's flat axis, ascending; None: all of them.
    """

    index: np.ndarray | None
    total: Callable[[np.ndarray], np.ndarray]
    ranks: Ranker | None


WHOLE_LAYOUT = TrackerShard(None, lambda counts: counts, None)  # one tracker keeps every column


def _stat(values: np.ndarray | Callable[[], np.ndarray], n: int, name: str) -> np.ndarray:
    """A step-0 statistic (n,) float, read now when it is a reader."""
    out = np.asarray(values() if callable(values) else values).reshape(-1)
    if out.shape != (n,) or out.dtype not in (np.float32, np.float64):
        raise ValueError(f"step-0 statistic {name} is {out.dtype} {out.shape}, expected float ({n},)")
    return out


class ChangeTracker:
    """The per-step record of a trajectory (see :meth:`record`).

    ``start``: (n,) the analysed model's selected values at step 0 at the tracker's columns (``shard``; None:
    all P), stored dtype. ``stats``: step-0 F, G, ρ at the same columns for the F / |G| / |ρ| predictors and
    the bound rule (None: those are left out; arrays or readers, read one at a time). ``optimizer``: which
    absorption rule applies. ``bound``: whether the regime has a bound (False for ``sft_sampled``: no bound
    rule). ``scratch``: where the column files go (:class:`~covgrad.updates.columns.ColumnFiles`; None: the
    system's temporary directory). ``chunk``: columns processed at a time.

    The ranked predictors are fixed for the whole run, so they are ranked once (globally, within each tensor
    for per-tensor random, within each |w_0| decile; over every shard's columns with ``shard.ranks``) into
    :class:`~covgrad.updates.columns.Ranking` files. With several shards every count is summed over them
    (``shard.total``, twice a step), so each shard's record is the whole layout's.

    Memory per column: the previous weights (stored dtype, 2 or 4 B), change counts (uint16, 2 B), the last
    step's set and the rule unions (bool, 1 B each); the start, the deciles, the drift model's c, F for the
    SGD bound rule and every ranking (a 1-byte bucket and a 4-byte order) stay in the column files, about
    60 B per column on disk, read a chunk at a time. A step adds its weights and gradient and two bool sets.
    """

    def __init__(
        self,
        layout: ParamLayout,
        start: torch.Tensor,
        optimizer: OptimizerSpec,
        stats: StepZeroStats | None = None,
        bound: bool = True,
        shard: TrackerShard | None = None,
        scratch: str | None = None,
        chunk: int = CHUNK,
    ) -> None:
        self.shard = WHOLE_LAYOUT if shard is None else shard
        index = self.shard.index
        n = layout.P if index is None else index.shape[0]
        if start.shape != (n,):
            raise ValueError(f"start has shape {tuple(start.shape)}, expected ({n},)")
        if chunk < 8 or chunk % 8:
            raise ValueError(f"chunk must be a positive multiple of 8, got {chunk}")
        self.layout, self.spec, self.n, self.chunk, self.dtype = layout, optimizer, n, chunk, start.dtype
        self.files = ColumnFiles(scratch)
        self.files.write("start", value_bits(start))
        self.prev = start.clone()
        self.counts = np.zeros(n, dtype=np.uint16)  # steps that changed each coordinate
        self.hist = np.asarray([n], dtype=np.int64)  # (steps + 1,) coordinates changed in exactly j steps
        self.last = np.zeros(n, dtype=bool)  # the previous step's changed set
        self.steps = 0  # steps recorded
        self.lr_sum, self.lr_sq_sum = 0.0, 0.0  # Σ lr_j and Σ lr_j² over the steps recorded
        self._ends = np.asarray([e.offset + e.numel for e in layout.entries], dtype=np.int64)
        self.rules: tuple[str, ...] = ("absorb",)
        if optimizer.name == "sgd" and stats is not None and bound:
            self.rules = ("absorb", "bound")
            self.files.write("F", _stat(stats.F, n, "F").astype(np.float64))
        self.drift = optimizer.name != "sgd" and stats is not None and stats.samples_per_step > 0
        if self.drift:
            self.rules = (*self.rules, "drift_rule")
        self.union = {r: np.zeros(n, dtype=bool) for r in self.rules}
        self._rank(start, stats)

    def _rank(self, start: torch.Tensor, stats: StepZeroStats | None) -> None:
        """Build every predictor's ranking (``rankings``: global, ``decile_rankings``: within |w_0| deciles)
        and the column files of the deciles and the drift model's c."""
        P, n = self.layout.P, self.n
        ranker = self.shard.ranks if self.shard.index is not None else None
        whole = np.asarray([P], dtype=np.int64)
        self.rankings: dict[str, Ranking] = {}
        self.decile_rankings: dict[str, Ranking] = {}
        small = Ranking.build(self.files, "smallw", start.float().abs().numpy(), False, None, whole, ranker)
        decile = small.per_column(self.files, n, lambda r: (r * N_DECILES // max(P, 1)).astype(np.int8))
        self.files.write("decile", decile)
        edges = -(-np.arange(N_DECILES + 1, dtype=np.int64) * P // N_DECILES)  # ⌈d·P/10⌉
        self.decile_sizes = np.diff(edges)  # (N_DECILES,) columns of each decile over the whole layout
        tensor_sizes = np.asarray([e.numel for e in self.layout.entries], dtype=np.int64)
        seed = 0 if stats is None else stats.seed
        values: dict[str, tuple[Callable[[], np.ndarray], bool]] = {}
        if stats is not None:
            values["F"] = (lambda: _stat(stats.F, n, "F"), True)
            values["absG"] = (lambda: np.abs(_stat(stats.G, n, "G")), True)
            values["absrho"] = (lambda: np.abs(_stat(stats.rho, n, "rho")), True)
        if self.drift:
            assert stats is not None

            def drift() -> np.ndarray:
                c = sign_consistency(_stat(stats.rho, n, "rho"), stats.samples_per_step)
                self.files.write("c", c.astype(np.float32))
                return c / half_spacing(start).numpy()

            values["drift"] = (drift, True)
        values["random"] = (lambda: random_values(seed, P, self.shard.index), True)
        for name in RANKED:
            if name == "smallw":
                self.rankings[name] = small
            elif name == "tensor_random":
                v = random_values(seed, P, self.shard.index)
                self.rankings[name] = Ranking.build(
                    self.files, name, v, True, self._tensor_at(np.arange(n)), tensor_sizes, ranker
                )
            elif name in values:
                v, largest = values[name][0](), values[name][1]
                self.rankings[name] = Ranking.build(self.files, name, v, largest, None, whole, ranker)
                if name in DECILE_PREDICTORS:
                    self.decile_rankings[name] = Ranking.build(
                        self.files, f"decile_{name}", v, largest, decile, self.decile_sizes, ranker
                    )
                del v

    def _tensor_at(self, positions: np.ndarray) -> np.ndarray:
        """(m,) int32 the layout tensor of the tracker's columns at ``positions`` (m,) int (its own, 0..n−1)."""
        index = self.shard.index
        cols = positions if index is None else index[positions]
        return np.searchsorted(self._ends, cols, side="right").astype(np.int32)

    def _start(self, lo: int, hi: int) -> torch.Tensor:
        """The start weights at columns [lo, hi), stored dtype."""
        bits = self.files.read("start", lo, hi)
        as_int = torch.from_numpy(bits.view(np.int16 if bits.dtype == np.uint16 else np.int32))
        return as_int.view(self.dtype)

    def close(self) -> None:
        """Remove the column files (the tracker records nothing more)."""
        self.files.close()

    def __enter__(self) -> ChangeTracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def state_dict(self) -> dict:
        """Plain dict of tensors, ints and floats (steps, previous weights, counts, last set, rule unions and the
        learning-rate sums; the drift model's crossings follow from the sums)."""
        return {
            "steps": self.steps,
            "prev": self.prev.clone(),
            "counts": torch.from_numpy(self.counts.copy()),
            "last": torch.from_numpy(self.last.copy()),
            "union": {r: torch.from_numpy(u.copy()) for r, u in self.union.items()},
            "lr_sum": self.lr_sum,
            "lr_sq_sum": self.lr_sq_sum,
        }

    def load_state_dict(self, state: Mapping) -> None:
        """Restore :meth:`state_dict`'s output."""
        self.prev = state["prev"].clone()
        self.counts = state["counts"].numpy().astype(np.uint16)
        self.hist = np.zeros(int(state["steps"]) + 1, dtype=np.int64)
        for lo in range(0, self.n, self.chunk):
            self.hist += np.bincount(self.counts[lo : lo + self.chunk], minlength=self.hist.shape[0])
        self.last = state["last"].numpy().copy()
        self.steps = int(state["steps"])
        self.union = {r: state["union"][r].numpy().copy() for r in self.rules}
        self.lr_sum, self.lr_sq_sum = float(state["lr_sum"]), float(state["lr_sq_sum"])

    def drift_crossings(self, c: torch.Tensor, h0: torch.Tensor, lr_sum: float, lr_sq_sum: float) -> torch.Tensor:
        """(m,) int32 midpoints crossed by the drift model (:func:`drift_reach`) at the learning-rate sums; 0
        before any step."""
        if lr_sum == 0 and lr_sq_sum == 0:
            return torch.zeros(c.shape, dtype=torch.int32)
        reach = drift_reach(c, lr_sum, lr_sq_sum)
        return torch.floor(((reach / h0 + 1.0) / 2.0).clamp(max=MAX_CROSSINGS)).to(torch.int32)

    def drift_rule_counts(
        self, start: torch.Tensor, before: tuple[float, float], after: tuple[float, float]
    ) -> dict[str, np.ndarray]:
        """The drift rule of a record that spans several optimizer steps (an external run's checkpoint): per scope,
        int64 (3,) ``|pred|, |true|, |pred ∩ true|``. ``step``: predicted when the drift model's reach crossed one
        more midpoint w_0 ± h(w_0), ± 3h, … between the learning-rate sums ``before`` and ``after`` (Σ lr, Σ lr²
        through the previous and this record), true = the last recorded step set; ``cum``: at least one crossing
        at ``after``, true = the weights differ from ``start``. ``start``: (P,) the start weights, stored dtype;
        reads the drift model's column ``c`` in chunks."""
        counts = {scope: np.zeros(3, dtype=np.int64) for scope in SCOPES}
        for lo in range(0, self.n, CHUNK):
            hi = min(self.n, lo + CHUNK)
            c = torch.from_numpy(self.files.read("c", lo, hi))
            h0 = half_spacing(start[lo:hi]).float()
            before_x, after_x = (self.drift_crossings(c, h0, *sums) for sums in (before, after))
            pred = {"step": (after_x > before_x).numpy(), "cum": (after_x > 0).numpy()}
            true = {"step": self.last[lo:hi], "cum": (self.prev[lo:hi] != start[lo:hi]).numpy()}
            for scope in SCOPES:
                p, s = pred[scope], true[scope]
                counts[scope] += [np.count_nonzero(p), np.count_nonzero(s), np.count_nonzero(p & s)]
        return counts

    def rule_masks(
        self, lo: int, hi: int, prev: torch.Tensor, grad: torch.Tensor, lr: float, adv_rms: float
    ) -> dict[str, torch.Tensor]:
        """(hi − lo,) bool predicted step sets at columns [lo, hi) from the weights ``prev`` before the step and
        its gradient ``grad`` there: ``absorb`` SGD lr·|ĝ| ≥ h(w), Adam/AdamW lr·|ĝ|/(|ĝ| + eps) ≥ h(w) (their
        first step); ``bound`` (SGD) lr·adv_rms·√F ≥ h(w); ``drift_rule`` (Adam/AdamW) the step at which the drift
        model's reach (:func:`drift_reach` at the learning-rate sums including this step's) crosses w_0 ± h,
        ± 3h, … (its cumulative set: reach ≥ h(w_0)); h = :func:`half_spacing` in the stored dtype, float64."""
        if self.spec.name == "sgd":
            h = half_spacing_fast(prev)
            masks = {"absorb": lr * grad.double().abs() >= h}
            if "bound" in self.rules:
                F = torch.from_numpy(self.files.read("F", lo, hi))
                masks["bound"] = lr * adv_rms * F.clamp(min=0).sqrt() >= h
        else:  # lr·|ĝ|/(|ĝ| + eps) < lr: only columns with h ≤ lr can be absorbed
            masks = {"absorb": torch.zeros(prev.shape, dtype=torch.bool)}
            at = torch.from_numpy(np.flatnonzero(half_spacing_at_most(prev, lr)))
            g = grad[at].double().abs()
            masks["absorb"][at] = lr * g / (g + ADAM_EPS) >= half_spacing_fast(prev[at])
        if self.drift:
            start = self._start(lo, hi)
            masks["drift_rule"] = torch.zeros(start.shape, dtype=torch.bool)
            after = (self.lr_sum + lr, self.lr_sq_sum + lr * lr)
            # reach ≤ √(Σlr² + Σlr_j²) for any c: columns with h(w_0) beyond it cross no midpoint yet (h of a bf16
            # or float32 weight is a power of two, exact in float32)
            at = np.flatnonzero(half_spacing_at_most(start, math.sqrt(after[0] ** 2 + after[1]) * (1 + 1e-9)))
            if at.shape[0]:
                h0 = half_spacing_fast(start[torch.from_numpy(at)]).float()
                c = torch.from_numpy(self.files.read("c", lo, hi)[at])
                before = self.drift_crossings(c, h0, self.lr_sum, self.lr_sq_sum)
                masks["drift_rule"][torch.from_numpy(at)] = self.drift_crossings(c, h0, *after) > before
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
        if self.steps >= np.iinfo(np.uint16).max:
            raise ValueError(f"a tracker records at most {np.iinfo(np.uint16).max} steps")
        true = {scope: np.empty(self.n, dtype=bool) for scope in SCOPES}
        local = self._first_pass(now, grad, lr, adv_rms, true)
        if grad is not None:
            self.lr_sum, self.lr_sq_sum = self.lr_sum + lr, self.lr_sq_sum + lr * lr
        sums = iter(self._split(self.shard.total(np.concatenate(local).astype(np.int64)), local))
        moved = now[torch.from_numpy(true["step"])]
        rec: dict = {"changed": np.packbits(true["step"]), "changed_values": value_bits(moved)}
        tensor_k, decile_k, rule_counts = {}, {}, {}
        for scope in SCOPES:
            n_true, flips = (int(x) for x in next(sums))
            rec[f"n_changed_{scope}"] = n_true
            rec[f"n_above_{scope}"] = next(sums)
            rec[f"sign_flips_{scope}"] = flips
            rec[f"per_tensor_{scope}"] = tensor_k[scope] = next(sums)
            decile_k[scope] = next(sums)
            rule_counts[scope] = {r: [int(x) for x in next(sums)] for r in self._rules_of(grad)}
        n_last, both = (int(x) for x in next(sums))
        rec["jaccard_prev"] = (
            count_metrics(rec["n_changed_step"], n_last, both)["jaccard"] if self.steps else float("nan")
        )
        self.steps += 1
        rec["persist_hist"] = next(sums)[: self.steps + 1]
        ranked = self._ranked(true, {s: rec[f"n_changed_{s}"] for s in SCOPES}, tensor_k, decile_k)
        for scope, part in zip(SCOPES, self._split(self.shard.total(np.concatenate(ranked)), ranked), strict=True):
            n_true = rec[f"n_changed_{scope}"]
            rec.update(self._metrics(scope, part, n_true, rule_counts[scope], decile_k[scope]))
        self.prev, self.last = now.clone(), true["step"]
        return rec

    def _rules_of(self, grad: torch.Tensor | None) -> tuple[str, ...]:
        return self.rules if grad is not None else ()

    def _first_pass(
        self, now: torch.Tensor, grad: torch.Tensor | None, lr: float, adv_rms: float, true: dict[str, np.ndarray]
    ) -> list[np.ndarray]:
        """One pass over the columns in chunks: fills the step and cumulative sets ``true`` ((n,) bool each),
        updates the rule unions and the change counts; returns the tracker's counts to sum over the shards, in
        the order :meth:`record` reads them. What depends on |Δ| (thresholds, sign flips, tensors, deciles) is
        counted on each set's columns only: elsewhere Δ = 0."""
        E, rules = len(self.layout.entries), self._rules_of(grad)
        acc = {
            scope: {
                "n": np.zeros(2, dtype=np.int64),
                "above": np.zeros(len(THRESHOLDS), dtype=np.int64),
                "tensor": np.zeros(E, dtype=np.int64),
                "decile": np.zeros(N_DECILES, dtype=np.int64),
                **{r: np.zeros(2, dtype=np.int64) for r in rules},
            }
            for scope in SCOPES
        }
        last_counts = np.zeros(2, dtype=np.int64)
        hist = np.zeros(self.steps + 2, dtype=np.int64)  # the counts' histogram, updated where a count moves
        hist[: self.hist.shape[0]] = self.hist
        for lo in range(0, self.n, self.chunk):
            hi = min(self.n, lo + self.chunk)
            nw, pv, st = now[lo:hi], self.prev[lo:hi], self._start(lo, hi)
            sets = {"step": (nw != pv).numpy(), "cum": (nw != st).numpy()}
            masks = self.rule_masks(lo, hi, pv, grad[lo:hi], lr, adv_rms) if grad is not None else {}
            for r, m in masks.items():
                self.union[r][lo:hi] |= m.numpy()
            decile = self.files.read("decile", lo, hi)
            for scope, base in (("step", pv), ("cum", st)):
                s, a = sets[scope], acc[scope]
                true[scope][lo:hi] = s
                at = np.flatnonzero(s)
                rows = torch.from_numpy(at)
                new32, old32 = nw[rows].float(), base[rows].float()
                delta = (new32 - old32).abs()
                a["n"] += [at.shape[0], count(torch.sign(new32) != torch.sign(old32))]
                a["above"] += [count(delta > t) for t in THRESHOLDS]
                a["tensor"] += np.bincount(self._tensor_at(lo + at), minlength=E)
                a["decile"] += np.bincount(decile[at], minlength=N_DECILES)
                for r, m in masks.items():
                    pred = m.numpy() if scope == "step" else self.union[r][lo:hi]
                    a[r] += [np.count_nonzero(pred), np.count_nonzero(pred[at])]
            last = self.last[lo:hi]
            last_counts += [np.count_nonzero(last), np.count_nonzero(last[sets["step"]])]
            changed = lo + np.flatnonzero(sets["step"])
            before = self.counts[changed]
            self.counts[changed] = before + 1
            hist -= np.bincount(before, minlength=self.steps + 2)
            hist += np.bincount(before + 1, minlength=self.steps + 2)
        local: list[np.ndarray] = []
        for scope in SCOPES:
            a = acc[scope]
            local += [a["n"], a["above"], a["tensor"], a["decile"], *(a[r] for r in rules)]
        self.hist = hist
        return [*local, last_counts, hist.copy()]

    @staticmethod
    def _split(values: np.ndarray, like: list[np.ndarray]) -> list[np.ndarray]:
        """``values`` cut into pieces of the lengths of ``like``'s arrays."""
        return np.split(values, np.cumsum([len(x) for x in like])[:-1])

    def _ranked(
        self, true: dict[str, np.ndarray], k: dict[str, int], tensor_k: dict[str, np.ndarray], decile_k: dict
    ) -> list[np.ndarray]:
        """Per scope, the tracker's |pred ∩ true| counts at the changed set ``true[scope]`` (n,): each ranked
        predictor's at k (tensor_random at each tensor's changed count ``tensor_k`` (E,)), then each decile
        predictor's at every decile's changed count ``decile_k`` (N_DECILES,); int64. Each ranking's buckets
        are read once for both scopes, and only at the sets' columns."""
        jobs = [(r, None) for name, r in self.rankings.items() if name != "tensor_random"]
        if "tensor_random" in self.rankings:
            jobs.append((self.rankings["tensor_random"], "tensor"))
        jobs += [(r, "decile") for r in self.decile_rankings.values()]
        sizes = {None: lambda s: np.asarray([k[s]]), "tensor": lambda s: tensor_k[s], "decile": lambda s: decile_k[s]}
        thresholds = {s: [r.thresholds(sizes[g](s)) for r, g in jobs] for s in SCOPES}
        counts = {s: [r.boundary(self.files, sizes[g](s), true[s]) for r, g in jobs] for s in SCOPES}
        for lo in range(0, self.n, self.chunk):
            hi = min(self.n, lo + self.chunk)
            at = {s: np.flatnonzero(true[s][lo:hi]) for s in SCOPES}
            if not any(a.shape[0] for a in at.values()):
                continue
            decile = self.files.read("decile", lo, hi)
            groups = {s: {"tensor": self._tensor_at(lo + at[s]), "decile": decile[at[s]], None: None} for s in SCOPES}
            for j, (r, grouping) in enumerate(jobs):
                bucket = self.files.read(f"{r.name}.bucket", lo, hi)
                for s in SCOPES:
                    counts[s][j] += r.below(bucket[at[s]], groups[s][grouping], thresholds[s][j])
        out = []
        for s in SCOPES:
            by_name = dict(zip([r.name for r, _ in jobs], counts[s], strict=True))
            part = [int(by_name[name].sum()) for name in RANKED if name in self.rankings]
            for name in self.decile_rankings:
                part.extend(by_name[f"decile_{name}"].tolist())
            out.append(np.asarray(part, dtype=np.int64))
        return out

    def _metrics(self, scope: str, both: np.ndarray, k: int, rules: dict[str, list[int]], decile_k: np.ndarray) -> dict:
        """One scope's set metrics: the ranked predictors' and the deciles' from the summed counts of
        :meth:`_ranked`, the rules' from their summed (|pred|, |pred ∩ true|) ``rules``."""
        rec: dict = {}
        names = [n for n in RANKED if n in self.rankings]
        for name, n_both in zip(names, both, strict=False):
            rec.update({f"{scope}_{name}_{s}": v for s, v in count_metrics(k, k, int(n_both)).items()})
        for r, (n_pred, n_both) in rules.items():
            rec.update({f"{scope}_{r}_{s}": v for s, v in count_metrics(n_pred, k, n_both).items()})
        at = len(names)
        for name in self.decile_rankings:
            table = np.full((len(SET_STATS), N_DECILES), np.nan)
            for d in np.flatnonzero(self.decile_sizes):
                m = count_metrics(int(decile_k[d]), int(decile_k[d]), int(both[at + d]))
                table[:, d] = [m[s] for s in SET_STATS]
            at += N_DECILES
            rec.update({f"decile_{scope}_{name}_{s}": table[i] for i, s in enumerate(SET_STATS)})
        return rec


SERIES_PREDICTORS = ("F", "absG", "absrho")  # the predictors of a statistics series recorded during the run


class SeriesRanking:
    """Exact top-k counts of predictors whose values are re-read during a run (an in-run series' F, |G|, |ρ| at a
    folded step, ``tasks.jobs.external_run.InRunRule``), in the same order as the tracker's ranked predictors:
    largest first, ties by the lowest column, NaN last (:class:`~covgrad.updates.columns.Ranking`, so
    ``top_k_masks``'s set). Each named slot holds one ranking per predictor in ``files`` (the tracker's
    :class:`~covgrad.updates.columns.ColumnFiles`), replaced when the slot is ranked again: 5 B per column per
    predictor on disk, the values of one predictor in memory while it is ranked.

    ``n``: the columns (a whole layout, P); ``chunk``: columns read at a time."""

    def __init__(self, files: ColumnFiles, n: int, chunk: int = CHUNK) -> None:
        self.files, self.n, self.chunk = files, n, chunk
        self.slots: dict[str, dict[str, Ranking]] = {}

    def rank(self, slot: str, values: Mapping[str, Callable[[], np.ndarray]]) -> None:
        """Rank each predictor of ``values`` (name -> a reader of its (n,) float values, read one at a time) into
        ``slot``, replacing what the slot held."""
        whole = np.asarray([self.n], dtype=np.int64)
        rankings = {}
        for name, read in values.items():
            v = read()
            if v.shape != (self.n,):
                raise ValueError(f"series predictor {name} has shape {v.shape}, expected ({self.n},)")
            rankings[name] = Ranking.build(self.files, f"series_{slot}_{name}", v, True, None, whole)
            del v
        self.slots[slot] = rankings

    def overlaps(self, slot: str, true: np.ndarray, k: int) -> dict[str, int]:
        """Per predictor of ``slot``: |top k ∩ true| for the set ``true`` (n,) bool."""
        ks = np.asarray([k], dtype=np.int64)
        out = {}
        for name, r in self.slots[slot].items():
            b = r.thresholds(ks)
            both = int(r.boundary(self.files, ks, true)[0])
            for lo in range(0, self.n, self.chunk):
                hi = min(self.n, lo + self.chunk)
                at = np.flatnonzero(true[lo:hi])
                if at.shape[0]:
                    both += int(r.below(self.files.read(f"{r.name}.bucket", lo, hi)[at], None, b)[0])
            out[name] = both
        return out
