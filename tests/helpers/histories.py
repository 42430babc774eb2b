"""An external run's tracker history as the stacks write it (verl's file logger, TensorBoard through
``torch.utils.tensorboard.SummaryWriter`` as verl's and the Trainer's loggers use it, a Trainer's
``trainer_state.json``), a Trainer-layout checkpoint series made from the tiny pipeline's policy, and the tiny
pipeline's trajectory stage run on the two."""

import json
import shutil
from pathlib import Path

import torch
import xarray as xr

from storage.models import load_model
from storage.schema import TRAJECTORY
from tests.helpers.pipeline import NO_OPTIONAL, run_planned, tiny_config

STEPS = (1, 2, 3, 4)  # the run's optimizer steps
CHECKPOINTS = (2, 4)  # the steps the series saved
LR = {t: 2e-4 * t for t in STEPS}
# one step's metrics by verl's names (verl/workers/fsdp_workers.py, dp_actor.py, trainer/ppo/metric_utils.py,
# rollout_corr_helper.py, utils/debug/metrics.py) and by the Trainer's / TRL's (GRPOTrainer's log keys)
VERL_KEYS = {
    "lr": "actor/lr",
    "loss": "actor/pg_loss",
    "grad_norm": "actor/grad_norm",
    "kl": "actor/kl_loss",
    "reward": "critic/score/mean",
}
TRAINER_KEYS = {"lr": "learning_rate", "loss": "loss", "grad_norm": "grad_norm", "kl": "kl", "reward": "reward"}
MISMATCH_KEY = "rollout_corr/k3_kl"


def logged(step: int) -> dict[str, float]:
    """What the run logged at ``step``, by covgrad column (binary fractions: exact in TensorBoard's float32 but
    the learning rate)."""
    return {"lr": LR[step], "loss": 0.25 * step, "grad_norm": 1.5 + step, "kl": 0.125 * step, "reward": 0.5}


def write_verl(path: Path, steps=STEPS) -> Path:
    """verl's file-logger JSONL: one ``{"step", "data"}`` line per step (orjson writes NaN as null), a step-0
    validation line first and a second line of step 2 (validation metrics) as verl's trainer logs them."""
    lines = [{"step": 0, "data": {"val-core/acc/mean@1": 0.25}}]
    for t in steps:
        data = {VERL_KEYS[c]: v for c, v in logged(t).items()}
        data |= {MISMATCH_KEY: 0.001 * t, "training/rollout_probs_diff_mean": None, "perf/mfu/actor": 0.5}
        lines.append({"step": t, "data": data})
    lines.insert(3, {"step": 2, "data": {"val-core/acc/mean@1": 0.5}})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def write_tensorboard(folder: Path, trainer: bool = False, steps=STEPS) -> Path:
    """The same history as TensorBoard event files written by ``SummaryWriter.add_scalar`` (verl's
    ``_TensorboardAdapter``; with ``trainer``, the Trainer's ``TensorBoardCallback``: its keys after ``train/``)."""
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(folder))
    names = TRAINER_KEYS if trainer else VERL_KEYS
    for t in steps:
        row = {names[c]: v for c, v in logged(t).items()} | {MISMATCH_KEY: 0.001 * t}
        for key, value in row.items():
            writer.add_scalar(f"train/{key}" if trainer else key, value, t)
    writer.close()
    return folder


def write_trainer_state(path: Path, steps=STEPS) -> Path:
    """The same history as a Trainer's ``trainer_state.json`` (``log_history`` by TRL's keys, an eval entry)."""
    history = [
        {"step": t, **{TRAINER_KEYS[c]: v for c, v in logged(t).items()}, MISMATCH_KEY: 0.001 * t} for t in steps
    ]
    history.append({"step": steps[-1], "eval_loss": 9.0})
    path.write_text(json.dumps({"global_step": steps[-1], "log_history": history}))
    return path


def trainer_series(folder: Path, policy: Path) -> Path:
    """A Trainer-layout series ``checkpoint-2``, ``checkpoint-4`` of bf16 weights: the policy (fp32) moved by seeded
    noise of 3e-3 per saved step, on every weight at step 2 and on half of them at step 4."""
    model = load_model(policy)
    g = torch.Generator().manual_seed(0)
    for i, t in enumerate(CHECKPOINTS):
        with torch.no_grad():
            for p in model.parameters():
                noise = 3e-3 * torch.randn(p.shape, generator=g)
                p.add_(noise if i == 0 else noise * (torch.rand(p.shape, generator=g) < 0.5))
        model.to(torch.bfloat16).save_pretrained(folder / f"checkpoint-{t}")
        model.float()
    return folder


def copied_run(tiny_run, tmp: Path) -> Path:
    """A writable copy of the session's tiny pipeline root (``tiny_run``)."""
    root = tmp / "root"
    shutil.copytree(tiny_run[0], root)
    return root


def external(root: Path, series: Path, history: Path | None = None, **overrides: object):
    """The tiny pipeline's trajectory stage (Adam) on ``series`` with ``history``; (its dataset, the config, the
    stage's result)."""
    settings = {"trajectory.enabled": True, "trajectory.checkpoints": str(series)}
    if history is not None:
        settings["trajectory.history"] = str(history)
    cfg = tiny_config(str(root), **NO_OPTIONAL, **settings, **overrides)
    result = run_planned(cfg, {"trajectory"})["trajectory"]
    return xr.open_zarr(root / result.ref.stage / result.ref.key / TRAJECTORY), cfg, result


def read_wandb(path: Path) -> dict[str, dict[int, float]]:
    """key -> W&B step (``_step``) -> value of every history item in the run file, by wandb's own reader."""
    from wandb.proto.wandb_internal_pb2 import Record
    from wandb.sdk.internal.datastore import DataStore

    store = DataStore()
    store.open_for_scan(str(path))
    out: dict[str, dict[int, float]] = {}
    while (data := store.scan_data()) is not None:
        record = Record()
        record.ParseFromString(data)
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)  # wandb 0.29 stores every key as nested_key
                out.setdefault(key, {})[record.history.step.num] = json.loads(item.value_json)
    store.close()
    return out
