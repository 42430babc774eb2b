"""The gates' activation derivatives by backward kernels (covgrad.scores.activations) against autograd: the same
bytes for every recognised activation, on fresh random inputs in the layouts the experts rules pass (column-major
halves and interleaved columns), in float32 and float64; the clamp masks at their bounds exactly; autograd for
an activation the module does not know."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN, GELUActivation, GELUTanh, ReLUSquaredActivation, SiLUActivation
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

from covgrad.scores.activations import act_vjp, backward_kernel, clamp_mask, glu_forward, glu_vjp

KNOWN = {
    "F.silu": F.silu,
    "nn.SiLU": nn.SiLU(),
    "SiLUActivation": SiLUActivation(),
    "ACT2FN silu": ACT2FN["silu"],
    "F.gelu": F.gelu,
    "gelu tanh partial": functools.partial(F.gelu, approximate="tanh"),
    "nn.GELU": nn.GELU(),
    "nn.GELU tanh": nn.GELU(approximate="tanh"),
    "GELUActivation": GELUActivation(),
    "GELUTanh": GELUTanh(),
    "ACT2FN gelu_pytorch_tanh": ACT2FN["gelu_pytorch_tanh"],
}
UNKNOWN = {
    "ReLUSquared": ReLUSquaredActivation(),
    "GELU python": GELUActivation(use_gelu_python=True),
    "GELUTanh python": GELUTanh(use_gelu_tanh_python=True),
    "lambda": lambda x: x * torch.sigmoid(1.5 * x),
}


def _autograd_vjp(fn, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    leaf = x.detach().requires_grad_()
    return torch.autograd.grad(fn(leaf), leaf, g)[0]


def _column_major(rows: int, cols: int, dtype: torch.dtype, scale: float = 3.0) -> torch.Tensor:
    return (scale * torch.randn(cols, rows, dtype=dtype)).t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(KNOWN) + list(UNKNOWN))
def test_act_vjp_has_autograds_bytes(name: str, dtype: torch.dtype) -> None:
    fn = {**KNOWN, **UNKNOWN}[name]
    assert (backward_kernel(fn) is not None) == (name in KNOWN)
    gu = _column_major(257, 12, dtype)
    gate = gu.chunk(2, dim=-1)[0]  # a column-major half, as the default gate's
    g = _column_major(257, 6, dtype)
    assert torch.equal(act_vjp(fn, gate, g), _autograd_vjp(fn, gate, g))
    out = torch.full_like(gu, torch.nan)  # written into the gate's half of δ, as the experts rule does
    act_vjp(fn, gate, g, out=out[:, :6])
    assert torch.equal(out[:, :6], _autograd_vjp(fn, gate, g)) and out[:, 6:].isnan().all()


def test_a_subclass_is_differentiated_by_autograd() -> None:
    class Scaled(SiLUActivation):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * F.silu(x)

    x, g = torch.randn(40), torch.randn(40)
    assert backward_kernel(Scaled()) is None
    assert torch.equal(act_vjp(Scaled(), x, g), _autograd_vjp(Scaled(), x, g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gpt_oss_gate_has_autograds_bytes(dtype: torch.dtype) -> None:
    """GPT-OSS's gate (interleaved columns, the gate clamped above, up clamped both sides) on values that cross
    and sit exactly on the limit: glu_vjp and clamp_mask give autograd's gradient of the class's own gate."""
    torch.manual_seed(1)
    module = GptOssExperts.__new__(GptOssExperts)
    nn.Module.__init__(module)
    module.limit, module.alpha = 7.0, 1.702
    gu = _column_major(301, 16, dtype, scale=6.0).clone()
    gu[::7, 0], gu[1::7, 1], gu[2::7, 3] = module.limit, -module.limit, module.limit  # on the bounds
    da = _column_major(301, 8, dtype)
    gate, up = gu[..., ::2], gu[..., 1::2]
    f, c, s = glu_forward(gate, module.limit, module.alpha)
    factor = up.clamp(min=-module.limit, max=module.limit) + 1
    assert torch.equal(f * factor, module._apply_gate(gu))
    reference = _autograd_vjp(module._apply_gate, gu, da)
    assert torch.equal(glu_vjp(gate, c, s, da * factor, module.limit, module.alpha), reference[..., ::2])
    assert torch.equal(clamp_mask(da * f, up, -module.limit, module.limit), reference[..., 1::2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("bounds", [(-1.5, 2.0), (None, 2.0), (-1.5, None), (0.1, 0.1)])
def test_clamp_mask_is_clamps_gradient(bounds: tuple[float | None, float | None], dtype: torch.dtype) -> None:
    low, high = bounds
    x = torch.cat([torch.randn(500, dtype=dtype) * 3, torch.tensor([v for v in bounds if v is not None], dtype=dtype)])
    below = [torch.nextafter(v, torch.tensor(-torch.inf, dtype=dtype)) for v in x[-2:]]
    x = torch.cat([x, torch.stack(below)])  # the bounds and the floats just below them
    g = torch.randn_like(x)
    assert torch.equal(clamp_mask(g, x, low, high), _autograd_vjp(lambda t: t.clamp(low, high), x, g))
