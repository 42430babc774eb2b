"""update_check stage on one tiny pipeline whose single minibatch holds every sample (the case where the
SGD bound rule is a theorem): the row table, the bound rule's recall, determinism, the layout check."""

import csv
import io
import json
import math

import numpy as np
import pytest
import torch

from covgrad.layout import ParamLayout, check_layout
from storage.artifacts import ArtifactStore
from tasks.specs import plan
from tasks.update_check import STORE
from tests.helpers.pipeline import tiny_config
from tests.helpers.stages import POLICY_ONLY, run_upto

# 8 prompts in one minibatch: the step's gradient is the G the stats describe
ONE_MINIBATCH = {**POLICY_ONLY, "scores.groups_per_batch": 8}


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    torch.set_num_threads(1)
    cfg = tiny_config(str(tmp_path_factory.mktemp("update")), **ONE_MINIBATCH)
    refs = run_upto(cfg, "update_check")
    return cfg, refs, ArtifactStore(cfg.root)


@pytest.mark.slow
def test_grid_has_one_row_per_cell_and_step(run):
    cfg, refs, store = run
    ref = refs["update_check"]
    uc = cfg.update_check
    rows = store.read_json(ref, "grid.json")
    expected = [
        (opt, prec, lr, n)
        for opt in uc.optimizers
        for prec in uc.precisions
        for lr in (uc.sgd_lrs if opt == "sgd" else uc.adam_lrs)
        for n in uc.steps
    ]
    assert [(r["optimizer"], r["precision"], r["lr"], r["steps"]) for r in rows] == expected
    with store.fs.open(store.path(ref, "grid.csv")) as f:
        table = list(csv.DictReader(io.TextIOWrapper(f)))
    assert len(table) == len(rows) and sorted(table[0]) == sorted(rows[0])
    g = store.open_group(ref, STORE, mode="r")
    assert g["optimizer"][:].tolist() == [r["optimizer"] for r in rows]
    np.testing.assert_array_equal(g["frac_changed_bf16"][:], [r["frac_changed_bf16"] for r in rows])
    md = store.fs.cat(store.path(ref, "grid.md")).decode().splitlines()
    assert len(md) == 2 + len(rows)
    summary = store.read_json(ref, "summary.json")
    assert summary["one_minibatch_holds_all_samples"] is True
    assert len(summary["cells_at_one_step"]) == len(rows) // len(uc.steps)
    for cell in summary["cells_at_one_step"]:
        assert 0 < cell["frac_changed_bf16"] < 1
        assert cell["best_jaccard"] >= cell["random_jaccard"]


@pytest.mark.slow
def test_plain_xarray_selects_a_cell_by_its_labels(run):
    """``xr.open_zarr`` on the update store, with no project import in the check, selects a grid cell by
    its optimizer, precision, lr and steps coordinates and names the tensors of the parameter axis."""
    import xarray as xr

    _, refs, store = run
    path = store.path(refs["update_check"], STORE)
    rows = store.read_json(refs["update_check"], "grid.json")
    names = [t["name"] for t in store.open_group(refs["update_check"], STORE, mode="r").attrs["tensors"]]

    ds = xr.open_zarr(path)
    cells = ds.set_index(cell=["optimizer", "precision", "lr", "steps"])
    for r in rows:
        cell = cells.sel(optimizer=r["optimizer"], precision=r["precision"], lr=r["lr"], steps=r["steps"]).load()
        assert cell.frac_changed_bf16.item() == r["frac_changed_bf16"]
    assert {"tensor_name", "tensor_offset", "tensor_numel"} <= set(ds.coords)
    assert ds.tensor_name.values.tolist() == names
    assert ds.frac_changed_bf16.attrs["long_name"] == "fraction of parameters changed"


@pytest.mark.slow
def test_every_array_is_declared_in_the_schema(run):
    """Every array the stages wrote (rollouts, scores, stats, update) has the dims and dtype that
    storage/schema.py declares for it."""
    from storage.schema import SCHEMAS, var

    _, refs, store = run
    seen = 0
    for ref in refs.values():
        for name in SCHEMAS:
            if not store.fs.exists(store.path(ref, name)):
                continue
            for key, arr in store.open_group(ref, name, mode="r").arrays():
                v = var(name, key)
                assert tuple(arr.metadata.dimension_names) == v.dims, (name, key)
                expected = "StringDType()" if v.dtype == "str" else v.dtype
                assert v.dtype is None or str(arr.dtype) == expected, (name, key, arr.dtype)
                seen += 1
    assert seen > 20


@pytest.mark.slow
def test_sgd_bound_rule_recall_is_one_at_one_fp32_step(run):
    _, refs, store = run
    rows = store.read_json(refs["update_check"], "grid.json")
    cells = [r for r in rows if r["optimizer"] == "sgd" and r["precision"] == "fp32" and r["steps"] == 1]
    assert cells
    for r in cells:
        assert r["n_changed_bf16"] > 0
        assert r["bf16_bound_recall"] == 1.0
        assert r["bf16_bound_precision"] < 1.0  # the bound set is a strict superset here
    adam = [r for r in rows if r["optimizer"] == "adam"]
    assert all(math.isnan(r["bf16_bound_recall"]) for r in adam)


@pytest.mark.slow
def test_rerun_is_deterministic(run):
    cfg, refs, store = run
    ref = refs["update_check"]
    first = json.dumps(store.read_json(ref, "grid.json"))
    store.clear(ref)
    run_upto(cfg, "update_check")
    assert json.dumps(store.read_json(ref, "grid.json")) == first
    assert plan(cfg)["update_check"].ref == ref


def test_layout_mismatch_names_both_tables():
    mine = ParamLayout.from_records(
        [{"name": "a.weight", "offset": 0, "numel": 4, "shape": [2, 2], "dtype": "float32"}]
    )
    theirs = ParamLayout.from_records(
        [
            {"name": "a.weight", "offset": 0, "numel": 4, "shape": [2, 2], "dtype": "float32"},
            {"name": "b.weight", "offset": 4, "numel": 2, "shape": [2], "dtype": "float32"},
        ]
    )
    check_layout(mine, mine, "update_check")
    with pytest.raises(ValueError, match=r"model None vs stats \('b.weight'"):
        check_layout(mine, theirs, "update_check")
