"""open_run and the ``covgrad`` xarray accessor on hand-made stores, and the explore notebook, headless."""

import json

import dask.array as da
import numpy as np
import pytest
import torch

from storage.artifacts import ArtifactStore
from storage.notebook import open_run
from tests.helpers.pipeline import REPO, tiny_config

SHAPES = {"a.weight": (3, 5), "b.bias": (7,), "c.weight": (2, 3, 4)}


def _layout() -> list[dict]:
    records, offset = [], 0
    for name, shape in SHAPES.items():
        numel = int(np.prod(shape))
        records.append({"name": name, "offset": offset, "numel": numel, "shape": list(shape), "dtype": "float32"})
        offset += numel
    return records


def _make_run(root: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A run index naming one complete stats artifact, one masks artifact and one absent artifact."""
    store = ArtifactStore(root)
    layout = _layout()
    P = layout[-1]["offset"] + layout[-1]["numel"]
    data = {"F": rng.random(P), "G": rng.standard_normal(P), "mask": rng.random((2, P)) < 0.3}
    stats, masks = store.ref("stats", "k-stats"), store.ref("masks", "k-masks", upstream=["k-stats"])
    for ref, arrays in ((stats, {"F": data["F"], "G": data["G"]}), (masks, {"F_global": data["mask"]})):
        claim = store.begin(ref, {"test": True}, resume=False)
        g = store.open_group(ref, f"{ref.stage}.zarr", mode="w")
        for name, values in arrays.items():
            dims = ["param"] if values.ndim == 1 else ["q", "param"]
            chunks = (4,) if values.ndim == 1 else (1, 4)
            g.create_array(name, data=values, chunks=chunks, dimension_names=dims)
        if ref.stage == "masks":
            g.create_array("q", data=np.array([0.01, 0.1]), dimension_names=["q"])
        g.attrs.update({"tensors": layout, "note": ref.stage})
        store.consolidate(ref, f"{ref.stage}.zarr")
        store.complete(ref, claim, {"seconds": 0.0})
    index = {
        "run": "runkey",
        "name": "toy",
        "config": {},
        "artifacts": {
            "stats.policy.policy": {"stage": "stats", "key": "k-stats"},
            "masks": {"stage": "masks", "key": "k-masks"},
            "tokens": {"stage": "tokens", "key": "k-absent"},
        },
    }
    store.fs.makedirs(f"{store.base}/runs", exist_ok=True)
    for stem in ("runkey", "toy"):
        store.fs.pipe_file(f"{store.base}/runs/{stem}.json", json.dumps(index).encode())
    return data


@pytest.fixture(params=["local", "memory"])
def toy_root(request, tmp_path):
    if request.param == "local":
        yield str(tmp_path / "root")
        return
    root = f"memory://h7-notebook-{tmp_path.name}"
    yield root
    store = ArtifactStore(root)
    store.fs.rm(store.base, recursive=True)


def test_tensor_views_equal_numpy_reshape(toy_root):
    data = _make_run(toy_root, np.random.default_rng(0))
    for run_name in ("toy", "runkey"):
        run = open_run(toy_root, run_name)
        assert sorted(run) == ["masks", "stats.policy.policy"] and run.missing == ["tokens"]
    stats, masks = run["stats.policy.policy"], run["masks"]
    assert stats.attrs["provenance"]["key"] == "k-stats" and stats.attrs["note"] == "stats"
    offset = 0
    for name, shape in SHAPES.items():
        numel = int(np.prod(shape))
        view = stats.covgrad.tensor(name)
        assert isinstance(view["F"].data, da.Array)
        np.testing.assert_array_equal(view["F"].values, data["F"][offset : offset + numel].reshape(shape))
        np.testing.assert_array_equal(view["G"].values, data["G"][offset : offset + numel].reshape(shape))
        mview = masks.covgrad.tensor(name)["F_global"]
        assert mview.dims[0] == "q" and mview.shape == (2, *shape)
        np.testing.assert_array_equal(mview.sel(q=0.1).values, data["mask"][1, offset : offset + numel].reshape(shape))
        offset += numel
    assert stats.covgrad.names == list(SHAPES)


def test_bad_names_raise_with_the_known_ones(tmp_path):
    root = str(tmp_path / "root")
    _make_run(root, np.random.default_rng(1))
    run = open_run(root, "toy")
    with pytest.raises(KeyError, match="no.such.weight"):
        run["stats.policy.policy"].covgrad.tensor("no.such.weight")
    with pytest.raises(KeyError, match="tokens.*missing"):
        run["tokens"]
    with pytest.raises(FileNotFoundError, match="known runs"):
        open_run(root, "nope")


@pytest.fixture(scope="module")
def policy_run(tmp_path_factory):
    """A policy-only tiny pipeline run (no tokens, no update check), task bodies called directly."""
    from storage.runs import write_run_index
    from tasks.specs import plan
    from tests.helpers.pipeline import run_planned

    torch.set_num_threads(1)
    cfg = tiny_config(
        str(tmp_path_factory.mktemp("notebook") / "root"),
        **{
            "rollouts.samplers": {"policy": {"group_size": 4, "max_new_tokens": 3, "batch_size": 16}},
            "tokens.enabled": False,
            "update_check.enabled": False,
        },
    )
    refs = {n: r.ref for n, r in run_planned(cfg).items()}
    write_run_index(ArtifactStore(cfg.root), cfg, plan(cfg).run_key, refs)
    return cfg


@pytest.mark.slow
def test_explore_notebook_executes_headless(policy_run, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("COVGRAD_ROOT", policy_run.root)
    monkeypatch.setenv("COVGRAD_RUN", policy_run.name)
    nb = nbformat.read(REPO / "notebooks" / "explore.ipynb", as_version=4)
    client = NotebookClient(
        nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(REPO / "notebooks")}}
    )
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    text = json.dumps([o.get("data", {}).get("text/markdown", "") for o in outputs])
    assert "spearman_F_absG" in text and "overlap(q=0.01)" in text
    assert "model.layers.0.mlp.up_proj.weight {'dim_0': 64, 'dim_1': 32}" in json.dumps(
        [o.get("text", "") for o in outputs]
    )
    assert any("image/png" in o.get("data", {}) for o in outputs)


@pytest.mark.slow
def test_plain_xarray_selects_one_tensor_by_name(policy_run):
    """``xr.open_zarr`` on a stats store, with no project import in the check, selects one tensor's F by
    name through the ``tensor_id``/``tensor_name`` coordinates, and each statistic says what it is."""
    import xarray as xr

    from tasks.specs import plan

    path = ArtifactStore(policy_run.root).path(plan(policy_run).main.ref, "stats.zarr")
    name = "model.layers.0.mlp.up_proj.weight"

    ds = xr.open_zarr(path)
    t = ds.isel(tensor=ds.tensor_name.values.tolist().index(name))
    F = ds.F.isel(param=slice(int(t.tensor_offset), int(t.tensor_offset + t.tensor_numel)))
    assert F.dims == ("param",) and F.size == 64 * 32
    assert ds.F.attrs["long_name"] == "Fisher (uncentered)" and ds.F.attrs["definition"] == "mean(s^2)"

    expected = open_run(policy_run.root, policy_run.name)["stats.policy.policy"].covgrad.tensor(name)["F"]
    np.testing.assert_array_equal(F.values, expected.values.ravel())


@pytest.mark.slow
def test_completion_markers_record_the_spec(policy_run):
    """Every artifact's marker holds the spec it was computed from (what its key hashes, plus placement)."""
    from tasks.specs import plan

    store = ArtifactStore(policy_run.root)
    for name, step in plan(policy_run).items():
        assert store.marker(step.ref)["config"] == step.spec.model_dump(mode="json"), name


@pytest.mark.slow
def test_off_policy_table_is_indexed_by_sampler_and_centering(tiny_run):
    """``RunData.off_policy()`` and the offpolicy Dataset select a row by (sampler, centering)."""
    root, p = tiny_run
    run = open_run(str(root), p.run_key)
    table = run.off_policy()
    assert table.index.names == ["sampler", "centering"]
    rows = json.loads((root / "offpolicy" / p["offpolicy"].ref.key / "offpolicy.json").read_text())
    for r in rows:
        got = table.loc[(r["sampler"], r["centering"]), "zero_mean_trace"]
        assert got == r["zero_mean_trace"] or (np.isnan(got) and r["zero_mean_trace"] is None)
    ds = run["offpolicy"]
    one = rows[-1]
    sel = ds.sel(sampler=one["sampler"], centering=one["centering"])
    assert float(sel.zero_mean_trace) == pytest.approx(one["zero_mean_trace"], nan_ok=True)
