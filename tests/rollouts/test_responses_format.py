"""The ``responses`` import format (a plain SFT dataset, μ unknown): its sample file and text records import to
the token arrays of the equivalent covgrad-format file, μ-free and reward-free arrays are NaN, and a malformed
record fails in one line naming ``file:line`` and the field."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from covgrad.config import SamplerSection
from covgrad.rollouts.formats import import_records
from covgrad.rollouts.problems import ADDITION_CHARS, build_char_tokenizer
from storage.readers import read_located_records

DATA = Path(__file__).parents[1] / "data" / "formats"
V = 32
SAMPLE = DATA / "responses.jsonl"
SAMPLER_ONLY = {"sampler_logp"}  # the one array a dataset cannot have: NaN


def _import(path: Path, fmt: str, **kw):
    return import_records(read_located_records(str(path)), fmt, V, None, source=str(path), **kw)


def _write(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _assert_same_tokens(arrays: dict, ref: dict) -> None:
    assert set(arrays) == {k for k in ref if not k.startswith("mu_")}
    for key, value in arrays.items():
        if key in SAMPLER_ONLY:
            assert value.shape == ref[key].shape and np.isnan(value).all(), key
            continue
        assert value.dtype == ref[key].dtype, key
        np.testing.assert_array_equal(value, ref[key], err_msg=key)


def test_sample_file_imports_like_covgrad_jsonl():
    ref, _, _ = _import(DATA / "covgrad.jsonl", "covgrad")
    arrays, extras, summary = _import(DATA / "responses.jsonl", "responses")
    _assert_same_tokens(arrays, ref)
    assert extras == {} and summary["format"] == "responses" and summary["message"] is None


def test_text_records_tokenize_like_their_ids(tmp_path):
    """Prompt text as the tokenizer encodes a prompt (the demo's BOS), response text without special tokens,
    EOS appended by ``eos: true``; the ids here are looked up by hand in the character vocabulary."""
    tok = build_char_tokenizer()
    ids = {c: 4 + i for i, c in enumerate(ADDITION_CHARS)}  # 0 pad, 1 bos, 2 eos, 3 unk, then the characters
    text = [
        {"prompt": "5+2=", "response": "7", "eos": True, "reward": 1.0},
        {"prompt": "5+2=", "response": "71", "reward": 0.0},
        {"prompt": "9+9=", "response": "18", "eos": True, "reward": 1.0},
        {"prompt": "9+9=", "response": "9", "eos": False, "reward": 0.0},
    ]
    covgrad = []
    for r in text:
        response = [ids[c] for c in r["response"]] + ([2] if r.get("eos") else [])
        covgrad.append(
            {
                "prompt_ids": [1] + [ids[c] for c in r["prompt"]],
                "response_ids": response,
                "reward": r["reward"],
                "logprobs": [-1.0] * len(response),
            }
        )
    kw = {"tokenizer": tok, "pad_id": 0}
    ref, _, _ = _import(_write(tmp_path / "ids.jsonl", covgrad), "covgrad", **kw)
    arrays, _, _ = _import(_write(tmp_path / "text.jsonl", text), "responses", eos_id=tok.eos_token_id, **kw)
    _assert_same_tokens(arrays, ref)


def test_a_dataset_without_rewards_has_nan_rewards(tmp_path):
    records = [{k: v for k, v in json.loads(line).items() if k != "reward"} for line in SAMPLE.read_text().splitlines()]
    arrays, _, _ = _import(_write(tmp_path / "plain.jsonl", records), "responses")
    assert arrays["reward"].shape == (6,) and np.isnan(arrays["reward"]).all()
    assert arrays["group"].tolist() == [0, 0, 1, 1, 2, 2]


def _set(field, value):
    return lambda rec: rec.__setitem__(field, value)


def _drop(*fields):
    return lambda rec: [rec.pop(f) for f in fields]


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (_drop("prompt_ids"), "missing field 'prompt_ids' (or text 'prompt'"),
        (_drop("response_ids"), "missing field 'response_ids' (or text 'response'"),
        (_set("response_ids", []), "'response_ids' is empty"),
        (lambda rec: (rec.pop("response_ids"), rec.__setitem__("response", "")), "'response' is empty"),
        (_set("response_ids", [1, 2.5]), "'response_ids' has non-integer token id 2.5"),
        (_set("prompt_ids", [1, "x"]), "'prompt_ids' must be a flat list of integer token ids"),
        (_set("response_ids", [1, 99]), "'response_ids' has token id 99 outside [0, 32)"),
        (_drop("reward"), "lacks 'reward' unlike"),
        (_set("reward", float("nan")), "'reward' must be a finite number"),
        (_set("eos", "yes"), "'eos' must be true or false"),
        (_set("logprobs", [-1.0, -1.0]), "format responses has no sampler 'logprobs'"),
    ],
)
def test_malformed_record_is_one_line_with_file_line_and_field(tmp_path, edit, field):
    records = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    edit(records[2])
    path = _write(tmp_path / "bad.jsonl", records)
    with pytest.raises(ValueError) as info:
        _import(path, "responses", tokenizer=build_char_tokenizer())
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}:3: "), message
    assert field in message, message


def test_a_dataset_sampler_takes_no_mu_settings():
    for key, value in (("on_policy", True), ("mu_model", "ckpt"), ("verify_records", 4)):
        with pytest.raises(ValueError, match=f"format responses is a dataset whose μ is unknown, so {key}"):
            SamplerSection(import_path="d.jsonl", format="responses", **{key: value})
    assert not SamplerSection(import_path="d.jsonl", format="responses").mu_known
    assert SamplerSection(import_path="d.jsonl").mu_known
