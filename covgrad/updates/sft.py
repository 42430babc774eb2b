"""Supervised fine-tuning of the demo model until its sampled accuracy lands in a target band.

The demo needs a policy whose rewards vary (accuracy at temperature 1 inside ``target_accuracy``),
and an earlier, clearly worse checkpoint to act as a stale sampler for the off-policy comparison.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerFast

from covgrad.config import DemoModel
from covgrad.rollouts.problems import Problem, addition_reward, response_texts
from covgrad.rollouts.sampling import SamplerSpec, generate


@dataclass
class SFTResult:
    """The trained policy's and the stale checkpoint's weights, with the accuracy history."""

    policy_state: dict[str, torch.Tensor]
    stale_state: dict[str, torch.Tensor]
    policy_accuracy: float
    stale_accuracy: float
    stale_step: int
    steps: int
    history: list[tuple[int, float]] = field(default_factory=list)


def sft_batch(tokenizer: PreTrainedTokenizerFast, problems: list[Problem]) -> dict[str, torch.Tensor]:
    """Right-padded rows ``<bos> prompt answer <eos>``; labels are -100 except on answer and EOS."""
    prompts = tokenizer([p.prompt for p in problems])["input_ids"]  # two calls per batch, not two per row
    answers = tokenizer([p.answer for p in problems], add_special_tokens=False)["input_ids"]
    rows = [q + a + [tokenizer.eos_token_id] for q, a in zip(prompts, answers, strict=True)]
    width = max(len(r) for r in rows)
    pad = [width - len(r) for r in rows]
    ids = torch.tensor([r + [tokenizer.pad_token_id] * k for r, k in zip(rows, pad, strict=True)])
    lab = torch.tensor([[-100] * len(q) + r[len(q) :] + [-100] * k for q, r, k in zip(prompts, rows, pad, strict=True)])
    mask = torch.tensor([[1] * len(r) + [0] * k for r, k in zip(rows, pad, strict=True)])
    return {"input_ids": ids, "attention_mask": mask, "labels": lab}


def sampled_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    problems: list[Problem],
    seed: int,
    max_new_tokens: int,
) -> float:
    """Fraction of ``problems`` answered exactly by one sample each at temperature 1."""
    prompts = [tokenizer(p.prompt)["input_ids"] for p in problems]
    out = generate(
        model,
        prompts,
        list(range(len(prompts))),
        1,
        SamplerSpec(max_new_tokens=max_new_tokens),
        seed,
        batch_size=256,
        eos_id=tokenizer.eos_token_id,
        pad_id=tokenizer.pad_token_id,
    )
    texts = response_texts(tokenizer, out["tokens"].tolist(), out["prompt_len"], out["response_len"])
    return sum(addition_reward(p.prompt, t, p.answer) for p, t in zip(problems, texts, strict=True)) / len(problems)


def train_sft(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    cfg: DemoModel,
    train_problems: Callable[[int], list[Problem]],
    eval_problems: list[Problem],
    max_new_tokens: int,
    progress: Callable[[int, float], None] | None = None,
) -> SFTResult:
    """Train ``model`` in place with AdamW on cross-entropy over answer tokens.

    ``train_problems(step)`` gives the batch for a step. Every ``cfg.eval_every`` steps the sampled
    accuracy on ``eval_problems`` is measured; the last checkpoint at or below
    ``cfg.stale_max_accuracy`` becomes the stale sampler and training stops as soon as the accuracy
    lies inside ``cfg.target_accuracy``. RuntimeError when that band is never reached.
    """
    torch.manual_seed(cfg.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    low, high = cfg.target_accuracy
    history: list[tuple[int, float]] = []
    stale: tuple[int, float, dict[str, torch.Tensor]] | None = None
    for step in range(cfg.max_steps + 1):
        if step % cfg.eval_every == 0:
            model.eval()
            acc = sampled_accuracy(model, tokenizer, eval_problems, seed=cfg.seed, max_new_tokens=max_new_tokens)
            history.append((step, acc))
            if progress is not None:
                progress(step, acc)
            if acc <= cfg.stale_max_accuracy:
                stale = (step, acc, copy.deepcopy(model.state_dict()))
            elif low <= acc <= high and stale is not None:
                return SFTResult(
                    policy_state=copy.deepcopy(model.state_dict()),
                    stale_state=stale[2],
                    policy_accuracy=acc,
                    stale_accuracy=stale[1],
                    stale_step=stale[0],
                    steps=step,
                    history=history,
                )
            elif acc > high:
                raise RuntimeError(
                    f"demo SFT overshot: accuracy {acc:.2f} > {high} at step {step} without landing in "
                    f"[{low}, {high}]; lower model.demo.lr (now {cfg.lr}) or model.demo.eval_every ({cfg.eval_every})"
                )
            if step == cfg.max_steps:
                break
        model.train()
        batch = sft_batch(tokenizer, train_problems(step))
        loss = model(**batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    raise RuntimeError(
        f"demo SFT did not reach accuracy in {cfg.target_accuracy} within {cfg.max_steps} steps "
        f"(history {history[-3:]}); raise model.demo.max_steps or model.demo.lr"
    )
