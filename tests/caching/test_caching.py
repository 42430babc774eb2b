"""Caching through the ``covgrad-pipeline`` flow (Prefect cache + artifact markers), the leftover
Prefect lock of a killed run, and ``covgrad ls`` / ``gc``. One tiny pipeline per module."""

import pytest

from tests.helpers.pipeline import below, tiny_config

pytestmark = pytest.mark.slow

OVERRIDES = {"tokens.enabled": False, "update_check.enabled": False}


def computed(result: dict) -> set[str]:
    return {n for n, s in result["status"].items() if s == "computed"}


@pytest.fixture(scope="module")
def first(prefect_server, tmp_path_factory):
    """(cfg, flow result) of the first run on a fresh local root."""
    from flows.pipeline import covgrad_pipeline

    cfg = tiny_config(str(tmp_path_factory.mktemp("cache")), **OVERRIDES)
    return cfg, covgrad_pipeline(cfg)


def test_first_run_computes_and_identical_rerun_is_all_cached(first):
    from flows.pipeline import covgrad_pipeline

    cfg, result = first
    assert set(result["status"].values()) == {"computed"}
    again = covgrad_pipeline(cfg)
    assert again["run"] == result["run"]
    assert set(again["status"]) == set(result["status"])
    assert set(again["status"].values()) == {"cached"}


def test_downstream_parameter_recomputes_only_downstream(first):
    from flows.pipeline import covgrad_pipeline

    cfg, _ = first
    changed = tiny_config(cfg.root, **OVERRIDES, **{"masks.qs": [0.05, 0.2]})
    result = covgrad_pipeline(changed)
    assert computed(result) == below(changed, "masks")
    assert "stats.policy.policy" not in computed(result)


def test_prefect_cache_hit_with_missing_marker_recomputes_that_stage_and_below(first):
    from flows.pipeline import covgrad_pipeline
    from storage.artifacts import MARKER, ArtifactStore
    from tasks.common import cache_options
    from tasks.specs import plan

    cfg, _ = first
    store = ArtifactStore(cfg.root)
    nodes = plan(cfg)
    ref = nodes["rollouts.stale"].ref
    assert cache_options(store, ref)["refresh_cache"] is False
    store.fs.rm(store.path(ref, MARKER))
    assert cache_options(store, ref)["refresh_cache"] is True
    downstream = nodes["scores.stale.sampler"].ref
    assert cache_options(store, downstream)["refresh_cache"] is True, "served while its upstream is missing"

    result = covgrad_pipeline(cfg)
    expected = below(cfg, "rollouts.stale")
    assert {"rollouts.stale", "scores.stale.policy", "stats.stale.sampler"} <= expected
    assert computed(result) == expected
    assert all(store.is_complete(nodes[n].ref) for n in nodes)
    assert cache_options(store, downstream)["refresh_cache"] is False


def test_leftover_prefect_lock_of_a_dead_run_is_removed(tmp_path):
    from storage.artifacts import ArtifactStore
    from tasks.common import cache_key, cache_options

    store = ArtifactStore(str(tmp_path))
    ref = store.ref("masks", "0123456789abcdef01234567")
    lock = tmp_path / ".prefect-locks" / f"{cache_key(ref)}.lock"
    lock.parent.mkdir()
    lock.write_text('{"holder": "dead", "expiration": null}')
    with store.lock(ref):
        assert store.busy(ref)
        cache_options(store, ref)
        assert lock.exists()
    assert not store.busy(ref)
    cache_options(store, ref)
    assert not lock.exists()


def test_ls_and_gc(first, capsys):
    from flows.cli import main
    from storage.artifacts import ArtifactStore

    cfg, _ = first
    store = ArtifactStore(cfg.root)
    orphan = store.ref("stats", "feedfacefeedfacefeedface")
    store.write_json(orphan, "_STARTED.json", {"stage": "stats"})
    capsys.readouterr()
    assert main(["ls", "--root", cfg.root]) == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    states = {(line.split()[0], line.split()[1]): line.split()[2] for line in lines}
    assert states[("stats", orphan.key)] == "partial"
    assert sum(s == "complete" for s in states.values()) == len(states) - 1, states
    before = {k for k, s in states.items() if s == "complete"}

    assert main(["gc", "--root", cfg.root, "--yes"]) == 0
    out = capsys.readouterr().out
    assert f"remove stats/{orphan.key} (partial" in out
    assert not store.exists(orphan)
    after = {(r["stage"], r["key"]) for r in store.list_artifacts()}
    assert after == before
