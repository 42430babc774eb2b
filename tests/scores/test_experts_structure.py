"""Experts recognised by what they do, not by class: MoE designs the fused-experts rule does not know by name (a
stacked weight indexed by routed token groups: ``weight[e]`` on each expert's gathered rows, a matmul per expert
over the slices of rows sorted by expert, NemotronH's non-gated experts in each of transformers' implementations)
take the routed-experts rule (one batched backward with the experts widened per sample), exactly against the
one-backward-per-sequence loop, with the self-check on and off, tied and untied, left and right padding. A forward
that does something else with its stacked weights (one that mixes the experts) fails the rule's probe and takes
the module replay, exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from covgrad.layout import select_parameters
from covgrad.scores import binding
from covgrad.scores import experts as expert_rules
from covgrad.scores.engine import PerSampleGrads
from tests.helpers.families import FAMILIES as FAMILIES_DENSE
from tests.helpers.families_hybrid import FAMILIES
from tests.helpers.models import tiny_llama
from tests.helpers.persample import BATCH, PAD, V, hook_scores, make_batch, max_rel_err, naive_scores, right_padded

H, E, I, K = 32, 4, 16, 2


class GatheredExperts(nn.Module):
    """Per expert e: its tokens' rows gathered (``hidden[rows]``), ``silu(rows W_e + b_e) D_e`` scaled by the
    routing weight and added back at the rows; a (E, H) per-expert output gain."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = E
        self.w_in = nn.Parameter(0.2 * torch.randn(E, I, H))
        self.b_in = nn.Parameter(0.2 * torch.randn(E, I))
        self.w_out = nn.Parameter(0.2 * torch.randn(E, H, I))
        self.gain = nn.Parameter(1.0 + 0.2 * torch.randn(E, H))

    def forward(self, hidden: Tensor, index: Tensor, weights: Tensor) -> Tensor:
        out = torch.zeros_like(hidden)  # (N, H)
        for e in range(self.num_experts):
            rows, k = torch.where(index == e)
            y = F.linear(F.silu(F.linear(hidden[rows], self.w_in[e], self.b_in[e])), self.w_out[e]) * self.gain[e]
            out.index_add_(0, rows, y * weights[rows, k, None])
        return out


class SortedExperts(GatheredExperts):
    """JetMoE's pattern: the routed (token, k) pairs sorted by expert, split into per-expert slices of rows, one
    matmul per slice with ``weight[e]``, the results scattered back."""

    def forward(self, hidden: Tensor, index: Tensor, weights: Tensor) -> Tensor:
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        x = hidden[order // index.shape[1]]  # (N·K, H) sorted by expert
        parts = [
            F.linear(F.silu(F.linear(xs, self.w_in[e], self.b_in[e])), self.w_out[e]) * self.gain[e]
            for e, xs in enumerate(x.split(counts))
        ]
        y = torch.cat(parts) * weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden).index_add_(0, order // index.shape[1], y)


class MixedExperts(GatheredExperts):
    """Every expert also uses the mean of all experts' input weights: not a function of its own weights alone."""

    def forward(self, hidden: Tensor, index: Tensor, weights: Tensor) -> Tensor:
        shared = self.w_in.mean(0)
        out = torch.zeros_like(hidden)
        for e in range(self.num_experts):
            rows, k = torch.where(index == e)
            a = F.silu(F.linear(hidden[rows], self.w_in[e] + shared, self.b_in[e]))
            out.index_add_(0, rows, F.linear(a, self.w_out[e]) * self.gain[e] * weights[rows, k, None])
        return out


class ExpertMLP(nn.Module):
    """One expert of the older Mixtral layout: w2(silu(w1 x) ⊙ w3 x), three Linears."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(H, I, bias=False), nn.Linear(H, I)
        self.w2 = nn.Linear(I, H, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class ListedExperts(nn.Module):
    """transformers 4's Mixtral block: a ModuleList of expert modules, each called on its tokens' gathered rows."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts = E
        self.experts = nn.ModuleList(ExpertMLP() for _ in range(E))

    def forward(self, hidden: Tensor, index: Tensor, weights: Tensor) -> Tensor:
        out = torch.zeros_like(hidden)
        hit = torch.nn.functional.one_hot(index, self.num_experts).sum((0, 1)).nonzero()[:, 0].tolist()
        for e in hit:
            rows, k = torch.where(index == e)
            out.index_add_(0, rows, self.experts[e](hidden[rows]) * weights[rows, k, None])
        return out


class Moe(nn.Module):
    """A softmax top-K router over (B·L, H) rows and the experts, in place of a Llama MLP."""

    def __init__(self, experts: nn.Module) -> None:
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = experts

    def forward(self, x: Tensor) -> Tensor:
        h = x.reshape(-1, H)
        weights, index = torch.topk(self.router(h).softmax(-1), K, dim=-1)
        return self.experts(h, index, weights / weights.sum(-1, keepdim=True)).reshape(x.shape)


EXPERTS = {"gathered": GatheredExperts, "sorted": SortedExperts, "mixed": MixedExperts, "listed": ListedExperts}


def moe_llama(kind: str, tied: bool = False) -> nn.Module:
    model = tiny_llama(V, intermediate=48, tied=tied, pad_token_id=PAD)
    torch.manual_seed(1)
    for layer in model.model.layers:
        layer.mlp = Moe(EXPERTS[kind]())
    return model.eval()


def experts_of(model: nn.Module) -> list[nn.Module]:
    kinds = (GatheredExperts, ListedExperts)
    return [m for m in model.modules() if isinstance(m, kinds) or type(m).__name__ == "NemotronHExperts"]


@pytest.mark.parametrize(
    ("kind", "tied", "padding"),
    [("gathered", False, "left"), ("gathered", True, "right"), ("sorted", False, "left"), ("listed", True, "left")],
)
def test_experts_by_structure_take_the_routed_rule_exactly(kind, tied, padding):
    model = moe_llama(kind, tied)
    layout = select_parameters(model)
    batch = make_batch(50, **BATCH)
    if padding == "right":
        batch = right_padded(batch)
    assert all(binding.rule_for(m)[0] is expert_rules._routed_experts_rule for m in experts_of(model))
    ref = naive_scores(model, layout, batch)
    for check in (True, False):
        err, where = max_rel_err(layout, hook_scores(model, layout, batch, check=check), ref)
        assert err < 1e-5, (kind, check, err, where)
    assert [expert_rules.experts_path(m) for m in experts_of(model)] == ["routed", "routed"]


def test_experts_that_mix_their_weights_fail_the_probe_and_take_the_replay_exactly():
    model = moe_llama("mixed")
    layout = select_parameters(model)
    batch = make_batch(51, **BATCH)
    err, where = max_rel_err(layout, hook_scores(model, layout, batch, check=False), naive_scores(model, layout, batch))
    assert err < 1e-5, (err, where)
    assert [expert_rules.experts_path(m) for m in experts_of(model)] == ["replay", "replay"]


def test_probe_rejects_a_forward_whose_rows_read_other_samples_copies():
    """The probe alone: the widened forward of the mixing design moves every sample's rows when one sample's
    copies move; the gathered design's moves only that sample's."""
    h = torch.randn(4 * 5, H)
    index = torch.stack([torch.randperm(E)[:K] for _ in range(20)])
    weights = torch.rand(20, K)
    for cls, want in ((GatheredExperts, True), (MixedExperts, False)):
        torch.manual_seed(2)
        module = cls()
        wide = {pn: p.detach().repeat_interleave(4, 0) for pn, p in module.named_parameters()}
        ids = index * 4 + (torch.arange(20) // 5)[:, None]
        leaves, spec = torch.utils._pytree.tree_flatten(((h, index, weights), {}))
        ex = expert_rules.experts_shape(module)
        assert expert_rules._routed_separates(module, ex, 4, wide, leaves, spec, 1, ids) is want


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm", "eager"])
def test_nemotron_h_experts_take_the_routed_rule_in_every_implementation(implementation, monkeypatch):
    """NemotronH's non-gated relu² experts (Nemotron-3-Nano) are not a class the fused-experts rule knows; with
    their own closed-form rule (covgrad.scores.mlp_experts) switched off, they are recognised by structure."""
    monkeypatch.setattr(binding, "_mlp_experts_ok", lambda module: False)
    model = FAMILIES["nemotron-h-moe"]()
    model.config._experts_implementation = implementation
    layout = select_parameters(model, ["*experts*", "*mixer.gate.weight", "lm_head.weight"])
    batch = make_batch(52, **BATCH)
    psg = PerSampleGrads(model, layout)
    assert {rule for m, rule, _ in psg.bindings() if m in experts_of(model)} == {expert_rules._routed_experts_rule}
    err, where = max_rel_err(layout, hook_scores(model, layout, batch), naive_scores(model, layout, batch))
    assert err < 1e-5, (implementation, err, where)
    assert [expert_rules.experts_path(m) for m in experts_of(model)] == ["routed"]


@pytest.mark.parametrize("name", ["qwen3-moe", "gpt-oss", "gemma4-moe", "deepseek-v3"])
def test_designs_the_fused_rule_knows_by_class_are_exact_by_structure_too(name, monkeypatch):
    """With the class-matched fused-experts rule switched off, transformers' own expert classes (gated, with
    biases and transposed weights, GPT-OSS's clamped gate) are recognised by structure and exact."""
    monkeypatch.setattr(binding, "_fused_experts_ok", lambda module: False)
    model = FAMILIES[name]() if name in FAMILIES else FAMILIES_DENSE[name]()
    layout = select_parameters(model, ["*experts*"])
    batch = make_batch(53, **BATCH)
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert experts and all(binding.rule_for(m)[0] is expert_rules._routed_experts_rule for m in experts)
    err, where = max_rel_err(layout, hook_scores(model, layout, batch, check=False), naive_scores(model, layout, batch))
    assert err < 1e-5, (name, err, where)
    assert {expert_rules.experts_path(m) for m in experts} == {"routed"}
