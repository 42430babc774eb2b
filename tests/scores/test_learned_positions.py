"""OPT's learned position embedding (covgrad.scores.rules._learned_positions_rule): taken by the source text of its
forward (OPT's and BioGPT's verbatim copy, not a rewritten subclass); each sample's rows against autograd of the
module's own forward per sample, with position ids passed and counted from a left-padded attention mask (with a
cache length), and OPT's position and token tables against the naive loop with the rule in place (the whole
family: tests/families)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.biogpt.modeling_biogpt import BioGptLearnedPositionalEmbedding
from transformers.models.opt.modeling_opt import OPTLearnedPositionalEmbedding

from covgrad.layout import select_parameters
from covgrad.scores.binding import rule_for
from covgrad.scores.rules import Call, Slot, _learned_positions_rule
from tests.helpers.families import FAMILIES
from tests.helpers.persample import BATCH, hook_scores, make_batch, max_rel_err, naive_scores

B, L, H, N = 3, 6, 4, 10


def _mask() -> torch.Tensor:
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, :2] = 0  # left padding: the forward's counted positions start later there
    return mask


@pytest.mark.parametrize("cls", [OPTLearnedPositionalEmbedding, BioGptLearnedPositionalEmbedding])
@pytest.mark.parametrize("given", ["position_ids", "counted", "counted-with-cache"])
def test_rule_matches_autograd_per_sample(cls, given):
    torch.manual_seed(0)
    module = cls(N, H)
    mask = _mask()
    if given == "position_ids":
        args, kwargs = (mask,), {"position_ids": torch.randint(0, N, (B, L))}
    else:
        args, kwargs = ((mask, 2) if given == "counted-with-cache" else (mask,)), {}
    out = module(*args, **kwargs)
    g = torch.randn(out.shape)
    view = torch.full((B, *module.weight.shape), float("nan"))
    _learned_positions_rule(module, mask, g, Slot(lambda n: (view, True)), call=Call(args, kwargs, False, L))
    for n in range(B):
        row_args = tuple(a[n : n + 1] if isinstance(a, torch.Tensor) else a for a in args)
        row_kwargs = {k: v[n : n + 1] for k, v in kwargs.items()}
        (want,) = torch.autograd.grad((module(*row_args, **row_kwargs) * g[n : n + 1]).sum(), module.weight)
        torch.testing.assert_close(view[n], want, rtol=0, atol=1e-6)


def test_learned_positions_are_taken_by_source_text():
    assert rule_for(OPTLearnedPositionalEmbedding(N, H))[0] is _learned_positions_rule
    assert rule_for(BioGptLearnedPositionalEmbedding(N, H))[0] is _learned_positions_rule

    class Shifted(OPTLearnedPositionalEmbedding):  # another forward: not taken
        def forward(self, attention_mask, cache_length=0, position_ids=None):
            return super().forward(attention_mask, cache_length, position_ids) * 2

    assert rule_for(Shifted(N, H))[0] is not _learned_positions_rule


def test_opt_is_exact_with_the_rule():
    model = FAMILIES["opt"]()
    assert rule_for(model.model.decoder.embed_positions)[0] is _learned_positions_rule
    layout = select_parameters(model, ["model.decoder.embed_positions.weight", "model.decoder.embed_tokens.weight"])
    batch = make_batch(61, **BATCH)
    for check in (True, False):
        err, where = max_rel_err(
            layout, hook_scores(model, layout, batch, check=check), naive_scores(model, layout, batch)
        )
        assert err < 1e-5, (check, err, where)
