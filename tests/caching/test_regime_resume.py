"""A regime fold killed between checkpoints resumes byte-identical to an uninterrupted run (its moment state,
checkpoint progress and bound arrays), like a scores artifact (tests/caching/test_resume.py); so does a pass of two
folds killed after the first fold's checkpoint and before the second's (they resume from different batches)."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from tests.helpers import forked
from tests.helpers.pipeline import run_planned, tiny_config

OVERRIDES = {
    "tokens.enabled": False,
    "update_check.enabled": False,
    "scores.groups_per_batch": 1,
    "scores.checkpoint_batches": 3,
    "regimes": {"distill": {"kind": "distill_reverse_kl", "teacher": "stale"}},
}
PAIR = {**OVERRIDES, "regimes": {**OVERRIDES["regimes"], "rl": {"kind": "rl"}}}  # one pass, distill leads
INSTANCE = "regime.distill"


def _digests(store: Path) -> dict[str, str]:
    return {
        str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(store.rglob("*"))
        if p.is_file() and p.name != "zarr.json"
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """overrides -> the config of an uninterrupted tiny pipeline with them; each distinct overrides is computed
    once per module."""
    computed: dict[str, object] = {}

    def config(overrides: dict):
        key = json.dumps(overrides, sort_keys=True)
        if key not in computed:
            cfg = tiny_config(str(tmp_path_factory.mktemp("reference")), **overrides)
            run_planned(cfg)
            computed[key] = cfg
        return computed[key]

    return config


@pytest.mark.slow
@pytest.mark.parametrize(("kill_after", "overrides"), [(1, OVERRIDES), (4, OVERRIDES), (1, PAIR)])
def test_regime_fold_killed_then_resumed_is_byte_identical(reference, tmp_path, kill_after, overrides):
    """On a root holding the uninterrupted run's base model and rollouts, a child process runs the regime
    pass and SIGKILLs itself at the batch mark that follows ``kill_after`` marks; no fold is complete, the
    rerun computes the pass and every fold's scores store equals the uninterrupted run's byte for byte."""
    from tasks.specs import plan

    cfg = reference(overrides)
    ref_root = Path(cfg.root)
    root = tmp_path / "killed"
    killed = tiny_config(str(root), **overrides)
    for name in plan(killed):  # the uninterrupted run's base model and rollouts
        if name.startswith(("base_model", "rollouts")):
            ref = plan(cfg)[name].ref
            shutil.copytree(ref_root / ref.stage / ref.key, root / ref.stage / ref.key)
    with forked.start(
        forked.seamed_run, str(root), overrides, {INSTANCE}, "storage.stores.scores", kill_at_mark=kill_after
    ) as child:
        assert child.wait() == forked.KILLED, child.output()
    names = [f"regime.{n}" for n in overrides["regimes"]]
    for name in names:
        step = plan(killed)[name]
        assert not (root / step.ref.stage / step.ref.key / "_COMPLETE.json").exists(), name
    assert run_planned(killed, set(names))[INSTANCE].computed
    for name in names:
        step, want = plan(killed)[name], plan(cfg)[name].ref
        assert step.ref.key == want.key
        art = root / step.ref.stage / step.ref.key
        assert _digests(art / "scores.zarr") == _digests(ref_root / want.stage / want.key / "scores.zarr"), name
