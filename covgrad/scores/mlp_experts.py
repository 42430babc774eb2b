"""Per-sample rule of routed experts whose expert is a plain MLP, ``down_e act(up_e x)``: NemotronH's (the
Nemotron-3-Nano design), recognised by the source text of its forward (:func:`_mlp_experts_ok`).

That forward loops in Python over the experts its batch hits; :func:`covgrad.scores.experts._routed_experts_rule`
would run it with E·B widened experts (a loop of up to E·B iterations per backward). Here the per-sample products
are closed-form segmented GEMMs over the routed (token, k) pairs sorted by (expert, sample), as for the fused
experts (:class:`covgrad.scores.experts._Routes`).

Shape notation: B samples, T positions per sample, E experts, K routed experts per token, H the experts' input
size, I their intermediate size, m = B·T·K routed pairs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from covgrad.scores.activations import act_vjp
from covgrad.scores.experts import _routed, _write_groups
from covgrad.scores.rules import Call, Slot, _source_key, full_call

try:
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts
except ImportError:  # transformers without NemotronH
    NemotronHExperts = None

MLP_EXPERTS_PARAMS = frozenset({"up_proj", "down_proj"})


def _mlp_experts_ok(module: nn.Module) -> bool:
    """Whether ``module`` runs NemotronH's experts forward (by its source text): rows (B·T, H) routed by
    ``top_k_index`` (B·T, K) in [0, E] (E: no expert) with ``top_k_weights`` (B·T, K); expert e maps a row x to
    ``F.linear(act_fn(F.linear(x, up_proj[e])), down_proj[e])`` times its weight, summed over the token's K; up_proj
    (E, I, H) and down_proj (E, H, I) its only parameters; in any of transformers' expert implementations (eager,
    batched or grouped matmuls compute that map for a module without gate, bias, transposed weights or post-expert
    norm)."""
    if NemotronHExperts is None or _source_key(type(module).forward) != _source_key(NemotronHExperts.forward):
        return False
    flags = ("has_gate", "has_bias", "is_transposed", "has_post_expert_norm", "_is_expert_parallel")
    return (
        not any(getattr(module, f, False) for f in flags)
        and {n for n, _ in module.named_parameters()} == MLP_EXPERTS_PARAMS
        and callable(getattr(module, "act_fn", None))
    )


@full_call
def _mlp_experts_rule(module: nn.Module, x: Tensor, g: Tensor, slot: Slot, call: Call) -> None:
    """Plain-MLP experts (:func:`_mlp_experts_ok`): out_t = Σ_k w_{t,k} D_e act(U_e x_t), e = index_{t,k}.

    Per sample and expert, ∂D_e = Σ_{(t,k)→e} (w_{t,k} g_t) a_tᵀ (H, I) and ∂U_e = Σ δ_t x_tᵀ (I, H), with
    a = act(U_e x_t) and δ = act'(U_e x_t) ⊙ D_eᵀ (w_{t,k} g_t); only the sample's own tokens routed to e contribute
    (ids outside [0, E) add exact zeros). In float32 on the pairs sorted by (expert, sample): the experts' products
    as one segmented GEMM per expert, the per-sample outer products as one per (expert, sample); act' by autograd of
    the module's own act_fn. The routing weights w are constants here (the router has its own rule)."""
    s_up, s_down = slot("up_proj"), slot("down_proj")
    if s_up is None and s_down is None:
        return
    W_up = module.up_proj.detach().to(torch.float32)  # (E, I, H)
    W_down = module.down_proj.detach().to(torch.float32)  # (E, H, I)
    B, E = g.shape[0], W_up.shape[0]
    routes, xe = _routed(x, call, B, E)  # xe (m, H): each sorted pair's input
    do = routes.rows(g.reshape(-1, W_down.shape[1]).to(torch.float32), routes.w)  # (m, H) weighted output grads
    u = routes.times(xe, W_up.transpose(1, 2))  # (m, I)
    if s_down is not None:
        _write_groups(s_down, routes.outer_sums(do, module.act_fn(u)), E, B)
    if s_up is not None:
        delta = act_vjp(module.act_fn, u, routes.times(do, W_down))  # (m, I)
        _write_groups(s_up, routes.outer_sums(delta, xe), E, B)
