"""``covgrad run``'s trackers (config section ``trackers``, docs/formats.md): after the stages, the run's scalars
(``covgrad.report.trackers.run_scalars``: the report's headline numbers at step 0, each trajectory's per-step
metrics at the run's own steps) go to every selected tracker, each a field of ``trackers`` naming a folder
(:data:`TRACKERS`):

- ``tensorboard``: event files written with ``torch.utils.tensorboard.SummaryWriter`` (extra ``tensorboard``);
- ``wandb``: a W&B offline run (``wandb.init(mode="offline")``, extra ``wandb``): ``wandb/offline-run-*/`` with
  its ``run-<id>.wandb`` file, which ``wandb sync`` uploads later; nothing goes over the network;
- ``mlflow``: one MLflow run in a local SQLite store ``mlflow.db`` (MLflow's default backend since 3.7; its file
  store ``./mlruns`` is in maintenance mode and refused by MLflow 3.18 without an opt-in), written with
  ``MlflowClient`` (extra ``mlflow``, the ``mlflow-skinny`` package); ``mlflow ui --backend-store-uri
  sqlite:///<folder>/mlflow.db`` shows it, ``mlflow.MlflowClient`` reads it; no server, no network;
- ``trackio``: one trackio run in the project database ``covgrad.db``, written with ``trackio.init``/``log``/
  ``finish`` (extra ``trackio``) in a child process whose trackio folder (``TRACKIO_DIR``) is the run's folder;
  ``TRACKIO_DIR=<folder> trackio show --project covgrad`` shows it; no server, no browser, no network.

The scalars of one run are written once per tracker, into ``<folder>/<name>-<run key[:12]>/``; a run logged before
(that folder holds :data:`LOGGED`, written last) is not written again, and what an interrupted write left there is
removed first. A selected tracker whose package is missing fails the run before any stage, in one line naming the
extra.
"""

from __future__ import annotations

import importlib
import json
import shutil
import time
from collections.abc import Callable
from itertools import groupby
from pathlib import Path
from typing import Any

from covgrad.config import PipelineConfig
from covgrad.report.trackers import PREFIX, Scalar, run_scalars
from storage.artifacts import ArtifactStore
from storage.stores.history import run_trackio
from storage.stores.reports import RunArtifacts, report_numbers

LOGGED = "covgrad-logged.json"  # written last into a run's tracker folder: what was logged there
EVENTS = "events.out.tfevents."
WANDB_DIR = "wandb"  # the folder wandb.init(dir=...) writes its runs into
MLFLOW_DB = "mlflow.db"  # the SQLite store write_mlflow writes a run's folder's MLflow run into
TRACKIO_DB = f"{PREFIX}.db"  # the database of trackio project ``covgrad`` (in its TRACKIO_DIR, the run's folder)
# write_trackio's child (storage.stores.history.run_trackio): the run logged and finished, then counted back
TRACKIO_LOG = """import trackio
from trackio.sqlite_storage import SQLiteStorage
project = request["project"]
run = trackio.init(project=project, name=request["name"], embed=False, auto_log_cpu=False, auto_log_gpu=False)
for step, metrics in request["logs"]:
    trackio.log(metrics, step=step)
trackio.finish()
stored = SQLiteStorage.get_logs(project, run=run.name, run_id=run.id)
if len(stored) != len(request["logs"]):
    sys.exit(f"trackio stored {len(stored)} of the run's {len(request['logs'])} logs")
json.dump(run.id, out)
"""


def write_tensorboard(folder: Path, scalars: list[Scalar]) -> None:
    """``scalars`` as TensorBoard event data in ``folder`` (one ``add_scalar`` each, in order; event files an
    interrupted earlier write left there are removed first)."""
    from torch.utils.tensorboard import SummaryWriter

    for partial in folder.glob(f"{EVENTS}*"):
        partial.unlink()
    writer = SummaryWriter(log_dir=str(folder))
    try:
        for s in scalars:
            writer.add_scalar(s.tag, s.value, s.step)
    finally:
        writer.close()


def write_wandb(folder: Path, scalars: list[Scalar]) -> None:
    """``scalars`` as one W&B offline run under ``folder/wandb/`` (project ``covgrad``, run name and id the
    folder's name; a ``wandb`` folder an interrupted earlier write left is removed first): one ``run.log`` per
    step, ascending, with ``step=`` the scalars' step, so W&B's ``_step`` is the run's own step; values keep
    float64. The process's W&B service is then shut down (``wandb.teardown``), which returns once the run file is
    complete: ``run.finish()`` alone can return before wandb-core has written the history records (a run file of
    its 7-byte header was read back in a test process), so a W&B run the process had open ends here too."""
    import wandb

    shutil.rmtree(folder / WANDB_DIR, ignore_errors=True)
    settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True, save_code=False)
    run = wandb.init(
        mode="offline",
        dir=str(folder),
        project=PREFIX,
        name=folder.name,
        id=folder.name,
        settings=settings,
    )
    try:
        for step, points in groupby(sorted(scalars, key=lambda s: s.step), key=lambda s: s.step):
            run.log({s.tag: s.value for s in points}, step=step)
    finally:
        run.finish()
        wandb.teardown()


def write_mlflow(folder: Path, scalars: list[Scalar]) -> None:
    """``scalars`` as one finished MLflow run in the SQLite store ``folder/mlflow.db`` (experiment ``covgrad``, run
    name the folder's name; a store an interrupted earlier write left is removed first): every scalar a metric
    with MLflow's ``step`` the scalars' step, logged by ``MlflowClient.log_batch`` in batches of MLflow's limit
    (1000 metrics), timestamps the write's time in ms; values keep float64 (the store's ``value`` column is a
    double). Nothing but the store is written: no artifacts, no tracking URI or active run set in the process."""
    from mlflow import MlflowClient
    from mlflow.entities import Metric, RunStatus
    from mlflow.utils.validation import MAX_METRICS_PER_BATCH

    db = folder / MLFLOW_DB
    db.unlink(missing_ok=True)
    client = MlflowClient(tracking_uri=f"sqlite:///{db.resolve()}")
    experiment = client.create_experiment(PREFIX, artifact_location=(folder / "artifacts").resolve().as_uri())
    run_id = client.create_run(experiment, run_name=folder.name).info.run_id
    now_ms = int(time.time() * 1000)
    metrics = [Metric(s.tag, s.value, now_ms, s.step) for s in scalars]
    for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=metrics[start : start + MAX_METRICS_PER_BATCH])
    client.set_terminated(run_id, RunStatus.to_string(RunStatus.FINISHED))


def write_trackio(folder: Path, scalars: list[Scalar]) -> None:
    """``scalars`` as one finished trackio run in ``folder/covgrad.db`` (project ``covgrad``, run name the folder's
    name; the database, its SQLite side files and lock an interrupted earlier write left are removed first): one
    ``trackio.log`` per step, ascending, with ``step=`` the scalars' step; values keep float64 (trackio stores each
    log as JSON, NaN and infinities as its ``"NaN"``/``"Infinity"`` strings). Written in a child process whose
    ``TRACKIO_DIR`` is ``folder`` (``storage.stores.history.run_trackio``: trackio reads it once, on import), with no
    CPU/GPU monitor, dashboard or remote; RuntimeError with the child's last line when trackio stored fewer logs
    than it was given (``trackio.log`` only warns when it fails)."""
    for stale in folder.glob(f"{PREFIX}.*"):
        stale.unlink()
    logs = [
        (step, {s.tag: s.value for s in points})
        for step, points in groupby(sorted(scalars, key=lambda s: s.step), key=lambda s: s.step)
    ]
    run_trackio(folder, TRACKIO_LOG, {"project": PREFIX, "name": folder.name, "logs": logs})


# tracker (a field of the config's ``trackers``) -> (its package and extra, the writer of one run's folder)
TRACKERS: dict[str, tuple[str, Callable[[Path, list[Scalar]], None]]] = {
    "tensorboard": ("tensorboard", write_tensorboard),
    "wandb": ("wandb", write_wandb),
    "mlflow": ("mlflow", write_mlflow),
    "trackio": ("trackio", write_trackio),
}


def selected(cfg: PipelineConfig) -> dict[str, str]:
    """Tracker -> folder of every tracker that ``cfg.trackers`` sets."""
    return {name: folder for name, folder in cfg.trackers.model_dump().items() if folder is not None}


def check_trackers(cfg: PipelineConfig) -> None:
    """ImportError in one line naming the extra when a selected tracker's package is not installed."""
    for name in selected(cfg):
        package = TRACKERS[name][0]
        try:
            importlib.import_module(package)
        except ImportError:
            raise ImportError(
                f"trackers.{name} needs the {package} package: pip install 'covgrad[{package}]'"
            ) from None


def log_trackers(cfg: PipelineConfig, store: ArtifactStore, refs: dict[str, Any], run_key: str) -> list[str]:
    """Write the scalars of the run (``refs``: instance -> ref of its artifacts, the report's among them; ``run_key``:
    ``tasks.specs.Plan.run_key``) to the selected trackers; prints and returns one line per tracker saying where."""
    lines: list[str] = []
    scalars: list[Scalar] | None = None
    for name, root in selected(cfg).items():
        folder = Path(root) / f"{cfg.name}-{run_key[:12]}"
        if (folder / LOGGED).is_file():
            lines.append(f"{name}: {folder} (logged before)")
            continue
        if scalars is None:
            index = {"artifacts": {n: {"stage": r.stage, "key": r.key} for n, r in refs.items()}}
            report = report_numbers(store, refs["report"]) if "report" in refs else None
            scalars = run_scalars(RunArtifacts(store, index), (report or {}).get("numbers") or {})
        folder.mkdir(parents=True, exist_ok=True)
        TRACKERS[name][1](folder, scalars)
        tags = sorted({s.tag for s in scalars})
        (folder / LOGGED).write_text(json.dumps({"scalars": len(scalars), "tags": tags}, indent=1))
        lines.append(f"{name}: {folder} ({len(scalars)} scalars)")
    for line in lines:
        print(f"trackers: {line}")
    return lines
