"""MLflow out and in (flows/trackers.py ``write_mlflow``, storage/stores/history.py ``mlflow_history``), with the real
``mlflow`` (extra ``mlflow``: ``mlflow-skinny``) on a local SQLite store, read back with MLflow's own
``MlflowClient``: the tiny pipeline's scalars equal the report's numbers (headline at step 0) and an external
trajectory's store arrays (at the trainer's steps 2 and 4), in float64; a verl-style and a Trainer-style MLflow run
read as the same history as verl's file logger, from a SQLite store and from a legacy file-store run; a store that
is no MLflow store, from another schema version, damaged, or ambiguous is refused in one line naming the file."""

import shutil
import sqlite3
import sys
from pathlib import Path

import pytest

pytest.importorskip("mlflow")

from mlflow import MlflowClient
from mlflow.entities import Metric, ViewType

from covgrad.report.trackers import run_scalars
from flows.trackers import MLFLOW_DB, write_mlflow
from storage.stores.history import read_history
from storage.stores.reports import RunArtifacts
from tests.helpers.histories import (
    CHECKPOINTS,
    MISMATCH_KEY,
    STEPS,
    TRAINER_KEYS,
    VERL_KEYS,
    logged,
    write_verl,
)
from tests.helpers.trackers import headline_tags, trajectory_tags


@pytest.fixture(autouse=True, scope="module")
def no_telemetry():
    """MLflow's usage telemetry off (it is on by default and would try the network)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        yield


def read_back(db: Path) -> tuple[str, dict[str, dict[int, float]]]:
    """(run name, key -> step -> value of every metric) of the one run in the SQLite store ``db``, by
    ``MlflowClient``."""
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    experiments = [e.experiment_id for e in client.search_experiments(view_type=ViewType.ALL)]
    (run,) = client.search_runs(experiments, run_view_type=ViewType.ALL)
    out = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)} for key in run.data.metrics}
    assert run.info.status == "FINISHED"
    return run.info.run_name, out


def log_run(client: MlflowClient, rows: list[tuple[int, dict[str, float]]]) -> str:
    """A finished run in ``client``'s store (its default experiment) logging each (step, data) of ``rows`` as
    ``mlflow.log_metrics(data, step=step)`` does (one timestamp a call, ascending); its run id."""
    run_id = client.create_run("0").info.run_id
    for i, (step, data) in enumerate(rows):
        client.log_batch(run_id, metrics=[Metric(k, v, 1_000 + i, step) for k, v in data.items()])
    client.set_terminated(run_id)
    return run_id


def verl_rows() -> list[tuple[int, dict[str, float]]]:
    """verl's ``mlflow`` logger: its metric names, ``step=global_steps``."""
    return [(t, {VERL_KEYS[c]: v for c, v in logged(t).items()} | {MISMATCH_KEY: 0.001 * t}) for t in STEPS]


def trainer_rows() -> list[tuple[int, dict[str, float]]]:
    """The Trainer's ``MLflowCallback``: its log keys as they are, ``step=global_step``; an eval log at step 2."""
    rows = [(t, {TRAINER_KEYS[c]: v for c, v in logged(t).items()} | {MISMATCH_KEY: 0.001 * t}) for t in STEPS]
    rows.insert(2, (2, {"eval_loss": 9.0}))
    return rows


@pytest.fixture(scope="module")
def empty_store(tmp_path_factory) -> Path:
    """An MLflow SQLite store with its tables created (MLflow's migrations take seconds: tests copy this one)."""
    db = tmp_path_factory.mktemp("mlflow-empty") / MLFLOW_DB
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


def store_copy(empty_store: Path, folder: Path) -> Path:
    """A copy of ``empty_store`` in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(empty_store, folder / MLFLOW_DB))


@pytest.fixture(scope="module")
def logged_run(tracked_run, tmp_path_factory):
    """The session's tiny run with an external trajectory (a Trainer series at steps 2, 4 with a verl history)
    logged to MLflow: (the report's numbers, the trajectory dataset, the tracker folder)."""
    tmp = tmp_path_factory.mktemp("trackers-mlflow")
    run = tracked_run
    store, index, numbers, ds = run.store, run.index, run.numbers, run.ds
    folder = tmp / "mlflow-out" / "tiny-0123456789ab"
    folder.mkdir(parents=True)
    write_mlflow(folder, run_scalars(RunArtifacts(store, index), numbers))
    return numbers, ds, folder


@pytest.mark.slow
def test_the_headline_read_back_is_the_reports(logged_run):
    n, _, folder = logged_run
    name, got = read_back(folder / MLFLOW_DB)
    assert name == "tiny-0123456789ab"  # the run name is the folder's
    want = headline_tags(n)
    for tag, value in want.items():
        assert got[f"covgrad/{tag}"] == {0: value}, tag  # float64: MLflow's store keeps the report's value exactly


@pytest.mark.slow
def test_the_trajectory_read_back_is_the_stores(logged_run):
    _, ds, folder = logged_run
    _, got = read_back(folder / MLFLOW_DB)
    series = trajectory_tags(ds)
    for tag, values in series.items():
        assert got[f"covgrad/trajectory/{tag}"] == dict(zip(CHECKPOINTS, values.tolist(), strict=True)), tag
    assert got["covgrad/trajectory/jaccard_prev"] == {4: float(ds.jaccard_prev.values[1])}
    dk = ds.dk.sel(k=1).values
    assert got["covgrad/trajectory/d_k/k1"] == {0: float(dk[0]), 2: float(dk[1])}


def test_an_mlflow_history_is_the_verl_files(tmp_path, empty_store):
    """verl's and the Trainer's runs in one store: the store alone is ambiguous, each ``<store>#<run id>`` (and the
    store's folder with it) reads as verl's file logger's history."""
    db = store_copy(empty_store, tmp_path / "store")
    client = MlflowClient(tracking_uri=f"sqlite:///{db}")
    runs = {"verl": log_run(client, verl_rows()), "trainer": log_run(client, trainer_rows())}
    want = read_history(str(write_verl(tmp_path / "verl.jsonl")))
    for stack, run_id in runs.items():
        for where in (db, db.parent):
            got = read_history(f"{where}#{run_id}")
            assert (got.format, got.path) == ("mlflow", f"{db}#{run_id}")
            assert got.values == want.values  # float64 throughout: equal, the learning rate too
            keys = TRAINER_KEYS if stack == "trainer" else VERL_KEYS
            assert got.keys == keys | {"mismatch_rollout_corr_k3_kl": MISMATCH_KEY}
    with pytest.raises(ValueError, match=rf"^{db}: holds 2 active MLflow runs \[.*\]; give one as {db}#<run id>$"):
        read_history(str(db.parent))
    with pytest.raises(ValueError, match=rf"^{db}: not a readable MLflow store or run \(MlflowException: Run"):
        read_history(f"{db}#0123456789abcdef")


def test_a_file_store_run_reads_with_mlflows_opt_in(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    mlruns = tmp_path / "mlruns"
    run_id = log_run(MlflowClient(tracking_uri=mlruns.as_uri()), verl_rows())
    folder = mlruns / "0" / run_id
    got = read_history(str(folder))
    assert (got.format, got.path) == ("mlflow", str(folder))
    assert got.values == read_history(str(write_verl(tmp_path / "verl.jsonl"))).values
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")
    with pytest.raises(ValueError, match=rf"^{folder}: a run of MLflow's legacy file store, .*migrate-filestore"):
        read_history(str(folder))


def test_a_foreign_old_or_damaged_store_is_refused(tmp_path, empty_store):
    foreign = tmp_path / "foreign.db"
    with sqlite3.connect(foreign) as con:
        con.execute("CREATE TABLE runs (id INTEGER)")
    before = foreign.read_bytes()
    with pytest.raises(ValueError, match=rf"^{foreign}: a SQLite database but no MLflow store \(no tables \["):
        read_history(str(foreign))
    assert foreign.read_bytes() == before  # checked read-only: MLflow's client would have created its tables
    old = store_copy(empty_store, tmp_path / "old")  # no client on it before: MLflow caches a store per URI
    with sqlite3.connect(old) as con:
        con.execute("UPDATE alembic_version SET version_num = '451aebb31d03'")  # MLflow 1.x's first revision
    with pytest.raises(ValueError, match=rf"^{old}: not a readable MLflow store or run \(.*out-of-date database"):
        read_history(str(old))
    cut = tmp_path / "cut" / MLFLOW_DB
    cut.parent.mkdir()
    cut.write_bytes(empty_store.read_bytes()[:4096])
    with pytest.raises(ValueError, match=rf"^{cut}: not a readable "):
        read_history(str(cut.parent))


def test_reading_without_mlflow_names_the_extra(tmp_path, empty_store, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # importing it raises ImportError
    with pytest.raises(ImportError) as err:
        read_history(str(empty_store))
    assert str(err.value).endswith("reading it needs the mlflow package: pip install 'covgrad[mlflow]'")
