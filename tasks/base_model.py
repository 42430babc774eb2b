"""base_model stage: the demo's SFT-trained tiny Llama and its stale checkpoint, or a user model."""

from __future__ import annotations

import zlib
from typing import Any

import torch
from prefect import task

from covgrad.models import build_demo_model
from covgrad.rollouts import addition_problems, answer_tokens, build_char_tokenizer
from covgrad.updates import train_sft
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.models import load_model_and_tokenizer
from tasks.common import StageResult, log, progress_bar, run_stage
from tasks.specs import BaseModelSpec


def _train_demo(store: ArtifactStore, ref: ArtifactRef, spec: BaseModelSpec) -> dict[str, Any]:
    demo, digits = spec.demo, spec.digits
    assert demo is not None and digits is not None
    torch.manual_seed(demo.seed)
    tokenizer = build_char_tokenizer()
    model = build_demo_model(demo, tokenizer)
    eval_problems = addition_problems(demo.eval_prompts, digits, seed=demo.seed + 1_000_003)

    def train_problems(step: int) -> list:
        return addition_problems(demo.batch_size, digits, seed=zlib.crc32(f"{demo.seed}:{step}".encode()))

    # every thread the stage has: on 2 cores the demo's SFT takes 56 s against 73 s on one thread, with
    # bit-identical weights
    # total: at most max_steps SFT steps (training stops earlier once the accuracy band is reached)
    with progress_bar("base_model SFT (stops at the accuracy band)", demo.max_steps, "step") as bar:

        def report(step: int, acc: float) -> None:
            log.info("base_model: step %d sampled accuracy %.3f", step, acc)
            if step > bar.done:
                bar.update(step - bar.done)

        result = train_sft(model, tokenizer, demo, train_problems, eval_problems, answer_tokens(digits), report)
    for name, state in (("policy", result.policy_state), ("stale", result.stale_state)):
        model.load_state_dict(state)
        with store.local_dir(ref, name, write=True) as d:
            model.save_pretrained(d, safe_serialization=True)
            tokenizer.save_pretrained(d)
    info = {
        "policy_accuracy": result.policy_accuracy,
        "stale_accuracy": result.stale_accuracy,
        "stale_step": result.stale_step,
        "steps": result.steps,
        "history": result.history,
        "n_parameters": sum(p.numel() for p in model.parameters()),
    }
    store.write_json(ref, "sft.json", info)
    return {"policy_accuracy": result.policy_accuracy, "stale_accuracy": result.stale_accuracy}


def _register_user_model(store: ArtifactStore, ref: ArtifactRef, spec: BaseModelSpec) -> dict[str, Any]:
    p = spec.policy
    assert p.path is not None
    model, _ = load_model_and_tokenizer(p.path, p.dtype, p.trust_remote_code)
    info = {
        "path": p.path,
        "n_parameters": sum(p.numel() for p in model.parameters()),
    }
    store.write_json(ref, "model.json", info)
    return info


@task(name="base_model")
def base_model_task(ref: ArtifactRef, spec: BaseModelSpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """Train (demo) or register (user path) the policy model."""
    compute = _train_demo if spec.policy.path is None else _register_user_model
    return run_stage(ref, spec, lambda store, r: compute(store, r, spec))
