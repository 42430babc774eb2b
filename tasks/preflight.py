"""Checks run before any stage, so that bad input fails in one line with nothing written."""

from __future__ import annotations

from pathlib import Path

from covgrad.config import PipelineConfig
from covgrad.rollout_import import require_mu_source
from covgrad.task import (
    Problem,
    RewardFn,
    addition_problems,
    addition_reward,
    problems_from_records,
    resolve_reward,
)
from storage.models import check_model_dir
from storage.readers import read_prompt_file, read_records


def load_task(cfg: PipelineConfig) -> tuple[list[Problem], RewardFn]:
    """The run's prompts and reward function."""
    t = cfg.task
    if t.kind == "addition":
        return addition_problems(t.n_prompts, t.digits, t.seed), addition_reward
    assert t.path is not None and t.reward is not None
    reward = resolve_reward(t.reward)
    problems = problems_from_records(read_prompt_file(t.path))
    return problems[: t.n_prompts], reward


def preflight(cfg: PipelineConfig) -> None:
    """Validate everything the config points at: model directories, task file, reward, imports."""
    if cfg.model.path is not None:
        check_model_dir(cfg.model.path, "model.path")
    for name, s in cfg.rollouts.samplers.items():
        if s.model not in ("policy", "stale"):
            check_model_dir(s.model, f"rollouts.samplers.{name}.model")
        if s.import_path is not None and not Path(s.import_path).is_file() and "://" not in s.import_path:
            raise FileNotFoundError(f"rollouts.samplers.{name}.import_path {s.import_path!r} does not exist")
        if s.import_path is not None:
            first = next(iter(read_records(s.import_path)))
            require_mu_source(f"rollouts.samplers.{name}", first, s.on_policy, s.mu_model)
        if s.mu_model is not None:
            check_model_dir(s.mu_model, f"rollouts.samplers.{name}.mu_model")
    load_task(cfg)
