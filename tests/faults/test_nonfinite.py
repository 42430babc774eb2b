"""NaN is never served as a result: a model with one NaN weight is refused at every load (policy, teacher,
checkpoints of ``covgrad diff``) in one line naming its path, the first bad tensor and the count; the rollouts
stage refuses non-finite sampler log-probs naming the sampler; the stats stage refuses a scores artifact whose F
or G is not finite, naming it and the counts. Each ends with nothing marked complete (exit 2 through the CLI)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr

from covgrad.models import check_finite_weights
from covgrad.rollouts import check_sampler_logp
from storage.artifacts import MARKER
from tests.helpers.faults import error_line
from tests.helpers.pipeline import REPO, run_planned
from tests.helpers.user import NAN_TENSOR, user_config, write_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[Path, Path]:
    """(finite, one NaN weight) tiny checkpoints with the same other weights."""
    tmp = tmp_path_factory.mktemp("nonfinite")
    return write_checkpoint(tmp / "finite"), write_checkpoint(tmp / "nan", nan=True)


def completed(root: Path) -> list[str]:
    """The artifacts under ``root`` that carry a completion marker (stage/key)."""
    return sorted(str(p.parent.relative_to(root)) for p in root.rglob(MARKER))


def test_the_check_names_the_first_bad_tensor_and_counts_every_value():
    tensors = [
        ("a", torch.zeros(3)),
        ("ids", torch.tensor([1, 2])),  # not floating point: not checked
        ("b", torch.tensor([[0.0, float("nan")], [float("inf"), 1.0]])),
        ("c", torch.tensor([-float("inf")])),
        ("m", torch.empty(4, device="meta")),  # no values
    ]
    with pytest.raises(ValueError) as err:
        check_finite_weights(tensors, "model path '/m'")
    said = str(err.value)
    assert said.startswith("model path '/m' has 3 non-finite weight value(s) (NaN or inf) in 2 tensor(s)"), said
    assert "the first b (2 of 4)" in said and "\n" not in said
    check_finite_weights(tensors[:2], "model path '/m'")  # finite: nothing raised


def test_a_nan_weight_is_refused_at_every_load_naming_path_tensor_and_count(checkpoints):
    """The policy's loader and a regime's teacher loader both refuse it; the same weights without the NaN load."""
    from storage.models import ModelSource, load_fixed_model, load_model

    finite, nan = checkpoints
    load_model(finite)
    with pytest.raises(ValueError) as err:
        load_model(nan)
    said = str(err.value)
    assert said.startswith(f"model path {str(nan)!r} has 1 non-finite weight value(s)"), said
    assert f"the first {NAN_TENSOR} (1 of 2048)" in said and "\n" not in said
    load_model(nan, meta=True)  # shapes only: no weights read, nothing to check

    class Source(ModelSource):
        path, dtype, trust_remote_code = str(finite), "float32", False

    with pytest.raises(ValueError, match=rf"model path {str(nan)!r} has 1 non-finite .* {NAN_TENSOR}"):
        load_fixed_model(None, None, str(nan), Source(), regime="d", role="teacher", policy_vocab=16)


def test_a_policy_with_one_nan_weight_stops_the_pipeline_at_stage_one(tmp_path, checkpoints):
    cfg = user_config(tmp_path / "root", checkpoints[1], tmp_path / "task.jsonl")
    with pytest.raises(ValueError, match=rf"model path .* has 1 non-finite .* the first {NAN_TENSOR}"):
        run_planned(cfg)
    assert completed(tmp_path / "root") == []


def test_covgrad_diff_of_a_nan_checkpoint_exits_2_in_one_line(tmp_path, checkpoints, monkeypatch, capsys):
    import flows.cli as cli

    monkeypatch.setenv("COVGRAD_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setattr(cli, "_LOG_PATH", None)
    finite, nan = checkpoints
    assert cli.main(["diff", str(finite), str(nan)]) == 2
    line = error_line(capsys.readouterr().err)
    assert f"checkpoint AFTER {str(nan)!r} has 1 non-finite weight value(s)" in line and NAN_TENSOR in line, line


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # -1e300 as float32
def test_non_finite_sampler_log_probs_are_refused_naming_the_sampler(tmp_path, checkpoints):
    """An imported log-prob of -1e300 is finite in the file and -inf in float32: the rollouts stage refuses it
    naming the sampler, the sample and the token, and marks nothing of its own complete."""
    with pytest.raises(ValueError, match=r"rollouts.samplers.x: .* sample 0, token 1 is -inf \(1 non-finite"):
        check_sampler_logp(np.array([[-1.0, -np.inf], [0.0, 0.0]], dtype=np.float32), "rollouts.samplers.x")
    check_sampler_logp(np.zeros((2, 2)), "rollouts.samplers.x")
    records = tmp_path / "engine.jsonl"
    rows = [
        {"prompt_ids": [1, 5], "response_ids": [6, 2], "reward": r, "logprobs": [-1.0, lp]}
        for r, lp in ((1.0, -0.5), (0.0, -1e300))
    ]
    records.write_text("".join(json.dumps(r) + "\n" for r in rows))
    samplers = {
        "policy": {"group_size": 4, "max_new_tokens": 3, "batch_size": 16},
        "engine": {"import_path": str(records), "on_policy": True},
    }
    cfg = user_config(tmp_path / "root", checkpoints[0], tmp_path / "task.jsonl", **{"rollouts.samplers": samplers})
    with pytest.raises(ValueError) as err:
        run_planned(cfg, names={"base_model", "rollouts.engine"})
    said = str(err.value)
    assert said.startswith("rollouts.samplers.engine: the sampler's log-probability of sample 1, token 1 is -inf"), said
    assert [p for p in completed(tmp_path / "root") if not p.startswith("base_model/")] == []


def test_stats_of_non_finite_scores_are_refused_naming_the_scores_artifact(tmp_path, checkpoints, monkeypatch):
    """A complete scores artifact whose mean score is NaN at parameter 3 as read (what an overflow, or a NaN
    weight before it was refused, leaves): the stats stage fails in one line naming that artifact and the counts of
    F and G, and is not marked complete."""
    import tasks.stats
    from covgrad.layout import ParamLayout
    from covgrad.moments import Moments

    cfg = user_config(tmp_path / "root", checkpoints[0], tmp_path / "task.jsonl")
    names = {"base_model", "rollouts.policy", "scores.policy.policy"}
    ref = run_planned(cfg, names=names)["scores.policy.policy"].ref
    read = tasks.stats.load_moments

    def nan_at_3(sc: zarr.Group, cols: slice = slice(None), halves: bool = True) -> tuple[Moments, ...]:
        start, stop, _ = cols.indices(ParamLayout.from_records(sc.attrs["tensors"]).P)
        planted = np.zeros(stop - start)
        if start <= 3 < stop:
            planted[3 - start] = np.nan
        return tuple(
            Moments(m.count, m.mean_a, m.m2_a, m.mean_s + planted, m.m2_s, m.c_as) for m in read(sc, cols, halves)
        )

    monkeypatch.setattr(tasks.stats, "load_moments", nan_at_3)
    with pytest.raises(ValueError) as err:
        run_planned(cfg, names={"stats.policy.policy"})
    said = str(err.value)
    assert said.startswith(f"scores artifact scores/{ref.key}: F is NaN or inf at 1 and G at 1 of P = "), said
    assert "\n" not in said
    assert not [p for p in completed(tmp_path / "root") if p.startswith("stats/")]


@pytest.mark.slow
def test_covgrad_run_on_a_nan_policy_exits_2_in_one_line(tmp_path, checkpoints, cli_api):
    """``covgrad run`` on a user model with one NaN weight: exit 2, the one line naming the path and the tensor,
    nothing marked complete."""
    task = tmp_path / "task.jsonl"
    task.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4)))
    sets = {
        "model.path": checkpoints[1],
        "task.path": task,
        "task.reward": "covgrad.rewards:mentions_answer",
        "task.n_prompts": 4,
        "rollouts.samplers": json.dumps({"policy": {"group_size": 2, "max_new_tokens": 2, "batch_size": 8}}),
        "tokens.enabled": "false",
        "update_check.enabled": "false",
    }
    cmd = [sys.executable, "-m", "flows.cli", "run", "--config", str(REPO / "configs" / "user.yaml")]
    cmd += ["--root", str(tmp_path / "root"), *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))]
    env = {**os.environ, "PYTHONPATH": str(REPO), "COVGRAD_LOG_DIR": str(tmp_path / "logs"), "PREFECT_API_URL": cli_api}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = error_line(proc.stderr)
    assert f"model path {str(checkpoints[1])!r} has 1 non-finite weight value(s)" in line and NAN_TENSOR in line
    assert completed(tmp_path / "root") == []
