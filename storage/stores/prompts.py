"""A task's prompts and reward, where each prompt comes from, and how many tokens each prompt is.

Token counts use the ``tokenizers`` library on the policy's ``tokenizer.json`` (what ``AutoTokenizer``
loads for a fast tokenizer, special tokens included, no chat template: the rollouts stage encodes the
prompt text as it is), so the preflight counts them before torch or transformers load.
"""

from __future__ import annotations

from pathlib import Path

from covgrad.config import TaskSection
from covgrad.rollouts import (
    DEMO_CONTEXT,
    Problem,
    RewardFn,
    addition_problems,
    addition_reward,
    char_tokenizer,
    problems_from_records,
    resolve_reward,
)
from storage.models import model_context
from storage.readers import prompt_locations, read_prompt_file


def load_problems(t: TaskSection) -> list[Problem]:
    """The prompts of task section ``t``, without its reward (nothing of the reward's module is imported)."""
    if t.kind == "addition":
        return addition_problems(t.n_prompts, t.digits, t.seed)
    assert t.path is not None
    return problems_from_records(read_prompt_file(t.path))[: t.n_prompts]


def load_task(t: TaskSection) -> tuple[list[Problem], RewardFn]:
    """The prompts and reward function of task section ``t``; a reward outside ``covgrad.rewards`` is imported
    only with ``t.trust_reward_code`` (else ValueError naming it and the setting, before the prompts are read)."""
    if t.kind == "addition":
        return load_problems(t), addition_reward
    assert t.reward is not None
    reward = resolve_reward(t.reward, t.trust_reward_code)
    return load_problems(t), reward


def prompt_places(t: TaskSection, n: int) -> list[str]:
    """Where each of the first ``n`` prompts of task ``t`` comes from: ``file:line`` of a JSONL task, else
    ``prompt i`` (the built-in task)."""
    if t.kind == "jsonl" and t.path is not None:
        return prompt_locations(t.path)[:n]
    return [f"prompt {i}" for i in range(n)]


def prompt_lengths(
    model_path: str | None, problems: list[Problem], max_length: int | None = None
) -> tuple[list[int], int | None] | None:
    """Token counts of the prompts and the policy's context (the demo's when ``model_path`` is None; else
    ``storage.models.model_context``: config.json, tokenizer_config.json, then ``max_length``, the run's
    ``model.max_length``; None when none of them tells it), or None when the prompts cannot be counted without
    loading the model (no tokenizer.json): the rollouts stage checks then."""
    if model_path is None:
        tokenizer, limit = char_tokenizer(), DEMO_CONTEXT
    else:
        root = Path(model_path)
        if not (root / "tokenizer.json").is_file():
            return None
        from tokenizers import Tokenizer

        tokenizer, limit = Tokenizer.from_file(str(root / "tokenizer.json")), model_context(model_path, max_length)
    encodings = tokenizer.encode_batch([p.prompt for p in problems])
    return [len(e.ids) for e in encodings], limit
