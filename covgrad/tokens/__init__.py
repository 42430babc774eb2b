"""Token-level Fisher: the per-token scores of the LM head, their backward, and the token study."""

from covgrad.tokens.fisher import (
    TokenBackward,
    candidates,
    head_forward,
    repeated_batch,
    response_positions,
    token_fisher,
)
from covgrad.tokens.study import (
    POSITION_ARRAYS,
    BatchResult,
    StudyRecord,
    TokenStudy,
    batch_bounds,
    draws,
    lm_head_entry,
    output_rows,
    resolve_modes,
    row_names,
    study_setup,
    summarize,
    trace_names,
)

__all__ = [
    "POSITION_ARRAYS",
    "BatchResult",
    "StudyRecord",
    "TokenBackward",
    "TokenStudy",
    "batch_bounds",
    "candidates",
    "draws",
    "head_forward",
    "lm_head_entry",
    "output_rows",
    "repeated_batch",
    "resolve_modes",
    "response_positions",
    "row_names",
    "study_setup",
    "summarize",
    "token_fisher",
    "trace_names",
]
