"""Preflight on model directories, and the whole pipeline (token Fisher included) on tiny Qwen3, Gemma 3
and GPT-2 directories."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch
import transformers as T

from covgrad.scores.preflight import check_model
from tests.helpers.arch_dirs import ARCH_GENERIC, SMALL, arch_dir, family_config
from tests.helpers.pipeline import tiny_config

FAMILIES = {
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, {"head_dim": 8}),
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, {"head_dim": 8, "sliding_window": 4}),
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
}

# A Llama whose final norm owns a weight, wraps a Linear and mixes the samples of a batch: no per-sample
# gradient exists (remote code, as a user's custom architecture would be).
BAD_MODELING = """
import torch
from torch import nn
from transformers import LlamaForCausalLM


class WrappedNorm(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.inner = nn.Linear(n, n, bias=False)

    def forward(self, x):
        return self.inner(x) * self.weight + x.mean(0, keepdim=True)


class BadLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.model.norm = WrappedNorm(config.hidden_size)
"""


def family_dir(path: Path, family: str, layers: int = 3) -> Path:
    """A random tiny ``family`` model with the character tokenizer, saved as a model directory."""
    from covgrad.rollouts.problems import build_char_tokenizer

    tok = build_char_tokenizer()
    special = {"pad_token_id": tok.pad_token_id, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id}
    torch.manual_seed(0)
    if family == "gpt2":  # absolute position embeddings: every stage must pass position ids
        cfg = T.GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=layers, n_head=4, n_positions=64, **special)
        model = T.GPT2LMHeadModel(cfg)
    else:
        config_cls, model_cls, extra = FAMILIES[family]
        cfg = config_cls(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            **special,
            **extra,
        )
        model = model_cls(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def bad_dir(path: Path) -> Path:
    family_dir(path, "llama")
    (path / "modeling_bad.py").write_text(BAD_MODELING)
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_bad.BadLlamaForCausalLM"}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_check_model_accepts_families(tmp_path, family):
    check_model(str(family_dir(tmp_path, family)), None)
    check_model(str(tmp_path), ["model.layers.2.*", "model.norm.weight"])


def test_check_model_names_parameter_and_module_type(tmp_path):
    path = str(bad_dir(tmp_path))
    with pytest.raises(ValueError, match=r"preflight .*'model\.norm\.weight'.*WrappedNorm"):
        check_model(path, None, trust_remote_code=True)
    # the layers are upstream of the norm that averages over the batch: their rows would take other samples' objectives
    with pytest.raises(
        ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight'.*flows through model\.norm \(a WrappedNorm\)"
    ):
        check_model(path, ["model.layers.*"], trust_remote_code=True)
    check_model(path, ["lm_head.weight", "model.norm.inner.weight"], trust_remote_code=True)  # downstream: fine


def _vocabulary(path: Path, vocab: int, pad: int) -> Path:
    """Give the saved config at ``path`` a ``vocab``-token vocabulary and pad id (preflight reads only the config)."""
    config = json.loads((path / "config.json").read_text())
    config.update(vocab_size=vocab, pad_token_id=pad)
    (path / "config.json").write_text(json.dumps(config))
    return path


def _spy(monkeypatch, fail_cut: bool = False) -> list[tuple[int, int]]:
    """(vocabulary, pad id) of every random copy preflight runs; ``fail_cut``: the cut-vocabulary copy raises."""
    from covgrad.scores import preflight

    seen, real = [], preflight._copy_pass

    def copy_pass(config, *args):
        text = config.get_text_config()
        seen.append((text.vocab_size, text.pad_token_id))
        if fail_cut and text.vocab_size == preflight._VOCAB:
            raise RuntimeError("a table sized by the vocabulary")
        return real(config, *args)

    monkeypatch.setattr(preflight, "_copy_pass", copy_pass)
    return seen


def test_the_random_copy_cuts_a_large_vocabulary_and_still_refuses(tmp_path, monkeypatch):
    """A 5,000-token vocabulary (pad id 4,999) is checked on a 512-token copy (pad id 511) in one pass; the
    sample-mixing norm is refused with the same lines (the cut copy refuses, and the full one decides)."""
    seen = _spy(monkeypatch)
    check_model(str(_vocabulary(family_dir(tmp_path / "ok", "llama"), 5000, 4999)), None)
    assert seen == [(512, 511)]
    bad = str(_vocabulary(bad_dir(tmp_path / "bad"), 5000, 4999))
    with pytest.raises(ValueError, match=r"preflight .*'model\.norm\.weight'.*WrappedNorm"):
        check_model(bad, None, trust_remote_code=True)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight'.*flows through model\.norm"):
        check_model(bad, None, trust_remote_code=True)
    assert seen[1:] == [(512, 511), (5000, 4999)] * 2


def test_a_copy_that_fails_at_the_cut_vocabulary_is_run_at_the_full_one(tmp_path, monkeypatch):
    seen = _spy(monkeypatch, fail_cut=True)
    summary = check_model(str(_vocabulary(family_dir(tmp_path, "llama"), 5000, 3)), None)
    assert summary.startswith("generic path: 0 of ") and seen == [(512, 3), (5000, 3)]


@pytest.mark.slow
def test_pipeline_refuses_unsupported_module_before_rollouts(prefect_server, tmp_path):
    from flows.pipeline import covgrad_pipeline
    from storage.artifacts import ArtifactStore
    from tasks.specs import plan

    cfg = family_config(tmp_path, bad_dir(tmp_path / "bad"), **{"model.trust_remote_code": True})
    with pytest.raises(ValueError, match=r"'model\.norm\.weight'.*WrappedNorm"):
        covgrad_pipeline(cfg)
    store = ArtifactStore(cfg.root)
    rollouts = [node.ref for node in plan(cfg).values() if node.ref.stage == "rollouts"]
    assert rollouts and not any(store.exists(ref) for ref in rollouts)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gemma3", "gpt2"])
def test_pipeline_completes_every_stage(prefect_server, tmp_path, family):
    from flows.pipeline import covgrad_pipeline
    from storage.artifacts import ArtifactStore
    from tasks.specs import plan

    cfg = family_config(tmp_path, family_dir(tmp_path / family, family))
    result = covgrad_pipeline(cfg)
    assert set(result["status"].values()) == {"computed"}
    store = ArtifactStore(cfg.root)
    assert all(store.is_complete(node.ref) for node in plan(cfg).values())


# A Llama whose top-level forward multiplies the final hidden states by a child module's weight with
# F.linear: the child's forward never runs, so no hook would see the weight (its rows would be zeros); and
# adds a logit bias the top-level module owns (refused before any pass).
PLANTED_MODELING = """
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast


class Mix(nn.Module):
    def __init__(self, n):
        super().__init__()
        self.weight = nn.Parameter(torch.eye(n))


class PlantedLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        super().__init__(config)
        self.mix = Mix(config.hidden_size)
        self.logit_bias = nn.Parameter(torch.zeros(()))

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
        h = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).last_hidden_state
        return CausalLMOutputWithPast(logits=self.lm_head(F.linear(h, self.mix.weight)) + self.logit_bias)
"""


def planted_dir(path: Path) -> Path:
    family_dir(path, "llama")
    (path / "modeling_planted.py").write_text(PLANTED_MODELING)
    config = json.loads((path / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_planted.PlantedLlamaForCausalLM"}
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_parameter_used_outside_its_module_refused_without_self_check(tmp_path):
    """Refused in the random copy's pass ('mix.weight') and before it ('logit_bias'): one refusal names both,
    with a selection of the full model that runs."""
    path = str(planted_dir(tmp_path))
    with pytest.raises(
        ValueError,
        match=r"preflight .*'logit_bias' is owned by the model's top-level .*'mix\.weight' is used by the forward "
        r"of the top-level model.*zeros.*model\.params = \[",
    ) as info:
        check_model(path, None, trust_remote_code=True, self_check=False)
    msg = str(info.value)
    assert "\n" not in msg and "2 selected parameters" in msg
    selection = ast.literal_eval(msg.split("model.params = ")[1])
    assert "model.layers.*.mlp.up_proj.weight" in selection and "mix.weight" not in selection
    check_model(path, selection, trust_remote_code=True, self_check=False)


def test_check_model_reports_the_generic_path(tmp_path):
    summary = check_model(str(family_dir(tmp_path, "gemma3")), None)  # the scaled embedding has a fast rule
    assert summary.startswith("generic path: 0 of ") and "(none)" in summary, summary


@pytest.mark.parametrize("family", list(ARCH_GENERIC))
def test_check_model_accepts_hybrid_and_moe_directories(tmp_path, family):
    summary = check_model(str(arch_dir(tmp_path, family)), None, self_check=False)
    assert summary.startswith("generic path: ") and ARCH_GENERIC[family] in summary, summary


@pytest.mark.slow
@pytest.mark.parametrize("family", list(ARCH_GENERIC))
def test_pipeline_completes_every_stage_on_hybrid_and_moe(prefect_server, tmp_path, family):
    """Every parameter selected: the generic-path ones (ARCH_GENERIC) are scored too."""
    from flows.pipeline import covgrad_pipeline
    from storage.artifacts import ArtifactStore
    from tasks.specs import plan

    cfg = family_config(tmp_path, arch_dir(tmp_path / family, family), **SMALL)
    result = covgrad_pipeline(cfg)
    assert set(result["status"].values()) == {"computed"}
    store = ArtifactStore(cfg.root)
    assert all(store.is_complete(node.ref) for node in plan(cfg).values())


def test_a_params_typo_on_the_demo_is_refused_before_training(tmp_path):
    """The demo model is built on the meta device, so a pattern that matches nothing fails in preflight."""
    from flows.preflight import preflight

    cfg = tiny_config(str(tmp_path / "root"), **{"model.params": ["model.layers.*.mlp.up_prj.weight"]})
    with pytest.raises(ValueError, match=r"^model\.params: parameter pattern 'model\.layers\.\*\.mlp\.up_prj\.weight'"):
        preflight(cfg)
    preflight(tiny_config(str(tmp_path / "root"), **{"model.params": ["model.layers.*.mlp.up_proj.weight"]}))
    assert not (tmp_path / "root").exists()
