"""A regime fold killed between checkpoints resumes byte-identical to an uninterrupted run (its moment state,
checkpoint progress and bound arrays), like a scores artifact (tests/test_resume.py); so does a pass of two
folds killed after the first fold's checkpoint and before the second's (they resume from different batches)."""

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.pipeline import REPO, run_planned, tiny_config

OVERRIDES = {
    "tokens.enabled": False,
    "update_check.enabled": False,
    "scores.groups_per_batch": 1,
    "scores.checkpoint_batches": 3,
    "regimes": {"distill": {"kind": "distill_reverse_kl", "teacher": "stale"}},
}
PAIR = {**OVERRIDES, "regimes": {**OVERRIDES["regimes"], "rl": {"kind": "rl"}}}  # one pass, distill leads
INSTANCE = "regime.distill"

CHILD = r"""
import json, os, signal, sys
import storage.scores as module
import tests.conftest as conftest

root, kill_after, overrides = sys.argv[1:4]  # kill at mark call kill_after (the first checkpoint's second)
cfg = conftest.tiny_config(root, **json.loads(overrides))
real_mark, calls = module.mark_batch_done, []

def mark(group, b):
    if len(calls) == int(kill_after):
        os.kill(os.getpid(), signal.SIGKILL)
    calls.append(b)
    real_mark(group, b)

module.mark_batch_done = mark
conftest.run_planned(cfg, {"regime.distill"})
"""


def _digests(store: Path) -> dict[str, str]:
    return {
        str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(store.rglob("*"))
        if p.is_file() and p.name != "zarr.json"
    }


@pytest.mark.slow
@pytest.mark.parametrize(("kill_after", "overrides"), [(1, OVERRIDES), (4, OVERRIDES), (1, PAIR)])
def test_regime_fold_killed_then_resumed_is_byte_identical(tmp_path, kill_after, overrides):
    from tasks.specs import plan

    ref_root, root = tmp_path / "ref", tmp_path / "killed"
    cfg = tiny_config(str(ref_root), **overrides)
    run_planned(cfg)
    killed = tiny_config(str(root), **overrides)
    upstream = {n for n in plan(killed) if n.startswith(("base_model", "rollouts"))}
    run_planned(killed, upstream)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(kill_after), json.dumps(overrides)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr[-2000:]
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
