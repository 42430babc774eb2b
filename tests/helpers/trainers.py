"""Callbacks and settings for tests that run a real Hugging Face / TRL trainer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


class StepGradient:
    """A trainer callback (``callback``) keeping the flat gradient the optimizer step is about to apply, ``grad``
    (P,) in the model's dtype."""

    def __init__(self) -> None:
        from transformers import TrainerCallback

        grabber = self

        class Grab(TrainerCallback):
            def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
                grabber.grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).detach().clone()

        self.callback = Grab()
        self.grad: torch.Tensor | None = None


def cpu_grpo_args(out: Path, per_device: int, generations: int, **overrides: Any) -> Any:
    """A ``GRPOConfig`` for a tiny CPU run: ``per_device`` completions per process and step in groups of
    ``generations``, 4 new tokens, 2 steps at lr 1e-2, no KL term, fp32, no reports or saves, seed 0
    (``overrides`` replace any of these)."""
    from trl import GRPOConfig

    settings: dict[str, Any] = {
        "output_dir": str(out),
        "per_device_train_batch_size": per_device,
        "num_generations": generations,
        "max_completion_length": 4,
        "max_steps": 2,
        "learning_rate": 1e-2,
        "beta": 0.0,
        "use_cpu": True,
        "bf16": False,
        "report_to": [],
        "save_strategy": "no",
        "seed": 0,
        "dataloader_num_workers": 0,
    }
    return GRPOConfig(**(settings | overrides))
