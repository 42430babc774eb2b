"""The tiny pipeline for tests: its config with overrides, the instances below one, and its stages run by their task
bodies in the flow's order (no Prefect engine)."""

from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]


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
