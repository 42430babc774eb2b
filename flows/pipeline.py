"""The ``covgrad-pipeline`` flow: every stage of one analysis, each a cached artifact.

No ``from __future__ import annotations`` here: Prefect builds the parameter schema from the
annotations at import time (DESIGN.md section 6).
"""

import logging
from typing import Any

from prefect import flow

from covgrad.config import PipelineConfig
from covgrad.preflight import check_model
from flows.deployment import deployment_config
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.runs import write_run_index
from tasks.common import StageResult, cache_options
from tasks.plan import plan, run_key
from tasks.registry import STAGE_TASKS

log = logging.getLogger("covgrad")


def run_node(cfg: PipelineConfig, name: str, ref: ArtifactRef, upstream: dict[str, ArtifactRef]) -> StageResult:
    """Submit one planned artifact's task through Prefect with the artifact cache policy."""
    store = ArtifactStore(cfg.root)
    task_fn = STAGE_TASKS[ref.stage].with_options(name=name, **cache_options(store, ref))
    state = task_fn(ref, cfg, name, upstream, return_state=True)
    result: StageResult = state.result()
    if state.name == "Cached":
        result = StageResult(ref=result.ref, computed=False)
    return result


@flow(name="covgrad-pipeline", log_prints=True)
def covgrad_pipeline(config: PipelineConfig = PipelineConfig()) -> dict[str, Any]:  # noqa: B008
    """Run (or reuse) every stage planned for ``config``; return the run key and each stage's status."""
    config = deployment_config(config)  # a deployment run's partial config keeps the deployment's defaults
    if config.model.path is not None:  # unsupported modules fail here, in seconds, not after rollouts
        m = config.model
        check_model(m.path, config.scores.params, m.trust_remote_code, config.scores.self_check)
    nodes = plan(config)
    key = run_key(nodes)
    refs: dict[str, ArtifactRef] = {}
    status: dict[str, str] = {}
    for name, node in nodes.items():
        upstream = {u: refs[u] for u in node.upstream}
        result = run_node(config, name, node.ref, upstream)
        refs[name] = result.ref
        status[name] = "computed" if result.computed else "cached"
        print(f"{name:28s} {status[name]:8s} {result.ref.key}")
        write_run_index(ArtifactStore(config.root), config, key, refs)  # a failed run's finished stages stay reachable
    return {"run": key, "name": config.name, "root": config.root, "status": status}
