"""A fold's statistics read off its moment state a column block at a time (:mod:`covgrad.integrations.inrun`): the
blocks, the step's scalars merged over them, and the step's (P,) vectors filled block by block and streamed into
its ``.npz``, so that the host holds one block's statistics, the top sets' candidates and the kept vectors, never
the whole (H, P) state or a dozen (P,) vectors.

Every (P,) statistic of :func:`covgrad.moments.stats.compute_stats` (and of a regime fold) is computed column by
column from the columns' moments and the per-half scalars (counts, mean and Σ(a − ā)² of the advantages), so a
block's statistics are the whole array's at its columns, bit for bit; the scalars N, mean_A, std_A (and a regime's
a²) depend on the per-half scalars alone, ``bound_violations`` is a count (summed over blocks) and ``rho_undefined``
holds when it holds in every block. ``zero_mean_trace`` and ``zero_mean_coord`` (sums over the whole axis, whose
rounding would depend on the blocks) are not statistics of an in-run step.

Files: the written vectors go to ``.npy`` files in a temporary folder inside the output folder (the header of
:func:`numpy.lib.format.open_memmap`, then each block written at its offset: page cache, not the process's memory),
then into the step's npz, member by member, with ``zipfile`` as :func:`numpy.savez` writes it (ZIP_STORED, zip64,
the same ``.npy`` bytes per member); the npz is moved into place whole. A kept vector that is written comes back as
a read-only view of its npz member (:func:`npz_view`), so it costs page cache, not memory.

Shape notation: P columns (selected parameter elements, or a rank's share), b columns in a block.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
import zipfile
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import numpy as np

BLOCK = 1 << 18  # columns per block: a block's statistics take ~300 B per column on the host (~80 MB)
SCALARS = ("N", "mean_A", "std_A", "rho_undefined", "bound_violations")  # an in-run step's scalar statistics


def column_blocks(P: int, block: int) -> list[tuple[int, int]]:
    """[lo, hi) of the consecutive blocks of at most ``block`` columns covering [0, P): at least one (the empty
    block when P = 0, so that the scalars always have a block)."""
    if block < 1:
        raise ValueError(f"block must be >= 1 columns; got {block}")
    return [(lo, min(P, lo + block)) for lo in range(0, max(P, 1), block)]


def merge_scalars(total: dict[str, Any] | None, block: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The step's scalars ``names`` after one more block's statistics: ``bound_violations`` summed,
    ``rho_undefined`` true when it is true in every block, the others (functions of the per-half scalars alone:
    equal in every block) the first block's."""
    if total is None:
        return {n: block[n] for n in names}
    out = dict(total)
    out["bound_violations"] = total["bound_violations"] + block["bound_violations"]
    out["rho_undefined"] = total["rho_undefined"] and block["rho_undefined"]
    return out


def npz_view(path: Path, name: str) -> np.ndarray:
    """A read-only memory map of member ``name`` (an ``.npy`` stored uncompressed) of the npz at ``path``: the
    array ``np.load(path)[name]`` reads, without reading it."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(f"{name}.npy")
    if info.compress_type != zipfile.ZIP_STORED:
        raise ValueError(f"{path}: member {name!r} is compressed; only a stored member can be mapped")
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)  # the local file header; its name and extra field lengths at bytes 26..29
        f.seek(info.header_offset + 30 + sum(struct.unpack("<HH", local[26:30])))
        version = np.lib.format.read_magic(f)
        read = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}[version]
        shape, fortran, dtype = read(f)
        offset = f.tell()
    order = "F" if fortran else "C"
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order=order)


class StepVectors:
    """The (P,) float64 statistics of one fold, filled block by block (module docstring).

    Use as a context manager: the temporary folder is removed on exit, whatever happened.

    Args:
        P: the columns.
        written: the statistics written to the step's npz (() when nothing is written).
        kept: the statistics :meth:`kept` returns (the step's :class:`covgrad.integrations.inrun.InRunStep`).
        folder: the output folder (the temporary one goes inside it, until exit); None: nothing is written.
        name: the step's file name (for the temporary folder's).

    Attributes:
        names: every statistic :meth:`put` takes (written, then kept), in order.
    """

    def __init__(self, P: int, written: Sequence[str], kept: Sequence[str], folder: Path | None, name: str) -> None:
        if written and folder is None:
            raise ValueError("written vectors need an output folder")
        self.P, self.written, self.kept_names = P, tuple(written), tuple(kept)
        self.names = tuple(dict.fromkeys((*self.written, *self.kept_names)))
        self.scratch = None if folder is None else Path(tempfile.mkdtemp(prefix=f".{name}.", dir=folder))
        self._npz: Path | None = None
        self._open = ExitStack()  # the written vectors' files, closed by write() or on exit
        self._files: dict[str, tuple[IO[bytes], int]] = {}  # a written vector's open .npy and its data offset
        self._arrays = {v: np.empty(P, dtype=np.float64) for v in self.names if v not in self.written}
        for v in self.written:
            assert self.scratch is not None
            path = self.scratch / f"{v}.npy"
            header = np.lib.format.open_memmap(path, "w+", np.float64, (P,))  # numpy's header, the file sized
            offset = header.offset
            del header
            self._files[v] = self._open.enter_context(open(path, "r+b")), offset  # noqa: SIM115 (the stack closes it)

    def __enter__(self) -> StepVectors:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self._open.close()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def put(self, start: int, stats: Mapping[str, np.ndarray]) -> None:
        """Columns [start, start + b) of every statistic in :attr:`names`, from ``stats`` (each (b,))."""
        for v in self.names:
            values = np.ascontiguousarray(stats[v], dtype=np.float64)
            if v in self._files:
                f, offset = self._files[v]
                f.seek(offset + 8 * start)
                f.write(memoryview(values).cast("B"))
            else:
                self._arrays[v][start : start + values.shape[0]] = values

    def write(self, path: Path, tail: Mapping[str, np.ndarray]) -> None:
        """The npz at ``path``: the written statistics, then the arrays of ``tail`` (small), as ``np.savez(path,
        **written, **tail)`` would write them; built in the temporary folder and moved into place."""
        assert self.scratch is not None, "write() without an output folder"
        staging = self.scratch / path.name
        self._open.close()
        with zipfile.ZipFile(staging, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for v in self.written:
                with zf.open(f"{v}.npy", "w", force_zip64=True) as dst, open(self.scratch / f"{v}.npy", "rb") as src:
                    shutil.copyfileobj(src, dst, 1 << 22)
            for key, value in tail.items():
                with zf.open(f"{key}.npy", "w", force_zip64=True) as dst:
                    np.lib.format.write_array(dst, np.asanyarray(value), allow_pickle=False)
        os.replace(staging, path)
        self._npz = path

    def kept(self) -> dict[str, np.ndarray]:
        """The kept statistics, each (P,) float64: a written one as a read-only view of the npz (after
        :meth:`write`), the others in memory."""
        out = {}
        for v in self.kept_names:
            if v in self.written:
                assert self._npz is not None, "kept() of a written vector before write()"
                out[v] = npz_view(self._npz, v)
            else:
                out[v] = self._arrays[v]
        return out
