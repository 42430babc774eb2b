"""base_model stage: the demo's SFT-trained tiny Llama and its stale checkpoint, or a user model."""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

import torch
from prefect import task
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from covgrad.config import PipelineConfig
from covgrad.models import build_demo_model
from covgrad.sft import train_sft
from covgrad.task import addition_problems, build_char_tokenizer
from storage.artifacts import ArtifactRef, ArtifactStore
from storage.models import load_model_and_tokenizer, model_fingerprint
from tasks.common import StageResult, log, run_stage

VERSION = "1"


def stage_config(cfg: PipelineConfig) -> dict[str, Any]:
    """What the base_model artifact depends on."""
    if cfg.model.path is None:
        return {"demo": cfg.model.demo.model_dump(), "digits": cfg.task.digits, "dtype": cfg.model.dtype}
    return {
        "path": str(Path(cfg.model.path).resolve()),
        "fingerprint": model_fingerprint(cfg.model.path),
        "dtype": cfg.model.dtype,
        "trust_remote_code": cfg.model.trust_remote_code,
    }


def answer_tokens(digits: int) -> int:
    """Response budget of the addition task: up to digits + 1 sum digits, then EOS."""
    return digits + 2


def _train_demo(store: ArtifactStore, ref: ArtifactRef, cfg: PipelineConfig) -> dict[str, Any]:
    demo = cfg.model.demo
    torch.manual_seed(demo.seed)
    tokenizer = build_char_tokenizer()
    model = build_demo_model(demo, tokenizer)
    digits = cfg.task.digits
    eval_problems = addition_problems(demo.eval_prompts, digits, seed=demo.seed + 1_000_003)

    def train_problems(step: int) -> list:
        return addition_problems(demo.batch_size, digits, seed=zlib.crc32(f"{demo.seed}:{step}".encode()))

    def report(step: int, acc: float) -> None:
        log.info("base_model: step %d sampled accuracy %.3f", step, acc)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 1e5-parameter model trains fastest on one thread; more only contend
    try:
        result = train_sft(model, tokenizer, demo, train_problems, eval_problems, answer_tokens(digits), report)
    finally:
        torch.set_num_threads(threads)
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


def _register_user_model(store: ArtifactStore, ref: ArtifactRef, cfg: PipelineConfig) -> dict[str, Any]:
    assert cfg.model.path is not None
    model, _ = load_model_and_tokenizer(cfg.model.path, cfg.model.dtype, cfg.model.trust_remote_code)
    info = {
        "path": str(Path(cfg.model.path).resolve()),
        "n_parameters": sum(p.numel() for p in model.parameters()),
    }
    store.write_json(ref, "model.json", info)
    return info


@task(name="base_model")
def base_model_task(
    ref: ArtifactRef, cfg: PipelineConfig, instance: str, upstream: dict[str, ArtifactRef]
) -> StageResult:
    """Train (demo) or register (user path) the policy model."""
    compute = _train_demo if cfg.model.path is None else _register_user_model
    return run_stage(ref, stage_config(cfg), lambda store, r: compute(store, r, cfg))


def load_models(
    store: ArtifactStore, base: ArtifactRef, which: str, cfg: PipelineConfig
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the policy (``which='policy'``), the demo's stale checkpoint (``'stale'``) or another model
    directory given by path, with the tokenizer saved beside it, in eval mode."""
    dtype, trust = cfg.model.dtype, cfg.model.trust_remote_code
    if which == "policy" and cfg.model.path is not None:
        return load_model_and_tokenizer(cfg.model.path, dtype, trust)
    if which in ("policy", "stale"):
        with store.local_dir(base, which, write=False) as d:
            return load_model_and_tokenizer(d, dtype, trust)
    return load_model_and_tokenizer(which, dtype, trust)
