"""Shared pieces of the experts rules' unit tests: parameters moved off their init, and each sample's block against
the gradient of one backward of that sample alone."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


def spread(module: nn.Module) -> nn.Module:
    """The module with every parameter set to 0.5 · N(0, 1) values (its init may leave experts at zero)."""
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.5 * torch.randn(p.shape))
    return module


def assert_blocks_match(
    views: dict[str, Tensor], want: Callable[[int], dict[str, Tensor]], B: int, zero: int | None = None
) -> None:
    """Each sample n's block ``views[name][n]`` against ``want(n)[name]`` (one backward of sample n alone): within
    1e-5 relative; sample ``zero`` (its output gradient zero) exact zeros."""
    for n in range(B):
        grads = want(n)
        for name, got in views.items():
            if n == zero:
                assert float(got[n].abs().max()) == 0.0, name
            else:
                w = grads[name]
                assert float((got[n] - w).norm() / w.norm()) < 1e-5, (name, n)
