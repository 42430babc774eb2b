"""Importing recorded rollouts: round trip through generate(), validation, and the file readers."""

from __future__ import annotations

import json

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from covgrad.rollouts.imports import records_to_rollouts
from covgrad.rollouts.sampling import SamplerSpec, generate, mu_from_topk
from storage.readers import read_prompt_file, read_records
from tests.helpers.models import tiny_llama

V = 16
EOS, PAD = 0, 15


@pytest.fixture(scope="module")
def rollouts() -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    model = tiny_llama(V, initializer_range=0.5)
    spec = SamplerSpec(temperature=0.8, top_p=0.9, max_new_tokens=8)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9]]
    return generate(model, prompts, [0, 1, 2], 3, spec, 3, 4, EOS, PAD, mu_mode="topk", mu_topk=4)


def _to_records(out: dict[str, torch.Tensor]) -> list[dict]:
    """Records as an engine would log them; top-k alternates between the two accepted forms."""
    records = []
    for n in range(out["tokens"].shape[0]):
        lp, lr = int(out["prompt_len"][n]), int(out["response_len"][n])
        top = []
        for j in range(lr):
            ids = out["mu_topk_ids"][n, j].tolist()
            logps = out["mu_topk_logp"][n, j].tolist()
            top.append(dict(zip(map(str, ids), logps, strict=True)) if j % 2 else [ids, logps])
        records.append(
            {
                "prompt_ids": out["tokens"][n, :lp].tolist(),
                "response_ids": out["tokens"][n, lp : lp + lr].tolist(),
                "reward": float(n % 4) / 3,
                "logprobs": out["sampler_logp"][n, :lr].tolist(),
                "top_logprobs": top,
            }
        )
    return records


def _good(**changes) -> dict:
    rec = {"prompt_ids": [1, 2], "response_ids": [3, 0], "reward": 1.0, "logprobs": [-0.5, -0.1]}
    rec.update(changes)
    return {k: v for k, v in rec.items() if v is not None}


def test_round_trip_through_jsonl_reproduces_generate(rollouts, tmp_path):
    assert int(rollouts["response_len"].max()) == rollouts["sampler_logp"].shape[1]  # same T both ways
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _to_records(rollouts)))
    got = records_to_rollouts(read_records(str(path)), V, max_len=None, pad_id=PAD)
    for key, want in rollouts.items():
        assert got[key].dtype == want.numpy().dtype, key
        np.testing.assert_array_equal(got[key], want.numpy(), err_msg=key)
    assert (got["group"] == rollouts["prompt_index"].numpy()).all()
    np.testing.assert_array_equal(got["reward"], [float(n % 4) / 3 for n in range(len(got["reward"]))])


def test_tied_top_logprobs_are_ordered_by_lowest_id():
    top = [[[7, 2, 5], [-2.0, -2.0, -1.5]], {"0": -0.1}]
    out = records_to_rollouts([_good(top_logprobs=top)], V, max_len=None)
    assert out["mu_topk_ids"][0, 0].tolist() == [5, 2, 7]


def test_groups_from_field_or_identical_prompts():
    recs = [_good(prompt_ids=[5]), _good(prompt_ids=[6]), _good(prompt_ids=[5]), _good(prompt_ids=[6])]
    by_prompt = records_to_rollouts(recs, V, max_len=None)
    assert by_prompt["group"].tolist() == [0, 1, 0, 1]
    assert by_prompt["prompt_index"].tolist() == [0, 1, 0, 1]
    assert by_prompt["sample_index"].tolist() == [0, 0, 1, 1]
    labelled = [dict(r, group=g) for r, g in zip(recs, ["b", "a", "a", "b"], strict=True)]
    by_field = records_to_rollouts(labelled, V, max_len=None)
    assert by_field["group"].tolist() == [0, 1, 1, 0]
    assert by_field["sample_index"].tolist() == [0, 0, 1, 1]
    assert by_field["prompt_index"].tolist() == [0, 1, 0, 1]


def test_text_prompts_use_the_tokenizer():
    class CharTokenizer:
        def encode(self, text: str) -> list[int]:
            return [ord(c) - ord("a") for c in text]

    rec = _good(prompt_ids=None, prompt="bad")
    out = records_to_rollouts([rec], V, max_len=None, tokenizer=CharTokenizer())
    assert out["tokens"][0].tolist() == [1, 0, 3, 3, 0]
    with pytest.raises(ValueError, match="record 0: has text 'prompt' but no tokenizer"):
        records_to_rollouts([rec], V, max_len=None)


def test_variable_k_is_padded_with_zero_mass():
    top = [{"9": -3.0, "3": -0.3, "4": -2.0}, [[0], [-0.05]]]
    out = records_to_rollouts([_good(top_logprobs=top)], V, max_len=None)
    assert out["mu_topk_ids"].shape == (1, 2, 3)
    assert out["mu_topk_ids"][0, 0].tolist() == [3, 4, 9]  # sorted by decreasing log-prob
    assert out["mu_topk_logp"][0, 0].tolist() == pytest.approx([-0.3, -2.0, -3.0])
    assert out["mu_topk_ids"][0, 1].tolist() == [0, 0, 0]
    assert out["mu_topk_logp"][0, 1, 1:].tolist() == [-np.inf, -np.inf]
    tail = out["mu_tail"][0]
    assert tail[0] == pytest.approx(1 - np.exp([-0.3, -2.0, -3.0]).sum(), abs=1e-7)
    assert tail[1] == pytest.approx(1 - np.exp(-0.05), abs=1e-7)
    policy = torch.full((1, 2, V), 1.0 / V)
    mu = mu_from_topk(*(torch.from_numpy(out[k]) for k in ("mu_topk_ids", "mu_topk_logp", "mu_tail")), policy)
    assert mu[0, 1, 0].item() == pytest.approx(np.exp(-0.05), abs=1e-7)
    assert mu[0, 1, 1].item() == pytest.approx((1 - np.exp(-0.05)) / (V - 1), abs=1e-7)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (_good(prompt_ids=None), "missing field 'prompt_ids'"),
        (_good(response_ids=None), "missing field 'response_ids'"),
        (_good(reward=None), "missing field 'reward'"),
        (_good(logprobs=None), "missing field 'logprobs'"),
        (_good(prompt_ids=[1, -1]), "token id -1 outside"),
        (_good(response_ids=[3, 16]), "token id 16 outside"),
        (_good(response_ids=[3, 1.5]), "non-integer token id 1.5"),
        (_good(response_ids=["a", "b"]), "'response_ids' must be a flat list"),
        (_good(logprobs=[-0.5]), "'logprobs' has 1 entries for 2 response tokens"),
        (_good(logprobs=[-0.5, float("nan")]), "invalid log-probability nan"),
        (_good(reward=float("nan")), "'reward' must be a finite number; got nan"),
        (_good(reward=float("inf")), "'reward' must be a finite number; got inf"),
        (_good(reward="1.0"), "'reward' must be a finite number; got '1.0'"),
        (_good(reward=True), "'reward' must be a finite number; got True"),
        (_good(response_ids=[], logprobs=[]), "'response_ids' is empty"),
        (_good(prompt_ids=[1, 2, 3, 4]), "4 \\+ 2 tokens, over max_len=5"),
        (_good(top_logprobs=[{"3": -0.1}, {"16": -0.2}]), "top_logprobs\\[1\\]' has token id 16 outside"),
        (_good(top_logprobs=[[[3, 4], [-0.1]], {"0": -0.1}]), "has 2 ids but 1 log-probs"),
        (_good(top_logprobs=[{}, {"0": -0.1}]), "top_logprobs\\[0\\]' is empty"),
        (_good(top_logprobs=[[[3, 3], [-1, -2]], {"0": -0.1}]), "repeats a token id"),
        (_good(top_logprobs=[{"3": -0.1}]), "one entry per response token"),
        (_good(group=[1]), "'group' must be an int or a string"),
        ([1, 2], "expected a dict; got list"),
    ],
)
def test_bad_record_is_named_by_index(bad, match):
    valid_optional = {"group": 0, "top_logprobs": [{"3": -0.1}, {"0": -0.1}]}
    extra = {k: v for k, v in valid_optional.items() if isinstance(bad, dict) and k in bad}
    records = [_good(**extra), _good(prompt_ids=[4], **extra), bad]
    with pytest.raises(ValueError, match=f"record 2: .*{match}"):
        records_to_rollouts(records, V, max_len=5)


def test_optional_fields_are_all_or_none_and_input_nonempty():
    with pytest.raises(ValueError, match="record 1: has 'group' unlike record 0"):
        records_to_rollouts([_good(), _good(group=1)], V, max_len=None)
    with pytest.raises(ValueError, match="record 1: lacks 'top_logprobs' unlike record 0"):
        records_to_rollouts([_good(top_logprobs=[{"3": -0.1}, {"0": -0.1}]), _good()], V, max_len=None)
    with pytest.raises(ValueError, match="no records"):
        records_to_rollouts([], V, max_len=None)


# --- readers --------------------------------------------------------------------------------------


def test_read_records_jsonl_errors_name_file_and_line(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2,\n')
    it = read_records(str(path))
    assert next(it) == {"a": 1}
    with pytest.raises(ValueError, match=r"r\.jsonl:3: not valid JSON"):
        next(it)
    path.write_text('{"a": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"r\.jsonl:2: expected a JSON object; got list"):
        list(read_records(str(path)))
    path.write_text("\n  \n")
    with pytest.raises(ValueError, match=r"r\.jsonl is empty"):
        list(read_records(str(path)))
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        read_records(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match=r"must end in \.jsonl or \.parquet"):
        read_records(str(tmp_path / "r.csv"))


def test_read_records_parquet_and_memory_url(tmp_path):
    rows = [_good(), _good(prompt_ids=[7], reward=0.5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "r.parquet")
    assert list(read_records(str(tmp_path / "r.parquet"))) == rows
    pq.write_table(pa.Table.from_pylist(rows).slice(0, 0), tmp_path / "empty.parquet")
    with pytest.raises(ValueError, match=r"empty\.parquet is empty"):
        list(read_records(str(tmp_path / "empty.parquet")))
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(ValueError, match=r"junk\.parquet: not a readable parquet file"):
        list(read_records(str(tmp_path / "junk.parquet")))
    fsspec.filesystem("memory").pipe("/covgrad-test/r.jsonl", b'{"a": 3}\n')
    assert list(read_records("memory://covgrad-test/r.jsonl")) == [{"a": 3}]


def test_read_prompt_file(tmp_path):
    path = tmp_path / "task.jsonl"
    path.write_text('{"prompt": "2+2", "answer": "4"}\n{"prompt": "1+1", "answer": "2", "id": 9}\n')
    assert read_prompt_file(str(path)) == [
        {"prompt": "2+2", "answer": "4"},
        {"prompt": "1+1", "answer": "2", "id": 9},
    ]
    path.write_text('{"prompt": "2+2", "answer": "4"}\n{"question": "1+1"}\n')
    with pytest.raises(ValueError, match=r"task\.jsonl:2: the line needs a string 'prompt'"):
        read_prompt_file(str(path))
    path.write_text('{"prompt": "2+2", "answer": "4"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"task\.jsonl:2: not valid JSON"):
        read_prompt_file(str(path))
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl"):
        read_prompt_file(str(tmp_path / "nope.jsonl"))
