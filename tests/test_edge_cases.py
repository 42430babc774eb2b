"""The whole pipeline when every reward is equal (std(A) = 0): no crash, G = Cov = 0, ρ NaN with a flag."""

import warnings

import numpy as np
import pytest

from storage.artifacts import ArtifactStore
from storage.runs import write_run_index
from tasks.plan import plan
from tasks.registry import STAGE_TASKS
from tests.test_deployments import user_config, write_checkpoint


def constant_reward(prompt: str, response: str, answer: str) -> float:
    """The same reward for every response: no signal at all."""
    del prompt, response, answer
    return 1.0


@pytest.mark.slow
def test_pipeline_with_constant_rewards(tmp_path):
    cfg = user_config(
        tmp_path / "runs",
        write_checkpoint(tmp_path / "ckpt"),
        tmp_path / "task.jsonl",
        **{
            "task.reward": "tests.test_edge_cases:constant_reward",
            "tokens.enabled": True,
            "update_check.enabled": True,
        },
    )
    store = ArtifactStore(cfg.root)
    refs = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, node in plan(cfg).items():
            upstream = {u: refs[u] for u in node.upstream}
            refs[name] = STAGE_TASKS[node.ref.stage].fn(node.ref, cfg, name, upstream).ref
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
