"""Pure checks of a run's inputs, made before any stage: do the prompts fit the policy's context, and is a
dataset without rewards used only where rewards are not needed.

No file is read here (``storage.stores.prompts`` reads the task, the tokenizer and the model config) and
nothing heavy is imported, so the preflight (``flows.preflight``) stays well under 2 s; the rollouts
stage repeats :func:`check_context` with the loaded tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_MAX_POSITION_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_sequence_length",
    "max_seq_len",
    "seq_length",
    "n_ctx",
    "context_length",
)
"""Config fields that give a model's context in positions, in the order they are read. A config's ``max_length``
is not one of them: in older configs it is a generation default (20), not the context."""

UNBOUNDED_TOKENIZER = 10**18
"""A tokenizer ``model_max_length`` at or above this is transformers' "no limit" sentinel (``int(1e30)``), not a
context."""

CONTEXT_SETTING = "model.max_length"
"""The config setting that gives the policy's context when neither its config nor its tokenizer does."""


def max_positions(config: Mapping[str, Any]) -> int | None:
    """The longest sequence a Hugging Face model config allows (the first of :data:`_MAX_POSITION_KEYS` it sets
    to a positive integer, at the top level or in ``text_config``), or None."""
    for section in (config, config.get("text_config") or {}):
        for key in _MAX_POSITION_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def tokenizer_limit(model_max_length: object) -> int | None:
    """A tokenizer's ``model_max_length`` as a context in tokens: None when it is missing, not a positive whole
    number, or the unbounded sentinel (:data:`UNBOUNDED_TOKENIZER` or above)."""
    if isinstance(model_max_length, bool) or not isinstance(model_max_length, int | float):
        return None
    if not 0 < model_max_length < UNBOUNDED_TOKENIZER or model_max_length != int(model_max_length):
        return None
    return int(model_max_length)


def context_of(config: Mapping[str, Any], model_max_length: object = None, setting: int | None = None) -> int | None:
    """The context (positions) of a model: what its config says (:func:`max_positions`), else its tokenizer's
    ``model_max_length`` (:func:`tokenizer_limit`), else ``setting`` (:data:`CONTEXT_SETTING`, which only fills
    in for a model that tells neither); None when none of them gives one.

    Args:
        config: the model's config.json as a dict (``PretrainedConfig.to_dict()`` for a loaded model).
        model_max_length: the tokenizer's ``model_max_length`` (tokenizer_config.json's, or the loaded one's).
        setting: the run's ``model.max_length``.
    """
    return max_positions(config) or tokenizer_limit(model_max_length) or setting


def no_context(what: str) -> str:
    """The one line that refuses a model (``what``: where it comes from) whose context nothing tells."""
    keys = ", ".join(_MAX_POSITION_KEYS)
    return (
        f"cannot tell the context length of {what}: its config has none of {keys} and its tokenizer no "
        f"model_max_length; set {CONTEXT_SETTING} to the most tokens (prompt and response) the model may take"
    )


def check_context(lengths: Sequence[int], where: Sequence[str], max_new_tokens: int, limit: int, what: str) -> None:
    """ValueError (one line) naming the first prompt whose tokens plus ``max_new_tokens`` exceed the
    model's context ``limit``, with both lengths, how many prompts are too long, and what to change.

    Args:
        lengths: prompt lengths in tokens, special tokens included.
        where: the place of each prompt (``file:line``).
        max_new_tokens: the sampler's response budget.
        limit: the policy's context (maximum positions).
        what: the sampler's config section, e.g. ``rollouts.samplers.policy``.
    """
    over = [i for i, n in enumerate(lengths) if n + max_new_tokens > limit]
    if not over:
        return
    i = over[0]
    more = f" ({len(over) - 1} more prompt(s) too long)" if len(over) > 1 else ""
    raise ValueError(
        f"{where[i]}: the prompt is {lengths[i]} tokens; with {what}.max_new_tokens={max_new_tokens} that is "
        f"{lengths[i] + max_new_tokens} > the model's context of {limit} positions{more}; shorten the prompt "
        f"or lower max_new_tokens"
    )


DATASET_KINDS = ("sft_sampled", "sft_drift")
"""The regime kinds that fold over a dataset of responses without rewards (they read no advantages)."""


def check_unrewarded(cfg: Any, unrewarded: Mapping[str, str]) -> None:
    """ValueError (one line, naming the key) when a ``PipelineConfig`` needs the rewards of a sampler that has
    none: ``rollouts.analyse`` naming it (the rl analysis, masks, tokens, update check and trajectory read the
    analysed rollouts' advantages), or a regime of a kind outside :data:`DATASET_KINDS` folding over it.
    Every trajectory and update-check cell steps on the analysed sampler or on a regime's, so these two
    refusals cover them.

    Args:
        cfg: the run's ``PipelineConfig``.
        unrewarded: sampler name -> where its first record is (``file:line``), for each dataset sampler
            without rewards.
    """
    why = "is a dataset of responses without rewards ({} has no 'reward')"
    analysed = cfg.rollouts.analyse
    if analysed in unrewarded:
        raise ValueError(
            f"rollouts.analyse: sampler {analysed!r} {why.format(unrewarded[analysed])}, so its rl analysis "
            "(advantages, scores, stats, masks) is undefined; analyse a sampler with rewards and fold the dataset "
            "in an sft_sampled regime"
        )
    for name, r in cfg.regimes.items():
        sampler = r.sampler or analysed
        if sampler in unrewarded and r.kind not in DATASET_KINDS:
            raise ValueError(
                f"regimes.{name}.sampler: sampler {sampler!r} {why.format(unrewarded[sampler])}; regime kind "
                f"{r.kind} needs rewarded rollouts, only {' and '.join(DATASET_KINDS)} fold over a dataset"
            )
