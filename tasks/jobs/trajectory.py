"""The trajectory's step source: what loads the regime's fixed models, reads the step-0 statistics and builds
the data every step takes, from a trajectory spec (the in-process stage and every rank of a sharded one call it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from covgrad.config import RegimeSection, TrajectorySection
from covgrad.distributed import RankColumns
from covgrad.regimes import regime_of
from covgrad.rollouts import SamplerSpec
from covgrad.updates import (
    FixedBatches,
    OnPolicy,
    OptimizerSpec,
    StepLoss,
    StepZeroStats,
    text_rewards,
)
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.models import ModelSource, load_fixed_model, load_models, vocab_size
from storage.schema import REGIMES, ROLLOUTS, STATS
from storage.stores.prompts import load_task
from storage.stores.trajectory import fixed_batches
from tasks.specs import TrajectorySpec

FIXED_KINDS = ("sft_drift", "sft_sampled")  # regimes whose data are fixed responses, never fresh samples


def optimizer_spec(s: TrajectorySection) -> OptimizerSpec:
    """The optimizer of trajectory settings ``s`` (weight decay only for AdamW)."""
    decay = s.weight_decay if s.optimizer == "adamw" else None
    return OptimizerSpec(s.optimizer, s.lr, tuple(s.betas), decay, s.warmup, s.schedule, s.steps, s.max_grad_norm)


def step_zero_stats(
    store: ArtifactStore, spec: TrajectorySpec, up: dict[str, ArtifactRef], columns: RankColumns | None = None
) -> StepZeroStats:
    """The step-0 predictors of trajectory spec ``spec``: F of the main statistics, G and ρ of the main statistics
    for rl and of the regime's own (the ``regimes`` stage) otherwise; all P columns, or those of ``columns`` (a
    ``covgrad.distributed.fsdp.RankColumns``), read run by run; the samples per step of its data (prompt groups
    per step times the sampler's group size) for the Adam drift predictor. F, G and ρ are readers: each is read
    when the tracker ranks it, so that one (P,) float64 array is in memory at a time."""
    st = store.open_group(up["stats"], STATS, mode="r")
    rg = st if spec.regime is None else store.open_group(up["regimes"], REGIMES, mode="r")
    own = "" if spec.regime is None else f"_{spec.settings.regime}"

    def read(array: Any) -> Callable[[], np.ndarray]:
        def values() -> np.ndarray:
            if columns is None:
                return array[:]
            parts = [np.asarray(array[a:b]) for a, b in zip(columns.starts, columns.stops, strict=True)]
            return np.concatenate(parts) if parts else np.zeros(0, dtype=array.dtype)

        return values

    s = spec.settings
    fixed = s.data == "fixed" or (spec.regime is not None and spec.regime.kind in FIXED_KINDS)
    groups = spec.groups_per_batch if fixed else s.prompts_per_step
    return StepZeroStats(
        F=read(st["F"]),
        G=read(rg[f"G{own}"]),
        rho=read(rg[f"rho{own}"]),
        seed=s.seed,
        samples_per_step=groups * spec.sampler.group_size,
    )


def step_loss(
    store: ArtifactStore,
    base: ArtifactRef,
    policy: ModelSource,
    name: str,
    r: RegimeSection | None,
    teacher: ArtifactRef | None = None,
    meta: bool = False,
) -> StepLoss:
    """The loss regime ``name`` steps (None: rl), its teacher and reference loaded as fixed float32 models
    (``policy``: the start policy; ``stale``; ``trained``: the teacher stage's artifact ``teacher``; a model
    directory), on the meta device with ``meta`` (a rank that takes its shards from rank 0); ValueError for
    another vocabulary."""
    if r is None:
        return StepLoss()
    if r.teacher_logprobs:
        raise ValueError(
            f"regime {name}: teacher_logprobs imports the teacher's log-probs of fixed samples; a step needs the "
            "teacher model (set teacher to a model directory, stale or policy)"
        )

    def fixed(which: str | None, role: str) -> torch.nn.Module | None:
        if which is None:
            return None
        V = vocab_size(load_models(store, base, "policy", policy, meta=True)[0])  # the policy's shapes only
        model = load_fixed_model(
            store, base, which, policy, regime=name, role=role, policy_vocab=V, trained=teacher, meta=meta
        ).float()
        for p in model.parameters():
            p.requires_grad_(False)
        return model

    return StepLoss(
        regime_of(r),
        teacher=fixed(r.teacher, "teacher"),
        reference=fixed(r.reference if r.kl_beta else None, "reference"),
        use_advantages=r.advantages != "none",
    )


def step_source(
    store: ArtifactStore, spec: TrajectorySpec, up: dict[str, ArtifactRef], tokenizer: Any, loss: StepLoss
) -> FixedBatches | OnPolicy:
    """The data of every step of trajectory spec ``spec`` (a ``tasks.specs.TrajectorySpec``): fresh on-policy
    rows, or fixed minibatches of the upstream rollouts."""
    s, r = spec.settings, spec.regime
    if s.data == "fixed" or (r is not None and r.kind in FIXED_KINDS):
        ro = store.open_group(up["rollouts"], ROLLOUTS, mode="r")
        return FixedBatches(fixed_batches(ro, spec.groups_per_batch, r), True, loss.needs)
    if r is not None and r.advantages == "imported":
        raise ValueError(
            f"trajectory: regime {s.regime} uses imported per-token advantages, which fresh samples lack; "
            "set trajectory.data=fixed"
        )
    problems, reward_fn = load_task(spec.task)
    sampler = spec.sampler
    return OnPolicy(
        prompts=[tokenizer(p.prompt)["input_ids"] for p in problems],
        rewards=text_rewards(tokenizer, problems, reward_fn),
        group_size=sampler.group_size,
        sampler=SamplerSpec.of(sampler),
        prompts_per_step=s.prompts_per_step,
        seed=s.seed,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
        advantage=spec.advantage,
        batch_size=sampler.batch_size,
    )
