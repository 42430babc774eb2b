"""The demo SFT's batch: ``<bos> prompt answer <eos>`` rows, right-padded, labels only on the answer and EOS."""

from __future__ import annotations

import torch

from covgrad.rollouts.problems import Problem, addition_problems, build_char_tokenizer
from covgrad.updates.sft import sft_batch


def test_rows_labels_and_mask_match_a_row_by_row_construction():
    tok = build_char_tokenizer()
    problems = addition_problems(16, 2, seed=3) + [Problem(prompt="9+9=", answer="18")]
    out = sft_batch(tok, problems)
    width = out["input_ids"].shape[1]
    for i, p in enumerate(problems):
        prompt = tok(p.prompt)["input_ids"]
        answer = tok(p.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        pad = width - len(prompt) - len(answer)
        assert out["input_ids"][i].tolist() == prompt + answer + [tok.pad_token_id] * pad
        assert out["labels"][i].tolist() == [-100] * len(prompt) + answer + [-100] * pad
        assert out["attention_mask"][i].tolist() == [1] * (len(prompt) + len(answer)) + [0] * pad
    assert all(v.dtype == torch.int64 for v in out.values())
    assert width == max(len(tok(p.prompt)["input_ids"]) + len(p.answer) + 1 for p in problems)
