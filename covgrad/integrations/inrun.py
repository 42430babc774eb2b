"""In-run statistics: the policy's exact per-sample scores on the trainer's own batch, folded inside the training
process and on the model's device every ``every_n`` steps, with no second job and no checkpoint.

Any trainer calls it between its steps::

    folder = InRunFolder(model, params=None, every_n=10, out_dir="run/inrun")
    for step, batch in enumerate(loader):
        folder.fold(step, batch.input_ids, batch.attention_mask, batch.response_mask, batch.advantages)
        loss = ...; loss.backward(); optimizer.step(); optimizer.zero_grad()

A due step (the first call, then the first step ≥ the last folded step + ``every_n``) runs one forward and one
per-sample backward of the scores stage's engine (:meth:`covgrad.scores.engine.PerSampleGrads.accumulate`, policy
centering :func:`covgrad.scores.centering.score_logit_grad` at the trainer's temperature, each sample's accumulator
row its prompt group's parity, as :func:`covgrad.scores.fold.fold_batches` passes them) into fresh float64 moment
state (:class:`covgrad.moments.accum.MomentAccumulator`), reads the statistics off it with the stats stage's
:func:`covgrad.moments.stats.compute_stats` (every estimator divides by N: F = mean(s²), G = mean(A·s),
Cov = Cov(A, s), ρ = Cov / (std(A)·√Var(s))) and the exact top-q sets by F, |G| and |ρ| with
:func:`covgrad.moments.topk.topk_indices` (ties to the lowest index, NaN never selected). The statistics are read
off the state ``block`` columns at a time (:mod:`covgrad.integrations.blocks`: every statistic is column by column,
so the blocks change no byte), the top sets streamed over the blocks (:class:`covgrad.moments.topk.StreamingTopK`,
exactly ``topk_indices`` of the whole axis). The step's state is its batch alone: the statistics of θ_t on θ_t's
samples, never mixed across steps.

The trainer is left as it was: the engine freezes the parameters during the pass and restores every
``requires_grad`` flag, takes its backward with ``torch.autograd.grad`` (no ``.grad`` is read or written), removes
its hooks when the pass ends (or fails), and draws random numbers from its own generators; the fold runs in eval
mode (dropout off; Hugging Face gradient checkpointing runs in training mode only) and puts every module's own
``training`` flag back (the leaf that ``enable_input_require_grads`` makes of the input embedding's output is a
graph root of the engine's pass, as any output outside the graph).

Files under ``out_dir`` (plain numpy and JSON: ``covgrad`` writes no stores):

- ``step_{t:06d}.npz``: the (P,) float64 vectors named in ``vectors`` (default F, G, rho), and ``top_F``,
  ``top_absG``, ``top_absrho``: the sorted int64 flat indices of the top ceil(q·P) by F, |G|, |ρ| (the arrays
  ``np.savez`` writes, the vectors streamed in block by block);
- ``step_{t:06d}.json``: ``step``, ``N``, ``mean_A``, ``std_A``, ``rho_undefined``, ``bound_violations``, ``q``,
  ``k``, ``seconds`` (the fold and its statistics, not the writes), and per metric the overlap |S_t ∩ S_u| / |S_t|
  with the previous folded step's set (``overlap_prev``, step ``prev_step``) and the first folded step's
  (``overlap_first``, step ``first_step``): NaN when a set is empty (ρ is undefined when std(A) = 0);
- ``inrun.json``: ``every_n``, ``q``, ``temperature``, ``vectors``, ``steps`` (the folded steps) and ``tensors``
  (:meth:`covgrad.layout.ParamLayout.to_records`: the flat axis), rewritten after every fold.

Memory on the model's device: 48 B per selected parameter for the state (``state_dtype="float32"``: 32 B) and the
engine's blocks in flight. On the host: one block's statistics (a few hundred bytes per column of the block), the
top sets' candidates (16 B per candidate, up to 3·2k) and the ``keep`` vectors the returned :class:`InRunStep`
holds (8 B per parameter each, those not written; a written one is a view of its npz member); on disk, while a
step is written, its vectors twice (a temporary ``.npy`` each, then the npz). ``keep=()`` leaves O(block + k).

On-policy distillation (the trainer's batch is the policy's own samples, its objective a teacher's full
distribution) folds with :class:`InRunRegimeFolder`: F of the scores beside the regime's own G and ρ = G/(a√F),
from the teacher's logits of the batch.

The plain hook over it (a trainer's batch mapping, per-token advantages, any group labels) is
:class:`covgrad.integrations.torch.InRunHook`; on the trainer's FSDP2 ranks, each folding its own shard's columns,
:class:`covgrad.integrations.ranks.RankInRunFolder`; ``storage.notebook.open_inrun`` opens the files by step.

Shape notation: B rows of L tokens, P selected parameter elements.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from covgrad.integrations.blocks import BLOCK, SCALARS, StepVectors, column_blocks, merge_scalars
from covgrad.layout import select_parameters
from covgrad.moments.accum import MomentAccumulator
from covgrad.moments.stats import PARAM_STATS, Moments, compute_stats
from covgrad.moments.topk import StreamingTopK, count_for_fraction
from covgrad.regimes.cotangents import Regime, RegimeGrad
from covgrad.regimes.errors import _ratio
from covgrad.regimes.fold import RegimeMoments
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import Cotangent, PerSampleGrads

INDEX = "inrun.json"
METRICS = {"F": "F", "absG": "G", "absrho": "rho"}  # top-set name -> the statistic whose |value| ranks it
VECTORS = ("F", "G", "rho")
REGIME_KINDS = ("distill_reverse_kl", "distill_forward_kl")  # the regimes InRunRegimeFolder folds
REGIME_VECTORS = ("m", "F", "Fvar", "G", "rho")  # its (P,) statistics (no advantages: no Cov)
# ids, attention mask, position ids (B, L) on the device, response weights (B, L) float32 there, advantages (B,)
# float64 and accumulator rows (B,) int64 on the CPU
Batch = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


@dataclass(frozen=True)
class InRunStep:
    """One folded step.

    Attributes:
        step: the trainer's step (optimizer steps taken before the batch).
        stats: :func:`covgrad.moments.stats.compute_stats` of the batch: the scalars ``N``, ``mean_A``, ``std_A``,
            ``rho_undefined``, ``bound_violations`` (a regime fold's ``bound_a2`` too) and the folder's ``keep``
            statistics of ``m``, ``F``, ``Fvar``, ``G``, ``Cov``, ``rho``, each (P,) float64 (a written one a
            read-only view of the step's npz member).
        top: ``F``, ``absG``, ``absrho`` -> sorted (≤ k,) int64 flat indices of the top ceil(q·P).
        summary: what ``step_{t:06d}.json`` holds (scalars and overlaps).
    """

    step: int
    stats: dict[str, Any]
    top: dict[str, np.ndarray]
    summary: dict[str, Any]


def _name(step: int) -> str:
    """The file name of a folded step, without its suffix."""
    return f"step_{step:06d}"


def _overlap(a: np.ndarray, b: np.ndarray | None) -> float:
    """|a ∩ b| / |a| of two sorted index sets; NaN when ``a`` is empty or ``b`` is None or empty."""
    if b is None or len(a) == 0 or len(b) == 0:
        return math.nan
    return len(np.intersect1d(a, b, assume_unique=True)) / len(a)


def statistics(rows: dict[str, np.ndarray]) -> dict[str, Any]:
    """:func:`compute_stats` of an accumulator's rows (:meth:`MomentAccumulator.rows`: (H,) scalars and (H, b)
    state of any b columns: the statistics of those columns, every one column by column), the halves that hold no
    sample left out; std(A) = 0 (one reward for the whole batch) leaves ρ NaN silently (``rho_undefined`` reports
    it)."""
    keep = rows["count"] > 0
    moments = Moments(*(rows[k][keep] for k in ("count", "mean_a", "m2_a", "mean_s", "m2_s", "c_as")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return compute_stats(moments)


class InRunFolder:
    """Exact per-sample score statistics of the trainer's batch, every ``every_n`` steps (module docstring).

    Args:
        model: the policy (a Hugging Face causal LM, or any module the engine takes), on its device.
        params: globs of the parameters to analyse (:func:`covgrad.layout.select_parameters`); None: every
            trainable one.
        every_n: fold the first step, then the first step at least ``every_n`` after the last folded one.
        out_dir: where the per-step files go (created); None: nothing is written (``fold`` still returns).
        q: the fraction of the top sets, in (0, 1].
        temperature: τ of the trainer's log-probabilities (the score is ∇ log softmax(z/τ)).
        vectors: the (P,) statistics written per step (any of ``m, F, Fvar, G, Cov, rho``; () for the sets only).
        state_dtype: ``"float64"`` or ``"float32"`` moment state (:class:`covgrad.moments.accum.MomentAccumulator`).
        check: compare the first fold's summed scores with autograd (one extra forward and backward).
        keep: the (P,) statistics the returned :class:`InRunStep` holds; None: every one (:attr:`STATISTICS`);
            () for the scalars and sets only, host memory O(block + k).
        block: columns of the state read and reduced at a time (≥ 1); one block of ≥ P columns reads it whole.

    Raises:
        ValueError: every_n < 1, q outside (0, 1], block < 1, or a vector or kept statistic not in
            :attr:`STATISTICS`.
    """

    STATISTICS: tuple[str, ...] = PARAM_STATS  # the (P,) statistics of a fold

    def __init__(
        self,
        model: nn.Module,
        params: Sequence[str] | None = None,
        every_n: int = 1,
        out_dir: str | Path | None = None,
        *,
        q: float = 0.01,
        temperature: float = 1.0,
        vectors: Sequence[str] = VECTORS,
        state_dtype: str = "float64",
        check: bool = False,
        keep: Sequence[str] | None = None,
        block: int = BLOCK,
    ) -> None:
        if every_n < 1:
            raise ValueError(f"every_n must be >= 1; got {every_n}")
        count_for_fraction(q, 1)  # refuses q outside (0, 1]
        column_blocks(0, block)  # refuses block < 1
        self.keep = self.STATISTICS if keep is None else tuple(keep)
        for what, names in (("vectors", vectors), ("keep", self.keep)):
            bad = sorted(set(names) - set(self.STATISTICS))
            if bad:
                raise ValueError(f"{what} {bad} are not statistics of this fold; choose from {self.STATISTICS}")
        self.model, self.every_n, self.q, self.temperature = model, int(every_n), float(q), float(temperature)
        self.layout = select_parameters(model, params)
        self.vectors, self.state_dtype, self.check, self.block = tuple(vectors), state_dtype, check, int(block)
        self.out = None if out_dir is None else Path(out_dir)
        if self.out is not None:
            self.out.mkdir(parents=True, exist_ok=True)
        self.steps: list[int] = []
        self._psg: PerSampleGrads | None = None
        self._first: dict[str, np.ndarray] | None = None
        self._prev: dict[str, np.ndarray] | None = None

    def due(self, step: int) -> bool:
        """Whether ``fold`` at ``step`` computes: the first call, or ``every_n`` steps after the last fold."""
        return not self.steps or step >= self.steps[-1] + self.every_n

    def fold(
        self,
        step: int,
        input_ids: Tensor,
        attention_mask: Tensor,
        response_mask: Tensor,
        advantages: Tensor | np.ndarray,
        *,
        position_ids: Tensor | None = None,
        group: Tensor | np.ndarray | None = None,
    ) -> InRunStep | None:
        """The statistics of one batch at the model's current weights when ``step`` is due (else None).

        Args:
            step: the trainer's step (optimizer steps taken before this batch).
            input_ids: (B, L) token ids, any padding side.
            attention_mask: (B, L), 1 on real tokens.
            response_mask: (B, L) weight of each token position as a scored response token (the trainer's loss
                mask, aligned with the tokens: position 0 is never scored).
            advantages: (B,) each row's sequence advantage.
            position_ids: (B, L), or None: each row counts from its first real token (cumsum(mask) − 1), the
                positions of covgrad's rollouts and of an unpadded forward.
            group: (B,) prompt group of each row (the accumulator row is its parity); None: one row.

        Raises:
            ValueError: the batch holds fewer than 2 rows, the shapes disagree, or the engine refuses a parameter.
        """
        if not self.due(step):
            return None
        start = time.perf_counter()
        acc = self._fold(*self._batch(input_ids, attention_mask, response_mask, advantages, position_ids, group))
        return self._finish(int(step), acc, start)

    def _device(self) -> torch.device:
        """The device of the model's first selected parameter (where the state lives)."""
        return dict(self.model.named_parameters())[self.layout.entries[0].name].device

    def _batch(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        response_mask: Tensor,
        advantages: Tensor | np.ndarray,
        position_ids: Tensor | None,
        group: Tensor | np.ndarray | None,
    ) -> Batch:
        """The batch on the model's device: ids, attention mask, position ids (B, L), response weights (B, L)
        float32, advantages (B,) float64 and accumulator rows (B,) int64 on the CPU.

        Raises:
            ValueError: fewer than 2 rows, or advantages that are not (B,).
        """
        device = self._device()
        ids, mask = input_ids.to(device), attention_mask.to(device)
        if position_ids is None:
            position_ids = (mask.long().cumsum(1) - 1).clamp(min=0)
        a = torch.as_tensor(advantages).detach().double().cpu()
        if a.shape != (ids.shape[0],) or ids.shape[0] < 2:
            raise ValueError(f"advantages must be (B,) for B >= 2 rows of input_ids {tuple(ids.shape)}; got {a.shape}")
        half = torch.zeros(len(a), dtype=torch.int64) if group is None else torch.as_tensor(group).cpu().long() % 2
        w = response_mask.to(device=device, dtype=torch.float32)  # the engine's cotangent takes float32 weights
        return ids, mask, position_ids.to(device), w, a, half

    def _fold(self, ids: Tensor, mask: Tensor, position_ids: Tensor, w: Tensor, a: Tensor, half: Tensor) -> Any:
        """One engine pass of the batch (:meth:`_batch`) into fresh state on the model's device."""
        if self._psg is None:
            self._psg = PerSampleGrads(self.model, self.layout, check=self.check)
        acc = MomentAccumulator(self.layout.P, self._device(), self.state_dtype, halves=2)
        self._pass(self._psg, acc, (ids, mask, position_ids, w, a, half))
        return acc

    def _pass(self, psg: PerSampleGrads, acc: Any, batch: Batch) -> None:
        """``psg.accumulate`` of one batch into ``acc`` in eval mode, every module's ``training`` flag restored."""
        ids, mask, position_ids, w, a, half = batch
        with self._eval():
            psg.accumulate(ids, mask, self._score(ids, w), acc, a, half.numpy(), position_ids=position_ids)

    def _score(self, ids: Tensor, w: Tensor) -> Any:
        """The policy-centred score's logit cotangent of the batch (ids and weights (B, L)) at the temperature."""
        return partial(score_logit_grad, input_ids=ids, target_mask=w, temperature=self.temperature)

    @contextmanager
    def _eval(self) -> Iterator[None]:
        """The model in eval mode, every module's own ``training`` flag put back after (or on an error)."""
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        try:
            yield
        finally:
            for m, training in modes:
                m.training = training

    def _finish(self, step: int, state: Any, start: float) -> InRunStep | None:
        """The statistics of the folded ``state`` block by block, the step noted and its files written; ``start``:
        the fold's :func:`time.perf_counter`."""
        written = self.vectors if self.out is not None else ()
        with StepVectors(self.layout.P, written, self.keep, self.out, _name(step)) as vectors:
            scalars, top = self._reduce(state, vectors)
            return self._record(step, scalars, top, vectors, time.perf_counter() - start)

    def _reduce(self, state: Any, vectors: StepVectors) -> tuple[dict[str, Any] | None, dict[str, np.ndarray] | None]:
        """The step's scalars (:data:`covgrad.integrations.blocks.SCALARS`, :meth:`_block`'s, merged over the
        blocks) and the top ceil(q·P) sets by F, |G| and |ρ| (:data:`METRICS`), streamed over the blocks of
        ``block`` columns; each block's statistics put into ``vectors``."""
        tops = {name: StreamingTopK(count_for_fraction(self.q, self.layout.P)) for name in METRICS}
        scalars = None
        for lo, hi in column_blocks(self.layout.P, self.block):
            stats = self._block(state, lo, hi)
            scalars = merge_scalars(scalars, stats, self._scalar_names())
            index = np.arange(lo, hi, dtype=np.int64)
            for name, src in METRICS.items():
                tops[name].push(np.abs(stats[src]), index)
            vectors.put(lo, stats)
        return scalars, {name: top.result()[0] for name, top in tops.items()}

    def _block(self, acc: Any, lo: int, hi: int) -> dict[str, Any]:
        """The statistics (:func:`statistics`) of columns [lo, hi) of the folded state: (hi − lo,) vectors."""
        return statistics(acc.rows(slice(lo, hi)))

    def _scalar_names(self) -> tuple[str, ...]:
        """The scalar statistics of a step."""
        return SCALARS

    def _record(
        self,
        step: int,
        scalars: dict[str, Any] | None,
        top: dict[str, np.ndarray] | None,
        vectors: StepVectors,
        seconds: float,
    ) -> InRunStep | None:
        """The step's summary and overlaps, its files written; None (only the step noted) without statistics."""
        if scalars is None or top is None:
            self.steps.append(step)
            return None
        summary = {
            "step": step,
            **self._scalars(scalars),
            "q": self.q,
            "k": count_for_fraction(self.q, self.layout.P),
            "seconds": seconds,
            "prev_step": self.steps[-1] if self.steps else None,
            "overlap_prev": {m: _overlap(top[m], None if self._prev is None else self._prev[m]) for m in top},
            "first_step": self.steps[0] if self.steps else step,
            "overlap_first": {m: _overlap(top[m], (self._first or top)[m]) for m in top},
        }
        self.steps.append(step)
        self._prev = top
        self._first = self._first or top
        if self.out is not None:
            self._write(step, summary, top, vectors)
        return InRunStep(step, {**scalars, **vectors.kept()}, top, summary)

    def _scalars(self, stats: dict[str, Any]) -> dict[str, Any]:
        """The step file's scalars of the statistics (JSON types)."""
        return {
            "N": int(stats["N"]),
            "mean_A": float(stats["mean_A"]),
            "std_A": float(stats["std_A"]),
            "rho_undefined": bool(stats["rho_undefined"]),
            "bound_violations": int(stats["bound_violations"]),
        }

    def _index(self) -> dict[str, Any]:
        """What ``inrun.json`` holds."""
        return {
            "every_n": self.every_n,
            "q": self.q,
            "temperature": self.temperature,
            "vectors": list(self.vectors),
            "steps": self.steps,
            "tensors": self.layout.to_records(),
        }

    def _write(self, step: int, summary: dict[str, Any], top: dict[str, np.ndarray], vectors: StepVectors) -> None:
        """``step_{t:06d}.npz`` (the written vectors, then the top sets) and ``.json`` of one fold, then the index."""
        assert self.out is not None
        vectors.write(self.out / f"{_name(step)}.npz", {f"top_{m}": idx for m, idx in top.items()})
        (self.out / f"{_name(step)}.json").write_text(json.dumps(summary, indent=1))
        (self.out / INDEX).write_text(json.dumps(self._index()))


class InRunRegimeFolder(InRunFolder):
    """In-run statistics of on-policy distillation against a teacher's full distribution: the trainer's batch is
    the policy's own samples and its objective a full-distribution regime (:data:`REGIME_KINDS`, docs/regimes.md
    R3), every ``every_n`` steps as :class:`InRunFolder` folds them.

    A due step runs one forward and two per-sample backwards (:meth:`PerSampleGrads.accumulate_many`): the
    policy-centred score into a :class:`MomentAccumulator` (advantages 0), whose statistics give m, F = mean(s²)
    and Fvar, and the regime's cotangent (:class:`covgrad.regimes.cotangents.RegimeGrad` with the teacher's logits)
    into a :class:`covgrad.regimes.fold.RegimeMoments`, whose mean is the regime's G = mean_n g_n (the ascent
    direction of −Σ_t KL: a step follows +G, up to the trainer's normalisation) and whose bound scalar gives
    a² = mean_n c²_n. Then ρ = G / (a·√F), with |ρ| ≤ 1 in expectation (the regimes stage's ρ), and
    ``bound_violations`` counts the coordinates with |G| > a·√F (in-sample they are possible: the bound holds in
    expectation). The top sets rank F, |G| and |ρ|.

    The files are :class:`InRunFolder`'s, with ``mean_A`` and ``std_A`` NaN (the batch has no advantages), and
    ``bound_a2`` (a²) and ``regime`` (its kind) added to each step's JSON; ``inrun.json`` adds ``regime`` (kind,
    temperature, teacher_temperature). Memory: two states (the score's and the regime's), each about
    :class:`InRunFolder`'s, and the teacher's (B, L, V) logits beside the policy's.

    Args:
        model: the policy, on its device.
        regime: the objective (its ``temperature`` is the score's too).
        params, every_n, out_dir, q, state_dtype, check, block: as :class:`InRunFolder`.
        vectors: the (P,) statistics written per step, any of :data:`REGIME_VECTORS`.
        keep: the (P,) statistics the returned :class:`InRunStep` holds, any of :data:`REGIME_VECTORS`; None:
            every one.

    Raises:
        ValueError: a regime not in :data:`REGIME_KINDS`, a vector or kept statistic not in
            :data:`REGIME_VECTORS`, or as :class:`InRunFolder`.
    """

    STATISTICS = REGIME_VECTORS

    def __init__(
        self,
        model: nn.Module,
        regime: Regime,
        params: Sequence[str] | None = None,
        every_n: int = 1,
        out_dir: str | Path | None = None,
        *,
        q: float = 0.01,
        vectors: Sequence[str] = VECTORS,
        state_dtype: str = "float64",
        check: bool = False,
        keep: Sequence[str] | None = None,
        block: int = BLOCK,
    ) -> None:
        if regime.kind not in REGIME_KINDS:
            raise ValueError(f"in-run regime {regime.kind!r} is not one of {REGIME_KINDS}")
        super().__init__(
            model,
            params,
            every_n,
            out_dir,
            q=q,
            temperature=regime.temperature,
            vectors=vectors,
            state_dtype=state_dtype,
            check=check,
            keep=keep,
            block=block,
        )
        self.regime = regime

    def fold(  # the teacher's logits take the advantages' place
        self,
        step: int,
        input_ids: Tensor,
        attention_mask: Tensor,
        response_mask: Tensor,
        teacher_logits: Tensor,
        *,
        position_ids: Tensor | None = None,
        group: Tensor | np.ndarray | None = None,
    ) -> InRunStep | None:
        """The statistics of one batch at the model's current weights when ``step`` is due (else None).

        Args:
            step, input_ids, attention_mask, response_mask, position_ids: as :meth:`InRunFolder.fold`.
            teacher_logits: (B, L, V) the teacher's logits of the same rows (aligned like the policy's: position
                t predicts token t + 1), any device and float dtype.
            group: (B,) prompt group of each row (the accumulator row is its parity, and the regime's groups);
                None: one row, every sample its own group.

        Raises:
            ValueError: as :meth:`InRunFolder.fold`, or teacher logits of another shape than the policy's.
        """
        if not self.due(step):
            return None
        start = time.perf_counter()
        B = input_ids.shape[0]
        zeros = torch.zeros(B, dtype=torch.float64)
        ids, mask, pos, w, a, half = self._batch(input_ids, attention_mask, response_mask, zeros, position_ids, group)
        fn = RegimeGrad(self.regime, ids, w, teacher_logits=teacher_logits.detach().to(ids.device))
        if self._psg is None:
            self._psg = PerSampleGrads(self.model, self.layout, check=self.check)
        device = self._device()
        scores = MomentAccumulator(self.layout.P, device, self.state_dtype, halves=2)
        regime = RegimeMoments(self.layout.P, device, self.state_dtype, halves=2)
        halves = half.numpy()
        groups = None if group is None else np.asarray(torch.as_tensor(group).cpu())
        with self._eval():
            cotangents = [Cotangent(self._score(ids, w), scores, a, halves), regime.cotangent(fn, halves, group=groups)]
            self._psg.accumulate_many(ids, mask, cotangents, position_ids=pos)
        return self._finish(int(step), (scores, regime), start)

    def _block(self, state: Any, lo: int, hi: int) -> dict[str, Any]:
        """Columns [lo, hi) of the score's m, F, Fvar, the regime's G and ρ = G/(a√F) (each (hi − lo,)), a², and
        the block's bound violations; ``state``: the score's :class:`MomentAccumulator` and the
        :class:`RegimeMoments`."""
        scores, regime = state
        cols = slice(lo, hi)
        stats = statistics(scores.rows(cols))
        del stats["Cov"]  # Cov(A, s) with no advantages: not a statistic of this fold
        G = regime.gradient(cols=cols)  # every half's samples
        a2 = regime.bound_a2()  # a full-distribution regime has its a² (float)
        bound = np.sqrt(a2 * stats["F"])
        rho = _ratio(G, bound)
        stats.update(
            G=G,
            rho=rho,
            bound_a2=a2,
            mean_A=math.nan,
            std_A=math.nan,
            rho_undefined=not bool(np.isfinite(rho).any()),
            bound_violations=int(np.count_nonzero(np.abs(G) > bound * (1 + 1e-6))),
        )
        return stats

    def _scalar_names(self) -> tuple[str, ...]:
        """The scalar statistics of a step, a² included."""
        return (*SCALARS, "bound_a2")

    def _scalars(self, stats: dict[str, Any]) -> dict[str, Any]:
        """:meth:`InRunFolder._scalars`, with the regime's kind and a² = ``bound_a2``."""
        return {**super()._scalars(stats), "regime": self.regime.kind, "bound_a2": float(stats["bound_a2"])}

    def _index(self) -> dict[str, Any]:
        """:meth:`InRunFolder._index`, with the regime."""
        r = self.regime
        regime = {"kind": r.kind, "temperature": r.temperature, "teacher_temperature": r.teacher_temperature}
        return {**super()._index(), "regime": regime}
