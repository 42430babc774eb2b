"""The stages that train models: the demo's policy (base_model) and its teacher.

base_model stage: the demo's SFT-trained tiny Llama and its stale checkpoint, or a user model.

teacher stage: the demo's trained teacher, the base_model artifact's policy trained on by SFT.

The policy is trained further by ``covgrad.updates.sft.train_sft`` (AdamW at ``trained_teacher.lr``, batches of
``trained_teacher.batch_size`` from a seed stream of its own) until its sampled accuracy on the base_model
stage's evaluation prompts reaches ``trained_teacher.accuracy``; the result is saved as ``teacher/`` (model
and tokenizer) with ``teacher.json`` (accuracy history). The base_model artifact and its key stay what they are.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from prefect import task

from covgrad.models import build_demo_model
from covgrad.rollouts import addition_problems, answer_tokens, build_char_tokenizer
from covgrad.updates import train_sft
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.models import load_model_and_tokenizer, load_models
from tasks.common import StageResult, log, progress_bar, run_stage
from tasks.specs import BaseModelSpec, TeacherSpec


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


def _train(store: ArtifactStore, ref: ArtifactRef, spec: TeacherSpec, base: ArtifactRef) -> dict[str, Any]:
    demo, digits, t = spec.demo, spec.digits, spec.training
    model, tokenizer = load_models(store, base, "policy", spec.policy)
    # train_sft keeps the last checkpoint at or below stale_max_accuracy and stops inside target_accuracy:
    # every evaluation below the target is "stale", the first one at or above it ends the training
    settings = demo.model_copy(
        update={
            "lr": t.lr,
            "batch_size": t.batch_size,
            "max_steps": t.max_steps,
            "eval_every": t.eval_every,
            "target_accuracy": (t.accuracy, 1.0),
            "stale_max_accuracy": max(0.0, t.accuracy - 1e-9),
        }
    )
    eval_problems = addition_problems(demo.eval_prompts, digits, seed=demo.seed + 1_000_003)

    def train_problems(step: int) -> list:
        return addition_problems(t.batch_size, digits, seed=zlib.crc32(f"teacher:{demo.seed}:{step}".encode()))

    # every thread the stage has: at batch 128 two threads step 1.2x faster than one
    with progress_bar(f"teacher SFT (stops at accuracy {t.accuracy})", t.max_steps, "step") as bar:

        def report(step: int, acc: float) -> None:
            log.info("teacher: step %d sampled accuracy %.3f", step, acc)
            if step > bar.done:
                bar.update(step - bar.done)

        try:
            result = train_sft(model, tokenizer, settings, train_problems, eval_problems, answer_tokens(digits), report)
        except RuntimeError as err:
            raise RuntimeError(
                f"the demo teacher did not reach regimes.*.trained_teacher.accuracy {t.accuracy} within "
                f"trained_teacher.max_steps {t.max_steps} ({err}); raise max_steps or lower the accuracy"
            ) from None
    model.load_state_dict(result.policy_state)
    with store.local_dir(ref, "teacher", write=True) as d:
        model.save_pretrained(d, safe_serialization=True)
        tokenizer.save_pretrained(d)
    info = {"teacher_accuracy": result.policy_accuracy, "steps": result.steps, "history": result.history}
    store.write_json(ref, "teacher.json", info)
    return {"teacher_accuracy": result.policy_accuracy, "steps": result.steps}


@task(name="teacher")
def teacher_task(ref: ArtifactRef, spec: TeacherSpec, upstream: dict[str, ArtifactRef]) -> StageResult:
    """Train the demo's teacher from the base_model artifact's policy."""
    return run_stage(ref, spec, lambda store, r: _train(store, r, spec, upstream["base_model"]))
