"""Llama 4's dense experts rule (covgrad.scores.dense_experts._dense_experts_rule): every token once per expert, rows
expert-major. Each (sample, expert) block against one backward per sample of the module's own forward, on fresh
random inputs, in float32 and from bf16 inputs; the binding: taken by source text, not by class name; and the
autograd node a pass runs it as: the class's forward and input gradient, its state read by the rule."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

import covgrad.scores.dense_experts as experts
from covgrad.layout import select_parameters
from covgrad.scores.binding import rule_for
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from covgrad.scores.rules import Call, Slot
from tests.families.matrix import MATRIX
from tests.helpers.experts import assert_blocks_match, spread
from tests.helpers.persample import BATCH, make_batch, max_rel_err, naive_scores

B, T_, H, I, E = 3, 5, 8, 6, 4


def _module() -> Llama4TextExperts:
    return spread(Llama4TextExperts(T.Llama4TextConfig(hidden_size=H, intermediate_size=I, num_local_experts=E)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_rule_matches_one_backward_per_sample(dtype):
    torch.manual_seed(0)
    module = _module()
    x = torch.randn(B, E, T_, H).to(dtype)  # sample n's rows for expert e: x[n, e]
    g = torch.randn(B, E, T_, H).to(dtype)
    g[1] = 0.0  # a sample with no gradient: exact zeros
    views = {name: torch.full((B, *p.shape), float("nan")) for name, p in module.named_parameters()}
    call = Call((x.transpose(0, 1).reshape(E * B * T_, H),), {}, flat=True, length=T_, outer=E)
    experts._dense_experts_rule(
        module, x.reshape(B, E * T_, H), g.reshape(B, E * T_, H), Slot(lambda n: (views[n], True)), call=call
    )
    names, params = zip(*module.named_parameters(), strict=True)

    def want(n: int) -> dict[str, torch.Tensor]:  # the forward on sample n's rows alone, in float32 on the same values
        with torch.enable_grad():
            out = torch.func.functional_call(
                module, {k: p.float() for k, p in zip(names, params, strict=True)}, (x[n].float().reshape(-1, H),)
            )
            grads = torch.autograd.grad((out * g[n].float().reshape(-1, H)).sum(), params, allow_unused=True)
        return dict(zip(names, grads, strict=True))

    assert_blocks_match(views, want, B, zero=1)


def test_dense_experts_are_taken_by_source_text():
    module = _module()
    assert rule_for(module)[0] is experts._dense_experts_rule

    class Renamed(Llama4TextExperts):  # another name, the same forward: taken
        pass

    renamed = Renamed(T.Llama4TextConfig(hidden_size=H, intermediate_size=I, num_local_experts=E))
    assert rule_for(renamed)[0] is experts._dense_experts_rule

    class Scaled(Llama4TextExperts):  # another forward: not taken
        def forward(self, hidden_states):
            return 2 * super().forward(hidden_states)

    scaled = Scaled(T.Llama4TextConfig(hidden_size=H, intermediate_size=I, num_local_experts=E))
    assert rule_for(scaled)[0] is not experts._dense_experts_rule


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_rule", [True, False], ids=["rule-dgu", "own-dgu"])
def test_dense_node_is_the_class_forward_and_its_input_gradient(dtype, with_rule):
    """The node's forward is the class's, bit for bit; its ∂x is autograd's through the class's forward (float32:
    1e-6; bf16: the node's δ in float32, within bf16 rounding), whether the rule left δ or the backward forms it;
    and the rule on the node's state gives the blocks of the rule on the call's rows (float32: 1e-6)."""
    torch.manual_seed(1)
    module = _module().to(dtype)
    x = torch.randn(E * B * T_, H).to(dtype)
    g = torch.randn(E * B * T_, H).to(dtype)
    xs = x.detach().requires_grad_()
    (want_dx,) = torch.autograd.grad(module(xs), xs, g)
    xs = x.detach().requires_grad_()
    out = experts._DenseExperts.apply(module, xs)
    assert torch.equal(out, module(x))
    state = out.covgrad_state
    state.backward = True
    views = {name: torch.empty((B, *p.shape)) for name, p in module.named_parameters()}
    if with_rule:
        call = Call((x,), {}, flat=True, length=T_, outer=E, state=state)
        gb = g.reshape(E, B, T_, H).transpose(0, 1).reshape(B, E * T_, H)
        xb = x.reshape(E, B, T_, H).transpose(0, 1).reshape(B, E * T_, H)
        experts._dense_experts_rule(module, xb, gb, Slot(lambda n: (views[n], True)), call=call)
        assert state.dgu is not None
        if dtype == torch.float32:
            again = {name: torch.empty_like(v) for name, v in views.items()}
            plain = Call((x,), {}, flat=True, length=T_, outer=E)
            experts._dense_experts_rule(module, xb, gb, Slot(lambda n: (again[n], True)), call=plain)
            for name in views:
                torch.testing.assert_close(views[name], again[name], rtol=1e-6, atol=1e-6)
    (dx,) = torch.autograd.grad(out, xs, g)
    assert state.dgu is None  # handed to the backward once
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(dx.float(), want_dx.float(), **tol)


def test_dense_experts_run_as_the_node_in_a_pass(monkeypatch):
    """In a pass of PerSampleGrads on a tiny Llama 4, each dense experts module runs as the node (its forward given
    back after the pass), the rule reads the node's state, and the rows equal the naive loop's."""
    calls, states = [], []
    node = experts._DenseExperts

    class Counting(node):
        @staticmethod
        def forward(ctx, module, hidden):
            calls.append(id(module))
            return node.forward(ctx, module, hidden)

    rule = experts._dense_experts_rule

    def recording(module, x, g, slot, call):
        states.append(call.state)
        return rule(module, x, g, slot, call=call)

    recording.needs_call = True
    monkeypatch.setattr(experts, "_DenseExperts", Counting)
    monkeypatch.setattr("covgrad.scores.binding._dense_experts_rule", recording)
    model = MATRIX["llama4"]()
    layout = select_parameters(model)
    dense = [m for m in model.modules() if experts._dense_experts_ok(m)]
    batch = make_batch(31, **BATCH)
    ids = batch["input_ids"]
    psg = PerSampleGrads(model, layout)
    got = psg(
        ids, batch["attention_mask"], lambda z: score_logit_grad(z, ids, batch["target_mask"]), batch["position_ids"]
    )
    assert dense and sorted(set(calls)) == sorted(id(m) for m in dense)
    assert states and all(isinstance(s, experts._DenseCall) for s in states)
    assert all("forward" not in m.__dict__ for m in dense)
    err, where = max_rel_err(layout, got, naive_scores(model, layout, batch))
    assert err < 1e-5, (err, where)
