"""Token-level Fisher: its estimators (``fisher``), their backward of many logit cotangents from one forward
(``backward``), and the token study (``study``).

The names below are re-exported lazily (PEP 562): importing the package loads none of its modules, so
a caller that needs one engine (the GPU image: no pydantic, zarr or dask) pulls in only that module's imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

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


def __getattr__(name: str) -> object:
    """The re-exported ``name``, imported from its module on first use."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
