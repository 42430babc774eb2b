"""Exact per-sample scores: the batched engine (``engine``) with its forward hooks (``hooks``), per-sample blocks
(``blocks``), first-call trace (``tracing``) and autograd self-check (``selfcheck``); its rules (``rules``,
``experts``), their binding to modules (``binding``) and op taps, centering under the policy or a sampler, the support
μ, the fold loop into moment state and the preflight check.

Names re-exported lazily (:mod:`covgrad.lazy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from covgrad.lazy import exports

if TYPE_CHECKING:
    from covgrad.scores.binding import folds_in_row_chunks, rule_for, writes_row_parts
    from covgrad.scores.blocks import chunk_rows, default_chunk_bytes
    from covgrad.scores.centering import (
        LogitGrad,
        MuRecord,
        SamplerCentering,
        policy_logit_grad,
        sampled_token_logp,
        score_logit_grad,
    )
    from covgrad.scores.engine import Cotangent, PerSampleGrads
    from covgrad.scores.fold import fold_batches
    from covgrad.scores.preflight import check_model
    from covgrad.scores.rules import FLATTENING_PARENTS, Rule, Slot, generic_rule, rmsnorm_rule
    from covgrad.scores.support_mu import gradient_error_factor, tail_summary
    from covgrad.scores.tracing import Binding, bind_rules

_EXPORTS = {
    "Binding": "covgrad.scores.tracing",
    "Cotangent": "covgrad.scores.engine",
    "FLATTENING_PARENTS": "covgrad.scores.rules",
    "LogitGrad": "covgrad.scores.centering",
    "MuRecord": "covgrad.scores.centering",
    "PerSampleGrads": "covgrad.scores.engine",
    "Rule": "covgrad.scores.rules",
    "SamplerCentering": "covgrad.scores.centering",
    "Slot": "covgrad.scores.rules",
    "bind_rules": "covgrad.scores.tracing",
    "check_model": "covgrad.scores.preflight",
    "chunk_rows": "covgrad.scores.blocks",
    "default_chunk_bytes": "covgrad.scores.blocks",
    "fold_batches": "covgrad.scores.fold",
    "folds_in_row_chunks": "covgrad.scores.binding",
    "generic_rule": "covgrad.scores.rules",
    "gradient_error_factor": "covgrad.scores.support_mu",
    "policy_logit_grad": "covgrad.scores.centering",
    "rmsnorm_rule": "covgrad.scores.rules",
    "rule_for": "covgrad.scores.binding",
    "sampled_token_logp": "covgrad.scores.centering",
    "score_logit_grad": "covgrad.scores.centering",
    "tail_summary": "covgrad.scores.support_mu",
    "writes_row_parts": "covgrad.scores.binding",
}

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

__getattr__ = exports(__name__, _EXPORTS)
