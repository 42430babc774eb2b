"""report stage: render the run's report (``covgrad.report``) from every upstream artifact, write its
files (``storage.stores.reports``) and publish it as Prefect artifacts."""

from __future__ import annotations

import re
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.context import FlowRunContext, TaskRunContext

from covgrad.config import PipelineConfig, current_layout
from covgrad.report import Report, render_report
from covgrad.report.document import cell
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.stores.reports import RunArtifacts, write_report
from tasks.common import StageResult, log, run_stage
from tasks.specs import ReportSpec, main_stats


def artifact_key(text: str) -> str:
    """A valid Prefect artifact key (lowercase letters, digits, dashes) made from ``text``."""
    return re.sub(r"-+", "-", re.sub(r"[^a-z0-9-]", "-", text.lower())).strip("-")


def render_run(store: ArtifactStore, index: dict[str, Any]) -> Report:
    """The report of a run index (``name``, ``config``, ``artifacts``) from the stores under ``store``."""
    config = current_layout(index["config"])
    cfg = PipelineConfig.model_validate(config)
    main = str(main_stats(cfg))
    return render_report(RunArtifacts(store, index), config, index.get("name", cfg.name), main)


def publish(report: Report, name: str) -> None:
    """Prefect artifacts (the report's markdown without images, the headline table); only inside a
    flow or task run, where Prefect records them."""
    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return
    text = "\n".join(line for line in report.markdown().splitlines() if not line.startswith("!["))
    create_markdown_artifact(key=artifact_key(f"covgrad-report-{name}"), markdown=text, description="covgrad report")
    table = [{k: cell(v) for k, v in r.items()} for r in report.headline]
    create_table_artifact(key=artifact_key(f"covgrad-headline-{name}"), table=table, description="covgrad headline")


@task(name="report")
def report_task(ref: ArtifactRef, spec: ReportSpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """Render the run's report from every upstream artifact (``upstream``: by instance name)."""

    def compute(store: ArtifactStore, r: ArtifactRef) -> None:
        artifacts = {n: {"stage": u.stage, "key": u.key} for n, u in upstream.items()}
        report = render_run(store, {"name": spec.name, "config": spec.config, "artifacts": artifacts})
        write_report(store.fs, store.path(r), report)
        publish(report, spec.name)
        log.info("report: %d plot(s), missing %s", len(report.plots), report.missing or "nothing")

    return run_stage(ref, spec, compute)
