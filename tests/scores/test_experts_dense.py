"""Llama 4's dense experts rule (covgrad.scores.experts._dense_experts_rule): every token once per expert, rows
expert-major. Each (sample, expert) block against one backward per sample of the module's own forward, on fresh
random inputs, in float32 and from bf16 inputs; and the binding: taken by source text, not by class name."""

from __future__ import annotations

import pytest
import torch
import transformers as T
from transformers.models.llama4.modeling_llama4 import Llama4TextExperts

import covgrad.scores.experts as experts
from covgrad.scores.binding import rule_for
from covgrad.scores.rules import Call, Slot
from tests.helpers.experts import assert_blocks_match, spread

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
