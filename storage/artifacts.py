"""Content-addressed stage artifacts on a local path or any fsspec URL.

Each stage's output lives at ``{root}/{stage}/{key}/`` where ``key`` is the sha256 of the stage name,
the stage's code version, the canonical JSON of the stage's config and the keys of its upstream
artifacts. A completion marker ``_COMPLETE.json`` holding provenance is written *last*; only an
artifact with a valid marker is served from cache. Batched stages keep per-batch progress in a
``batch_done`` zarr array (one chunk per batch, written after the batch's data), so a killed run
resumes at the first unfinished batch.

Freshness: every marker gets a random ``completion`` id and records the ``upstream_stamps`` (the
completion ids of the upstream artifacts it was computed from). An artifact counts as complete only
while each upstream artifact is still that same completion, so recomputing an upstream artifact makes
everything below it recompute even though the content keys did not change (a recompute need not be
bit-identical, e.g. on a GPU, and a downstream artifact must describe the upstream bytes on disk).

Integrity: before the marker, ``complete`` writes every chunk a zarr array of the artifact lacks
(zarr skips chunks equal to the fill value, which would make a deleted chunk indistinguishable from
zeros) and then ``_MANIFEST.json``: size, crc32c and mtime of every file of the artifact. The marker
records the manifest's own checksum. An artifact whose files disagree with its manifest is damaged
and counts as incomplete: ``damage(ref)`` compares names and sizes, and re-hashes a file only when
its mtime changed (cheap, for every cache hit); ``damage(ref, full=True)`` re-hashes everything
(``covgrad verify``). Zarr stores of a complete artifact opened read-only check every chunk they
read against the manifest and raise ``DamagedArtifactError`` naming the store, array and chunk.

Writers: ``_STARTED.json`` (the claim) exists from ``begin`` until the marker is written, so a claim
without a marker is an interrupted writer, the only state that is resumed. ``lock`` serialises
writers of one artifact across processes on local roots.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import hashlib
import json
import logging
import platform
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import zarr
from fsspec.implementations.local import LocalFileSystem
from pydantic import BaseModel
from zarr.storage import FsspecStore, LocalStore

from storage.integrity import VerifiedStore, crc32c, fill_missing_chunks
from storage.schema import create

MARKER = "_COMPLETE.json"
CLAIM = "_STARTED.json"
MANIFEST = "_MANIFEST.json"
BOOKKEEPING = (MARKER, CLAIM, MANIFEST)
LOCKS = ".locks"
RUNS = "runs"  # the run indexes (storage/runs.py), not a stage

_PROCESS_LOCKS: dict[str, threading.Lock] = {}
_PROCESS_LOCKS_GUARD = threading.Lock()


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    """Log ``message`` as a warning of the ``covgrad`` logger, once per process."""
    if message not in _warned:
        _warned.add(message)
        logging.getLogger("covgrad").warning(message)


def _process_lock(name: str) -> threading.Lock:
    with _PROCESS_LOCKS_GUARD:
        return _PROCESS_LOCKS.setdefault(name, threading.Lock())


def canonical_json(obj: Any) -> str:
    """Deterministic JSON: sorted keys, no whitespace, floats via repr."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


def stage_key(stage: str, version: str, config: Any, upstream: Sequence[str]) -> str:
    """sha256 (hex, 24 characters) of (stage, code version, canonical config JSON, upstream keys)."""
    payload = canonical_json({"stage": stage, "version": version, "config": config, "upstream": list(upstream)})
    return hashlib.sha256(payload.encode()).hexdigest()[:24]


class ArtifactRef(BaseModel):
    """A small, serialisable pointer to one stage artifact (what Prefect tasks return)."""

    stage: str
    key: str
    root: str
    version: str = ""
    upstream: list[str] = []


def join_url(root: str, *parts: str) -> str:
    """``root/part/...`` for a local path or URL root."""
    return "/".join([root.rstrip("/"), *[p.strip("/") for p in parts if p]])


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment() -> dict[str, Any]:
    """Versions and host recorded with every artifact."""
    import torch
    import transformers

    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "zarr": zarr.__version__,
        "numpy": np.__version__,
        "covgrad": _covgrad_version(),
        "git_commit": _git_commit(),
        "host": socket.gethostname(),
        "platform": platform.platform(),
    }


def _covgrad_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("covgrad")
    except PackageNotFoundError:
        return "unknown"


def now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="seconds")


class ArtifactStore:
    """All artifact paths, markers and zarr stores under one root (local path or fsspec URL)."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/") or root
        self.fs, self.base = fsspec.core.url_to_fs(self.root)
        self.local = isinstance(self.fs, LocalFileSystem)
        if self.local:
            self.base = str(Path(self.base).resolve())

    def ref(self, stage: str, key: str, version: str = "", upstream: Sequence[str] = ()) -> ArtifactRef:
        return ArtifactRef(stage=stage, key=key, root=self.root, version=version, upstream=list(upstream))

    def path(self, ref: ArtifactRef, *parts: str) -> str:
        """Filesystem path (in ``self.fs``) of the artifact directory or a file inside it."""
        return "/".join([self.base.rstrip("/"), ref.stage, ref.key, *parts])

    # ----- markers -----------------------------------------------------------------------------
    def marker(self, ref: ArtifactRef) -> dict[str, Any] | None:
        """The completion marker's provenance, or None when the artifact is absent or incomplete."""
        path = self.path(ref, MARKER)
        try:
            with self.fs.open(path, "r") as f:
                data = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError, OSError):
            return None
        if not isinstance(data, dict):
            _warn_once(f"{path} holds {type(data).__name__}, not a completion record: the artifact is incomplete")
            return None
        return data if data.get("key") == ref.key and data.get("stage") == ref.stage else None

    def find_marker(self, key: str) -> dict[str, Any] | None:
        """The valid completion marker of the artifact with content key ``key`` in any stage, or None."""
        if not self.fs.exists(self.base):
            return None
        for stage_dir in self.fs.ls(self.base, detail=False):
            stage = stage_dir.rstrip("/").rsplit("/", 1)[-1]
            if stage.startswith((".", "_")) or stage == RUNS:
                continue
            mark = self.marker(self.ref(stage, key))
            if mark is not None:
                return mark
        return None

    def upstream_stamps(self, keys: Sequence[str]) -> dict[str, str | None]:
        """Current completion id of each upstream artifact key (None where it is absent or incomplete)."""
        return {k: (self.find_marker(k) or {}).get("completion") for k in keys}

    def is_complete(self, ref: ArtifactRef) -> bool:
        """True when the marker is present, the files agree with the manifest (cheap check: names,
        sizes, and checksums of files whose mtime changed) and every upstream artifact is still the
        completion this artifact was computed from."""
        mark = self.marker(ref)
        if mark is None or not isinstance(mark.get("upstream_stamps"), dict):
            return False
        recorded = mark["upstream_stamps"]
        current = self.upstream_stamps(list(recorded))
        return None not in current.values() and current == recorded and not self.damage(ref)

    # ----- integrity ---------------------------------------------------------------------------
    def _files(self, ref: ArtifactRef) -> dict[str, dict[str, Any]]:
        """Every file of the artifact but the bookkeeping ones: path relative to the artifact → fs info."""
        top = self.path(ref)
        if not self.fs.exists(top):
            return {}
        out = {}
        for path, info in self.fs.find(top, detail=True).items():
            rel = path[len(top) :].lstrip("/")
            if rel not in BOOKKEEPING and not rel.startswith(".") and info.get("type", "file") == "file":
                out[rel] = info
        return out

    def _mtime_ns(self, ref: ArtifactRef, rel: str) -> int | None:
        return Path(self.path(ref, rel)).stat().st_mtime_ns if self.local else None

    def write_manifest(self, ref: ArtifactRef) -> dict[str, Any]:
        """Fill every missing zarr chunk, then write ``_MANIFEST.json`` (size, crc32c and mtime of every
        file); returns the summary the marker records (file count, bytes, the manifest's crc32c)."""

        def store_for(array_dir: str) -> LocalStore | FsspecStore:
            if self.local:
                return LocalStore(array_dir)
            return FsspecStore.from_url(self.fs.unstrip_protocol(array_dir))

        fill_missing_chunks(self.fs, self.path(ref), store_for)
        files = {}
        for rel in sorted(self._files(ref)):
            data = self.fs.cat_file(self.path(ref, rel))
            files[rel] = {"size": len(data), "crc32c": crc32c(data), "mtime_ns": self._mtime_ns(ref, rel)}
        text = json.dumps({"algorithm": "crc32c", "files": files}, sort_keys=True)
        self.write_atomic(self.path(ref, MANIFEST), text)
        return {
            "files": len(files),
            "bytes": sum(f["size"] for f in files.values()),
            "crc32c": crc32c(text.encode()),
        }

    def manifest(self, ref: ArtifactRef) -> dict[str, dict[str, Any]] | None:
        """The manifest's files of a complete artifact, or None when the marker, the manifest or its
        checksum (recorded in the marker) is missing or wrong."""
        mark = self.marker(ref)
        summary = (mark or {}).get("manifest")
        if not isinstance(summary, dict):
            return None
        try:
            data = self.fs.cat_file(self.path(ref, MANIFEST))
        except (FileNotFoundError, OSError):
            return None
        if crc32c(data) != summary.get("crc32c"):
            return None
        return json.loads(data)["files"]

    def damage(self, ref: ArtifactRef, full: bool = False) -> list[str]:
        """What is wrong with a complete artifact's files, one ``file: why`` line each ([] when intact
        or when there is no marker). Cheap by default: names and sizes, plus the checksum of any file
        whose mtime changed; ``full`` checks every file's checksum."""
        if self.marker(ref) is None:
            return []
        expected = self.manifest(ref)
        if expected is None:
            return [f"{MANIFEST}: missing, or does not match the checksum in {MARKER}"]
        found = self._files(ref)
        problems = []
        for rel, want in expected.items():
            info = found.get(rel)
            if info is None:
                problems.append(f"{rel}: missing")
                continue
            size = int(info.get("size", -1))
            if size != want["size"]:
                problems.append(f"{rel}: truncated or resized ({size} bytes, expected {want['size']})")
                continue
            touched = want.get("mtime_ns") is not None and self._mtime_ns(ref, rel) != want["mtime_ns"]
            if (full or touched) and crc32c(self.fs.cat_file(self.path(ref, rel))) != want["crc32c"]:
                problems.append(f"{rel}: corrupted (checksum mismatch)")
        problems.extend(f"{rel}: unexpected file" for rel in sorted(set(found) - set(expected)))
        return problems

    def exists(self, ref: ArtifactRef) -> bool:
        return self.fs.exists(self.path(ref))

    def begin(self, ref: ArtifactRef, config: Any, resume: bool) -> dict[str, Any]:
        """Prepare the artifact directory for computing and write the claim (returned, for ``complete``).

        With ``resume`` an interrupted writer's files are kept (minus leftover ``*.partial`` files) when
        its claim was made against the same upstream completions and no marker exists; anything else
        (a finished artifact whose marker was removed, a stale one, another upstream) is cleared.
        Raises ValueError when an upstream artifact is not complete.
        """
        stamps = self.upstream_stamps(ref.upstream)
        missing = [k for k, v in stamps.items() if v is None]
        if missing:
            raise ValueError(
                f"upstream artifact(s) {missing} of {ref.stage} {ref.key} are not complete; compute them first"
            )
        previous = self._read_optional(ref, CLAIM)
        keep = (
            resume
            and previous is not None
            and previous.get("upstream_stamps") == stamps
            and not self.fs.exists(self.path(ref, MARKER))
        )
        if keep:
            self.remove_partials(ref)
        else:
            self.clear(ref)
        self.fs.makedirs(self.path(ref), exist_ok=True)
        claim = {"stage": ref.stage, "key": ref.key, "started": now(), "config": config, "upstream_stamps": stamps}
        self.write_json(ref, CLAIM, claim)
        return claim

    def complete(self, ref: ArtifactRef, claim: dict[str, Any], extra: dict[str, Any] | None = None) -> dict:
        """Write the completion marker (last) with provenance and a fresh completion id, then drop the claim."""
        record = {
            "stage": ref.stage,
            "key": ref.key,
            "version": ref.version,
            "upstream": ref.upstream,
            "upstream_stamps": claim["upstream_stamps"],
            "completion": uuid.uuid4().hex,
            "config": claim["config"],
            "started": claim["started"],
            "finished": now(),
            "environment": environment(),
            **(extra or {}),
            "manifest": self.write_manifest(ref),
        }
        self.write_json(ref, MARKER, record)
        self.fs.rm(self.path(ref, CLAIM))
        return record

    def _read_optional(self, ref: ArtifactRef, name: str) -> dict[str, Any] | None:
        try:
            return self.read_json(ref, name)
        except (FileNotFoundError, json.JSONDecodeError, OSError):
            return None

    # ----- writer lock -------------------------------------------------------------------------
    def _lock_path(self, ref: ArtifactRef) -> Path:
        return Path(self.base) / LOCKS / f"{ref.stage}-{ref.key}.lock"

    @contextmanager
    def lock(self, ref: ArtifactRef) -> Iterator[None]:
        """Hold the exclusive right to write ``ref``, waiting for another holder to finish.

        Local roots: an advisory ``flock`` on ``{root}/.locks/{stage}-{key}.lock``, exclusive across
        processes and threads and released by the kernel when its holder dies, so a killed run never
        leaves it held. Other filesystems: a lock within this process only (``memory://`` is
        process-local; object stores offer no exclusive create, so there Prefect's lock is the guard).
        """
        if not self.local:
            with _process_lock(join_url(self.root, ref.stage, ref.key)):
                yield
            return
        path = self._lock_path(ref)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)

    def busy(self, ref: ArtifactRef) -> bool:
        """True while some writer holds ``lock(ref)`` (for other filesystems: within this process)."""
        if not self.local:
            return _process_lock(join_url(self.root, ref.stage, ref.key)).locked()
        path = self._lock_path(ref)
        if not path.exists():
            return False
        with open(path, "a") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return False

    def clear(self, ref: ArtifactRef) -> None:
        if self.exists(ref):
            self.fs.rm(self.path(ref), recursive=True)

    def clear_if_idle(self, ref: ArtifactRef) -> bool:
        """Delete the artifact unless a writer holds ``lock(ref)``, holding the lock while deleting so no
        writer starts meanwhile; returns whether it was deleted."""
        if not self.local:
            held = _process_lock(join_url(self.root, ref.stage, ref.key))
            if not held.acquire(blocking=False):
                return False
            try:
                self.clear(ref)
            finally:
                held.release()
            return True
        path = self._lock_path(ref)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            try:
                self.clear(ref)
            finally:
                fcntl.flock(f.fileno(), fcntl.LOCK_UN)
        return True

    def remove_partials(self, ref: ArtifactRef) -> int:
        """Delete temporary files a killed writer may have left (``*.partial``); returns how many."""
        leftovers = [p for p in self.fs.find(self.path(ref)) if ".partial" in p.rsplit("/", 1)[-1]]
        for p in leftovers:
            self.fs.rm(p)
        return len(leftovers)

    # ----- files -------------------------------------------------------------------------------
    def write_json(self, ref: ArtifactRef, name: str, obj: Any) -> None:
        """Write JSON atomically on local disks (temp file + rename); object stores put whole objects."""
        target = self.path(ref, name)
        self.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
        self.write_atomic(target, json.dumps(obj, indent=1, sort_keys=True, default=str))

    def write_atomic(self, target: str, text: str) -> None:
        """Write ``text`` to ``target`` atomically on local disks (temp file + rename); object stores put
        whole objects. An OSError that names no file (e.g. a full disk during the write) is raised again
        naming ``target``."""
        try:
            if self.local:
                tmp = Path(target + ".partial")
                tmp.write_text(text)
                tmp.replace(target)
            else:
                self.fs.pipe_file(target, text.encode())
        except OSError as exc:
            if exc.filename is not None or exc.errno is None:
                raise
            raise OSError(exc.errno, exc.strerror, target) from exc

    def read_json(self, ref: ArtifactRef, name: str) -> Any:
        with self.fs.open(self.path(ref, name), "r") as f:
            return json.load(f)

    def write_text(self, ref: ArtifactRef, name: str, text: str) -> None:
        self.fs.pipe_file(self.path(ref, name), text.encode())

    def zarr_store(
        self, ref: ArtifactRef, name: str, read_only: bool = False
    ) -> LocalStore | FsspecStore | VerifiedStore:
        """A zarr v3 store for ``{artifact}/{name}``; read-only stores of a complete artifact check each
        object they read against the manifest (``DamagedArtifactError`` naming store, array, chunk)."""
        if self.local:
            store: LocalStore | FsspecStore = LocalStore(self.path(ref, name), read_only=read_only)
        else:
            store = FsspecStore.from_url(join_url(self.root, ref.stage, ref.key, name), read_only=read_only)
        files = self.manifest(ref) if read_only else None
        if files is None:
            return store
        prefix = name.strip("/") + "/"
        expected = {r[len(prefix) :]: (f["size"], f["crc32c"]) for r, f in files.items() if r.startswith(prefix)}
        return VerifiedStore(store, expected, f"{ref.stage}/{ref.key}", name)

    def open_group(self, ref: ArtifactRef, name: str, mode: str = "r") -> zarr.Group:
        return zarr.open_group(self.zarr_store(ref, name, read_only=mode == "r"), mode=mode)

    def consolidate(self, ref: ArtifactRef, name: str) -> None:
        """Consolidate a zarr group's metadata once, as the last write of a stage."""
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            zarr.consolidate_metadata(self.zarr_store(ref, name))

    @contextmanager
    def local_dir(self, ref: ArtifactRef, name: str, write: bool) -> Iterator[Path]:
        """A local directory for ``{artifact}/{name}`` (for libraries that need real paths, e.g.
        ``save_pretrained``). On remote roots it is a temporary copy, uploaded afterwards when ``write``."""
        if self.local:
            path = Path(self.path(ref, name))
            if write:
                path.mkdir(parents=True, exist_ok=True)
            yield path
            return
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            local = Path(tmp) / name
            if write:
                local.mkdir(parents=True)
            else:
                self.fs.get(self.path(ref, name), str(local), recursive=True)
            yield local
            if write:
                self.fs.put(str(local), self.path(ref, name), recursive=True)

    # ----- listing -----------------------------------------------------------------------------
    def list_artifacts(self) -> list[dict[str, Any]]:
        """Every artifact under the root: stage, key, complete (marker present), damaged (its files
        disagree with the manifest: the cheap check), bytes, created, short config."""
        rows = []
        if not self.fs.exists(self.base):
            return rows
        for stage_dir in sorted(self.fs.ls(self.base, detail=False)):
            stage = stage_dir.rstrip("/").rsplit("/", 1)[-1]
            if stage.startswith((".", "_")) or stage == RUNS or not self.fs.isdir(stage_dir):
                continue
            for key_dir in sorted(self.fs.ls(stage_dir, detail=False)):
                key = key_dir.rstrip("/").rsplit("/", 1)[-1]
                if not self.fs.isdir(key_dir):
                    continue
                ref = self.ref(stage, key)
                mark = self.marker(ref)
                size = sum(self.fs.du(key_dir, total=False).values()) if self.fs.isdir(key_dir) else 0
                rows.append(
                    {
                        "stage": stage,
                        "key": key,
                        "complete": mark is not None,
                        "damaged": mark is not None and bool(self.damage(ref)),
                        "bytes": int(size),
                        "created": (mark or {}).get("finished", ""),
                        "upstream": (mark or {}).get("upstream", []),
                        "config": canonical_json((mark or {}).get("config", ""))[:80],
                    }
                )
        return rows


# ----- batch progress (resumable batched stages) ----------------------------------------------------
def create_progress(group: zarr.Group, store: str, n_batches: int) -> zarr.Array:
    """The ``batch_done(batch)`` uint8 array of store ``store`` (``storage.schema.PROGRESS``): one chunk
    per batch, so concurrent marks never collide."""
    if "batch_done" in group:
        arr = group["batch_done"]
        if arr.shape != (n_batches,):
            raise ValueError(f"existing progress has {arr.shape[0]} batches, expected {n_batches}; clear the artifact")
        return arr
    return create(group, store, "batch_done", (n_batches,))


def pending_batches(group: zarr.Group) -> list[int]:
    """Indices of batches not yet marked done."""
    done = group["batch_done"][:]
    return [int(b) for b in np.flatnonzero(done == 0)]


def mark_batch_done(group: zarr.Group, b: int) -> None:
    """Mark batch ``b`` done; call only after all of its data is written."""
    group["batch_done"][b] = 1
