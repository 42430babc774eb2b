"""Plain-MLP experts rule (covgrad.scores.mlp_experts): NemotronH's non-gated relu² experts. Each (sample, expert)
block against one backward per sample of the module's own forward on fresh random inputs (the "no expert" id E
and a sample without gradient included), in float32 and from bf16 inputs; the model against the naive loop in each
of transformers' expert implementations; and the binding: taken by source text, not by class name."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

from covgrad.layout import select_parameters
from covgrad.scores import binding
from covgrad.scores.engine import PerSampleGrads
from covgrad.scores.mlp_experts import _mlp_experts_rule
from covgrad.scores.rules import Call, Slot
from tests.helpers.experts import assert_blocks_match, spread
from tests.helpers.families_hybrid import FAMILIES
from tests.helpers.persample import BATCH, hook_scores, make_batch, max_rel_err, naive_scores

B, T_, K = 3, 5, 2


def _experts() -> NemotronHExperts:
    model = FAMILIES["nemotron-h-moe"]()
    return spread(next(m for m in model.modules() if isinstance(m, NemotronHExperts)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mlp_rule_matches_one_backward_per_sample(dtype):
    torch.manual_seed(0)
    module = _experts().to(dtype)
    E, _, H = module.up_proj.shape
    x = torch.randn(B, T_, H).to(dtype)
    g = torch.randn(B, T_, H).to(dtype)
    g[1] = 0.0  # a sample with no gradient: exact zeros
    index = torch.stack([torch.randperm(E)[:K] for _ in range(B * T_)])
    index[3, 0] = E  # "no expert": skipped by the forward, zero here
    weights = torch.rand(B * T_, K).to(dtype)
    views = {name: torch.full((B, *p.shape), float("nan")) for name, p in module.named_parameters()}
    call = Call((x.reshape(-1, H), index, weights), {}, flat=True, length=T_)
    _mlp_experts_rule(module, x, g, Slot(lambda n: (views[n], True)), call=call)
    p32 = {k: p.detach().float() for k, p in module.named_parameters()}
    reference = copy.deepcopy(module).float()

    def want(n: int) -> dict[str, torch.Tensor]:  # the forward on sample n's rows alone, in float32, same values
        rows = slice(n * T_, (n + 1) * T_)
        leaves = {k: p.clone().requires_grad_() for k, p in p32.items()}
        with torch.enable_grad():
            out = torch.func.functional_call(reference, leaves, (x[n].float(), index[rows], weights[rows].float()))
            return dict(
                zip(leaves, torch.autograd.grad((out * g[n].float()).sum(), list(leaves.values())), strict=True)
            )

    assert_blocks_match(views, want, B, zero=1)


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm", "eager"])
def test_nemotron_h_moe_is_exact_with_the_mlp_rule(implementation):
    model = FAMILIES["nemotron-h-moe"]()
    model.config._experts_implementation = implementation
    layout = select_parameters(model, ["*experts*", "*mixer.gate.weight", "lm_head.weight"])
    batch = make_batch(54, **BATCH)
    psg = PerSampleGrads(model, layout)
    experts = [m for m in model.modules() if isinstance(m, NemotronHExperts)]
    assert {rule for m, rule, _ in psg.bindings() if m in experts} == {_mlp_experts_rule}
    for check in (True, False):
        err, where = max_rel_err(
            layout, hook_scores(model, layout, batch, check=check), naive_scores(model, layout, batch)
        )
        assert err < 1e-5, (implementation, check, err, where)


def test_mlp_experts_are_taken_by_source_text():
    module = _experts()
    assert binding.rule_for(module)[0] is _mlp_experts_rule

    class Renamed(NemotronHExperts):  # another name, the same forward: taken
        pass

    renamed = Renamed(module.config)
    assert binding.rule_for(renamed)[0] is _mlp_experts_rule

    class Scaled(NemotronHExperts):  # another forward: not taken
        def forward(self, hidden_states, top_k_index, top_k_weights):
            return 2 * super().forward(hidden_states, top_k_index, top_k_weights)

    assert binding.rule_for(Scaled(module.config))[0] is not _mlp_experts_rule
    module.has_bias = True  # a flag the implementations read: not this rule's map
    assert binding.rule_for(module)[0] is not _mlp_experts_rule
