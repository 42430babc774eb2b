"""The fused-experts rule (covgrad.scores.experts._experts_rule) on routings that its sorted layout must get right:
an expert that receives no token of a sample, a sample whose rows carry no gradient (all padding), top-k > 1,
E not a power of 2, and ids outside [0, E) (a router's padding, routed nowhere); each (sample, expert) block
against one backward per sample of the module's own forward, with torch's grouped GEMM and with the padded
batched-matmul fallback. And a whole Qwen3-MoE of 5 experts, top 3, against the naive loop."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

import covgrad.scores.experts as experts
from covgrad.layout import select_parameters
from covgrad.scores.engine import PerSampleGrads
from covgrad.scores.rules import Call, Slot
from tests.helpers.families import build
from tests.helpers.persample import hook_scores, make_batch, max_rel_err, naive_scores

B, T_, H, I = 4, 6, 8, 6


def _module(kind: str, E: int, K: int) -> torch.nn.Module:
    """A fused experts block of ``kind`` with E experts, top K, every parameter random (biases too)."""
    torch.manual_seed(E * 10 + K)
    if kind == "qwen3-moe":
        config = T.Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=K)
        module = Qwen3MoeExperts(config)
    else:
        config = T.GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
        module = GptOssExperts(config)
        module.limit = 0.5  # its clamps of the gate and up columns active on many rows
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.5 * torch.randn(p.shape))
    assert experts._fused_experts_ok(module)
    return module


def _routing(E: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B·T, K) distinct ids per token and weights: sample 0 never routes to expert 0, sample 2 has ids −1 and E
    (routed nowhere) on some tokens."""
    gen = torch.Generator().manual_seed(E + K)
    index = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(B * T_)])
    index[:T_] = torch.stack([1 + torch.randperm(E - 1, generator=gen)[:K] for _ in range(T_)])
    index[2 * T_, 0], index[2 * T_ + 3, K - 1] = -1, E
    return index, torch.rand(B * T_, K, generator=gen)


def _naive(
    module: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, index: torch.Tensor, weights: torch.Tensor
) -> dict[str, torch.Tensor]:
    """name → (B, *shape): per sample, one backward of the module's forward on its own rows x (B, T, H) against
    g (B, T, H) (ids outside [0, E) replaced by expert 0 with weight 0: routed nowhere)."""
    E = module.num_experts
    inside = (index >= 0) & (index < E)
    index, weights = torch.where(inside, index, 0), torch.where(inside, weights, 0.0)
    names, params = zip(*module.named_parameters(), strict=True)
    rows = []
    for n in range(B):
        at = slice(n * T_, (n + 1) * T_)
        out = module(x[n], index[at], weights[at])
        rows.append(torch.autograd.grad((out * g[n]).sum(), params))
    return {name: torch.stack([r[i] for r in rows]) for i, name in enumerate(names)}


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize(("E", "K"), [(3, 2), (5, 3), (4, 1)])
@pytest.mark.parametrize("kind", ["qwen3-moe", "gpt-oss"])
def test_fused_rule_matches_one_backward_per_sample(kind, E, K, grouped, monkeypatch):
    if not grouped:
        monkeypatch.setitem(experts._GROUPED_MM, ("cpu", torch.float32), False)
    module = _module(kind, E, K)
    index, weights = _routing(E, K)
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(B, T_, H, generator=gen), torch.randn(B, T_, H, generator=gen)
    g[1] = 0.0  # sample 1: all padding, no gradient reaches its rows
    views = {name: torch.full((B, *p.shape), float("nan")) for name, p in module.named_parameters()}
    call = Call((x.reshape(B * T_, H), index, weights), {}, flat=True, length=T_)
    experts._experts_rule(module, x, g, Slot(lambda name: (views[name], True)), call=call)
    ref = _naive(module, x, g, index, weights)
    assert set(views) == set(ref)
    for name, want in ref.items():
        got = views[name]
        err = float((got - want).norm() / want.norm())
        assert err < 1e-5, (name, err)
        assert float(got[1].abs().max()) == 0.0, name  # the padding sample's blocks are exact zeros
    assert float(views["gate_up_proj"][0, 0].abs().max()) == 0.0  # expert 0 got no token of sample 0


def test_qwen3_moe_of_five_experts_top_three_matches_the_naive_loop():
    model = build(
        T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, num_experts=5, num_experts_per_tok=3, moe_intermediate_size=8
    )
    layout = select_parameters(model)
    assert any(rule is experts._experts_rule for _, rule, _ in PerSampleGrads(model, layout).bindings())
    batch = make_batch(7, [1, 5, 2, 4], [1, 3, 8, 5])  # sample 0: one prompt token, one response token
    err, where = max_rel_err(layout, hook_scores(model, layout, batch), naive_scores(model, layout, batch))
    assert err < 1e-5, (err, where)


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize(("E", "K"), [(3, 2), (4, 1)])
@pytest.mark.parametrize("kind", ["qwen3-moe", "gpt-oss"])
def test_fused_function_is_the_class_forward_and_its_rule_the_naive_loop(kind, E, K, grouped, monkeypatch):
    """The pass's autograd node of fused experts (covgrad.scores.experts._FusedExperts): its output, ∂x and ∂w
    against autograd of the class's own forward (ids outside [0, E) as expert 0 with weight 0, whose ∂w the node
    leaves 0: routed nowhere), and the rule fed by its forward (call.state) against the naive loop, the δ it
    leaves taken by the backward."""
    if not grouped:
        monkeypatch.setitem(experts._GROUPED_MM, ("cpu", torch.float32), False)
    module = _module(kind, E, K)
    index, weights = _routing(E, K)
    inside = (index >= 0) & (index < E)
    gen = torch.Generator().manual_seed(2)
    x, g = torch.randn(B * T_, H, generator=gen), torch.randn(B * T_, H, generator=gen)
    g[T_ : 2 * T_] = 0.0  # sample 1: all padding
    for p in module.parameters():
        p.requires_grad_(False)

    x_ref, w_ref = x.clone().requires_grad_(), torch.where(inside, weights, 0.0).requires_grad_()
    out_ref = type(module).forward(module, x_ref, torch.where(inside, index, 0), w_ref)
    dx_ref, dw_ref = torch.autograd.grad(out_ref, (x_ref, w_ref), g)

    x_new, w_new = x.clone().requires_grad_(), weights.clone().requires_grad_()
    out = experts._FusedExperts.apply(module, B, x_new, index, w_new)
    assert float((out - out_ref).detach().norm() / out_ref.detach().norm()) < 1e-6
    saved = out.covgrad_state
    saved.backward = out.grad_fn is not None  # as fused_forward marks it: the node's backward will run
    views = {name: torch.full((B, *p.shape), float("nan")) for name, p in module.named_parameters()}
    call = Call((x, index, weights), {}, flat=True, length=T_, state=saved)
    experts._experts_rule(module, x.reshape(B, T_, H), g.reshape(B, T_, H), Slot(lambda n: (views[n], True)), call)
    assert saved.dgu is not None  # left for the backward
    dx, dw = torch.autograd.grad(out, (x_new, w_new), g)
    assert saved.dgu is None  # taken by it
    assert float((dx - dx_ref).norm() / dx_ref.norm()) < 1e-5
    assert float((dw - torch.where(inside, dw_ref, 0.0)).norm() / dw_ref.norm()) < 1e-5
    assert float(dw[~inside].abs().max()) == 0.0
    (dx_alone,) = torch.autograd.grad(experts._FusedExperts.apply(module, B, x_new, index, w_new), x_new, g)
    assert float((dx_alone - dx).norm() / dx.norm()) < 1e-6  # without the rule, the backward forms δ itself

    for p in module.parameters():
        p.requires_grad_(True)
    ref = _naive(module, x.reshape(B, T_, H), g.reshape(B, T_, H), index, weights)
    for name, want in ref.items():
        err = float((views[name] - want).norm() / want.norm())
        assert err < 1e-5, (name, err)
        assert float(views[name][1].abs().max()) == 0.0, name


def test_a_pass_runs_fused_experts_as_one_autograd_node_and_gives_their_forward_back():
    """In a pass, each fused experts module's forward is the node (its output's grad_fn), and after it the class's."""
    model = build(
        T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8
    )
    layout = select_parameters(model)
    fused = [m for m, rule, _ in PerSampleGrads(model, layout).bindings() if rule is experts._experts_rule]
    seen = []
    handles = [m.register_forward_hook(lambda m, a, out: seen.append(type(out.grad_fn).__name__)) for m in fused]
    batch = make_batch(3, [2, 4, 3], [3, 2, 4])
    hook_scores(model, layout, batch)
    for h in handles:
        h.remove()
    assert fused and set(seen) >= {"_FusedExpertsBackward"}
    assert all("forward" not in vars(m) for m in fused)


@pytest.mark.parametrize("family", ["qwen3-moe", "gpt-oss"])
def test_bf16_moe_through_the_node_is_close_to_fp32_and_passes_the_self_check(family):
    """A bf16 MoE's pass runs its experts as the node in bf16 (the self-check compares Σ_n s_n with autograd of the
    class's own bf16 forward); the rows stay within bf16's reach of the fp32 model's."""
    if family == "qwen3-moe":
        model = build(T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, num_experts=4, num_experts_per_tok=2)
    else:
        model = build(T.GptOssConfig, T.GptOssForCausalLM, num_local_experts=4, num_experts_per_tok=2, head_dim=8)
    layout = select_parameters(model)
    batch = make_batch(8, [2, 4, 3], [3, 2, 4])
    ref = hook_scores(model, layout, batch)
    got = hook_scores(model.to(torch.bfloat16), layout, batch)
    rel = float((got.double() - ref.double()).norm() / ref.double().norm())
    assert rel < 2e-2, rel
    assert experts._GROUPED_MM.get(("cpu", torch.float32), True)  # a bf16 fallback leaves float32's grouped GEMM
