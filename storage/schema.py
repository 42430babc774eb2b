"""Every store's schema: store names, dimension names, the chunking along ``param``, coordinates and
variable attributes. Tasks create arrays and write coordinates through this module and pick no chunk
size of their own.

Coordinates along the flat parameter axis (DESIGN.md section 5): ``tensor_id (param)`` int32, the index
of the tensor that holds each element, and ``tensor_name (tensor)``, its name as in
``named_parameters()``. A string per element would cost P strings (about 60 bytes each at P = 1.35e8, 8
GB); the integer id costs 4 bytes per element and compresses to almost nothing, and plain xarray selects a
tensor by name with no project import::

    ds = xr.open_zarr(path_of_stats_store)
    tid = int((ds.tensor_name == "model.layers.0.mlp.up_proj.weight").argmax())
    ds.F.where(ds.tensor_id == tid, drop=True)
"""

from __future__ import annotations

from typing import Any

import numpy as np

from covgrad.layout import ParamLayout

ROLLOUTS = "rollouts.zarr"
SCORES = "scores.zarr"
STATS = "stats.zarr"
MASKS = "masks.zarr"
TOKENS = "tokens.zarr"
UPDATE = "update.zarr"

PARAM_CHUNK = 65536  # elements per chunk along ``param`` (every (…, param) array of every store)

# What each (param,) statistic is: long name and definition (DESIGN.md section 1; s = sequence score,
# A = advantage, all means over the N samples with 1/N).
STATS_ATTRS: dict[str, dict[str, str]] = {
    "m": {"long_name": "mean score", "definition": "mean(s)", "units": "score"},
    "F": {"long_name": "Fisher (uncentered)", "definition": "mean(s^2)", "units": "score^2"},
    "Fvar": {"long_name": "score variance", "definition": "Var(s) = F - m^2", "units": "score^2"},
    "G": {"long_name": "REINFORCE gradient", "definition": "mean(A*s)", "units": "advantage*score"},
    "Cov": {"long_name": "advantage-score covariance", "definition": "G - mean(A)*m", "units": "advantage*score"},
    "rho": {"long_name": "alignment", "definition": "Cov / (std(A)*sqrt(Fvar)), in [-1, 1]", "units": "1"},
    "crossfit_ratio": {
        "long_name": "cross-fit bound ratio",
        "definition": "|Cov| from one half of the prompt groups / (std(A)*sqrt(Fvar)) from the other",
        "units": "1",
    },
}


def param_chunk(P: int) -> int:
    """Chunk length along ``param`` of a store over P parameter elements."""
    return max(1, min(P, PARAM_CHUNK))


def write_param_coords(g: Any, layout: ParamLayout) -> None:
    """Write the tensor coordinates of the flat parameter axis into zarr group ``g``: ``tensor_id (param)``
    int32 (chunked like every param array) and ``tensor_name (tensor)`` text, and declare ``tensor_name``
    a coordinate of every other variable's ``tensor`` dim and ``tensor_id`` of its ``param`` dim."""
    P = layout.P
    ids = g.create_array(
        "tensor_id", shape=(P,), chunks=(param_chunk(P),), dtype="int32", dimension_names=["param"], overwrite=True
    )
    for i, e in enumerate(layout.entries):
        ids[e.offset : e.offset + e.numel] = np.int32(i)
    ids.attrs.update({"long_name": "tensor index", "definition": "row of tensor_name holding this element"})
    names = g.create_array(
        "tensor_name", shape=(len(layout.entries),), dtype=str, dimension_names=["tensor"], overwrite=True
    )
    names[:] = np.asarray([e.name for e in layout.entries])
    names.attrs["long_name"] = "parameter tensor name (named_parameters())"
    for name, arr in g.arrays():
        if name in ("tensor_id", "tensor_name"):
            continue
        dims = arr.metadata.dimension_names or ()
        coords = [c for c, d in (("tensor_id", "param"), ("tensor_name", "tensor")) if d in dims]
        if coords:
            arr.attrs["coordinates"] = " ".join(coords)
