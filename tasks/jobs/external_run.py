"""An external run for the trajectory stage: its checkpoint series (``trajectory.checkpoints``) or grail delta
trace (``trajectory.deltas``) read in step order, starting at the policy, and its records and k-step arrays
written into the trajectory store (:func:`external_run`); with ``trajectory.history``, the trainer's logged
columns and, where the history gives every step's learning rate, the Adam drift rule (:class:`DriftRule`); with
``trajectory.inrun``, the trainer's in-run statistics as predictors at the latest folded step and at the first
(:class:`InRunRule`). Recomputed whole on a rerun: no training state.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from covgrad.layout import ParamLayout, parameters_flat
from covgrad.progress import Progress
from covgrad.updates import (
    ChangeTracker,
    OptimizerSpec,
    StepZeroStats,
    checkpoint_records,
    value_bits,
)
from covgrad.updates.tracking import SCOPES, SERIES_PREDICTORS, SeriesRanking, count_metrics
from storage.artifacts import ArtifactRef, ArtifactStore, create_progress, mark_batch_done
from storage.checkpoints import checkpoint_dtype, load_state_dict
from storage.identity import check_computed_on
from storage.models import load_model
from storage.schema import TRAJECTORY as STORE
from storage.stores.external import checkpoint_series, delta_trace, replay_deltas
from storage.stores.history import History, read_history
from storage.stores.inrun import InRunSeries, inrun_series
from storage.stores.trajectory import (
    create_changed,
    finish_store,
    read_records,
    write_persistence,
    write_start,
    write_step,
    write_summary,
)
from tasks.specs import TrajectorySpec

log = logging.getLogger("covgrad")
LOGGED = ("lr", "loss", "grad_norm")  # the history columns covgrad.updates.checkpoint_records writes itself


@dataclass(frozen=True)
class ExternalRun:
    """An external run as the stage analyses it: ``layout`` (the series' layout, or the delta trace's), the
    ``start`` (its label, its step and its (P,) selected weights in the run's stored dtype), the trainer ``steps``
    after it and ``later``, (step, (P,) weights) in that order, and the trainer's ``logged`` values per step."""

    layout: str
    start: str
    start_step: int
    start_weights: torch.Tensor
    steps: list[int]
    later: Iterator[tuple[int, torch.Tensor]]
    logged: dict[int, dict[str, float]] | None = None


def external_run(
    store: ArtifactStore,
    ref: ArtifactRef,
    spec: TrajectorySpec,
    up: dict[str, ArtifactRef],
    layout: ParamLayout,
    stats: StepZeroStats,
    opt: OptimizerSpec,
    policy: torch.nn.Module,
    progress: Callable[..., Progress],
) -> dict:
    """The trajectory analysis of an external run, from the checkpoints of ``trajectory.checkpoints``
    (:func:`series_run`) or the delta trace of ``trajectory.deltas`` (:func:`delta_run`), which start at the
    policy (its main statistics are the step-0 predictors); row i of the store is the change from the run's
    (i − 1)-th state to its i-th, ``step`` the trainer's step; ``progress`` the stage's progress bar factory.
    Returns the summary written into the store."""
    s = spec.settings
    history = None if s.history is None else read_history(s.history)  # a malformed file fails before any load
    series = None if s.inrun is None else inrun_series(s.inrun)
    columns = None if series is None else series.columns(layout)  # a disagreeing layout fails before any load
    run = series_run(spec, layout, policy) if s.deltas is None else delta_run(spec, layout, policy)
    source = s.checkpoints if s.deltas is None else s.deltas
    setting = "trajectory.checkpoints" if s.deltas is None else "trajectory.deltas"
    what = f"{setting}: the step-0 statistics were not computed on the first checkpoint {run.start}"
    fix = "set model.path to it so the step-0 statistics are the first checkpoint's"
    check_computed_on(store, up["stats"].key, dict(policy.named_parameters()), what, fix)
    K = len(run.steps)
    tracker = ChangeTracker(layout, run.start_weights, opt, stats)
    drift, notes = rule_notes(tracker, history, run)
    inrun = None if series is None else InRunRule(series, columns, tracker)
    g = store.open_group(ref, STORE, mode="a")
    create_changed(g, K, layout.P)
    create_progress(g, STORE, K)
    write_start(store, ref, value_bits(run.start_weights))
    with progress(f"trajectory {ref.key[:8]}", K, unit="checkpoint") as bar:
        for i, rec in enumerate(run_records(run, tracker, history, drift, inrun), start=1):
            write_step(store, ref, g, i, rec.pop("changed"), rec.pop("changed_values"), rec)
            mark_batch_done(g, i - 1)
            bar.update(1)
    records = read_records(store, ref, K)
    finish_store(g, records, layout)
    persistence = write_persistence(store, ref, g, layout, K)
    summary = {
        "external": source,
        "external_layout": run.layout,
        "start": run.start,
        "trainer_steps": [run.start_step, *run.steps],
        "P": layout.P,
        "steps": K,
        "frac_changed_step_mean": float(np.mean([r["n_changed_step"] for r in records]) / layout.P),
        "frac_changed_cum_final": records[-1]["n_changed_cum"] / layout.P,
        "persistence": persistence,
        "dtype": str(run.start_weights.dtype).removeprefix("torch."),
    }
    if history is not None:
        summary["history"] = {"path": history.path, "format": history.format, "keys": history.keys}
        summary["rules"] = notes
        log.info("trajectory %s: history %s (%s), rules: %s", ref.key, history.path, history.format, notes)
    if inrun is not None:
        summary["inrun"] = inrun.summary(records)
        folded = inrun.series.steps
        log.info("trajectory %s: in-run series %s, %d folded steps", ref.key, inrun.series.path, len(folded))
    write_summary(store, ref, g, layout, summary)
    return summary


def run_records(
    run: ExternalRun,
    tracker: ChangeTracker,
    history: History | None,
    drift: DriftRule | None,
    inrun: InRunRule | None,
) -> Iterator[dict]:
    """The records of external run ``run`` in step order (``covgrad.updates.checkpoint_records``), each with the
    logged columns of ``history`` beyond lr, loss and grad_norm (NaN where the step logged none), the drift rule's
    (``drift``) and the in-run predictors' (``inrun``: ranked at the state before each record, before the tracker
    records it)."""
    logged = run.logged if history is None else history.values
    columns = [] if history is None else [c for c in history.keys if c not in LOGGED]

    def later() -> Iterator[tuple[int, torch.Tensor]]:
        before = run.start_step
        for step, weights in run.later:
            if inrun is not None:
                inrun.before(before, tracker.prev)  # the tracker's weights: the state before this record
            yield step, weights
            before = step

    for rec in checkpoint_records(later(), tracker, logged):
        step_log = {} if history is None else history.values.get(rec["step"], {})
        rec.update({c: step_log.get(c, math.nan) for c in columns})
        if drift is not None:
            rec.update(drift.record(rec["step"]))
        if inrun is not None:
            rec.update(inrun.record(rec))
        yield rec


SLOTS = ("latest", "first")  # the in-run predictors: the latest folded step before a record, the first folded step


class InRunRule:
    """The in-run series' predictors of an external run: for each record (the change from state s_{i−1} to s_i, trainer
    steps), the top-k by F_u, |G_u|, |ρ_u| of folded step u (the statistics of θ_u on the trainer's batch at u), for
    u the latest folded step ≤ s_{i−1} (``latest``: the newest statistics available before the record's updates,
    no later batch) and the first folded step when it is ≤ s_{i−1} (``first``: usually step 0, the in-run twin of the
    step-0 predictors), at k = the changed set's size (so precision = recall), exact with ties to the lowest column
    and NaN last (:class:`covgrad.updates.tracking.SeriesRanking`). Scopes: ``step``, the record's changed set;
    ``cum``, the coordinates changed since the slot's anchor, the first recorded state at or after u (w_{s_i} ≠
    w_anchor; for u = a recorded step the weights at u). Before any folded step ≤ s_{i−1} a slot's metrics are NaN.

    ``series``: the checked folder; ``columns``: its column of each analysed column (``InRunSeries.columns``; None:
    the same axis); ``tracker``: the run's tracker (its column files hold the rankings; its ``prev`` and ``last``
    are read around each record). Memory: each slot's anchor weights (P, stored dtype) and one (P,) float64 vector
    while a slot is ranked; on disk 5 B per column per predictor and slot."""

    def __init__(self, series: InRunSeries, columns: np.ndarray | None, tracker: ChangeTracker) -> None:
        self.series, self.columns, self.tracker = series, columns, tracker
        self.ranking = SeriesRanking(tracker.files, tracker.n, tracker.chunk)
        self.used: dict[str, int | None] = dict.fromkeys(SLOTS)  # the folded step each slot holds
        self.anchor: dict[str, torch.Tensor] = {}
        self.history: dict[str, list[int | None]] = {slot: [] for slot in SLOTS}  # per record, the folded step used

    def before(self, state: int, weights: torch.Tensor) -> None:
        """Rank the slots for the next record, whose earlier state is trainer step ``state`` with (P,) ``weights``
        (stored dtype): a slot whose folded step changed is ranked again and anchored at ``weights``."""
        ready = [u for u in self.series.steps if u <= state]
        want = {"latest": ready[-1] if ready else None, "first": ready[0] if ready else None}
        for slot in reversed(SLOTS):  # first, then latest (which reuses first's ranking at the same step)
            u = want[slot]
            if u is not None and u != self.used[slot]:
                if slot == "latest" and u == self.used["first"]:
                    self.ranking.slots[slot] = self.ranking.slots["first"]
                    self.anchor[slot] = self.anchor["first"]
                else:
                    readers = {name: self._reader(u, name) for name in SERIES_PREDICTORS}
                    self.ranking.rank(slot, readers)
                    self.anchor[slot] = weights.clone()
                self.used[slot] = u

    def _reader(self, step: int, name: str) -> Callable[[], np.ndarray]:
        return lambda: self.series.ranked(step, name, self.columns)

    def record(self, rec: dict) -> dict[str, float]:
        """``{scope}_inrun_{slot}_{predictor}_{precision,recall,jaccard,size}`` of the record the tracker has just
        made (``rec``: its ``n_changed_step``; the step set is ``tracker.last``, the new weights ``tracker.prev``)."""
        out: dict[str, float] = {}
        now = self.tracker.prev
        for slot in SLOTS:
            self.history[slot].append(self.used[slot])
            if self.used[slot] is None:
                out.update(
                    {
                        f"{scope}_inrun_{slot}_{name}_{stat}": math.nan
                        for scope in SCOPES
                        for name in SERIES_PREDICTORS
                        for stat in ("precision", "recall", "jaccard", "size")
                    }
                )
                continue
            sets = {"step": (self.tracker.last, int(rec["n_changed_step"])), "cum": self._since(now, slot)}
            for scope, (true, k) in sets.items():
                for name, both in self.ranking.overlaps(slot, true, k).items():
                    out.update({f"{scope}_inrun_{slot}_{name}_{s}": v for s, v in count_metrics(k, k, both).items()})
        return out

    def _since(self, now: torch.Tensor, slot: str) -> tuple[np.ndarray, int]:
        """(P,) bool the coordinates of ``now`` that differ from the slot's anchor, and their count."""
        anchor = self.anchor[slot]
        out = np.empty(now.shape[0], dtype=bool)
        for lo in range(0, now.shape[0], self.tracker.chunk):
            hi = min(now.shape[0], lo + self.tracker.chunk)
            out[lo:hi] = (now[lo:hi] != anchor[lo:hi]).numpy()
        return out, int(np.count_nonzero(out))

    def summary(self, records: list[dict]) -> dict:
        """The series' part of the summary: its folder and folded steps, the folded step each slot used per record,
        and per scope the mean precision over the records where the latest slot is defined of each slot's
        predictors and of the step-0 ones (``step0``), a record whose set is empty left out: how much predicting at
        the latest folded step beats step 0."""
        defined = [i for i, u in enumerate(self.history["latest"]) if u is not None]
        means = {}
        for scope in SCOPES:
            for name in SERIES_PREDICTORS:
                keys = {slot: f"{scope}_inrun_{slot}_{name}_precision" for slot in SLOTS}
                keys["step0"] = f"{scope}_{name}_precision"
                for label, key in keys.items():
                    values = [v for i in defined if math.isfinite(v := records[i].get(key, math.nan))]
                    means[f"{scope}_{label}_{name}"] = float(np.mean(values)) if values else math.nan
        return {
            "path": self.series.path,
            "folded_steps": list(self.series.steps),
            **self.history,
            "mean_precision": means,
        }


ABSORB = (
    "not run: it predicts a step's set from that step's minibatch gradient g (lr·|g| ≥ h(w) with SGD, "
    "lr·|g|/(|g| + eps) ≥ h(w) with Adam), which no tracker logs"
)
BOUND = (
    "not run: lr·a·√F ≥ h(w) needs each step's advantage RMS a, which no tracker logs, at the weights before each step"
)


def rule_notes(
    tracker: ChangeTracker, history: History | None, run: ExternalRun
) -> tuple[DriftRule | None, dict[str, str]]:
    """The rules of ``tracker``'s optimizer an external run with ``history`` gets: the drift rule (Adam/AdamW) when
    the history logs the learning rate of every step from the run's start to its last (:class:`DriftRule`), else
    None; and per rule ``run: ...`` or ``not run: <why>``. The absorption and SGD bound rules need what no tracker
    logs (each step's gradient, its advantage RMS)."""
    notes = {"absorb": ABSORB}
    if "bound" in tracker.rules:
        notes["bound"] = BOUND
    if not tracker.drift or history is None:
        return None, notes
    steps = range(run.start_step + 1, run.steps[-1] + 1)
    lrs = {t: history.values.get(t, {}).get("lr", math.nan) for t in steps}
    missing = [t for t, lr in lrs.items() if not math.isfinite(lr)]
    if missing:
        shown = ", ".join(map(str, missing[:5])) + (", …" if len(missing) > 5 else "")
        notes["drift"] = (
            f"not run: the history has no lr at {len(missing)} of steps {steps[0]}..{steps[-1]} ({shown}); the "
            "drift model sums every step's lr"
        )
        return None, notes
    notes["drift"] = (
        f"run: reach at Σ lr and Σ lr² over the logged lr of steps {steps[0]}..{steps[-1]}, one optimizer step per "
        "logged step (records {step,cum}_drift_rule_*)"
    )
    return DriftRule(tracker, run.start_weights, run.start_step, lrs), notes


class DriftRule:
    """The Adam drift rule of an external run from its logged learning rates: a coordinate is predicted changed by
    trainer step t when the drift model's reach (``covgrad.updates.tracking.drift_reach``) at the sums Σ lr_j and
    Σ lr_j² over steps j ≤ t has crossed a midpoint w_0 ± h(w_0), and in the step set of a checkpoint when it
    crossed one more since the previous checkpoint: the union, over the steps between two checkpoints, of the
    stepped run's per-step rule (``ChangeTracker.drift_rule_counts``).

    ``tracker``: the run's tracker with the drift model (its column file ``c``), read after each record for the
    changed sets; ``start``: (P,) the start weights, stored dtype; ``lrs``: trainer step -> lr for every step
    after ``start_step``."""

    def __init__(self, tracker: ChangeTracker, start: torch.Tensor, start_step: int, lrs: dict[int, float]) -> None:
        self.tracker, self.start, self.lrs = tracker, start, lrs
        self.last = start_step  # the step of the previous checkpoint
        self.sums = (0.0, 0.0)  # Σ lr and Σ lr² through it

    def record(self, step: int) -> dict[str, float]:
        """``{scope}_drift_rule_{precision,recall,jaccard,size}`` of checkpoint ``step`` (the tracker has recorded
        it), for scope in (step, cum), and the sums moved on to it."""
        gap = [self.lrs[t] for t in range(self.last + 1, step + 1)]
        after = (self.sums[0] + sum(gap), self.sums[1] + sum(lr * lr for lr in gap))
        counts = self.tracker.drift_rule_counts(self.start, self.sums, after)
        self.last, self.sums = step, after
        return {
            f"{scope}_drift_rule_{stat}": value
            for scope in SCOPES
            for stat, value in count_metrics(*(int(x) for x in counts[scope])).items()
        }


def series_run(spec: TrajectorySpec, layout: ParamLayout, policy: torch.nn.Module) -> ExternalRun:
    """The checkpoint series of ``trajectory.checkpoints`` (``storage.stores.external.checkpoint_series``),
    compared in the stored dtype of its last checkpoint (which every checkpoint after the start shares; the start
    is rounded to it). The start is the first checkpoint when it is model.path in that dtype, else model.path
    itself at step 0 when the series has no step 0 (the trainer's own checkpoints begin after a step)."""
    setting = f"trajectory.checkpoints {spec.settings.checkpoints!r}"
    series = checkpoint_series(spec.settings.checkpoints)
    names = [e.name for e in layout.entries]
    dtype = _compared_dtype(series.checkpoints[-1][1], names)

    def flat(directory: str, start: bool = False) -> torch.Tensor:
        """(P,) the checkpoint's selected weights in ``dtype``, which it must store unless it is the ``start``."""
        if not start:
            _check_dtype(directory, names, dtype)
        model = load_model(directory, "float32", spec.policy.trust_remote_code)  # bf16 and float32 both exact
        return _selected(model, layout, f"checkpoint {directory}").to(dtype)

    t0, d0 = series.checkpoints[0]
    first = flat(d0, start=True)
    origin = parameters_flat(policy, layout).to(dtype)
    if torch.equal(first, origin):
        start, start_step, rest = d0, t0, series.checkpoints[1:]
        later: Iterator[tuple[int, torch.Tensor]] = ((t, flat(d)) for t, d in rest)
    elif t0 > 0:
        _check_dtype(d0, names, dtype)
        start, start_step, rest = spec.policy.path or "model.path (the demo policy)", 0, series.checkpoints
        later = itertools.chain([(t0, first)], ((t, flat(d)) for t, d in rest[1:]))
    else:
        raise ValueError(
            f"trajectory.checkpoints: the first checkpoint {d0} is not model.path in {dtype}; set model.path to it "
            "so the step-0 statistics are the first checkpoint's"
        )
    if not rest:
        raise ValueError(f"{setting} holds only the start {start}; a series needs a checkpoint after it")
    steps = [t for t, _ in rest]
    return ExternalRun(series.layout, start, start_step, origin, steps, later, series.logged)


def delta_run(spec: TrajectorySpec, layout: ParamLayout, policy: torch.nn.Module) -> ExternalRun:
    """The delta trace of ``trajectory.deltas`` (``storage.stores.external.delta_trace``), replayed from its
    start weights, which must be model.path's in the trace's dtype."""
    trace = delta_trace(spec.settings.deltas)
    base = load_state_dict(trace.start)
    for e in layout.entries:
        if e.name not in base or tuple(base[e.name].shape) != e.shape:
            raise ValueError(
                f"trajectory.deltas: the start weights {trace.start} hold no tensor {e.name!r} of shape {e.shape}, "
                "which model.path has"
            )
    start = torch.cat([base[e.name].detach().reshape(-1).to(trace.dtype) for e in layout.entries])
    if not torch.equal(start, parameters_flat(policy, layout).to(trace.dtype)):
        raise ValueError(
            f"trajectory.deltas: the start weights {trace.start} are not model.path's in {trace.dtype}; set "
            "model.path to the model the traced run started from"
        )
    shapes = {name: tuple(p.shape) for name, p in policy.named_parameters()}
    steps = [t + 1 for t, _ in trace.files]
    later = replay_deltas(trace, shapes, layout, start)
    return ExternalRun(trace.layout, trace.start, trace.start_step, start, steps, later)


def _compared_dtype(directory: str, names: list[str]) -> torch.dtype:
    """The stored dtype of checkpoint ``directory``'s tensors ``names``: bf16 or float32 (ValueError naming it
    otherwise)."""
    dtype = checkpoint_dtype(directory, names)
    if dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"trajectory.checkpoints: {directory} stores {dtype}; covgrad compares bf16 or float32")
    return dtype


def _check_dtype(directory: str, names: list[str], dtype: torch.dtype) -> None:
    """ValueError naming checkpoint ``directory`` unless it stores its tensors ``names`` in ``dtype``, the
    series' dtype."""
    own = checkpoint_dtype(directory, names)
    if own != dtype:
        raise ValueError(
            f"trajectory.checkpoints: {directory} stores {own}, the series' last checkpoint {dtype}; the "
            "checkpoints after the start share one stored dtype"
        )


def _selected(model: torch.nn.Module, layout: ParamLayout, what: str) -> torch.Tensor:
    """(P,) the layout's parameters of ``model``; ValueError naming ``what`` when one is missing or reshaped."""
    params = dict(model.named_parameters())
    for e in layout.entries:
        if e.name not in params or tuple(params[e.name].shape) != e.shape:
            raise ValueError(f"trajectory.checkpoints: {what} has no parameter {e.name!r} of shape {e.shape}")
    return parameters_flat(model, layout)
