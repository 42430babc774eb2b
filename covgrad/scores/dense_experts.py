"""Llama 4's dense experts: every token once per expert, the rows expert-major (the (E·N, H) input viewed as
(E, N, H)), ``act(gate) ⊙ up`` on the halves of ``x @ gate_up_proj`` (E, H, 2I), then ``@ down_proj`` (E, I, H).

Recognised by the source text of the forward (:func:`_dense_experts_ok`), they take :func:`_dense_experts_rule`:
per (expert, sample) block one batched product per tensor. In a pass of :class:`covgrad.scores.engine.PerSampleGrads`
the module runs as one autograd node (:class:`_DenseExperts`, :func:`dense_forward`), as the fused experts do
(:func:`covgrad.scores.experts.fused_forward`): the rule reads the forward's gate, up and act(gate) instead of
recomputing them, and the node's backward forms ∂x from the rule's δ instead of autograd's graph through the class's
forward recomputing the same products.

Shape notation: B samples in the batch, T positions per sample, E experts, N = B·T rows per expert, H hidden size,
I intermediate size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from covgrad.scores.activations import act_vjp
from covgrad.scores.experts import _Restore, _write_groups, node_forward
from covgrad.scores.rules import Call, Slot, _source_key, full_call

try:
    from transformers.models.llama4.modeling_llama4 import Llama4TextExperts
except ImportError:
    Llama4TextExperts = None


def _dense_experts_ok(module: nn.Module) -> bool:
    """Whether ``module`` runs Llama 4's dense experts forward (by its source text): an (E·N, H) input viewed as
    (E, N, H), every row through its expert, ``act(gate) ⊙ up`` on the halves of ``x @ gate_up_proj`` (E, H, 2I),
    then ``@ down_proj`` (E, I, H); those two tensors its only parameters."""
    if Llama4TextExperts is None or _source_key(type(module).forward) != _source_key(Llama4TextExperts.forward):
        return False
    return {n for n, _ in module.named_parameters()} == {"gate_up_proj", "down_proj"}


@dataclass
class _DenseCall:
    """What a :class:`_DenseExperts` forward keeps for the rule and its backward: the rows xs (E, N, H), gate and
    up (E, N, I) each, f = act(gate) (E, N, I), all in the model's dtype; the rule leaves dgu (E, N, 2I) float32,
    the gradient of x @ gate_up_proj, and gate_up_proj (E, H, 2I) in float32 for the backward, which takes and clears
    them (a bf16 model's experts are cast once per backward; ``backward``: the output is in the graph)."""

    xs: Tensor
    gate: Tensor
    up: Tensor
    f: Tensor
    dgu: Tensor | None = None
    W_gu: Tensor | None = None
    backward: bool = False


def _dgu(module: nn.Module, gate: Tensor, up: Tensor, f: Tensor, gs: Tensor, W_d: Tensor) -> Tensor:
    """The gradient of x @ gate_up_proj (E, N, 2I) float32 from the output gradient gs (E, N, H) float32: ∂a = gs
    D_eᵀ, then [∂gate; ∂up] = [act'(gate) ⊙ ∂a ⊙ up; ∂a ⊙ f] (act's vector-Jacobian product:
    :func:`covgrad.scores.activations.act_vjp`)."""
    da = torch.bmm(gs, W_d.transpose(1, 2))  # (E, N, I)
    return torch.cat([act_vjp(module.act_fn, gate, da * up), da * f], dim=-1)


class _DenseExperts(torch.autograd.Function):
    """Llama 4's dense experts forward as one autograd node: the forward is the class's (the same operations in the
    model's dtype) and keeps xs, gate, up and act(gate) (:class:`_DenseCall`); the rule, run from the output's
    gradient hook before this node's backward, leaves δ = ∂(x @ gate_up_proj) here; the backward then forms ∂x = δ
    G_eᵀ only. The experts' weights are constants (frozen during the pass)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, module: nn.Module, hidden: Tensor) -> Tensor:
        W_gu, W_d = module.gate_up_proj.detach(), module.down_proj.detach()
        xs = hidden.detach().view(W_gu.shape[0], -1, module.hidden_size)
        gate, up = torch.bmm(xs, W_gu).chunk(2, dim=-1)
        f = module.act_fn(gate)
        out = torch.bmm(up * f, W_d).view(-1, module.hidden_size)
        saved = _DenseCall(xs, gate, up, f)
        ctx.module, ctx.saved, ctx.dtype = module, saved, hidden.dtype
        out.covgrad_state = saved
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, g: Tensor) -> tuple[Tensor | None, ...]:
        saved, module = ctx.saved, ctx.module
        W_gu, saved.W_gu = saved.W_gu, None
        if W_gu is None:
            W_gu = module.gate_up_proj.detach().to(torch.float32)
        dgu, saved.dgu = saved.dgu, None
        if dgu is None:  # the rule did not run for this backward (its tensors refused, or a probe's backward)
            gs = g.reshape(saved.xs.shape).to(torch.float32)
            W_d = module.down_proj.detach().to(torch.float32)
            gate, up, f = (t.to(torch.float32) for t in (saved.gate, saved.up, saved.f))
            dgu = _dgu(module, gate, up, f, gs, W_d)
        dx = torch.bmm(dgu, W_gu.transpose(1, 2)).reshape(g.shape).to(ctx.dtype)
        return None, dx


def dense_forward(owner: Any, module: nn.Module) -> _Restore:
    """Run a dense-experts module (:func:`_dense_experts_ok`) as :class:`_DenseExperts` in the passes of ``owner``
    (:func:`covgrad.scores.experts.node_forward`)."""
    return node_forward(
        owner, module, lambda args, kwargs, B: _DenseExperts.apply(module, args[0] if args else kwargs["hidden_states"])
    )


@full_call
def _dense_experts_rule(module: nn.Module, x: Tensor, g: Tensor, slot: Slot, call: Call) -> None:
    """Llama 4's dense experts (:func:`_dense_experts_ok`): the call's rows are expert-major (row (e·B + n)·T + t is
    sample n's position t for expert e, as the first call's trace found; the rule reads the call's rows as they are
    and the output gradient as the hook hands it over, (B, E·T, …)). Per sample and expert, ∂G_e = Σ_t x_{e,t}
    δ_{e,t}ᵀ (H, 2I) and ∂D_e = Σ_t a_{e,t} g_{e,t}ᵀ (I, H) over the sample's T rows of expert e, with a =
    act(gate) ⊙ up and δ its vector-Jacobian product on the halves: the forward's and ∂a's products once over all
    rows per expert, then one batched product per tensor over the E·B (expert, sample) blocks, in float32. A call run
    by :class:`_DenseExperts` (``call.state``) takes xs, gate, up and act(gate) from the forward and leaves δ for
    that node's backward."""
    W_gu, W_d = module.gate_up_proj.detach().to(torch.float32), module.down_proj.detach().to(torch.float32)
    B, (E, H, _) = g.shape[0], W_gu.shape
    saved = call.state
    if saved is not None:
        xs = saved.xs.to(torch.float32)
        gate, up, f = (t.to(torch.float32) for t in (saved.gate, saved.up, saved.f))
    else:
        xs = call.args[0].reshape(E, -1, H).to(torch.float32)  # (E, B·T, H): the call's own expert-major rows
        gate, up = torch.bmm(xs, W_gu).chunk(2, dim=-1)  # (E, B·T, I) each
        f = module.act_fn(gate)
    T = xs.shape[1] // B
    gs = g.reshape(B, E, T, H).transpose(0, 1).reshape(E, B * T, H).to(torch.float32)
    dgu = _dgu(module, gate, up, f, gs, W_d)
    if saved is not None and saved.backward:
        saved.dgu, saved.W_gu = dgu, W_gu

    def write(s: tuple[Tensor, bool] | None, left: Tensor, right: Tensor) -> None:
        """Σ over each (expert, sample) block's T rows of left (E, B·T, p) × right (E, B·T, q) into s."""
        if s is not None:
            p, q = left.shape[-1], right.shape[-1]
            _write_groups(s, torch.bmm(left.reshape(E * B, T, p).transpose(1, 2), right.reshape(E * B, T, q)), E, B)

    write(slot("down_proj"), up * f, gs)
    write(slot("gate_up_proj"), xs, dgu)
