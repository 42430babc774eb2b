"""Integrations with training stacks: in-run statistics any trainer can call (``covgrad.integrations.inrun``; the
plain hook ``covgrad.integrations.torch``; on the trainer's FSDP2 ranks ``covgrad.integrations.ranks``) and TRL's
``GRPOTrainer`` and ``DistillationTrainer`` callbacks (``covgrad.integrations.trl``, optional extra ``trl``).

Names re-exported lazily (:mod:`covgrad.lazy`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from covgrad.lazy import exports

if TYPE_CHECKING:
    from covgrad.integrations.inrun import InRunFolder, InRunRegimeFolder, InRunStep
    from covgrad.integrations.ranks import RankInRunFolder, RankPlan, prepare_ranks
    from covgrad.integrations.torch import InRunHook
    from covgrad.integrations.trl import CovgradInRun, CovgradRecorder

_EXPORTS = {
    "CovgradInRun": "covgrad.integrations.trl",
    "CovgradRecorder": "covgrad.integrations.trl",
    "InRunFolder": "covgrad.integrations.inrun",
    "InRunHook": "covgrad.integrations.torch",
    "InRunRegimeFolder": "covgrad.integrations.inrun",
    "InRunStep": "covgrad.integrations.inrun",
    "RankInRunFolder": "covgrad.integrations.ranks",
    "RankPlan": "covgrad.integrations.ranks",
    "prepare_ranks": "covgrad.integrations.ranks",
}

__all__ = [
    "CovgradInRun",
    "CovgradRecorder",
    "InRunFolder",
    "InRunHook",
    "InRunRegimeFolder",
    "InRunStep",
    "RankInRunFolder",
    "RankPlan",
    "prepare_ranks",
]

__getattr__ = exports(__name__, _EXPORTS)
