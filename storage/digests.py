"""Content digests of the files and directories a stage reads, so an input changed in place changes its keys.

A digest is sha256 over the bytes (a directory: over its files' relative names and digests, in name order).
Hashing multi-GB weights on every run would be slow, so each file's digest is cached under
``$COVGRAD_CACHE_DIR`` (default ``~/.cache/covgrad``) by (real path, size, inode, mtime_ns, ctime_ns): any write
to a file changes its ctime, and restoring the mtime with ``touch``/``os.utime`` changes it again, so a changed
byte is never served from the cache. Costs: one read of every byte the first time (about 1 s per GB), a
``stat`` per file afterwards.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path

_BLOCK = 1 << 24  # bytes read at a time: 16 MiB
# The files of a model directory that loading reads: config, weights, tokenizer, chat template, remote code.
MODEL_FILES = frozenset({".json", ".safetensors", ".bin", ".model", ".txt", ".py", ".jinja"})
_lock = threading.Lock()


def _cache_file() -> Path:
    return Path(os.environ.get("COVGRAD_CACHE_DIR", Path.home() / ".cache" / "covgrad")) / "digests.json"


def _load_cache(path: Path) -> dict[str, str]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_ino}|{st.st_mtime_ns}|{st.st_ctime_ns}"


def _hash_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def file_digest(path: str | os.PathLike, cache: dict[str, str] | None = None) -> str:
    """sha256 (hex) of the file's bytes, from ``cache`` (stat key → digest) when the file is unchanged."""
    p = Path(path)
    key = _stat_key(p)
    if cache is not None and key in cache:
        return cache[key]
    digest = _hash_file(p)
    if cache is not None:
        cache[key] = digest
    return digest


def content_digest(path: str | os.PathLike, suffixes: frozenset[str] | None = None) -> str:
    """The 24-hex-digit content digest of a file, or of every file under a directory (names and bytes;
    with ``suffixes``, only the directory's own files with those suffixes); FileNotFoundError naming
    ``path`` when it does not exist."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"no such file or directory: {path}")
    with _lock:
        cache_path = _cache_file()
        cache = _load_cache(cache_path)
        size = len(cache)
        if p.is_dir():
            h = hashlib.sha256()
            found = p.rglob("*") if suffixes is None else (q for q in p.iterdir() if q.suffix in suffixes)
            for f in sorted(q for q in found if q.is_file() and not q.name.startswith(".")):
                h.update(f"{f.relative_to(p).as_posix()}\0{file_digest(f, cache)}\n".encode())
            digest = h.hexdigest()
        else:
            digest = file_digest(p, cache)
        if len(cache) != size:
            _save_cache(cache_path, cache)
    return digest[:24]


def _save_cache(path: Path, cache: dict[str, str]) -> None:
    """Write the cache atomically; a cache that cannot be written only costs a re-hash next time."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.partial")
        tmp.write_text(json.dumps(cache, sort_keys=True))
        tmp.replace(path)
    except OSError:
        return


def input_digest(path_or_url: str, model: bool = False) -> str:
    """The digest a stage's key records for an input: :func:`content_digest` of a local file or (``model``)
    of a model directory's :data:`MODEL_FILES`; for a remote URL, fsspec's checksum of its listing (ETag,
    size, modification time); ``"absent"`` when there is nothing at the path (preflight names it). A local
    ``<path>#<name>`` that does not exist as a whole (a run chosen inside an MLflow or trackio store) is the
    digest of ``<path>`` and the name."""
    if "://" in path_or_url and not path_or_url.startswith("file://"):
        import fsspec

        fs, inner = fsspec.core.url_to_fs(path_or_url)
        return f"{fs.checksum(inner):x}" if fs.exists(inner) else "absent"
    local = path_or_url.removeprefix("file://")
    if not Path(local).exists():
        base, sep, name = local.rpartition("#")
        if sep and Path(base).exists():
            return f"{content_digest(base, MODEL_FILES if model else None)}#{name}"
        return "absent"
    return content_digest(local, MODEL_FILES if model else None)
