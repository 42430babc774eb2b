"""Checks run before any stage, so that bad input fails in one line with nothing written.

Everything here reads files and light libraries only (no torch, no transformers, no Prefect), so the
whole preflight takes well under 2 s: model directories (config and weights headers), the task file
and its reward, the μ source of imported rollouts, and whether every prompt plus ``max_new_tokens``
fits the policy's context. Prompt tokens are counted with the ``tokenizers`` library from the
policy's ``tokenizer.json`` (what ``AutoTokenizer`` loads for a fast tokenizer, special tokens
included, no chat template: the rollouts stage encodes the prompt text as it is); the rollouts stage
repeats the check with the loaded tokenizer through the same :func:`check_context`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from covgrad.config import PipelineConfig, TaskSection
from covgrad.problems import (
    DEMO_CONTEXT,
    Problem,
    RewardFn,
    addition_problems,
    addition_reward,
    char_tokenizer,
    problems_from_records,
    resolve_reward,
)
from covgrad.rollout_import import require_mu_source
from storage.models import check_model_dir
from storage.readers import prompt_locations, read_prompt_file, read_records

_MAX_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")


def load_task(t: TaskSection) -> tuple[list[Problem], RewardFn]:
    """The prompts and reward function of task section ``t``."""
    if t.kind == "addition":
        return addition_problems(t.n_prompts, t.digits, t.seed), addition_reward
    assert t.path is not None and t.reward is not None
    reward = resolve_reward(t.reward)
    problems = problems_from_records(read_prompt_file(t.path))
    return problems[: t.n_prompts], reward


def prompt_places(t: TaskSection, n: int) -> list[str]:
    """Where each of the first ``n`` prompts of task ``t`` comes from: ``file:line`` of a JSONL task, else
    ``prompt i`` (the built-in task)."""
    if t.kind == "jsonl" and t.path is not None:
        return prompt_locations(t.path)[:n]
    return [f"prompt {i}" for i in range(n)]


def max_positions(config: Mapping[str, Any]) -> int | None:
    """The longest sequence a Hugging Face model config allows (``max_position_embeddings``,
    ``n_positions`` or ``max_sequence_length``, at the top level or in ``text_config``), or None."""
    for section in (config, config.get("text_config") or {}):
        for key in _MAX_POSITION_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def check_context(lengths: Sequence[int], where: Sequence[str], max_new_tokens: int, limit: int, what: str) -> None:
    """ValueError (one line) naming the first prompt whose tokens plus ``max_new_tokens`` exceed the
    model's context ``limit``, with both lengths, how many prompts are too long, and what to change.

    Args:
        lengths: prompt lengths in tokens, special tokens included.
        where: the place of each prompt (``file:line``).
        max_new_tokens: the sampler's response budget.
        limit: the policy's context (maximum positions).
        what: the sampler's config section, e.g. ``rollouts.samplers.policy``.
    """
    over = [i for i, n in enumerate(lengths) if n + max_new_tokens > limit]
    if not over:
        return
    i = over[0]
    more = f" ({len(over) - 1} more prompt(s) too long)" if len(over) > 1 else ""
    raise ValueError(
        f"{where[i]}: the prompt is {lengths[i]} tokens; with {what}.max_new_tokens={max_new_tokens} that is "
        f"{lengths[i] + max_new_tokens} > the model's context of {limit} positions{more}; shorten the prompt "
        f"or lower max_new_tokens"
    )


def _prompt_lengths(cfg: PipelineConfig, problems: list[Problem]) -> tuple[list[int], int] | None:
    """Token counts of the prompts and the policy's context, or None when they cannot be told without
    loading the model (no tokenizer.json, no max positions in config.json): the rollouts stage checks."""
    if cfg.model.path is None:
        tokenizer, limit = char_tokenizer(), DEMO_CONTEXT
    else:
        root = Path(cfg.model.path)
        limit = max_positions(json.loads((root / "config.json").read_text()))
        if limit is None or not (root / "tokenizer.json").is_file():
            return None
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(root / "tokenizer.json"))
    encodings = tokenizer.encode_batch([p.prompt for p in problems])
    return [len(e.ids) for e in encodings], limit


def preflight(cfg: PipelineConfig) -> None:
    """Validate everything the config points at: model directories, task file, reward, imports, and
    that the prompts fit the policy's context with every generating sampler's ``max_new_tokens``."""
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
    problems, _ = load_task(cfg.task)
    generating = {name: s for name, s in cfg.rollouts.samplers.items() if s.import_path is None}
    counted = _prompt_lengths(cfg, problems) if generating else None
    if counted is None:
        return
    lengths, limit = counted
    where = prompt_places(cfg.task, len(problems))
    for name, s in generating.items():
        check_context(lengths, where, s.max_new_tokens, limit, f"rollouts.samplers.{name}")
