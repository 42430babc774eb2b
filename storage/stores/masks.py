"""Reading a masks artifact back as boolean vectors on its flat parameter axis."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import zarr

from covgrad.layout import ParamLayout
from storage.schema import MASKS, MASKS_VARS


def mask_names(g: zarr.Group) -> list[str]:
    """The names of the (q, param) mask arrays of an open masks group (not its q axis or tensor table)."""
    return [name for name, v in MASKS_VARS.items() if v.dims == ("q", "param") and name in g]


def load_masks(artifact_dir: str, q: float) -> tuple[dict[str, np.ndarray], ParamLayout]:
    """Every ``{metric}_{scope}`` mask of ``{artifact_dir}/masks.zarr`` at fraction ``q``, and the layout.

    ValueError naming the available fractions when ``q`` was not computed, or the degenerate condition
    when the artifact holds no masks.
    """
    path = Path(artifact_dir) / MASKS
    if not path.is_dir():
        raise FileNotFoundError(f"{str(path)!r} does not exist; pass a masks artifact directory ({{root}}/masks/<key>)")
    g = zarr.open_group(str(path), mode="r")
    if g.attrs.get("degenerate"):
        raise ValueError(f"{str(path)!r} holds no masks: {g.attrs['degenerate']}")
    qs = g["q"][:]
    hits = np.flatnonzero(np.isclose(qs, q))
    if not hits.size:
        raise ValueError(f"masks were computed for q in {qs.tolist()}, not {q}")
    i = int(hits[0])
    masks = {name: g[name][i] for name in mask_names(g)}
    return masks, ParamLayout.from_records(g.attrs["tensors"])
