"""Stage name → Prefect task. Every task has the signature ``(ref, cfg, instance, upstream)``."""

from prefect import Task

from tasks.base_model import base_model_task

STAGE_TASKS: dict[str, Task] = {
    "base_model": base_model_task,
}
