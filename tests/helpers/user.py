"""A user's model and task for tests: a saved tiny checkpoint, a JSONL task and the tiny config pointed at them, and
the rewards those tasks name."""

import json
from pathlib import Path

from covgrad.config import DemoModel, PipelineConfig
from tests.helpers.pipeline import tiny_config

PROMPTS = [(1, 2), (3, 4), (5, 1), (2, 2), (7, 1), (0, 9), (4, 4), (6, 3)]


def digit_reward(prompt: str, response: str, answer: str) -> float:
    """1 when the response starts with a digit: a reward an untrained model earns about half the time."""
    del prompt, answer
    return float(response[:1].isdigit())


NAN_TENSOR = "model.layers.0.mlp.up_proj.weight"  # (64, 32): where ``write_checkpoint(nan=True)`` plants its NaN


def write_checkpoint(path: Path, nan: bool = False) -> Path:
    """A randomly initialised tiny Llama with the character tokenizer, saved as a model directory; with ``nan``
    one weight (the first of :data:`NAN_TENSOR`) is NaN."""
    import torch

    from covgrad.models import build_demo_model
    from covgrad.rollouts.problems import build_char_tokenizer

    tok = build_char_tokenizer()
    model = build_demo_model(DemoModel(hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64), tok)
    if nan:
        with torch.no_grad():
            model.get_parameter(NAN_TENSOR)[0, 0] = float("nan")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def user_config(root: Path, checkpoint: Path, task_file: Path, **overrides: object) -> PipelineConfig:
    """The tiny config on a user checkpoint and a JSONL task with ``digit_reward`` (no training)."""
    if not task_file.exists():
        lines = [json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) for a, b in PROMPTS]
        task_file.write_text("\n".join(lines) + "\n")
    return tiny_config(
        str(root),
        **{
            "name": "user",
            "model.path": str(checkpoint),
            "task": {
                "kind": "jsonl",
                "path": str(task_file),
                "reward": "tests.helpers.user:digit_reward",
                "trust_reward_code": True,
            },
            "rollouts.samplers": {"policy": {"group_size": 4, "max_new_tokens": 3, "batch_size": 16}},
            "tokens.enabled": False,
            "update_check.enabled": False,
            **overrides,
        },
    )


def nan_on_seven(prompt: str, response: str, answer: str) -> float:
    """NaN for the prompt whose answer is 7 (line 3 of the task file above), else 1."""
    del prompt, response
    return float("nan") if answer == "7" else 1.0


def constant_reward(prompt: str, response: str, answer: str) -> float:
    """The same reward for every response: no signal at all."""
    del prompt, response, answer
    return 1.0
