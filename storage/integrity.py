"""Integrity of finished artifacts: complete zarr chunk grids, checksums, and reads that check them.

- ``fill_missing_chunks`` writes every chunk a zarr array lacks (zarr does not write a chunk that
  equals the fill value), so after it a missing chunk file is damage, never "all fill values".
- ``crc32c`` is the checksum of the manifest (``storage.artifacts``).
- ``VerifiedStore`` wraps the zarr store of a complete artifact: every key it reads that the manifest
  lists must exist and, when read whole, match the manifest's size and crc32c; otherwise it raises
  ``DamagedArtifactError`` in one line naming the artifact, the store, the array and the chunk.
- ``name_full_disk`` names the artifact being written in a full-disk error the system raised without a
  file name (zarr's chunk writes in dask or writer threads), so the user's one line says where.
"""

from __future__ import annotations

import errno
import itertools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import fsspec
import google_crc32c
import zarr
from zarr.abc.store import ByteRequest
from zarr.core.buffer import Buffer, BufferPrototype
from zarr.storage import WrapperStore


class DamagedArtifactError(ValueError):
    """A complete artifact's file is missing, truncated or corrupted (an expected failure: rerun to
    recompute it, or ``covgrad verify`` to list all damage)."""


_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@contextmanager
def name_full_disk(where: str) -> Iterator[None]:
    """Re-raise a full-disk OSError (ENOSPC, EDQUOT, EFBIG) that names no file as one naming ``where``."""
    try:
        yield
    except OSError as exc:
        if exc.filename is not None or exc.errno not in _FULL:
            raise
        raise OSError(exc.errno, exc.strerror, where) from exc


def crc32c(data: bytes) -> str:
    """crc32c of ``data`` as 8 hex digits."""
    return f"{google_crc32c.value(data):08x}"


def describe_key(store_name: str, key: str) -> str:
    """``store 'scores.zarr' array 'mean_s' chunk c/1/0`` for a zarr key inside ``store_name``."""
    parts = key.split("/")
    if "c" in parts:  # default chunk keys: {array}/c/{i}/{j}..., the array's own name never ends the path
        i = len(parts) - 1 - parts[::-1].index("c")
        return f"store {store_name!r} array {'/'.join(parts[:i]) or '/'!r} chunk {'/'.join(parts[i:])}"
    node = key.rsplit("/", 1)[0] if "/" in key else "/"
    return f"store {store_name!r} metadata of {node!r} ({key})"


class VerifiedStore(WrapperStore):
    """A read-only zarr store that checks what it reads against a manifest.

    ``expected`` maps store keys to (size in bytes, crc32c hex). Whole-object reads are checked for
    size and checksum; byte-range reads (inner chunks of a shard) for existence.
    """

    def __init__(self, store: Any, expected: dict[str, tuple[int, str]], label: str, store_name: str) -> None:
        super().__init__(store)
        self._expected = expected
        self._label = label
        self._store_name = store_name

    def _with_store(self, store: Any) -> VerifiedStore:
        return type(self)(store, self._expected, self._label, self._store_name)

    def _damaged(self, key: str, what: str) -> DamagedArtifactError:
        return DamagedArtifactError(
            f"damaged artifact {self._label}: {describe_key(self._store_name, key)} is {what}; "
            "rerun to recompute it (covgrad verify lists all damage)"
        )

    def _check(self, key: str, buf: Buffer | None, whole: bool) -> None:
        entry = self._expected.get(key)
        if entry is None:
            return
        if buf is None:
            raise self._damaged(key, "missing")
        if not whole:
            return
        data = buf.to_bytes()
        if len(data) != entry[0]:
            raise self._damaged(key, f"truncated or resized ({len(data)} bytes, expected {entry[0]})")
        if crc32c(data) != entry[1]:
            raise self._damaged(key, "corrupted (checksum mismatch)")

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        buf = await self._store.get(key, prototype, byte_range)
        self._check(key, buf, byte_range is None)
        return buf

    async def get_partial_values(self, prototype: BufferPrototype, key_ranges: Any) -> list[Buffer | None]:
        key_ranges = list(key_ranges)
        bufs = await self._store.get_partial_values(prototype, key_ranges)
        for (key, byte_range), buf in zip(key_ranges, bufs, strict=True):
            self._check(key, buf, byte_range is None)
        return bufs


def fill_missing_chunks(fs: fsspec.AbstractFileSystem, directory: str, url_for: Any) -> int:
    """Write the fill value into every chunk that a zarr v3 array under ``directory`` lacks.

    Args:
        fs: the filesystem holding ``directory``.
        directory: an artifact directory (in ``fs``); every ``zarr.json`` of node type array below it
            is visited.
        url_for: maps an array directory (in ``fs``) to a zarr store for it.

    Returns:
        The number of chunks written.
    """
    files = set(fs.find(directory))
    written = 0
    for meta_path in sorted(p for p in files if p.rsplit("/", 1)[-1] == "zarr.json"):
        meta = json.loads(fs.cat_file(meta_path))
        if meta.get("node_type") != "array":
            continue
        array_dir = meta_path.rsplit("/", 1)[0]
        with zarr.config.set({"array.write_empty_chunks": True}):  # read when the array is opened
            arr = zarr.open_array(url_for(array_dir), mode="r+")
        shape = arr.shape
        grid = arr.metadata.chunk_grid.chunk_shape  # the stored objects: shards when sharded
        counts = [-(-n // c) for n, c in zip(shape, grid, strict=True)]
        for coords in itertools.product(*(range(n) for n in counts)):
            key = arr.metadata.encode_chunk_key(coords)
            if f"{array_dir}/{key}" in files:
                continue
            region = tuple(slice(i * c, min((i + 1) * c, n)) for i, c, n in zip(coords, grid, shape, strict=True))
            arr[region] = arr.metadata.fill_value
            written += 1
    return written
