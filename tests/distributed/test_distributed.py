"""Distributed execution on a dask LocalCluster: the stats stage through ``dask.address`` and score
extraction as 2 sample shards × 2 parameter blocks over two worker processes (one of them killed mid-job
in one test) must write exactly what the same partition computed in one process writes."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import zarr
from distributed import WorkerPlugin

from covgrad.config import PipelineConfig
from storage.artifacts import ArtifactRef, ArtifactStore
from tasks.specs import plan
from tests.helpers.pipeline import run_planned
from tests.helpers.user import user_config, write_checkpoint

pytestmark = pytest.mark.integration

SCORES = "scores.policy.policy"


def run_stages(cfg: PipelineConfig, names: list[str]) -> dict[str, ArtifactRef]:
    """Run the named planned stages in order through their task functions (no Prefect engine)."""
    run_planned(cfg, set(names))
    return {name: step.ref for name, step in plan(cfg).items()}


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
    (``{tmp}/upstream``), and then scores (2 sample shards × 2 parameter blocks, one job after another)
    and stats computed in-process in ``{tmp}/threaded``. Eight batches of one prompt group, a checkpoint
    after every batch."""
    tmp = tmp_path_factory.mktemp("distributed")
    ckpt = write_checkpoint(tmp / "ckpt")
    cfg = user_config(
        tmp / "threaded",
        ckpt,
        tmp / "task.jsonl",
        **{"scores.shards": [2, 2], "scores.groups_per_batch": 1, "scores.checkpoint_batches": 1},
    )
    run_stages(cfg, ["base_model", "rollouts.policy"])
    shutil.copytree(tmp / "threaded", tmp / "upstream")
    run_stages(cfg, [SCORES, "stats.policy.policy"])
    return cfg


def scores_store(cfg: PipelineConfig) -> zarr.Group:
    return ArtifactStore(cfg.root).open_group(plan(cfg)[SCORES].ref, "scores.zarr")


def assert_same_scores(cfg: PipelineConfig, threaded: PipelineConfig) -> None:
    """Every array of the two scores stores has the same bytes, and the attributes agree."""
    one, two = scores_store(threaded), scores_store(cfg)
    assert two.attrs["shards"] == [2, 2] and two["shard_batches"][...].tolist() == [[4, 4], [4, 4]]
    assert two["count"][...].sum() == one["advantage"].shape[0]  # every sample folded once
    assert np.count_nonzero(one["c_as"][...]) > 0
    assert_same_group(one, two)


def test_sharded_scores_equal_one_process(prefect_server, threaded: PipelineConfig, cluster, tmp_path: Path):
    """2 × 2 jobs on two worker processes: the bytes of the same partition computed in one process; the
    jobs ran on both workers (the scheduler's task stream)."""
    from distributed import Client

    from flows.shards import sharded_scores

    shutil.copytree(Path(threaded.root).parent / "upstream", tmp_path / "root")
    cfg = with_root(threaded, tmp_path / "root")
    with Client(cluster.scheduler_address) as client:
        client.get_task_stream()  # the scheduler records the stream from its first request on
        out = sharded_scores(cfg, SCORES, address=cluster.scheduler_address)
        stream = [t for t in client.get_task_stream() if str(t["key"]).startswith("scores-job-")]
    assert out["computed"] and out["shards"] == [2, 2]
    assert len(stream) == 4 and len({t["worker"] for t in stream}) == 2, stream
    store = ArtifactStore(cfg.root)
    assert store.is_complete(plan(cfg)[SCORES].ref)
    # the recorded peak is the workers' (each job measured in its own process), not this process's
    marker = store.marker(plan(cfg)[SCORES].ref)
    assert sorted(marker["job_peak_rss_bytes"]) == ["0,0", "0,1", "1,0", "1,1"]
    assert out["peak_rss_bytes"] == marker["peak_rss_bytes"] == max(marker["job_peak_rss_bytes"].values()) > 0
    assert_same_scores(cfg, threaded)
    # the block axis: the same state bytes as 2 sample shards × 1 block (a different artifact)
    shutil.copytree(Path(threaded.root).parent / "upstream", tmp_path / "unblocked")
    data = with_root(threaded, tmp_path / "unblocked").model_dump(mode="json")
    data["scores"]["shards"] = [2, 1]
    unblocked = PipelineConfig.model_validate(data)
    run_stages(unblocked, [SCORES])
    for name in ("count", "mean_a", "m2_a", "mean_s", "m2_s", "c_as", "batch_done"):
        assert scores_store(unblocked)[name][...].tobytes() == scores_store(cfg)[name][...].tobytes(), name
    again = sharded_scores(cfg, SCORES, address=cluster.scheduler_address)
    assert not again["computed"]


class PauseAfterCheckpoint(WorkerPlugin):
    """Worker plugin: the first job to complete its second checkpoint writes "pid i k" (its worker's
    process id and the job) to ``flag`` and waits there (to be killed); every other job runs on. Each job start appends
    "i k restored-batches" to ``flag``.log."""

    def __init__(self, flag: str) -> None:
        self.flag = flag

    def setup(self, worker) -> None:
        import os
        import time

        from storage.stores.scores import ScoresStore

        real, flag = ScoresStore.drop_checkpoints, self.flag
        real_restore = ScoresStore.restore

        def restore(store, g, which, acc):
            done = real_restore(store, g, which, acc)
            with open(flag + ".log", "a") as f:
                f.write(f"{which[0]} {which[1]} {done}\n")
            return done

        def drop(store, g, which, keep):
            real(store, g, which, keep)
            if keep == 2:
                try:
                    fd = os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    return
                os.write(fd, f"{os.getpid()} {which[0]} {which[1]}".encode())
                os.close(fd)
                time.sleep(300)

        ScoresStore.drop_checkpoints = drop
        ScoresStore.restore = restore


def test_worker_killed_mid_job_gives_the_same_bytes(threaded: PipelineConfig, cluster, tmp_path: Path):
    """SIGKILL the worker process running a job after its second checkpoint: the scheduler reruns the job
    elsewhere, the rerun resumes from that checkpoint, and the store has the uninterrupted bytes."""
    import os
    import signal
    import threading
    import time

    from distributed import Client

    from flows.shards import run_sharded

    shutil.copytree(Path(threaded.root).parent / "upstream", tmp_path / "root")
    cfg = with_root(threaded, tmp_path / "root")
    flag = tmp_path / "paused.pid"
    plugin = PauseAfterCheckpoint(str(flag))
    with Client(cluster.scheduler_address) as client:
        client.register_plugin(plugin, name="pause-after-checkpoint")
        try:
            result: dict = {}
            runner = threading.Thread(target=lambda: result.update(run_sharded(cfg, SCORES, client)))
            runner.start()
            deadline = time.monotonic() + 240
            while not (flag.exists() and flag.read_text()):
                assert time.monotonic() < deadline and runner.is_alive(), "no job reached its second checkpoint"
                time.sleep(0.1)
            pid, i, k = flag.read_text().split()
            pids = client.run(os.getpid)  # worker address -> process id
            victim = next(addr for addr, p in pids.items() if p == int(pid))
            busy = [str(key) for key in client.processing()[victim]]  # running and queued there
            assert any(key.startswith(f"scores-job-{i}-{k}-") for key in busy), busy
            os.kill(int(pid), signal.SIGKILL)
            runner.join(timeout=300)
            assert not runner.is_alive() and result.get("computed"), result
        finally:
            client.unregister_worker_plugin("pause-after-checkpoint")
    starts = Path(f"{flag}.log").read_text().split("\n")
    assert f"{i} {k} 0" in starts and f"{i} {k} 2" in starts, starts  # the rerun resumed from checkpoint n2
    assert_same_scores(cfg, threaded)


def test_sharded_scores_rejects_bad_input(prefect_server, threaded: PipelineConfig, cluster):
    from distributed import Client

    from flows.shards import run_sharded

    with Client(cluster.scheduler_address) as client:
        with pytest.raises(ValueError, match="not a planned scores artifact"):
            run_sharded(threaded, "stats.policy.policy", client)
        with pytest.raises(ValueError, match="torch_threads 0"):
            run_sharded(threaded, SCORES, client, torch_threads=0)


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
