"""How a run's changed sets persist: PULSE's k-step changed fractions, consecutive Jaccard and the persistence
histogram, per tensor, per kind of tensor and within |w_0| deciles, from a run's sparse change trace.

A *trace* is the start weights w_0 (P,) in the stored dtype and, for each step t = 1..T, the coordinates whose
stored value changed (ascending flat indices) and their new values: exactly what an exact delta sync ships,
and what :class:`covgrad.updates.tracking.ChangeTracker` records. Definitions (PULSE, Miahi & Belilovsky 2026;
``one-covenant/grail`` ``scripts/compute_k_step_sparsity.py`` at 54d6342):

- d_k(t) = |{i : w_{t+k,i} ≠ w_{t,i}}| / n for windows t = 0..T−k (n: the coordinates of the group), the
  *net* change of the stored weights over k steps; d_1(t) is the changed fraction of step t + 1.
- independent_k(t) = 1 − Π_{j=t}^{t+k−1} (1 − d_1(j)): d_k if each step changed an independent random set of
  its size. d_k / independent_k ≪ 1 means the same coordinates change step after step.
- Jaccard(t) = |S_t ∩ S_{t−1}| / |S_t ∪ S_{t−1}| of consecutive per-step sets S_t (t ≥ 2).
- hist[c] = the coordinates that changed in exactly c of the T steps.

grail sums per-step deltas that were rounded to bf16 in float32 and compares the sum with 0; here windows
compare the stored weights themselves, so a coordinate that moves and moves back counts as unchanged, and
nothing is lost to the rounding of deltas (docs/trajectory.md: where this differs from grail's numbers).

Every count is exact integer arithmetic over *cells* (a tensor × |w_0| decile pair); a group's count is the
sum of its cells'. The replay keeps three (P,) arrays (w_t, w_{t+k}, their mismatch) and touches only the
coordinates a step changed, so a k costs O(Σ_t |S_t|) after an O(P) start.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from covgrad.updates.columns import CHUNK, stable_order

KS = (1, 2, 4, 8, 16, 32)
KINDS = ("embedding", "attention", "mlp", "norm", "other")
N_DECILES = 10
_KIND_PATTERNS = (
    ("norm", re.compile(r"norm|(^|\.)ln_|layernorm|\.ln\d*\.")),
    ("embedding", re.compile(r"embed|(^|\.)wte\.|(^|\.)wpe\.|lm_head|(^|\.)head\.")),
    ("attention", re.compile(r"attn|attention|q_proj|k_proj|v_proj|o_proj|qkv|query|key|value|c_attn")),
    ("mlp", re.compile(r"mlp|gate_proj|up_proj|down_proj|fc\d|c_fc|c_proj|expert|ffn|feed_forward|w1|w2|w3")),
)

# (t) -> (changed flat indices (n_t,) int64 ascending, their new values (n_t,) stored-dtype bits), t = 1..T
StepDelta = Callable[[int], tuple[np.ndarray, np.ndarray]]


def tensor_kind(name: str) -> str:
    """The kind of a parameter tensor by its name: ``norm``, ``embedding`` (token and position embeddings and
    the LM head), ``attention``, ``mlp`` (experts included) or ``other``."""
    lower = name.lower()
    for kind, pattern in _KIND_PATTERNS:
        if pattern.search(lower):
            return kind
    return "other"


def magnitude_deciles(start: np.ndarray) -> np.ndarray:
    """(P,) int8 decile of |w_0| per coordinate, 0 = the smallest tenth: rank·10 // P in the order of
    :func:`covgrad.updates.tracking.stable_ranks` (smallest first, ties by the lowest index), as the
    trajectory tracker's deciles. ``start``: (P,) float32 (ranked as float32: bf16 and float32 weights are
    exact in it) or another float dtype (ranked as float64)."""
    v = np.asarray(start).reshape(-1)
    order = stable_order(np.abs(v if v.dtype == np.float32 else v.astype(np.float64)), largest=False)
    P = v.shape[0]
    deciles = np.empty(P, dtype=np.int8)
    for lo in range(0, P, CHUNK):
        hi = min(P, lo + CHUNK)
        deciles[order[lo:hi]] = np.arange(lo, hi, dtype=np.int64) * N_DECILES // max(P, 1)
    return deciles


@dataclass(frozen=True)
class Cells:
    """The cells of a layout: each coordinate's tensor and |w_0| decile, cell = tensor·N_DECILES + decile.

    Attributes:
        cell: (P,) int32 cell of every coordinate.
        names: (E,) tensor names, in layout order.
        kinds: (E,) the kind of each tensor (:func:`tensor_kind`).
    """

    cell: np.ndarray
    names: tuple[str, ...]
    kinds: tuple[str, ...]

    @classmethod
    def of(cls, names: Sequence[str], numels: Sequence[int], start: np.ndarray) -> Cells:
        """Cells from the layout's tensor names and sizes (flat order) and the start weights (P,) as floats."""
        tensor = np.repeat(np.arange(len(names), dtype=np.int32), np.asarray(numels, dtype=np.int64))
        if tensor.shape[0] != np.asarray(start).reshape(-1).shape[0]:
            raise ValueError(f"the layout has {tensor.shape[0]} coordinates, the start weights {np.size(start)}")
        cell = tensor * N_DECILES + magnitude_deciles(start)
        return cls(cell, tuple(names), tuple(tensor_kind(n) for n in names))

    @property
    def n_cells(self) -> int:
        return len(self.names) * N_DECILES

    def sizes(self) -> np.ndarray:
        """(n_cells,) int64 coordinates per cell."""
        return np.bincount(self.cell, minlength=self.n_cells).astype(np.int64)

    def count(self, index: np.ndarray) -> np.ndarray:
        """(n_cells,) int64 how many of the coordinates ``index`` (n,) fall in each cell."""
        return np.bincount(self.cell[index], minlength=self.n_cells).astype(np.int64)

    def groupings(self) -> dict[str, tuple[tuple[str, ...], np.ndarray]]:
        """Grouping -> (group labels, (n_cells, G) 0/1 int64 matrix summing cells into groups): ``all``,
        ``kind`` (the kinds present, in KINDS order), ``tensor``, ``decile``."""
        E = len(self.names)
        tensor_of = np.repeat(np.arange(E), N_DECILES)
        decile_of = np.tile(np.arange(N_DECILES), E)
        kinds = tuple(k for k in KINDS if k in self.kinds)
        kind_of = np.asarray([kinds.index(self.kinds[e]) for e in tensor_of], dtype=np.int64)
        return {
            "all": (("all",), np.ones((self.n_cells, 1), dtype=np.int64)),
            "kind": (kinds, np.eye(len(kinds), dtype=np.int64)[kind_of]),
            "tensor": (self.names, np.eye(E, dtype=np.int64)[tensor_of]),
            "decile": (tuple(str(d) for d in range(N_DECILES)), np.eye(N_DECILES, dtype=np.int64)[decile_of]),
        }


@dataclass(frozen=True)
class PersistenceCounts:
    """The integer counts of a trace per cell (C cells, T steps, K = len(ks)).

    Attributes:
        ks: the window lengths k.
        sizes: (C,) coordinates per cell.
        window: (K, T, C) coordinates with w_{t+k} ≠ w_t for windows t = 0..T−k; −1 where t > T − k.
        step: (T, C) |S_t|, the per-step changed counts (row t − 1 is step t).
        both: (T, C) |S_t ∩ S_{t−1}| (row 0 is 0: no step before the first).
        hist: (C, T + 1) coordinates changed in exactly c of the T steps.
    """

    ks: tuple[int, ...]
    sizes: np.ndarray
    window: np.ndarray
    step: np.ndarray
    both: np.ndarray
    hist: np.ndarray


def count_trace(
    start: np.ndarray,
    delta: StepDelta,
    steps: int,
    cells: Cells,
    ks: Sequence[int] = KS,
    scratch: str | None = None,
) -> PersistenceCounts:
    """The :class:`PersistenceCounts` of a trace of ``steps`` steps: ``start`` (P,) the stored weights at step 0
    (any dtype compared exactly, e.g. bf16 bits as uint16), ``delta(t)`` step t's changed indices and new
    values in the same dtype. Reads each step's delta once: the replays of every k read it back from ``.npy``
    files in a temporary directory under ``scratch`` (None: the system's temporary directory)."""
    start = np.asarray(start).reshape(-1)
    P, C, T = start.shape[0], cells.n_cells, steps
    ks = tuple(int(k) for k in ks)
    window = np.full((len(ks), T, C), -1, dtype=np.int64)
    step = np.zeros((T, C), dtype=np.int64)
    both = np.zeros((T, C), dtype=np.int64)
    times = np.zeros(P, dtype=np.uint16 if T < 2**16 else np.uint32)
    last = np.zeros(P, dtype=bool)
    with tempfile.TemporaryDirectory(prefix="covgrad-trace-", dir=scratch) as tmp:
        paths = {t: (os.path.join(tmp, f"index_{t}.npy"), os.path.join(tmp, f"value_{t}.npy")) for t in range(1, T + 1)}
        for t in range(1, T + 1):
            idx, values = delta(t)
            np.save(paths[t][0], np.asarray(idx, dtype=np.int32 if P < 2**31 else np.int64))
            np.save(paths[t][1], values)
            step[t - 1] = cells.count(idx)
            both[t - 1] = cells.count(idx[last[idx]])
            last[:] = False
            last[idx] = True
            times[idx] += 1
        del last
        hist = _histogram(cells.cell, times, C, T)
        del times

        def replay(t: int) -> tuple[np.ndarray, np.ndarray]:
            return np.load(paths[t][0]), np.load(paths[t][1])

        for ki, k in enumerate(ks):
            if k <= T:
                window[ki, : T - k + 1] = _windows(start, replay, T, k, cells)
    return PersistenceCounts(ks, cells.sizes(), window, step, both, hist)


def _histogram(cell: np.ndarray, times: np.ndarray, C: int, T: int) -> np.ndarray:
    """(C, T + 1) int64 coordinates of each cell (``cell`` (P,)) that changed in exactly c steps (``times``
    (P,)), counted a chunk at a time."""
    hist = np.zeros(C * (T + 1), dtype=np.int64)
    for lo in range(0, cell.shape[0], CHUNK):
        hi = min(cell.shape[0], lo + CHUNK)
        hist += np.bincount(cell[lo:hi].astype(np.int64) * (T + 1) + times[lo:hi], minlength=C * (T + 1))
    return hist.reshape(C, T + 1)


def _windows(start: np.ndarray, delta: StepDelta, T: int, k: int, cells: Cells) -> np.ndarray:
    """(T − k + 1, C) per-cell counts of w_{t+k} ≠ w_t for t = 0..T−k: two cursors k steps apart, their
    mismatch updated at the coordinates each step changes."""
    a, b = start.copy(), start.copy()
    for j in range(1, k + 1):
        idx, val = delta(j)
        b[idx] = val
    mismatch = a != b
    counts = cells.count(np.flatnonzero(mismatch))
    out = [counts.copy()]
    for t in range(1, T - k + 1):
        for cursor, j in ((a, t), (b, t + k)):
            idx, val = delta(j)
            before = mismatch[idx]
            cursor[idx] = val
            after = a[idx] != b[idx]
            mismatch[idx] = after
            counts -= cells.count(idx[before])
            counts += cells.count(idx[after])
        out.append(counts.copy())
    return np.stack(out)


def persistence_tables(counts: PersistenceCounts, cells: Cells) -> dict[str, np.ndarray | tuple[str, ...]]:
    """Fractions per grouping g (``all``, ``kind``, ``tensor``, ``decile``; G groups), float64, NaN where
    undefined (an empty group, a window past the end, step 1's Jaccard):

    - ``dk_{g}`` (K, T, G): d_k(t); ``independent_{g}`` (K, T, G): 1 − Π (1 − d_1) over the window;
    - ``jaccard_{g}`` (T, G): consecutive Jaccard of step t + 1's set with step t's (row 0 NaN);
    - ``hist_{g}`` (G, T + 1) int64: coordinates changed in exactly c steps; ``labels_{g}``: the group names.
    """
    out: dict[str, np.ndarray | tuple[str, ...]] = {}
    K, T = counts.window.shape[:2]
    for g, (labels, to_group) in cells.groupings().items():
        size = (counts.sizes @ to_group).astype(np.float64)  # (G,)
        with np.errstate(invalid="ignore", divide="ignore"):
            window = counts.window @ to_group  # (K, T, G)
            dk = np.where(counts.window[..., :1] >= 0, window / size, np.nan)
            d1 = (counts.step @ to_group) / size  # (T, G)
            log_keep = np.log1p(-np.minimum(d1, 1.0))
            cum = np.vstack([np.zeros((1, d1.shape[1])), np.cumsum(log_keep, axis=0)])  # (T + 1, G)
            independent = np.full((K, T, len(labels)), np.nan)
            for ki, k in enumerate(counts.ks):
                if k <= T:
                    independent[ki, : T - k + 1] = -np.expm1(cum[k:] - cum[: T - k + 1])
            step, both = counts.step @ to_group, counts.both @ to_group
            union = step[1:] + step[:-1] - both[1:]
            jaccard = np.vstack([np.full((1, len(labels)), np.nan), np.where(union > 0, both[1:] / union, np.nan)])
        out.update(
            {
                f"dk_{g}": dk,
                f"independent_{g}": independent,
                f"jaccard_{g}": jaccard,
                f"hist_{g}": to_group.T @ counts.hist,
                f"labels_{g}": labels,
            }
        )
    return out
