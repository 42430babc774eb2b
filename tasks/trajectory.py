"""trajectory stage: K optimizer steps of one regime from the policy, checked against step-0 predictions.

Stepping, records and predictors: ``covgrad.updates``; the step source (fixed models, step-0 statistics, data):
``tasks/jobs/trajectory.py``; files: ``storage/stores/trajectory.py``. Loss: rl's REINFORCE loss or that of the
configured regime ``trajectory.regime`` (``StepLoss``). Data: ``"on_policy"`` draws fresh samples from the current
policy every step (the analysed sampler's settings), rewards them with the task's reward and gives them group
advantages; ``"fixed"`` steps on minibatches of ``scores.groups_per_batch`` prompt groups of fixed rollouts (the
analysed ones, or the regime's sampler's; the sft regimes always step on fixed data). Predictors: F of the main
statistics; G and ρ of the main statistics for rl, of the regime's own otherwise. With ``scores.ranks`` local ranks
the model is sharded over them (``tasks/jobs/trajectory_ranks.py``), same bytes.

Resumable by step: each step's packed changed set, its new values and its record are written, then its progress
mark; every ``state_every`` steps (and at the last) the resume state (weights, optimizer and tracker state) is
stored, so a killed run restarts from the newest state and ends byte-identical to an uninterrupted one. Once every
step is done, the k-step persistence arrays are counted from the stored trace. Hugging Face checkpoints of the
analysed model are written at ``checkpoint_steps`` (steps floor(r**i) and K, r = ``checkpoint_ratio``).

External runs (``trajectory.checkpoints``, ``trajectory.deltas``): nothing is stepped; the run's checkpoint series
or grail delta trace (``storage/stores/external.py``) is read in its stored dtype from its start, model.path, and
each of its states after the start is one row.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from prefect import task

from covgrad.layout import ParamLayout, check_layout, parameters_flat, select_parameters
from covgrad.updates import (
    ChangeTracker,
    OptimizerSpec,
    Stepper,
    StepZeroStats,
    bf16_rounded,
    checkpoint_records,
    checkpoint_steps,
    load_trajectory_state,
    run_trajectory,
    stored_dtype,
    trajectory_state,
    value_bits,
)
from storage.artifacts import ArtifactRef, ArtifactStore, create_progress, mark_batch_done
from storage.checkpoints import checkpoint_dtype, load_state_dict
from storage.identity import check_computed_on
from storage.models import load_model, load_models
from storage.schema import STATS
from storage.schema import TRAJECTORY as STORE
from storage.stores.external import checkpoint_series, delta_trace, replay_deltas
from storage.stores.trajectory import (
    checkpoint_name,
    create_changed,
    drop_state,
    finish_store,
    read_records,
    read_state,
    write_persistence,
    write_start,
    write_state,
    write_step,
    write_summary,
)
from tasks.common import StageResult, log, progress_bar, run_stage
from tasks.jobs.trajectory import optimizer_spec, step_loss, step_source, step_zero_stats
from tasks.jobs.trajectory_ranks import run_trajectory_ranks
from tasks.specs import TrajectorySpec


def _compute(store: ArtifactStore, ref: ArtifactRef, spec: TrajectorySpec, up: dict[str, ArtifactRef]) -> dict:
    s = spec.settings
    st = store.open_group(up["stats"], STATS, mode="r")
    if st.attrs.get("degenerate"):
        raise ValueError(
            f"trajectory: the main statistics are degenerate ({st.attrs['degenerate']}); "
            "their predictors are undefined, so the trajectory is not run"
        )
    external = s.checkpoints is not None or s.deltas is not None
    if not external and spec.placement.ranks > 1:  # the model sharded over ranks
        return _finish(store, ref, spec, run_trajectory_ranks(store, ref, spec, up))
    start, tokenizer = load_models(store, up["base_model"], "policy", spec.policy)
    start = start.float()
    layout = select_parameters(start, spec.params)
    check_layout(layout, ParamLayout.from_records(st.attrs["tensors"]), "trajectory")
    stats, opt = step_zero_stats(store, spec, up), optimizer_spec(s)
    if external:
        return _external(store, ref, spec, up, layout, stats, opt, start)
    loss = step_loss(store, up["base_model"], spec.policy, s.regime, spec.regime, up.get("teacher"))
    stepper = Stepper(bf16_rounded(start, layout), opt, s.precision, loss, s.minibatches)
    bound = spec.regime is None or spec.regime.kind != "sft_sampled"
    tracker = ChangeTracker(layout, stepper.flat(layout), opt, stats, bound)
    reference = load_models(store, up["base_model"], "policy", spec.policy)[0].float()
    reference = bf16_rounded(reference).to(stored_dtype(s.precision))
    source = step_source(store, spec, up, tokenizer, loss)

    g = store.open_group(ref, STORE, mode="a")
    create_changed(g, s.steps, layout.P)
    create_progress(g, STORE, s.steps)
    write_start(store, ref, value_bits(tracker.start))
    state = read_state(store, ref)
    if state is not None:
        load_trajectory_state(state, stepper, tracker, s.seed)
    saved = set(checkpoint_steps(s.steps, s.checkpoint_ratio))
    with progress_bar(f"trajectory {ref.key[:8]}", s.steps, unit="step") as bar:
        bar.update(stepper.step)
        for rec in run_trajectory(stepper, source, layout, s.steps, tracker, reference):
            t = rec["step"]
            write_step(store, ref, g, t, rec.pop("changed"), rec.pop("changed_values"), rec)
            if t in saved:
                with store.local_dir(ref, checkpoint_name(t), write=True) as d:
                    stepper.model.save_pretrained(d)
                    tokenizer.save_pretrained(d)
            mark_batch_done(g, t - 1)
            if t % s.state_every == 0 or t == s.steps:
                write_state(store, ref, trajectory_state(stepper, tracker, s.seed))
            bar.update(1)
    return _finish(store, ref, spec, layout)


def _finish(store: ArtifactStore, ref: ArtifactRef, spec: TrajectorySpec, layout: ParamLayout) -> dict:
    """The per-step arrays and the summary of a stepped trajectory from its records; its resume states deleted."""
    s, g = spec.settings, store.open_group(ref, STORE, mode="a")
    records = read_records(store, ref, s.steps)
    finish_store(g, records, layout)
    persistence = write_persistence(store, ref, g, layout, s.steps)
    last = records[-1]
    summary = {
        "regime": s.regime,
        "kind": "rl" if spec.regime is None else spec.regime.kind,
        "optimizer": s.optimizer,
        "precision": s.precision,
        "lr": s.lr,
        "P": layout.P,
        "steps": s.steps,
        "frac_changed_step_mean": float(np.mean([r["n_changed_step"] for r in records]) / layout.P),
        "frac_changed_cum_final": last["n_changed_cum"] / layout.P,
        "reward_first": records[0]["reward"],
        "reward_last": last["reward"],
        "kl_last": last["kl"],
        "checkpoints": checkpoint_steps(s.steps, s.checkpoint_ratio),
        "persistence": persistence,
    }
    write_summary(store, ref, g, layout, summary)
    drop_state(store, ref)
    fractions = summary["frac_changed_step_mean"], summary["frac_changed_cum_final"]
    log.info("trajectory %s: %d steps, per-step changed %.4f, cumulative %.4f", ref.key, s.steps, *fractions)
    return summary


@dataclass(frozen=True)
class _ExternalRun:
    """An external run as the stage analyses it: ``layout`` (the series' layout, or ``grail deltas``), the
    ``start`` (its label, its step and its (P,) selected weights in the run's stored dtype), the trainer ``steps``
    after it and ``later``, (step, (P,) weights) in that order, and the trainer's ``logged`` values per step."""

    layout: str
    start: str
    start_step: int
    start_weights: torch.Tensor
    steps: list[int]
    later: Iterator[tuple[int, torch.Tensor]]
    logged: dict[int, dict[str, float]] | None = None


def _external(
    store: ArtifactStore,
    ref: ArtifactRef,
    spec: TrajectorySpec,
    up: dict[str, ArtifactRef],
    layout: ParamLayout,
    stats: StepZeroStats,
    opt: OptimizerSpec,
    policy: torch.nn.Module,
) -> dict:
    """The trajectory analysis of an external run, from the checkpoints of ``trajectory.checkpoints``
    (:func:`_series_run`) or the delta trace of ``trajectory.deltas`` (:func:`_delta_run`), which start at the
    policy (its main statistics are the step-0 predictors); row i of the store is the change from the run's
    (i − 1)-th state to its i-th, ``step`` the trainer's step. Recomputed whole on a rerun (no training state)."""
    s = spec.settings
    run = _series_run(spec, layout, policy) if s.deltas is None else _delta_run(spec, layout, policy)
    source = s.checkpoints if s.deltas is None else s.deltas
    setting = "trajectory.checkpoints" if s.deltas is None else "trajectory.deltas"
    what = f"{setting}: the step-0 statistics were not computed on the first checkpoint {run.start}"
    fix = "set model.path to it so the step-0 statistics are the first checkpoint's"
    check_computed_on(store, up["stats"].key, dict(policy.named_parameters()), what, fix)
    K = len(run.steps)
    tracker = ChangeTracker(layout, run.start_weights, opt, stats)
    g = store.open_group(ref, STORE, mode="a")
    create_changed(g, K, layout.P)
    create_progress(g, STORE, K)
    write_start(store, ref, value_bits(run.start_weights))
    with progress_bar(f"trajectory {ref.key[:8]}", K, unit="checkpoint") as bar:
        for i, rec in enumerate(checkpoint_records(run.later, tracker, run.logged), start=1):
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
    }
    write_summary(store, ref, g, layout, summary)
    cum = summary["frac_changed_cum_final"]
    log.info(
        "trajectory %s: external run (%s layout, %d steps from %s, %s), cumulative %.4f",
        ref.key,
        run.layout,
        K,
        run.start,
        str(run.start_weights.dtype).removeprefix("torch."),
        cum,
    )
    return summary


def _series_run(spec: TrajectorySpec, layout: ParamLayout, policy: torch.nn.Module) -> _ExternalRun:
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
    return _ExternalRun(series.layout, start, start_step, origin, steps, later, series.logged)


def _delta_run(spec: TrajectorySpec, layout: ParamLayout, policy: torch.nn.Module) -> _ExternalRun:
    """The grail delta trace of ``trajectory.deltas`` (``storage.stores.external.delta_trace``), replayed from its
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
    return _ExternalRun("grail deltas", trace.start, 0, start, steps, replay_deltas(trace, shapes, layout, start))


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


@task(name="trajectory")
def trajectory_task(ref: ArtifactRef, spec: TrajectorySpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """K optimizer steps of one regime from the policy, each step's changed set against the step-0 predictors."""
    return run_stage(ref, spec, lambda store, r: _compute(store, r, spec, upstream), resumable=True)
