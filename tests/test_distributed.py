"""Distributed execution on a dask LocalCluster: the stats stage through ``dask.address`` and score
extraction sharded over two worker processes must write exactly what the in-process run writes."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr

from covgrad.config import PipelineConfig
from storage.artifacts import ArtifactRef, ArtifactStore
from tasks.plan import plan
from tasks.registry import STAGE_TASKS
from tests.test_deployments import user_config, write_checkpoint

pytestmark = pytest.mark.integration

SCORES = "scores.policy.policy"


def run_stages(cfg: PipelineConfig, names: list[str]) -> dict[str, ArtifactRef]:
    """Run the named planned stages in order through their task functions (no Prefect engine)."""
    nodes = plan(cfg)
    for name in names:
        node = nodes[name]
        upstream = {u: nodes[u].ref for u in node.upstream}
        STAGE_TASKS[node.ref.stage].fn(node.ref, cfg, name, upstream)
    return {name: node.ref for name, node in nodes.items()}


def with_root(cfg: PipelineConfig, root: Path, address: str | None = None) -> PipelineConfig:
    data = cfg.model_dump(mode="json")
    data["root"] = str(root)
    data["dask"]["address"] = address
    return PipelineConfig.model_validate(data)


def assert_same_group(a: zarr.Group, b: zarr.Group) -> None:
    """Same arrays with the same dtype, shape and bytes, and the same attributes (NaN equal to NaN)."""
    assert sorted(a.array_keys()) == sorted(b.array_keys())
    for name in a.array_keys():
        x, y = a[name][...], b[name][...]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), f"array {name} differs"
    assert json.dumps(dict(a.attrs), sort_keys=True) == json.dumps(dict(b.attrs), sort_keys=True)


@pytest.fixture(scope="module")
def cluster():
    from distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, host="127.0.0.1", dashboard_address=None) as c:
        yield c


@pytest.fixture(scope="module")
def threaded(tmp_path_factory: pytest.TempPathFactory) -> PipelineConfig:
    """Rollouts of the tiny user-model config, a copy of that root for the distributed runs
    (``{tmp}/upstream``), and then scores and stats computed in-process in ``{tmp}/threaded``."""
    tmp = tmp_path_factory.mktemp("distributed")
    ckpt = write_checkpoint(tmp / "ckpt")
    cfg = user_config(tmp / "threaded", ckpt, tmp / "task.jsonl")
    run_stages(cfg, ["base_model", "rollouts.policy"])
    shutil.copytree(tmp / "threaded", tmp / "upstream")
    run_stages(cfg, [SCORES, "stats.policy.policy"])
    return cfg


def test_sharded_scores_equal_one_worker(prefect_server, threaded: PipelineConfig, cluster, tmp_path: Path):
    from tasks.shards import sharded_scores

    shutil.copytree(Path(threaded.root).parent / "upstream", tmp_path / "root")
    cfg = with_root(threaded, tmp_path / "root")
    out = sharded_scores(cfg, SCORES, n_shards=2, address=cluster.scheduler_address)
    assert out["computed"] and out["n_shards"] == 2
    ref = plan(cfg)[SCORES].ref
    store = ArtifactStore(cfg.root)
    assert store.is_complete(ref) and store.marker(ref)["n_shards"] == 2
    one = ArtifactStore(threaded.root).open_group(plan(threaded)[SCORES].ref, "scores.zarr")
    two = store.open_group(ref, "scores.zarr")
    assert np.count_nonzero(one["scores"][...]) > 0 and np.count_nonzero(one["c_as"][...]) > 0
    for name in ("scores", "advantage", "group", "batch_done"):  # per-sample data: byte for byte
        assert one[name][...].tobytes() == two[name][...].tobytes(), name
    assert two["count"].shape == (4,) and two["shard_batches"][:].sum() == one["batch_done"].shape[0]
    # moment state: one pair of parity rows per shard, which merge to the one-worker rows
    from covgrad.stats import Moments, merge_moments

    def half(g, h: int) -> Moments:
        rows = np.arange(g["count"].shape[0]) % 2 == h
        return merge_moments(Moments(*(g[n][...][rows] for n in ("count", "mean_a", "m2_a", "mean_s", "m2_s", "c_as"))))

    for h in (0, 1):
        a, b = half(one, h), half(two, h)
        for name in ("count", "mean_a", "m2_a", "mean_s", "m2_s", "c_as"):
            np.testing.assert_allclose(getattr(b, name), getattr(a, name), rtol=1e-12, atol=1e-15, err_msg=name)
    again = sharded_scores(cfg, SCORES, n_shards=2, address=cluster.scheduler_address)
    assert not again["computed"]


def test_sharded_scores_rejects_bad_input(prefect_server, threaded: PipelineConfig):
    from tasks.shards import sharded_scores_flow

    with pytest.raises(ValueError, match="not a planned scores artifact"):
        sharded_scores_flow.fn(threaded, "stats.policy.policy")
    with pytest.raises(ValueError, match="n_shards 0"):
        sharded_scores_flow.fn(threaded, SCORES, n_shards=0)


def test_stats_on_local_cluster_equal_threaded(threaded: PipelineConfig, cluster, tmp_path: Path):
    shutil.copytree(Path(threaded.root), tmp_path / "root", ignore=shutil.ignore_patterns("stats"))
    cfg = with_root(threaded, tmp_path / "root", address=cluster.scheduler_address)
    refs = run_stages(cfg, ["stats.policy.policy"])
    ref = refs["stats.policy.policy"]
    assert ArtifactStore(cfg.root).is_complete(ref)
    one = ArtifactStore(threaded.root).open_group(plan(threaded)["stats.policy.policy"].ref, "stats.zarr")
    two = ArtifactStore(cfg.root).open_group(ref, "stats.zarr")
    assert np.count_nonzero(np.nan_to_num(one["G"][...])) > 0
    assert_same_group(one, two)
