"""Exact per-sample scores: the batched engine (``persample``), its rules and op taps, centering under
the policy or a sampler, the support μ, the fold loop into moment state and the preflight check.
"""

from covgrad.scores.centering import LogitGrad, MuRecord, SamplerCentering, policy_logit_grad, sampled_token_logp
from covgrad.scores.fold import fold_batches
from covgrad.scores.persample import (
    Binding,
    Cotangent,
    PerSampleGrads,
    bind_rules,
    chunk_rows,
    default_chunk_bytes,
    score_logit_grad,
)
from covgrad.scores.preflight import check_model
from covgrad.scores.rules import (
    FLATTENING_PARENTS,
    Rule,
    Slot,
    folds_in_row_chunks,
    generic_rule,
    rmsnorm_rule,
    rule_for,
    writes_row_parts,
)
from covgrad.scores.support_mu import gradient_error_factor, tail_summary

__all__ = [
    "FLATTENING_PARENTS",
    "Binding",
    "Cotangent",
    "LogitGrad",
    "MuRecord",
    "PerSampleGrads",
    "Rule",
    "SamplerCentering",
    "Slot",
    "bind_rules",
    "check_model",
    "chunk_rows",
    "default_chunk_bytes",
    "fold_batches",
    "folds_in_row_chunks",
    "generic_rule",
    "gradient_error_factor",
    "policy_logit_grad",
    "rmsnorm_rule",
    "rule_for",
    "sampled_token_logp",
    "score_logit_grad",
    "tail_summary",
    "writes_row_parts",
]
