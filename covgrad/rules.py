"""Per-module rules: a hooked module's saved input and output gradient → every sample's parameter gradient.

A rule is called once per module call during the backward with the module, its saved (detached)
input ``x`` and the gradient ``g`` of the objective with respect to the module's output, both with a
leading batch dimension B. For each parameter it owns it asks ``slot(name)`` for a (B, *param.shape)
float32 view to write (first contribution) or accumulate into (a later call of the same module or a
tied module), or None when that parameter is not selected. :func:`rule_for` picks a module's rule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.pytorch_utils import Conv1D

# A rule's view of one parameter: (B, *param.shape) float32 slice of the output, and whether this is
# the first contribution in the call (write) or a later one from a tied module (accumulate).
Slot = Callable[[str], tuple[Tensor, bool] | None]
Rule = Callable[[nn.Module, Tensor, Tensor, Slot], None]

_HF_RMSNORMS = (LlamaRMSNorm, Qwen2RMSNorm, MistralRMSNorm)


_LOW = (torch.bfloat16, torch.float16)


def _flat(t: Tensor, B: int, features: int) -> Tensor:
    """(B, *, features) -> (B, T', features) float32; a bf16/fp16 source dtype is remembered on the result
    (``covgrad_low``) so that :func:`_bmm_into` can run the product on tensor cores without rounding."""
    out = t.reshape(B, -1, features).to(torch.float32)
    if t.dtype in _LOW:
        out.covgrad_low = t.dtype
    return out


def _low_dtype(*ts: Tensor) -> torch.dtype | None:
    """The common bf16/fp16 source dtype of float32 operands made by :func:`_flat` (or views of them), on
    cuda, where ``bmm(..., out_dtype=float32)`` exists (CPU kernels lack it: None there)."""
    found = {getattr(t, "covgrad_low", None) or getattr(t._base, "covgrad_low", None) for t in ts}
    low = found.pop() if len(found) == 1 else None
    return low if low is not None and all(t.is_cuda for t in ts) else None


def _bmm_into(view: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """view (B, m, n) float32 = or += a @ b. Operands that hold bf16/fp16 values exactly (from a low-precision
    model) are cast back and multiplied with fp32 accumulation on tensor cores: the same products as the
    fp32 GEMM on the upcast values, about 10x faster."""
    low = _low_dtype(a, b)
    if low is not None:
        a, b = a.to(low), b.to(low)
        if first:
            torch.bmm(a, b, out_dtype=torch.float32, out=view)
        else:
            view.add_(torch.bmm(a, b, out_dtype=torch.float32))
    elif first:
        torch.bmm(a, b, out=view)
    else:
        view.baddbmm_(a, b)


def _sum_into(view: Tensor, x: Tensor, first: bool) -> None:
    """view (B, n) = or += x.sum over positions; x (B, T', n)."""
    if first:
        torch.sum(x, dim=1, out=view)
    else:
        view.add_(x.sum(dim=1))


def _linear_rule(module: nn.Module, x: Tensor, g: Tensor, slot: Slot) -> None:
    """y = x Wᵀ + b: per-sample ∂W = Σ_t g_t x_tᵀ (B, out, in), ∂b = Σ_t g_t."""
    B = g.shape[0]
    g = _flat(g, B, module.out_features)  # (B, T', O)
    if (s := slot("weight")) is not None:
        _bmm_into(s[0], g.transpose(1, 2), _flat(x, B, module.in_features), s[1])
    if (s := slot("bias")) is not None:
        _sum_into(s[0], g, s[1])


def _conv1d_rule(module: nn.Module, x: Tensor, g: Tensor, slot: Slot) -> None:
    """GPT-2 Conv1D, y = x W + b with W (in, out): per-sample ∂W = Σ_t x_t g_tᵀ (B, in, out)."""
    B = g.shape[0]
    g = _flat(g, B, module.nf)
    if (s := slot("weight")) is not None:
        _bmm_into(s[0], _flat(x, B, module.nx).transpose(1, 2), g, s[1])
    if (s := slot("bias")) is not None:
        _sum_into(s[0], g, s[1])


def _embedding_rule(module: nn.Module, x: Tensor, g: Tensor, slot: Slot) -> None:
    """Row y of the table gets Σ_{t: id_t = y} g_t per sample; the padding row gets nothing."""
    B, H = g.shape[0], module.embedding_dim
    ids = x.reshape(B, -1)  # (B, T')
    g = _flat(g, B, H)
    if module.padding_idx is not None:
        g = g.masked_fill((ids == module.padding_idx)[..., None], 0.0)
    view, first = slot("weight")
    if first:
        view.zero_()
    view.scatter_add_(1, ids[..., None].expand(-1, -1, H), g)  # view (B, V, H)


def _layernorm_rule(module: nn.Module, x: Tensor, g: Tensor, slot: Slot) -> None:
    """y = x̂ ⊙ w + b with x̂ recomputed by the same kernel in float32: ∂w = Σ_t g ⊙ x̂, ∂b = Σ_t g."""
    B, n = g.shape[0], module.weight.numel()
    g = _flat(g, B, n)
    if (s := slot("weight")) is not None:
        xhat = F.layer_norm(x.to(torch.float32), module.normalized_shape, None, None, module.eps)
        _sum_into(s[0].view(B, n), g * _flat(xhat, B, n), s[1])
    if (s := slot("bias")) is not None:
        _sum_into(s[0].view(B, n), g, s[1])


def _hf_rmsnorm_rule(module: nn.Module, x: Tensor, g: Tensor, slot: Slot) -> None:
    """Llama/Qwen2/Mistral RMSNorm, y = w ⊙ (x·rsqrt(mean x² + ε) in float32, cast back to x's dtype)."""
    B, n = g.shape[0], module.weight.numel()
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    h = h.to(x.dtype)  # the module multiplies the weight by the normalised input in the input's dtype
    view, first = slot("weight")
    _sum_into(view.view(B, n), _flat(g, B, n) * _flat(h, B, n), first)


def _torch_rmsnorm_rule(module: nn.Module, x: Tensor, g: Tensor, slot: Slot) -> None:
    """torch.nn.RMSNorm: x̂ recomputed by F.rms_norm without weight, ∂w = Σ_t g ⊙ x̂."""
    B, n = g.shape[0], module.weight.numel()
    xhat = F.rms_norm(x, module.normalized_shape, None, module.eps)
    view, first = slot("weight")
    _sum_into(view.view(B, n), _flat(g, B, n) * _flat(xhat, B, n), first)


def rule_for(module: nn.Module) -> tuple[Rule, frozenset[str]] | str:
    """The module's rule and the parameter names it covers, or the reason it has none."""
    if isinstance(module, nn.Linear):
        return _linear_rule, frozenset({"weight", "bias"})
    if isinstance(module, Conv1D):
        return _conv1d_rule, frozenset({"weight", "bias"})
    if isinstance(module, nn.Embedding):
        if module.max_norm is not None or module.scale_grad_by_freq:
            return "max_norm and scale_grad_by_freq change the gradient and have no per-sample rule"
        return _embedding_rule, frozenset({"weight"})
    if isinstance(module, nn.LayerNorm):
        return _layernorm_rule, frozenset({"weight", "bias"})
    if isinstance(module, _HF_RMSNORMS):
        return _hf_rmsnorm_rule, frozenset({"weight"})
    if isinstance(module, nn.RMSNorm):
        return _torch_rmsnorm_rule, frozenset({"weight"})
    return (
        "supported: nn.Linear, transformers Conv1D, nn.Embedding, nn.LayerNorm, nn.RMSNorm, "
        "Llama/Qwen2/Mistral RMSNorm; deselect it or add a rule"
    )
