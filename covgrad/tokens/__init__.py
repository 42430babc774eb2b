"""Token-level Fisher: its estimators (``fisher``), their backward of many logit cotangents from one forward
(``backward``), and the token study (``study``).

Names re-exported lazily (:mod:`covgrad.lazy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from covgrad.lazy import exports

if TYPE_CHECKING:
    from covgrad.tokens.backward import TokenBackward, repeated_batch
    from covgrad.tokens.fisher import candidates, head_forward, response_positions, token_fisher
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

_EXPORTS = {
    "BatchResult": "covgrad.tokens.study",
    "POSITION_ARRAYS": "covgrad.tokens.study",
    "StudyRecord": "covgrad.tokens.study",
    "TokenBackward": "covgrad.tokens.backward",
    "TokenStudy": "covgrad.tokens.study",
    "batch_bounds": "covgrad.tokens.study",
    "candidates": "covgrad.tokens.fisher",
    "draws": "covgrad.tokens.study",
    "head_forward": "covgrad.tokens.fisher",
    "lm_head_entry": "covgrad.tokens.study",
    "output_rows": "covgrad.tokens.study",
    "repeated_batch": "covgrad.tokens.backward",
    "resolve_modes": "covgrad.tokens.study",
    "response_positions": "covgrad.tokens.fisher",
    "row_names": "covgrad.tokens.study",
    "study_setup": "covgrad.tokens.study",
    "summarize": "covgrad.tokens.study",
    "token_fisher": "covgrad.tokens.fisher",
    "trace_names": "covgrad.tokens.study",
}

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

__getattr__ = exports(__name__, _EXPORTS)
