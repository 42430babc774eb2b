"""What every stage task shares: the artifact cache policy, the run-or-reuse protocol, progress.

A stage task receives the ``ArtifactRef`` the flow planned for it, its spec (``tasks.specs``; the
ref's key is the spec's key, checked here) and its upstream refs, and returns a ``StageResult``. Two
layers keep reruns cheap and correct:

1. Prefect's cache, keyed by the artifact key (``ArtifactCache``), with persisted results next to the
   artifacts and SERIALIZABLE isolation under a file-system lock, so two concurrent runs of the same
   stage compute it once. The flow asks Prefect to refresh the cache whenever the artifact on disk is
   not complete, because Prefect alone would hand back a reference to a deleted artifact.
2. ``run_stage`` itself: a complete artifact (marker present, files matching its manifest, upstream
   unchanged since) is returned at once; a damaged one is reported in one warning line and recomputed.
   Otherwise it takes the artifact's writer lock (``ArtifactStore.lock``), checks again (a
   concurrent run may have finished it meanwhile), resumes an interrupted writer's batches or clears
   the directory, computes, and writes the marker last. The sharded scores flow (``flows/shards.py``)
   runs its jobs through the same function.

Prefect never expires its file-system locks, so a run killed inside a stage would leave one that makes
every later run wait forever. ``cache_options`` removes such a leftover: a Prefect lock on an artifact
that is incomplete and whose writer lock nobody holds belongs to a dead run.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect.cache_policies import CachePolicy
from prefect.context import TaskRunContext
from prefect.exceptions import MissingContextError
from prefect.locking.filesystem import FileSystemLockManager
from prefect.locking.memory import MemoryLockManager
from prefect.logging import get_run_logger
from prefect.transactions import IsolationLevel
from pydantic import BaseModel

from covgrad.devices import PeakRSS, release_free_memory
from covgrad.progress import Progress
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.integrity import name_full_disk
from tasks.specs import StageSpec


class _StageLog:
    """Logs to the Prefect run logger inside a flow or task run (shown in the terminal and the UI),
    else to the ``covgrad`` logger."""

    @staticmethod
    def _logger() -> Any:
        try:
            return get_run_logger()
        except MissingContextError:
            return logging.getLogger("covgrad")

    def info(self, msg: str, *args: Any) -> None:
        self._logger().info(msg, *args)

    def warning(self, msg: str, *args: Any) -> None:
        self._logger().warning(msg, *args)


log = _StageLog()


class StageResult(BaseModel):
    """A stage task's return value: where the artifact is, whether this call computed it and, if so, in
    how many seconds and at what peak resident memory (bytes), for the flow's one line per stage."""

    ref: ArtifactRef
    computed: bool
    seconds: float = 0.0
    peak_rss_bytes: int = 0


@dataclass
class ArtifactCache(CachePolicy):
    """Prefect cache key = the artifact's stage and content key (the task's ``ref`` argument)."""

    def compute_key(
        self, task_ctx: TaskRunContext, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any
    ) -> str | None:
        ref = inputs.get("ref")
        if not isinstance(ref, ArtifactRef):
            return None
        return cache_key(ref)


def cache_key(ref: ArtifactRef) -> str:
    """The Prefect cache (and lock) key of one artifact."""
    return f"covgrad-{ref.stage}-{ref.key}"


def prefect_state_dir(base: Path) -> Path:
    """Where Prefect's lock files and persisted results of the local root ``base`` go: the root itself
    when this process may write it, else ``$COVGRAD_STATE_DIR`` or ``~/.cache/covgrad/{sha256 of the
    root's path, 16 hex}``, so a read-only root whose artifacts are complete can still be read."""
    if os.access(base, os.W_OK):
        return base
    explicit = os.environ.get("COVGRAD_STATE_DIR")
    if explicit:
        return Path(explicit)
    return Path.home() / ".cache" / "covgrad" / hashlib.sha256(str(base).encode()).hexdigest()[:16]


def cache_options(store: ArtifactStore, ref: ArtifactRef) -> dict[str, Any]:
    """``task.with_options(**...)`` for one planned artifact: cache policy with locking, result storage
    beside the artifacts on local roots (``prefect_state_dir`` when the root is read-only), and a forced
    refresh when the artifact is not complete."""
    complete = store.is_complete(ref)
    if store.local:
        base = Path(store.base)
        base.mkdir(parents=True, exist_ok=True)
        state = prefect_state_dir(base)
        locks = state / ".prefect-locks"
        if not complete and not store.busy(ref):
            (locks / f"{cache_key(ref)}.lock").unlink(missing_ok=True)
        lock_manager: Any = FileSystemLockManager(lock_files_directory=locks)
        storage: dict[str, Any] = {"result_storage": state / ".prefect-results"}
    else:
        lock_manager, storage = MemoryLockManager(), {}
    policy = ArtifactCache().configure(isolation_level=IsolationLevel.SERIALIZABLE, lock_manager=lock_manager)
    return {"cache_policy": policy, "persist_result": True, "refresh_cache": not complete, **storage}


def check_spec(ref: ArtifactRef, spec: StageSpec) -> None:
    """ValueError unless ``ref`` is the artifact of ``spec`` (its stage, and its key = the spec's key over
    the ref's upstream keys): a task computes exactly what its key says."""
    if ref.stage != spec.STAGE or ref.key != spec.key(ref.upstream):
        raise ValueError(f"{ref.stage} {ref.key} is not the artifact of this {spec.STAGE} spec; plan it (tasks.specs)")


def run_stage(
    ref: ArtifactRef,
    spec: StageSpec,
    compute: Callable[[ArtifactStore, ArtifactRef], dict[str, Any] | None],
    resumable: bool = False,
) -> StageResult:
    """Return the complete artifact at ``ref`` (the artifact of ``spec``), computing it first when needed.

    ``compute(store, ref)`` writes the artifact's files and may return extra provenance; the completion
    marker records the spec. On failure nothing is marked complete; a batched (``resumable``) stage keeps
    its finished batches.
    """
    check_spec(ref, spec)
    store = ArtifactStore(ref.root)
    problems = store.damage(ref)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        log.warning(
            "%s %s: damaged, %s%s; recomputing it and everything below it", ref.stage, ref.key, problems[0], more
        )
    if store.is_complete(ref):
        log.info("%s %s: cache hit", ref.stage, ref.key)
        return StageResult(ref=ref, computed=False)
    with store.lock(ref):
        if store.is_complete(ref):
            log.info("%s %s: computed meanwhile by another run", ref.stage, ref.key)
            return StageResult(ref=ref, computed=False)
        t0 = time.perf_counter()
        claim = store.begin(ref, spec.model_dump(mode="json"), resume=resumable)
        release_free_memory()  # pages earlier stages freed but the C heap kept: this stage's peak is its own
        with PeakRSS() as rss, name_full_disk(store.path(ref)):
            extra = compute(store, ref) or {}
        timing = {"seconds": round(time.perf_counter() - t0, 3), "peak_rss_bytes": rss.peak}
        store.complete(ref, claim, {**timing, **extra})
    seconds = time.perf_counter() - t0
    log.info("%s %s: computed in %.1f s, peak resident memory %.2f GiB", ref.stage, ref.key, seconds, rss.peak / 2**30)
    return StageResult(ref=ref, computed=True, seconds=seconds, peak_rss_bytes=rss.peak)


def progress_bar(stage: str, total: int, unit: str = "batch") -> Progress:
    """The :class:`covgrad.progress.Progress` of a long loop, reporting to the stage log (and to stderr when it
    is not a terminal) every ``$COVGRAD_PROGRESS_SECONDS`` seconds (default 30)."""
    every = float(os.environ.get("COVGRAD_PROGRESS_SECONDS", "30"))
    return Progress(stage, total, unit, every, lambda text: log.info("%s", text))
