"""A trajectory artifact stepped by R ranks with the model sharded over them (:mod:`covgrad.distributed.stepper`),
into the one trajectory store of :mod:`storage.stores.trajectory`.

Every rank loads the start policy (its weights on rank 0 only, the others on the meta device), shards it, the
reference and the regime's teacher, and steps every step's rows with the others; each tracks its own shard's
columns and gets the whole layout's record. What the ranks write (files as in :mod:`storage.stores.trajectory`):

- rank 0: each step's record, its changed set (gathered from every rank's columns), the Hugging Face checkpoints
  (gathered whole onto rank 0) and the step's progress mark, in that order;
- every rank: its shard's resume state ``state/step_{t}.rank{r}-of-{R}.pt`` every ``state_every`` steps; a rank
  deletes its older state only after every rank has written step t's, so a rerun resumes all ranks from the newest
  step every rank holds (a group of another size starts afresh).

The task's process creates the store before the ranks start and writes the per-step arrays and the summary after
they have finished, from the records, as without ranks.
"""

from __future__ import annotations

import logging
import tempfile
from typing import Any

import torch
import torch.distributed as dist

from covgrad.distributed import (
    ShardedStepper,
    gather_changed,
    gather_changed_values,
    launch_ranks,
    rank_columns,
    rank_device,
    rank_shard,
    shard_frozen,
)
from covgrad.layout import ParamLayout, check_layout, parameters_flat, select_parameters
from covgrad.updates import (
    ChangeTracker,
    bf16_rounded,
    checkpoint_steps,
    load_trajectory_state,
    run_trajectory,
    stored_dtype,
    trajectory_state,
    value_bits,
)
from storage.artifacts import ArtifactRef, ArtifactStore, create_progress, mark_batch_done
from storage.models import load_models, load_rank_policy
from storage.schema import STATS
from storage.schema import TRAJECTORY as STORE
from storage.stores.trajectory import (
    checkpoint_name,
    create_changed,
    drop_older_states,
    rank_label,
    read_state,
    state_steps,
    write_start,
    write_state,
    write_step,
)
from tasks.jobs.trajectory import optimizer_spec, step_loss, step_source, step_zero_stats
from tasks.specs import TrajectorySpec

log = logging.getLogger("covgrad")


def _resume_step(store: ArtifactStore, ref: ArtifactRef) -> int:
    """The newest step whose resume state every rank holds (0: none; collective)."""
    mine = state_steps(store, ref, rank_label(dist.get_rank(), dist.get_world_size()))
    newest = torch.tensor([mine[-1] if mine else 0], dtype=torch.int64)
    dist.all_reduce(newest, op=dist.ReduceOp.MIN)
    return int(newest)


def _save_checkpoint(
    store: ArtifactStore, ref: ArtifactRef, step: int, stepper: ShardedStepper, tokenizer: Any
) -> None:
    """The analysed model at ``step`` as a Hugging Face checkpoint, gathered whole onto rank 0 (collective)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(stepper.model, options=options)
    if dist.get_rank() == 0:
        full = {k: v.to(stepper.dtype) if v.is_floating_point() else v for k, v in full.items()}
        with store.local_dir(ref, checkpoint_name(step), write=True) as d:
            stepper.model.save_pretrained(d, state_dict=full)
            tokenizer.save_pretrained(d)


def trajectory_rank(root: str, ref: ArtifactRef, spec: TrajectorySpec, up: dict[str, ArtifactRef]) -> None:
    """One launched rank of a trajectory artifact (``spec``: a ``tasks.specs.TrajectorySpec``) whose store the task's
    process has created: build the sharded stepper and this rank's tracker, resume from the newest state every rank
    holds, and step to ``settings.steps`` with the other ranks."""
    store, s = ArtifactStore(root), spec.settings
    rank, label = dist.get_rank(), rank_label(dist.get_rank(), dist.get_world_size())

    def policy() -> torch.nn.Module:
        return load_rank_policy(store, up["base_model"], spec.policy, rank_device()).float()

    tokenizer = load_models(store, up["base_model"], "policy", spec.policy, meta=True)[1]
    start = policy()
    layout = select_parameters(start, spec.params)
    opt = optimizer_spec(s)
    loss = step_loss(store, up["base_model"], spec.policy, s.regime, spec.regime, up.get("teacher"), rank > 0)
    loss.teacher = None if loss.teacher is None else shard_frozen(loss.teacher)
    loss.reference = None if loss.reference is None else shard_frozen(loss.reference)
    rounded = bf16_rounded(start, layout)
    if rank == 0:
        write_start(store, ref, value_bits(parameters_flat(rounded, layout).to(stored_dtype(s.precision))))
    stepper = ShardedStepper(rounded, opt, s.precision, loss)
    bound = spec.regime is None or spec.regime.kind != "sft_sampled"
    shard = rank_shard(layout)
    stats = step_zero_stats(store, spec, up, rank_columns(layout))
    tracker = ChangeTracker(layout, stepper.flat(layout), opt, stats, bound, shard=shard)
    reference = shard_frozen(bf16_rounded(policy()).to(stored_dtype(s.precision)))
    source = step_source(store, spec, up, tokenizer, loss)
    g = store.open_group(ref, STORE, mode="r+")
    resume = _resume_step(store, ref)
    if resume:
        load_trajectory_state(read_state(store, ref, label, resume), stepper, tracker, s.seed)
    saved = set(checkpoint_steps(s.steps, s.checkpoint_ratio))
    for rec in run_trajectory(stepper, source, layout, s.steps, tracker, reference):
        t = rec["step"]
        local = rec.pop("changed")
        packed = gather_changed(local, layout)
        values = gather_changed_values(rec.pop("changed_values"), local, layout)
        if t in saved:
            _save_checkpoint(store, ref, t, stepper, tokenizer)
        if rank == 0:
            write_step(store, ref, g, t, packed, values, rec)
            mark_batch_done(g, t - 1)
        if t % s.state_every == 0 or t == s.steps:
            write_state(store, ref, trajectory_state(stepper, tracker, s.seed), label)
            dist.barrier()  # every rank holds step t's state
            drop_older_states(store, ref, t, label)


def run_trajectory_ranks(
    store: ArtifactStore, ref: ArtifactRef, spec: TrajectorySpec, up: dict[str, ArtifactRef]
) -> ParamLayout:
    """Create the store of a trajectory artifact and step it on the ``spec.placement.ranks`` local gloo processes of
    this machine (:func:`trajectory_rank` in each); returns the layout (the per-step arrays and the summary are the
    task's).

    Raises:
        covgrad.distributed.launch.RankFailedError: one line naming the first rank that failed (a rerun resumes
            from the newest state every rank holds).
    """
    s = spec.settings
    if s.minibatches > 1 or s.max_grad_norm is not None:
        raise ValueError(
            "trajectory.minibatches and trajectory.max_grad_norm run in one process; unset scores.ranks for this run"
        )
    meta = load_models(store, up["base_model"], "policy", spec.policy, meta=True)[0]
    layout = select_parameters(meta, spec.params)
    tensors = store.open_group(up["stats"], STATS, mode="r").attrs["tensors"]
    check_layout(layout, ParamLayout.from_records(tensors), "trajectory")
    g = store.open_group(ref, STORE, mode="a")
    create_changed(g, s.steps, layout.P)
    create_progress(g, STORE, s.steps)
    log.info("trajectory %s: %d steps on %d ranks", ref.key, s.steps, spec.placement.ranks)
    with tempfile.TemporaryDirectory(prefix="covgrad-trajectory-ranks-") as tmp:
        launch_ranks(spec.placement.launched(), trajectory_rank, (store.root, ref, spec, up), tmp)
    return layout
