"""Saved tiny hybrid and MoE model directories and a small pipeline config to run them (preflight and CLI tests)."""

from __future__ import annotations

import json
from pathlib import Path

from covgrad.config import PipelineConfig
from tests.helpers.pipeline import tiny_config


def family_config(root: Path, model: Path, **overrides: object) -> PipelineConfig:
    """The tiny pipeline config on a saved model directory: a two-prompt addition task in a JSONL file under
    ``root``, four samples per prompt, ``overrides`` as dotted keys."""
    task = root / "task.jsonl"
    task.write_text(
        "".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n" for a, b in [(1, 2), (3, 4)])
    )
    return tiny_config(
        str(root / "runs"),
        **{
            "name": "family",
            "model.path": str(model),
            "task": {
                "kind": "jsonl",
                "path": str(task),
                "reward": "covgrad.rewards:addition_reward",
                "n_prompts": 2,
            },
            "rollouts.samplers": {"policy": {"group_size": 4, "max_new_tokens": 3, "batch_size": 8}},
            **overrides,
        },
    )


def arch_dir(path: Path, family: str) -> Path:
    """A tiny ``family`` model of tests.families.test_families_hybrid_ssm_moe with the character tokenizer, saved."""
    from covgrad.rollouts.problems import build_char_tokenizer
    from tests.helpers.families_hybrid import family_model

    tok = build_char_tokenizer()
    model = family_model(family, vocab_size=len(tok))
    model.config._attn_implementation = "eager"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


# Every stage, each with the least work: every parameter selected, one update-check cell, probe tokens.
SMALL = {
    "model.params": None,
    "masks.qs": [0.1],
    "tokens.modes": ["probe"],
    "tokens.max_samples": 4,
    "update_check.optimizers": ["sgd"],
    "update_check.precisions": ["fp32"],
    "update_check.steps": [1],
}

ARCH_GENERIC = {
    "qwen3.5": "model.layers.N.linear_attn.dt_bias",
    "gpt-oss": "model.layers.N.self_attn.sinks",
    "deepseek-v3": "model.layers.N.mlp.gate.weight",
}
