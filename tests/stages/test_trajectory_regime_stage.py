"""Regime trajectories and the regime update check on the tiny pipeline: a grid of cells (distillation on
fresh samples, SFT on a sampler's fixed rollouts) runs through the stage with each regime's own loss and
predictors; the update check's rl cells are unchanged by the regimes beside them."""

import json
import math

import numpy as np
import pytest
import xarray as xr

from storage.artifacts import ArtifactStore
from storage.notebook import open_run
from storage.runs import write_run_index
from storage.schema import TRAJECTORY, UPDATE
from tasks.specs import plan
from tests.helpers.pipeline import run_planned, tiny_config

REGIMES = {
    "sharpen": {"kind": "distill_reverse_kl", "teacher": "policy", "teacher_temperature": 0.5},
    "sft": {"kind": "sft_sampled", "sampler": "stale"},
}
GRID = {
    "sharpen-adam-bf16": {"regime": "sharpen", "optimizer": "adam", "precision": "bf16", "lr": 1e-3},
    "sft-sgd-fp32": {"regime": "sft", "optimizer": "sgd", "precision": "fp32", "lr": 1e-2},
}
OVERRIDES = {
    "tokens.enabled": False,
    "regimes": REGIMES,
    "trajectory.enabled": True,
    "trajectory.steps": 3,
    "trajectory.prompts_per_step": 2,
    "trajectory.grid": GRID,
    "update_check.precisions": ["bf16"],
    "update_check.steps": [1],
}


@pytest.mark.slow
def test_regime_cells_and_the_regime_update_check(tmp_path):
    cfg = tiny_config(str(tmp_path), **OVERRIDES)
    p = plan(cfg)
    results = run_planned(cfg)
    for cell, settings in GRID.items():
        ref = p[f"trajectory.{cell}"].ref
        assert results[f"trajectory.{cell}"].computed
        art = tmp_path / ref.stage / ref.key
        summary = json.loads((art / "summary.json").read_text())
        assert summary["regime"] == settings["regime"] and summary["kind"] == REGIMES[settings["regime"]]["kind"]
        ds = xr.open_zarr(art / TRAJECTORY)
        assert (ds.n_changed_step.values > 0).all()
        if settings["regime"] == "sft":  # fixed data: no reward, no bound
            assert np.isnan(ds.reward.values).all() and np.isnan(ds.adv_rms.values).all()
            assert "step_bound_recall" not in ds
        else:  # fresh samples, rewarded; the loss is Σ_t KL(p_t‖q_t) >= 0
            assert np.isfinite(ds.reward.values).all() and (ds.loss.values >= 0).all()
            assert (ds.adv_rms.values > 0).all()
    grid = json.loads((tmp_path / "update_check" / p["update_check"].ref.key / "grid.json").read_text())
    assert sorted({r["regime"] for r in grid}) == ["rl", "sft", "sharpen"]
    assert all(math.isnan(r["bf16_bound_recall"]) for r in grid if r["regime"] == "sft")
    ds = xr.open_zarr(tmp_path / "update_check" / p["update_check"].ref.key / UPDATE)
    assert sorted(set(ds.regime.values.tolist())) == ["rl", "sft", "sharpen"]

    # the notebook: per-step sets and metrics by step; the report's trajectories section
    write_run_index(ArtifactStore(cfg.root), cfg, p.run_key, {n: r.ref for n, r in results.items()})
    trajs = open_run(str(tmp_path), cfg.name).trajectories()
    assert sorted(trajs) == sorted(GRID)
    ds = trajs["sft-sgd-fp32"]
    raw = xr.open_zarr(tmp_path / "trajectory" / p["trajectory.sft-sgd-fp32"].ref.key / TRAJECTORY)
    P = sum(t["numel"] for t in ds.attrs["tensors"])
    sets = ds.covgrad.changed_sets()
    assert sets.shape == (3, P) and sets.sel(step=2).values.tolist() == (
        np.unpackbits(raw.changed.values[1], count=P).astype(bool).tolist()
    )
    assert int(sets.sel(step=2).sum()) == int(ds.sel(step=2).n_changed_step)
    name = ds.attrs["tensors"][-1]["name"]
    entry = ds.attrs["tensors"][-1]
    one = ds.covgrad.changed_sets(name)
    assert one.shape == (3, *entry["shape"])
    assert one.values.reshape(3, -1).tolist() == sets.values[:, entry["offset"] :].tolist()
    report = tmp_path / "report" / p["report"].ref.key
    text = (report / "report.md").read_text()
    assert "## Trajectories" in text and "trajectory_predictors.png" in text
    assert {"trajectory_changed.png", "trajectory_predictors.png", "trajectory_persistence.png"} <= {
        f.name for f in report.rglob("*.png")
    }

    without = {k: v for k, v in OVERRIDES.items() if k not in ("regimes", "trajectory.grid")}
    plain = tiny_config(str(tmp_path), **without)
    ref = plan(plain)["update_check"].ref
    run_planned(plain, {"update_check"})
    alone = json.loads((tmp_path / "update_check" / ref.key / "grid.json").read_text())
    with_regimes = [{k: v for k, v in r.items() if k != "regime"} for r in grid if r["regime"] == "rl"]
    assert json.dumps(with_regimes) == json.dumps(alone)
