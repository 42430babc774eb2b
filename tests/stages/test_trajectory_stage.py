"""trajectory stage on the tiny pipeline: the store opens in plain xarray, the checkpoints at log-spaced
steps agree with the packed sets (covgrad.updates.diff), and a run SIGKILLed at a random step and rerun
ends byte-identical to an uninterrupted one."""

import json
import random
import shutil

import numpy as np
import pytest
import torch
import xarray as xr

from covgrad.layout import ParamLayout
from covgrad.updates.diff import diff_state_dicts
from covgrad.updates.trajectory import checkpoint_steps
from storage.checkpoints import load_state_dict
from storage.schema import TRAJECTORY
from tasks.specs import plan
from tests.helpers import forked
from tests.helpers.pipeline import run_planned, tiny_config
from tests.helpers.trajectory import OVERRIDES, STEPS, digests


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("trajectory")
    cfg = tiny_config(str(root), **OVERRIDES)
    results = run_planned(cfg)
    assert results["trajectory"].computed
    return root, cfg, plan(cfg)["trajectory"].ref


@pytest.mark.slow
def test_store_checkpoints_and_packed_sets(reference):
    root, _, ref = reference
    artifact = root / ref.stage / ref.key
    ds = xr.open_zarr(artifact / TRAJECTORY)
    layout = ParamLayout.from_records(json.loads(json.dumps(ds.attrs["tensors"])))
    assert ds.changed.shape == (STEPS, -(-layout.P // 8))
    assert ds.step.values.tolist() == list(range(1, STEPS + 1))
    assert ds.kl.values[0] == 0.0 and np.all(ds.kl.values[1:] > 0)
    assert not (artifact / "state").exists()
    steps = checkpoint_steps(STEPS, 2.0)
    assert steps == [1, 2, 4, 6]
    assert checkpoint_steps(10, 1.5) == [1, 2, 3, 5, 7, 10] and checkpoint_steps(6, 0) == []
    assert sorted(p.name for p in (artifact / "checkpoints").iterdir()) == [f"step_{t:06d}" for t in steps]
    ckpt = {t: load_state_dict(artifact / "checkpoints" / f"step_{t:06d}") for t in steps}
    packed = np.unpackbits(ds.changed.values[1], axis=-1, count=layout.P).astype(bool)  # step 2
    d = diff_state_dicts(ckpt[1], ckpt[2], masks={"step2": packed}, layout=layout)
    assert d["overlap"]["step2"]["exact"]["recall"] == 1.0
    assert d["overlap"]["step2"]["exact"]["precision"] == 1.0
    assert int(ds.n_changed_step.values[1]) == d["changed_exact"]


@pytest.mark.slow
def test_k_step_arrays_and_the_trace_agree_with_the_checkpoints(reference):
    """The stored trace replayed to step 6 is checkpoint 6, bit for bit; d_k between checkpoints (steps 1 → 2,
    2 → 4, 2 → 6) is what the stored d_k says for those windows; each grouping's histogram sums to the whole's."""
    root, _, ref = reference
    artifact = root / ref.stage / ref.key
    ds = xr.open_zarr(artifact / TRAJECTORY)
    layout = ParamLayout.from_records(json.loads(json.dumps(ds.attrs["tensors"])))
    names = [e.name for e in layout.entries]

    def bits(t: int) -> np.ndarray:
        sd = load_state_dict(artifact / "checkpoints" / f"step_{t:06d}")
        flat = torch.cat([sd[n].reshape(-1) for n in names])
        return flat.view(torch.int16).numpy().view(np.uint16)

    w = np.load(artifact / "deltas" / "start.npy")
    for t in range(1, STEPS + 1):
        idx = np.flatnonzero(np.unpackbits(ds.changed.values[t - 1], count=layout.P))
        w[idx] = np.load(artifact / "deltas" / f"step_{t:06d}.npy")
    assert np.array_equal(w, bits(STEPS))
    ks = ds.k.values.tolist()
    for t, k in ((1, 1), (2, 2), (2, 4)):
        want = float(np.mean(bits(t) != bits(t + k)))
        assert float(ds.dk.values[ks.index(k), t]) == want, (t, k)
    assert np.isnan(ds.dk.values[ks.index(8), 0])  # a window longer than the run
    for grouping in ("kind", "tensor", "decile"):
        assert ds[f"hist_{grouping}"].values.sum(0).tolist() == ds.persist_hist.values[-1].tolist()
    summary = ds.attrs["summary"]["persistence"]
    assert summary["k1"]["dk_mean"] == pytest.approx(float(np.mean(ds.n_changed_step.values)) / layout.P, rel=1e-12)


@pytest.mark.slow
def test_sigkill_mid_run_then_rerun_is_byte_identical(reference, tmp_path):
    root, _, ref = reference
    copy = tmp_path / "copy"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns(".locks"))
    shutil.rmtree(copy / ref.stage / ref.key)
    let_through = random.Random(0).randrange(1, STEPS)
    # a child process SIGKILLs itself at its progress mark after ``let_through`` marks
    with forked.start(
        forked.seamed_run, str(copy), OVERRIDES, {"trajectory"}, "tasks.trajectory", kill_at_mark=let_through
    ) as child:
        assert child.wait() == forked.KILLED, child.output()
    partial = copy / ref.stage / ref.key
    assert not (partial / "_COMPLETE.json").exists()
    result = run_planned(tiny_config(str(copy), **OVERRIDES), {"trajectory"})["trajectory"]
    assert result.computed
    assert digests(partial) == digests(root / ref.stage / ref.key)


@pytest.mark.slow
def test_fixed_data_is_the_update_checks_case(reference, tmp_path):
    root, _, _ = reference
    copy = tmp_path / "fixed"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns(".locks"))
    cfg = tiny_config(str(copy), **{**OVERRIDES, "trajectory.data": "fixed", "trajectory.steps": 2})
    result = run_planned(cfg, {"trajectory"})["trajectory"]
    assert result.computed
    ds = xr.open_zarr(copy / result.ref.stage / result.ref.key / TRAJECTORY)
    assert np.isnan(ds.reward.values).all() and (ds.n_changed_step.values > 0).all()
