"""The ``covgrad-pipeline`` flow: every stage of one analysis, each a cached artifact.

``run_stages`` is the stage list, in DAG order; ``tasks.specs.plan`` fixes each artifact's spec and key
before anything runs, and each stage's task receives its spec and upstream refs. The flow submits every
call through Prefect with the artifact cache policy; tests call ``run_stages`` with the task bodies.

No ``from __future__ import annotations`` here: Prefect builds the parameter schema from the
annotations at import time (DESIGN.md section 6).
"""

import logging
from collections.abc import Callable
from typing import Any

from prefect import Task, flow

from covgrad.config import PipelineConfig
from flows.deployment import run_config
from flows.preflight import preflight
from storage.artifacts import ArtifactStore
from storage.runs import write_run_index
from tasks.base_model import base_model_task
from tasks.common import StageResult, cache_options
from tasks.masks import masks_task
from tasks.offpolicy import offpolicy_task
from tasks.report import report_task
from tasks.rollouts import rollouts_task
from tasks.scores import scores_task
from tasks.specs import Plan, Step, plan
from tasks.stats import stats_task
from tasks.tokens import tokens_task
from tasks.update_check import update_check_task

log = logging.getLogger("covgrad")

Run = Callable[[Task, Step], StageResult]


def run_stages(p: Plan, run: Run) -> None:
    """Every planned artifact of ``p``, one ``run(task, step)`` each, upstream first."""
    run(base_model_task, p.base_model)
    for step in p.rollouts.values():
        run(rollouts_task, step)
    for step in p.scores.values():
        run(scores_task, step)
    for step in p.stats.values():
        run(stats_task, step)
    run(offpolicy_task, p.offpolicy)
    run(masks_task, p.masks)
    if p.tokens is not None:
        run(tokens_task, p.tokens)
    if p.update_check is not None:
        run(update_check_task, p.update_check)
    run(report_task, p.report)


@flow(name="covgrad-pipeline", log_prints=True)
def covgrad_pipeline(config: PipelineConfig = PipelineConfig(), config_file: str | None = None) -> dict[str, Any]:  # noqa: B008
    """Run (or reuse) every stage planned for ``config``; return the run key and each stage's status.
    ``config_file``: a YAML config (relative to the working directory) under the keys ``config`` sets."""
    config = run_config(config, config_file)  # a deployment's partial config keeps its defaults
    preflight(config)  # bad input fails here, in one line, before any stage
    p = plan(config)
    store = ArtifactStore(config.root)
    refs: dict[str, Any] = {}
    status: dict[str, str] = {}

    def run(task: Task, step: Step) -> StageResult:
        name = str(step.instance)
        state = task.with_options(name=name, **cache_options(store, step.ref))(
            step.ref, step.spec, step.upstream, return_state=True
        )
        result: StageResult = state.result()
        refs[name] = result.ref
        status[name] = "computed" if result.computed and state.name != "Cached" else "cached"
        cost = (
            f"  {result.seconds:.1f} s, peak {result.peak_rss_bytes / 2**30:.2f} GiB"
            if status[name] == "computed"
            else ""
        )
        print(f"{name:28s} {status[name]:8s} {result.ref.key}{cost}")
        write_run_index(store, config, p.run_key, refs)  # a failed run's finished stages stay reachable
        return result

    run_stages(p, run)
    return {"run": p.run_key, "name": config.name, "root": config.root, "status": status}
