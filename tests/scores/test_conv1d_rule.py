"""The nn.Conv1d rule (the short convolutions of state-space and hybrid layers): per-sample ∂W and ∂b equal
autograd's gradient of the module alone, one sample at a time, for depthwise, grouped and dense convolutions,
with and without bias and padding, on (B, C, L) inputs and on a flattened batch's (B, s, C, L) rows; and the
convolutions it does not take keep the generic rule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from covgrad.scores.binding import rule_for
from covgrad.scores.rules import Slot, _torch_conv1d_rule, generic_rule

CONVS = [  # in channels, out channels, groups, kernel, padding, bias
    (8, 8, 8, 4, 3, True),  # depthwise, causal padding (Mamba's)
    (8, 8, 8, 3, 2, False),  # depthwise without bias (LFM2's)
    (8, 16, 8, 3, 1, True),  # depthwise with a channel multiplier
    (8, 12, 4, 3, 0, True),  # grouped, no padding
    (6, 5, 1, 2, 1, True),  # dense
]


def rows_by_rule(conv: nn.Conv1d, x: torch.Tensor, g: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rule's (B, *shape) float32 per-sample gradients of the conv's weight and bias."""
    B = g.shape[0]
    out = {n: torch.full((B, *p.shape), float("nan")) for n, p in conv.named_parameters()}
    _torch_conv1d_rule(conv, x, g, Slot(lambda name: (out[name], True) if name in out else None))
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("C", "O", "groups", "K", "pad", "bias"), CONVS)
@pytest.mark.parametrize("flat", [False, True])
def test_conv1d_rule_is_autograd_per_sample(C, O, groups, K, pad, bias, dtype, flat):
    torch.manual_seed(0)
    conv = nn.Conv1d(C, O, K, padding=pad, groups=groups, bias=bias).to(dtype)
    assert rule_for(conv)[0] is _torch_conv1d_rule
    B, s, L = 3, 2 if flat else 1, 7
    x = torch.randn(B, s, C, L).to(dtype)
    T = L + 2 * pad - K + 1
    g = torch.randn(B, s, O, T).to(dtype)
    got = rows_by_rule(conv, x if flat else x[:, 0], g if flat else g[:, 0])
    for n, p in conv.named_parameters():
        ref = torch.stack([torch.autograd.grad(conv(x[b]), p, g[b])[0].double() for b in range(B)])
        rel = float((got[n].double() - ref).norm() / ref.norm())
        assert rel < {torch.float64: 1e-6, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype], (n, rel)


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv1d(4, 4, 3, stride=2),
        nn.Conv1d(4, 4, 3, dilation=2),
        nn.Conv1d(4, 4, 3, padding=1, padding_mode="circular"),
        nn.Conv1d(4, 4, 3, padding="same"),
    ],
)
def test_other_convolutions_keep_the_generic_rule(conv):
    assert rule_for(conv)[0] is generic_rule
