"""Parameter updates: trajectory stepping and change tracking, the one-step update check, checkpoint
diffs and SFT training helpers.

Names re-exported lazily (:mod:`covgrad.lazy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from covgrad.lazy import exports

if TYPE_CHECKING:
    from covgrad.updates.check import GRID_MD_COLUMNS, rl_minibatches, summarize, update_grid
    from covgrad.updates.columns import Ranker
    from covgrad.updates.diff import diff_state_dicts
    from covgrad.updates.kstep import KS, Cells, StepDelta, count_trace, persistence_tables, tensor_kind
    from covgrad.updates.sft import train_sft
    from covgrad.updates.stepping import (
        BATCH_KEYS,
        FixedBatches,
        OnPolicy,
        OptimizerSpec,
        StepLoss,
        Stepper,
        bf16_rounded,
        stored_dtype,
        text_rewards,
    )
    from covgrad.updates.tracking import ChangeTracker, StepZeroStats, TrackerShard, value_bits
    from covgrad.updates.trajectory import (
        checkpoint_records,
        checkpoint_steps,
        load_trajectory_state,
        run_trajectory,
        trajectory_state,
    )

_EXPORTS = {
    "BATCH_KEYS": "covgrad.updates.stepping",
    "Cells": "covgrad.updates.kstep",
    "ChangeTracker": "covgrad.updates.tracking",
    "FixedBatches": "covgrad.updates.stepping",
    "GRID_MD_COLUMNS": "covgrad.updates.check",
    "KS": "covgrad.updates.kstep",
    "OnPolicy": "covgrad.updates.stepping",
    "OptimizerSpec": "covgrad.updates.stepping",
    "Ranker": "covgrad.updates.columns",
    "StepDelta": "covgrad.updates.kstep",
    "StepLoss": "covgrad.updates.stepping",
    "StepZeroStats": "covgrad.updates.tracking",
    "Stepper": "covgrad.updates.stepping",
    "TrackerShard": "covgrad.updates.tracking",
    "bf16_rounded": "covgrad.updates.stepping",
    "checkpoint_records": "covgrad.updates.trajectory",
    "checkpoint_steps": "covgrad.updates.trajectory",
    "count_trace": "covgrad.updates.kstep",
    "diff_state_dicts": "covgrad.updates.diff",
    "load_trajectory_state": "covgrad.updates.trajectory",
    "persistence_tables": "covgrad.updates.kstep",
    "rl_minibatches": "covgrad.updates.check",
    "run_trajectory": "covgrad.updates.trajectory",
    "stored_dtype": "covgrad.updates.stepping",
    "summarize": "covgrad.updates.check",
    "tensor_kind": "covgrad.updates.kstep",
    "text_rewards": "covgrad.updates.stepping",
    "train_sft": "covgrad.updates.sft",
    "trajectory_state": "covgrad.updates.trajectory",
    "update_grid": "covgrad.updates.check",
    "value_bits": "covgrad.updates.tracking",
}

__all__ = [
    "BATCH_KEYS",
    "GRID_MD_COLUMNS",
    "KS",
    "Cells",
    "ChangeTracker",
    "FixedBatches",
    "OnPolicy",
    "OptimizerSpec",
    "Ranker",
    "StepDelta",
    "StepLoss",
    "StepZeroStats",
    "Stepper",
    "TrackerShard",
    "bf16_rounded",
    "checkpoint_records",
    "checkpoint_steps",
    "count_trace",
    "diff_state_dicts",
    "load_trajectory_state",
    "persistence_tables",
    "rl_minibatches",
    "run_trajectory",
    "stored_dtype",
    "summarize",
    "tensor_kind",
    "text_rewards",
    "train_sft",
    "trajectory_state",
    "update_grid",
    "value_bits",
]

__getattr__ = exports(__name__, _EXPORTS)
