"""Problems: prompts plus a reward. The built-in demo problem set is integer addition with a character tokenizer.

A task is a list of ``Problem`` (prompt text and reference answer) and a reward function
``reward(prompt, response_text, answer) -> float``. The built-in ``addition`` task rewards an exact
answer with 1.0 and anything else (a wrong or malformed answer) with 0.0. A user task is a JSONL file
of ``{"prompt": ..., "answer": ...}`` lines (read by ``storage.readers``) and a reward function named by
its import path ``module:function``.
"""

from __future__ import annotations

import importlib
import math
import numbers
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # transformers loads lazily: reading prompts and a reward must not wait for it
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

RewardFn = Callable[[str, str, str], float]

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
ADDITION_CHARS = "0123456789+="
DEMO_CONTEXT = 64  # positions of the demo model (covgrad.models.build_demo_model)


@dataclass(frozen=True)
class Problem:
    """One prompt and its reference answer (text)."""

    prompt: str
    answer: str


def addition_problems(n: int, digits: int, seed: int) -> list[Problem]:
    """``n`` prompts ``a+b=`` with ``digits``-digit operands (zero-padded), drawn from ``seed``.

    The answer is the decimal sum without leading zeros; the model should emit it, then EOS.
    """
    if n < 1 or digits < 1:
        raise ValueError(f"addition task needs n >= 1 and digits >= 1 (got n={n}, digits={digits})")
    rng = random.Random(seed)
    hi = 10**digits
    out = []
    for _ in range(n):
        a, b = rng.randrange(hi), rng.randrange(hi)
        out.append(Problem(f"{a:0{digits}d}+{b:0{digits}d}=", str(a + b)))
    return out


def addition_reward(prompt: str, response: str, answer: str) -> float:
    """1.0 when the response (text before EOS) is exactly the answer's digits, else 0.0."""
    del prompt
    return 1.0 if response.strip() == answer else 0.0


def char_tokenizer(chars: str = ADDITION_CHARS) -> Tokenizer:
    """The demo's character-level ``tokenizers.Tokenizer``: one token per character, BOS prepended.

    Ids: 0 ``<pad>``, 1 ``<bos>``, 2 ``<eos>``, 3 ``<unk>``, then the characters in order. Needs only the
    ``tokenizers`` library, so preflight can count prompt tokens before transformers loads.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    if len(set(chars)) != len(chars):
        raise ValueError(f"tokenizer characters must be distinct, got {chars!r}")
    vocab = {PAD: 0, BOS: 1, EOS: 2, UNK: 3}
    for c in chars:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", special_tokens=[(BOS, 1)])
    return tok


def build_char_tokenizer(chars: str = ADDITION_CHARS) -> PreTrainedTokenizerFast:
    """:func:`char_tokenizer` as a Hugging Face tokenizer (right padding).

    ``save_pretrained(dir)`` makes it loadable with ``AutoTokenizer.from_pretrained(dir)``.
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=char_tokenizer(chars),
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="right",
    )


BUILTIN_REWARDS = "covgrad.rewards"  # the module whose rewards run without task.trust_reward_code


def resolve_reward(spec: str, trusted: bool = False) -> RewardFn:
    """Import a reward function from ``module:function``; ValueError naming the path when it fails, or, before
    anything is imported, when the module is not :data:`BUILTIN_REWARDS` and ``trusted`` (the config's
    ``task.trust_reward_code``) is off: importing a module runs its code."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward {spec!r} must be an import path 'module:function'")
    if module_name != BUILTIN_REWARDS and not trusted:
        raise ValueError(
            f"task.reward {spec!r} would import and run module {module_name!r}, code outside {BUILTIN_REWARDS}; "
            f"set task.trust_reward_code: true to allow it, or use a {BUILTIN_REWARDS}:<name> reward"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({exc})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no function {attr!r}")
    return fn


def problems_from_records(records: Sequence[dict]) -> list[Problem]:
    """Problems from JSONL records ``{"prompt": str, "answer": any}``; errors name the record index."""
    out = []
    for i, rec in enumerate(records):
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str) or not rec["prompt"]:
            raise ValueError(f"task record {i}: needs a non-empty string field 'prompt'")
        out.append(Problem(rec["prompt"], str(rec.get("answer", ""))))
    if not out:
        raise ValueError('the task file holds no prompts; add lines of {"prompt": ..., "answer": ...}')
    return out


def score_rewards(
    reward_fn: RewardFn, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[str]
) -> list[float]:
    """Apply the reward to every (prompt, response, answer); ValueError naming the record index when
    the reward raises or returns something that is not a finite number."""
    out = []
    for i, (p, r, a) in enumerate(zip(prompts, responses, answers, strict=True)):
        try:
            value = reward_fn(p, r, a)
        except Exception as exc:  # a user function may raise anything; report which record
            raise ValueError(f"reward function raised on record {i} ({type(exc).__name__}: {exc})") from None
        if isinstance(value, bool | np.bool_) or not isinstance(value, numbers.Real):
            raise ValueError(f"reward function returned {value!r} for record {i}; it must return a float")
        if not math.isfinite(value):
            raise ValueError(f"reward function returned {value} for record {i}; rewards must be finite")
        out.append(float(value))
    return out


def response_texts(
    tokenizer: PreTrainedTokenizerFast,
    tokens: Sequence[Sequence[int]],
    prompt_len: Sequence[int],
    response_len: Sequence[int],
) -> list[str]:
    """Decode each row's response tokens (``tokens[n, prompt_len[n] : prompt_len[n] + response_len[n]]``),
    special tokens (EOS, padding) dropped."""
    return [
        tokenizer.decode(list(row[int(p) : int(p) + int(r)]), skip_special_tokens=True)
        for row, p, r in zip(tokens, prompt_len, response_len, strict=True)
    ]


def answer_tokens(digits: int) -> int:
    """Response budget of the addition task: up to digits + 1 sum digits, then EOS."""
    return digits + 2
