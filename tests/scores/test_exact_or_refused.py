"""Exact or refused, never silently wrong: the per-sample rows of patterns that once crashed or were silently wrong
against a float64 one-backward-per-sequence loop, and refusals that name every parameter once with a selection
that runs, exactly.

- NemotronH with its MoE layers (a rows probe of the router's op taps once ran the norm's tap rule mid-forward),
  tied, unchecked and right-padded here (the family matrix runs it untied and left-padded);
- the embedding output updated in place by the model (``h *= √H``, ``h += positions``; GIT's ``embeddings +=
  position_embeddings``): the engine's graph roots are copies, never leaves the model writes into;
- a tensor registered under two names (an LM head's bias that is also its decoder Linear's): bound once;
- refusals of a module called several times, of a module whose output no rule takes (turned into its
  parameters) and of a module whose input the model updates after its call; the trace taken before sharding
  raises its refusals itself.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Callable

import pytest
import torch
import transformers as T
from torch import nn

from covgrad.layout import ParamLayout, select_parameters
from covgrad.scores.centering import score_logit_grad
from covgrad.scores.engine import PerSampleGrads
from covgrad.scores.tracing import RefusalError
from tests.helpers.families_hybrid import FAMILIES
from tests.helpers.persample import BATCH, PAD, V, llama, make_batch, naive_scores, right_padded

H = 32


def naive64(build: Callable[[], nn.Module], layout: ParamLayout, batch: dict) -> torch.Tensor:
    """(B, P) float64: the naive loop on a float64 copy of the model ``build()`` builds."""
    return naive_scores(build().double(), layout, batch).double()


def rows(model: nn.Module, layout: ParamLayout, batch: dict, **kw: object) -> torch.Tensor:
    psg = PerSampleGrads(model, layout, **kw)
    ids = batch["input_ids"]
    fn = lambda z: score_logit_grad(z, ids, batch["target_mask"])  # noqa: E731
    return psg(ids, batch["attention_mask"], fn, position_ids=batch["position_ids"])


def worst(layout: ParamLayout, got: torch.Tensor, ref: torch.Tensor) -> tuple[float, str]:
    """Largest per-tensor ‖got − ref‖ / ‖ref‖ (a tensor whose exact gradient is 0 against 1e-6 of the whole
    gradient's norm)."""
    floor = 1e-6 * float(ref.norm())
    out = (0.0, "")
    for e in layout.entries:
        a, b = got[:, e.offset : e.offset + e.numel].double(), ref[:, e.offset : e.offset + e.numel]
        out = max(out, (float((a - b).norm()) / max(float(b.norm()), floor), e.name))
    return out


def proposal(msg: str) -> list[str]:
    """The ``model.params`` selection a one-line refusal proposes."""
    assert "\n" not in msg and "model.params = " in msg, msg
    return ast.literal_eval(msg.split("model.params = ")[1])


def tied_nemotron_h_moe() -> nn.Module:
    """The family matrix's NemotronH with MoE layers (Nemotron-3-Nano's design), its LM head tied to the
    embeddings by hand (its config's tie_word_embeddings is not applied)."""
    model = FAMILIES["nemotron-h-moe"]()
    model.lm_head.weight = model.model.embeddings.weight
    return model


def eager_experts(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """``build`` with the experts' eager loop (grouped_mm has no float64 kernel): the same map."""

    def built() -> nn.Module:
        model = build()
        model.config._experts_implementation = "eager"
        return model

    return built


def test_nemotron_h_moe_tied_unchecked_right_padded_is_exact():
    model = tied_nemotron_h_moe()
    layout = select_parameters(model)
    assert "lm_head.weight" not in layout.names and any(".experts.up_proj" in n for n in layout.names)
    batch = right_padded(make_batch(57, **BATCH))
    ref = naive64(eager_experts(tied_nemotron_h_moe), layout, batch)
    err, where = worst(layout, rows(model, layout, batch, check=False), ref)
    assert err < 1e-5, (err, where)


class InPlaceEmbeddings(nn.Module):
    """Updates the embedding output in place before the first layer (a pre-hook of it), as Gemma-style
    (``inputs_embeds *= normalizer``) and BERT-style (``embeddings += position_embeddings``) forwards do."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = nn.Embedding(64, H)

    def update(self, layer: nn.Module, args: tuple, kwargs: dict) -> None:
        h = args[0]
        h *= math.sqrt(H)
        h += self.positions(kwargs["position_ids"])


def in_place_llama(tied: bool) -> nn.Module:
    model = llama(tied)
    torch.manual_seed(3)
    model.model.in_place = InPlaceEmbeddings()
    model.model.layers[0].register_forward_pre_hook(model.model.in_place.update, with_kwargs=True)
    return model.eval()


@pytest.mark.parametrize(("tied", "padding"), [(True, "left"), (False, "right")])
def test_embedding_output_updated_in_place_is_exact(tied, padding):
    model = in_place_llama(tied)
    layout = select_parameters(model)
    assert "model.embed_tokens.weight" in layout.names and "model.in_place.positions.weight" in layout.names
    batch = make_batch(50, **BATCH)
    batch = right_padded(batch) if padding == "right" else batch
    ref = naive64(lambda: in_place_llama(tied), layout, batch)
    err, where = worst(layout, rows(model, layout, batch), ref)
    assert err < 1e-5, (err, where)


def git() -> nn.Module:
    """A tiny text-only GIT: ``embeddings = word_embeddings(ids); embeddings += position_embeddings``."""
    torch.manual_seed(0)
    vision = {"hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    config = T.GitConfig(
        vision_config={**vision, "image_size": 8, "patch_size": 4},
        vocab_size=V,
        hidden_size=H,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        pad_token_id=PAD,
    )
    return T.GitForCausalLM(config).eval()


def test_git_embeddings_updated_in_place_are_exact():
    model = git()
    layout = select_parameters(model, ["git.embeddings.*", "git.encoder.*", "output.*"])
    batch = make_batch(51, **BATCH)
    err, where = worst(layout, rows(model, layout, batch), naive64(git, layout, batch))
    assert err < 1e-5, (err, where)


def bert() -> nn.Module:
    """A tiny BERT LM head model: ``cls.predictions.bias`` is also ``cls.predictions.decoder.bias``."""
    torch.manual_seed(0)
    config = T.BertConfig(
        vocab_size=V,
        hidden_size=H,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        is_decoder=True,
        pad_token_id=PAD,
        max_position_embeddings=64,
    )
    model = T.BertLMHeadModel(config).eval()
    with torch.no_grad():
        model.cls.predictions.bias.normal_()
    return model


def test_tensor_registered_under_two_names_is_bound_once_and_exact_unchecked():
    model = bert()
    head = model.cls.predictions
    assert head.bias is head.decoder.bias
    layout = select_parameters(model)
    psg = PerSampleGrads(model, layout, check=False)
    bound = [m for m, _, local in psg.bindings() for e in local.values() if e.name == "cls.predictions.bias"]
    assert bound == [head.decoder]
    batch = make_batch(52, **BATCH)
    err, where = worst(layout, rows(model, layout, batch, check=False), naive64(bert, layout, batch))
    assert err < 1e-5, (err, where)


class BiasedHead(nn.Module):
    """An LM head whose bias is its decoder's too and which also adds it itself: the outer use moves the bias to
    this module's generic rule, whose replay must follow both names."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = nn.Linear(H, V)
        self.bias = self.decoder.bias

    def forward(self, x):
        return self.decoder(x) + 0.5 * self.bias


def biased_head_llama() -> nn.Module:
    model = llama(tied=False)
    torch.manual_seed(4)
    model.lm_head = BiasedHead()
    with torch.no_grad():
        model.lm_head.bias.normal_()
    return model.eval()


@pytest.mark.parametrize("op_taps", [True, False])
def test_registered_twice_and_used_by_both_modules_is_exact(op_taps):
    model = biased_head_llama()
    layout = select_parameters(model, ["lm_head.*", "model.norm.weight"])
    batch = make_batch(53, **BATCH)
    got = rows(model, layout, batch, check=False, op_taps=op_taps)
    err, where = worst(layout, got, naive64(biased_head_llama, layout, batch))
    assert err < 1e-5, (err, where)


class ByPosition(nn.Module):
    """A Linear run on a position-major (L·B, H) view: correct, but its rows are not sample by sample."""

    def __init__(self, inner: nn.Linear) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        B, L, _ = x.shape
        return self.inner(x.transpose(0, 1).reshape(B * L, -1)).reshape(L, B, -1).transpose(0, 1)


def shared_by_position_llama() -> nn.Module:
    """One ByPosition Linear shared by the gate and up projections of both layers: four calls."""
    model = llama(tied=False)
    shared = ByPosition(model.model.layers[0].mlp.up_proj)
    for layer in model.model.layers:
        layer.mlp.gate_proj = layer.mlp.up_proj = shared
    return model.eval()


def test_module_called_four_times_refused_once_with_a_selection_that_runs_exactly():
    model = shared_by_position_llama()
    batch = make_batch(54, **BATCH)
    name = "model.layers.0.mlp.gate_proj.inner.weight"
    with pytest.raises(RefusalError, match=r"leading dimension is not sample by sample") as info:
        rows(model, select_parameters(model), batch)
    msg = str(info.value)
    assert msg.startswith(f"no per-sample rule for parameter '{name}'") and msg.count(f"'{name}'") == 1, msg
    layout = select_parameters(model, proposal(msg))
    assert name not in layout.names and len(layout.names) == len(select_parameters(model).names) - 1
    err, where = worst(layout, rows(model, layout, batch), naive64(shared_by_position_llama, layout, batch))
    assert err < 1e-5, (err, where)


class DictGain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.3 * torch.randn(H))

    def forward(self, x):
        return {"out": x * self.weight}


class Unwrapped(nn.Module):
    """A norm followed by a gain that returns a dict (no rule takes its output), unwrapped here."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm, self.gain = norm, DictGain()

    def forward(self, x):
        return self.gain(self.norm(x))["out"]


def dict_gain_llama() -> nn.Module:
    model = llama(tied=True)
    torch.manual_seed(5)
    for layer in model.model.layers:
        layer.post_attention_layernorm = Unwrapped(layer.post_attention_layernorm)
    return model.eval()


def test_module_level_refusal_names_its_parameters_with_a_selection_that_runs_exactly():
    """The module replay's hook cannot take a dict output: each layer's gain parameter is named (not "deselect
    its parameters"), in one refusal raised once the pass is over, and again by every later call."""
    model = dict_gain_llama()
    batch = make_batch(55, **BATCH)
    psg = PerSampleGrads(model, select_parameters(model), op_taps=False)
    ids = batch["input_ids"]
    fn = lambda z: score_logit_grad(z, ids, batch["target_mask"])  # noqa: E731
    for _ in range(2):
        with pytest.raises(
            RefusalError, match=r"2 selected parameters: 'model\.layers\.0\.post_attention_layernorm\.gain"
        ):
            psg(ids, batch["attention_mask"], fn, position_ids=batch["position_ids"])
    refused = psg._refused.reasons
    assert list(refused) == [f"model.layers.{i}.post_attention_layernorm.gain.weight" for i in (0, 1)]
    assert all("returned dict" in why for why in refused.values())
    with pytest.raises(RefusalError) as info:
        rows(model, select_parameters(model), batch, op_taps=False)
    layout = select_parameters(model, proposal(str(info.value)))
    got = rows(model, layout, batch, op_taps=False)
    err, where = worst(layout, got, naive64(dict_gain_llama, layout, batch))
    assert err < 1e-5, (err, where)


class Gain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.3 * torch.randn(48))

    def forward(self, x):
        return x * self.weight


class LateUpdate(nn.Module):
    """Runs a module, then updates its input in place: its rule would read the updated values."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        h = x * 1.0
        y = self.inner(h)
        h.mul_(2.0)
        return y


@pytest.mark.parametrize("kind", ["linear", "op-tap"])
def test_input_updated_after_the_call_is_refused(kind):
    """A Linear's rule (its saved input) and a generic parameter's op (its kept data input)."""
    model = llama(tied=False)
    mlp = model.model.layers[1].mlp
    inner = mlp.down_proj if kind == "linear" else nn.Sequential(Gain(), mlp.down_proj)
    mlp.down_proj = LateUpdate(inner).eval()
    batch = make_batch(56, **BATCH)
    name = "model.layers.1.mlp.down_proj.inner" + (".weight" if kind == "linear" else ".0.weight")
    with pytest.raises(RefusalError, match=rf"'{name}': an input of .* was updated in place after its call"):
        rows(model, select_parameters(model), batch, check=False)


def test_trace_alone_refuses_as_before_sharding():
    """The trace taken before sharding (its bindings are handed to every rank) raises its refusals itself."""
    from covgrad.distributed.fsdp import trace_unsharded

    model = shared_by_position_llama()
    batch = make_batch(54, **BATCH)
    example = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids")}
    with pytest.raises(RefusalError, match=r"'model\.layers\.0\.mlp\.gate_proj\.inner\.weight'.*leading dimension"):
        trace_unsharded(model, select_parameters(model), example)
