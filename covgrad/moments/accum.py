"""Score moments accumulated on the scores' device: O(P) state per parity half, merged batch by batch.

The scores stage never keeps a (B, P) block of scores longer than needed: each parameter tensor's
per-sample block (B, n) is folded into the accumulators as soon as it is complete, and dropped. The
state of half h (the cross-fit's prompt-group parity) is one moment row in the format of
:class:`covgrad.moments.stats.Moments`: the sample count, the mean advantage and Σ(a − ā)², and per parameter
the mean score, ``m2_s`` = Σ(s − s̄)² and ``c_as`` = Σ(a − ā)(s − s̄), so ``covgrad.moments.stats`` merges the
rows of several shards exactly as it merged the per-batch rows.

Merge (Chan's update): a batch of b samples of half h, shifted by a common K (the running mean, or the
batch's first sample before the first batch), gives S1 = Σd, S2 = Σd², SA = Σ(a − ā_b)d with d = s − K
(two GEMMs with the (2H, b) indicator/advantage matrix, one pass for d²). Then with n_old samples
before and n = n_old + b after, δ = K + S1/b − mean_old:
    mean += δ·b/n,   m2 += (S2 − S1²/b) + δ²·n_old·b/n,   c += (SA − S1·Σ(a − ā_b)/b) + δ·Δā·n_old·b/n.

``state_dtype=float64`` (default): 24 bytes per parameter per half (16 without the co-moment). ``float32``:
the mean is kept as an unevaluated float32 pair (hi + lo, error-free TwoSum renormalisation, so the shift
K = hi stays within rounding of the true mean and δ is accurate even when mean/std is 1e4), m2 and c as
float32 sums of non-negative-dominated per-batch terms (relative error ≲ batches·6e-8): 16 bytes per
parameter per half.

Two implementations of the same update. The compiled fold (``torch.compile``: C++ on CPU, Triton on cuda,
from the one function :func:`_fold_started`) reads each block once and does the shift, the three sums of
every half and the merge in one kernel, in float64 whatever the state dtype; on the CPU with float64 state
it is the native kernel of :mod:`covgrad.moments.native_fold` (the same formulas, each half summed over its own
rows, a fifth of the per-call cost) whenever that builds. The eager fold (column tiles,
two GEMMs, the merge as (H, n) torch ops) serves a half's first samples, and everything when compiling
fails. A state without the co-moment (``comoment=False``: the advantages are all 0, as for a regime's g_n)
keeps no ``c`` and forms neither of its sums: a third less state, state traffic and arithmetic.
Compiling costs tens of seconds per process and state dtype (dynamo and AOT tracing run again even
when inductor's cache is warm), more than a small run's whole fold, so by default the compiled fold takes
over only once the state holds samples × P ≥ ``_COMPILE_AFTER`` element-folds (about as much eager folding
as a compile costs). The switch depends on the state alone, so a resumed run switches at the same batch
as an uninterrupted one and ends with the same bytes.

Shape notation: H halves (rows), B samples in a batch, P parameter elements, n columns of one tensor.
"""

from __future__ import annotations

import functools
import threading
import warnings
from typing import Any

import numpy as np
import torch
from torch import Tensor

from covgrad.moments.native_fold import native_fold

STATE_DTYPES = {"float64": torch.float64, "float32": torch.float32}

# Columns per fold step: bounds the transient (B, columns) state-dtype buffers. CPU: small enough to stay
# in cache; accelerators: large enough that a step is a few big kernels.
FOLD_ELEMENTS = {"cpu": 1 << 17, "cuda": 1 << 26}

# Columns per call of the compiled fold: its kernel keeps per-column sums of every half (6 × columns × 8
# bytes), so a tied embedding's block (V × H columns, 28M for SmolLM2) is folded in tiles of 32 MiB of sums
# instead of 1.4 GB at once. Every column's arithmetic is the same whatever the tile (tested bit for bit).
_COMPILED_COLUMNS = 1 << 22

# The compiled fold on the CPU with float64 state: the native kernel (covgrad.moments.native_fold) when it builds, else
# torch.compile of _fold_started (the kernel every other device and state dtype compiles; tests switch this off
# to run it on the CPU).
NATIVE_CPU = True

# Samples already in the state × P from which the compiled fold runs by default: ~4.3e9 element-folds,
# 10-20 s of eager folding on a CPU, about what a compile costs. The demo (N·P ≈ 6e7) never compiles.
_COMPILE_AFTER = 1 << 32


def _fold_started(
    x: Tensor,
    wa: Tensor,
    coef: Tensor,
    mean: list[Tensor],
    m2: list[Tensor],
    c: list[Tensor] | None,
    lo: list[Tensor] | None,
) -> None:
    """Merge a block into state whose halves all have earlier samples, in place, in one pass (compiled).

    Args:
        x: (B, n) float32 per-sample block.
        wa: (B, 2H) float64: column h is 1 where the sample belongs to half h, column H + h its a − ā_b there.
        coef: (5, H) float64 per half: 1/b, b/n, n_old·b/n, n_old·b/n·(ā_b − ā_old), Σ(a − ā_b)/b.
        mean, m2, c: per half h, its (n,) state columns (float64, or float32 with ``lo`` the low halves of
            the means); ``c`` None without the co-moment (its sums are then never formed). One row per
            argument, not (H, n) views: the kernel then updates them in place (stacked rows would cost
            extra buffers and copy loops).
    """
    H = wa.shape[1] // 2
    K = mean[0].to(torch.float64, copy=True)  # the shift: half 0's mean before this batch (hi part for float32)
    d = x.to(torch.float64) - K  # (B, n), never materialised by the compiled kernel
    dd = d * d
    # Σd, Σd² (and Σ(a − ā_b)d) over all samples and over halves 0..H-2; the last half's are the differences
    # (fewer products per element: the kernel is bound by its arithmetic once the block is in cache).
    total = [d.sum(0), dd.sum(0)]
    sums = [[(wa[:, h, None] * d).sum(0), (wa[:, h, None] * dd).sum(0)] for h in range(H - 1)]
    if c is not None:
        total.append((wa[:, H:].sum(1, keepdim=True) * d).sum(0))  # each sample's a − ā_b in its own half
        for h, s in enumerate(sums):
            s.append((wa[:, H + h, None] * d).sum(0))
    sums.append([t - sum(s[k] for s in sums) for k, t in enumerate(total)])
    for h, hs in enumerate(sums):
        s1, s2 = hs[0], hs[1]
        rel = s1 * coef[0, h]  # batch mean − K
        m2b = (s2 - s1 * rel).clamp(min=0)
        old = mean[h].to(torch.float64)
        delta = (K - old) + rel if lo is None else ((K - old) - lo[h].to(torch.float64)) + rel
        ch = None if c is None else (hs[2] - s1 * coef[4, h]) + coef[3, h] * delta
        if lo is None:
            m2[h].add_(m2b + (coef[2, h] * delta) * delta)
            if ch is not None:
                c[h].add_(ch)
            mean[h].add_(coef[1, h] * delta)
            continue
        m2[h].copy_(m2[h].to(torch.float64) + (m2b + (coef[2, h] * delta) * delta))
        if ch is not None:
            c[h].copy_(c[h].to(torch.float64) + ch)
        full = (old + lo[h].to(torch.float64)) + coef[1, h] * delta  # split into its nearest float32 and the rest
        hi = full.to(torch.float32)
        mean[h].copy_(hi)
        lo[h].copy_(full - hi.to(torch.float64))


def state_bytes_per_param(state_dtype: str, halves: int = 2, comoment: bool = True) -> int:
    """Bytes of moment state per parameter element over ``halves`` rows: the mean, M2 and (``comoment``)
    the co-moment, and the mean's low part for float32, in ``state_dtype``; 48 (float64) or 32 (float32)
    for two halves with the co-moment, 32 or 24 without."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype {state_dtype!r} is not supported; use one of {sorted(STATE_DTYPES)}")
    arrays = (3 if state_dtype == "float32" else 2) + comoment
    return halves * arrays * STATE_DTYPES[state_dtype].itemsize


def _fold_bare(
    x: Tensor, wa: Tensor, coef: Tensor, mean: list[Tensor], m2: list[Tensor], lo: list[Tensor] | None
) -> None:
    """:func:`_fold_started` without the co-moment: a function of its own, so that its compiled variants
    have their own cache (dynamo's recompile limit counts per function)."""
    _fold_started(x, wa, coef, mean, m2, None, lo)


_compiled_fold: Any = None
_compile_lock = threading.Lock()  # dynamo's compile caches are not thread-safe (dask workers may run threads)


def _compiled() -> Any:
    """The compiled :func:`_fold_started` (one per process; shapes are symbolic, so one compile per state dtype
    and with or without the co-moment)."""
    global _compiled_fold
    if _compiled_fold is None:
        # C++ on CPU: let the compiler fuse a·b + c into FMAs (one rounding instead of two, and fewer instructions)
        options = {"cpp.enable_floating_point_contract_flag": "fast"}
        full = torch.compile(_fold_started, dynamic=True, options=options)
        bare = torch.compile(_fold_bare, dynamic=True, options=options)

        def fold(
            x: Tensor, wa: Tensor, coef: Tensor, mean: list[Tensor], m2: list[Tensor], c: list[Tensor] | None, lo: Any
        ) -> None:
            if c is None:
                bare(x, wa, coef, mean, m2, lo)
            else:
                full(x, wa, coef, mean, m2, c, lo)

        _compiled_fold = fold
    return _compiled_fold


class MomentAccumulator:
    """Running per-half moments of per-sample scores and advantages, on one device.

    Args:
        P: parameter elements (flat axis of the layout).
        device: where the (H, P) state lives; folded blocks must be on it.
        state_dtype: ``"float64"`` or ``"float32"`` (see the module docstring for the error model).
        halves: H, the number of independent rows (2: the prompt-group parity halves).
        compiled: True: the compiled fold for every batch whose halves all have samples; False: never;
            None: once the state holds samples × P >= ``_COMPILE_AFTER`` (see the module docstring).
        switch_P: the P in that product (default ``P``). The columns of one parameter block of a larger
            selection pass the selection's P, so that every block switches at the same batch as the
            unblocked run and blocks never change a byte.
        comoment: keep ``c`` (False: samples whose advantage is always 0, such as a regime's g_n; ``c``
            is then None, a third less state and arithmetic).

    Attributes:
        count, mean_a, m2_a: shape (H,) float64 numpy, samples, mean advantage and Σ(a − ā)² per half.
        mean, m2, c: shape (H, P) tensors of ``state_dtype`` on ``device``: mean score (the hi part
            for float32), Σ(s − s̄)² and Σ(a − ā)(s − s̄) (None without the co-moment).
        mean_lo: shape (H, P) float32 low part of the mean (float32 state only), else None.
        fold_path: the fold for merges of started batches: ``"compiled"`` (forced, or since the switch),
            ``"eager"``, ``"eager until …"`` (before the switch) or ``"eager (compile failed: …)"``.
    """

    def __init__(
        self,
        P: int,
        device: torch.device | str,
        state_dtype: str = "float64",
        halves: int = 2,
        compiled: bool | None = None,
        switch_P: int | None = None,
        comoment: bool = True,
    ) -> None:
        if state_dtype not in STATE_DTYPES:
            raise ValueError(f"state_dtype {state_dtype!r} is not supported; use one of {sorted(STATE_DTYPES)}")
        if P < 0 or halves < 1:
            raise ValueError(f"P must be >= 0 and halves >= 1; got P={P}, halves={halves}")
        self.P, self.H = P, halves
        self.device = torch.empty(0, device=device).device  # 'cuda' -> 'cuda:0', as tensors report it
        self.dtype = STATE_DTYPES[state_dtype]
        self.state_dtype = state_dtype
        self.count = np.zeros(halves)
        self.mean_a = np.zeros(halves)
        self.m2_a = np.zeros(halves)
        self.mean = torch.zeros(halves, P, dtype=self.dtype, device=self.device)
        self.m2 = torch.zeros_like(self.mean)
        self.comoment = comoment
        self.c = torch.zeros_like(self.mean) if comoment else None
        self.mean_lo = torch.zeros_like(self.mean) if self.dtype == torch.float32 else None
        self._batch: _Batch | None = None
        self._work: tuple[Tensor, ...] | None = None
        self._fold_elements = FOLD_ELEMENTS.get(self.device.type, 1 << 22)
        # samples × P from which the compiled fold runs (None: never)
        self._compile_from = {None: _COMPILE_AFTER, True: 0, False: None}[compiled]
        self.switch_P = P if switch_P is None else switch_P
        self.fold_path = "compiled" if compiled else "eager"
        if compiled is None:
            self.fold_path = f"eager until samples × P >= {_COMPILE_AFTER:.2g}, then compiled"

    @property
    def bytes_per_param(self) -> int:
        """Device bytes of state per parameter element (all halves)."""
        return state_bytes_per_param(self.state_dtype, self.H, self.comoment)

    def begin_batch(self, advantages: Tensor | np.ndarray, half: Tensor | np.ndarray) -> None:
        """Start a batch: its advantages (B,) and each sample's half (B,) integers in [0, H)."""
        a = np.asarray(torch.as_tensor(advantages).cpu(), dtype=np.float64)
        h = np.asarray(torch.as_tensor(half).cpu(), dtype=np.int64)
        if a.ndim != 1 or h.shape != a.shape or a.size < 1:
            raise ValueError(f"advantages and half must both be (B,) with B >= 1; got {a.shape} and {h.shape}")
        if h.min() < 0 or h.max() >= self.H:
            raise ValueError(f"half values must lie in [0, {self.H}); got range [{h.min()}, {h.max()}]")
        if self._batch is not None:
            raise ValueError("begin_batch called twice; call end_batch after folding every tensor")
        self._batch = _Batch(a, h, self)

    def wants(self, offset: int, n: int) -> bool:
        """Whether folding columns [offset, offset + n) changes this state: always (every column is kept)."""
        return True

    def by_column(self) -> bool:
        """Whether the started batch's folds compute every column on its own (the native kernel), so that one fold
        of many tensors' columns gives the bytes of one fold per tensor; the eager fold's GEMMs round a column
        by the width of their call."""
        batch = self._batch
        return batch is not None and batch.native is not None and self._compile_from is not None

    def row_spans(self, offset: int, first: int, end: int, row: int) -> list[tuple[int, int]] | None:
        """The rows of a tensor whose row chunks to form on a grid of their own (see
        :meth:`covgrad.distributed.fsdp.ShardAccumulator.row_spans`): None, every tensor's chunks on its own grid."""
        return None

    def fold(self, offset: int, block: Tensor) -> None:
        """Fold one tensor's per-sample block (B, n) (any float dtype) into columns [offset, offset + n)."""
        batch = self._batch
        if batch is None:
            raise ValueError("fold called outside a batch; call begin_batch first")
        B = block.shape[0]
        n = block.numel() // B if B else 0
        if B != batch.B or offset < 0 or offset + n > self.P:
            raise ValueError(
                f"block of {B} samples × {n} columns at offset {offset} does not fit the batch of {batch.B} "
                f"and P={self.P}"
            )
        block = block.reshape(B, n)
        if batch.native is not None and 0 < n <= _COMPILED_COLUMNS and self._compile_from is not None:
            # the native kernel on the whole block: what _fold_compiled runs on its one tile, without the lookups
            x = block.to(torch.float32).contiguous()
            batch.native(x, batch.order, batch.offsets, batch.acen, batch.coef64, self.mean, self.m2, self.c, offset)
            self.fold_path = "compiled"
            return
        done = 0  # columns folded by the compiled kernel, tile by tile (all of them unless compiling fails)
        if batch.compiled:
            while done < n and self._compile_from is not None:
                tile = block[:, done : done + _COMPILED_COLUMNS]
                if not self._fold_compiled(batch, offset + done, tile):
                    break
                done += tile.shape[1]
        step = max(1, self._fold_elements // B)
        for j in range(done, n, step):
            self._fold_columns(batch, offset + j, block[:, j : j + step])

    def _fold_compiled(self, batch: _Batch, offset: int, block: Tensor) -> bool:
        """The compiled fold of a started batch's block; False (and the eager fold from then on) when
        compiling fails, which happens before the kernel touches any state. On the CPU with float64 state it is
        the native kernel (:mod:`covgrad.moments.native_fold`) when it builds."""
        native = native_fold() if NATIVE_CPU and self.device.type == "cpu" and self.mean_lo is None else None
        if native is not None:
            x = block.to(torch.float32).contiguous()
            native(x, batch.order, batch.offsets, batch.acen, batch.coef64, self.mean, self.m2, self.c, offset)
            self.fold_path = "compiled"
            return True
        cols = slice(offset, offset + block.shape[1])
        mean, m2, c, lo = (
            None if t is None else [t[h, cols] for h in range(self.H)]
            for t in (self.mean, self.m2, self.c, self.mean_lo)
        )
        try:
            with torch.no_grad(), _compile_lock:
                _compiled()(block.to(torch.float32).contiguous(), batch.wa, batch.coef64, mean, m2, c, lo)
        except torch.OutOfMemoryError:
            raise
        except Exception as err:  # any failure to compile: no C++ compiler, no Triton, a dynamo gap
            self._compile_from = None
            self.fold_path = f"eager (compile failed: {type(err).__name__}: {(str(err) or '?').splitlines()[0][:120]})"
            warnings.warn(f"MomentAccumulator: {self.fold_path}", RuntimeWarning, stacklevel=3)
            return False
        self.fold_path = "compiled"
        return True

    def _fold_columns(self, batch: _Batch, p0: int, x: Tensor) -> None:
        cols = slice(p0, p0 + x.shape[1])
        first = batch.first
        K = x[0].to(self.dtype) if self.count[first] == 0 else self.mean[first, cols].clone()  # (n,)
        B, n = x.shape
        d, lin, sums = self._workspace(B, n)
        if d.is_cuda:  # (B, n) in the state dtype: x is converted exactly, then K subtracted (same bits both ways)
            torch.sub(x, K, out=d)  # one kernel
        else:
            d.copy_(x).sub_(K)  # copy then subtract beats the mixed-dtype sub 2x on CPU
        rows = 2 * self.H if self.comoment else self.H
        torch.mm(batch.weights[:rows], d, out=lin[:rows])  # (2H, n): rows h: Σ_h d; rows H + h: Σ_h (a − ā_b) d
        torch.mm(batch.weights[: self.H], d.mul_(d), out=sums)  # (H, n): Σ_h d²
        s1, sa = lin[: self.H], lin[self.H :]
        if batch.started:
            self._merge_all(batch, cols, K, s1, sums, sa)
            return
        for h in batch.active:  # a half's first samples: its state starts at the batch's moments
            nb = batch.nb[h]
            m2b = (sums[h] - s1[h] * s1[h] / nb).clamp_(min=0)
            cb = sa[h] - s1[h] * (batch.ac_sum[h] / nb)
            if self.count[h] == 0:
                self.m2[h, cols] = m2b
                if self.c is not None:
                    self.c[h, cols] = cb
                self._set_mean(
                    self.mean[h, cols], None if self.mean_lo is None else self.mean_lo[h, cols], K, s1[h] / nb
                )
                continue
            w, f = nb / (self.count[h] + nb), self.count[h] * nb / (self.count[h] + nb)
            self._merge(cols, slice(h, h + 1), K, s1[h] / nb, m2b, cb, w, f, f * batch.d_a[h])

    def _merge_all(self, batch: _Batch, cols: slice, K: Tensor, s1: Tensor, s2: Tensor, sa: Tensor) -> None:
        """Chan-merge the batch sums of every half at once ((H, n) ops; halves without samples get
        exact zero updates)."""
        inv_nb, w, f, fda, acs = batch.coef  # each (H, 1)
        rel = s1 * inv_nb  # (H, n) batch mean − K
        m2b = (s2 - s1 * rel).clamp_(min=0)  # Σd² ≥ (Σd)²/b exactly; the clip only removes rounding below 0
        cb = sa - s1 * acs
        self._merge(cols, slice(None), K, rel, m2b, cb, w, f, fda)

    def _merge(
        self, cols: slice, rows: slice, K: Tensor, rel: Tensor, m2b: Tensor, cb: Tensor, w: Any, f: Any, fda: Any
    ) -> None:
        """state[rows, cols] ⊕ batch moments: rel = batch mean − K, m2b, cb the batch's centered sums,
        w = b/n, f = n_old·b/n, fda = f·(ā_b − ā_old)."""
        old = self.mean[rows, cols]
        delta = (K - old) + rel if self.mean_lo is None else ((K - old) - self.mean_lo[rows, cols]) + rel
        self.m2[rows, cols] += m2b + (f * delta) * delta
        if self.c is not None:
            self.c[rows, cols] += cb + fda * delta
        if self.mean_lo is None:
            old += w * delta
        else:
            self._set_mean(old, self.mean_lo[rows, cols], old.clone(), self.mean_lo[rows, cols] + w * delta)

    @staticmethod
    def _set_mean(hi_out: Tensor, lo_out: Tensor | None, base: Tensor, add: Tensor) -> None:
        """hi_out = base + add; for the float32 state (``lo_out`` given) as an error-free pair (TwoSum)."""
        if lo_out is None:
            torch.add(base, add, out=hi_out)
            return
        hi = base + add
        bp = hi - base
        lo_out.copy_((base - (hi - bp)) + (add - bp))
        hi_out.copy_(hi)

    def _workspace(self, B: int, n: int) -> tuple[Tensor, Tensor, Tensor]:
        """Reused buffers (B, n), (2H, n), (H, n) of the state dtype: fresh large allocations would page-fault
        on every fold step."""
        rows = (B, 2 * self.H, self.H)
        cols = max(n, min(self.P, max(1, self._fold_elements // B)))
        if self._work is None or any(w.numel() < r * n for w, r in zip(self._work, rows, strict=True)):
            # grown per buffer: a later batch of fewer samples folds more columns at once (its step is wider)
            old = self._work or (None,) * 3
            self._work = tuple(
                torch.empty(max(r * cols, 0 if w is None else w.numel()), dtype=self.dtype, device=self.device)
                for w, r in zip(old, rows, strict=True)
            )
        return tuple(w[: r * n].view(r, n) for w, r in zip(self._work, rows, strict=True))

    def end_batch(self) -> None:
        """Commit the batch's advantage moments (after every tensor of the batch is folded)."""
        batch = self._batch
        if batch is None:
            raise ValueError("end_batch called outside a batch")
        for h in batch.active:
            nb, n_old = batch.nb[h], self.count[h]
            n = n_old + nb
            if n_old == 0:
                self.mean_a[h], self.m2_a[h] = batch.mean_a[h], batch.m2_a[h]
            else:
                self.m2_a[h] += batch.m2_a[h] + batch.d_a[h] ** 2 * n_old * nb / n
                self.mean_a[h] += batch.d_a[h] * nb / n
            self.count[h] = n
        self._batch = None

    def abort_batch(self) -> None:
        """Forget a batch whose folds failed (the state must then be restored from a checkpoint)."""
        self._batch = None

    def rows(self, cols: slice = slice(None)) -> dict[str, np.ndarray]:
        """The state as host numpy: ``count, mean_a, m2_a`` (H,) float64 and ``mean_s, m2_s, c_as``
        (H, columns) in the state dtype (no ``c_as`` without the co-moment; plus ``mean_s_lo`` for float32
        state)."""
        out = {"count": self.count.copy(), "mean_a": self.mean_a.copy(), "m2_a": self.m2_a.copy()}
        out["mean_s"] = self.mean[:, cols].cpu().numpy()
        out["m2_s"] = self.m2[:, cols].cpu().numpy()
        if self.c is not None:
            out["c_as"] = self.c[:, cols].cpu().numpy()
        if self.mean_lo is not None:
            out["mean_s_lo"] = self.mean_lo[:, cols].cpu().numpy()
        return out

    def load(self, rows: dict[str, np.ndarray], cols: slice = slice(None)) -> None:
        """Restore state written by :meth:`rows`: the scalars and (H, columns) arrays at ``cols`` it holds."""
        for name in ("count", "mean_a", "m2_a"):
            if name in rows:
                getattr(self, name)[:] = rows[name]
        pairs = [("mean_s", self.mean), ("m2_s", self.m2), ("c_as", self.c), ("mean_s_lo", self.mean_lo)]
        for name, t in pairs:
            if t is None:
                continue
            if name in rows:
                t[:, cols] = torch.from_numpy(np.ascontiguousarray(rows[name])).to(self.device, self.dtype)


class _Batch:
    """Per-batch constants of the merge: per-half counts, advantage moments, the GEMM weights."""

    def __init__(self, a: np.ndarray, half: np.ndarray, acc: MomentAccumulator) -> None:
        H = acc.H
        self.B = len(a)
        self.nb = np.bincount(half, minlength=H).astype(np.float64)
        self.active = [h for h in range(H) if self.nb[h] > 0]
        self.first = int(half[0])
        self.mean_a = np.zeros(H)
        self.m2_a = np.zeros(H)
        self.ac_sum = np.zeros(H)
        self.d_a = np.zeros(H)
        weights = np.zeros((2 * H, self.B))
        for h in self.active:
            sel = half == h
            ah = a[sel]
            ra = ah - ah[0]
            self.mean_a[h] = ah[0] + ra.sum() / self.nb[h]
            ac = ra - ra.sum() / self.nb[h]  # a − ā_b, shifted first so that it does not cancel
            self.m2_a[h] = ac @ ac
            self.ac_sum[h] = ac.sum()
            self.d_a[h] = self.mean_a[h] - acc.mean_a[h] if acc.count[h] > 0 else 0.0
            weights[h, sel] = 1.0
            weights[H + h, sel] = ac
        self._weights, self._device, self._dtype = weights, acc.device, acc.dtype  # (2H, B), see weights
        # every half has earlier samples: one vectorised merge for all halves, with these (H, 1) factors
        self.started = bool((acc.count > 0).all())
        ready = acc._compile_from is not None and acc.count.sum() * acc.switch_P >= acc._compile_from
        self.compiled = self.started and ready  # this batch's started merges run the compiled fold
        # the compiled fold's native CPU kernel (MomentAccumulator._fold_compiled), looked up once per batch
        cpu64 = NATIVE_CPU and acc.device.type == "cpu" and acc.mean_lo is None
        self.native = native_fold() if self.compiled and cpu64 else None
        n_old, nbs = acc.count, np.maximum(self.nb, 1)
        n = np.maximum(n_old + self.nb, 1)
        coef = np.stack([1 / nbs, self.nb / n, n_old * self.nb / n, n_old * self.nb / n * self.d_a, self.ac_sum / nbs])
        self._coef = coef  # (5, H) float64
        self.coef64 = torch.from_numpy(coef).to(acc.device)  # (5, H) float64, the compiled fold's
        # the native fold's view of the same: the samples ordered by half, where each half starts, a − ā_b
        order = np.argsort(half, kind="stable")
        self.order = torch.from_numpy(order.astype(np.int64))
        self.offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(self.nb)]).astype(np.int64))
        self.acen = torch.from_numpy(np.ascontiguousarray(weights[H + half, np.arange(self.B)]))

    # The eager fold's and the torch.compile kernel's tensors, made on first use (the native kernel needs none).

    @functools.cached_property
    def weights(self) -> Tensor:
        """(2H, B) in the state dtype: row h is 1 where the sample belongs to half h, row H + h its a − ā_b there."""
        return torch.from_numpy(self._weights).to(self._device, self._dtype)

    @functools.cached_property
    def coef(self) -> Tensor:
        """(5, H, 1) in the state dtype: the merge's per-half factors (see :func:`_fold_started`)."""
        return torch.from_numpy(self._coef[:, :, None]).to(self._device, self._dtype)

    @functools.cached_property
    def wa(self) -> Tensor:
        """(B, 2H) float64: :attr:`weights` transposed, the torch.compile kernel's."""
        return torch.from_numpy(np.ascontiguousarray(self._weights.T)).to(self._device)


PRODUCT_SUMS = ("cuda",)
"""Device types whose :class:`GroupAccumulator` forms the groups' sums as a (C, B) @ (B, n) product: cuda's
``index_add_`` adds in no fixed order. Elsewhere ``index_add_`` (4× faster on the CPU); tests add "cpu" here
to run the product on the CPU."""


class GroupAccumulator(MomentAccumulator):
    """Moments of each prompt group's sum of the per-sample rows: the group c of a batch, with n_c samples, is
    folded as one row S_c = Σ_{i∈c} x_i whose advantage is n_c.

    The samples of one prompt are not independent (they share the prompt, and in RL a group-relative
    advantage), so the standard error of a mean over them is the prompt-clustered one, from the spread of the
    groups' sums: for the C groups of a half, n = Σ n_c samples and the mean G = Σ S_c / n,
        se² = C/(C − 1) · Σ_c (S_c − n_c·G)² / n²,   Σ_c (S_c − n_c G)² = m2_S − 2G·c_nS + G²·m2_n
    (:func:`covgrad.regimes.errors.clustered_mean_se`; ``comoment`` keeps c_nS, needed for groups of several sizes:
    with one size m2_n and c_nS are 0). With one sample per group it is the independent-samples error. The
    state is a :class:`MomentAccumulator`'s over groups: ``count`` groups, ``mean_a`` the mean group size,
    ``mean`` the mean S_c; G = mean / mean_a. Folding C group rows instead of B sample rows costs one
    pass over each block for the sums (an ``index_add_``, in row order, or a product: :data:`PRODUCT_SUMS`) and
    a fold of C rows.

    Before each batch, :meth:`set_groups` gives its samples' group ids; every group's samples lie in one
    batch (``covgrad.rollouts.batch.group_batches``) and one half.

    Args:
        P, device, state_dtype, halves, compiled, switch_P: as :class:`MomentAccumulator`.
        comoment: keep c_nS (groups of several sizes); without it, groups of another size than the first
            are refused.
    """

    def __init__(
        self,
        P: int,
        device: torch.device | str,
        state_dtype: str = "float64",
        halves: int = 2,
        compiled: bool | None = None,
        switch_P: int | None = None,
        comoment: bool = False,
    ) -> None:
        super().__init__(P, device, state_dtype, halves, compiled, switch_P, comoment)
        self._next: np.ndarray | None = None
        self._indicator: Tensor | None = None  # (C, B) float32 for a product, else the (B,) int64 group index

    def set_groups(self, group: Tensor | np.ndarray) -> None:
        """The group id of each sample (B,) of the next batch."""
        self._next = np.asarray(torch.as_tensor(group).cpu(), dtype=np.int64)

    def begin_batch(self, advantages: Tensor | np.ndarray, half: Tensor | np.ndarray) -> None:
        """Start a batch of B samples with halves ``half`` (B,) whose groups :meth:`set_groups` gave; the
        samples' ``advantages`` are not used (each group's advantage is its size)."""
        group, self._next = self._next, None
        h = np.asarray(torch.as_tensor(half).cpu(), dtype=np.int64)
        if group is None or group.shape != h.shape:
            shape = None if group is None else group.shape
            raise ValueError(f"set_groups before each batch with the (B,) = {h.shape} group ids; got {shape}")
        ids, inverse = np.unique(group, return_inverse=True)
        group_half = np.zeros(len(ids), np.int64)
        group_half[inverse] = h
        split = np.flatnonzero(group_half[inverse] != h)
        if split.size:
            raise ValueError(f"prompt group {ids[inverse[split[0]]]} has samples in two halves; give a group one half")
        sizes = np.bincount(inverse, minlength=len(ids)).astype(np.float64)
        found = sorted(set(sizes.tolist()) | set(self.mean_a[self.count > 0].tolist()))
        if not self.comoment and len(found) > 1:
            raise ValueError(f"prompt groups of sizes {found}; make the accumulator with comoment=True")
        super().begin_batch(sizes, group_half)
        if self.device.type in PRODUCT_SUMS:
            index = np.zeros((len(ids), len(h)), np.float32)  # (C, B) 0/1
            index[inverse, np.arange(len(h))] = 1.0
        else:
            index = inverse.astype(np.int64)
        self._indicator = torch.from_numpy(index).to(self.device)

    def fold(self, offset: int, block: Tensor) -> None:
        """Fold the groups' sums (C, n) of one tensor's per-sample block (B, n) into columns [offset, offset + n)."""
        index, batch = self._indicator, self._batch
        if index is None or batch is None:
            raise ValueError("fold called outside a batch; call set_groups and begin_batch first")
        B = index.shape[-1] if index.dim() == 2 else index.shape[0]
        if block.shape[0] != B:
            raise ValueError(f"block of {block.shape[0]} samples does not fit the batch of {B}")
        rows = block.reshape(B, -1).to(torch.float32)
        if index.dim() == 2:
            sums = index @ rows
        else:
            sums = torch.zeros(batch.B, rows.shape[1], dtype=torch.float32, device=rows.device)
            sums.index_add_(0, index, rows)
        super().fold(offset, sums)

    def end_batch(self) -> None:
        """Commit the batch."""
        super().end_batch()
        self._indicator = None

    def abort_batch(self) -> None:
        """Forget the batch."""
        super().abort_batch()
        self._indicator = None
