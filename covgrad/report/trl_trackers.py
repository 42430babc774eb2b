"""covgrad's in-run statistics in a TRL (Hugging Face Trainer) run's own trackers: :class:`CovgradTrackerLog` sends
the scalars of every step that ``covgrad.integrations.trl.CovgradInRun`` folded to the trainer's ``report_to``
integrations (TensorBoard, W&B, trackio, MLflow, ...) and into its ``trainer_state.json`` ``log_history``.

Use::

    inrun = CovgradInRun("run/inrun", every_n=10)
    tracked = CovgradTrackerLog(inrun)
    trainer = GRPOTrainer(..., args=GRPOConfig(..., report_to=["tensorboard"]), callbacks=[inrun, tracked])
    inrun.attach(trainer)
    tracked.attach(trainer)
    trainer.train()

After each optimizer step, every fold not logged yet is read from the in-run folder (``step_{t:06d}.json`` and
``.npz``, :mod:`covgrad.integrations.inrun`) and logged, keys under ``covgrad/inrun/`` (:func:`inrun_scalars`), at
x = t: the fold's step, the optimizer steps taken before the batch it describes (``covgrad run`` puts the start's
statistics at step 0 the same way). The integrations get them through the trainer's callback handler
(``on_log``) with copies of the trainer's state (its ``global_step`` set to t) and control, so the trainer's own
logging is left as it was; the integrations put ``train/`` before every key (transformers' ``rewrite_logs``), so
a TensorBoard tag or W&B key reads ``train/covgrad/inrun/...``, while ``log_history`` holds ``covgrad/inrun/...``
with ``"step": t``.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from transformers import TrainerCallback

PREFIX = "covgrad/inrun"
SUMMARY = ("N", "mean_A", "std_A", "bound_violations")  # the step file's scalars logged as they are


def inrun_scalars(folder: str | Path, step: int) -> dict[str, float]:
    """The scalars of the fold at ``step`` in the in-run ``folder`` (its ``step_{t:06d}.json`` and ``.npz``), keys
    under :data:`PREFIX`; non-finite values left out:

    - ``N`` (rows), ``mean_A`` and ``std_A`` (the advantages' mean and std, reward units), ``bound_violations``
      (coordinates where |Cov(A, s)| > std(A)·√Var(s));
    - ``overlap_F_absG``: |top F ∩ top |G|| / |top F|, the top sets at the fold's fraction q (``covgrad run``'s
      headline overlap at that q);
    - ``max_abs_rho``: max |ρ| over the coordinates where ρ is defined (only when the fold wrote ``rho``);
    - ``overlap_prev/<m>`` and ``overlap_first/<m>`` for m in F, absG, absrho: the top set's overlap with the
      previous and the first folded step's.
    """
    name = Path(folder) / f"step_{step:06d}"
    summary = json.loads(name.with_suffix(".json").read_text())
    values: dict[str, Any] = {k: summary[k] for k in SUMMARY}
    with np.load(name.with_suffix(".npz")) as saved:
        top_F, top_G = saved["top_F"], saved["top_absG"]
        values["overlap_F_absG"] = len(np.intersect1d(top_F, top_G)) / len(top_F) if len(top_F) else math.nan
        if "rho" in saved.files:
            rho = np.abs(saved["rho"])
            values["max_abs_rho"] = float(np.nanmax(rho)) if np.isfinite(rho).any() else math.nan
    for which in ("overlap_prev", "overlap_first"):
        values |= {f"{which}/{m}": v for m, v in summary[which].items()}
    return {f"{PREFIX}/{k}": float(v) for k, v in values.items() if v is not None and math.isfinite(v)}


class CovgradTrackerLog(TrainerCallback):
    """Logs the folds of ``inrun`` (a ``CovgradInRun``) to the trainer's trackers (see the module docstring).

    Args:
        inrun: the in-run callback whose folder is read; attach both to the same trainer.
    """

    def __init__(self, inrun: Any) -> None:
        self.inrun = inrun
        self.logged: list[int] = []
        self.trainer: Any = None

    def attach(self, trainer: Any) -> CovgradTrackerLog:
        """Log through ``trainer``'s callback handler and state."""
        self.trainer = trainer
        return self

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Refuse a run whose trainer was not attached."""
        if self.trainer is None:
            raise RuntimeError("CovgradTrackerLog: call tracked.attach(trainer) before trainer.train()")

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Log every fold that wrote its files since the last call, at its own step."""
        folder = Path(self.inrun.out)
        for step in self.inrun.folder.steps:
            if step in self.logged or not (folder / f"step_{step:06d}.json").is_file():
                continue  # a fold without statistics writes no files
            logs = inrun_scalars(folder, step)
            state.log_history.append({**logs, "step": step})
            at = copy.copy(state)
            at.global_step = step
            self.trainer.callback_handler.on_log(args, at, copy.copy(control), logs)
            self.logged.append(step)
