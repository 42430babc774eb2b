"""``covgrad run``'s trackers (config section ``trackers``, docs/formats.md): after the stages, the run's scalars
(``covgrad.report.trackers.run_scalars``: the report's headline numbers at step 0, each trajectory's per-step
metrics at the run's own steps) go to every selected tracker. TensorBoard is the one supported: the scalars of one
run are written once, into ``<folder>/<name>-<run key>/``, with ``torch.utils.tensorboard.SummaryWriter``; a run
logged before (its folder holds :data:`LOGGED`) is not written again. A selected tracker whose package is missing
fails the run before any stage, in one line naming the extra.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from covgrad.config import PipelineConfig
from covgrad.report.trackers import Scalar, run_scalars
from storage.artifacts import ArtifactStore
from storage.stores.reports import RunArtifacts, report_numbers

LOGGED = "covgrad-logged.json"  # written last into a run's TensorBoard folder: what was logged there
EVENTS = "events.out.tfevents."


def check_trackers(cfg: PipelineConfig) -> None:
    """ImportError in one line naming the extra when a selected tracker's package is not installed."""
    if cfg.trackers.tensorboard is None:
        return
    try:
        import tensorboard  # noqa: F401  (torch.utils.tensorboard needs it)
    except ImportError:
        raise ImportError(
            "trackers.tensorboard needs the tensorboard package: pip install 'covgrad[tensorboard]'"
        ) from None


def log_trackers(cfg: PipelineConfig, store: ArtifactStore, refs: dict[str, Any], run_key: str) -> list[str]:
    """Write the scalars of the run (``refs``: instance -> ref of its artifacts, the report's among them; ``run_key``:
    ``tasks.specs.Plan.run_key``) to the selected trackers; prints and returns one line per tracker saying where."""
    if cfg.trackers.tensorboard is None:
        return []
    folder = Path(cfg.trackers.tensorboard) / f"{cfg.name}-{run_key[:12]}"
    if (folder / LOGGED).is_file():
        line = f"tensorboard: {folder} (logged before)"
    else:
        index = {"artifacts": {n: {"stage": r.stage, "key": r.key} for n, r in refs.items()}}
        report = report_numbers(store, refs["report"]) if "report" in refs else None
        scalars = run_scalars(RunArtifacts(store, index), (report or {}).get("numbers") or {})
        write_tensorboard(folder, scalars)
        line = f"tensorboard: {folder} ({len(scalars)} scalars)"
    print(f"trackers: {line}")
    return [line]


def write_tensorboard(folder: Path, scalars: list[Scalar]) -> None:
    """``scalars`` as TensorBoard event data in ``folder`` (one ``add_scalar`` each, in order; event files an
    interrupted earlier write left there are removed first), then :data:`LOGGED` with the tags written."""
    from torch.utils.tensorboard import SummaryWriter

    folder.mkdir(parents=True, exist_ok=True)
    for partial in folder.glob(f"{EVENTS}*"):
        partial.unlink()
    writer = SummaryWriter(log_dir=str(folder))
    try:
        for s in scalars:
            writer.add_scalar(s.tag, s.value, s.step)
    finally:
        writer.close()
    tags = sorted({s.tag for s in scalars})
    (folder / LOGGED).write_text(json.dumps({"scalars": len(scalars), "tags": tags}, indent=1))
