"""The whole pipeline when every reward is equal (std(A) = 0): no crash, G = Cov = 0, ρ NaN with a flag."""

import warnings

import numpy as np
import pytest

from storage.artifacts import ArtifactStore
from storage.runs import write_run_index
from tests.helpers.pipeline import run_planned
from tests.helpers.user import user_config, write_checkpoint


@pytest.mark.slow
def test_pipeline_with_constant_rewards(tmp_path):
    cfg = user_config(
        tmp_path / "runs",
        write_checkpoint(tmp_path / "ckpt"),
        tmp_path / "task.jsonl",
        **{
            "task.reward": "tests.helpers.user:constant_reward",
            "tokens.enabled": True,
            "update_check.enabled": True,
        },
    )
    store = ArtifactStore(cfg.root)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        refs = {n: r.ref for n, r in run_planned(cfg).items()}
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)]  # reported by the stage's logger
    write_run_index(store, cfg, "edge", refs)
    st = store.open_group(refs["stats.policy.policy"], "stats.zarr")
    assert st.attrs["degenerate"].startswith("no reward variance: G ≡ 0")
    s = st.attrs["scalars"]
    assert s["std_A"] == 0 and s["rho_undefined"] and s["bound_violations"] == 0
    assert np.all(st["G"][:] == 0) and np.all(st["Cov"][:] == 0)
    assert np.all(np.isnan(st["rho"][:]))
    assert np.all(np.isfinite(st["F"][:])) and st["F"][:].max() > 0
    assert all(store.is_complete(r) for r in refs.values())
