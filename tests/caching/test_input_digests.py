"""Keys see content: a task file, a sampler's model directory, μ's model or an imported rollouts file changed in
place (same path, size and modification time restored) changes the keys of exactly the stages that read it and
everything below; the demo, which reads no user file, keeps its keys."""

import json
import os
import shutil
from pathlib import Path

import pytest

from tasks.specs import plan
from tests.helpers.pipeline import tiny_config
from tests.helpers.user import user_config, write_checkpoint


@pytest.fixture(autouse=True)
def digest_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COVGRAD_CACHE_DIR", str(tmp_path / "digest-cache"))


def rewrite_in_place(path: Path, old: bytes, new: bytes) -> None:
    """Replace ``old`` by ``new`` (same length) inside the file, keeping its inode, size and mtime."""
    assert len(old) == len(new)
    st = path.stat()
    data = path.read_bytes()
    assert old in data
    with open(path, "r+b") as f:
        f.write(data.replace(old, new, 1))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def keys(cfg) -> dict[str, str]:
    return {name: step.ref.key for name, step in plan(cfg).items()}


def changed(before: dict[str, str], after: dict[str, str]) -> set[str]:
    return {n for n in before if before[n] != after[n]}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("digests") / "ckpt")


def test_a_task_file_edited_in_place_changes_rollouts_and_below(tmp_path, checkpoint):
    task = tmp_path / "task.jsonl"
    cfg = user_config(tmp_path / "root", checkpoint, task)
    before = keys(cfg)
    rewrite_in_place(task, b'"1+2="', b'"2+1="')
    after = keys(cfg)
    moved = changed(before, after)
    assert "base_model" not in moved
    assert {"rollouts.policy", "scores.policy.policy", "stats.policy.policy", "masks", "report"} <= moved


def test_the_reward_source_is_in_the_rollouts_key(tmp_path, checkpoint, monkeypatch):
    (tmp_path / "my_reward.py").write_text("def reward(p, r, a):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = user_config(tmp_path / "root", checkpoint, tmp_path / "task.jsonl")
    cfg = cfg.model_copy(update={"task": cfg.task.model_copy(update={"reward": "my_reward:reward"})})
    before = keys(cfg)
    rewrite_in_place(tmp_path / "my_reward.py", b"return 1.0", b"return 0.0")
    assert "rollouts.policy" in changed(before, keys(cfg))


def test_a_sampler_model_changed_in_place_changes_its_keys_only(tmp_path, checkpoint):
    other = tmp_path / "other"
    shutil.copytree(checkpoint, other)
    samplers = {
        "policy": {"group_size": 4, "max_new_tokens": 3, "batch_size": 16},
        "older": {"model": str(other), "group_size": 4, "max_new_tokens": 3, "batch_size": 16, "store_mu": "full"},
    }
    cfg = user_config(tmp_path / "root", checkpoint, tmp_path / "task.jsonl", **{"rollouts.samplers": samplers})
    before = keys(cfg)
    weights = other / "model.safetensors"
    data = weights.read_bytes()
    rewrite_in_place(weights, data[-8:], bytes(reversed(data[-8:])) if data[-8:] != data[-8:][::-1] else b"\x01" * 8)
    moved = changed(before, keys(cfg))
    assert {"rollouts.older", "scores.older.policy", "scores.older.sampler"} <= moved
    assert not moved & {"base_model", "rollouts.policy", "scores.policy.policy", "stats.policy.policy"}


def test_mu_model_and_imported_rollouts_are_in_the_keys(tmp_path, checkpoint):
    mu = tmp_path / "mu"
    shutil.copytree(checkpoint, mu)
    records = tmp_path / "engine.jsonl"
    rec = {"prompt_ids": [1, 5], "response_ids": [6, 2], "reward": 1.0, "logprobs": [-1.0, -0.5]}
    records.write_text("\n".join(json.dumps({**rec, "reward": float(i % 2)}) for i in range(8)) + "\n")
    samplers = {"engine": {"import_path": str(records), "mu_model": str(mu)}}
    overrides = {"rollouts.samplers": samplers, "rollouts.analyse": "engine"}
    cfg = user_config(tmp_path / "root", checkpoint, tmp_path / "task.jsonl", **overrides)
    before = keys(cfg)
    rewrite_in_place(records, b'"reward": 0.0', b'"reward": 2.0')
    after_records = keys(cfg)
    assert {"rollouts.engine", "scores.engine.policy"} <= changed(before, after_records)
    rewrite_in_place(mu / "config.json", b"32", b"33")
    moved = changed(after_records, keys(cfg))
    assert "scores.engine.sampler" in moved
    assert not moved & {"rollouts.engine", "scores.engine.policy"}


def test_the_demo_reads_no_user_file_and_hashes_no_inputs(tmp_path):
    p = plan(tiny_config(str(tmp_path / "root")))
    for step in p.values():
        assert "inputs" not in step.spec.hashed()
