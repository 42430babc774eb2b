"""Stack dump readers: each sample file imports to the arrays of the equivalent covgrad JSONL."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from covgrad.rollouts.formats import READERS, convert, import_records, parse_reward_fields
from storage.readers import read_located_records

DATA = Path(__file__).parents[1] / "data" / "formats"
V = 32
OPTIONS = {
    "covgrad": {},
    "open_instruct": {"sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1}},
    "trl": {"reward_fields": ["accuracy_reward"], "sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1}},
    "verl": {"sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": -1}},
}


def _import(fmt: str, path: Path | None = None):
    path = path or DATA / f"{fmt}.jsonl"
    return import_records(read_located_records(str(path)), fmt, V, None, options=OPTIONS[fmt], source=str(path))


@pytest.fixture(scope="module")
def reference():
    return _import("covgrad")


@pytest.mark.parametrize("fmt", ["open_instruct", "trl", "verl"])
def test_sample_file_imports_like_covgrad_jsonl(fmt, reference):
    ref_arrays, ref_extras, ref_summary = reference
    arrays, extras, summary = _import(fmt)
    # open-instruct and verl dumps carry only the sampled token's log-prob; TRL's also the support
    support = {"mu_topk_ids", "mu_topk_logp", "mu_tail"} if fmt == "trl" else set()
    expected = {k for k in ref_arrays if not k.startswith("mu_")} | support
    assert set(arrays) == expected
    for key, value in arrays.items():
        assert value.dtype == ref_arrays[key].dtype, key
        np.testing.assert_array_equal(value, ref_arrays[key], err_msg=key)
    assert extras["policy_version"].tolist() == ref_extras["policy_version"].tolist()
    if fmt in ("open_instruct", "trl"):
        np.testing.assert_array_equal(extras["advantage"], ref_extras["advantage"])
    if fmt == "verl":
        np.testing.assert_array_equal(extras["token_advantages"], ref_extras["token_advantages"])
    assert summary["policy_versions"] == ref_summary["policy_versions"] == {3: 4, 4: 2}
    assert summary["mixed_versions"] and "2 policy versions in 6 records (3: 4, 4: 2)" in summary["message"]
    assert summary["sampling_params"] == [{"temperature": 1.0, "top_p": 1.0, "top_k": -1}]


def test_covgrad_token_advantages_padded(reference):
    arrays, extras, _ = reference
    adv = extras["token_advantages"]
    assert adv.shape == arrays["sampler_logp"].shape and adv.dtype == np.float64
    live = np.arange(adv.shape[1])[None, :] < arrays["response_len"][:, None]
    assert (adv[~live] == 0).all()
    np.testing.assert_array_equal(adv[live], np.repeat(extras["advantage"], arrays["response_len"]))


def test_one_version_has_no_message(tmp_path):
    lines = (DATA / "open_instruct.jsonl").read_text().splitlines()[:4]
    path = tmp_path / "one.jsonl"
    path.write_text("\n".join(lines) + "\n")
    _, _, summary = _import("open_instruct", path)
    assert summary["policy_versions"] == {3: 4} and not summary["mixed_versions"] and summary["message"] is None


def _planted(tmp_path: Path, fmt: str, line: int, edit) -> Path:
    records = [json.loads(x) for x in (DATA / f"{fmt}.jsonl").read_text().splitlines()]
    edit(records[line - 1])
    path = tmp_path / f"{fmt}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _set(field, value):
    def edit(rec):
        rec[field] = value

    return edit


def _drop(field):
    return lambda rec: rec.pop(field)


def _bad_log_prob(rec):
    rec["rollout_log_probs"][0] = 0.5


@pytest.mark.parametrize(
    ("fmt", "edit", "field"),
    [
        ("open_instruct", _drop("response_tokens"), "'response_tokens'"),
        ("open_instruct", _set("logprobs", None), "'logprobs' is null"),
        ("open_instruct", _set("prompt_tokens", [1, 99]), "'prompt_tokens' has token id 99"),
        ("open_instruct", _set("logprobs", [-0.1]), "'logprobs' has 1 entries"),
        ("trl", _set("completion_ids", [1, 2, 3, 4, 5, 6, 7, 8, 9]), "'logprobs' has"),
        ("trl", _set("logprob_token_ids", [[30], [30], [30], [30], [30], [30]]), "'logprob_token_ids[0]'"),
        ("trl", _set("accuracy_reward", None), "reward column"),
        ("verl", _drop("rollout_log_probs"), "'rollout_log_probs' is missing"),
        ("verl", _bad_log_prob, "'rollout_log_probs' has log-probability 0.5 > 0"),
        ("verl", _set("response_mask", [1, 0, 1, 0, 0, 0]), "'response_mask[1]' is 0"),
        ("verl", _set("score", float("inf")), "'score' must be a finite number"),
        ("verl", _set("uid", None), "'uid'"),
        ("verl", _set("advantages", ["x"]), "'advantages' must be a list of numbers"),
    ],
)
def test_malformed_record_is_one_line_with_file_line_and_field(tmp_path, fmt, edit, field):
    path = _planted(tmp_path, fmt, 3, edit)
    with pytest.raises(ValueError) as info:
        _import(fmt, path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}:3: ") or (field == "'uid'" and f"{path}:" in message)
    assert field in message


def test_unknown_format_and_non_object():
    with pytest.raises(ValueError, match="unknown rollout format 'slime'"):
        convert("slime", {}, "x:1")
    with pytest.raises(ValueError, match="x:1: expected a JSON object; got list"):
        convert("verl", [1], "x:1")
    assert sorted(READERS) == ["covgrad", "open_instruct", "responses", "trl", "verl"]


def test_trl_flat_logprobs_and_reward_weights():
    rec = {"prompt_ids": [1], "completion_ids": [2, 0], "logprobs": [-0.5, -0.25], "f": 1.0, "g": float("nan")}
    out, extras = convert("trl", rec, "r:1", {"reward_fields": ["f", "g"], "reward_weights": [2.0, 5.0]})
    assert out["logprobs"] == [-0.5, -0.25] and out["reward"] == 2.0 and "top_logprobs" not in out
    assert extras["policy_version"] is None and "group" not in out


def test_verl_partial_rollout_across_versions_is_rejected():
    rec = json.loads((DATA / "verl.jsonl").read_text().splitlines()[0])
    rec.update(param_version_start=3, param_version_end=4)
    with pytest.raises(ValueError, match="r:1: 'param_version_start' 3 != 'param_version_end' 4"):
        convert("verl", rec, "r:1")
    rec.update(param_version_end=3, step=9)
    assert convert("verl", rec, "r:1")[1]["policy_version"] == 3


def test_sample_files_keep_the_stacks_field_order():
    """The fields, in the order the stacks write them (open-instruct: the RolloutRecord dataclass;
    verl: _dump_generations' keys, then the DataProto row; TRL: the completions table, then the generation row)."""
    first = {fmt: list(json.loads((DATA / f"{fmt}.jsonl").read_text().splitlines()[0])) for fmt in READERS}
    assert first["open_instruct"] == [
        "step", "sample_idx", "prompt_idx", "prompt_tokens", "response_tokens", "reward", "advantage",
        "finish_reason", "dataset", "ground_truth", "request_info", "logprobs",
    ]  # fmt: skip
    assert first["verl"][:5] == ["input", "output", "gts", "score", "step"]
    assert first["trl"][:3] == ["step", "prompt", "completion"]


def test_non_integral_versions_are_named():
    rec = json.loads((DATA / "open_instruct.jsonl").read_text().splitlines()[0])
    for bad in (2.5, float("nan"), "3"):
        rec["step"] = bad
        with pytest.raises(ValueError, match="r:1: 'step' must be an integer"):
            convert("open_instruct", rec, "r:1")


def test_reward_fields_apply_to_every_format():
    rec = json.loads((DATA / "open_instruct.jsonl").read_text().splitlines()[0])
    rec.update(acc=0.5, fmt=float("nan"))
    options = parse_reward_fields(["acc:4", "fmt"])
    assert options == {"reward_fields": ["acc", "fmt"], "reward_weights": [4.0, 1.0]}
    assert convert("open_instruct", rec, "r:1", options)[0]["reward"] == 2.0


def test_trl_advantage_is_the_imported_per_token_advantage():
    """TRL's completion advantage is every completion token's: the per-token advantages that ``advantages:
    imported`` reads, besides the sequence advantage (stack_advantage)."""
    arrays, extras, _ = _import("trl")
    live = np.arange(arrays["sampler_logp"].shape[1])[None, :] < arrays["response_len"][:, None]
    want = np.where(live, extras["advantage"][:, None], 0.0)
    np.testing.assert_array_equal(extras["token_advantages"], want)
    assert extras["advantage"].any()
    from tasks.jobs.rollout_import import import_extra_arrays

    stored = import_extra_arrays(arrays, extras, None)  # the rollouts store's arrays, token-aligned
    np.testing.assert_array_equal(stored["stack_advantage"], extras["advantage"])
    per_token = np.where(arrays["response_mask"], extras["advantage"][:, None], 0.0)
    np.testing.assert_array_equal(stored["token_advantage"], per_token)


def test_trl_records_without_advantage_are_refused_for_imported_advantages(tmp_path):
    from covgrad.rollouts.formats import check_imported_field

    rec = json.loads((DATA / "trl.jsonl").read_text().splitlines()[0])
    check_imported_field("trl", rec, "t.jsonl:1", "advantages")
    with pytest.raises(ValueError, match=r"^t\.jsonl:1 has no 'advantage' field \(format trl: .*advantages$"):
        check_imported_field("trl", {k: v for k, v in rec.items() if k != "advantage"}, "t.jsonl:1", "advantages")
    with pytest.raises(ValueError, match=r"^t\.jsonl:1: 'advantage' must be a finite number; got 'x'$"):
        check_imported_field("trl", {**rec, "advantage": "x"}, "t.jsonl:1", "advantages")
    path = _planted(tmp_path, "trl", 2, _drop("advantage"))  # some records with it, some without
    with pytest.raises(ValueError, match=r"trl\.jsonl:2: lacks 'advantage' unlike .*trl\.jsonl:1"):
        _import("trl", path)


def test_records_sampled_at_another_temperature_say_so_in_one_line(tmp_path):
    """A record's own sampling_params that disagree with the sampler section's are named in the import's message
    (one log line); agreeing ones (vLLM's top_k -1 is covgrad's 0) or absent ones add nothing."""
    records = [json.loads(x) for x in (DATA / "covgrad.jsonl").read_text().splitlines()]
    for rec in records:
        rec.pop("policy_version", None)
        rec["sampling_params"] = {"temperature": 0.7, "top_p": 1.0, "top_k": -1}
    path = tmp_path / "hot.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    located = read_located_records(str(path))
    section = {"sampling_params": {"temperature": 1.0, "top_p": 1.0, "top_k": 0}}
    message = import_records(located, "covgrad", V, None, options=section, source="hot")[2]["message"]
    assert message is not None and "\n" not in message
    assert 'sampled with {"temperature": 0.7, "top_p": 1.0, "top_k": -1}' in message
    assert '"temperature": 1.0' in message and "regime's policy temperature" in message
    section["sampling_params"]["temperature"] = 0.7
    located = read_located_records(str(path))
    assert import_records(located, "covgrad", V, None, options=section, source="hot")[2]["message"] is None
