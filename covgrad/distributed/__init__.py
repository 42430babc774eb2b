"""Sharded work: FSDP2 per-sample scores, the launch of rank groups, the FSDP plan, shard plans and the sharded
trajectory stepper.

Names re-exported lazily (:mod:`covgrad.lazy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from covgrad.lazy import exports

if TYPE_CHECKING:
    from covgrad.distributed.fsdp import (
        RankColumns,
        ShardAccumulator,
        ShardedPerSampleGrads,
        loads_weights,
        on_meta,
        rank_scores,
        shard_from_rank0,
    )
    from covgrad.distributed.launch import (
        Placement,
        RankFailedError,
        Torchrun,
        launch_ranks,
        rank_device,
        torchrun_rank,
    )
    from covgrad.distributed.plan import SHAPES, FsdpWork, fsdp_plan
    from covgrad.distributed.shardplan import ModelShape, ShardPlan, Workload, keeps_rows, make_plan, resolve_shards
    from covgrad.distributed.stepper import (
        ShardedStepper,
        gather_changed,
        gather_changed_values,
        rank_columns,
        rank_shard,
        shard_frozen,
    )

_EXPORTS = {
    "FsdpWork": "covgrad.distributed.plan",
    "ModelShape": "covgrad.distributed.shardplan",
    "Placement": "covgrad.distributed.launch",
    "RankColumns": "covgrad.distributed.fsdp",
    "RankFailedError": "covgrad.distributed.launch",
    "SHAPES": "covgrad.distributed.plan",
    "ShardAccumulator": "covgrad.distributed.fsdp",
    "ShardPlan": "covgrad.distributed.shardplan",
    "ShardedPerSampleGrads": "covgrad.distributed.fsdp",
    "ShardedStepper": "covgrad.distributed.stepper",
    "Torchrun": "covgrad.distributed.launch",
    "Workload": "covgrad.distributed.shardplan",
    "fsdp_plan": "covgrad.distributed.plan",
    "gather_changed": "covgrad.distributed.stepper",
    "gather_changed_values": "covgrad.distributed.stepper",
    "keeps_rows": "covgrad.distributed.shardplan",
    "launch_ranks": "covgrad.distributed.launch",
    "loads_weights": "covgrad.distributed.fsdp",
    "make_plan": "covgrad.distributed.shardplan",
    "on_meta": "covgrad.distributed.fsdp",
    "rank_columns": "covgrad.distributed.stepper",
    "rank_device": "covgrad.distributed.launch",
    "rank_scores": "covgrad.distributed.fsdp",
    "rank_shard": "covgrad.distributed.stepper",
    "resolve_shards": "covgrad.distributed.shardplan",
    "shard_from_rank0": "covgrad.distributed.fsdp",
    "shard_frozen": "covgrad.distributed.stepper",
    "torchrun_rank": "covgrad.distributed.launch",
}

__all__ = [
    "SHAPES",
    "FsdpWork",
    "ModelShape",
    "Placement",
    "RankColumns",
    "RankFailedError",
    "ShardAccumulator",
    "ShardPlan",
    "ShardedPerSampleGrads",
    "ShardedStepper",
    "Torchrun",
    "Workload",
    "fsdp_plan",
    "gather_changed",
    "gather_changed_values",
    "keeps_rows",
    "launch_ranks",
    "loads_weights",
    "make_plan",
    "on_meta",
    "rank_columns",
    "rank_device",
    "rank_scores",
    "rank_shard",
    "resolve_shards",
    "shard_from_rank0",
    "shard_frozen",
    "torchrun_rank",
]

__getattr__ = exports(__name__, _EXPORTS)
