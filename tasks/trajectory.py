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

from typing import Any

import numpy as np
from prefect import task

from covgrad.devices import release_free_memory
from covgrad.layout import ParamLayout, check_layout, select_parameters
from covgrad.updates import (
    ChangeTracker,
    Stepper,
    bf16_rounded,
    checkpoint_steps,
    load_trajectory_state,
    run_trajectory,
    stored_dtype,
    trajectory_state,
    value_bits,
)
from storage.artifacts import ArtifactRef, ArtifactStore, create_progress, mark_batch_done
from storage.models import load_models
from storage.schema import STATS
from storage.schema import TRAJECTORY as STORE
from storage.stores.trajectory import (
    checkpoint_name,
    column_scratch,
    create_changed,
    drop_scratch,
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
from tasks.jobs.external_run import external_run
from tasks.jobs.trajectory import optimizer_spec, step_loss, step_source, step_zero_stats
from tasks.jobs.trajectory_ranks import run_trajectory_ranks
from tasks.specs import TrajectorySpec


def _compute(store: ArtifactStore, ref: ArtifactRef, spec: TrajectorySpec, up: dict[str, ArtifactRef]) -> dict:
    st = store.open_group(up["stats"], STATS, mode="r")
    if st.attrs.get("degenerate"):
        raise ValueError(
            f"trajectory: the main statistics are degenerate ({st.attrs['degenerate']}); "
            "their predictors are undefined, so the trajectory is not run"
        )
    s = spec.settings
    if s.checkpoints is not None or s.deltas is not None:
        start, _, layout = _policy(store, spec, up, st)
        stats, opt = step_zero_stats(store, spec, up), optimizer_spec(s)
        summary = external_run(store, ref, spec, up, layout, stats, opt, start, progress_bar)
        _log_external(ref, summary)
        return summary
    if spec.placement.ranks > 1:  # the model sharded over ranks
        return _finish(store, ref, spec, run_trajectory_ranks(store, ref, spec, up))
    layout = _step(store, ref, spec, up, st)  # the model, optimizer and tracker are freed when it returns
    release_free_memory()
    return _finish(store, ref, spec, layout)


def _policy(
    store: ArtifactStore, spec: TrajectorySpec, up: dict[str, ArtifactRef], st: Any
) -> tuple[Any, Any, ParamLayout]:
    """The start policy (float32), its tokenizer and the selected layout, checked against the statistics' ``st``."""
    start, tokenizer = load_models(store, up["base_model"], "policy", spec.policy)
    start = start.float()
    layout = select_parameters(start, spec.params)
    check_layout(layout, ParamLayout.from_records(st.attrs["tensors"]), "trajectory")
    return start, tokenizer, layout


def _step(
    store: ArtifactStore, ref: ArtifactRef, spec: TrajectorySpec, up: dict[str, ArtifactRef], st: Any
) -> ParamLayout:
    """Step the run from its newest resume state (or step 0) to its last step, writing every step's data."""
    s, opt = spec.settings, optimizer_spec(spec.settings)
    start, tokenizer, layout = _policy(store, spec, up, st)
    loss = step_loss(store, up["base_model"], spec.policy, s.regime, spec.regime, up.get("teacher"))
    stepper = Stepper(bf16_rounded(start, layout), opt, s.precision, loss, s.minibatches)
    del start
    bound = spec.regime is None or spec.regime.kind != "sft_sampled"
    start_flat = stepper.flat(layout)
    scratch = column_scratch(store, ref)
    tracker = ChangeTracker(layout, start_flat, opt, step_zero_stats(store, spec, up), bound, scratch=scratch)
    reference = load_models(store, up["base_model"], "policy", spec.policy)[0].float()
    reference = bf16_rounded(reference).to(stored_dtype(s.precision))
    source = step_source(store, spec, up, tokenizer, loss)

    g = store.open_group(ref, STORE, mode="a")
    create_changed(g, s.steps, layout.P)
    create_progress(g, STORE, s.steps)
    write_start(store, ref, value_bits(start_flat))
    del start_flat
    state = read_state(store, ref)
    if state is not None:
        load_trajectory_state(state, stepper, tracker, s.seed)
        del state
    saved = set(checkpoint_steps(s.steps, s.checkpoint_ratio))
    with tracker, progress_bar(f"trajectory {ref.key[:8]}", s.steps, unit="step") as bar:
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
    return layout


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
    drop_scratch(store, ref)
    fractions = summary["frac_changed_step_mean"], summary["frac_changed_cum_final"]
    log.info("trajectory %s: %d steps, per-step changed %.4f, cumulative %.4f", ref.key, s.steps, *fractions)
    return summary


def _log_external(ref: ArtifactRef, summary: dict) -> None:
    log.info(
        "trajectory %s: external run (%s layout, %d steps from %s, %s), cumulative %.4f",
        ref.key,
        summary["external_layout"],
        summary["steps"],
        summary["start"],
        summary["dtype"],
        summary["frac_changed_cum_final"],
    )


@task(name="trajectory")
def trajectory_task(ref: ArtifactRef, spec: TrajectorySpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """K optimizer steps of one regime from the policy, each step's changed set against the step-0 predictors."""
    return run_stage(ref, spec, lambda store, r: _compute(store, r, spec, upstream), resumable=True)
