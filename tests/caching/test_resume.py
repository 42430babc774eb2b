"""Resumability, invalidation and concurrency of stage artifacts, driving the stage functions (``.fn``)
directly: no Prefect server. One tiny pipeline is computed once per module (the reference root);
each test works on a copy of it (local path or ``memory://``).

Killed runs and concurrent runs happen in child processes running ``tests.helpers.forked.seamed_run``,
which wraps the stage's writes (``WRITERS``).
"""

import hashlib
import random
import shutil
import time
import uuid
from pathlib import Path

import fsspec
import pytest

from tests.helpers import forked
from tests.helpers.pipeline import below, run_planned, status_of, tiny_config

# Many small batches, so a kill can land in the middle: 8 score batches and 8 rollout batches; the
# scores state is checkpointed every 3 batches (after batches 3, 6 and the final 8).
OVERRIDES = {
    "tokens.enabled": False,
    "update_check.enabled": False,
    "scores.groups_per_batch": 1,
    "scores.checkpoint_batches": 3,
    "rollouts.samplers.policy.batch_size": 4,
}

# The module whose ``mark_batch_done`` (and, for scores, ``write_state``) a stage's writes go through.
WRITERS = {"scores": "storage.stores.scores", "rollouts": "tasks.rollouts"}

STATE_ARRAYS = {"count", "mean_a", "m2_a", "mean_s", "m2_s", "c_as", "shard_batches", "ckpt"}


def run_chain(cfg) -> dict[str, str]:
    """Every planned stage through its task function, in order; instance → computed/cached."""
    return status_of(run_planned(cfg))


def computed(status: dict[str, str]) -> set[str]:
    return {n for n, s in status.items() if s == "computed"}


def data_digests(store_dir: Path) -> dict[str, str]:
    """sha256 of every file of a zarr store except metadata (``zarr.json`` holds attrs/timestamps)."""
    return {
        str(p.relative_to(store_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(store_dir.rglob("*"))
        if p.is_file() and p.name != "zarr.json"
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(root, cfg, node map) of one uninterrupted tiny pipeline on a local path."""
    from tasks.specs import plan

    root = tmp_path_factory.mktemp("reference")
    cfg = tiny_config(str(root), **OVERRIDES)
    status = run_chain(cfg)
    assert set(status.values()) == {"computed"}
    return root, cfg, plan(cfg)


def copy_root(reference, dest: Path, drop: tuple[str, ...] = ()) -> object:
    """A copy of the reference root at ``dest`` without the artifacts of instances ``drop``; its cfg."""
    root, _, nodes = reference
    shutil.copytree(root, dest, ignore=shutil.ignore_patterns(".locks"))
    for name in drop:
        shutil.rmtree(dest / nodes[name].ref.stage / nodes[name].ref.key)
    return tiny_config(str(dest), **OVERRIDES)


def artifact_dir(root: Path, nodes, instance: str) -> Path:
    return root / nodes[instance].ref.stage / nodes[instance].ref.key


def spawn(root: Path, instance: str, **seams) -> forked.Child:
    """A child process computing ``instance`` on a copy's ``root`` with its stage's writes wrapped by ``seams``
    (``forked.seamed_run``'s keywords)."""
    module = WRITERS[instance.split(".")[0]]
    return forked.start(forked.seamed_run, str(root), OVERRIDES, {instance}, module, **seams)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "memory"])
def test_rerun_cached_and_invalidation_recomputes_exactly_below(reference, tmp_path, where):
    root, _, nodes = reference
    if where == "local":
        cfg = copy_root(reference, tmp_path / "root")
    else:
        target = f"/covgrad-test-{uuid.uuid4().hex[:8]}"
        fs = fsspec.filesystem("memory")
        fs.put(str(root), target, recursive=True)
        cfg = tiny_config(f"memory://{target.lstrip('/')}", **OVERRIDES)
    from storage.artifacts import MARKER, ArtifactStore

    store = ArtifactStore(cfg.root)
    assert set(run_chain(cfg).values()) == {"cached"}

    store.fs.rm(store.path(nodes["rollouts.stale"].ref, MARKER))
    status = run_chain(cfg)
    expected = below(cfg, "rollouts.stale")
    assert {"scores.stale.sampler", "stats.stale.policy"} <= expected
    assert "masks" not in expected and "rollouts.policy" not in expected
    assert computed(status) == expected

    # A truncated scores store: one chunk file and the marker gone -> recomputed from scratch.
    ref = nodes["scores.policy.policy"].ref
    chunks = sorted(p for p in store.fs.find(store.path(ref, "scores.zarr", "mean_s")) if "/c/" in p)
    before = store.fs.cat_file(chunks[0])
    store.fs.rm([chunks[0], store.path(ref, MARKER)])
    status = run_chain(cfg)
    assert computed(status) == below(cfg, "scores.policy.policy")
    assert store.fs.cat_file(chunks[0]) == before
    assert set(run_chain(cfg).values()) == {"cached"}
    if where == "memory":
        store.fs.rm(store.base, recursive=True)


@pytest.mark.slow  # the only fast user of the reference chain (many small batches)
def test_stale_upstream_is_not_resumed(reference, tmp_path):
    """Batches written against an upstream completion that has since been replaced are discarded."""
    from storage.artifacts import CLAIM, MARKER, ArtifactStore

    _, _, nodes = reference
    cfg = copy_root(reference, tmp_path / "root")
    store = ArtifactStore(cfg.root)
    ref = nodes["scores.policy.policy"].ref
    claim = {"stage": ref.stage, "key": ref.key, "started": "x", "config": {}, "upstream_stamps": {}}
    store.write_json(ref, CLAIM, claim)
    store.fs.rm(store.path(ref, MARKER))
    claim = store.begin(ref, {}, resume=True)
    assert store.fs.ls(store.path(ref), detail=False) == [store.path(ref, CLAIM)]
    assert claim["upstream_stamps"] == store.upstream_stamps(ref.upstream)
    assert None not in claim["upstream_stamps"].values()


def resume_after_kill(reference, tmp_path, instance, seams: dict, monkeypatch) -> tuple[list[int], Path]:
    """A child computing ``instance`` SIGKILLs itself at the seam ``seams`` names; leave a torn ``*.partial``
    file, resume in this process; return the batches the resumed run marked done and the artifact directory."""
    import importlib

    from tasks.specs import plan

    _, _, nodes = reference
    root = tmp_path / "root"
    cfg = copy_root(reference, root, drop=(instance,))
    with spawn(root, instance, **seams) as child:
        assert child.wait() == forked.KILLED, f"{seams}: child did not die by SIGKILL:\n{child.output(2000)}"
    art = artifact_dir(root, nodes, instance)
    assert not (art / "_COMPLETE.json").exists()
    store_name = "scores.zarr" if instance.startswith("scores") else "rollouts.zarr"
    (art / store_name / "stray.partial").write_bytes(b"torn")

    module = importlib.import_module(WRITERS[nodes[instance].ref.stage])
    real_mark, marked = module.mark_batch_done, []
    monkeypatch.setattr(module, "mark_batch_done", lambda g, b: (marked.append(b), real_mark(g, b)))
    assert plan(cfg)[instance].ref.root == str(root)
    result = run_planned(cfg, {instance})[instance]
    assert result.computed
    assert not list(art.rglob("*.partial"))
    return marked, art


def assert_same_store(reference, art: Path, instance: str, note: str) -> None:
    ref_root, _, nodes = reference
    store_name = "scores.zarr" if instance.startswith("scores") else "rollouts.zarr"
    got = data_digests(art / store_name)
    want = data_digests(artifact_dir(ref_root, nodes, instance) / store_name)
    assert got == want, (
        f"{note}: files differ: {sorted(set(want) ^ set(got) | {k for k in want if got.get(k) != want[k]})}"
    )


@pytest.mark.slow
@pytest.mark.parametrize("instance", ["scores.policy.policy", "rollouts.policy"])
def test_sigkill_at_random_batch_then_resume_is_byte_identical(reference, tmp_path, instance, monkeypatch):
    """Killed while marking batches done (rollouts: after any batch; scores: between checkpoints, whose
    marks come after each complete checkpoint): the resumed run redoes exactly the unmarked batches."""
    seed = random.randrange(2**32)
    kill_after = random.Random(seed).randrange(1, 7)
    marked, art = resume_after_kill(reference, tmp_path, instance, {"kill_at_mark": kill_after}, monkeypatch)
    if instance.startswith("scores"):
        # marks come in checkpoint groups [0, 1, 2], [3, 4, 5], [6, 7]; the kill lands inside a group whose
        # checkpoint is complete, so the resumed run finishes that group's marks and recomputes the rest.
        assert sorted(marked) == list(range(kill_after, 8)), f"seed {seed}: {marked}"
    else:
        assert len(marked) == 8 - kill_after, f"seed {seed}: resumed {len(marked)} batches, killed after {kill_after}"
    assert_same_store(reference, art, instance, f"seed {seed}")


@pytest.mark.slow
@pytest.mark.parametrize("writes", [1, 5])
def test_sigkill_while_writing_a_checkpoint_then_resume_is_byte_identical(reference, tmp_path, writes, monkeypatch):
    """Killed in the middle of writing the state (first checkpoint, or the second after a complete first):
    the torn checkpoint is discarded and the batches after the last complete one are recomputed."""
    instance = "scores.policy.policy"
    marked, art = resume_after_kill(reference, tmp_path, instance, {"kill_at_write": writes}, monkeypatch)
    blocks = 3  # state arrays per checkpoint (one block each in the tiny model)
    first_incomplete = 3 * (writes // blocks)  # batches of the last complete checkpoint
    assert sorted(marked) == list(range(first_incomplete, 8)), marked
    assert_same_store(reference, art, instance, f"kill after {writes} writes")


@pytest.mark.slow
def test_scores_store_size_does_not_grow_with_samples(tmp_path):
    """The moment state is O(P): its bytes are the same for N and 4N samples."""
    from tasks.specs import plan

    sizes = {}
    for groups in (4, 16):
        cfg = tiny_config(str(tmp_path / f"g{groups}"), **{**OVERRIDES, "task.n_prompts": groups})
        nodes = plan(cfg)
        run_planned(cfg, {"base_model", "rollouts.policy", "scores.policy.policy"})
        art = artifact_dir(Path(cfg.root), nodes, "scores.policy.policy") / "scores.zarr"
        state = [p for p in art.rglob("*") if p.is_file() and p.relative_to(art).parts[0] in STATE_ARRAYS]
        sizes[groups] = (sum(p.stat().st_size for p in state), len(state))
    assert sizes[4] == sizes[16] and sizes[4][1] >= 7, sizes


@pytest.mark.slow
def test_two_concurrent_writers_compute_once(reference, tmp_path):
    ref_root, _, nodes = reference
    instance = "scores.policy.policy"
    root = tmp_path / "root"
    copy_root(reference, root, drop=(instance,))
    sync = tmp_path / "sync"
    sync.mkdir()
    children = [spawn(root, instance, mark_delay=0.2, sync=str(sync)) for _ in range(2)]
    try:
        deadline = time.monotonic() + 300
        while len(list(sync.glob("ready-*"))) < 2:
            ok = time.monotonic() < deadline and all(c.poll() is None for c in children)
            assert ok, "children did not start:\n" + "\n".join(c.output(2000) for c in children)
            time.sleep(0.05)
        (sync / "go").touch()
        outs = [c.result() for c in children]
    finally:
        for c in children:
            c.close()
    assert sorted(o["computed"][instance] for o in outs) == [False, True]
    assert sorted(o["batches"] for o in outs) == [0, 8]
    art = artifact_dir(root, nodes, instance)
    assert (art / "_COMPLETE.json").exists() and not (art / "_STARTED.json").exists()
    assert data_digests(art / "scores.zarr") == data_digests(artifact_dir(ref_root, nodes, instance) / "scores.zarr")
