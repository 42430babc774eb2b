"""The ``covgrad-pipeline`` flow: every stage of one analysis, each a cached artifact. ``TASKS`` is the stage list;
``tasks.specs.plan`` fixes each artifact's spec, key and order before anything runs, and ``run_stages`` calls each
planned artifact's task (through Prefect in the flow, as task bodies in tests). No ``from __future__ import
annotations``: Prefect builds the parameter schema from the annotations (DESIGN.md §6)."""

import logging
from collections.abc import Callable
from typing import Any

from prefect import Task, flow

from covgrad.config import PipelineConfig
from flows.deployment import run_config
from flows.preflight import preflight
from flows.stop import rearm
from flows.trackers import check_trackers, log_trackers
from storage.artifacts import ArtifactStore
from storage.runs import write_run_index
from tasks.common import StageResult, cache_options
from tasks.masks import masks_task
from tasks.offpolicy import offpolicy_task
from tasks.regimes import regime_task, regimes_task
from tasks.report import report_task
from tasks.rollouts import rollouts_task
from tasks.scores import scores_task
from tasks.specs import Plan, Step, plan
from tasks.stats import stats_task
from tasks.tokens import tokens_task
from tasks.training import base_model_task, teacher_task
from tasks.trajectory import trajectory_task
from tasks.update_check import update_check_task

log = logging.getLogger("covgrad")

Run = Callable[[Task, Step], StageResult]

TASKS = (
    base_model_task,
    teacher_task,
    rollouts_task,
    scores_task,
    stats_task,
    offpolicy_task,
    masks_task,
    tokens_task,
    update_check_task,
    trajectory_task,
    regime_task,
    regimes_task,
    report_task,
)  # one per stage; each task's name is its spec's STAGE


def run_stages(p: Plan, run: Run) -> None:
    """Every planned artifact of ``p``, one ``run(task, step)`` each, in the plan's order (upstream first)."""
    by_stage = {t.name: t for t in TASKS}
    for step in p.values():
        run(by_stage[step.spec.STAGE], step)


@flow(name="covgrad-pipeline", log_prints=True)
def covgrad_pipeline(config: PipelineConfig = PipelineConfig(), config_file: str | None = None) -> dict[str, Any]:  # noqa: B008
    """Run (or reuse) every stage planned for ``config``; return the run key and each stage's status.
    ``config_file``: a YAML config (relative to the working directory) under the keys ``config`` sets."""
    rearm()  # `covgrad run`'s SIGINT/SIGTERM handler over the one Prefect's flow engine installed
    config = run_config(config, config_file)  # a deployment's partial config keeps its defaults
    preflight(config)  # bad input fails here, in one line, before any stage
    check_trackers(config)  # so does a selected tracker whose extra is not installed
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
        computed = status[name] == "computed"
        cost = f"  {result.seconds:.1f} s, peak {result.peak_rss_bytes / 2**30:.2f} GiB" if computed else ""
        print(f"{name:28s} {status[name]:8s} {result.ref.key}{cost}")
        write_run_index(store, config, p.run_key, refs)  # a failed run's finished stages stay reachable
        return result

    run_stages(p, run)
    log_trackers(config, store, refs, p.run_key)  # the run's scalars to the selected trackers
    return {"run": p.run_key, "name": config.name, "root": config.root, "status": status}
