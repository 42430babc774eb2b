"""What the stores share: their names, the chunking along ``param``, the tensor coordinates and the
variables' attributes. Tasks take these from here and pick no chunk length of their own.

Coordinates of the flat parameter axis (DESIGN.md section 5), one row per tensor along dim ``tensor``:
``tensor_name`` (as in ``named_parameters()``), ``tensor_offset`` and ``tensor_numel`` (its run of
``param``). Measured on a SmolLM2-135M layout (P = 134,515,008 in 272 tensors): a name per element
compresses to about 0.5 MB on disk but is 3.4 GB of text and P Python strings once loaded; an int32
tensor index per element 60 kB on disk, 538 MB loaded (selecting by it reads all of it); the per-tensor
table 3 kB, and a tensor is a contiguous slice of ``param``, which xarray selects lazily. Plain
xarray selects a tensor by name with no project import::

    ds = xr.open_zarr(path_of_stats_store)
    t = ds.isel(tensor=ds.tensor_name.values.tolist().index("model.layers.0.mlp.up_proj.weight"))
    F = ds.F.isel(param=slice(int(t.tensor_offset), int(t.tensor_offset + t.tensor_numel)))
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

COORDS = ("tensor_name", "tensor_offset", "tensor_numel")
PARAM_CHUNK = 65536  # elements per chunk along ``param`` (every (…, param) array of every store)

# What each variable is: long name, definition and units (DESIGN.md section 1; s = sequence score, A =
# advantage, f_t = token Fisher at one position; means over the N samples with 1/N). Keys are array names;
# a key ending in "_" covers every array whose name starts with it.
VARIABLE_ATTRS: dict[str, dict[str, str]] = {
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
    "F_": {"long_name": "top-q mask by F", "definition": "row q: the top-q fraction of parameters by F"},
    "absG_": {"long_name": "top-q mask by |G|", "definition": "row q: the top-q fraction of parameters by |G|"},
    "absrho_": {"long_name": "top-q mask by |rho|", "definition": "row q: the top-q fraction by |rho|"},
    "fisher_seq": {"long_name": "sequence Fisher", "definition": "mean(s^2) over the samples", "units": "score^2"},
    "fisher_": {"long_name": "token Fisher estimate", "definition": "sum of f_t / N", "units": "score^2"},
    "trace_": {"long_name": "token Fisher trace", "definition": "sum over parameters of f_t", "units": "score^2"},
    "mean_s": {"long_name": "running mean score (moment state)", "definition": "Chan-merged mean(s) per row"},
    "m2_s": {"long_name": "score second central moment sum", "definition": "sum((s - mean_s)^2) per row"},
    "c_as": {"long_name": "advantage-score co-moment sum", "definition": "sum((A - mean_a)(s - mean_s)) per row"},
    "scores": {"long_name": "per-sample score", "definition": "s_n, one row per sample", "units": "score"},
}


def variable_attrs(name: str) -> dict[str, str]:
    """The attributes of array ``name`` (exact name first, then the longest matching prefix), or {}."""
    if name in VARIABLE_ATTRS:
        return VARIABLE_ATTRS[name]
    prefixes = [k for k in VARIABLE_ATTRS if k.endswith("_") and name.startswith(k)]
    return VARIABLE_ATTRS[max(prefixes, key=len)] if prefixes else {}


def param_chunk(P: int) -> int:
    """Chunk length along ``param`` of a store over P parameter elements."""
    return max(1, min(P, PARAM_CHUNK))


def annotate(g: Any, layout: ParamLayout) -> None:
    """Write the tensor table of the flat parameter axis into zarr group ``g`` as coordinates along dim
    ``tensor`` (``tensor_name`` text, ``tensor_offset`` and ``tensor_numel`` int64), name them in the
    ``coordinates`` attribute of every variable over ``param`` or ``tensor`` (xarray opens them as
    coordinates), and give every known variable its attributes (:data:`VARIABLE_ATTRS`)."""
    entries = layout.entries
    names = g.create_array("tensor_name", shape=(len(entries),), dtype=str, dimension_names=["tensor"], overwrite=True)
    names[:] = np.asarray([e.name for e in entries])
    names.attrs["long_name"] = "parameter tensor name (named_parameters())"
    for col, values, what in (
        ("tensor_offset", [e.offset for e in entries], "first param index of the tensor"),
        ("tensor_numel", [e.numel for e in entries], "elements of the tensor"),
    ):
        arr = g.create_array(col, data=np.asarray(values, dtype=np.int64), dimension_names=["tensor"], overwrite=True)
        arr.attrs["long_name"] = what
    for name, arr in g.arrays():
        dims = arr.metadata.dimension_names or ()
        if name in COORDS:
            continue
        if "param" in dims or "tensor" in dims:
            arr.attrs["coordinates"] = " ".join(COORDS)
        arr.attrs.update(variable_attrs(name))


# The off-policy table (stage ``offpolicy``): one row per stats artifact along dim ``row``, one 1-D array per
# column in this order (``sampler`` and ``centering`` are the row's coordinates), and the same rows as the
# tables ``offpolicy.{json,csv,md}`` beside the store. Column -> (dtype, attributes).
OFFPOLICY = "offpolicy.zarr"
OFFPOLICY_TABLE = "offpolicy"
OFFPOLICY_DIM = "row"
OFFPOLICY_COLUMNS: dict[str, tuple[str, dict[str, str]]] = {
    "sampler": ("str", {"long_name": "sampler (rollouts.samplers key)"}),
    "centering": ("str", {"long_name": "score centering", "definition": "policy: grad log p; sampler: by mu"}),
    "zero_mean_trace": ("float64", {"long_name": "zero-mean test, trace", "definition": "N*|m|^2 / tr Var(s)"}),
    "zero_mean_coord": ("float64", {"long_name": "zero-mean test, per coordinate", "definition": "mean N*m^2/Var"}),
    "rel_diff_G": (
        "float64",
        {
            "long_name": "G under the two centerings",
            "definition": "|G_sampler - G_policy| / |G_sampler| (L2 over param) of the row's sampler; NaN if on-policy",
            "units": "1",
        },
    ),
    "kl_per_token": (
        "float64",
        {"long_name": "KL(mu || p) per response token", "definition": "0 when mu = p", "units": "nats"},
    ),
    "max_abs_rho": ("float64", {"long_name": "max |rho|", "definition": "max |Cov| / (std(A)*sqrt(Fvar))"}),
    "bound_violations": ("int64", {"long_name": "bound violations", "definition": "count |Cov| > std(A)*sqrt(Fvar)"}),
    "crossfit_frac_exceed": (
        "float64",
        {"long_name": "cross-fit exceedances", "definition": "fraction of ratios > 1, F even groups, G odd"},
    ),
    "overlap_1pct": ("float64", {"long_name": "overlap at q = 0.01", "definition": "global top-1% by |G| and F"}),
    "finding": ("str", {"long_name": "degenerate condition", "definition": "why G has no finding, else empty"}),
}
