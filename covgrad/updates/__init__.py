"""Parameter updates: trajectory stepping and change tracking, the one-step update check, checkpoint
diffs and SFT training helpers.
"""

from covgrad.updates.check import GRID_MD_COLUMNS, rl_minibatches, summarize, update_grid
from covgrad.updates.diff import diff_state_dicts
from covgrad.updates.sft import train_sft
from covgrad.updates.trajectory import (
    BATCH_KEYS,
    ChangeTracker,
    FixedBatches,
    OnPolicy,
    OptimizerSpec,
    Ranker,
    StepLoss,
    Stepper,
    StepZeroStats,
    TrackerShard,
    bf16_rounded,
    checkpoint_records,
    checkpoint_steps,
    load_trajectory_state,
    run_trajectory,
    stored_dtype,
    text_rewards,
    trajectory_state,
)

__all__ = [
    "BATCH_KEYS",
    "GRID_MD_COLUMNS",
    "ChangeTracker",
    "FixedBatches",
    "OnPolicy",
    "OptimizerSpec",
    "Ranker",
    "StepLoss",
    "StepZeroStats",
    "Stepper",
    "TrackerShard",
    "bf16_rounded",
    "checkpoint_records",
    "checkpoint_steps",
    "diff_state_dicts",
    "load_trajectory_state",
    "rl_minibatches",
    "run_trajectory",
    "stored_dtype",
    "summarize",
    "text_rewards",
    "train_sft",
    "trajectory_state",
    "update_grid",
]
