"""Reward functions shipped for JSONL tasks."""

import pytest

from covgrad.rewards import mentions_answer


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("The capital of Japan is Tokyo.", "Tokyo", 1.0),
        ("tokyo", "Tokyo", 1.0),
        ("Kyoto, the heart", "Tokyo", 0.0),
        ("The capital of Turkey is Ank", "Ankara", 0.0),
        ("Oslofjord", "Oslo", 0.0),
        ("7 + 7 = 14", "14", 1.0),
        ("7 + 7 = 140", "14", 0.0),
        ("", "14", 0.0),
        ("a.b", "a.b", 1.0),
        ("axb", "a.b", 0.0),
    ],
)
def test_mentions_answer(response, answer, reward):
    assert mentions_answer("prompt", response, answer) == reward
