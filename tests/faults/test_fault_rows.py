"""Rows of the fault table that need a whole stage chain or a live writer: a task file edited in place is recomputed
with its new prompts, a regime's teacher or reference directory changed in place changes that regime's key, and
``covgrad gc --yes`` while a scores stage is being written keeps it and the run completes byte-identical."""

import os
import shutil
import time
from pathlib import Path

import pytest
import zarr

from tests.helpers import forked
from tests.helpers.faults import digests
from tests.helpers.pipeline import run_planned, status_of
from tests.helpers.user import user_config, write_checkpoint


@pytest.fixture(autouse=True)
def digest_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("COVGRAD_CACHE_DIR", str(tmp_path / "digest-cache"))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("fault-rows") / "ckpt")


def rewrite_in_place(path: Path, old: bytes, new: bytes) -> None:
    """Replace the first ``old`` by ``new`` (same length) inside the file, keeping its inode, size and mtime."""
    assert len(old) == len(new) and old != new
    st = path.stat()
    data = path.read_bytes()
    assert old in data
    with open(path, "r+b") as f:
        f.write(data.replace(old, new, 1))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = path.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (st.st_ino, st.st_size, st.st_mtime_ns)


def flip_last_weight_bytes(model_dir: Path) -> None:
    """Change the last 8 bytes of the directory's safetensors file in place (size and mtime kept)."""
    weights = model_dir / "model.safetensors"
    tail = weights.read_bytes()[-8:]
    rewrite_in_place(weights, tail, bytes(b ^ 0x01 for b in tail))


@pytest.mark.slow
def test_a_task_file_edited_in_place_is_recomputed_with_its_new_prompts(tmp_path, checkpoint):
    """Line 1's prompt and answer changed in place, the file's size and mtime restored: the rerun computes
    the rollouts and every stage below them (the base model stays cached) and stores the new prompt."""
    task = tmp_path / "task.jsonl"
    cfg = user_config(tmp_path / "root", checkpoint, task)
    first = status_of(run_planned(cfg))
    assert set(first.values()) == {"computed"}
    rewrite_in_place(task, b'{"prompt": "1+2=", "answer": "3"}', b'{"prompt": "2+1=", "answer": "4"}')
    results = run_planned(cfg)
    status = status_of(results)
    assert status.pop("base_model") == "cached"
    assert set(status.values()) == {"computed"}, status
    ref = results["rollouts.policy"].ref
    prompts = zarr.open_group(str(tmp_path / "root" / ref.stage / ref.key / "rollouts.zarr"), mode="r")["prompt"]
    assert "2+1=" in prompts[:].tolist() and "1+2=" not in prompts[:].tolist()


def test_a_teacher_or_reference_directory_changed_in_place_changes_its_regime_key(tmp_path, checkpoint):
    """A regime's teacher (distill) or reference (rl_token's KL) model directory with its weights rewritten in
    place, mtime restored: that regime's key changes, with the regimes statistics and the report; no other."""
    from tasks.specs import plan

    teacher, reference = tmp_path / "teacher", tmp_path / "reference"
    shutil.copytree(checkpoint, teacher)
    shutil.copytree(checkpoint, reference)
    regimes = {
        "d": {"kind": "distill_reverse_kl", "teacher": str(teacher)},
        "k": {"kind": "rl_token", "kl_beta": 0.1, "reference": str(reference)},
    }
    cfg = user_config(tmp_path / "root", checkpoint, tmp_path / "task.jsonl", regimes=regimes)

    def keys() -> dict[str, str]:
        return {name: step.ref.key for name, step in plan(cfg).items()}

    before = keys()
    flip_last_weight_bytes(teacher)
    after_teacher = keys()
    assert {n for n in before if before[n] != after_teacher[n]} == {"regime.d", "regimes", "report"}
    flip_last_weight_bytes(reference)
    after = keys()
    assert {n for n in before if after_teacher[n] != after[n]} == {"regime.k", "regimes", "report"}


@pytest.mark.slow
def test_gc_during_a_live_scores_stage_keeps_it_and_the_run_completes(tiny_run, tmp_path, capsys):
    """The tiny chain on a root holding the finished run's stages above scores and its run index, paused in
    its first scores state write: ``covgrad gc --yes`` says it keeps that scores artifact (a live run is
    writing it) and removes nothing of the run; released, the chain completes and every artifact is
    byte-identical to the uninterrupted run's."""
    from flows.cli import main

    source, plan = tiny_run
    root = tmp_path / "root"
    for stage in ("base_model", "rollouts", "runs"):
        shutil.copytree(source / stage, root / stage)
    ready, go = tmp_path / "ready", tmp_path / "go"
    chain = forked.start(forked.paused_chain, str(root), str(ready), str(go))  # a child process
    try:
        deadline = time.monotonic() + 300
        while not ready.exists() and chain.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), chain.output() if chain.poll() is not None else "the chain never wrote scores"
        live = [d for d in (root / "scores").iterdir() if not (d / "_COMPLETE.json").exists()]
        assert len(live) == 1
        capsys.readouterr()
        assert main(["gc", "--root", str(root), "--yes"]) == 0
        out = capsys.readouterr().out
        assert f"kept scores/{live[0].name}: a live run is writing it" in out, out
        assert "remove " not in out, out
        assert live[0].is_dir()
    finally:
        go.write_text("")
        chain.wait(timeout=600)
    with chain:
        status = chain.result()
    assert status["scores.policy.policy"] == "computed" and status["rollouts.policy"] == "cached", status
    for name, step in plan.items():
        ref = step.ref
        assert digests(root / ref.stage / ref.key) == digests(source / ref.stage / ref.key), name


@pytest.mark.slow
def test_a_truncated_run_index_is_one_warning_and_a_rerun_rewrites_it(tiny_run, tmp_path, caplog, capsys):
    """``runs/tiny.json`` cut mid-write: ``ls`` and ``runs`` still list everything with one warning naming
    the file, ``gc`` refuses in one line and deletes nothing, and the (fully cached) rerun rewrites it."""
    import logging

    from flows.cli import main
    from storage.artifacts import ArtifactStore
    from storage.runs import read_run_index
    from tests.helpers.faults import OVERRIDES, run_chain, tree
    from tests.helpers.pipeline import tiny_config

    source, plan = tiny_run
    root = tmp_path / "root"
    shutil.copytree(source, root)
    index = root / "runs" / "tiny.json"
    index.write_text(index.read_text()[:40])
    before = tree(root)
    with caplog.at_level(logging.WARNING, logger="covgrad"):
        assert main(["ls", "--root", str(root)]) == 0
        assert main(["runs", "--root", str(root)]) == 0
    out = capsys.readouterr().out
    assert plan["report"].ref.key in out and "tiny" in out
    warned = [r.getMessage() for r in caplog.records if str(index) in r.getMessage()]
    assert len(warned) == 1 and f"skipped: {index} is not valid JSON" in warned[0], warned
    assert main(["gc", "--root", str(root), "--yes"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"covgrad: error: {index} is not valid JSON" in err[0], err
    assert tree(root) == before
    status = run_chain(tiny_config(str(root), **OVERRIDES))
    assert set(status.values()) == {"cached"}
    assert read_run_index(ArtifactStore(str(root)), "tiny")["run"] == plan.run_key
