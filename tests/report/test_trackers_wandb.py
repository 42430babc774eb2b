"""W&B out and in (flows/trackers.py ``write_wandb``, storage/stores/history.py ``wandb_history``), with the real
``wandb`` (extra ``wandb``) in offline mode, read back with wandb's own reader of its run files
(``wandb.sdk.internal.datastore.DataStore`` and ``wandb.proto``): the tiny pipeline's scalars equal the report's
numbers (headline at step 0) and an external trajectory's store arrays (at the trainer's steps 2 and 4), in
float64; a verl-style and a Trainer-style W&B history read as the same history as verl's file logger; a damaged
or ambiguous run is refused in one line naming the file."""

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("wandb")

from covgrad.report.trackers import run_scalars
from flows.trackers import WANDB_DIR, write_wandb
from storage.stores.history import read_history
from storage.stores.reports import RunArtifacts
from tests.helpers.histories import (
    CHECKPOINTS,
    MISMATCH_KEY,
    STEPS,
    TRAINER_KEYS,
    VERL_KEYS,
    logged,
    read_wandb,
    write_verl,
)
from tests.helpers.trackers import headline_tags, trajectory_tags


@pytest.fixture(autouse=True, scope="module")
def wandb_home(tmp_path_factory):
    """wandb's settings, cache and artifacts under a temporary folder, never the user's."""
    home = tmp_path_factory.mktemp("wandb-home")
    with pytest.MonkeyPatch.context() as mp:
        for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
            mp.setenv(var, str(home / var.lower()))
        yield


def run_file(folder: Path) -> Path:
    """The one ``run-*.wandb`` file under ``folder``."""
    (path,) = folder.glob(f"{WANDB_DIR}/offline-run-*/run-*.wandb")
    return path


def wandb_run(folder: Path, rows: list[tuple[int | None, dict[str, float]]]) -> Path:
    """An offline W&B run in ``folder`` logging each (step, data) of ``rows`` (step None: W&B's own count);
    the run folder ``wandb/offline-run-*``."""
    import wandb

    settings = wandb.Settings(silent=True, console="off", x_disable_stats=True, disable_git=True)
    run = wandb.init(mode="offline", dir=str(folder), project="p", settings=settings)
    for step, data in rows:
        run.log(data, step=step)
    run.finish()
    wandb.teardown()  # returns once the run file is complete (finish alone may return before its records land)
    return run_file(folder).parent


@pytest.fixture(scope="module")
def logged_run(tracked_run, tmp_path_factory):
    """The session's tiny run with an external trajectory (a Trainer series at steps 2, 4 with a verl history)
    logged to W&B: (the report's numbers, the trajectory dataset, the run file)."""
    tmp = tmp_path_factory.mktemp("trackers-wandb")
    run = tracked_run
    store, index, numbers, ds = run.store, run.index, run.numbers, run.ds
    folder = tmp / "wandb-out" / "tiny-0123456789ab"
    folder.mkdir(parents=True)
    write_wandb(folder, run_scalars(RunArtifacts(store, index), numbers))
    return numbers, ds, run_file(folder)


@pytest.mark.slow
def test_the_headline_read_back_is_the_reports(logged_run):
    n, _, path = logged_run
    got = read_wandb(path)
    want = headline_tags(n)
    for tag, value in want.items():
        assert got[f"covgrad/{tag}"] == {0: value}, tag  # float64: W&B keeps the report's value exactly


@pytest.mark.slow
def test_the_trajectory_read_back_is_the_stores(logged_run):
    _, ds, path = logged_run
    got = read_wandb(path)
    series = trajectory_tags(ds)
    for tag, values in series.items():
        assert got[f"covgrad/trajectory/{tag}"] == dict(zip(CHECKPOINTS, values.tolist(), strict=True)), tag
    assert got["covgrad/trajectory/jaccard_prev"] == {4: float(ds.jaccard_prev.values[1])}
    dk = ds.dk.sel(k=1).values
    assert got["covgrad/trajectory/d_k/k1"] == {0: float(dk[0]), 2: float(dk[1])}
    assert path.parent.name.endswith("-tiny-0123456789ab")  # the run id is the folder's name


@pytest.mark.parametrize("trainer", [False, True], ids=["verl", "trainer"])
def test_a_wandb_history_is_the_verl_files(tmp_path, trainer):
    """verl's ``wandb`` logger logs at ``step=global_steps``; the Trainer's ``WandbCallback`` logs ``train/`` keys
    with ``train/global_step`` (W&B's ``_step`` counts its calls: an eval log between steps shifts it)."""
    if trainer:
        rows = [(None, {f"train/{TRAINER_KEYS[c]}": v for c, v in logged(t).items()}) for t in STEPS]
        for (_, data), t in zip(rows, STEPS, strict=True):
            data |= {f"train/{MISMATCH_KEY}": 0.001 * t, "train/global_step": t}
        rows.insert(2, (None, {"eval/loss": 9.0, "train/global_step": 2}))
    else:
        rows = [(t, {VERL_KEYS[c]: v for c, v in logged(t).items()} | {MISMATCH_KEY: 0.001 * t}) for t in STEPS]
    folder = wandb_run(tmp_path, rows)
    want = read_history(str(write_verl(tmp_path / "verl.jsonl")))
    for path in (folder, run_file(tmp_path)):
        got = read_history(str(path))
        assert (got.format, got.path) == ("wandb", str(run_file(tmp_path)))
        assert got.values == want.values  # float64 throughout: equal, the learning rate too
        assert got.keys == (TRAINER_KEYS if trainer else VERL_KEYS) | {"mismatch_rollout_corr_k3_kl": MISMATCH_KEY}


def test_a_damaged_or_ambiguous_wandb_run_is_refused(tmp_path):
    folder = wandb_run(tmp_path / "a", [(t, {"actor/lr": 0.5 * t}) for t in STEPS])
    with pytest.raises(ValueError, match=r"its subfolders \['offline-run-.*'\] do: give one run's"):
        read_history(str(folder.parent))
    path = run_file(tmp_path / "a")
    cut = tmp_path / "cut" / path.name
    cut.parent.mkdir()
    cut.write_bytes(path.read_bytes()[: os.path.getsize(path) - 40])
    with pytest.raises(ValueError, match=f"^{cut}: not a readable W&B run file"):
        read_history(str(cut))
    (tmp_path / "cut" / "run-b.wandb").write_bytes(b"not a W&B file")
    with pytest.raises(ValueError, match="holds 2 W&B run files; give one"):
        read_history(str(tmp_path / "cut"))
    with pytest.raises(ValueError, match="run-b.wandb: not a readable W&B run file"):
        read_history(str(tmp_path / "cut" / "run-b.wandb"))


def test_reading_without_the_reader_names_the_extra(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb.sdk.internal.datastore", None)  # importing it raises ImportError
    (tmp_path / "run-x.wandb").write_bytes(b"")
    with pytest.raises(ImportError) as err:
        read_history(str(tmp_path / "run-x.wandb"))
    want = "reading it needs wandb's offline-file reader (wandb < 0.30): pip install 'covgrad[wandb]'"
    assert str(err.value).endswith(want)
