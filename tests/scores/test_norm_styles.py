"""The RMSNorm rule on every norm class it recognises by the body of its forward: per-sample ∂w equals autograd's
gradient of that module alone, one sample at a time, in float64, float32 and bfloat16 (padding rows included:
the rule sees every position, as the engine hands it)."""

from __future__ import annotations

import importlib

import pytest
import torch

from covgrad.scores.rules import Slot, _rmsnorm_style, rmsnorm_rule

# (transformers module, class, constructor keyword for the width, the style its forward has)
NORMS = [
    ("llama.modeling_llama", "LlamaRMSNorm", "cast-then-scale"),
    ("mamba2.modeling_mamba2", "Mamba2RMSNorm", "cast-then-scale"),
    ("zamba2.modeling_zamba2", "Zamba2RMSNorm", "cast-then-scale"),
    ("llama4.modeling_llama4", "Llama4TextRMSNorm", "cast-then-scale"),
    ("olmo2.modeling_olmo2", "Olmo2RMSNorm", "scale-then-cast"),
    ("nemotron_h.modeling_nemotron_h", "NemotronHRMSNorm", "scale-then-cast"),
    ("gemma3.modeling_gemma3", "Gemma3RMSNorm", "one-plus-w"),
    ("gemma3n.modeling_gemma3n", "Gemma3nRMSNorm", "pow"),
    ("gemma4.modeling_gemma4", "Gemma4RMSNorm", "pow"),
    ("cohere2_moe.modeling_cohere2_moe", "Cohere2MoeLayerNorm", "centered"),
    ("cohere.modeling_cohere", "CohereLayerNorm", "centered"),
]
TOL = {torch.float64: 1e-6, torch.float32: 1e-5, torch.bfloat16: 2e-2}  # the rule writes float32 rows


def rule_rows(module: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The rule's (B, n) float32 per-sample gradient of the module's weight."""
    out = torch.empty(x.shape[0], module.weight.numel())
    rmsnorm_rule(module, x, g, Slot(lambda name: (out, True) if name == "weight" else None))
    return out


def autograd_rows(module: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Autograd's gradient of the module's weight for each sample alone, (B, n) in float64."""
    rows = []
    for n in range(x.shape[0]):
        (grad,) = torch.autograd.grad(module(x[n : n + 1]), module.weight, g[n : n + 1])
        rows.append(grad.double().reshape(-1))
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("module", "name", "style"), NORMS)
def test_a_recognised_norm_has_its_per_sample_gradient(module, name, style, dtype):
    cls = getattr(importlib.import_module(f"transformers.models.{module}"), name)
    assert _rmsnorm_style(cls) == style
    torch.manual_seed(0)
    norm = cls(16)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.3 * torch.randn(16))
    norm = norm.to(dtype)
    x = (2.0 * torch.randn(4, 6, 16) + 0.5).to(dtype)
    g = torch.randn(4, 6, 16).to(dtype)
    ref = autograd_rows(norm, x, g)
    got = rule_rows(norm, x, g).double()
    rel = float((got - ref).norm() / ref.norm())
    assert rel < TOL[dtype], (name, dtype, rel)


def test_a_forward_with_another_body_is_not_recognised():
    llama = importlib.import_module("transformers.models.llama.modeling_llama").LlamaRMSNorm

    class Shifted(llama):
        def forward(self, hidden_states):
            return super().forward(hidden_states) + 1.0

    assert _rmsnorm_style(Shifted) is None
