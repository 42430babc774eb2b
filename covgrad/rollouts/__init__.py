"""Rollouts: sampling and advantages, the typed batch, prompts and rewards, stack formats and imports,
input checks and rollout-mismatch metrics.
"""

from covgrad.rollouts.batch import RolloutBatch, group_batches
from covgrad.rollouts.formats import convert, import_records, parse_reward_fields, rename_fields, without_rewards
from covgrad.rollouts.imports import record_mismatch, records_to_rollouts, require_mu_source, verification_warning
from covgrad.rollouts.inputs import check_context, check_unrewarded, max_positions
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
    compute_advantages,
    generate,
    mu_from_topk,
    recompute_sampler_logp,
    sampler_log_probs,
)

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
    "check_unrewarded",
    "compute_advantages",
    "convert",
    "generate",
    "group_batches",
    "import_records",
    "max_positions",
    "mismatch_metrics",
    "mu_from_topk",
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
