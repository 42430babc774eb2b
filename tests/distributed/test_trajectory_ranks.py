"""The trajectory stage with the model sharded over 2 gloo ranks (scores.ranks=2, tasks/jobs/trajectory_ranks.py) on the
tiny pipeline: the same key and the same bytes as in-process (records, changed sets, per-step arrays, checkpoints),
on-policy sampling from the sharded model included; a rank SIGKILLed mid-run is named in one line and the rerun
resumes every rank from the newest state all of them hold, to the same bytes."""

import shutil
from functools import partial
from pathlib import Path

import pytest

from covgrad.distributed.launch import RankFailedError
from storage.artifacts import ArtifactStore
from tasks.specs import plan
from tests.helpers.fsdp_ranks import killing_trajectory_rank
from tests.helpers.pipeline import run_planned, tiny_config
from tests.helpers.trajectory import OVERRIDES, digests

RANKS = {"scores.ranks": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny pipeline's trajectory in-process, and on 2 ranks from a copy of the in-process upstream artifacts
    (ranks are placement: the same keys, so only the trajectory is computed again)."""
    in_process, ranks = tmp_path_factory.mktemp("in-process"), tmp_path_factory.mktemp("ranks")
    assert run_planned(tiny_config(str(in_process), **OVERRIDES))["trajectory"].computed
    shutil.copytree(in_process, ranks, ignore=shutil.ignore_patterns("trajectory"), dirs_exist_ok=True)
    results = run_planned(tiny_config(str(ranks), **OVERRIDES, **RANKS))
    assert [name for name, r in results.items() if r.computed] == ["trajectory", "report"]  # the config changed
    return in_process, ranks


def _artifact(root: Path, **extra: object) -> Path:
    ref = plan(tiny_config(str(root), **OVERRIDES, **extra))["trajectory"].ref
    return root / ref.stage / ref.key


@pytest.mark.slow
def test_two_ranks_give_the_in_process_artifact(runs):
    in_process, ranks = runs
    spec = plan(tiny_config(str(ranks), **OVERRIDES, **RANKS))["trajectory"].spec
    assert (spec.placement.launcher, spec.placement.ranks) == ("local", 2)
    assert "ranks" not in plan(tiny_config(str(in_process), **OVERRIDES))["trajectory"].spec.model_dump()
    assert _artifact(in_process).name == _artifact(ranks, **RANKS).name  # ranks are placement
    want, got = digests(_artifact(in_process)), digests(_artifact(ranks, **RANKS))
    assert any(name.startswith("checkpoints/") for name in want)
    assert sorted(got) == sorted(want)
    assert [name for name in want if got[name] != want[name]] == []
    assert not (_artifact(ranks, **RANKS) / "state").exists()


@pytest.mark.slow
def test_a_killed_rank_is_named_and_the_rerun_resumes_to_the_same_bytes(runs, tmp_path: Path, monkeypatch):
    """Rank 1 SIGKILLs itself once both ranks hold their state of step 4: the stage fails in one line naming it,
    nothing is marked complete; the rerun resumes both ranks at step 4 and ends with the in-process bytes."""
    in_process, ranks = runs
    root = tmp_path / "root"
    shutil.copytree(ranks, root, ignore=shutil.ignore_patterns("trajectory"))
    log = tmp_path / "resumed.log"
    rank_main = "tasks.jobs.trajectory_ranks.trajectory_rank"
    monkeypatch.setattr(rank_main, partial(killing_trajectory_rank, log=str(log), kill=(1, 4)))
    cfg = tiny_config(str(root), **OVERRIDES, **RANKS)
    with pytest.raises(RankFailedError) as info:
        run_planned(cfg)
    assert str(info.value) == "rank 1 of 2 was killed by SIGKILL; rerun to resume from the checkpoints"
    assert not ArtifactStore(cfg.root).is_complete(plan(cfg)["trajectory"].ref)
    assert sorted(log.read_text().splitlines()) == ["0 0", "1 0"]
    log.write_text("")
    monkeypatch.setattr(rank_main, partial(killing_trajectory_rank, log=str(log), kill=None))
    assert run_planned(cfg)["trajectory"].computed
    assert sorted(log.read_text().splitlines()) == ["0 4", "1 4"]
    want, got = digests(_artifact(in_process)), digests(_artifact(root, **RANKS))
    assert [name for name in want if got.get(name) != want[name]] == []


# a distillation towards a sharpened copy of the policy (its teacher loaded without weights on rank 1) and SFT on the
# stale sampler's rollouts (fixed data), as tests/stages/test_trajectory_regime_stage.py runs them in-process
REGIMES = {
    "sharpen": {"kind": "distill_reverse_kl", "teacher": "policy", "teacher_temperature": 0.5},
    "sft": {"kind": "sft_sampled", "sampler": "stale"},
}
REGIME_OVERRIDES = {
    "tokens.enabled": False,
    "update_check.enabled": False,
    "regimes": REGIMES,
    "trajectory.enabled": True,
    "trajectory.steps": 3,
    "trajectory.prompts_per_step": 2,
    "trajectory.grid": {
        "sharpen-adam-bf16": {"regime": "sharpen", "optimizer": "adam", "precision": "bf16", "lr": 1e-3},
        "sft-sgd-fp32": {"regime": "sft", "optimizer": "sgd", "precision": "fp32", "lr": 1e-2},
    },
}


@pytest.mark.slow
def test_regime_trajectories_on_two_ranks_are_the_in_process_artifacts(tmp_path: Path):
    in_process, ranks = tmp_path / "in-process", tmp_path / "ranks"
    assert run_planned(tiny_config(str(in_process), **REGIME_OVERRIDES))
    shutil.copytree(in_process, ranks, ignore=shutil.ignore_patterns("trajectory"))
    results = run_planned(tiny_config(str(ranks), **REGIME_OVERRIDES, **RANKS))
    cells = [f"trajectory.{cell}" for cell in REGIME_OVERRIDES["trajectory.grid"]]
    assert all(results[c].computed for c in cells)
    for cell in cells:
        ref = plan(tiny_config(str(ranks), **REGIME_OVERRIDES, **RANKS))[cell].ref
        want, got = digests(in_process / ref.stage / ref.key), digests(ranks / ref.stage / ref.key)
        assert sorted(got) == sorted(want) and [n for n in want if got[n] != want[n]] == [], cell
