"""Rollouts: sampling and advantages, the typed batch, prompts and rewards, stack formats and imports,
input checks and rollout-mismatch metrics.

Names re-exported lazily (:mod:`covgrad.lazy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from covgrad.lazy import exports

if TYPE_CHECKING:
    from covgrad.rollouts.batch import RolloutBatch, group_batches
    from covgrad.rollouts.formats import convert, import_records, parse_reward_fields, rename_fields, without_rewards
    from covgrad.rollouts.imports import record_mismatch, records_to_rollouts, require_mu_source, verification_warning
    from covgrad.rollouts.inputs import check_context, check_unrewarded, max_positions, no_context
    from covgrad.rollouts.mismatch import mismatch_metrics
    from covgrad.rollouts.problems import (
        DEMO_CONTEXT,
        Problem,
        RewardFn,
        addition_problems,
        addition_reward,
        answer_tokens,
        build_char_tokenizer,
        char_tokenizer,
        problems_from_records,
        resolve_reward,
        response_texts,
        score_rewards,
    )
    from covgrad.rollouts.sampling import (
        AdvantageKind,
        SamplerSpec,
        check_rewards,
        check_sampler_logp,
        compute_advantages,
        generate,
        mu_from_topk,
        recompute_sampler_logp,
        sampler_log_probs,
    )

_EXPORTS = {
    "AdvantageKind": "covgrad.rollouts.sampling",
    "DEMO_CONTEXT": "covgrad.rollouts.problems",
    "Problem": "covgrad.rollouts.problems",
    "RewardFn": "covgrad.rollouts.problems",
    "RolloutBatch": "covgrad.rollouts.batch",
    "SamplerSpec": "covgrad.rollouts.sampling",
    "addition_problems": "covgrad.rollouts.problems",
    "addition_reward": "covgrad.rollouts.problems",
    "answer_tokens": "covgrad.rollouts.problems",
    "build_char_tokenizer": "covgrad.rollouts.problems",
    "char_tokenizer": "covgrad.rollouts.problems",
    "check_context": "covgrad.rollouts.inputs",
    "check_rewards": "covgrad.rollouts.sampling",
    "check_sampler_logp": "covgrad.rollouts.sampling",
    "check_unrewarded": "covgrad.rollouts.inputs",
    "compute_advantages": "covgrad.rollouts.sampling",
    "convert": "covgrad.rollouts.formats",
    "generate": "covgrad.rollouts.sampling",
    "group_batches": "covgrad.rollouts.batch",
    "import_records": "covgrad.rollouts.formats",
    "max_positions": "covgrad.rollouts.inputs",
    "mismatch_metrics": "covgrad.rollouts.mismatch",
    "mu_from_topk": "covgrad.rollouts.sampling",
    "no_context": "covgrad.rollouts.inputs",
    "parse_reward_fields": "covgrad.rollouts.formats",
    "problems_from_records": "covgrad.rollouts.problems",
    "recompute_sampler_logp": "covgrad.rollouts.sampling",
    "record_mismatch": "covgrad.rollouts.imports",
    "records_to_rollouts": "covgrad.rollouts.imports",
    "rename_fields": "covgrad.rollouts.formats",
    "require_mu_source": "covgrad.rollouts.imports",
    "resolve_reward": "covgrad.rollouts.problems",
    "response_texts": "covgrad.rollouts.problems",
    "sampler_log_probs": "covgrad.rollouts.sampling",
    "score_rewards": "covgrad.rollouts.problems",
    "verification_warning": "covgrad.rollouts.imports",
    "without_rewards": "covgrad.rollouts.formats",
}

__all__ = [
    "DEMO_CONTEXT",
    "AdvantageKind",
    "Problem",
    "RewardFn",
    "RolloutBatch",
    "SamplerSpec",
    "addition_problems",
    "addition_reward",
    "answer_tokens",
    "build_char_tokenizer",
    "char_tokenizer",
    "check_context",
    "check_rewards",
    "check_sampler_logp",
    "check_unrewarded",
    "compute_advantages",
    "convert",
    "generate",
    "group_batches",
    "import_records",
    "max_positions",
    "mismatch_metrics",
    "mu_from_topk",
    "no_context",
    "parse_reward_fields",
    "problems_from_records",
    "recompute_sampler_logp",
    "record_mismatch",
    "records_to_rollouts",
    "rename_fields",
    "require_mu_source",
    "resolve_reward",
    "response_texts",
    "sampler_log_probs",
    "score_rewards",
    "verification_warning",
    "without_rewards",
]

__getattr__ = exports(__name__, _EXPORTS)
