"""A real TRL ``DistillationTrainer`` for the tests: a float64 one-layer Llama student and a float64 teacher of another
width and seed over the character vocabulary (built from configs), one step at learning rate 0 on 8 prompts of two
lengths (so left padding). Needs the ``trl`` extra (imported
when called)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from covgrad.rollouts.problems import addition_problems, build_char_tokenizer
from tests.helpers.models import tiny_llama

N_PROMPTS, T_MAX = 8, 6  # completions per step (one per prompt), max_completion_length


def char_models() -> tuple[Any, torch.nn.Module, torch.nn.Module]:
    """The char tokenizer, a float64 one-layer student (hidden 16) and a float64 teacher (hidden 24, another seed)
    over its vocabulary."""
    tok = build_char_tokenizer()
    V = len(tok.get_vocab())
    common = {"layers": 1, "heads": 2, "kv_heads": 1, "pad_token_id": 0, "eos_token_id": 2}
    student = tiny_llama(V, hidden=16, intermediate=32, seed=0, **common).to(torch.float64)
    teacher = tiny_llama(V, hidden=24, intermediate=40, seed=1, **common).to(torch.float64)
    return tok, student, teacher


def distillation_trainer(
    models: tuple[Any, torch.nn.Module, torch.nn.Module],
    out: Path,
    beta: float,
    temperature: float,
    callbacks: list[Any],
) -> Any:
    """A ``DistillationTrainer`` of copies of ``models`` (:func:`char_models`) set for one step at learning rate 0
    without gradient clipping, on CPU in float64, not yet trained."""
    from datasets import Dataset
    from trl import DistillationConfig, DistillationTrainer

    tok, student, teacher = models
    problems = addition_problems(N_PROMPTS // 2, 1, 0) + addition_problems(N_PROMPTS // 2, 2, 1)
    args = DistillationConfig(
        output_dir=str(out),
        beta=beta,
        temperature=temperature,
        per_device_train_batch_size=N_PROMPTS,
        max_completion_length=T_MAX,
        max_steps=1,
        learning_rate=0.0,
        max_grad_norm=0.0,  # no clipping: the raw gradient
        gradient_checkpointing=False,
        use_cpu=True,
        bf16=False,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    return DistillationTrainer(
        model=copy.deepcopy(student),
        teacher_model=copy.deepcopy(teacher),
        args=args,
        train_dataset=Dataset.from_list([{"prompt": p.prompt} for p in problems]),
        processing_class=tok,
        callbacks=callbacks,
    )
