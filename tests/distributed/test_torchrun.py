"""The scores stage on a torchrun group (scores.launcher: torchrun; covgrad.distributed.launch.launch_ranks, the
ranks running ``tasks.jobs.rank_main``): the real torchrun (``python -m torch.distributed.run``) and real gloo ranks,
no mocks.

Two "machines" on this host (two torchrun processes of one rank each, meeting at a c10d rendezvous on 127.0.0.1)
give the in-process arrays, node 1 only folding; a rank that raises is named in one line; the config refuses
torchrun settings that cannot run, in one line. A SIGKILLed torchrun rank (the rerun resuming the group to the
in-process arrays) is tests/distributed/test_fsdp_stage.py's, parametrized over the launcher."""

import shutil
from pathlib import Path

import pytest
from pydantic import ValidationError

from covgrad.config import ScoresSection
from covgrad.distributed.launch import Placement, RankFailedError, Torchrun, launch_ranks
from storage.artifacts import ArtifactStore
from tasks.jobs.scores_ranks import RANK_ENTRY
from tasks.scores import scores_task
from tasks.specs import plan
from tests.helpers.fsdp_ranks import SCORES, run_two_machines
from tests.helpers.fsdp_ranks import assert_same_arrays as _assert_same_arrays
from tests.helpers.fsdp_ranks import scores_arrays as _arrays
from tests.helpers.pipeline import NO_OPTIONAL, tiny_config
from tests.helpers.ports import free_port


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """One thread per rank (torchrun sets it only for several ranks per machine): the machine is small."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.mark.parametrize(
    ("scores", "message"),
    [
        ({"launcher": "torchrun", "ranks": 0}, "greater than or equal to 1"),
        ({"launcher": "torchrun", "nnodes": 2, "ranks": 2}, "scores.nnodes=2 without scores.rdzv_endpoint"),
        (
            {"launcher": "torchrun", "nnodes": 2, "ranks": 2, "node_rank": 2, "rdzv_endpoint": "h:29400"},
            r"scores.node_rank=2 is not in \[0, 2\)",
        ),
        ({"launcher": "torchrun", "node_rank": 1}, r"scores.node_rank=1 is not in \[0, 1\)"),
        (
            {"launcher": "torchrun", "nnodes": 2, "ranks": 3, "rdzv_endpoint": "h:29400"},
            "scores.ranks=3 .* does not split evenly over scores.nnodes=2",
        ),
        ({"launcher": "torchrun", "rdzv_endpoint": "h"}, "scores.rdzv_endpoint=h is not HOST:PORT"),
        ({"launcher": "torchrun", "rdzv_endpoint": "h:99999"}, "scores.rdzv_endpoint=h:99999 is not HOST:PORT"),
        (
            {"launcher": "torchrun", "rdzv_endpoint": "tcp://h:1"},
            "scores.rdzv_endpoint=tcp://h:1 is not HOST:PORT",
        ),
        ({"launcher": "local", "ranks": 2, "nnodes": 2}, "scores.nnodes=2 with scores.launcher=local"),
        ({"rdzv_endpoint": "h:1"}, "scores.rdzv_endpoint=h:1 with scores.launcher=auto"),
        ({"launcher": "torchrun", "shards": [1, 2]}, r"scores.shards=\[1, 2\]"),
    ],
)
def test_torchrun_settings_that_cannot_run_are_refused_in_one_line(scores, message):
    with pytest.raises(ValidationError, match=message) as info:
        ScoresSection(**scores)
    assert "\n" not in info.value.errors()[0]["msg"]


def test_torchrun_options():
    """One machine: --standalone (a free port); several: c10d at node 0's endpoint, node 0 hosting its store."""
    ScoresSection(launcher="torchrun", ranks=4, nnodes=2, node_rank=1, rdzv_endpoint="10.0.0.1:29400")
    one = Torchrun(2).argv()
    assert one == ["--nproc-per-node", "2", "--nnodes", "1", "--max-restarts", "0", "--standalone"]
    two = Torchrun(2, nnodes=2, node_rank=1, endpoint="10.0.0.1:29400", run_id="r").argv()
    assert two[:6] == ["--nproc-per-node", "2", "--nnodes", "2", "--max-restarts", "0"]
    assert two[6:12] == ["--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29400", "--rdzv-id", "r"]
    assert two[12] == "--rdzv-conf" and two[13].startswith("is_host=0,")
    assert Torchrun(2, 2, 0, "h:1").argv()[13].startswith("is_host=1,")
    with pytest.raises(ValueError, match="need a rendezvous endpoint"):
        Torchrun(1, nnodes=2)


def test_a_placement_names_its_group():
    """A torchrun placement builds (and checks) this machine's torchrun group, ranks / nnodes per machine; a local
    placement has none; a placement of no rank group is refused."""
    placed = Placement("torchrun", 4, nnodes=2, node_rank=1, rdzv_endpoint="h:1", run_id="r", backend="nccl")
    assert placed.torchrun == Torchrun(2, nnodes=2, node_rank=1, endpoint="h:1", run_id="r", backend="nccl")
    assert Placement("local", 3).torchrun is None
    with pytest.raises(ValueError, match="need a rendezvous endpoint"):
        Placement("torchrun", 2, nnodes=2)
    with pytest.raises(ValueError, match="starts no rank group"):
        Placement("in-process", 1)  # type: ignore[arg-type]


def _copy(tiny_run, tmp_path: Path) -> Path:
    shutil.copytree(tiny_run[0], tmp_path / "root", ignore=shutil.ignore_patterns("scores", "stats", "masks"))
    return tmp_path / "root"


@pytest.mark.slow
def test_two_machines_give_the_in_process_arrays_and_node_1_only_folds(tiny_run, tmp_path: Path):
    """Two "machines" on this host: the scores task of node 1 and of node 0 (scores.nnodes=2, one rank each, a
    c10d rendezvous on 127.0.0.1) against one store root. Node 1 alone creates nothing (it waits at the
    rendezvous); node 0 prepares, folds with it and completes the artifact; node 1 returns once it is complete.
    The artifact has the in-process key and arrays."""
    root = _copy(tiny_run, tmp_path)
    endpoint = f"127.0.0.1:{free_port()}"
    common = {"scores.ranks": 2, "scores.launcher": "torchrun", "scores.nnodes": 2, "scores.rdzv_endpoint": endpoint}
    node0, node1 = (
        plan(tiny_config(str(root), **NO_OPTIONAL, **common, **{"scores.node_rank": i}))[SCORES] for i in (0, 1)
    )
    assert node0.ref.key == node1.ref.key == tiny_run[1][SCORES].ref.key
    store = ArtifactStore(str(root))
    run_two_machines(scores_task.fn, node0, node1, store)
    _assert_same_arrays(_arrays(ArtifactStore(str(tiny_run[0])), tiny_run[1][SCORES].ref), _arrays(store, node0.ref))


def _raises() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("bad input on this rank")
    dist.barrier()


@pytest.mark.slow
def test_a_torchrun_rank_that_raises_is_named_in_one_line(tmp_path: Path):
    with pytest.raises(RankFailedError) as info:
        launch_ranks(Placement("torchrun", 2), _raises, (), tmp_path, RANK_ENTRY)
    assert str(info.value) == "rank 1 of 2 (torchrun) failed: ValueError: bad input on this rank"
