"""An external run's tracker history (``trajectory.history``): what its trainer logged per step, read from the
files the stacks write, format detected from what the path holds (:func:`read_history`):

- ``verl``: verl's ``file`` logger (``trainer.logger=[file]``, ``verl/utils/tracking.py`` ``FileLogger``), one JSON
  object a line, ``{"step": global_step, "data": {metric: value, ...}}`` (orjson: NaN as ``null``), written to
  ``$VERL_FILE_LOGGER_PATH`` or ``$VERL_FILE_LOGGER_ROOT/<project>/<experiment>.jsonl``; lines of one step merge
  (validation metrics come on their own line);
- ``tensorboard``: a folder of TensorBoard event files (``events.out.tfevents.*``) or one such file, read with
  TensorBoard's ``EventAccumulator`` (extra ``tensorboard``): verl's ``tensorboard`` logger (the same metric names)
  or the Hugging Face Trainer's ``TensorBoardCallback`` (``train/`` before its log keys);
- ``trainer``: a Hugging Face Trainer's (TRL's) ``trainer_state.json``, or a folder holding one: its
  ``log_history`` entries by ``step``;
- ``wandb``: a W&B run's transaction log, the ``run-<id>.wandb`` file of an offline (or synced) run folder
  ``wandb/offline-run-*/``, or that folder, read with wandb's own reader (``wandb.sdk.internal.datastore``
  and ``wandb.proto``, extra ``wandb``): its ``history`` records, each at the Trainer's ``train/global_step``
  when the record has one (the Hugging Face ``WandbCallback``, ``train/`` before its log keys), else at W&B's
  ``_step`` (verl's ``wandb`` logger and covgrad's own log with ``step=`` the trainer's step);
- ``mlflow``: an MLflow run read with MLflow's own client (``MlflowClient.get_metric_history``, extra ``mlflow``):
  a SQLite store (MLflow's default ``mlflow.db`` since 3.7, or a folder holding one: covgrad's ``trackers.mlflow``
  output) with one active run, or ``<store>#<run id>`` for one of several, or a run folder
  ``mlruns/<experiment>/<run id>/`` of MLflow's legacy file store (read only where ``MLFLOW_ALLOW_FILE_STORE=true``
  is set, MLflow 3's opt-in); every metric at its ``step`` (verl's ``mlflow`` logger logs ``step=global_steps``,
  the Hugging Face ``MLflowCallback`` ``step=global_step`` with its log keys as they are);
- ``trackio``: a trackio run read with trackio's own reader (``SQLiteStorage.get_run_records`` and ``get_logs``,
  extra ``trackio``): a project database ``<project>.db`` (trackio keeps one per project in its ``TRACKIO_DIR``;
  covgrad's ``trackers.trackio`` writes ``covgrad.db``), or a folder holding one, with one run, or
  ``<database>#<run name or id>`` for one of several; each log at its ``train/global_step`` when it has one (the
  Hugging Face ``TrackioCallback``, ``train/`` before its log keys), else at trackio's ``step`` (verl's ``trackio``
  logger logs ``step=global_steps``; covgrad's own log the trainer's step).

Each format's records become per-step columns (:data:`COLUMNS`: the first key of a column found in the file is the
one read) and a ``mismatch_*`` column for every rollout-mismatch metric the stack logged (:data:`MISMATCH`, the
names ``covgrad.rollouts.mismatch`` computes). A step is the trainer's step: verl's ``global_steps`` and the
Trainer's ``global_step`` both count optimizer steps from 1, and both log at step t the learning rate step t used.
Malformed input is refused in one line naming the file (and line).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import sqlite3
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from storage.stores.external import TRAINER_STATE

# covgrad column -> the keys the stacks log it under (verl's first, then the Trainer's / TRL's)
COLUMNS: dict[str, tuple[str, ...]] = {
    "lr": ("actor/lr", "learning_rate"),
    "loss": ("actor/pg_loss", "loss"),
    "grad_norm": ("actor/grad_norm", "grad_norm"),
    "kl": ("actor/kl_loss", "kl"),
    "reward": ("critic/score/mean", "reward"),
}
# the key prefixes of rollout-mismatch metrics: verl's debug metrics and rollout correction, prime-rl's mismatch KL,
# TRL's vLLM importance sampling (covgrad.rollouts.mismatch computes each under the same name)
MISMATCH = (
    "training/rollout_probs_diff_",
    "training/rollout_actor_probs_pearson_corr",
    "rollout_corr/",
    "mismatch_kl/",
    "sampling/sampling_logp_difference/",
    "sampling/importance_sampling_ratio/",
)
TRAINER_PREFIX = "train/"  # transformers' rewrite_logs puts it before every training log key (TensorBoard, W&B)
EVENTS = "events.out.tfevents."  # the name of every TensorBoard event file begins so
WANDB_FILE = "run-*.wandb"  # a W&B run folder's transaction log
WANDB_STEP = "train/global_step"  # the Trainer's W&B and trackio callbacks log its step here (theirs count logs)
MLFLOW_DB = "mlflow.db"  # MLflow's default SQLite store (and the one covgrad's trackers.mlflow writes)
SQLITE_HEADER = b"SQLite format 3\x00"  # the first 16 bytes of every SQLite database file
MLFLOW_TABLES = {"experiments", "runs", "metrics", "alembic_version"}  # an MLflow SQLite store has these
FILE_STORE_RUN = ("meta.yaml", "metrics")  # what a run folder of MLflow's file store holds
TRACKIO_DB = "*.db"  # a trackio project's database in its TRACKIO_DIR: <project>.db
TRACKIO_METRICS = {"run_name", "step", "metrics", "timestamp"}  # columns of a trackio database's metrics table
TRACKIO_ADDED = ("step", "timestamp")  # what trackio's get_logs adds to each log (a logged key of either is "__"-ed)
# the environment of a child process that runs trackio: its SQLite store only (never the JSONL inbox it picks on a
# network filesystem), the Hugging Face Hub offline (trackio asks it for the user's name), no remote settings
TRACKIO_LOCAL = {"TRACKIO_STORAGE_MODE": "sqlite", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"}
TRACKIO_REMOTE = ("SYSTEM", "SPACE_ID", "SPACE_REPO_NAME", "SPACE_HOST")  # trackio's Spaces settings: dropped
TRACKIO_JOURNAL = "TRACKIO_SQLITE_JOURNAL_MODE"  # the journal mode trackio sets on each connection (default WAL)
TRACKIO_TIMEOUT_S = 300.0  # at most this long (s) for a trackio child process
# the start of every trackio child's script: its request from stdin, trackio's prints to stderr, ``out`` the reply's
TRACKIO_PRELUDE = "import json, sys\nout, sys.stdout = sys.stdout, sys.stderr\nrequest = json.load(sys.stdin)\n"
# the trackio child of trackio_history: the project's runs and, when one is chosen, its logs (trackio's reader)
TRACKIO_READ = """from trackio.sqlite_storage import SQLiteStorage
runs = SQLiteStorage.get_run_records(request["project"])
chosen = [r for r in runs if request["run"] in (None, r["id"], r["name"])]
one = chosen[0] if len(chosen) == 1 else None
logs = SQLiteStorage.get_logs(request["project"], run=one["name"], run_id=one["id"]) if one else []
json.dump({"runs": runs, "chosen": chosen, "logs": logs}, out)
"""
FORMATS = ("verl", "tensorboard", "trainer", "wandb", "mlflow", "trackio")


@dataclass(frozen=True)
class History:
    """A run's logged history.

    Attributes:
        path: the file or folder read.
        format: one of :data:`FORMATS`.
        values: trainer step -> {column: value} (the columns logged at that step; NaN where the stack logged a
            non-finite value), steps ascending.
        keys: column -> the key the stack logged it under (``mismatch_*`` columns: their metric name).
    """

    path: str
    format: str
    values: dict[int, dict[str, float]]
    keys: dict[str, str]


def mismatch_column(key: str) -> str:
    """The store column of rollout-mismatch metric ``key``: ``mismatch_`` and its name with every run of other
    characters than letters and digits as one ``_`` (``rollout_corr/k3_kl`` -> ``mismatch_rollout_corr_k3_kl``)."""
    return "mismatch_" + re.sub(r"[^0-9A-Za-z]+", "_", key).strip("_")


def read_history(path: str) -> History:
    """The history at ``path`` in the format its contents show (module docstring); ValueError in one line naming
    the file for a path that holds none of them, a malformed record or a history without a known column."""
    store, _, run = path.partition("#")
    if run and not Path(path).exists():
        held = Path(store)
        if _is_trackio_db(held) or (held.is_dir() and not _is_sqlite(held / MLFLOW_DB) and _trackio_dbs(held)):
            return trackio_history(store, run)
        if _is_sqlite(held) or _is_sqlite(held / MLFLOW_DB):
            return mlflow_history(store, run)
    p = Path(path)
    if p.is_dir():
        if any(p.glob(f"{EVENTS}*")):
            return tensorboard_history(str(p))
        if (p / TRAINER_STATE).is_file():
            return trainer_history(str(p / TRAINER_STATE))
        if any(p.glob(WANDB_FILE)):
            return wandb_history(str(p))
        if _is_sqlite(p / MLFLOW_DB) or _is_file_store_run(p):
            return mlflow_history(str(p))
        if _trackio_dbs(p):
            return trackio_history(str(p))
        runs = sorted(d.name for d in p.iterdir() if d.is_dir() and not d.is_symlink() and _is_run(d))
        hint = f"; its subfolders {runs} do: give one run's" if runs else ""
        raise ValueError(
            f"trajectory.history {path!r} holds no TensorBoard event files ({EVENTS}*), no {TRAINER_STATE}, "
            f"no W&B run file ({WANDB_FILE}), no MLflow store ({MLFLOW_DB}), no MLflow file-store run and no "
            f"trackio database ({TRACKIO_DB}){hint}"
        )
    if not p.is_file():
        raise ValueError(f"trajectory.history {path!r} does not exist")
    if p.name.startswith(EVENTS):
        return tensorboard_history(str(p))
    if p.suffix == ".wandb":
        return wandb_history(str(p))
    if _is_trackio_db(p):
        return trackio_history(str(p))
    if _is_sqlite(p):
        return mlflow_history(str(p))
    text = p.read_text(encoding="utf-8-sig", errors="replace")
    try:
        whole = json.loads(text)
    except ValueError:
        whole = None
    if isinstance(whole, dict) and "log_history" in whole:
        return trainer_history(str(p))
    return verl_history(str(p))


def verl_history(path: str) -> History:
    """A verl ``file`` logger JSONL (module docstring); ValueError naming ``path:line`` for a line that is not a
    JSON object with an integer ``step`` and a ``data`` object, or a known column whose value is not a number."""
    raw: dict[int, dict[str, Any]] = {}
    lines = Path(path).read_text(encoding="utf-8-sig", errors="replace").splitlines()
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            obj = json.loads(line)
        except ValueError as err:
            raise ValueError(f"{where}: not a JSON line of verl's file logger ({err})") from None
        ok = isinstance(obj, dict) and _is_step(obj.get("step")) and isinstance(obj.get("data"), dict)
        if not ok:
            raise ValueError(f'{where}: not a verl file-logger record {{"step": <int>, "data": {{...}}}}')
        raw.setdefault(int(obj["step"]), {}).update({k: (where, v) for k, v in obj["data"].items()})
    return _history(path, "verl", raw)


def tensorboard_history(path: str) -> History:
    """The scalars of a TensorBoard event folder (its own event files, not its subfolders') or event file, by
    TensorBoard's ``EventAccumulator`` (the last value of a step that was logged twice); ``train/`` before a tag is
    dropped (the Trainer's). ImportError in one line naming the extra without the ``tensorboard`` package;
    ValueError naming ``path`` when the reader fails (it skips records it cannot parse: a truncated or foreign
    file reads as no scalars, refused as a history without a known column)."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator
    except ImportError:
        raise ImportError(
            f"trajectory.history {path!r} is TensorBoard's; reading it needs the tensorboard package: "
            "pip install 'covgrad[tensorboard]'"
        ) from None
    accumulator = EventAccumulator(path, size_guidance={SCALARS: 0})
    try:
        accumulator.Reload()
        tags = accumulator.Tags()["scalars"]
        events = {tag: accumulator.Scalars(tag) for tag in tags}
    except Exception as err:  # the event reader raises many kinds on a truncated or foreign file
        raise ValueError(f"{path}: not readable TensorBoard event data ({type(err).__name__}: {err})") from None
    raw: dict[int, dict[str, Any]] = {}
    for tag, scalars in events.items():
        key = tag.removeprefix(TRAINER_PREFIX)
        for e in scalars:
            raw.setdefault(int(e.step), {})[key] = (f"{path} (tag {tag!r}, step {e.step})", float(e.value))
    return _history(path, "tensorboard", raw)


def trainer_history(path: str) -> History:
    """A Hugging Face Trainer's ``trainer_state.json``: its ``log_history`` entries with a ``step``; ValueError naming
    ``path`` for a file that is not a Trainer state or an entry whose known column is not a number."""
    try:
        entries = json.loads(Path(path).read_text())["log_history"]
        if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
            raise TypeError("log_history is not a list of objects")
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path}: not a Trainer state with a log_history list ({err})") from None
    raw: dict[int, dict[str, Any]] = {}
    for i, entry in enumerate(entries):
        if _is_step(entry.get("step")):
            where = f"{path} (log_history[{i}])"
            raw.setdefault(int(entry["step"]), {}).update({k: (where, v) for k, v in entry.items() if k != "step"})
    return _history(path, "trainer", raw)


def wandb_history(path: str) -> History:
    """The ``history`` records of a W&B run file (``run-<id>.wandb``) or of the run folder holding one, read with
    wandb's own reader (``DataStore.scan_data``, each record a ``wandb.proto`` ``Record``): every item's key (a
    nested key's parts joined by ``/``, ``train/`` before a key dropped, W&B's own ``_`` keys left out) at the
    record's ``train/global_step``, else its ``_step``; values as W&B stored them (JSON, float64). ImportError in
    one line naming the extra without wandb or with a wandb that lacks the reader (0.30 and later); ValueError
    naming the file for a folder with several run files or a file the reader refuses (wrong header, a checksum
    or length that fails: a truncated or foreign file)."""
    try:
        from wandb.proto.wandb_internal_pb2 import Record
        from wandb.sdk.internal.datastore import DataStore
    except ImportError:
        raise ImportError(
            f"trajectory.history {path!r} is a W&B run's; reading it needs wandb's offline-file reader (wandb < 0.30): "
            "pip install 'covgrad[wandb]'"
        ) from None
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob(WANDB_FILE))
        if len(files) != 1:
            raise ValueError(f"trajectory.history {path!r} holds {len(files)} W&B run files; give one")
        p = files[0]
    raw: dict[int, dict[str, Any]] = {}
    store = DataStore()
    try:
        store.open_for_scan(str(p))
        while (data := store.scan_data()) is not None:
            record = Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") != "history":
                continue
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            step = items.get(WANDB_STEP, record.history.step.num)
            if not _is_step(step):
                raise ValueError(f"{WANDB_STEP} {step!r} is not a step")
            where = f"{p} (step {step})"
            logged = {k.removeprefix(TRAINER_PREFIX): v for k, v in items.items() if k != WANDB_STEP}
            raw.setdefault(step, {}).update({k: (where, v) for k, v in logged.items() if not k.startswith("_")})
    except Exception as err:  # the reader asserts on a truncated or foreign file; protobuf raises DecodeError
        raise ValueError(f"{p}: not a readable W&B run file ({type(err).__name__}: {err})") from None
    finally:
        store.close()
    return _history(str(p), "wandb", raw)


def mlflow_history(path: str, run_id: str | None = None) -> History:
    """The metrics of one MLflow run, read with MLflow's own client: ``path`` a SQLite store (or a folder holding
    ``mlflow.db``) and ``run_id`` one of its runs (None: its one active run), or a file-store run folder
    ``mlruns/<experiment>/<run id>/``. Each metric's history (``MlflowClient.get_metric_history``) at its ``step``,
    the last value logged at a step (by timestamp) kept, ``train/`` before a key dropped; values as MLflow stored
    them (float64). ImportError in one line naming the extra without mlflow; ValueError in one line naming the path
    for a SQLite file that is no MLflow store (checked read-only first: MLflow's client would create its tables in
    it), a store MLflow refuses (another schema version: ``mlflow db upgrade``), a file-store run without
    MLflow's opt-in, a store without exactly one active run when no run is given, or an unknown run."""
    try:
        from mlflow import MlflowClient
        from mlflow.entities import ViewType
        from mlflow.environment_variables import MLFLOW_ALLOW_FILE_STORE
    except ImportError:
        raise ImportError(
            f"trajectory.history {path!r} is an MLflow run's; reading it needs the mlflow package: "
            "pip install 'covgrad[mlflow]'"
        ) from None
    p = Path(path)
    if _is_file_store_run(p):
        if not MLFLOW_ALLOW_FILE_STORE.get():
            raise ValueError(
                f"{path}: a run of MLflow's legacy file store, which MLflow 3 reads only with "
                f"MLFLOW_ALLOW_FILE_STORE=true set (or migrate it: mlflow migrate-filestore --source "
                f"{p.parent.parent} --target sqlite:///<path>/{MLFLOW_DB})"
            )
        uri, run_id, where = p.parent.parent.resolve().as_uri(), p.name, str(p)
    else:
        db = p / MLFLOW_DB if p.is_dir() else p
        _check_mlflow_db(db)
        uri, where = f"sqlite:///{db.resolve()}", str(db)
    try:
        client = MlflowClient(tracking_uri=uri)
        if run_id is None:
            experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ACTIVE_ONLY)]
            runs = client.search_runs(experiments, run_view_type=ViewType.ACTIVE_ONLY, max_results=100)
            if len(runs) != 1:
                ids = [r.info.run_id for r in runs]
                raise ValueError(f"{where}: holds {len(runs)} active MLflow runs {ids}; give one as {where}#<run id>")
            run_id = runs[0].info.run_id
        keys = sorted(client.get_run(run_id).data.metrics)
        histories = {key: client.get_metric_history(run_id, key) for key in keys}
    except ValueError:
        raise
    except Exception as err:  # MlflowException, or SQLAlchemy's errors on a damaged database
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ValueError(f"{where}: not a readable MLflow store or run ({type(err).__name__}: {first})") from None
    raw: dict[int, dict[str, Any]] = {}
    for key, metrics in histories.items():
        for m in sorted(metrics, key=lambda m: (m.step, m.timestamp)):
            if not _is_step(m.step):
                raise ValueError(f"{where} (run {run_id}): metric {key!r} is logged at step {m.step!r}, not a step")
            raw.setdefault(m.step, {})[key.removeprefix(TRAINER_PREFIX)] = (f"{where} (run {run_id}, {key})", m.value)
    return _history(where if _is_file_store_run(p) else f"{where}#{run_id}", "mlflow", raw)


def trackio_history(path: str, run: str | None = None) -> History:
    """The logs of one trackio run, read with trackio's own reader (``SQLiteStorage.get_run_records`` and
    ``get_logs``, in a child process: :func:`run_trackio`): ``path`` a project database ``<project>.db`` or a folder
    holding one, ``run`` the name or id of one of its runs (None: its one run). Each log at its ``train/global_step``
    when it has one, else at its trackio ``step``; the logs of one step merge (in trackio's order: timestamp, then
    row), ``train/`` before a key dropped; values as trackio stored them (JSON, float64; its ``"NaN"`` and
    ``"Infinity"`` strings as the floats). ImportError in one line naming the extra without trackio; ValueError in
    one line naming the database for a file that is no trackio database (checked read-only first), a folder
    without exactly one, a database without exactly one run when no run is given (or with several of ``run``'s
    name), an unknown run, or one trackio's reader fails on."""
    if importlib.util.find_spec("trackio") is None:
        raise ImportError(
            f"trajectory.history {path!r} is a trackio run's; reading it needs the trackio package: "
            "pip install 'covgrad[trackio]'"
        )
    p = Path(path)
    if p.is_dir():
        dbs = _trackio_dbs(p)
        if len(dbs) > 1:
            dbs = [db for db in dbs if _is_trackio_db(db)]
        if len(dbs) != 1:
            raise ValueError(
                f"trajectory.history {path!r} holds {len(dbs)} trackio databases {[d.name for d in dbs]}; give one"
            )
        p = dbs[0]
    _check_trackio_db(p)
    # trackio's reader sets its journal mode on every connection (WAL): the database's own keeps its bytes as they are
    ((journal,),) = _sqlite_read(p, "PRAGMA journal_mode")
    try:
        reply = run_trackio(p.parent, TRACKIO_READ, {"project": p.stem, "run": run}, {TRACKIO_JOURNAL: journal})
    except RuntimeError as err:
        raise ValueError(f"{p}: not a readable trackio project ({err})") from None
    runs = [(r["name"], r["id"]) for r in reply["runs"]]
    if len(reply["chosen"]) != 1:
        if run is None:
            wanted = f"holds {len(runs)} trackio runs {runs}; give one as {p}#<run name or id>"
        elif reply["chosen"]:
            wanted = f"holds {len(reply['chosen'])} trackio runs named {run!r}; give one's id: {runs}"
        else:
            wanted = f"holds no trackio run {run!r} (its runs, name and id: {runs})"
        raise ValueError(f"{p}: {wanted}")
    one = reply["chosen"][0]
    where = f"{p} (run {one['name']})"
    raw: dict[int, dict[str, Any]] = {}
    for i, log in enumerate(reply["logs"]):
        step = log.get(WANDB_STEP, log["step"])
        if not _is_step(step):
            raise ValueError(f"{where}: log {i} is at step {step!r}, not a step")
        logged = {k.removeprefix(TRAINER_PREFIX): v for k, v in log.items() if k not in (WANDB_STEP, *TRACKIO_ADDED)}
        raw.setdefault(step, {}).update({k: (f"{where}, step {step}", v) for k, v in logged.items()})
    return _history(f"{p}#{one['id']}", "trackio", raw)


def run_trackio(trackio_dir: Path, script: str, request: dict[str, Any], settings: dict[str, str] | None = None) -> Any:
    """What ``script`` (after :data:`TRACKIO_PRELUDE`: its ``request``, its ``out``) writes to ``out`` as JSON, run
    by this Python in a child process whose trackio keeps its projects in ``trackio_dir``: trackio reads its folder
    (``TRACKIO_DIR``) once, when imported, so another folder takes another process. The child's environment is
    this one's without trackio's remote settings (every ``TRACKIO_*``, :data:`TRACKIO_REMOTE`) and with
    :data:`TRACKIO_LOCAL` and ``settings`` (more of trackio's variables): no server, no browser, no network.
    RuntimeError with the child's last line of stderr when it fails (a traceback's last line, or its ``sys.exit``
    message); at most :data:`TRACKIO_TIMEOUT_S`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACKIO_") and k not in TRACKIO_REMOTE}
    env |= TRACKIO_LOCAL | (settings or {}) | {"TRACKIO_DIR": str(trackio_dir.resolve())}
    child = subprocess.run(
        [sys.executable, "-c", TRACKIO_PRELUDE + script],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
        timeout=TRACKIO_TIMEOUT_S,
    )
    if child.returncode != 0:
        lines = child.stderr.strip().splitlines()
        raise RuntimeError(lines[-1] if lines else f"exit status {child.returncode}")
    return json.loads(child.stdout)


def _check_trackio_db(db: Path) -> None:
    """ValueError naming ``db`` unless it is a SQLite database whose ``metrics`` table has trackio's columns
    (:data:`TRACKIO_METRICS`), opened read-only."""
    if not _is_sqlite(db):
        raise ValueError(f"{db}: not a SQLite database (a trackio project is one)")
    columns = {row[1] for row in _sqlite_read(db, "PRAGMA table_info(metrics)")}
    if missing := sorted(TRACKIO_METRICS - columns):
        raise ValueError(f"{db}: a SQLite database but no trackio project (its metrics table lacks {missing})")


def _sqlite_read(db: Path, sql: str) -> list[tuple[Any, ...]]:
    """The rows of ``sql`` on the SQLite database ``db``, opened read-only; ValueError naming ``db`` when SQLite
    cannot read it."""
    try:
        with contextlib.closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)) as con:
            return con.execute(sql).fetchall()
    except sqlite3.Error as err:
        raise ValueError(f"{db}: not a readable SQLite database ({err})") from None


def _is_trackio_db(path: Path) -> bool:
    """Whether ``path`` is a SQLite database with trackio's ``metrics`` table (:func:`_check_trackio_db`)."""
    try:
        _check_trackio_db(path)
    except ValueError:
        return False
    return True


def _trackio_dbs(folder: Path) -> list[Path]:
    """The SQLite files ``*.db`` in ``folder`` but MLflow's ``mlflow.db``: the databases trackio's projects may be."""
    return sorted(db for db in folder.glob(TRACKIO_DB) if db.name != MLFLOW_DB and _is_sqlite(db))


def _check_mlflow_db(db: Path) -> None:
    """ValueError naming ``db`` unless it is a SQLite database with MLflow's tables (:data:`MLFLOW_TABLES`),
    opened read-only."""
    try:
        with contextlib.closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)) as con:
            tables = {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error as err:
        raise ValueError(f"{db}: not a readable SQLite database ({err})") from None
    if missing := sorted(MLFLOW_TABLES - tables):
        raise ValueError(f"{db}: a SQLite database but no MLflow store (no tables {missing})")


def _is_sqlite(path: Path) -> bool:
    """Whether ``path`` is a file that begins as a SQLite database does."""
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(len(SQLITE_HEADER)) == SQLITE_HEADER


def _is_file_store_run(folder: Path) -> bool:
    """Whether ``folder`` is a run folder of MLflow's file store (``meta.yaml`` and ``metrics/``)."""
    return (folder / FILE_STORE_RUN[0]).is_file() and (folder / FILE_STORE_RUN[1]).is_dir()


def _is_run(folder: Path) -> bool:
    """Whether ``folder`` holds one run's TensorBoard event files, W&B run file, MLflow store or trackio database."""
    return (
        any(folder.glob(f"{EVENTS}*"))
        or any(folder.glob(WANDB_FILE))
        or _is_sqlite(folder / MLFLOW_DB)
        or any(_is_trackio_db(db) for db in _trackio_dbs(folder))
    )


def _is_step(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _history(path: str, fmt: str, raw: dict[int, dict[str, tuple[str, Any]]]) -> History:
    """The :class:`History` of ``raw`` (step -> key -> (where it was read, value)): each :data:`COLUMNS` column
    under its first key found anywhere in the file, a ``mismatch_*`` column per :data:`MISMATCH` key; ``null``
    values are left out (a key logged only as ``null`` is no column); ValueError naming where for another
    non-number, or when no column is found."""
    found = {k for logged in raw.values() for k, (_, v) in logged.items() if v is not None}
    keys = {col: next(k for k in options if k in found) for col, options in COLUMNS.items() if found & set(options)}
    keys |= {mismatch_column(k): k for k in sorted(found) if k.startswith(MISMATCH)}
    if not keys:
        wanted = ", ".join(k for options in COLUMNS.values() for k in options)
        raise ValueError(f"trajectory.history {path!r} ({fmt}) logs none of {wanted} and no rollout-mismatch metric")
    values: dict[int, dict[str, float]] = {}
    for step in sorted(raw):
        row = {}
        for col, key in keys.items():
            if key not in raw[step] or raw[step][key][1] is None:
                continue
            where, v = raw[step][key]
            if isinstance(v, bool) or not isinstance(v, int | float):
                raise ValueError(f"{where}: {key!r} is {v!r}, not a number")
            row[col] = float(v) if math.isfinite(v) else float("nan")
        if row:
            values[step] = row
    return History(path, fmt, values, keys)
