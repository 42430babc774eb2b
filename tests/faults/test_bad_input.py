"""Bad input a user can write: rewards that overflow, rewards of numpy types, missing or null answers, a UTF-8
byte-order mark, and imported log-probabilities that are not of a probability distribution. Each is refused in
one line naming the value and where it is (or, for numpy rewards and a BOM, read as meant)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from covgrad.rollouts.imports import records_to_rollouts
from covgrad.rollouts.problems import score_rewards
from covgrad.rollouts.sampling import compute_advantages
from storage.readers import read_prompt_file
from tests.helpers.pipeline import REPO


@pytest.mark.parametrize("kind", ["group_mean", "group_zscore", "global_mean"])
def test_overflowing_rewards_are_refused_naming_the_sample(kind):
    rewards = np.array([1e308, 1e308, 0.0, 1.0])
    with pytest.raises(ValueError, match=r"sample \d \(group \d, reward .*\) overflows float64") as err:
        compute_advantages(rewards, np.array([0, 0, 1, 1]), kind)
    assert "\n" not in str(err.value)


def test_moderate_rewards_give_the_same_advantages_as_before():
    """The overflow check changes no bit of a finite result: the group z-score (TRL's scale_rewards="group":
    the sample std, n - 1, plus 1e-4) against its formula."""
    rng = np.random.default_rng(0)
    r, g = rng.normal(size=64), np.repeat(np.arange(8), 8)
    got = compute_advantages(r, g, "group_zscore")
    mean = np.array([r[g == k].mean() for k in g])
    std = np.array([r[g == k].std(ddof=1) for k in g])
    np.testing.assert_allclose(got, (r - mean) / (std + 1e-4), rtol=1e-12)


@pytest.mark.parametrize("value", [np.float32(0.5), np.float64(0.5), np.int64(1), 1, 0.5])
def test_rewards_of_any_real_numeric_type_are_accepted(value):
    assert score_rewards(lambda p, r, a: value, ["p"], ["r"], ["a"]) == [float(value)]


@pytest.mark.parametrize("value", [True, np.bool_(True), "1.0", None])
def test_rewards_that_are_not_numbers_are_refused(value):
    with pytest.raises(ValueError, match="it must return a float"):
        score_rewards(lambda p, r, a: value, ["p"], ["r"], ["a"])


@pytest.mark.parametrize(
    ("line", "said"), [('{"prompt": "1+1="}', "is missing"), ('{"prompt": "1+1=", "answer": null}', "is null")]
)
def test_a_missing_or_null_answer_is_refused_with_file_and_line(tmp_path, line, said):
    path = tmp_path / "task.jsonl"
    path.write_text('{"prompt": "1+2=", "answer": "3"}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"task.jsonl:2: the 'answer' field {said}"):
        read_prompt_file(str(path))


def test_a_utf8_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "task.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt": "1+2=", "answer": "3"}\n')
    assert read_prompt_file(str(path)) == [{"prompt": "1+2=", "answer": "3"}]


def _record(**extra):
    return {"prompt_ids": [1, 5], "response_ids": [6, 2], "reward": 1.0, "logprobs": [-1.0, -0.5], **extra}


def test_a_log_probability_above_zero_is_refused_naming_the_record():
    with pytest.raises(ValueError, match=r"rec\.jsonl:1: 'logprobs' has log-probability 0\.5 > 0"):
        records_to_rollouts([("rec.jsonl:1", _record(logprobs=[-1.0, 0.5]))], vocab_size=16, max_len=None)


def test_rounding_above_zero_is_accepted():
    out = records_to_rollouts([("rec.jsonl:1", _record(logprobs=[-1.0, 1e-6]))], vocab_size=16, max_len=None)
    assert out["sampler_logp"].shape[0] == 1


def test_top_k_mass_above_one_is_refused_naming_the_position():
    top = [{"6": -0.1, "7": -0.2}, {"2": -0.5}]  # exp(-0.1) + exp(-0.2) = 1.72
    with pytest.raises(ValueError, match=r"rec\.jsonl:1: 'top_logprobs\[0\]' holds probability mass 1\.72"):
        records_to_rollouts([("rec.jsonl:1", _record(top_logprobs=top))], vocab_size=16, max_len=None)


@pytest.mark.slow
def test_a_huge_reward_ends_the_run_with_one_line_and_exit_2(tmp_path, cli_api):
    """Reward 1e308 for every response: the rollouts stage refuses it and nothing is marked complete."""
    from tests.helpers.user import write_checkpoint

    model = write_checkpoint(tmp_path / "model")
    (tmp_path / "huge_reward.py").write_text("def reward(prompt, response, answer):\n    return 1e308\n")
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4)))
    sets = {
        "model.path": model,
        "task.path": task,
        "task.reward": "huge_reward:reward",
        "task.trust_reward_code": "true",
        "task.n_prompts": 4,
        "rollouts.samplers": json.dumps({"policy": {"group_size": 2, "max_new_tokens": 2, "batch_size": 8}}),
        "tokens.enabled": "false",
        "update_check.enabled": "false",
    }
    cmd = [sys.executable, "-m", "flows.cli", "run", "--config", str(REPO / "configs" / "user.yaml")]
    cmd += ["--root", str(tmp_path / "root"), *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))]
    pythonpath = os.pathsep.join([str(REPO), str(tmp_path)])
    env = {**os.environ, "PYTHONPATH": pythonpath, "COVGRAD_LOG_DIR": str(tmp_path / "logs")}
    env["PREFECT_API_URL"] = cli_api
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("covgrad: error")]
    assert len(errors) == 1 and "overflows float64" in errors[0] and "reward 1e+308" in errors[0], proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == errors[0]
    assert not list(Path(tmp_path / "root").glob("rollouts/*/COMPLETE*"))
