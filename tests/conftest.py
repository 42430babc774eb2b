"""Shared fixtures: offline settings before anything imports prefect or transformers, one thread,
a tiny pipeline configuration, one tiny pipeline run per session (``tiny_run``: computed once, read or
copied by the stage, fault, report and CLI tests) and an opt-in Prefect test server.

Tiers: ``make test-fast`` (``-m "not slow and not integration"``, two xdist workers), ``make test`` (everything)."""

from flows.cli import offline_env

offline_env()  # flows.cli imports nothing heavy at module level, so this runs before prefect loads

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import yaml  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
torch.set_num_threads(1)


def tiny_config(root: str, **overrides: object):
    """The tiny pipeline config (configs/tiny.yaml) with ``root`` and dotted-key overrides."""
    from covgrad.config import PipelineConfig, apply_overrides

    data = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    items = [f"root={root}"] + [
        f"{k}={yaml.safe_dump(v, default_flow_style=True).strip()}" for k, v in overrides.items()
    ]
    cleaned = [i.removesuffix("\n...") for i in items]
    return PipelineConfig.model_validate(apply_overrides(data, cleaned))


def below(cfg, instance: str) -> set[str]:
    """``instance`` and every instance of ``cfg``'s plan that reads it, directly or transitively."""
    from tasks.specs import plan

    return plan(cfg).downstream(instance)


def run_planned(cfg, names=None) -> dict:
    """Call the task bodies of ``cfg``'s planned stages (no Prefect engine) in the flow's order: every
    stage, or only the instances in ``names``; returns instance -> StageResult."""
    from flows.pipeline import run_stages
    from tasks.specs import plan

    results = {}

    def call(task, step):
        name = str(step.instance)
        if names is None or name in names:
            results[name] = task.fn(step.ref, step.spec, step.upstream)
        return results.get(name)

    run_stages(plan(cfg), call)
    return results


def status_of(results: dict) -> dict[str, str]:
    """instance -> "computed" / "cached" of ``run_planned``'s results."""
    return {n: "computed" if r.computed else "cached" for n, r in results.items()}


# The tiny pipeline without its optional stages: what most stage, fault and CLI tests run on.
NO_OPTIONAL = {"tokens.enabled": False, "update_check.enabled": False}


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory):
    """(root, plan) of one uninterrupted tiny pipeline (``NO_OPTIONAL``), every stage computed by its task
    body, with its run index. Read-only: a test that changes artifacts copies ``root`` first."""
    from storage.artifacts import ArtifactStore
    from storage.runs import write_run_index
    from tasks.specs import plan

    root = tmp_path_factory.mktemp("tiny-run") / "root"
    cfg = tiny_config(str(root), **NO_OPTIONAL)
    results = run_planned(cfg)
    assert {r.computed for r in results.values()} == {True}
    p = plan(cfg)
    write_run_index(ArtifactStore(cfg.root), cfg, p.run_key, {n: r.ref for n, r in results.items()})
    return root, p


@pytest.fixture(scope="session")
def prefect_server():
    """A temporary Prefect API (SQLite) for tests that run flows; started once per session."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
