"""Callbacks for tests that run a real Hugging Face / TRL trainer."""

from __future__ import annotations

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
