"""A scores job for launched ranks that records where each rank resumed and can SIGKILL one rank right after a
checkpoint that every rank holds (the seams are patched inside the rank process, which imports this module when it
unpickles it)."""

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch.distributed as dist
import zarr

from storage.artifacts import ArtifactStore

SCORES = "scores.policy.policy"  # the tiny pipeline's analysed scores artifact


def recording_job(root: str, ref, spec, up, log: str, kill: tuple[int, int] | None):
    """``tasks.scores.ScoresJob`` of the artifact; in a rank, ``restore_rank`` appends "rank count" to ``log``, and
    with ``kill`` = (rank, c) that rank SIGKILLs itself once every rank has written its checkpoint of c batches (it
    joins the barrier that follows the other ranks' saves first, so whether the others' writes finish before the
    parent terminates them is not a race)."""
    from storage.artifacts import ArtifactStore
    from tasks.jobs import scores_ranks
    from tasks.scores import ScoresJob

    if dist.is_initialized():
        rank = dist.get_rank()
        save, restore = scores_ranks.RankStore.save, scores_ranks.restore_rank

        def killing_save(self, g, i, c, acc):
            save(self, g, i, c, acc)
            if kill == (rank, c):
                dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)

        def recorded_restore(store, g, i, acc):
            c = restore(store, g, i, acc)
            with Path(log).open("a") as f:
                f.write(f"{rank} {c}\n")
            return c

        scores_ranks.RankStore.save = killing_save
        scores_ranks.restore_rank = recorded_restore
    return ScoresJob(ArtifactStore(root), ref, spec, up)


def scores_arrays(store: ArtifactStore, ref) -> dict[str, np.ndarray]:
    """Every array of a scores artifact's store, by path."""
    g = store.open_group(ref, "scores.zarr", mode="r")
    return {name: a[:] for name, a in g.members(max_depth=None) if isinstance(a, zarr.Array)}


def assert_same_arrays(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    """The same array names, each with the same dtype and bytes."""
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), name


def run_two_machines(task: Callable, node0: Any, node1: Any, store: ArtifactStore) -> None:
    """Two "machines" of one torchrun group on this host: ``task`` (a stage task's body) of planned step ``node1``
    started first in a thread, which must wait at the rendezvous without creating the artifact, then of
    ``node0`` here; both must compute, and node 1 return only once node 0 has completed the artifact."""
    out: dict[str, Any] = {}

    def second_machine() -> None:
        try:
            out["result"] = task(node1.ref, node1.spec, node1.upstream)
            out["complete"] = store.is_complete(node1.ref)
        except BaseException as exc:  # reported in the test's thread
            out["error"] = exc

    thread = threading.Thread(target=second_machine)
    thread.start()
    thread.join(8.0)  # node 1's torchrun waits at the rendezvous
    assert thread.is_alive() and not Path(store.path(node1.ref)).exists()
    first = task(node0.ref, node0.spec, node0.upstream)
    thread.join(120.0)
    assert not thread.is_alive() and "error" not in out, out.get("error")
    assert first.computed and out["result"].computed and out["complete"]


def killing_trajectory_rank(root: str, ref, spec, up, log: str, kill: tuple[int, int] | None) -> None:
    """``tasks.jobs.trajectory_ranks.trajectory_rank`` that appends "rank step" to ``log`` where a rank resumes and,
    with ``kill`` = (rank, t), SIGKILLs that rank once every rank holds its state of step t (after the barrier
    that follows the ranks' state writes)."""
    from tasks.jobs import trajectory_ranks

    rank = dist.get_rank()
    drop, resume = trajectory_ranks.drop_older_states, trajectory_ranks._resume_step

    def killing_drop(store, ref_, step, r):
        if kill == (rank, step):
            os.kill(os.getpid(), signal.SIGKILL)
        drop(store, ref_, step, r)

    def recorded_resume(store, ref_):
        step = resume(store, ref_)
        with Path(log).open("a") as f:
            f.write(f"{rank} {step}\n")
        return step

    trajectory_ranks.drop_older_states = killing_drop
    trajectory_ranks._resume_step = recorded_resume
    trajectory_ranks.trajectory_rank(root, ref, spec, up)
