"""trackio out and in (flows/trackers.py ``write_trackio``, storage/stores/history.py ``trackio_history``), with the
real ``trackio`` (extra ``trackio``) on a local project database, read back with trackio's own reader
(``SQLiteStorage.get_logs``, ``trackio.Api``): the tiny pipeline's scalars equal the report's numbers (headline at
step 0) and an external trajectory's store arrays (at the trainer's steps 2 and 4), in float64; a verl-style and a
Trainer-style trackio run read as the same history as verl's file logger; writing opens no socket or browser and
touches no folder but the run's; a database that is no trackio project, damaged, or ambiguous is refused in one
line naming the file."""

import contextlib
import sqlite3
import sys
from pathlib import Path

import pytest

pytest.importorskip("trackio")

from covgrad.config import TrackersSection
from covgrad.report.trackers import Scalar, run_scalars
from flows.trackers import TRACKIO_DB, check_trackers, write_trackio
from storage.stores.history import read_history, run_trackio, trackio_history
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
from tests.helpers.pipeline import tiny_config
from tests.helpers.trackers import headline_tags, trajectory_tags

# trackio's own reader in a child whose TRACKIO_DIR is the folder: every run's name and logs (step -> key -> value)
READ_BACK = """import trackio
from trackio.sqlite_storage import SQLiteStorage
runs = [(r.name, r.id) for r in trackio.Api().runs(request["project"])]
json.dump({name: SQLiteStorage.get_logs(request["project"], run=name, run_id=i) for name, i in runs}, out)
"""
# a run as verl's ``trackio`` logger (``step=global_steps``) or the Trainer's ``TrackioCallback`` (no step) logs it
LOG_RUN = """import trackio
trackio.init(project="p", name=request["name"], embed=False, auto_log_cpu=False, auto_log_gpu=False)
for step, data in request["rows"]:
    trackio.log(data, step=step)
trackio.finish()
json.dump(None, out)
"""
# an audit hook (sitecustomize of trackio's child) that records every socket, server or browser it opens, in a file
# it creates first
AUDIT = """import os, sys
open(os.environ["COVGRAD_AUDIT"], "a").close()
def _hook(event, args):
    if event in ("socket.connect", "socket.getaddrinfo", "socket.bind", "webbrowser.open"):
        with open(os.environ["COVGRAD_AUDIT"], "a") as f:
            f.write(f"{event} {args!r}\\n")
sys.addaudithook(_hook)
"""


def read_back(folder: Path) -> tuple[str, dict[str, dict[int, float]]]:
    """(run name, key -> step -> value of every logged metric) of the one run of project ``covgrad`` in the trackio
    folder ``folder``, by trackio's reader."""
    ((name, logs),) = run_trackio(folder, READ_BACK, {"project": "covgrad"}).items()
    out: dict[str, dict[int, float]] = {}
    for log in logs:
        for key, value in log.items():
            if key not in ("step", "timestamp"):
                out.setdefault(key, {})[log["step"]] = value
    return name, out


def log_run(folder: Path, name: str, rows: list[tuple[int | None, dict[str, float]]]) -> Path:
    """A run ``name`` of project ``p`` in the trackio folder ``folder`` logging each (step, data) of ``rows`` (step
    None: trackio's own count), by the real library; the project's database."""
    run_trackio(folder, LOG_RUN, {"name": name, "rows": rows})
    return folder / "p.db"


def verl_rows() -> list[tuple[int | None, dict[str, float]]]:
    """verl's ``trackio`` logger: its metric names, ``step=global_steps``."""
    return [(t, {VERL_KEYS[c]: v for c, v in logged(t).items()} | {MISMATCH_KEY: 0.001 * t}) for t in STEPS]


def trainer_rows() -> list[tuple[int | None, dict[str, float]]]:
    """The Trainer's ``TrackioCallback``: ``train/`` before its log keys, ``train/global_step``, trackio's step its
    count of logs (an eval log at step 2 shifts it)."""
    rows: list[tuple[int | None, dict[str, float]]] = [
        (None, {f"train/{TRAINER_KEYS[c]}": v for c, v in logged(t).items()} | {f"train/{MISMATCH_KEY}": 0.001 * t})
        for t in STEPS
    ]
    for (_, data), t in zip(rows, STEPS, strict=True):
        data["train/global_step"] = t
    rows.insert(2, (None, {"eval/loss": 9.0, "train/global_step": 2}))
    return rows


@pytest.fixture(scope="module")
def logged_run(tracked_run, tmp_path_factory):
    """The session's tiny run with an external trajectory (a Trainer series at steps 2, 4 with a verl history)
    logged to trackio: (the report's numbers, the trajectory dataset, the tracker folder)."""
    tmp = tmp_path_factory.mktemp("trackers-trackio")
    run = tracked_run
    store, index, numbers, ds = run.store, run.index, run.numbers, run.ds
    folder = tmp / "trackio-out" / "tiny-0123456789ab"
    folder.mkdir(parents=True)
    write_trackio(folder, run_scalars(RunArtifacts(store, index), numbers))
    return numbers, ds, folder


@pytest.mark.slow
def test_the_headline_read_back_is_the_reports(logged_run):
    n, _, folder = logged_run
    name, got = read_back(folder)
    assert name == "tiny-0123456789ab"  # the run name is the folder's
    assert (folder / TRACKIO_DB).is_file()
    want = headline_tags(n)
    for tag, value in want.items():
        assert got[f"covgrad/{tag}"] == {0: value}, tag  # float64: trackio's JSON keeps the report's value exactly


@pytest.mark.slow
def test_the_trajectory_read_back_is_the_stores(logged_run):
    _, ds, folder = logged_run
    _, got = read_back(folder)
    series = trajectory_tags(ds)
    for tag, values in series.items():
        assert got[f"covgrad/trajectory/{tag}"] == dict(zip(CHECKPOINTS, values.tolist(), strict=True)), tag
    assert got["covgrad/trajectory/jaccard_prev"] == {4: float(ds.jaccard_prev.values[1])}
    dk = ds.dk.sel(k=1).values
    assert got["covgrad/trajectory/d_k/k1"] == {0: float(dk[0]), 2: float(dk[1])}


def test_writing_is_local_and_replaces_an_interrupted_write(tmp_path, monkeypatch):
    """With a Space and a server set for trackio in the environment, the writer's child still opens no socket and
    no browser (an audit hook records them) and writes nothing outside the run's folder (not trackio's default
    folder under ``HF_HOME``); a database an interrupted write left is replaced; NaN stays NaN."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(AUDIT)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    monkeypatch.setenv("COVGRAD_AUDIT", str(tmp_path / "audit.log"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("TRACKIO_SPACE_ID", "someone/covgrad")
    monkeypatch.setenv("TRACKIO_SERVER_URL", "https://trackio.invalid/?write_token=x")
    folder = tmp_path / "tiny-0123456789ab"
    folder.mkdir()
    (folder / TRACKIO_DB).write_bytes(b"SQLite format 3\x00 cut short")
    points = {0: {"covgrad/a": 0.1}, 2: {"covgrad/a": float("nan"), "covgrad/b": 1 / 3}}
    write_trackio(folder, [Scalar(tag, step, value) for step, row in points.items() for tag, value in row.items()])
    assert (tmp_path / "audit.log").read_text() == ""  # the hook ran (it created the file) and saw nothing
    assert sorted(p.name for p in tmp_path.iterdir()) == ["audit.log", "site", "tiny-0123456789ab"]
    _, got = read_back(folder)
    assert got["covgrad/b"] == {2: 1 / 3} and got["covgrad/a"][0] == 0.1 and got["covgrad/a"][2] != got["covgrad/a"][2]


@pytest.mark.parametrize("trainer", [False, True], ids=["verl", "trainer"])
def test_a_trackio_history_is_the_verl_files(tmp_path, trainer):
    """verl's run given as the database and as its folder, the Trainer's as ``<database>#<run name>`` (each child
    that reads costs trackio's import, about 2 s)."""
    db = log_run(tmp_path / "trackio", "grpo", trainer_rows() if trainer else verl_rows())
    want = read_history(str(write_verl(tmp_path / "verl.jsonl")))
    for path in (f"{db}#grpo",) if trainer else (db, db.parent):
        got = read_history(str(path))
        assert got.format == "trackio" and got.path.startswith(f"{db}#")
        assert got.values == want.values  # float64 throughout: equal, the learning rate too
        assert got.keys == (TRAINER_KEYS if trainer else VERL_KEYS) | {"mismatch_rollout_corr_k3_kl": MISMATCH_KEY}


@pytest.mark.parametrize("journal", ["wal", "delete"])
def test_reading_leaves_the_database_as_it_is(tmp_path, journal):
    """trackio writes in WAL mode (a database exported from a Space is in DELETE mode) and its reader sets WAL on
    every connection: the reader keeps the database's own mode, so its bytes (and the history's digest) stay."""
    db = log_run(tmp_path, "r", verl_rows())
    with contextlib.closing(sqlite3.connect(db)) as con:
        assert con.execute(f"PRAGMA journal_mode = {journal}").fetchone() == (journal,)
    before = db.read_bytes()
    read_history(str(db))
    assert db.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.db", "p.lock"]


def test_one_of_several_runs_is_chosen_by_name_or_id(tmp_path):
    db = log_run(tmp_path, "a", verl_rows())
    log_run(tmp_path, "b", [(t, {"actor/lr": 0.5 * t}) for t in STEPS])
    with pytest.raises(ValueError, match=rf"^{db}: holds 2 trackio runs \[\('a', '\w+'\), \('b', '\w+'\)\]; give one"):
        read_history(str(db))
    got = read_history(f"{tmp_path}#b")
    assert got.values == {t: {"lr": 0.5 * t} for t in STEPS}
    run_id = got.path.rpartition("#")[2]
    assert read_history(f"{db}#{run_id}") == got
    log_run(tmp_path, "b", [(1, {"actor/lr": 1.0})])  # a second run named b
    with pytest.raises(ValueError, match=rf"^{db}: holds 2 trackio runs named 'b'; give one's id: "):
        read_history(f"{db}#b")
    with pytest.raises(ValueError, match=rf"^{db}: holds no trackio run 'c' \(its runs, name and id: "):
        read_history(f"{db}#c")


def test_a_foreign_damaged_or_unreadable_database_is_refused(tmp_path):
    foreign = tmp_path / "foreign" / "x.db"
    foreign.parent.mkdir()
    with sqlite3.connect(foreign) as con:
        con.execute("CREATE TABLE metrics (key TEXT, value REAL, step INTEGER, timestamp INTEGER)")  # MLflow-like
    before = foreign.read_bytes()
    with pytest.raises(ValueError, match=rf"^{foreign}: a SQLite database but no trackio project \(its metrics table"):
        read_history(str(foreign.parent))
    with pytest.raises(ValueError, match=rf"^{foreign}: a SQLite database but no trackio project"):
        trackio_history(str(foreign))
    assert foreign.read_bytes() == before  # checked read-only
    db = log_run(tmp_path / "ok", "r", verl_rows())
    cut = tmp_path / "cut" / "p.db"
    cut.parent.mkdir()
    cut.write_bytes(db.read_bytes()[:4096])
    with pytest.raises(ValueError, match=rf"^{cut}: not a readable "):
        read_history(str(cut.parent))
    with sqlite3.connect(db) as con:
        con.execute("UPDATE metrics SET metrics = '{not json' WHERE step = 2")
    with pytest.raises(ValueError, match=rf"^{db}: not a readable trackio project \(.*JSONDecodeError"):
        read_history(str(db))
    other = log_run(tmp_path / "text", "r", [(1, {"actor/lr": "high"})])
    with pytest.raises(ValueError, match=rf"^{other} \(run r\), step 1: 'actor/lr' is 'high', not a number$"):
        read_history(str(other))
    (tmp_path / "text" / "q.db").write_bytes(other.read_bytes())
    with pytest.raises(ValueError, match=r"holds 2 trackio databases \['p.db', 'q.db'\]; give one$"):
        read_history(str(tmp_path / "text"))


def test_reading_without_trackio_names_the_extra(tmp_path, monkeypatch):
    db = log_run(tmp_path, "r", verl_rows())
    monkeypatch.setitem(sys.modules, "trackio", None)  # importing it raises ImportError, find_spec finds none
    with pytest.raises(ImportError) as err:
        read_history(str(db))
    assert str(err.value).endswith("reading it needs the trackio package: pip install 'covgrad[trackio]'")


@pytest.mark.skipif("trackio" not in TrackersSection.model_fields, reason="no trackers.trackio in covgrad/config.py")
def test_a_missing_trackio_names_its_extra(tmp_path, monkeypatch):
    cfg = tiny_config(str(tmp_path), **{"trackers.trackio": str(tmp_path / "trackio")})
    monkeypatch.setitem(sys.modules, "trackio", None)
    with pytest.raises(ImportError) as err:
        check_trackers(cfg)
    assert str(err.value) == "trackers.trackio needs the trackio package: pip install 'covgrad[trackio]'"
