"""storage.models.fresh_copies: every call an independent copy of what the loader reads; a small model is read
once and kept, a large one read again each time."""

from __future__ import annotations

import torch

from storage.models import fresh_copies


def _loader(reads: list[int]):
    def load() -> torch.nn.Module:
        reads.append(1)
        torch.manual_seed(0)
        return torch.nn.Linear(4, 3)

    return load


def test_a_small_model_is_read_once_and_each_copy_is_independent():
    reads: list[int] = []
    fresh = fresh_copies(_loader(reads))
    first = fresh()
    reference = _loader([])()
    with torch.no_grad():
        first.weight.add_(1.0)  # a cell's training steps must not reach the next copy
    for _ in range(3):
        m = fresh()
        assert m is not first
        assert torch.equal(m.weight, reference.weight) and torch.equal(m.bias, reference.bias)
    assert len(reads) == 1


def test_a_model_over_the_budget_is_read_again_for_every_copy():
    reads: list[int] = []
    fresh = fresh_copies(_loader(reads), keep_bytes=15 * 4 - 1)  # 12 weights + 3 biases, float32
    models = [fresh() for _ in range(3)]
    assert len(reads) == 3 and len({id(m) for m in models}) == 3
    at_budget = fresh_copies(_loader(reads), keep_bytes=15 * 4)
    for _ in range(3):
        at_budget()
    assert len(reads) == 4
