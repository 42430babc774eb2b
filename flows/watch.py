"""The ``covgrad-watch`` flow: analyse every new checkpoint that appears in a directory.

A checkpoint is a subdirectory holding a Hugging Face ``config.json`` (and weights and tokenizer).
For each one the flow runs ``covgrad-pipeline`` as a subflow with ``model.path`` set to it. A
checkpoint whose planned artifacts are all complete is skipped without starting a subflow; the
artifact keys cover the checkpoint's fingerprint, so a rewritten checkpoint is analysed again.
Analysed checkpoints are recorded in ``{root}/watch/{config.name}.json``, each with its ``finding``: the
degenerate condition of its statistics in words (e.g. no reward variance on a fresh checkpoint), or null.

No ``from __future__ import annotations`` here: Prefect builds the parameter schema from the
annotations at import time.
"""

import fnmatch
import re
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from covgrad.config import PipelineConfig
from flows.pipeline import covgrad_pipeline
from storage.artifacts import ArtifactStore, now
from storage.runs import read_watch_record, write_watch_record
from storage.schema import STATS
from tasks.specs import plan


def find_checkpoints(directory: str, pattern: str = "*") -> list[Path]:
    """Subdirectories of ``directory`` whose name matches ``pattern`` and that hold a config.json, sorted."""
    root = Path(directory)
    if not root.is_dir():
        raise ValueError(f"watch directory {directory!r} does not exist; create it or pass another directory")
    return sorted(
        p for p in root.iterdir() if p.is_dir() and fnmatch.fnmatch(p.name, pattern) and (p / "config.json").is_file()
    )


def checkpoint_config(config: PipelineConfig, checkpoint: Path) -> PipelineConfig:
    """``config`` with ``model.path`` = the checkpoint and the run named ``{config.name}-{checkpoint}``."""
    data = config.model_dump(mode="json")
    data["model"]["path"] = str(checkpoint.resolve())
    data["name"] = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{config.name}-{checkpoint.name}")
    return PipelineConfig.model_validate(data)


def is_analysed(cfg: PipelineConfig) -> bool:
    """True when every artifact planned for ``cfg`` is complete."""
    store = ArtifactStore(cfg.root)
    return all(store.is_complete(step.ref) for step in plan(cfg).values())


def finding(cfg: PipelineConfig) -> str | None:
    """The degenerate condition the run's main statistics recorded (e.g. "no reward variance: G ≡ 0;
    ..."), or None when the statistics carry a finding about G."""
    store = ArtifactStore(cfg.root)
    return store.open_group(plan(cfg).main.ref, STATS, mode="r").attrs.get("degenerate")


@flow(name="covgrad-watch", log_prints=True)
def covgrad_watch(
    directory: str,
    config: PipelineConfig = PipelineConfig(),  # noqa: B008
    pattern: str = "*",
) -> dict[str, Any]:
    """Run the pipeline on each checkpoint under ``directory`` (names matching ``pattern``) that is
    not analysed yet. Returns ``{"analysed": [...], "skipped": [...], "runs": {checkpoint: run key}}``;
    raises after the loop when any checkpoint's pipeline failed, naming them."""
    logger = get_run_logger()
    store = ArtifactStore(config.root)
    record = read_watch_record(store, config.name)
    analysed: list[str] = []
    skipped: list[str] = []
    failed: list[str] = []
    runs: dict[str, str] = {}
    for checkpoint in find_checkpoints(directory, pattern):
        cfg = checkpoint_config(config, checkpoint)
        key = plan(cfg).run_key
        runs[checkpoint.name] = key
        if is_analysed(cfg):
            skipped.append(checkpoint.name)
        else:
            state = covgrad_pipeline(config=cfg, return_state=True)
            if not state.is_completed():
                logger.error("checkpoint %s: pipeline ended %s", checkpoint, state.name)
                failed.append(checkpoint.name)
                continue
            analysed.append(checkpoint.name)
        note = finding(cfg)
        if note:
            logger.warning("checkpoint %s: %s", checkpoint.name, note)
        entry = record.get(checkpoint.name, {})
        if entry.get("run") != key or entry.get("finding") != note:
            record[checkpoint.name] = {
                "path": str(checkpoint.resolve()),
                "run": key,
                "analysed": now(),
                "finding": note,
            }
            write_watch_record(store, config.name, record)
    print(f"watch {directory}: {len(analysed)} analysed, {len(skipped)} already analysed, {len(failed)} failed")
    if failed:
        raise RuntimeError(f"pipeline failed for checkpoints {failed}; see their subflow runs")
    return {"analysed": analysed, "skipped": skipped, "runs": runs}
