"""Deployment runs: the ``config`` a run passes is laid over the deployment's default ``config``.

Prefect replaces a deployment's parameter wholesale when a run passes it, so ``--params '{"config":
{"name": "mine", "model": {"path": ...}}}'`` on the user-model deployment would drop its ``root`` and
write into the checkout. ``deployment_config`` restores the defaults for every key the run did not
set (pydantic records which fields were given); named maps (``rollouts.samplers``) are replaced as a
whole, since merging them would add samplers the run did not ask for.
"""

from __future__ import annotations

from typing import Any

from covgrad.config import PipelineConfig, read_config_file

REPLACED = ("samplers",)  # maps of named entries: the run's map replaces the default one


def deep_merge(defaults: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """``defaults`` with ``override`` laid over it, recursing into sections (not into ``REPLACED`` maps)."""
    out = dict(defaults)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key not in REPLACED:
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def merge_config(defaults: dict[str, Any], config: PipelineConfig) -> PipelineConfig:
    """The deployment's default config (a JSON dict) with the fields ``config`` set explicitly over it."""
    return PipelineConfig.model_validate(deep_merge(defaults, config.model_dump(mode="json", exclude_unset=True)))


def deployment_config(config: PipelineConfig) -> PipelineConfig:
    """Inside a top-level deployment run: ``merge_config`` with that deployment's default config.
    Elsewhere (a direct call, a subflow, a deployment without a default config): ``config`` as given."""
    from prefect.client.orchestration import get_client
    from prefect.runtime import deployment, flow_run

    if deployment.id is None or flow_run.parent_flow_run_id:
        return config
    with get_client(sync_client=True) as client:
        defaults = client.read_deployment(deployment.id).parameters.get("config")
    return merge_config(defaults, config) if isinstance(defaults, dict) else config


def run_config(config: PipelineConfig, config_file: str | None) -> PipelineConfig:
    """The config a pipeline run computes: ``config`` with a deployment's defaults restored
    (``deployment_config``), laid over the YAML file ``config_file`` (relative to the working directory)
    when one is given, so a deployment can point at a config file instead of copying it."""
    config = deployment_config(config)
    return config if config_file is None else merge_config(read_config_file(config_file), config)
