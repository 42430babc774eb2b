"""Reward functions for JSONL tasks (``task.reward: covgrad.rewards:<name>``)."""

from __future__ import annotations

import re

_INT = re.compile(r"-?\d+")


def first_integer(prompt: str, response: str, answer: str) -> float:
    """1.0 when the first integer written in the response equals the answer, else 0.0.

    For chat models that wrap a number in a sentence ("The answer is 7."): only the first number counts,
    so listing several candidates earns nothing unless the first one is right.
    """
    del prompt
    found = _INT.search(response)
    return 1.0 if found is not None and found.group() == answer.strip() else 0.0
