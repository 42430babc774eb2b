"""A trainer's in-run series (the folder ``covgrad.integrations.inrun.InRunFolder`` writes) as the trajectory stage of
an external run reads it (``trajectory.inrun``): the index ``inrun.json`` (the folded steps, the written vectors, the
flat axis' layout) and per folded step t ``step_{t:06d}.npz`` with F, G, ρ (P,) float64.

:func:`inrun_series` checks the whole folder without reading a vector (the index, then every step's npz member
headers), so the preflight refuses a malformed folder in one line naming the file; :meth:`InRunSeries.columns` maps
the analysed layout onto the series' flat axis (refused, naming the index, when a tensor is missing or reshaped);
:meth:`InRunSeries.ranked` reads one step's vector, one at a time. Imports numpy only (no torch): the preflight
stays fast.

Shapes: P_run the series' flat axis, P the analysed layout's.
"""

from __future__ import annotations

import json
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from covgrad.layout import ParamLayout

INDEX = "inrun.json"
# the in-run predictors: name -> the written vector whose |value| ranks it (largest first)
RANKED = {"F": "F", "absG": "G", "absrho": "rho"}


@dataclass(frozen=True)
class InRunSeries:
    """A checked in-run folder.

    Attributes:
        path: the folder.
        steps: the folded trainer steps, ascending (each has its npz).
        tensors: (name, row0) -> (offset, shape) of every tensor (or part) of the series' flat axis.
        P: the flat axis' length P_run.
    """

    path: str
    steps: tuple[int, ...]
    tensors: dict[tuple[str, int], tuple[int, tuple[int, ...]]]
    P: int

    @property
    def index(self) -> Path:
        return Path(self.path) / INDEX

    def file(self, step: int) -> Path:
        """The npz of folded step ``step``."""
        return Path(self.path) / f"step_{step:06d}.npz"

    def columns(self, layout: ParamLayout) -> np.ndarray | None:
        """(P,) int64 the series' column of each column of ``layout`` (None: the two flat axes are one). ValueError,
        naming the index, when a tensor of ``layout`` is not in the series with its shape."""
        same = layout.P == self.P
        parts = []
        for e in layout.entries:
            found = self.tensors.get((e.name, e.row0))
            if found is None or found[1] != tuple(e.shape):
                had = "no such tensor" if found is None else f"shape {found[1]}"
                raise ValueError(
                    f"trajectory.inrun: {self.index} has {had} for the analysed tensor {e.name!r} of shape "
                    f"{tuple(e.shape)}; record the in-run series with the model and parameters that model.path and "
                    "model.params select"
                )
            same = same and found[0] == e.offset
            parts.append(np.arange(found[0], found[0] + e.numel, dtype=np.int64))
        return None if same else np.concatenate(parts)

    def ranked(self, step: int, name: str, columns: np.ndarray | None) -> np.ndarray:
        """(P,) float64 the values predictor ``name`` (a key of :data:`RANKED`) ranks at folded step ``step``: F,
        |G| or |ρ| at the analysed columns ``columns`` (:meth:`columns`)."""
        with np.load(self.file(step), allow_pickle=False) as f:
            values = np.asarray(f[RANKED[name]], dtype=np.float64)
        if columns is not None:
            values = values[columns]
        return values if name == "F" else np.abs(values, out=values)


def _refuse(where: Path | str, why: str) -> ValueError:
    return ValueError(f"trajectory.inrun: {where}: {why}")


def _tensors(records: object, index: Path) -> tuple[dict[tuple[str, int], tuple[int, tuple[int, ...]]], int]:
    """The index's ``tensors`` (``ParamLayout.to_records``) as (name, row0) -> (offset, shape), and P_run; ValueError
    naming ``index`` unless they tile the flat axis in order."""
    if not isinstance(records, list) or not records:
        raise _refuse(index, "its tensors are not a non-empty list of layout records (ParamLayout.to_records)")
    out: dict[tuple[str, int], tuple[int, tuple[int, ...]]] = {}
    at = 0
    for i, r in enumerate(records):
        try:
            name, offset, numel = r["name"], r["offset"], r["numel"]
            shape = tuple(r["shape"])
            row0 = r.get("row0", 0)
        except (TypeError, KeyError):
            raise _refuse(index, f"tensor record {i} lacks name, offset, numel or shape") from None
        ints = [offset, numel, row0, *shape]
        if not isinstance(name, str) or not all(isinstance(x, int) and x >= 0 for x in ints):
            raise _refuse(index, f"tensor record {i} ({name!r}) has a non-integer offset, numel or shape")
        if offset != at or numel != math.prod(shape) or (name, row0) in out:
            raise _refuse(index, f"tensor record {i} ({name!r}) does not follow the previous one on the flat axis")
        out[(name, row0)] = (offset, shape)
        at += numel
    return out, at


def _check_npz(file: Path, P: int) -> None:
    """ValueError naming ``file`` unless it is an npz holding F, G and rho as (P,) float64 (member headers only)."""
    try:
        with zipfile.ZipFile(file) as z:
            names = set(z.namelist())
            for v in RANKED.values():
                if f"{v}.npy" not in names:
                    raise _refuse(
                        file, f"holds no {v} (an InRunFolder writes F, G and rho unless vectors=... left one out)"
                    )
                with z.open(f"{v}.npy") as member:
                    major, _ = np.lib.format.read_magic(member)
                    read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                    shape, _, dtype = read(member)  # the header only
                if shape != (P,) or dtype != np.float64:
                    raise _refuse(file, f"its {v} is {dtype} {shape}, the index's layout needs float64 ({P},)")
    except FileNotFoundError:
        raise _refuse(file, "is missing; the index lists its step") from None
    except (OSError, zipfile.BadZipFile, ValueError) as err:
        if str(err).startswith("trajectory.inrun"):
            raise
        raise _refuse(file, f"not a readable npz ({type(err).__name__}: {err})") from None


def inrun_series(path: str) -> InRunSeries:
    """The in-run folder ``path`` checked: its index (JSON with ``steps``, ascending distinct integers ≥ 0, at least
    one; ``vectors`` naming F, G and rho; ``tensors``, a layout tiling the flat axis) and, per listed step, an npz
    with F, G and rho of shape (P_run,) float64 (only the zip members' headers are read). ValueError (FileNotFoundError
    for a missing folder) in one line naming the file."""
    root = Path(path)
    if not root.is_dir():
        if not root.exists():
            raise FileNotFoundError(f"trajectory.inrun {path!r} does not exist")
        raise _refuse(path, "not a folder; give the out_dir of an InRunFolder")
    index = root / INDEX
    if not index.is_file():
        raise _refuse(path, f"holds no {INDEX}; give the out_dir of an InRunFolder")
    try:
        data = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise _refuse(index, f"not valid JSON ({type(err).__name__})") from None
    if not isinstance(data, dict) or not {"steps", "vectors", "tensors"} <= set(data):
        raise _refuse(index, "not an in-run index (steps, vectors, tensors)")
    steps = data["steps"]
    if (
        not isinstance(steps, list)
        or not steps
        or not all(isinstance(t, int) and t >= 0 for t in steps)
        or any(b <= a for a, b in zip(steps, steps[1:], strict=False))
    ):
        raise _refuse(index, f"its steps {steps!r} are not ascending distinct integers >= 0 (at least one)")
    vectors = data["vectors"] if isinstance(data["vectors"], list) else []
    missing = [v for v in RANKED.values() if v not in vectors]
    if missing:
        raise _refuse(index, f"its vectors lack {missing}; the trajectory ranks F, |G| and |rho| of every folded step")
    tensors, P = _tensors(data["tensors"], index)
    for t in steps:
        _check_npz(root / f"step_{t:06d}.npz", P)
    return InRunSeries(str(root), tuple(steps), tensors, P)
