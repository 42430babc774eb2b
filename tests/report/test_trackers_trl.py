"""A real TRL ``GRPOTrainer`` run (CPU, a tiny Llama, two steps) with ``report_to=["tensorboard", "wandb"]`` (W&B
offline), ``CovgradInRun`` folding every step and ``covgrad.report.trl_trackers.CovgradTrackerLog``: covgrad's
in-run scalars read back with TensorBoard's ``EventAccumulator`` and wandb's own run-file reader equal the in-run
files' values at the folds' steps 0 and 1; the trainer's own logging is unchanged; and the run's TensorBoard and
W&B histories read back through ``trajectory.history`` give the learning rate of its ``trainer_state.json``."""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("wandb")

from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

from covgrad.report.trl_trackers import PREFIX, CovgradTrackerLog
from storage.stores.history import read_history
from tests.helpers.histories import read_wandb

G, PROMPTS, STEPS = 4, 2, 2


def _varied(prompts, completions, **kwargs):
    """A reward that varies on a random model's completions: the count of '1' and '+' characters."""
    return [float(c.count("1") + c.count("+")) for c in completions]


@pytest.fixture(scope="module")
def trl_run(tmp_path_factory):
    """The run's folders: (TensorBoard logging dir, W&B run file, in-run folder, the trainer's log_history)."""
    import wandb
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from covgrad.integrations.trl import CovgradInRun
    from covgrad.rollouts.problems import addition_problems
    from tests.helpers.user import write_checkpoint

    tmp = tmp_path_factory.mktemp("trl-trackers")
    model_dir = write_checkpoint(tmp / "model")
    env = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp), "WANDB_PROJECT": "covgrad-test"}
    env |= {"TENSORBOARD_LOGGING_DIR": str(tmp / "tb"), "WANDB_CONFIG_DIR": str(tmp / "wandb-config")}
    env |= {"WANDB_CACHE_DIR": str(tmp / "wandb-cache"), "WANDB_DATA_DIR": str(tmp / "wandb-data")}
    env |= {"WANDB_SILENT": "true", "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        args = GRPOConfig(
            output_dir=str(tmp / "trl"),
            per_device_train_batch_size=G * PROMPTS,
            num_generations=G,
            max_completion_length=4,
            max_steps=STEPS,
            learning_rate=1e-2,
            beta=0.0,
            use_cpu=True,
            bf16=False,
            report_to=["tensorboard", "wandb"],
            logging_steps=1,
            save_strategy="no",
            seed=0,
            dataloader_num_workers=0,
        )
        data = Dataset.from_list([{"prompt": p.prompt} for p in addition_problems(8, 2, seed=0)])
        inrun = CovgradInRun(tmp / "inrun", every_n=1)
        tracked = CovgradTrackerLog(inrun)
        trainer = GRPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
            reward_funcs=_varied,
            args=args,
            train_dataset=data,
            processing_class=AutoTokenizer.from_pretrained(model_dir),
            callbacks=[inrun, tracked],
        )
        inrun.attach(trainer)
        tracked.attach(trainer)
        trainer.train()
        wandb.finish()  # the Trainer leaves its W&B run open
        wandb.teardown()  # returns once the run file is complete
    (run_file,) = tmp.glob("wandb/offline-run-*/run-*.wandb")
    return tmp / "tb", run_file, tmp / "inrun", trainer.state.log_history


def expected(inrun: Path, step: int) -> dict[str, float]:
    """covgrad's scalars of the fold at ``step``, from the in-run files by their definitions."""
    summary = json.loads((inrun / f"step_{step:06d}.json").read_text())
    saved = np.load(inrun / f"step_{step:06d}.npz")
    want = {k: float(summary[k]) for k in ("N", "mean_A", "std_A", "bound_violations")}
    want["overlap_F_absG"] = len(set(saved["top_F"]) & set(saved["top_absG"])) / len(saved["top_F"])
    want["max_abs_rho"] = float(np.nanmax(np.abs(saved["rho"])))
    want |= {f"overlap_first/{m}": v for m, v in summary["overlap_first"].items()}
    want |= {f"overlap_prev/{m}": v for m, v in summary["overlap_prev"].items() if not math.isnan(v)}
    return {f"{PREFIX}/{k}": v for k, v in want.items()}


@pytest.mark.slow
def test_covgrads_scalars_are_in_the_trainers_trackers(trl_run):
    tb, run_file, inrun, history = trl_run
    assert json.loads((inrun / "inrun.json").read_text())["steps"] == [0, 1]
    want = {t: expected(inrun, t) for t in range(STEPS)}
    assert want[0][f"{PREFIX}/N"] == G * PROMPTS and f"{PREFIX}/overlap_prev/F" not in want[0]

    assert len(list(tb.glob("events.out.tfevents.*"))) == 1
    acc = EventAccumulator(str(tb), size_guidance={SCALARS: 0})
    acc.Reload()
    board = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    logged = read_wandb(run_file)
    for t, values in want.items():
        for key, v in values.items():
            assert board[f"train/{key}"][t] == float(np.float32(v)), (key, t)  # TensorBoard keeps float32
            # W&B: at the Trainer's step key, float64
            at = {logged["train/global_step"][i]: x for i, x in logged[f"train/{key}"].items()}
            assert at[t] == v, (key, t)
        entry = next(e for e in history if e["step"] == t and f"{PREFIX}/N" in e)
        assert {k: v for k, v in entry.items() if k != "step"} == values
    assert {k for k in board if k.startswith("train/covgrad/")} == {f"train/{k}" for k in want[1]}

    # the trainer's own logging is left as it was: one entry with its loss and learning rate per step
    own = [e for e in history if "loss" in e]
    assert [e["step"] for e in own] == [1, 2] and all("reward" in e for e in own)
    assert sorted(board["train/learning_rate"]) == [1, 2]


@pytest.mark.slow
def test_the_trainers_tracker_histories_read_wandb(trl_run):
    tb, run_file, _, history = trl_run
    lr = {e["step"]: e["learning_rate"] for e in history if "learning_rate" in e}
    wb = read_history(str(run_file.parent))
    assert wb.format == "wandb" and {t: row["lr"] for t, row in wb.values.items() if "lr" in row} == lr
    assert wb.keys["loss"] == "loss" and wb.keys["reward"] == "reward"
    board = read_history(str(tb))
    assert {t: row["lr"] for t, row in board.values.items()} == {t: float(np.float32(v)) for t, v in lr.items()}
