"""Notebook access to a pipeline run: lazy xarray Datasets per stage instance, tensors by name.

``open_run(root, run)`` reads the run index (``{root}/runs/{run}.json``, by run key or friendly name)
and returns a :class:`RunData`, a read-only mapping from instance name (``stats.policy.policy``,
``masks``, ``rollouts.stale`` ...) to the artifact's zarr store opened lazily with
``xr.open_zarr(..., consolidated=True)``. Each Dataset's attrs hold the zarr group's attributes plus
``provenance`` (the completion marker) and ``instance``. Importing this module registers the
``covgrad`` accessor::

    ds = open_run("runs", "demo")["stats.policy.policy"]
    ds.covgrad.tensor("model.layers.0.mlp.up_proj.weight")["F"]   # lazy, shape (64, 32)
    open_run("runs", "demo").off_policy().loc[("stale", "sampler"), "zero_mean_trace"]

The ``offpolicy`` Dataset's ``row`` dimension is indexed by (sampler, centering), so
``ds.sel(sampler="stale", centering="sampler")`` selects one row.

Trajectories (``trajectory`` or ``trajectory.<cell>``) are indexed by ``step``: every per-step metric
opens by step (``ds.sel(step=50).cum_F_precision``), and the bit-packed changed sets unpack lazily::

    run = open_run("runs", "trajectories")
    ds = run.trajectories()["rl-adam-bf16"]
    ds.covgrad.changed_sets()                       # (step, param) bool, dask
    ds.covgrad.changed_sets("model.norm.weight")    # (step, dim_0) of one tensor

A trainer's in-run series (``covgrad.integrations``: ``InRunFolder``, the TRL callback ``CovgradInRun``, the
hook ``InRunHook``), a folder of per-step files outside any pipeline run, opens by step as well::

    ds = open_inrun("run/inrun")
    ds.F.sel(step=10)                               # (param,) float64, lazy
    ds.overlap_first.sel(metric="absG")             # (step,): top-1% |G| set against the first folded step's
    ds.covgrad.tensor("model.layers.0.mlp.up_proj.weight")["G"]   # (step, 64, 32)
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import xarray as xr

from storage.artifacts import ArtifactRef, ArtifactStore
from storage.runs import read_run_index

PARAM_DIM = "param"
# The in-run folder's files (covgrad.integrations.inrun writes them): the index, and per folded step t
# ``step_{t:06d}.npz`` (vectors, top sets) and ``.json`` (scalars, overlaps).
INRUN_INDEX = "inrun.json"
INRUN_METRICS = ("F", "absG", "absrho")
INRUN_SCALARS = ("N", "mean_A", "std_A", "rho_undefined", "bound_violations", "k", "seconds")


class RunData(Mapping[str, xr.Dataset]):
    """The artifacts of one pipeline run, as lazy Datasets keyed by instance name.

    Only instances whose artifact is complete and holds a zarr store are keys; ``missing`` lists the
    instances the run index names whose artifact is absent or incomplete.
    """

    def __init__(self, store: ArtifactStore, index: dict[str, Any]) -> None:
        self.store = store
        self.index = index
        self.run: str = index.get("run", "")
        self.name: str = index.get("name", "")
        self.config: dict[str, Any] = index.get("config", {})
        self.refs: dict[str, ArtifactRef] = {
            n: store.ref(a["stage"], a["key"]) for n, a in index.get("artifacts", {}).items()
        }
        self.missing: list[str] = [n for n, r in self.refs.items() if not store.is_complete(r)]
        self._zarr_names: dict[str, str] = {}
        for n, ref in self.refs.items():
            if n in self.missing:
                continue
            stores = [p.rstrip("/").rsplit("/", 1)[-1] for p in store.fs.ls(store.path(ref), detail=False)]
            zarrs = sorted(s for s in stores if s.endswith(".zarr"))
            if zarrs:
                self._zarr_names[n] = zarrs[0]
        self._cache: dict[str, xr.Dataset] = {}

    def __getitem__(self, instance: str) -> xr.Dataset:
        if instance not in self._zarr_names:
            if instance in self.missing:
                raise KeyError(f"{instance!r} is missing or incomplete under {self.store.root}; rerun the pipeline")
            raise KeyError(f"{instance!r} has no zarr store in this run; instances: {list(self._zarr_names)}")
        if instance not in self._cache:
            ref = self.refs[instance]
            zstore = self.store.zarr_store(ref, self._zarr_names[instance], read_only=True)
            ds = xr.open_zarr(zstore, consolidated=True)
            if {"sampler", "centering"} <= set(ds.coords) and ds["sampler"].dims == ("row",):
                ds = ds.set_index(row=["sampler", "centering"])
            ds.attrs["provenance"] = self.store.marker(ref)
            ds.attrs["instance"] = instance
            self._cache[instance] = ds
        return self._cache[instance]

    def __iter__(self) -> Iterator[str]:
        return iter(self._zarr_names)

    def __len__(self) -> int:
        return len(self._zarr_names)

    def off_policy(self) -> Any:
        """The off-policy table as a pandas DataFrame indexed by (sampler, centering), one row per stats
        instance (columns as in the report's off-policy table; docs/reading.md defines them)."""
        import pandas as pd

        if "offpolicy" not in self.refs or "offpolicy" in self.missing:
            raise KeyError(f"this run has no complete offpolicy artifact under {self.store.root}")
        rows = self.store.read_json(self.refs["offpolicy"], "offpolicy.json")
        return pd.DataFrame(rows).set_index(["sampler", "centering"])

    def trajectories(self) -> dict[str, xr.Dataset]:
        """The run's trajectory Datasets by cell name (``trajectory`` for a run without a grid), in plan order."""
        names = [n for n in self if n == "trajectory" or n.startswith("trajectory.")]
        return {n.removeprefix("trajectory.") if n != "trajectory" else n: self[n] for n in names}

    def __repr__(self) -> str:
        return f"RunData(run={self.run!r}, name={self.name!r}, instances={list(self)}, missing={self.missing})"


def open_run(root: str, run: str) -> RunData:
    """Open a pipeline run under ``root`` (local path or fsspec URL) by run key or friendly name.

    Raises FileNotFoundError listing the known runs when ``run`` has no index under ``root``.
    """
    store = ArtifactStore(root)
    return RunData(store, read_run_index(store, run))


@xr.register_dataset_accessor("covgrad")
class CovgradAccessor:
    """``ds.covgrad``: per-tensor views of a Dataset on the flat ``param`` axis (attr ``tensors``)."""

    def __init__(self, ds: xr.Dataset) -> None:
        self._ds = ds

    @property
    def layout(self) -> list[dict[str, Any]]:
        """The tensor table: one record (name, offset, numel, shape, dtype) per tensor, in flat order."""
        table = self._ds.attrs.get("tensors")
        if not table:
            raise ValueError("this Dataset has no 'tensors' attribute; open a scores, stats, masks or tokens store")
        return list(table)

    @property
    def names(self) -> list[str]:
        """Parameter tensor names in flat-axis order."""
        return [t["name"] for t in self.layout]

    def changed_sets(self, tensor: str | None = None) -> xr.DataArray:
        """A trajectory's per-step changed sets unpacked from ``changed`` (step, param_byte): a lazy
        (step, param) bool DataArray (``np.unpackbits``, big-endian bit order, the trailing pad bits cut),
        or with ``tensor`` the (step, dim_0, ...) sets of that tensor."""
        import dask.array as da

        if "changed" not in self._ds or self._ds["changed"].dims != ("step", "param_byte"):
            raise ValueError("this Dataset has no packed 'changed' sets; open a trajectory store")
        P = sum(int(t["numel"]) for t in self.layout)
        packed = self._ds["changed"].data
        if not isinstance(packed, da.Array):
            packed = da.from_array(packed, chunks=(1, -1))
        bits = packed.map_blocks(
            lambda b: np.unpackbits(b, axis=-1).view(np.bool_),
            dtype=bool,
            chunks=(packed.chunks[0], tuple(8 * c for c in packed.chunks[1])),
        )[:, :P]
        coords = {"step": self._ds["step"]} if "step" in self._ds.coords else {}
        sets = xr.DataArray(bits, dims=("step", PARAM_DIM), coords=coords, name="changed")
        if tensor is None:
            return sets
        entry = next((t for t in self.layout if t["name"] == tensor), None)
        if entry is None:
            raise KeyError(f"tensor {tensor!r} is not in this store; known: {self.names}")
        lo, shape = int(entry["offset"]), tuple(entry["shape"])
        data = sets.data[:, lo : lo + int(entry["numel"])].reshape((sets.shape[0], *shape))
        return xr.DataArray(data, dims=("step", *(f"dim_{i}" for i in range(len(shape)))), coords=coords)

    def tensor(self, name: str) -> xr.Dataset:
        """Every ``param``-dimension variable restricted to tensor ``name`` and reshaped to its shape.

        A variable of dims (..., param) becomes (..., dim_0, ..., dim_{k-1}) with the tensor's shape;
        data stay lazy (dask). Raises KeyError naming the tensor and the known names when absent.
        """
        entry = next((t for t in self.layout if t["name"] == name), None)
        if entry is None:
            raise KeyError(f"tensor {name!r} is not in this store; known: {self.names}")
        lo, hi, shape = int(entry["offset"]), int(entry["offset"]) + int(entry["numel"]), tuple(entry["shape"])
        tensor_dims = [f"dim_{i}" for i in range(len(shape))]
        out = {}
        for var_name, var in self._ds.data_vars.items():
            if PARAM_DIM not in var.dims:
                continue
            lead = [d for d in var.dims if d != PARAM_DIM]
            var = var.transpose(*lead, PARAM_DIM)
            data = var.data[..., lo:hi].reshape(var.shape[:-1] + shape)
            coords = {d: self._ds.coords[d] for d in lead if d in self._ds.coords}
            out[var_name] = xr.DataArray(data, dims=[*lead, *tensor_dims], coords=coords, attrs=var.attrs)
        return xr.Dataset(out, attrs={"tensor": name, "offset": lo, "shape": list(shape)})


def _npz_array(path: str, name: str) -> np.ndarray:
    with np.load(path) as f:
        return np.asarray(f[name])


def _padded_top(path: str, name: str, k: int) -> np.ndarray:
    """A step's top set ``name`` as (k,) int64, padded with −1 past its length (a set of fewer than k non-NaN
    values)."""
    out = np.full(k, -1, dtype=np.int64)
    got = _npz_array(path, name)
    out[: got.shape[0]] = got
    return out


def open_inrun(path: str | Path) -> xr.Dataset:
    """A trainer's in-run series (the folder an ``InRunFolder`` writes) as a Dataset indexed by ``step``.

    Variables: each written statistic (``F``, ``G``, ``rho`` by default) (step, param) float64, lazy (dask, one
    chunk per step); ``top`` (step, metric, rank) int64, the sorted flat indices of the step's top ceil(q·P) by
    F, |G|, |ρ| (metric ``F``, ``absG``, ``absrho``), −1 past a shorter set, lazy; the per-step scalars ``N``,
    ``mean_A``, ``std_A``, ``rho_undefined``, ``bound_violations``, ``k``, ``seconds`` (step,); the overlaps
    ``overlap_prev`` and ``overlap_first`` (step, metric) float64 (NaN where a set is empty or, for the first
    step, has no previous one). Attrs: ``every_n``, ``q``, ``temperature``, ``path`` and ``tensors`` (the flat
    axis' layout, for ``ds.covgrad.tensor``).

    Raises:
        FileNotFoundError: when ``path`` holds no ``inrun.json``.
    """
    import dask
    import dask.array as da

    root = Path(path)
    if not (root / INRUN_INDEX).exists():
        raise FileNotFoundError(f"{root} holds no {INRUN_INDEX}; pass the out_dir of an InRunFolder")
    index = json.loads((root / INRUN_INDEX).read_text())
    steps = [int(t) for t in index["steps"]]
    P = sum(int(t["numel"]) for t in index["tensors"])
    npz = [str(root / f"step_{t:06d}.npz") for t in steps]
    summaries = [json.loads((root / f"step_{t:06d}.json").read_text()) for t in steps]
    k = max((int(s["k"]) for s in summaries), default=0)
    data: dict[str, Any] = {}
    for name in index["vectors"]:
        parts = [da.from_delayed(dask.delayed(_npz_array)(f, name), (P,), np.float64) for f in npz]
        data[name] = (("step", PARAM_DIM), da.stack(parts) if parts else da.zeros((0, P)))
    tops = [
        da.stack([da.from_delayed(dask.delayed(_padded_top)(f, f"top_{m}", k), (k,), np.int64) for m in INRUN_METRICS])
        for f in npz
    ]
    data["top"] = (("step", "metric", "rank"), da.stack(tops) if tops else da.zeros((0, len(INRUN_METRICS), k)))
    for name in INRUN_SCALARS:
        data[name] = ("step", np.asarray([s[name] for s in summaries]))
    for name in ("overlap_prev", "overlap_first"):
        values = [[np.nan if s[name][m] is None else s[name][m] for m in INRUN_METRICS] for s in summaries]
        data[name] = (("step", "metric"), np.asarray(values, dtype=np.float64).reshape(len(steps), -1))
    attrs = {key: index[key] for key in ("every_n", "q", "temperature", "tensors")}
    coords = {"step": np.asarray(steps, dtype=np.int64), "metric": list(INRUN_METRICS)}
    return xr.Dataset(data, coords=coords, attrs={**attrs, "path": str(root)})
