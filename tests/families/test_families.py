"""Family matrix: every selected tensor of every per-sample score of tiny models of the causal-LM families
people post-train today matches a naive one-backward-per-sequence loop (left padding, prompt masks, norms,
biases and routers moved away from their init)."""

from __future__ import annotations

import pytest
from torch import nn

from covgrad.layout import ParamLayout, select_parameters
from covgrad.scores.binding import rule_for
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from covgrad.scores.rules import _scaled_embedding_rule, generic_rule, rmsnorm_rule
from tests.helpers.families import FAMILIES, perturb
from tests.helpers.models import tiny_llama
from tests.helpers.persample import BATCH, PAD, V, hook_scores, make_batch, max_rel_err, naive_scores


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_naive_loop(name):
    model = FAMILIES[name]()
    layout = select_parameters(model)
    if name == "lora-llama":
        assert layout.names and all("lora_" in n for n in layout.names)  # only the adapters are trainable
    batch = make_batch(30, **BATCH)
    got = hook_scores(model, layout, batch, tau=0.8)  # with the self-check
    ref = naive_scores(model, layout, batch, tau=0.8)
    # A tensor whose exact gradient is 0 (OPT's key bias: the softmax ignores a shift shared by all keys;
    # with rotary positions it is not shared) holds rounding noise: compared in absolute terms.
    block = lambda S, e: S[:, e.offset : e.offset + e.numel]  # noqa: E731
    zero = [e for e in layout.entries if float(block(ref, e).norm()) < 1e-6 * float(ref.norm())]
    assert [e.name for e in zero if "k_proj.bias" not in e.name] == []
    for e in zero:
        assert float(block(got, e).norm()) < 1e-6 * float(ref.norm()), e.name
    err, where = max_rel_err(ParamLayout(tuple(e for e in layout.entries if e not in zero)), got, ref)
    assert err < 1e-5, (name, err, where)


def test_norms_use_the_fast_rule_and_subclasses_the_generic_one():
    for name in ("qwen3", "gemma3", "olmo2", "phi3", "granite", "smollm3", "mixtral"):
        model = FAMILIES[name]()
        norms = [m for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")]
        assert norms and all(rule_for(m)[0] is rmsnorm_rule for m in norms), name
    gemma = FAMILIES["gemma3"]()
    assert type(gemma.model.embed_tokens).__name__ == "Gemma3TextScaledWordEmbedding"
    assert rule_for(gemma.model.embed_tokens)[0] is _scaled_embedding_rule  # verbatim Gemma forward

    class Doubled(type(gemma.model.embed_tokens)):
        def forward(self, input_ids):
            return 2 * super().forward(input_ids)

    assert rule_for(Doubled(V, 8, PAD))[0] is generic_rule  # a subclass that changes the forward


class Flattener(nn.Module):
    """Runs a Linear on a (B·L, H) view, like OPT's layers: row n·L + t is sample n's position t, or with
    ``by_position`` row t·B + n (a correct computation whose rows are not sample by sample)."""

    def __init__(self, inner: nn.Linear, by_position: bool = False) -> None:
        super().__init__()
        self.inner, self.by_position = inner, by_position

    def forward(self, x):
        if self.by_position:
            B, L, H = x.shape
            y = self.inner(x.transpose(0, 1).reshape(-1, H))
            return y.reshape(L, B, -1).transpose(0, 1)
        return self.inner(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


def test_flattened_batch_verified_by_a_check_and_exact():
    model = perturb(tiny_llama(V, intermediate=48, pad_token_id=PAD))
    mlp = model.model.layers[0].mlp
    mlp.up_proj = Flattener(mlp.up_proj).eval()
    layout = select_parameters(model)
    batch = make_batch(31, **BATCH)
    err, where = max_rel_err(layout, hook_scores(model, layout, batch), naive_scores(model, layout, batch))
    assert err < 1e-5, (err, where)


def test_flattened_rows_not_sample_by_sample_refused():
    model = perturb(tiny_llama(V, intermediate=48, pad_token_id=PAD))
    mlp = model.model.layers[0].mlp
    mlp.up_proj = Flattener(mlp.up_proj, by_position=True).eval()
    batch = make_batch(31, **BATCH)
    psg = PerSampleGrads(model, select_parameters(model))
    with pytest.raises(ValueError, match=r"up_proj\.inner \(a Linear\) runs on inputs whose leading dimension is not"):
        psg(
            batch["input_ids"],
            batch["attention_mask"],
            lambda z: score_logit_grad(z, batch["input_ids"], batch["target_mask"]),
            position_ids=batch["position_ids"],
        )


def test_moe_router_alone_selected():
    """Only the routers: their outputs are graph roots (nothing upstream is hooked)."""
    model = FAMILIES["qwen3-moe"]()
    layout = select_parameters(model, ["*.mlp.gate.weight"])
    assert len(layout.names) == 2
    batch = make_batch(32, **BATCH)
    err, where = max_rel_err(layout, hook_scores(model, layout, batch), naive_scores(model, layout, batch))
    assert err < 1e-5, (err, where)
