"""An external run's tracker history (``trajectory.history``, storage/stores/history.py): verl's file-logger JSONL,
TensorBoard event files (verl's and the Trainer's tags, written by the real ``SummaryWriter``, read by TensorBoard's
``EventAccumulator``) and a Trainer's ``trainer_state.json`` give one history; malformed files are refused in one
line naming the file; the history enters the trajectory key only when set; and on the tiny pipeline a Trainer-layout
series with a verl history gets the logged columns and the Adam drift rule, recomputed here from the statistics'
ρ, the logged learning rates and the bf16 checkpoints."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from pydantic import ValidationError

from covgrad.layout import select_parameters
from covgrad.updates import ChangeTracker, OptimizerSpec, StepZeroStats
from covgrad.updates.tracking import MAX_CROSSINGS
from storage.models import load_model
from storage.schema import STATS
from storage.stores.history import mismatch_column, read_history
from tasks.jobs.external_run import ExternalRun, rule_notes
from tasks.specs import plan
from tests.helpers.deltas import one_line_error
from tests.helpers.histories import (
    CHECKPOINTS,
    LR,
    MISMATCH_KEY,
    STEPS,
    copied_run,
    external,
    logged,
    trainer_series,
    write_tensorboard,
    write_trainer_state,
    write_verl,
)
from tests.helpers.pipeline import tiny_config

MISMATCH = mismatch_column(MISMATCH_KEY)


def test_the_three_formats_give_one_history(tmp_path):
    want = {t: logged(t) | {MISMATCH: 0.001 * t} for t in STEPS}
    verl = read_history(str(write_verl(tmp_path / "verl.jsonl")))
    assert verl.format == "verl" and verl.values == want  # the validation lines of steps 0 and 2 add no column
    assert verl.keys == {
        "lr": "actor/lr",
        "loss": "actor/pg_loss",
        "grad_norm": "actor/grad_norm",
        "kl": "actor/kl_loss",
        "reward": "critic/score/mean",
        MISMATCH: MISMATCH_KEY,
    }  # a metric logged only as null is no column
    state = read_history(str(write_trainer_state(tmp_path / "trainer_state.json")))
    assert state.format == "trainer" and state.values == want and state.keys["lr"] == "learning_rate"
    (tmp_path / "ckpt").mkdir()
    write_trainer_state(tmp_path / "ckpt" / "trainer_state.json")
    assert read_history(str(tmp_path / "ckpt")).values == want  # a checkpoint folder holding one
    for trainer in (False, True):
        board = read_history(str(write_tensorboard(tmp_path / f"tb{trainer}", trainer=trainer)))
        assert board.format == "tensorboard" and set(board.keys) == set(verl.keys)
        assert board.keys["lr"] == ("learning_rate" if trainer else "actor/lr")
        for t in STEPS:  # TensorBoard stores float32
            assert board.values[t] == {c: float(np.float32(v)) for c, v in want[t].items()}
        events = next((tmp_path / f"tb{trainer}").glob("events.out.tfevents.*"))
        assert read_history(str(events)).values == board.values  # one event file


def test_malformed_histories_are_refused_naming_the_file(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 1, "data": {"actor/lr": 1e-5}}\n{"step": "two", "data": {}}\n')
    assert f"{bad}:2: not a verl file-logger record" in one_line_error(read_history, str(bad))
    bad.write_text('{"step": 1, "data": {"actor/lr": 1e-5}}\n{"step": 2, "data": \n')
    assert f"{bad}:2: not a JSON line of verl's file logger" in one_line_error(read_history, str(bad))
    bad.write_text('{"step": 1, "data": {"actor/lr": "1e-5"}}\n')
    assert f"{bad}:1: 'actor/lr' is '1e-5', not a number" in one_line_error(read_history, str(bad))
    bad.write_text('{"step": 1, "data": {"perf/mfu/actor": 0.5}}\n')
    assert "logs none of actor/lr, learning_rate" in one_line_error(read_history, str(bad))
    state = tmp_path / "trainer_state.json"
    state.write_text(json.dumps({"log_history": {"step": 1}}))
    assert f"{state}: not a Trainer state with a log_history list" in one_line_error(read_history, str(state))
    events = tmp_path / "tb" / "events.out.tfevents.1.host.1.0"
    events.parent.mkdir()
    events.write_bytes(b"\x00" * 7)
    assert str(tmp_path / "tb") in one_line_error(read_history, str(tmp_path / "tb"))
    write_tensorboard(tmp_path / "runs" / "run-a")
    msg = one_line_error(read_history, str(tmp_path / "runs"))
    assert "holds no TensorBoard event files" in msg and "its subfolders ['run-a'] do" in msg
    assert "does not exist" in one_line_error(read_history, str(tmp_path / "missing"))


def test_the_history_enters_the_trajectory_key_only_when_set(tmp_path):
    (tmp_path / "series").mkdir()
    history = write_verl(tmp_path / "verl.jsonl")
    base = {"trajectory.enabled": True, "trajectory.checkpoints": str(tmp_path / "series")}
    without = plan(tiny_config(str(tmp_path / "root"), **base))["trajectory"]
    assert "history" not in without.spec.hashed()["settings"] and "history" not in without.spec.inputs
    with_history = plan(tiny_config(str(tmp_path / "root"), **base, **{"trajectory.history": str(history)}))
    step = with_history["trajectory"]
    assert step.spec.hashed()["settings"]["history"] == str(history) and "history" in step.spec.inputs
    assert step.ref.key != without.ref.key
    history.write_text(history.read_text().replace('"actor/lr": 0.0002', '"actor/lr": 0.0003'))
    edited = plan(tiny_config(str(tmp_path / "root"), **base, **{"trajectory.history": str(history)}))
    assert edited["trajectory"].ref.key != step.ref.key  # the file's content is in the key
    for other in ({}, {"trajectory.deltas": str(tmp_path / "series")}):
        with pytest.raises(ValidationError, match="is the logged history of a checkpoint series; set trajectory.check"):
            tiny_config(str(tmp_path / "root"), **other, **{"trajectory.history": str(history)})


def test_rules_say_what_they_need(tmp_path):
    """Adam: the drift rule runs with every step's lr and names the steps without one; absorb never runs (it needs
    each step's gradient); SGD has the bound rule, which needs each step's advantage RMS."""
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    layout = select_parameters(net)
    ones = np.ones(layout.P)
    stats = StepZeroStats(F=ones, G=ones, rho=ones / 2, seed=0, samples_per_step=8)
    start = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).to(torch.bfloat16)
    run = ExternalRun("trainer", "start", 0, start, list(CHECKPOINTS), iter(()))
    adam = ChangeTracker(layout, start, OptimizerSpec("adam", 1e-3), stats)
    drift, notes = rule_notes(adam, read_history(str(write_verl(tmp_path / "full.jsonl"))), run)
    assert drift is not None
    assert notes["drift"].startswith("run: reach at Σ lr and Σ lr² over the logged lr of steps 1..4")
    assert notes["absorb"].startswith("not run:") and "minibatch gradient" in notes["absorb"] and "bound" not in notes
    gappy = read_history(str(write_verl(tmp_path / "gappy.jsonl", steps=(2, 4))))
    drift, notes = rule_notes(adam, gappy, run)
    assert drift is None and "the history has no lr at 2 of steps 1..4 (1, 3)" in notes["drift"]
    sgd = ChangeTracker(layout, start, OptimizerSpec("sgd", 1e-3), stats)
    drift, notes = rule_notes(sgd, gappy, run)
    assert drift is None and set(notes) == {"absorb", "bound"} and "advantage RMS" in notes["bound"]


def half_spacing_bf16(w: np.ndarray) -> np.ndarray:
    """(n,) float64 half the gap from each bf16 value (as float32 ``w``) to its nearer bf16 neighbour, from the
    bit patterns of the neighbours of |w|."""
    bits = (np.abs(w).view(np.uint32) >> 16).astype(np.int64)

    def value(b: np.ndarray) -> np.ndarray:
        return (b.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    a = np.abs(w).astype(np.float64)
    up = value(bits + 1) - a
    down = np.where(bits > 0, a - value(np.maximum(bits - 1, 0)), up)
    return np.minimum(up, down) / 2


def bf16_flat(directory: Path) -> np.ndarray:
    """(P,) float32 every parameter of the model at ``directory`` rounded to bf16, in named_parameters order."""
    model = load_model(directory)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).to(torch.bfloat16).float().numpy()


@pytest.mark.slow
def test_an_external_run_takes_its_history_and_runs_the_drift_rule(tiny_run, tmp_path):
    root = copied_run(tiny_run, tmp_path)
    policy = root / "base_model" / tiny_run[1]["base_model"].ref.key / "policy"
    series = trainer_series(tmp_path / "trl-output", policy)
    history = write_verl(tmp_path / "verl.jsonl")
    ds, cfg, _ = external(root, series, history)
    assert ds.step.values.tolist() == list(CHECKPOINTS)
    for col in ("lr", "loss", "grad_norm", "kl", "reward"):
        assert ds[col].values.tolist() == [logged(t)[col] for t in CHECKPOINTS], col
    assert ds[MISMATCH].values.tolist() == [0.001 * t for t in CHECKPOINTS]
    assert np.isnan(ds.adv_rms.values).all()
    summary = ds.attrs["summary"]
    assert summary["history"]["format"] == "verl" and summary["history"]["keys"][MISMATCH] == MISMATCH_KEY
    assert set(summary["rules"]) == {"absorb", "drift"} and summary["rules"]["drift"].startswith("run:")

    # the drift rule recomputed: c from the statistics' ρ and B = prompts_per_step × group_size, h(w_0) of the bf16
    # start, the reach at the logged lr sums; changed sets from the bf16 checkpoints against the bf16 start
    stats = plan(cfg)["stats.policy.policy"].ref
    rho = np.asarray(zarr.open_group(str(root / stats.stage / stats.key / STATS), mode="r")["rho"][:])
    B = cfg.trajectory.prompts_per_step * cfg.rollouts.samplers["policy"].group_size
    r2 = np.minimum(np.nan_to_num(rho) ** 2, 1.0)
    c = np.sqrt(r2 / (r2 * (1 - 1 / B) + 1 / B)).astype(np.float32).astype(np.float64)
    start = bf16_flat(policy)
    h0 = half_spacing_bf16(start)
    weights = [start, *(bf16_flat(series / f"checkpoint-{t}") for t in CHECKPOINTS)]
    crossed = [np.zeros(start.shape, dtype=np.int64)]
    for t in CHECKPOINTS:
        S, Q = sum(LR[j] for j in STEPS if j <= t), sum(LR[j] ** 2 for j in STEPS if j <= t)
        reach = np.sqrt((S * c) ** 2 + Q * (1 - c * c))
        crossed.append(np.floor(np.minimum((reach / h0 + 1) / 2, MAX_CROSSINGS)).astype(np.int64))  # saturates
    for i in (1, 2):
        for scope, pred, true in (
            ("step", crossed[i] > crossed[i - 1], weights[i] != weights[i - 1]),
            ("cum", crossed[i] > 0, weights[i] != weights[0]),
        ):
            both = int((pred & true).sum())
            assert int(ds[f"{scope}_drift_rule_size"].values[i - 1]) == int(pred.sum()) > 0, scope
            assert math.isclose(ds[f"{scope}_drift_rule_precision"].values[i - 1], both / pred.sum()), scope
            assert math.isclose(ds[f"{scope}_drift_rule_recall"].values[i - 1], both / true.sum()), scope
    assert ds.n_changed_cum.values.tolist() == [int((w != start).sum()) for w in weights[1:]]
