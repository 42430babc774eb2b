"""Reward functions for JSONL tasks (``task.reward: covgrad.rewards:<name>``): the only rewards that run without
``task.trust_reward_code`` (``covgrad.rollouts.problems.resolve_reward``)."""

from __future__ import annotations

import re

from covgrad.rollouts.problems import addition_reward

__all__ = ["addition_reward", "mentions_answer"]


def mentions_answer(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response contains the answer as a whole word or number (case-insensitive), else 0.0.

    For chat models that wrap a short answer in a sentence ("The capital of Japan is Tokyo."); "14"
    is not found in "140", nor "Oslo" in "Oslofjord".
    """
    del prompt
    pattern = r"(?<!\w)" + re.escape(answer.strip()) + r"(?!\w)"
    return 1.0 if re.search(pattern, response, flags=re.IGNORECASE) else 0.0
