"""``covgrad run``'s trackers (flows/trackers.py, covgrad/report/trackers.py): the tiny pipeline's scalars written to
TensorBoard with the real ``SummaryWriter`` and read back with TensorBoard's own ``EventAccumulator`` equal the
report's numbers (headline at step 0) and an external trajectory's store arrays (at the trainer's steps 2 and 4);
a run is logged once; a missing package fails in one line naming the extra."""

import math
import sys

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

from covgrad.report.trackers import headline_scalars
from flows.trackers import LOGGED, check_trackers, log_trackers
from storage.stores.reports import report_numbers
from tests.helpers.histories import CHECKPOINTS
from tests.helpers.pipeline import tiny_config
from tests.helpers.trackers import headline_tags, trajectory_tags


def read_back(folder) -> dict[str, dict[int, float]]:
    """tag -> step -> value of every scalar in the TensorBoard folder, by TensorBoard's reader."""
    acc = EventAccumulator(str(folder), size_guidance={SCALARS: 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def f32(v: float) -> float:
    """What a TensorBoard scalar holds of ``v`` (float32)."""
    return float(np.float32(v))


@pytest.fixture(scope="module")
def logged_run(tiny_run, tracked_run, tmp_path_factory):
    """The session's tiny run with an external trajectory (a Trainer series at steps 2, 4 with a verl history)
    logged to TensorBoard: (config, store, refs, run key, folder, trajectory dataset, lines)."""
    tmp = tmp_path_factory.mktemp("trackers")
    run = tracked_run
    cfg = tiny_config(str(run.root), **{"trackers.tensorboard": str(tmp / "tb")})
    store, refs, ds = run.store, run.refs, run.ds
    lines = log_trackers(cfg, store, refs, tiny_run[1].run_key)
    folder = tmp / "tb" / f"{cfg.name}-{tiny_run[1].run_key[:12]}"
    return cfg, store, refs, tiny_run[1].run_key, folder, ds, lines


@pytest.mark.slow
def test_the_headline_read_back_is_the_reports(logged_run):
    _, store, refs, _, folder, _, lines = logged_run
    assert lines == [f"tensorboard: {folder} ({sum(len(v) for v in read_back(folder).values())} scalars)"]
    got = read_back(folder)
    n = report_numbers(store, refs["report"])["numbers"]
    want = headline_tags(n)
    for tag, value in want.items():
        assert got[f"covgrad/{tag}"] == {0: f32(value)}, tag


@pytest.mark.slow
def test_the_trajectory_read_back_is_the_stores(logged_run):
    _, _, _, _, folder, ds, _ = logged_run
    got = read_back(folder)
    steps = list(CHECKPOINTS)
    series = trajectory_tags(ds)
    for tag, values in series.items():
        assert got[f"covgrad/trajectory/{tag}"] == {t: f32(v) for t, v in zip(steps, values, strict=True)}, tag
    assert "covgrad/trajectory/adv_rms" not in got and "covgrad/trajectory/cum_F_recall" not in got
    assert got["covgrad/trajectory/jaccard_prev"] == {4: f32(ds.jaccard_prev.values[1])}  # NaN at the first row
    dk = ds.dk.sel(k=1).values  # windows 0 (the start, step 0) and 1 (step 2)
    assert got["covgrad/trajectory/d_k/k1"] == {0: f32(dk[0]), 2: f32(dk[1])}


@pytest.mark.slow
def test_a_run_is_logged_once(logged_run):
    cfg, store, refs, run_key, folder, _, _ = logged_run
    files = sorted(folder.glob("events.out.tfevents.*"))
    assert len(files) == 1 and (folder / LOGGED).is_file()
    assert log_trackers(cfg, store, refs, run_key) == [f"tensorboard: {folder} (logged before)"]
    assert sorted(folder.glob("events.out.tfevents.*")) == files
    assert log_trackers(tiny_config(cfg.root), store, refs, run_key) == []  # no tracker selected


def test_a_missing_tracker_package_names_its_extra(tmp_path, monkeypatch):
    cfg = tiny_config(str(tmp_path), **{"trackers.tensorboard": str(tmp_path / "tb")})
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import tensorboard now raises ImportError
    with pytest.raises(ImportError) as err:
        check_trackers(cfg)
    assert str(err.value) == "trackers.tensorboard needs the tensorboard package: pip install 'covgrad[tensorboard]'"
    check_trackers(tiny_config(str(tmp_path)))  # none selected: nothing to import


def test_headline_scalars_per_regime_and_without_intervals():
    """Each regime's max |ρ|, violations and overlap at the q nearest 1% (its own rows only); a degenerate run's
    missing and non-finite numbers are left out."""
    numbers = {
        "overlap": [{"scope": "global", "q": 0.05, "overlap": 0.5, "random": 0.05, "per_tensor_random": 0.1}],
        "max_abs_rho": float("nan"),
        "regimes": [{"regime": "sft", "max_abs_rho": 0.25, "violations": 3}, {"regime": "rl", "violations": 0}],
    }
    overlap = [
        {"regime": "sft", "scope": "global", "q": 0.1, "overlap": 0.75},
        {"regime": "sft", "scope": "global", "q": 0.01, "overlap": 0.5},
        {"regime": "sft", "scope": "per_tensor", "q": 0.01, "overlap": 0.125},
    ]
    got = {s.tag.removeprefix("covgrad/"): s.value for s in headline_scalars(numbers, overlap)}
    assert got == {
        "overlap_1pct": 0.5,
        "overlap_1pct_random": 0.05,
        "overlap_1pct_per_tensor_random": 0.1,
        "regimes/sft/max_abs_rho": 0.25,
        "regimes/sft/violations": 3.0,
        "regimes/sft/overlap_1pct": 0.5,
        "regimes/rl/violations": 0.0,
    }
    assert all(s.step == 0 and math.isfinite(s.value) for s in headline_scalars(numbers, overlap))
