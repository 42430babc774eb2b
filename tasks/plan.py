"""The stage DAG: every artifact's key, computed from the config before anything runs.

Keys chain: a stage's key covers its own config section, its code version and its upstream keys, so
changing a downstream parameter changes only downstream keys, and an upstream change invalidates
everything below it. Instance names (``rollouts.stale``, ``scores.stale.sampler``) tell several
artifacts of one stage apart; the directory is ``{root}/{stage}/{key}``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from covgrad.config import PipelineConfig, SamplerSection
from storage.artifacts import ArtifactRef, ArtifactStore, stage_key
from tasks import base_model

# Bump a stage's version when its code changes what it writes.
VERSIONS = {
    "base_model": base_model.VERSION,
    "rollouts": "1",
    "scores": "4",
    "stats": "4",
    "masks": "2",
    "tokens": "3",
    "update_check": "2",
    "report": "5",
}


def on_policy(s: SamplerSection) -> bool:
    """True when the sampler is the policy itself, untruncated at temperature 1 (μ = p); imported
    rollouts say so with ``on_policy: true``."""
    if s.import_path is not None:
        return s.on_policy
    return s.model == "policy" and s.temperature == 1.0 and s.top_p == 1.0 and s.top_k == 0


def centerings(s: SamplerSection) -> list[str]:
    """Score centerings computed for a sampler: both when μ ≠ p (the off-policy comparison)."""
    return ["policy"] if on_policy(s) else ["policy", "sampler"]


def main_centering(cfg: PipelineConfig) -> str:
    """Centering used by masks, tokens and the update check: under the sampler whenever μ ≠ p."""
    return centerings(cfg.rollouts.samplers[cfg.rollouts.analyse])[-1]


@dataclass(frozen=True)
class Node:
    """One planned artifact: instance name, ref, and the upstream instances it reads."""

    name: str
    ref: ArtifactRef
    upstream: tuple[str, ...]
    config: Any


def _node(store: ArtifactStore, nodes: dict[str, Node], name: str, config: Any, upstream: tuple[str, ...]) -> None:
    stage = name.split(".", 1)[0]
    keys = [nodes[u].ref.key for u in upstream]
    key = stage_key(stage, VERSIONS[stage], config, keys)
    nodes[name] = Node(name, store.ref(stage, key, VERSIONS[stage], keys), upstream, config)


def plan(cfg: PipelineConfig) -> dict[str, Node]:
    """All artifacts of one pipeline run, in execution order."""
    store = ArtifactStore(cfg.root)
    nodes: dict[str, Node] = {}
    _node(store, nodes, "base_model", base_model.stage_config(cfg), ())
    task_cfg = cfg.task.model_dump()
    for name, s in cfg.rollouts.samplers.items():
        _node(
            store,
            nodes,
            f"rollouts.{name}",
            {"sampler": s.model_dump(), "task": task_cfg, "advantage": cfg.rollouts.advantage},
            ("base_model",),
        )
        for c in centerings(s):
            score_cfg = {
                "centering": c,
                "params": cfg.scores.params,
                "groups_per_batch": cfg.scores.groups_per_batch,
                "byte_budget": cfg.scores.byte_budget,
                "state_dtype": cfg.scores.state_dtype,
                "dtype": cfg.model.dtype,
                # sample shards change the order of the merges; parameter blocks and placement change no byte
                "sample_shards": cfg.scores.shards[0],
            }
            _node(store, nodes, f"scores.{name}.{c}", score_cfg, ("base_model", f"rollouts.{name}"))
            _node(store, nodes, f"stats.{name}.{c}", {}, (f"scores.{name}.{c}",))
    main = f"{cfg.rollouts.analyse}.{main_centering(cfg)}"
    _node(store, nodes, "masks", cfg.masks.model_dump(), (f"stats.{main}",))
    if cfg.tokens.enabled:
        _node(
            store,
            nodes,
            "tokens",
            cfg.tokens.model_dump(),
            ("base_model", f"rollouts.{cfg.rollouts.analyse}"),
        )
    if cfg.update_check.enabled:
        _node(
            store,
            nodes,
            "update_check",
            {**cfg.update_check.model_dump(), "params": cfg.scores.params},
            ("base_model", f"rollouts.{cfg.rollouts.analyse}", f"stats.{main}"),
        )
    from tasks.registry import STAGE_TASKS

    if "report" in STAGE_TASKS:
        _node(store, nodes, "report", {"name": cfg.name}, tuple(nodes))
    return {n: node for n, node in nodes.items() if node.ref.stage in STAGE_TASKS}


def run_key(nodes: dict[str, Node]) -> str:
    """The pipeline run's key: that of its report, which covers every upstream key."""
    return stage_key("run", "1", {}, [n.ref.key for n in nodes.values()])


def downstream(nodes: dict[str, Node], instance: str) -> set[str]:
    """``instance`` and every planned instance that reads it, directly or transitively."""
    out = {instance}
    for name, node in nodes.items():  # execution order: upstreams come first
        if out.intersection(node.upstream):
            out.add(name)
    return out
