"""Integrations with training stacks: in-run statistics any trainer can call (``covgrad.integrations.inrun``) and
TRL's ``GRPOTrainer`` callbacks (``covgrad.integrations.trl``, optional extra ``trl``).

Names re-exported lazily (:mod:`covgrad.lazy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from covgrad.lazy import exports

if TYPE_CHECKING:
    from covgrad.integrations.inrun import InRunFolder, InRunStep
    from covgrad.integrations.trl import CovgradInRun, CovgradRecorder

_EXPORTS = {
    "CovgradInRun": "covgrad.integrations.trl",
    "CovgradRecorder": "covgrad.integrations.trl",
    "InRunFolder": "covgrad.integrations.inrun",
    "InRunStep": "covgrad.integrations.inrun",
}

__all__ = ["CovgradInRun", "CovgradRecorder", "InRunFolder", "InRunStep"]

__getattr__ = exports(__name__, _EXPORTS)
