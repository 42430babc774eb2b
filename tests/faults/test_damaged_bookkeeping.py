"""Bookkeeping files a crash, a disk or a person can spoil: a completion marker that is valid JSON but not an
object, a truncated run index, and an artifact being written while ``covgrad gc`` runs. None of them crashes a
command or serves a wrong result; a writer's artifact is never deleted under it."""

import logging
import multiprocessing
import shutil

import pytest

from storage.artifacts import MARKER, ArtifactStore
from tests.helpers.pipeline import NO_OPTIONAL, run_planned, status_of, tiny_config

pytestmark = pytest.mark.slow  # each test copies and reruns the tiny pipeline


@pytest.fixture
def copied(tiny_run, tmp_path):
    """A private copy of the session's tiny pipeline: (root, plan)."""
    root, p = tiny_run
    shutil.copytree(root, tmp_path / "root")
    return tmp_path / "root", p


@pytest.mark.parametrize("text", ["null", "[1, 2]", '"done"'])
def test_a_marker_that_is_not_an_object_is_one_warning_then_recomputed(copied, caplog, capsys, text):
    from flows.cli import main

    root, p = copied
    ref = p["masks"].ref
    store = ArtifactStore(str(root))
    before = (root / ref.stage / ref.key / "masks.zarr").exists()
    (root / ref.stage / ref.key / MARKER).write_text(text)
    with caplog.at_level(logging.WARNING, logger="covgrad"):
        assert store.marker(ref) is None
        assert not store.is_complete(ref)
        for command in (["ls"], ["verify", "--all"], ["gc"]):
            assert main([*command, "--root", str(root)]) in (0, 1)
    warned = [r.getMessage() for r in caplog.records if MARKER in r.getMessage()]
    assert len(warned) == 1 and "not a completion record" in warned[0], warned
    status = status_of(run_planned(tiny_config(str(root), **NO_OPTIONAL)))
    assert status["masks"] == "computed" and before
    assert status["stats.policy.policy"] == "cached"
    assert store.is_complete(ref)


@pytest.mark.parametrize("text", ['{"run": "abc", "artif', "[]", '{"run": "abc"}'])
def test_a_spoiled_run_index_is_one_line_naming_the_file(copied, text):
    from storage.runs import read_run_index, referenced_keys

    root, _ = copied
    index = root / "runs" / "tiny.json"
    index.write_text(text)
    with pytest.raises(ValueError, match=r"runs/tiny\.json is not (valid JSON|a run index)") as err:
        read_run_index(ArtifactStore(str(root)), "tiny")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="rerun `covgrad run`"):
        referenced_keys(ArtifactStore(str(root)))  # gc deletes nothing it cannot account for


def test_the_run_index_is_written_atomically(copied):
    from storage.runs import read_run_index, write_run_index

    root, p = copied
    store = ArtifactStore(str(root))
    cfg = tiny_config(str(root), **NO_OPTIONAL)
    write_run_index(store, cfg, p.run_key, {n: s.ref for n, s in p.items()})
    assert not list((root / "runs").glob("*.partial"))
    assert read_run_index(store, "tiny")["run"] == p.run_key


def _hold_lock(root: str, stage: str, key: str, ready, release) -> None:
    store = ArtifactStore(root)
    ref = store.ref(stage, key)
    with store.lock(ref):
        store.write_json(ref, "_STARTED.json", {"stage": stage})
        ready.set()
        release.wait(60)


def test_gc_keeps_an_artifact_a_live_writer_holds(copied, capsys):
    from flows.cli import main

    root, _ = copied
    store = ArtifactStore(str(root))
    live, dead = store.ref("stats", "1" * 24), store.ref("stats", "2" * 24)
    store.write_json(dead, "_STARTED.json", {"stage": "stats"})
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    writer = ctx.Process(target=_hold_lock, args=(str(root), "stats", live.key, ready, release))
    writer.start()
    try:
        assert ready.wait(60)
        capsys.readouterr()
        assert main(["gc", "--root", str(root), "--yes"]) == 0
        out = capsys.readouterr().out
        assert f"kept stats/{live.key}: a live run is writing it" in out
        assert f"remove stats/{dead.key} (partial" in out
        assert store.exists(live) and not store.exists(dead)
    finally:
        release.set()
        writer.join(60)
    assert main(["gc", "--root", str(root), "--yes"]) == 0  # the writer is gone: now it is a leftover
    assert not store.exists(live)
