"""Pure checks of a run's inputs, made before any stage: do the prompts fit the policy's context, and is a
dataset without rewards used only where rewards are not needed.

No file is read here (``storage.stores.prompts`` reads the task, the tokenizer and the model config) and
nothing heavy is imported, so the preflight (``flows.preflight``) stays well under 2 s; the rollouts
stage repeats :func:`check_context` with the loaded tokenizer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_MAX_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length")


def max_positions(config: Mapping[str, Any]) -> int | None:
    """The longest sequence a Hugging Face model config allows (``max_position_embeddings``,
    ``n_positions`` or ``max_sequence_length``, at the top level or in ``text_config``), or None."""
    for section in (config, config.get("text_config") or {}):
        for key in _MAX_POSITION_KEYS:
            value = section.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


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
