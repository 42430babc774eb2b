"""Vector-Jacobian products of the gates' activations, by the kernels autograd runs for them.

An experts rule forms δ = ∂(gate input) for every routed (token, k) pair, (m, I) float32 per layer. Through
``torch.autograd.grad`` that costs a graph and an engine run per call, a millisecond on a 2048 × 48 block, more
than the grouped products around it; for the activations models use (SiLU, GELU exact and tanh, GPT-OSS's
clamped GLU) :func:`act_vjp` and :func:`glu_vjp` call the backward kernels themselves (``aten.silu_backward``,
``aten.gelu_backward``, ``aten.sigmoid_backward``) in autograd's order, so δ has the bytes autograd's would.
Any other activation is differentiated by autograd.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

try:
    from transformers.activations import GELUActivation, GELUTanh, SiLUActivation
except ImportError:  # an older transformers: only torch's own modules are recognised
    GELUActivation = GELUTanh = SiLUActivation = None

_Kernel = Callable[[Tensor, Tensor, Tensor | None], Tensor]


def _silu(g: Tensor, x: Tensor, out: Tensor | None) -> Tensor:
    if out is None:
        return torch.ops.aten.silu_backward(g, x)
    return torch.ops.aten.silu_backward.grad_input(g, x, grad_input=out)


def _gelu(approximate: str) -> _Kernel:
    def kernel(g: Tensor, x: Tensor, out: Tensor | None) -> Tensor:
        if out is None:
            return torch.ops.aten.gelu_backward(g, x, approximate=approximate)
        return torch.ops.aten.gelu_backward.grad_input(g, x, approximate=approximate, grad_input=out)

    return kernel


def _gelu_call(fn: object) -> str | None:
    """The ``approximate`` mode of a call to ``F.gelu`` (the function or a partial of it with that keyword only)."""
    if fn is F.gelu:
        return "none"
    if isinstance(fn, functools.partial) and fn.func is F.gelu and not fn.args and set(fn.keywords) <= {"approximate"}:
        return fn.keywords.get("approximate", "none")
    return None


def backward_kernel(act_fn: object) -> _Kernel | None:
    """The kernel (grad (…), x (…), out) ↦ grad ⊙ act_fn'(x) (into ``out`` where not None) that autograd runs for
    ``act_fn``, or None where it is not
    one of the recognised activations: ``F.silu``, ``nn.SiLU``, transformers' ``SiLUActivation``; ``F.gelu``,
    ``nn.GELU``, transformers' ``GELUActivation`` and ``GELUTanh`` on torch's kernel (a hub kernel swapped into
    ``SiLUActivation`` computes the same function, so the same derivative)."""
    cls = type(act_fn)
    if act_fn is F.silu or cls is nn.SiLU or cls is SiLUActivation:
        return _silu
    if cls is nn.GELU:
        return _gelu(act_fn.approximate)
    mode = _gelu_call(act_fn)
    if mode is None and cls in (GELUActivation, GELUTanh):
        mode = _gelu_call(act_fn.act)
    return None if mode is None else _gelu(mode)


def act_vjp(act_fn: Callable[[Tensor], Tensor], x: Tensor, g: Tensor, out: Tensor | None = None) -> Tensor:
    """grad ⊙ act_fn'(x): the vector-Jacobian product of the elementwise ``act_fn`` at x (…) for the output
    gradient g (…), same shape, written into ``out`` (…) where given; by the backward kernel where
    :func:`backward_kernel` knows one, else by autograd."""
    kernel = backward_kernel(act_fn)
    if kernel is not None:
        return kernel(g, x, out)
    with torch.enable_grad():
        leaf = x.detach().requires_grad_()
        grad = torch.autograd.grad(act_fn(leaf), leaf, g)[0]
    return grad if out is None else out.copy_(grad)


def glu_forward(gate: Tensor, limit: float, alpha: float) -> tuple[Tensor, Tensor, Tensor]:
    """GPT-OSS's gate activation f = c ⊙ σ(α c), c = min(gate, limit), on gate (…): (f, c, σ(α c)), each (…)."""
    c = gate.clamp(min=None, max=limit)
    s = torch.sigmoid(c * alpha)
    return c * s, c, s


def glu_vjp(
    gate: Tensor, c: Tensor, s: Tensor, g: Tensor, limit: float, alpha: float, out: Tensor | None = None
) -> Tensor:
    """The vector-Jacobian product of :func:`glu_forward` at gate (…) for the gradient g (…) of f, from its c and s:
    ∂gate = 1[gate ≤ limit] (g s + α σ'(α c) g c), in autograd's order of operations (the product's two
    gradients, the sigmoid's backward kernel, the clamp's mask: :func:`clamp_mask`), so the same bytes for finite
    inputs; written into ``out`` (…) where given."""
    dc = g * s + torch.ops.aten.sigmoid_backward(g * c, s) * alpha
    return clamp_mask(dc, gate, None, limit, out)


def clamp_mask(g: Tensor, x: Tensor, low: float | None, high: float | None, out: Tensor | None = None) -> Tensor:
    """The gradient of ``x.clamp(low, high)`` for its output gradient g: g where low ≤ x ≤ high, 0 elsewhere (…),
    for finite x; written into ``out`` (…) where given. Autograd's ``where(mask, g, 0)`` runs as bool kernels that
    cost several times an elementwise product on a CPU; hardtanh's backward kernel (0 where x ≤ lo or x ≥ hi) does
    it in one pass, with the bounds moved out to the next representable values so that x = low and x = high keep
    their gradient, as autograd's do."""
    lo = -torch.inf if low is None else _next(low, x.dtype, -torch.inf)
    hi = torch.inf if high is None else _next(high, x.dtype, torch.inf)
    if out is None:
        return torch.ops.aten.hardtanh_backward(g, x, lo, hi)
    return torch.ops.aten.hardtanh_backward.grad_input(g, x, lo, hi, grad_input=out)


@functools.lru_cache(maxsize=64)
def _next(value: float, dtype: torch.dtype, toward: float) -> float:
    """The ``dtype`` value next to ``value`` (rounded to ``dtype`` first) in the direction of ``toward``."""
    return torch.nextafter(torch.tensor(value, dtype=dtype), torch.tensor(toward, dtype=dtype)).item()
