"""Sharded work: FSDP2 per-sample scores, rank launchers, the FSDP plan, shard plans and the sharded
trajectory stepper.
"""

from covgrad.distributed.fsdp import (
    RankColumns,
    RankFailedError,
    ShardAccumulator,
    ShardedPerSampleGrads,
    Torchrun,
    launch,
    launch_torchrun,
    loads_weights,
    on_meta,
    rank_device,
    rank_scores,
    shard_from_rank0,
    torchrun_rank,
)
from covgrad.distributed.plan import SHAPES, FsdpWork, fsdp_plan
from covgrad.distributed.shardplan import ModelShape, ShardPlan, Workload, keeps_rows, make_plan, resolve_shards
from covgrad.distributed.stepper import ShardedStepper, gather_changed, rank_columns, rank_shard, shard_frozen

__all__ = [
    "SHAPES",
    "FsdpWork",
    "ModelShape",
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
    "keeps_rows",
    "launch",
    "launch_torchrun",
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
