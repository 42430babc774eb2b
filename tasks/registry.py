"""Stage name → Prefect task. Every task has the signature ``(ref, cfg, instance, upstream)``."""

from prefect import Task

from tasks.base_model import base_model_task
from tasks.masks import masks_task
from tasks.report import report_task
from tasks.rollouts import rollouts_task
from tasks.scores import scores_task
from tasks.stats import stats_task
from tasks.tokens import tokens_task
from tasks.update_check import update_check_task

STAGE_TASKS: dict[str, Task] = {
    "base_model": base_model_task,
    "rollouts": rollouts_task,
    "scores": scores_task,
    "stats": stats_task,
    "masks": masks_task,
    "tokens": tokens_task,
    "update_check": update_check_task,
    "report": report_task,
}
