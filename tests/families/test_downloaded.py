"""Checkpoints as people download them (issue 47): a multimodal ``*ForConditionalGeneration`` that transformers'
``AutoModelForCausalLM`` builds (Gemma 3 4B-27B) is accepted, loaded with its tokenizer and scored on its language
model (its vision tower selected only when ``model.params`` names it), and a model whose config gives no
``max_position_embeddings`` (state-space families) takes its context from its tokenizer or ``model.max_length``.

The mapping and the context rules are tested directly; ``covgrad run`` completes once on each kind of directory
(marked slow: a saved tiny Gemma3ForConditionalGeneration with every default, a saved tiny Mamba2 with
``model.max_length``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from covgrad.offline import OFFLINE_ENV
from tests.helpers.arch_dirs import SMALL, arch_dir, family_config
from tests.helpers.pipeline import REPO


def gemma3_vlm_dir(path: Path) -> Path:
    """A tiny ``Gemma3ForConditionalGeneration`` (2-layer text model, 1-layer SigLIP vision tower, tied embedding)
    with the character tokenizer, saved as a downloaded Gemma 3 4B directory is laid out."""
    import torch
    import transformers as T

    from covgrad.rollouts.problems import build_char_tokenizer

    tok = build_char_tokenizer()
    text = {
        "vocab_size": len(tok),
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 64,
        "sliding_window": 4,
        "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }
    vision = {
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    }
    torch.manual_seed(0)
    config = T.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    T.Gemma3ForConditionalGeneration(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gemma3_vlm(tmp_path_factory) -> Path:
    return gemma3_vlm_dir(tmp_path_factory.mktemp("downloaded") / "gemma3-vlm")


@pytest.fixture(scope="module")
def mamba2(tmp_path_factory) -> Path:
    """A tiny Mamba2 with the character tokenizer (``model_max_length``: the unbounded sentinel): nothing in the
    directory tells its context."""
    return arch_dir(tmp_path_factory.mktemp("downloaded") / "mamba2", "mamba2")


def test_the_causal_lm_mapping_is_transformers_own_read_without_importing_it():
    """The mapping read from transformers' source is the imported ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, and reading
    it (with checking a directory) loads neither transformers nor torch: the early preflight stays fast."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from storage.models import causal_lm_classes

    assert causal_lm_classes() == dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert causal_lm_classes()["gemma3"] == "Gemma3ForConditionalGeneration"
    code = (
        "import sys; from storage.models import causal_lm_classes; causal_lm_classes(); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_every_class_auto_model_for_causal_lm_maps_is_accepted():
    from storage.models import causal_lm_classes, is_causal_lm

    mapping = causal_lm_classes()
    refused = [t for t, c in mapping.items() if not is_causal_lm({"model_type": t, "architectures": [c]})]
    assert not refused
    conditional = [c for c in mapping.values() if c.endswith("ForConditionalGeneration")]
    assert "Gemma3ForConditionalGeneration" in conditional and len(conditional) >= 3


@pytest.mark.parametrize(
    ("config", "causal"),
    [
        ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}, True),
        ({"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]}, True),
        ({"model_type": "llama"}, True),  # no architectures: the model_type decides
        ({"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"]}, False),
        ({"model_type": "bert", "architectures": ["BertModel"]}, False),  # bert maps, but these weights have no head
        ({"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]}, False),
        ({"model_type": "llama", "architectures": ["LLaMAForCausalLM"]}, True),  # an older name of the class
        ({"model_type": "x", "architectures": ["XForCausalLM"]}, False),  # a name alone is not enough
        ({"model_type": "t5", "architectures": ["T5WithLMHeadModel"]}, False),  # nor a seq2seq model
        ({"model_type": "x", "auto_map": {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}}, True),
    ],
)
def test_is_causal_lm_follows_what_auto_model_for_causal_lm_builds(config, causal):
    from storage.models import is_causal_lm

    assert is_causal_lm(config) is causal


def test_a_refused_directory_names_why_in_one_line(tmp_path):
    from storage.models import check_model_dir

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"]})
    )
    with pytest.raises(ValueError, match=r"not a causal LM .*'llava'.*AutoModelForCausalLM does not build it") as err:
        check_model_dir(str(tmp_path), "model.path")
    assert "\n" not in str(err.value)


def test_multimodal_directory_loads_with_its_tokenizer_and_selects_the_language_model(gemma3_vlm):
    """``check_model_dir`` accepts the saved directory; it loads with AutoModelForCausalLM and AutoTokenizer (also
    when tokenizer_config.json names the model's processor, as downloaded Gemma 3 directories do); the default
    selection is the language model's every parameter (its tied LM head once), a ``model.params`` glob still reaches
    the vision tower, and a text-only model's default stays every parameter."""
    import shutil

    from covgrad.layout import select_parameters
    from storage.models import check_model_dir, load_model_and_tokenizer
    from tests.helpers.models import tiny_llama

    check_model_dir(str(gemma3_vlm), "model.path")
    model, tok = load_model_and_tokenizer(gemma3_vlm)
    assert type(model).__name__ == "Gemma3ForConditionalGeneration"
    names = dict(model.named_parameters())
    language = [n for n in names if n.startswith("model.language_model.")]
    assert list(select_parameters(model).names) == language
    assert len(language) < len(names) and any(n.startswith("model.vision_tower.") for n in names)
    vision = select_parameters(model, ["model.vision_tower.*"]).names
    assert vision and all(n.startswith("model.vision_tower.") for n in vision)
    llama = tiny_llama(16)
    assert list(select_parameters(llama).names) == [n for n, _ in llama.named_parameters()]

    processor = gemma3_vlm.parent / "with-processor"
    shutil.copytree(gemma3_vlm, processor)
    tok_config = json.loads((processor / "tokenizer_config.json").read_text())
    (processor / "tokenizer_config.json").write_text(json.dumps({**tok_config, "processor_class": "Gemma3Processor"}))
    assert load_model_and_tokenizer(processor)[1]("1+2=")["input_ids"] == tok("1+2=")["input_ids"]


@pytest.mark.parametrize(
    ("config", "tokenizer_max", "setting", "expected"),
    [
        ({"max_position_embeddings": 64}, 32, 16, 64),  # the config's, first
        ({"text_config": {"max_position_embeddings": 48}}, None, None, 48),  # a multimodal config's text model
        ({"n_positions": 40}, None, None, 40),
        ({"context_length": 1024}, None, None, 1024),  # RWKV
        ({"max_length": 20}, None, None, None),  # a generation default, not a context
        ({}, 2048, 16, 2048),  # the tokenizer's, next
        ({}, 2048.0, None, 2048),
        ({}, int(1e30), 16, 16),  # the unbounded sentinel is no context: the setting fills in
        ({}, True, None, None),
        ({}, None, None, None),
    ],
)
def test_context_is_the_configs_else_the_tokenizers_else_the_setting(config, tokenizer_max, setting, expected):
    from covgrad.rollouts.inputs import context_of

    assert context_of(config, tokenizer_max, setting) == expected


def test_context_of_a_directory_and_of_a_loaded_model_agree(mamba2, tmp_path):
    """Nothing in the Mamba2 directory tells its context: ``model_context`` and the stages' ``context_length`` both
    take ``model.max_length``, or refuse in one line naming it; a tokenizer_config.json ``model_max_length`` is
    read by both; a multimodal model's context is its text config's."""
    import shutil

    from covgrad.models import context_length
    from storage.models import load_model_and_tokenizer, model_context

    assert "max_position_embeddings" not in json.loads((mamba2 / "config.json").read_text())
    model, tok = load_model_and_tokenizer(mamba2)
    assert model_context(str(mamba2)) is None and model_context(str(mamba2), 96) == 96
    assert context_length(model, tok, 96) == 96
    with pytest.raises(ValueError, match=r"cannot tell the context length of Mamba2ForCausalLM.*set model\.max_length"):
        context_length(model, tok)

    told = shutil.copytree(mamba2, tmp_path / "told")
    tok_config = json.loads((told / "tokenizer_config.json").read_text())
    (told / "tokenizer_config.json").write_text(json.dumps({**tok_config, "model_max_length": 128}))
    model, tok = load_model_and_tokenizer(told)
    assert model_context(str(told), 96) == 128 == context_length(model, tok, 96)


def test_gemma3_context_is_its_text_configs(gemma3_vlm):
    from covgrad.models import context_length
    from storage.models import load_model, model_context

    assert model_context(str(gemma3_vlm)) == 64 == context_length(load_model(gemma3_vlm, meta=True))


def test_preflight_refuses_an_untold_context_in_one_line_naming_the_setting(mamba2, tmp_path):
    from flows.preflight import preflight

    cfg = family_config(tmp_path, mamba2)
    with pytest.raises(
        ValueError, match=r"cannot tell the context length of model\.path .*; set model\.max_length"
    ) as e:
        preflight(cfg, architecture=False)
    assert "\n" not in str(e.value)
    preflight(family_config(tmp_path, mamba2, **{"model.max_length": 96}), architecture=False)
    with pytest.raises(ValueError, match=r"> the model's context of 5 positions"):  # the setting is the limit
        preflight(family_config(tmp_path, mamba2, **{"model.max_length": 5}), architecture=False)


def test_an_unset_max_length_keys_and_records_nothing(tmp_path, mamba2):
    """Unset, ``model.max_length`` is in no stage's key or recorded spec (keys stay what they were before it
    existed) nor in the report's config; set, it reaches every stage that loads the policy."""
    from tasks.specs import plan
    from tasks.specs.planner import report_config

    unset = family_config(tmp_path, mamba2)
    assert "max_length" not in report_config(unset)["model"]
    loading = [step.spec for step in plan(unset).values() if "policy" in type(step.spec).model_fields]
    assert len(loading) >= 5
    for spec in loading:
        assert "max_length" not in spec.hashed()["policy"] and "max_length" not in spec.model_dump()["policy"]
    rollouts = plan(family_config(tmp_path, mamba2, **{"model.max_length": 96}))["rollouts.policy"].spec
    assert rollouts.policy.max_length == 96 and rollouts.hashed()["policy"]["max_length"] == 96


def _cli_run(tmp_path: Path, cfg, cli_api: str) -> str:
    """``covgrad run`` of ``cfg`` as a subprocess (the session's Prefect API): every planned stage computed, the
    report written; returns stdout."""
    from tasks.specs import plan

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json")))
    env = {**os.environ, "PREFECT_API_URL": cli_api, "PYTHONPATH": str(REPO), **OFFLINE_ENV}
    env["COVGRAD_LOG_DIR"] = str(tmp_path / "logs")
    cmd = [sys.executable, "-m", "flows.cli", "run", "--config", str(config)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    nodes = plan(cfg)
    assert f"{len(nodes)} stage(s) computed, 0 from cache" in proc.stdout, proc.stdout[-3000:]
    assert Path(re.search(r"^report:\s+(\S+)", proc.stdout, flags=re.M).group(1)).is_file()
    return proc.stdout


@pytest.mark.slow
def test_cli_run_completes_on_a_saved_gemma3_for_conditional_generation(tmp_path, cli_api, gemma3_vlm):
    """Every default (``model.params`` unset): the statistics cover exactly the language model's parameters, with
    reward variance (G not all zero) and finite F."""
    import numpy as np
    import zarr

    from storage.models import load_model
    from tasks.specs import plan

    task = {"task.reward": "covgrad.rewards:mentions_answer"}  # a random tiny model gets some answers right
    cfg = family_config(tmp_path, gemma3_vlm, **SMALL, **task)
    _cli_run(tmp_path, cfg, cli_api)
    key = plan(cfg)["stats.policy.policy"].ref.key
    stats = zarr.open_group(str(Path(cfg.root) / "stats" / key / "stats.zarr"), mode="r")
    names = [str(n) for n in stats["tensor_name"][:]]
    expected = [n for n, _ in load_model(gemma3_vlm, meta=True).named_parameters() if "language_model" in n]
    assert names == expected
    assert np.isfinite(stats["F"][:]).all() and np.abs(stats["G"][:]).max() > 0


@pytest.mark.slow
def test_cli_run_completes_on_a_saved_mamba2_with_model_max_length(tmp_path, cli_api, mamba2):
    cfg = family_config(tmp_path, mamba2, **SMALL, **{"model.max_length": 64})
    _cli_run(tmp_path, cfg, cli_api)


def test_plan_sizes_a_multimodal_and_a_state_space_model(gemma3_vlm, mamba2):
    """``covgrad plan``'s model shape is a multimodal model's text model (its config's own sizes live in
    ``text_config``) and a state-space model's, with no attention heads; the task's prompts are counted with the
    tokenizer whether or not the model tells its context."""
    from covgrad.distributed import ModelShape
    from covgrad.rollouts import Problem
    from storage.models import load_model
    from storage.stores.prompts import prompt_lengths

    vlm = ModelShape.of(load_model(gemma3_vlm, meta=True))
    assert (vlm.hidden, vlm.intermediate, vlm.layers, vlm.heads) == (32, 48, 2, 4)
    assert vlm.vocab == 16 and vlm.tied_embedding == "model.language_model.embed_tokens.weight"
    ssm = ModelShape.of(load_model(mamba2, meta=True))
    assert (ssm.hidden, ssm.layers, ssm.heads) == (32, 2, 0)
    problems = [Problem("1+2=", "3"), Problem("10+20=", "30")]
    assert prompt_lengths(str(mamba2), problems) == ([5, 7], None)
    assert prompt_lengths(str(mamba2), problems, 96) == ([5, 7], 96)
    assert prompt_lengths(str(gemma3_vlm), problems, 96) == ([5, 7], 64)
